"""The tick transaction: every due schedule decided and its runs and queue rows written, in one go.

:meth:`~.store.Store.tick` is this module's :func:`tick`; a prepared tick
(:mod:`~celery_boundedbeat.beat.prepared`) decides and records its schedules with the same
:func:`record_outcome`. Lock order: the module docstring of :mod:`.store`.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import Table, delete, select, update
from sqlalchemy.orm import Session

from ..core.backfill import without_taken
from ..core.due import on_due
from ..core.enums import MissedTicks, RunState
from ..core.messages import clip_error, message_options
from ..core.policy import Policy
from ..core.spec import EntrySpec
from ..core.ticks import Emission, ScheduleState, TickOutcome, set_aside_until
from .bulk import insert_document
from .database import Database
from .driver import Driver, Sql
from .faults import is_outage
from .locked import SCHEDULES, TICK_LEAVES_OUT, HeldRows, hold, prefetch_definitions, write_changed
from .row_state import apply_state, state_of
from .runs import _ACTIVE, elapsed_ms, not_before, runs_of
from .tables import QueueRow, RunRow, ScheduleRow

logger = logging.getLogger("celery_boundedbeat")

#: PostgreSQL NOTIFY channel: a queue row was added.
QUEUE_CHANNEL = "boundedbeat_queue"
#: The error of an active run revoked to make room for a newer tick (``missed_ticks: "replace"``).
REPLACED = "revoked: replaced by the run of a newer tick (missed_ticks replace)"


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
        "attempt": emission.attempt,
        "retry_of": emission.retry_of,
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


@dataclass(frozen=True, slots=True)
class Share:
    """The partitions a beat ticks (``boundedbeat_partitions`` > 1): ``mine`` of ``count``."""

    count: int
    mine: tuple[int, ...]
    #: Whether a tick that queued runs wakes every dispatcher (``NOTIFY``). A beat whose own
    #: dispatcher publishes them wakes that one directly: with several beats, each tick
    #: otherwise woke every beat's dispatcher into a claim that mostly found nothing.
    wake_dispatchers: bool = True

    def params(self) -> dict[str, Any]:
        return {"nparts": self.count, "parts": list(self.mine)}


#: The schedules of the beat's partitions (:class:`Share`), as a clause in front of a condition.
IN_SHARE = Sql(
    "(slot %% %(nparts)s) = ANY(CAST(%(parts)s AS int[])) AND ",
    sqlite="(slot % :nparts) IN (SELECT value FROM json_each(:parts)) AND ",
)


def _within(sql: Sql, share: Share | None, params: dict[str, Any]) -> tuple[Sql, dict[str, Any]]:
    """``sql`` (a condition) limited to the share's partitions, with their parameters."""
    if share is None:
        return sql, params
    return sql.after(IN_SHARE), {**params, **share.params()}


#: The due schedules, earliest first.
_DUE = "next_due_at <= %(now)s AND paused IS false AND stopped IS false ORDER BY next_due_at LIMIT %(limit)s"
#: The tick's query: the due schedules, skipping rows another transaction holds (SQLite has one
#: writer, whose transaction holds every row it reads).
DUE = Sql(_DUE + " FOR UPDATE SKIP LOCKED", sqlite=_DUE)
_NEXT_DUE = f"SELECT min(next_due_at) FROM {SCHEDULES.name} WHERE paused IS false AND stopped IS false"
#: The earliest due time; a tick that queued runs also wakes the dispatchers (PostgreSQL).
NEXT_DUE = Sql(_NEXT_DUE)
_NOTIFY_NEXT_DUE = Sql(f"SELECT ({_NEXT_DUE}), pg_notify(%(c)s, '')", sqlite=_NEXT_DUE)


@cache
def _next_due_sql(shared: bool, notify: bool) -> Sql:
    """:data:`NEXT_DUE` (``notify``: with the dispatchers' wake-up), in a share if ``shared``."""
    if not shared:
        return _NOTIFY_NEXT_DUE if notify else NEXT_DUE
    where = Sql("paused IS false AND stopped IS false").after(IN_SHARE)
    inner = where.prefixed(f"SELECT min(next_due_at) FROM {SCHEDULES.name} WHERE ")
    if not notify:
        return inner
    return Sql(f"SELECT ({inner.postgresql}), pg_notify(%(c)s, '')", sqlite=inner.sqlite or inner.postgresql)


_DUE_AT = (SCHEDULES.c.next_due_at,)
RUNS = cast(Table, RunRow.__table__)
QUEUE = cast(Table, QueueRow.__table__)


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


def tick(
    db: Database,
    specs: Mapping[str, EntrySpec] | Callable[[Any], EntrySpec | None],
    now: datetime,
    rng: random.Random,
    limit: int,
    *,
    expires_after: float | None = None,
    share: Share | None = None,
) -> TickResult:
    """Handle every due schedule in one transaction: reserve slots, write runs and queue rows.

    ``specs`` gives each due row's schedule: a beat passes a resolver that rebuilds a
    schedule from its row when its cached copy is older than the row's ``version``.
    ``expires_after`` (seconds after publishing) makes a message nobody started in time
    expire at the worker instead of running late after its run was settled ``rejected``.

    A batch that fails on its data (not an outage) is done again one schedule per
    transaction (:meth:`_tick_one_by_one`): one bad row cannot stop every other schedule.
    ``share``: only the schedules of these partitions (partitioned beats), due or next due.
    """
    resolve = specs if callable(specs) else (lambda row: specs.get(row.name))
    try:
        return _tick_batch(db, resolve, now, rng, limit, expires_after, share=share)
    except Exception as exc:
        if is_outage(exc):
            raise
        # INFO: the beat names each schedule that fails on its own, once (ERROR).
        logger.info(
            "celery_boundedbeat: a tick batch failed (%s: %s); ticking its schedules one by one",
            type(exc).__name__,
            clip_error(str(exc)),
        )
    return _tick_one_by_one(db, resolve, now, rng, limit, expires_after, share)


def _tick_one_by_one(
    db: Database,
    resolve: Callable[[Any], EntrySpec | None],
    now: datetime,
    rng: random.Random,
    limit: int,
    expires_after: float | None,
    share: Share | None = None,
) -> TickResult:
    """Each due schedule in a transaction of its own; one that fails is set aside.

    The failing row is moved out of the due range for a while (:func:`~.ticks.set_aside_until`)
    by a write that reads nothing else of it, and reported in ``TickResult.failed``; every
    other schedule is ticked as usual.
    """
    with db.session() as s:
        where, params = _within(Sql(_DUE), share, {"now": now, "limit": limit})
        due_names = where.prefixed(f"SELECT name FROM {SCHEDULES.name} WHERE ")
        names = [name for (name,) in Driver.of(s).rows(due_names, params)]
    result = TickResult(now=now)
    for name in names:
        try:
            one = _tick_batch(db, resolve, now, rng, 1, expires_after, only=name, share=share)
        except Exception as exc:
            if is_outage(exc):
                raise
            result.failed[name] = f"{type(exc).__name__}: {clip_error(str(exc))}"
            with db.session() as s:
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
    result.next_due_at = next_due_at(db, share)
    return result


def _tick_batch(
    db: Database,
    resolve: Callable[[Any], EntrySpec | None],
    now: datetime,
    rng: random.Random,
    limit: int,
    expires_after: float | None,
    *,
    only: str | None = None,
    share: Share | None = None,
) -> TickResult:
    """One tick transaction over the due rows (``only``: that one schedule, if due)."""
    result = TickResult(now=now)
    with db.session() as s:
        driver = Driver.of(s)
        due, params = _within(DUE, share, {"now": now, "limit": limit})
        if only is not None:
            due, params = due.prefixed("name = %(name)s AND "), {**params, "name": only}
        with driver.pipeline():  # BEGIN goes with the query
            held = hold(s, due, params, leave_out=TICK_LEAVES_OUT)
        prefetch_definitions(s, held, resolve)
        decided = decide_due(s, held, resolve, now, rng, expires_after, result)
        result.next_due_at = _write_tick(driver, held, decided, share)
    return result


@dataclass(kw_only=True, slots=True)
class Decided:
    """The rows a tick writes besides its held schedules: its runs and their queue rows."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    queue: list[dict[str, Any]] = field(default_factory=list)


def decide_due(
    s: Session,
    held: HeldRows,
    resolve: Callable[[Any], EntrySpec | None],
    now: datetime,
    rng: random.Random,
    expires_after: float | None,
    result: TickResult,
    *,
    keep: Callable[[ScheduleState, TickOutcome], bool] | None = None,
) -> Decided:
    """Decide each held due schedule as of ``now`` and record its outcome on its row (written
    back by the caller); the runs it emits are returned, to be written with the rows.

    ``keep`` (a prepared tick, decided ahead of ``now``: :mod:`~celery_boundedbeat.beat.prepared`)
    records only the outcomes it keeps, and leaves a schedule it cannot rebuild to the tick at
    ``now``; no run is revoked for ``replace`` then. Otherwise a schedule that cannot be rebuilt
    is set aside (:func:`~.ticks.set_aside_until`), reported in ``result.unusable``.
    """
    decided = Decided()
    for row in held:
        spec = resolve(row)
        if spec is None:
            if keep is None:
                # Its stored definition cannot be rebuilt: out of the due range for a while,
                # so it neither fills every batch nor keeps the beat looking at once.
                row.next_due_at = set_aside_until(now)
                result.unusable.append(row.name)
            continue
        state = state_of(row)
        victims = [] if keep is not None else _replaceable(s, row, spec.policy, state)
        outcome = on_due(spec.policy, spec.timing, state, now, rng, revocable=len(victims))
        if keep is not None and not keep(state, outcome):
            continue  # locked but untouched: decided by the tick at ``now``
        if outcome.revoke:
            result.revoked.extend(_revoke_replaced(s, victims[: outcome.revoke], now))
            row.last_finished_at = now
        if any(e.backfilled for e in outcome.emit):
            outcome = _write_backfilled(s, spec, row, outcome, now, expires_after, result, decided.queue)
        record_outcome(row, spec, outcome, now, expires_after, result, decided.runs, decided.queue)
    return decided


def _write_tick(
    driver: Driver, held: HeldRows, decided: Decided, share: Share | None = None
) -> datetime | None:
    """A tick's writes and its look at the next due time, in one round trip: returns that time.

    On a machine busy with other work (a thousand schedule changes a second), each round
    trip of a tick was a wait for a CPU, on both sides, and the tick's nine of them
    stretched it, and the drift of every run due while it ran, several times over. (SQLite
    runs the same statements, locally.)
    """
    with driver.pipeline():
        write_changed(driver, held)
        insert_document(driver, RUNS, decided.runs)
        if decided.queue:
            insert_document(driver, QUEUE, decided.queue)
        if decided.queue and (share is None or share.wake_dispatchers):
            woken = {"c": QUEUE_CHANNEL, **(share.params() if share else {})}
            (found,) = driver.one(_next_due_sql(share is not None, True), woken, _DUE_AT)[:1]
        else:
            (found,) = driver.one(
                _next_due_sql(share is not None, False), share.params() if share else None, _DUE_AT
            )
    return cast(datetime | None, found)


def _write_backfilled(
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
        inserted = s.execute(_insert_if_free(s, runs).values(**run).returning(runs.c.id)).scalar_one_or_none()
        if inserted is None:
            taken.append(emission.scheduled_for)
            continue
        queue_rows.append(queue_row)
        result.emitted.append(emitted)
    if taken:
        logger.info("celery_boundedbeat: %s: %d backfilled grid time(s) already had a run", name, len(taken))
    return without_taken(outcome, taken, now)


def _insert_if_free(s: Session, table: Table) -> Any:
    """``INSERT ... ON CONFLICT (schedule, scheduled_for, attempt) DO NOTHING`` for this dialect."""
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert  # type: ignore[assignment]
    return dialect_insert(table).on_conflict_do_nothing(
        index_elements=["schedule", "scheduled_for", "attempt"]
    )


def next_due_at(db: Database, share: Share | None = None) -> datetime | None:
    """When the earliest schedule (of the share) is due (an index lookup, not a scan)."""
    with db.session() as s:
        sql = _next_due_sql(share is not None, False)
        (found,) = Driver.of(s).one(sql, share.params() if share else None, _DUE_AT)
    return cast(datetime | None, found)
