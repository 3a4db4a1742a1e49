"""Every SQL state change, one method per change, one transaction each.

:class:`Store` is the index: one method per transaction, by what it changes. It is made of
parts that live in modules of their own and hold the same :class:`~.database.Database`: a
run's life at the worker (start, settle, heartbeats, the reaper) is ``store.run_life``
(:class:`~.runs.RunLife`); the tick transaction is :mod:`.tick`; the sweep of stale queue
rows is :mod:`.stale`. Transitions are guarded by ``WHERE state = <expected>`` and checked by
row count, so a duplicate or late signal can never settle a run twice (SQLite ignores ``FOR
UPDATE``; correctness comes from the guards and the unique ``(schedule, scheduled_for)`` key).

Lock order (PostgreSQL). Every transaction that locks rows of more than one kind, or several
rows of one kind, takes them in this order, so no two of them can wait for each other:

1. schedules (``boundedbeat_schedules``), by name;
2. runs (``boundedbeat_runs``), by id;
3. queue rows (``boundedbeat_queue``).

A schedule is found from its run without locking the run (a run's schedule never changes:
:meth:`~.runs.RunLife.lock_schedule_of`). A lock taken with ``SKIP LOCKED`` never waits and
may break the order (the tick's due schedules and ``replace`` victims, the dispatcher's claim).
A worker's heartbeat row is written by its own process only, in a transaction of its own.
The places that take locks say "lock order" and refer here.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, and_, delete, func, select, update
from sqlalchemy.orm import Session

from ..core.alerts import Alert
from ..core.backfill import Backfilled, BackfillRefused, on_backfill
from ..core.enums import RunState, StopReason
from ..core.exceptions import ScheduleEndedError, UnknownScheduleError
from ..core.messages import clip_error
from ..core.policy import Policy
from ..core.spec import Definition, EntrySpec
from ..core.ticks import TriggerRefused, on_resume, on_trigger, resume_refusal, stopped_as
from . import tick as tick_
from .alertlog import take
from .claims import Claimed, claim, mark
from .database import Database, utcnow
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
from .row_state import apply_state, state_of, write_state
from .runs import _ACTIVE, SETTLED_CHANNEL, RunLife, Settled, runs_of
from .stale import ExpiredMessage, StaleQueue
from .tables import IterationRow, LeaseRow, QueueRow, RunRow, ScheduleRow
from .tick import QUEUE_CHANNEL, TickResult

__all__ = ["QUEUE_CHANNEL", "SCHEDULES_CHANNEL", "ExpiredMessage", "Store", "TickResult", "utcnow"]

#: PostgreSQL NOTIFY channel: a schedule's definition was added, changed or removed (payload:
#: its name). A run settled: :data:`~.runs.SETTLED_CHANNEL`; a queue row was added:
#: :data:`~.tick.QUEUE_CHANNEL`.
SCHEDULES_CHANNEL = "boundedbeat_schedules"

#: The error of an active run settled ``revoked`` by ``remove_schedule(revoke_active=True)``.
REMOVED_WITH_REVOKE = "revoked: its schedule was removed (remove_schedule revoke_active)"


class Store:
    """The state database. Stateless apart from the engine; safe to share between threads."""

    def __init__(self, engine: Engine, *, failing_threshold: int = 1) -> None:
        self.engine = engine
        self.db = Database(engine)
        self.is_postgres = self.db.is_postgres
        #: Without LISTEN/NOTIFY, completions are noticed by polling.
        self.is_sqlite_like = not self.is_postgres
        #: A run's life at the worker: started, settled, heartbeats, the reaper.
        self.run_life = RunLife(self.db, failing_threshold=failing_threshold)
        self._stale = StaleQueue(self.db, self.run_life)

    def session(self) -> AbstractContextManager[Session]:
        """One transaction: commit on success, roll back on any error."""
        return self.db.session()

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
            with self.db.driver(one_statement=True) as driver:
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
                self.db.notify(s, SCHEDULES_CHANNEL, definition.name)
            return added

    def set_stopped(self, name: str, reason: StopReason, now: datetime) -> bool:
        """Stop a schedule as an imported file says (ended or ``stop_schedule``); False if unknown."""
        with self.session() as s:
            row = s.get(ScheduleRow, name, with_for_update=True)
            if row is None:
                return False
            write_state(row, stopped_as(state_of(row), reason))
            row.updated_at = now
            self.db.notify(s, SCHEDULES_CHANNEL, name)
            return True

    def update_schedule(
        self, name: str, revise: Callable[[ScheduleRow], Definition], now: datetime, rng: random.Random
    ) -> None:
        """Change a runtime schedule to ``revise(row)``'s definition (:func:`~.catalog.update_runtime`)."""
        if self.is_postgres:
            with self.db.driver() as driver:
                update_runtime_pg(driver, name, revise, now, rng, SCHEDULES_CHANNEL)
            return
        with self.session() as s:
            if update_runtime(s, name, revise, now, rng):
                self.db.notify(s, SCHEDULES_CHANNEL, name)

    def remove_schedule(self, name: str, now: datetime, *, revoke_active: bool) -> list[str] | None:
        """Delete a runtime schedule (its runs stay); ``None`` when there is none of that name.

        With ``revoke_active`` its active runs settle ``revoked`` in the same transaction and
        their ids are returned, for the caller to revoke at the workers once this commits.
        On PostgreSQL, without it, a runtime schedule's removal is one statement.
        """
        if self.is_postgres and not revoke_active:
            with self.db.driver(one_statement=True) as driver:
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
                    if self.run_life.settle_in(
                        s, run_id, RunState.REVOKED, now=now, error=REMOVED_WITH_REVOKE
                    ):
                        revoked.append(run_id)
            s.execute(delete(ScheduleRow).where(ScheduleRow.name == name))
            self.db.notify(s, SCHEDULES_CHANNEL, name)
            return revoked

    # -- ticks (the transaction: :mod:`.tick`) -------------------------------------------

    def tick(
        self,
        specs: Mapping[str, EntrySpec] | Callable[[Any], EntrySpec | None],
        now: datetime,
        rng: random.Random,
        limit: int,
        *,
        expires_after: float | None = None,
        share: tick_.Share | None = None,
    ) -> TickResult:
        """Handle every due schedule (of ``share``) in one transaction (:func:`.tick.tick`)."""
        return tick_.tick(self.db, specs, now, rng, limit, expires_after=expires_after, share=share)

    def next_due_at(self, share: tick_.Share | None = None) -> datetime | None:
        """When the earliest schedule (of ``share``) is due (an index lookup, not a scan)."""
        return tick_.next_due_at(self.db, share)

    # -- schedules: pause, trigger, backfill ------------------------------------------------

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
            self.db.notify(s, SETTLED_CHANNEL, name)
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
            self.db.notify(s, SETTLED_CHANNEL, name)
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
                self.db.notify(s, SETTLED_CHANNEL, name)
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
        """Runs still queued past the publish limit settle ``rejected`` (:mod:`.stale`)."""
        return self._stale.reject_unpublished(now, publish_timeout, rng)

    def drop_stale(
        self, now: datetime, publish_timeout: float, rng: random.Random
    ) -> tuple[list[Settled], list[ExpiredMessage]]:
        """The dispatcher's look for rows unpublished past the publish limit (:mod:`.stale`)."""
        return self._stale.drop_stale(now, publish_timeout, rng)

    def expire_outbox(self, now: datetime, publish_timeout: float) -> list[ExpiredMessage]:
        """``enqueue()`` rows unpublished past the publish limit are kept aside (:mod:`.stale`)."""
        return self._stale.expire_outbox(now, publish_timeout)

    # -- runs: retention and alerts (a run's life at the worker: ``run_life``) ----------

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

    def schedule_names(self, among: Collection[str] | None = None) -> set[str]:
        """The name of every schedule, or of those of ``among`` that exist (the primary key
        alone: an index-only read; with ``among``, its cost follows ``among``, not the table)."""
        with self.session() as s:
            if among is None:
                return set(s.scalars(select(ScheduleRow.name)))
            found: set[str] = set()
            for part in chunks(list(among)):
                found.update(s.scalars(select(ScheduleRow.name).where(ScheduleRow.name.in_(part))))
            return found

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
