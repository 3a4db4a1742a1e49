"""Every SQL state change, one method per change, one transaction each.

The ticks, the queue, schedule changes, leases and reads are here; a run's life at the
worker (start, settle, heartbeats, the reaper) is :class:`~.runlife.RunLife`, which
:class:`Store` is made of too. Transitions are guarded by ``WHERE state = <expected>`` and
checked by row count, so a duplicate or late signal can never settle a run twice (SQLite
ignores ``FOR UPDATE``; correctness comes from the guards and the unique ``(schedule,
scheduled_for)`` key).

Lock order (PostgreSQL). Every transaction that locks rows of more than one kind, or several
rows of one kind, takes them in this order, so no two of them can wait for each other:

1. schedules (``boundedbeat_schedules``), by name;
2. runs (``boundedbeat_runs``), by id;
3. queue rows (``boundedbeat_queue``).

A schedule is found from its run without locking the run (a run's schedule never changes:
:meth:`~.runlife.RunLife.lock_schedule_of`). A lock taken with ``SKIP LOCKED`` never waits and
may break the order (the tick's due schedules and ``replace`` victims, the dispatcher's claim).
A worker's heartbeat row is written by its own process only, in a transaction of its own.
The places that take locks say "lock order" and refer here.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    Engine,
    Table,
    and_,
    delete,
    func,
    select,
    update,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ..core.alerts import Alert
from ..core.backfill import Backfilled, BackfillRefused, on_backfill, without_taken
from ..core.due import on_due
from ..core.enums import MissedTicks, RunState, StopReason
from ..core.exceptions import ScheduleEndedError, UnknownScheduleError
from ..core.messages import clip_error, message_options
from ..core.policy import Policy
from ..core.spec import Definition, EntrySpec
from ..core.ticks import (
    Emission,
    ScheduleState,
    TickOutcome,
    TriggerRefused,
    on_resume,
    on_trigger,
    resume_refusal,
    set_aside_until,
    stopped_as,
)
from .alertlog import take
from .bulk import insert_document, insert_many
from .claims import Claimed, claim, mark, unclaimed
from .definition_writes import (
    Reconciled,
    add_runtime_pg,
    chunks,
    insert_runtime,
    reconcile_config,
    remove_runtime_pg,
    runtime_row,
    update_runtime,
    update_runtime_pg,
)
from .faults import is_outage
from .locked import (
    SCHEDULES,
    TICK_LEAVES_OUT,
    HeldRows,
    driver_connection,
    driver_cursor,
    hold,
    hold_pg,
    light_select,
    pipeline,
    prefetch_definitions,
    write_changed,
    write_changed_driver,
)
from .row_state import apply_state, state_of, write_state
from .runs import _ACTIVE, SETTLED_CHANNEL, RunLife, Settled, elapsed_ms, not_before, runs_of
from .tables import IterationRow, LeaseRow, OutboxExpiredRow, QueueRow, RunRow, ScheduleRow

logger = logging.getLogger("celery_boundedbeat")

#: PostgreSQL NOTIFY channels: a run settled (payload: schedule name); a queue row was added;
#: a schedule's definition was added, changed or removed (payload: its name).
QUEUE_CHANNEL = "boundedbeat_queue"
SCHEDULES_CHANNEL = "boundedbeat_schedules"

#: The error of an active run settled ``revoked`` by ``remove_schedule(revoke_active=True)``.
REMOVED_WITH_REVOKE = "revoked: its schedule was removed (remove_schedule revoke_active)"
#: The error of an active run revoked to make room for a newer tick (``missed_ticks: "replace"``).
REPLACED = "revoked: replaced by the run of a newer tick (missed_ticks replace)"


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, kw_only=True, slots=True)
class EmittedRun:
    """A run written by a tick (for logs)."""

    id: str
    schedule: str
    scheduled_for: datetime
    drift_ms: int
    overlap: bool


@dataclass(kw_only=True, slots=True)
class TickResult:
    """What one tick transaction did."""

    emitted: list[EmittedRun] = field(default_factory=list)
    outcomes: dict[str, TickOutcome] = field(default_factory=dict)
    next_due_at: datetime | None = None
    #: The ``now`` the tick looked at: a row due after it fell due while the tick ran.
    now: datetime | None = None
    #: Due schedules whose definition could not be rebuilt, set aside (``set_aside_until``).
    unusable: list[str] = field(default_factory=list)
    #: Runs this tick settled ``revoked`` for ``replace``: the beat asks the workers to
    #: terminate them once the tick has committed.
    revoked: list[str] = field(default_factory=list)
    #: Due schedules whose own tick failed (name: error), set aside so the others go on.
    failed: dict[str, str] = field(default_factory=dict)


#: The queue columns an expired ``enqueue()`` message keeps (``boundedbeat_outbox_expired``).
_KEPT_WHEN_EXPIRED = ("task_id", "task", "args", "kwargs", "options", "enqueued_at", "attempts", "last_error")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpiredMessage:
    """An ``enqueue()`` message moved out of the queue unpublished (for the log)."""

    task_id: str
    task: str
    enqueued_at: datetime
    attempts: int
    last_error: str | None


def emission_rows(
    spec: EntrySpec,
    schedule: str,
    emission: Emission,
    now: datetime,
    expires_after: float | None,
    *,
    incarnation: str,
) -> tuple[dict[str, Any], dict[str, Any], EmittedRun]:
    """The run row, the queue row and the log record of one emitted run (``task_id`` = run id).

    The run carries the schedule's ``incarnation``: it settles onto that schedule only.
    """
    run_id = str(uuid.uuid4())
    run = {
        "id": run_id,
        "schedule": schedule,
        "incarnation": incarnation,
        "task": spec.task,
        "state": RunState.QUEUED.value,
        "scheduled_for": emission.scheduled_for,
        "enqueued_at": now,
        "drift_ms": emission.drift_ms,
    }
    queued = {
        "run_id": run_id,
        "task_id": run_id,
        "task": spec.task,
        "args": list(spec.args),
        "kwargs": dict(spec.kwargs),
        "options": message_options(
            spec.options,
            spec.policy,
            run_id,
            schedule,
            expires_after=expires_after,
            scheduled_for=emission.scheduled_for,
        ),
        "due_at": emission.scheduled_for,
        "enqueued_at": now,
        "attempts": 0,
    }
    emitted = EmittedRun(
        id=run_id,
        schedule=schedule,
        scheduled_for=emission.scheduled_for,
        drift_ms=emission.drift_ms,
        overlap=emission.overlap,
    )
    return run, queued, emitted


def record_outcome(
    row: Any,
    spec: EntrySpec,
    outcome: TickOutcome,
    now: datetime,
    expires_after: float | None,
    result: TickResult,
    run_rows: list[dict[str, Any]],
    queue_rows: list[dict[str, Any]],
) -> None:
    """Write a due schedule's decided outcome into its row and collect the runs it emits.

    ``row`` is a ``ScheduleRow`` or a :class:`~.held.Held` one: the caller writes it back.

    Backfilled runs are left out: :meth:`Store.tick` writes them first, guarded by the run key.
    """
    apply_state(row, outcome.state, now)
    result.outcomes[row.name] = outcome
    for emission in outcome.emit:
        if emission.backfilled:
            continue
        run, queued, emitted = emission_rows(
            spec, row.name, emission, now, expires_after, incarnation=row.incarnation
        )
        run_rows.append(run)
        queue_rows.append(queued)
        result.emitted.append(emitted)


#: :func:`_due` and :meth:`Store._next_due` as PostgreSQL text (for psycopg directly).
_PG_DUE = (
    "next_due_at <= %(now)s AND paused IS false AND stopped IS false "
    "ORDER BY next_due_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
)
_PG_NEXT_DUE = f"SELECT min(next_due_at) FROM {SCHEDULES.name} WHERE paused IS false AND stopped IS false"
_PG_NOTIFY_NEXT_DUE = f"SELECT ({_PG_NEXT_DUE}), pg_notify(%(c)s, '')"


def _due(now: datetime, limit: int) -> Any:
    """The tick's query: the due schedules, earliest first, skipping rows another transaction holds."""
    return (
        light_select(leave_out=TICK_LEAVES_OUT)
        .where(
            SCHEDULES.c.next_due_at <= now,
            SCHEDULES.c.paused.is_(False),
            SCHEDULES.c.stopped.is_(False),
        )
        .order_by(SCHEDULES.c.next_due_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def _replaceable(s: Session, row: Any, policy: Policy, state: ScheduleState) -> list[Any]:
    """The oldest active runs ``replace`` may revoke: ``(id, started_at, enqueued_at)``, all at most.

    Only runs of this incarnation of the schedule hold its slots: an earlier schedule's run
    of the same name is left alone.

    Locked, skipping rows another transaction holds: a run a worker is settling right now is
    left alone (its settle frees its slot once this tick commits); waiting for it could
    deadlock, as the settle waits for the schedule row this tick holds.
    """
    if policy.missed_ticks is not MissedTicks.REPLACE or state.active_runs == 0:
        return []
    query = (
        select(RunRow.id, RunRow.started_at, RunRow.enqueued_at)
        .where(runs_of(row.name, row.incarnation), RunRow.state.in_(_ACTIVE))
        .order_by(RunRow.scheduled_for)
        .limit(state.active_runs)
        .with_for_update(skip_locked=True)
    )
    return list(s.execute(query))


def _revoke_replaced(s: Session, victims: Sequence[Any], now: datetime) -> list[str]:
    """Settle ``victims`` ``revoked`` inside the tick: their slots and counters the tick decided.

    Unlike ``settle_run`` the schedule row is not touched here (:func:`~.ticks.on_due` already
    gave each slot to the new run and counted the run ``revoked``); a later report from the
    worker finds the run settled and changes nothing.
    """
    revoked: list[str] = []
    for run_id, started_at, enqueued_at in victims:
        finished = not_before(now, enqueued_at, started_at)
        elapsed = elapsed_ms(started_at, finished)
        done = s.execute(
            update(RunRow)
            .where(RunRow.id == run_id, RunRow.state.in_(_ACTIVE))
            .values(state=RunState.REVOKED.value, finished_at=finished, elapsed_ms=elapsed, error=REPLACED)
        )
        if done.rowcount:  # type: ignore[attr-defined]
            revoked.append(run_id)
        else:  # locked by this transaction: cannot happen; say so loudly if it ever does
            logger.error("celery_boundedbeat: run %s to replace was no longer active", run_id)
    if revoked:
        s.execute(delete(QueueRow).where(QueueRow.run_id.in_(revoked)))
    return revoked


class Store(RunLife):
    """The state database. Stateless apart from the engine; safe to share between threads."""

    def __init__(self, engine: Engine, *, failing_threshold: int = 1) -> None:
        self.engine = engine
        #: ``boundedbeat_failing_threshold``: a settle that makes the failure streak this long
        #: announces the schedule failing (:func:`~celery_boundedbeat.core.alerts.on_settled`).
        self.failing_threshold = failing_threshold
        self.is_postgres = engine.dialect.name == "postgresql"
        #: Without LISTEN/NOTIFY, completions are noticed by polling.
        self.is_sqlite_like = not self.is_postgres

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: commit on success, roll back on any error."""
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def _driver(self, *, one_statement: bool = False) -> Iterator[Any]:
        """A psycopg connection in a transaction of its own (PostgreSQL), for the statements
        the ORM made cost more than they do; the driver's errors come out as SQLAlchemy's
        (``sqlalchemy.exc.OperationalError`` and so on), as from every other call.

        ``one_statement``: the caller sends a single statement, a transaction by itself, so
        it goes in autocommit: one round trip where ``BEGIN``, it and ``COMMIT`` were three.
        """
        import psycopg

        try:
            if one_statement:
                with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    yield conn.connection.driver_connection
                return
            with self.engine.begin() as conn:
                yield conn.connection.driver_connection
        except psycopg.Error as exc:
            raise DBAPIError.instance(None, None, exc, psycopg.Error) from exc

    def _notify(self, session: Session, channel: str, payload: str = "") -> None:
        if self.is_postgres:
            with driver_cursor(session) as cur:  # the ORM's statement path cost more than the call
                cur.execute("SELECT pg_notify(%(c)s, %(p)s)", {"c": channel, "p": payload})

    # -- schedules -----------------------------------------------------------------

    def sync_config(
        self, definitions: Iterable[EntrySpec | Definition], now: datetime, rng: random.Random
    ) -> Reconciled:
        """Reconcile ``beat_schedule`` with the config rows (:func:`~.catalog.reconcile_config`)."""
        wanted = [d if isinstance(d, Definition) else Definition.of(d) for d in definitions]
        with self.session() as s:
            return reconcile_config(s, wanted, now, rng)

    def add_schedule(
        self,
        definition: Definition,
        now: datetime,
        rng: random.Random,
        *,
        paused: bool = False,
        stop_reason: StopReason | None = None,
    ) -> bool:
        """Add a runtime schedule; False (nothing changed) when the name exists already.

        On PostgreSQL a new name without runs is one statement (:func:`~.catalog.add_runtime_pg`).
        ``paused`` and ``stop_reason`` (an import) add it paused or stopped in the same
        transaction: a running beat never sees it running.
        """
        if self.is_postgres and not paused and stop_reason is None:
            with self._driver(one_statement=True) as driver:
                if add_runtime_pg(driver, definition, now, rng, SCHEDULES_CHANNEL):
                    return True
        with self.session() as s:
            added = insert_runtime(s, definition, now, rng, self.engine.dialect.name)
            if added and (paused or stop_reason is not None):
                row = s.get(ScheduleRow, definition.name, with_for_update=True)
                assert row is not None
                row.paused = paused
                if stop_reason is not None:
                    write_state(row, stopped_as(state_of(row), stop_reason))
            if added:
                self._notify(s, SCHEDULES_CHANNEL, definition.name)
            return added

    def set_stopped(self, name: str, reason: StopReason, now: datetime) -> bool:
        """Stop a schedule as an imported file says (ended or ``stop_schedule``); False if unknown."""
        with self.session() as s:
            row = s.get(ScheduleRow, name, with_for_update=True)
            if row is None:
                return False
            write_state(row, stopped_as(state_of(row), reason))
            row.updated_at = now
            self._notify(s, SCHEDULES_CHANNEL, name)
            return True

    def update_schedule(
        self, name: str, revise: Callable[[ScheduleRow], Definition], now: datetime, rng: random.Random
    ) -> None:
        """Change a runtime schedule to ``revise(row)``'s definition (:func:`~.catalog.update_runtime`)."""
        if self.is_postgres:
            with self._driver() as driver:
                update_runtime_pg(driver, name, revise, now, rng, SCHEDULES_CHANNEL)
            return
        with self.session() as s:
            if update_runtime(s, name, revise, now, rng):
                self._notify(s, SCHEDULES_CHANNEL, name)

    def remove_schedule(self, name: str, now: datetime, *, revoke_active: bool) -> list[str] | None:
        """Delete a runtime schedule (its runs stay); ``None`` when there is none of that name.

        With ``revoke_active`` its active runs settle ``revoked`` in the same transaction and
        their ids are returned, for the caller to revoke at the workers once this commits.
        On PostgreSQL, without it, a runtime schedule's removal is one statement.
        """
        if self.is_postgres and not revoke_active:
            with self._driver(one_statement=True) as driver:
                if remove_runtime_pg(driver, name, SCHEDULES_CHANNEL):
                    return []
        with self.session() as s:
            try:
                held = runtime_row(s, name)
            except UnknownScheduleError:
                return None
            revoked: list[str] = []
            if revoke_active:
                # This schedule's runs (an earlier one's of the name run on). Lock order (module
                # docstring): the schedule is held, its runs go by id.
                incarnation = held.rows[name].incarnation
                active = s.scalars(
                    select(RunRow.id)
                    .where(runs_of(name, incarnation), RunRow.state.in_(_ACTIVE))
                    .order_by(RunRow.id)
                ).all()
                for run_id in active:
                    if self.settle_in(s, run_id, RunState.REVOKED, now=now, error=REMOVED_WITH_REVOKE):
                        revoked.append(run_id)
            s.execute(delete(ScheduleRow).where(ScheduleRow.name == name))
            self._notify(s, SCHEDULES_CHANNEL, name)
            return revoked

    def tick(
        self,
        specs: Mapping[str, EntrySpec] | Callable[[Any], EntrySpec | None],
        now: datetime,
        rng: random.Random,
        limit: int,
        *,
        expires_after: float | None = None,
    ) -> TickResult:
        """Handle every due schedule in one transaction: reserve slots, write runs and queue rows.

        ``specs`` gives each due row's schedule: a beat passes a resolver that rebuilds a
        schedule from its row when its cached copy is older than the row's ``version``.
        ``expires_after`` (seconds after publishing) makes a message nobody started in time
        expire at the worker instead of running late after its run was settled ``rejected``.

        A batch that fails on its data (not an outage) is done again one schedule per
        transaction (:meth:`_tick_one_by_one`): one bad row cannot stop every other schedule.
        """
        resolve = specs if callable(specs) else (lambda row: specs.get(row.name))
        try:
            return self._tick_batch(resolve, now, rng, limit, expires_after)
        except Exception as exc:
            if is_outage(exc):
                raise
            # INFO: the beat names each schedule that fails on its own, once (ERROR).
            logger.info(
                "celery_boundedbeat: a tick batch failed (%s: %s); ticking its schedules one by one",
                type(exc).__name__,
                clip_error(str(exc)),
            )
        return self._tick_one_by_one(resolve, now, rng, limit, expires_after)

    def _tick_one_by_one(
        self,
        resolve: Callable[[Any], EntrySpec | None],
        now: datetime,
        rng: random.Random,
        limit: int,
        expires_after: float | None,
    ) -> TickResult:
        """Each due schedule in a transaction of its own; one that fails is set aside.

        The failing row is moved out of the due range for a while (:func:`~.ticks.set_aside_until`)
        by a write that reads nothing else of it, and reported in ``TickResult.failed``; every
        other schedule is ticked as usual.
        """
        with self.session() as s:
            names = list(
                s.scalars(
                    select(ScheduleRow.name)
                    .where(
                        ScheduleRow.next_due_at <= now,
                        ScheduleRow.paused.is_(False),
                        ScheduleRow.stopped.is_(False),
                    )
                    .order_by(ScheduleRow.next_due_at)
                    .limit(limit)
                )
            )
        result = TickResult(now=now)
        for name in names:
            try:
                one = self._tick_batch(resolve, now, rng, 1, expires_after, only=name)
            except Exception as exc:
                if is_outage(exc):
                    raise
                result.failed[name] = f"{type(exc).__name__}: {clip_error(str(exc))}"
                with self.session() as s:
                    s.execute(  # still due: a row changed meanwhile keeps its own due time
                        update(ScheduleRow)
                        .where(ScheduleRow.name == name, ScheduleRow.next_due_at <= now)
                        .values(next_due_at=set_aside_until(now))
                    )
                continue
            result.emitted.extend(one.emitted)
            result.outcomes.update(one.outcomes)
            result.unusable.extend(one.unusable)
            result.revoked.extend(one.revoked)
        result.next_due_at = self.next_due_at()
        return result

    def _tick_batch(
        self,
        resolve: Callable[[Any], EntrySpec | None],
        now: datetime,
        rng: random.Random,
        limit: int,
        expires_after: float | None,
        *,
        only: str | None = None,
    ) -> TickResult:
        """One tick transaction over the due rows (``only``: that one schedule, if due)."""
        result = TickResult(now=now)
        with self.session() as s:
            run_rows: list[dict[str, Any]] = []
            queue_rows: list[dict[str, Any]] = []
            if self.is_postgres:
                where, params = _PG_DUE, {"now": now, "limit": limit}
                if only is not None:
                    where, params = "name = %(name)s AND " + where, {**params, "name": only}
                with pipeline(driver_connection(s)):  # BEGIN goes with the query
                    held = hold_pg(s, where, params, leave_out=TICK_LEAVES_OUT)
            else:
                query = _due(now, limit)
                held = hold(s, query if only is None else query.where(SCHEDULES.c.name == only))
            prefetch_definitions(s, held, resolve)
            for row in held:
                spec = resolve(row)
                if spec is None:
                    # Its stored definition cannot be rebuilt: out of the due range for a while,
                    # so it neither fills every batch nor keeps the beat looking at once.
                    row.next_due_at = set_aside_until(now)
                    result.unusable.append(row.name)
                    continue
                state = state_of(row)
                victims = _replaceable(s, row, spec.policy, state)
                outcome = on_due(spec.policy, spec.timing, state, now, rng, revocable=len(victims))
                if outcome.revoke:
                    result.revoked.extend(_revoke_replaced(s, victims[: outcome.revoke], now))
                    row.last_finished_at = now
                if any(e.backfilled for e in outcome.emit):
                    outcome = self._write_backfilled(
                        s, spec, row, outcome, now, expires_after, result, queue_rows
                    )
                record_outcome(row, spec, outcome, now, expires_after, result, run_rows, queue_rows)
            write = self._write_tick_pg if self.is_postgres else self._write_tick
            result.next_due_at = write(s, held, run_rows, queue_rows)
        return result

    def _write_tick(
        self, s: Session, held: HeldRows, run_rows: list[dict[str, Any]], queue_rows: list[dict[str, Any]]
    ) -> datetime | None:
        """A tick's writes, then the next due time it leaves (SQLite and the like)."""
        write_changed(s, held)
        insert_many(s, cast(Table, RunRow.__table__), run_rows)
        insert_many(s, cast(Table, QueueRow.__table__), queue_rows)
        return self._next_due(s)

    def _write_tick_pg(
        self, s: Session, held: HeldRows, run_rows: list[dict[str, Any]], queue_rows: list[dict[str, Any]]
    ) -> datetime | None:
        """A tick's writes and its look at the next due time, in one round trip: returns that time.

        On a machine busy with other work (a thousand schedule changes a second), each round
        trip of a tick was a wait for a CPU, on both sides, and the tick's nine of them
        stretched it, and the drift of every run due while it ran, several times over.
        """
        import psycopg  # the PostgreSQL extra's driver

        conn = driver_connection(s)
        try:
            with pipeline(conn), conn.cursor() as cur:
                write_changed_driver(conn, held)
                insert_document(cur, cast(Table, RunRow.__table__), run_rows)
                if queue_rows:
                    insert_document(cur, cast(Table, QueueRow.__table__), queue_rows)
                    cur.execute(_PG_NOTIFY_NEXT_DUE, {"c": QUEUE_CHANNEL})
                else:
                    cur.execute(_PG_NEXT_DUE)
                found = cur.fetchone()[0]
        except psycopg.Error as exc:  # as SQLAlchemy's (IntegrityError and so on), as elsewhere
            raise DBAPIError.instance(None, None, exc, psycopg.Error) from exc
        return None if found is None else found.astimezone(UTC)

    def _write_backfilled(
        self,
        s: Session,
        spec: EntrySpec,
        row: Any,
        outcome: TickOutcome,
        now: datetime,
        expires_after: float | None,
        result: TickResult,
        queue_rows: list[dict[str, Any]],
    ) -> TickOutcome:
        """Insert the backfilled runs of one outcome, each only if its grid time has no run yet.

        ``ON CONFLICT DO NOTHING`` on the unique ``(schedule, scheduled_for)`` key decides, in
        the write itself: a run emitted for that time by anyone, at any moment, wins. A time
        found taken gives its slot back (:func:`~.backfill.without_taken`). The queue rows of
        the runs written join ``queue_rows``, inserted with the tick's others.
        """
        runs = cast(Table, RunRow.__table__)
        name = row.name
        taken: list[datetime] = []
        for emission in outcome.emit:
            if not emission.backfilled:
                continue
            run, queue_row, emitted = emission_rows(
                spec, name, emission, now, expires_after, incarnation=row.incarnation
            )
            inserted = s.execute(
                self._insert_if_free(runs).values(**run).returning(runs.c.id)
            ).scalar_one_or_none()
            if inserted is None:
                taken.append(emission.scheduled_for)
                continue
            queue_rows.append(queue_row)
            result.emitted.append(emitted)
        if taken:
            logger.info(
                "celery_boundedbeat: %s: %d backfilled grid time(s) already had a run", name, len(taken)
            )
        return without_taken(outcome, taken, now)

    def _insert_if_free(self, table: Table) -> Any:
        """``INSERT ... ON CONFLICT (schedule, scheduled_for) DO NOTHING`` for this dialect."""
        if self.is_postgres:
            from sqlalchemy.dialects.postgresql import insert as dialect_insert
        else:
            from sqlalchemy.dialects.sqlite import insert as dialect_insert  # type: ignore[assignment]
        return dialect_insert(table).on_conflict_do_nothing(index_elements=["schedule", "scheduled_for"])

    def _next_due(self, s: Session) -> datetime | None:
        if self.is_postgres:  # once per tick: the ORM's statement cost more than the lookup
            with driver_cursor(s) as cur:
                cur.execute(_PG_NEXT_DUE)
                (found,) = cur.fetchone()
            return None if found is None else found.astimezone(UTC)
        return s.scalar(
            select(func.min(ScheduleRow.next_due_at)).where(
                ScheduleRow.paused.is_(False), ScheduleRow.stopped.is_(False)
            )
        )

    def next_due_at(self) -> datetime | None:
        """When the earliest schedule is due (an index lookup, not a scan)."""
        with self.session() as s:
            return self._next_due(s)

    def set_paused(self, name: str, paused: bool, now: datetime, *, replay: bool = False) -> bool:
        """Pause or resume; resume also lifts ``stop_schedule()``. False if unknown.

        ``replay`` (resume only) hands the ticks passed while paused to ``missed_ticks``.
        """
        with self.session() as s:
            row = s.get(ScheduleRow, name, with_for_update=True)
            if row is None:
                return False
            if not paused:
                refused = resume_refusal(state_of(row))
                if refused is not None:
                    raise ScheduleEndedError(name, refused)
                policy = Policy.from_json(row.policy)
                write_state(row, on_resume(policy, state_of(row), now, period=row.period, replay=replay))
                row.pause_reason = None
            row.paused = paused
            row.updated_at = now
            self._notify(s, SETTLED_CHANNEL, name)
            return True

    def trigger(self, name: str, now: datetime) -> datetime | TriggerRefused | None:
        """Queue one extra run now, apart from the grid; beat starts it as soon as a slot is free.

        Returns the run's ``scheduled_for``, the refusal (paused, stopped, too many queued:
        :func:`~celery_boundedbeat.core.ticks.on_trigger` decides), or ``None`` for an unknown name.
        The newest run's time is read so that a trigger never reuses a ``scheduled_for``.
        """
        with self.session() as s:
            row = s.get(ScheduleRow, name, with_for_update=True)
            if row is None:
                return None
            last_run_at = s.scalar(select(func.max(RunRow.scheduled_for)).where(RunRow.schedule == name))
            decided = on_trigger(state_of(row), now, paused=row.paused, last_run_at=last_run_at)
            if isinstance(decided, TriggerRefused):
                return decided
            apply_state(row, decided.state, now)
            self._notify(s, SETTLED_CHANNEL, name)
            return decided.scheduled_for

    def backfill(
        self,
        name: str,
        start: datetime,
        end: datetime,
        now: datetime,
        resolve: Callable[[ScheduleRow], EntrySpec],
    ) -> Backfilled | BackfillRefused | None:
        """Queue the grid times in ``[start, end]`` that have no run (``None``: unknown name).

        :func:`~celery_boundedbeat.core.backfill.on_backfill` decides from the row and the run
        times already in the range; the beat emits the queued times as slots free, each
        written only if its run key is still free (:meth:`_write_backfilled`).
        """
        with self.session() as s:
            row = s.get(ScheduleRow, name, with_for_update=True)
            if row is None:
                return None
            spec = resolve(row)
            run_times = s.scalars(
                select(RunRow.scheduled_for).where(
                    RunRow.schedule == name, RunRow.scheduled_for >= start, RunRow.scheduled_for <= end
                )
            ).all()
            decided = on_backfill(
                spec.policy,
                spec.timing,
                state_of(row),
                start,
                end,
                now,
                paused=row.paused,
                run_times=run_times,
                kind=str((row.timing or {}).get("kind", "interval")),
            )
            if isinstance(decided, Backfilled) and decided.queued:
                apply_state(row, decided.state, now)
                self._notify(s, SETTLED_CHANNEL, name)
            return decided

    # -- queue -----------------------------------------------------------------------

    def claim_batch(self, claimer: str, now: datetime, limit: int, claim_timeout: float) -> list[Claimed]:
        """Claim up to ``limit`` unclaimed (or abandoned) rows, oldest due first.

        PostgreSQL: one statement (``FOR UPDATE SKIP LOCKED`` picks, ``UPDATE ... RETURNING``
        claims), so concurrent dispatchers never claim the same row.
        """
        with self.engine.begin() as conn:
            return claim(conn, claimer, now, limit, claim_timeout, postgres=self.is_postgres)

    def mark_published(self, claimer: str, rows: Sequence[Claimed], now: datetime) -> None:
        """The broker accepted these: stamp ``published_at`` once, drop them from the queue."""
        self.mark_and_claim(claimer, rows, now, 0, 0.0)

    def mark_and_claim(
        self, claimer: str, done: Sequence[Claimed], now: datetime, limit: int, claim_timeout: float
    ) -> list[Claimed]:
        """``mark_published(done)`` and ``claim_batch`` in one transaction.

        The dispatcher does both between two batches; one commit instead of two halves the
        round trips and fsyncs per batch. Marking goes first (runs, then queue rows: the lock
        order of ``start_run``).
        """
        if not done and limit <= 0:
            return []
        with self.engine.begin() as conn:
            if done:
                mark(conn, claimer, done, now, postgres=self.is_postgres)
            return (
                claim(conn, claimer, now, limit, claim_timeout, postgres=self.is_postgres)
                if limit > 0
                else []
            )

    def release_claims(self, claimer: str, rows: Sequence[Claimed], error: str) -> None:
        """Put rows back for the next attempt (the broker refused them)."""
        if not rows:
            return
        with self.session() as s:
            s.execute(
                update(QueueRow)
                .where(QueueRow.id.in_([r.id for r in rows]), QueueRow.claimed_by == claimer)
                .values(claimed_by=None, claimed_until=None, last_error=clip_error(error))
            )

    def reject_unpublished(self, now: datetime, publish_timeout: float, rng: random.Random) -> list[Settled]:
        """Runs still queued past the publish limit settle ``rejected`` and leave the queue.

        Each stale row is taken in the transaction that settles its run, and only while no
        dispatcher holds a live claim on it and its run is still ``queued``: a row another
        dispatcher claimed or published since it was picked is left alone.
        """
        picked = [row for row in self._stale_rows(now, publish_timeout) if row.run_id is not None]
        return self._reject_rows(picked, now, publish_timeout, rng)

    def drop_stale(
        self, now: datetime, publish_timeout: float, rng: random.Random
    ) -> tuple[list[Settled], list[ExpiredMessage]]:
        """The dispatcher's look for rows unpublished past the publish limit: runs settle
        ``rejected`` (:meth:`reject_unpublished`), ``enqueue()`` messages are kept aside
        (:meth:`expire_outbox`). One read when there is none of either, as on every idle drain."""
        stale = self._stale_rows(now, publish_timeout)
        runs = [row for row in stale if row.run_id is not None]
        rejected = self._reject_rows(runs, now, publish_timeout, rng) if runs else []
        expired = self.expire_outbox(now, publish_timeout) if len(runs) < len(stale) else []
        return rejected, expired

    def _stale_rows(self, now: datetime, publish_timeout: float) -> list[Any]:
        """Up to 1,000 unclaimed queue rows (``id``, ``run_id``) enqueued before the publish limit."""
        cutoff = now - timedelta(seconds=publish_timeout)
        with self.session() as s:
            return list(
                s.execute(
                    select(QueueRow.id, QueueRow.run_id)
                    .where(QueueRow.enqueued_at < cutoff, unclaimed(now))
                    .limit(1000)
                )
            )

    def _reject_rows(
        self, picked: Sequence[Any], now: datetime, publish_timeout: float, rng: random.Random
    ) -> list[Settled]:
        error = f"not published within boundedbeat_publish_timeout ({publish_timeout:g} s)"
        settled: list[Settled] = []
        for row in picked:
            with self.session() as s:
                done = self._reject_stale_row(s, row.id, row.run_id, now=now, error=error, rng=rng)
            if done:
                settled.append(done)
        return settled

    def _reject_stale_row(
        self, s: Session, queue_id: int, run_id: str | None, *, now: datetime, error: str, rng: random.Random
    ) -> Settled | None:
        """Take one stale queue row and settle its run ``rejected``, both guarded (schedule, run,
        then queue: the lock order in the module docstring)."""
        if run_id is not None:
            self.lock_schedule_of(s, run_id)
            state = s.scalar(select(RunRow.state).where(RunRow.id == run_id).with_for_update())
            if state != RunState.QUEUED.value:
                return None
        taken = s.execute(delete(QueueRow).where(QueueRow.id == queue_id, unclaimed(now)))
        if not taken.rowcount or run_id is None:  # type: ignore[attr-defined]
            return None  # claimed meanwhile
        return self.settle_in(
            s, run_id, RunState.REJECTED, now=now, error=error, rng=rng, expect=[RunState.QUEUED]
        )

    def expire_outbox(self, now: datetime, publish_timeout: float) -> list[ExpiredMessage]:
        """``enqueue()`` rows unpublished past the publish limit move to ``boundedbeat_outbox_expired``.

        The queue row is taken (guarded: no live claim, still there) and kept whole in the same
        transaction, so a message is either still queued or kept, never neither; it leaves
        the queue so that a message the broker keeps refusing stops holding the others back.
        """
        cutoff = now - timedelta(seconds=publish_timeout)
        queue = cast(Table, QueueRow.__table__)
        with self.session() as s:
            picked = select(QueueRow.id).where(
                QueueRow.run_id.is_(None), QueueRow.enqueued_at < cutoff, unclaimed(now)
            )
            taken = s.execute(
                delete(queue)
                .where(
                    queue.c.id.in_(picked.limit(1000).scalar_subquery()),
                    queue.c.run_id.is_(None),
                    unclaimed(now),
                )
                .returning(*(queue.c[k] for k in _KEPT_WHEN_EXPIRED))
            ).all()
            if not taken:
                return []
            kept = [{**row._asdict(), "expired_at": now} for row in taken]
            insert_many(s, cast(Table, OutboxExpiredRow.__table__), kept)
        return [
            ExpiredMessage(
                task_id=row.task_id,
                task=row.task,
                enqueued_at=row.enqueued_at,
                attempts=row.attempts,
                last_error=row.last_error,
            )
            for row in taken
        ]

    # -- runs: retention and alerts (a run's life at the worker: :mod:`~.runlife`) --------

    def purge(self, older_than: datetime, batch: int = 1000) -> int:
        """Delete settled runs finished before ``older_than``, in small batches."""
        total = 0
        while True:
            with self.session() as s:
                ids = list(
                    s.scalars(
                        select(RunRow.id)
                        .where(RunRow.finished_at < older_than, RunRow.state.not_in(_ACTIVE))
                        .limit(batch)
                    )
                )
                if not ids:
                    return total
                s.execute(delete(RunRow).where(RunRow.id.in_(ids)))
                total += len(ids)

    def take_alerts(self) -> list[Alert]:
        """The oldest alerts to send, removed in their own committed transaction."""
        return take(self.engine)

    # -- leases --------------------------------------------------------------------

    def acquire_lease(self, name: str, holder: str, now: datetime, ttl: float) -> bool:
        """Take or renew the lease if it is free, expired, or already ours."""
        expires = now + timedelta(seconds=ttl)
        with self.session() as s:
            row = s.get(LeaseRow, name, with_for_update=True)
            if row is None:
                s.add(LeaseRow(name=name, holder=holder, acquired_at=now, renewed_at=now, expires_at=expires))
                try:
                    s.flush()
                except Exception:
                    return False
                return True
            if row.holder == holder:
                row.renewed_at = now
                row.expires_at = expires
                return True
            if row.expires_at <= now:
                row.holder = holder
                row.acquired_at = now
                row.renewed_at = now
                row.expires_at = expires
                return True
            return False

    def release_lease(self, name: str, holder: str) -> None:
        with self.session() as s:
            s.execute(delete(LeaseRow).where(and_(LeaseRow.name == name, LeaseRow.holder == holder)))

    def lease_holder(self, name: str, now: datetime) -> tuple[str, datetime] | None:
        with self.session() as s:
            row = s.get(LeaseRow, name)
            if row is None or row.expires_at <= now:
                return None
            return row.holder, row.expires_at

    def record_iteration(
        self, loop: str, holder: str, started: datetime, finished: datetime, error: str | None
    ) -> None:
        with self.session() as s:
            s.add(
                IterationRow(loop=loop, holder=holder, started_at=started, finished_at=finished, error=error)
            )

    # -- reads -----------------------------------------------------------------------

    def schedule_names(self) -> set[str]:
        """The name of every schedule (the primary key alone: an index-only read)."""
        with self.session() as s:
            return set(s.scalars(select(ScheduleRow.name)))

    def schedules(self, names: Sequence[str] | None = None) -> list[ScheduleRow]:
        with self.session() as s:
            if names is None:
                return list(s.scalars(select(ScheduleRow).order_by(ScheduleRow.name)))
            found: list[ScheduleRow] = []
            for part in chunks(list(names)):
                found.extend(s.scalars(select(ScheduleRow).where(ScheduleRow.name.in_(part))))
            return sorted(found, key=lambda r: r.name)

    def runs(
        self,
        *,
        name: str | None = None,
        limit: int = 100,
        state: str | None = None,
        since: datetime | None = None,
    ) -> list[RunRow]:
        with self.session() as s:
            query = (
                select(RunRow).order_by(RunRow.enqueued_at.desc(), RunRow.scheduled_for.desc()).limit(limit)
            )
            if name is not None:
                query = query.where(RunRow.schedule == name)
            if state is not None:
                query = query.where(RunRow.state == state)
            if since is not None:
                query = query.where(RunRow.enqueued_at >= since)
            return list(s.scalars(query))

    def run(self, run_id: str) -> RunRow | None:
        with self.session() as s:
            return s.get(RunRow, run_id)
