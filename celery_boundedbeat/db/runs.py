"""A run's life at the worker: started, settled (its slot freed on its schedule), late outcomes,
the worker heartbeat and the reaper that settles the runs of dead workers.

:class:`RunLife` holds these transitions; a :class:`~.store.Store` holds one (``store.run_life``)
and keeps the queue, the leases and the reads. Transitions are guarded by ``WHERE
state = <expected>`` and checked by row count, so a duplicate or late signal can never settle
a run twice.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, and_, case, delete, or_, select, update
from sqlalchemy.orm import Session

from ..core.enums import ACTIVE_STATES, RunState
from ..core.messages import clip_error
from ..core.policy import Policy
from ..core.ticks import on_settle
from .alertlog import note_settle
from .database import Database
from .row_state import apply_state, state_of
from .tables import QueueRow, RunRow, ScheduleRow, WorkerRow

logger = logging.getLogger("celery_boundedbeat")

#: PostgreSQL NOTIFY channel: a run settled (payload: schedule name).
SETTLED_CHANNEL = "boundedbeat_settled"

_ACTIVE = [s.value for s in ACTIVE_STATES]
#: Terminal states the beat decides without hearing from the task (reaper, dispatcher).
_DECIDED_WITHOUT_THE_TASK = frozenset(
    {RunState.LOST.value, RunState.TIMED_OUT.value, RunState.REJECTED.value}
)
#: Marks a task outcome that arrived after the run was settled without it (see ``settle_run``).
LATE_OUTCOME = "late outcome from the worker"


_PG_BEGIN = """
    WITH first AS (
        UPDATE boundedbeat_runs SET
            state = %(started)s,
            started_at = %(at)s,
            published_at = CASE WHEN published_at IS NULL OR published_at > %(at)s
                THEN %(at)s ELSE published_at END,
            worker = %(worker)s,
            process = %(process)s,
            deadline_at = %(deadline)s
        WHERE id = %(id)s AND state IN (%(queued)s, %(published)s)
        RETURNING id
    ), unqueued AS (
        DELETE FROM boundedbeat_queue WHERE run_id IN (SELECT id FROM first)
    )
    SELECT (SELECT count(*) FROM first), r.state, r.process, r.started_at, w.heartbeat_at
    FROM (SELECT 1) AS one
    LEFT JOIN boundedbeat_runs AS r ON r.id = %(id)s
    LEFT JOIN boundedbeat_workers AS w ON w.id = r.process
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class Begun:
    """What a delivery of a run's message found when it recorded the run's start
    (:meth:`RunLife.begin_run`): whether its start is the first, else the run as it was."""

    #: This delivery recorded the run's start (queued/published → started).
    first: bool
    #: The run's state before (``None``: no such run).
    state: str | None = None
    #: The process that recorded the earlier start, and its last heartbeat.
    process: str | None = None
    started_at: datetime | None = None
    heartbeat_at: datetime | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Settled:
    """A run that this call settled (``None`` is returned when it was already settled)."""

    run_id: str
    schedule: str
    state: RunState
    elapsed_ms: int | None


def not_before(at: datetime, *earlier: datetime | None) -> datetime:
    """``at``, or the latest of ``earlier`` if that is later: a run's times never go backwards
    (``enqueued_at`` ≤ ``started_at`` ≤ ``finished_at``), although the clocks that stamp them
    belong to different processes and hosts (a beat's, a worker's, a ``remove_schedule`` caller's)."""
    return max([at, *(t for t in earlier if t is not None)])


def elapsed_ms(started_at: datetime | None, finished_at: datetime) -> int | None:
    """A settled run's ``elapsed_ms``: never negative (clocks of two hosts), None if it never started."""
    if started_at is None:
        return None
    return max(int((finished_at - started_at).total_seconds() * 1000), 0)


def settles_onto(row: Any, incarnation: str | None) -> bool:
    """Whether a run of ``incarnation`` settles onto schedule ``row`` (its name's current row).

    A run of an earlier incarnation (removed, then the name added again) frees no slot and
    touches no counter, streak, alert or stop flag of the new one. A run without one (recorded
    before migration 0009 and not attributable then) settles by name, as it did.
    """
    return incarnation is None or row.incarnation == incarnation


def runs_of(name: str, incarnation: str | None) -> ColumnElement[bool]:
    """The runs that settle onto incarnation ``incarnation`` of schedule ``name`` (SQL criteria):
    its own, and those of the name recorded without one (:func:`settles_onto`)."""
    return and_(
        RunRow.schedule == name,
        or_(RunRow.incarnation == incarnation, RunRow.incarnation.is_(None)),
    )


class Attempt(NamedTuple):
    """Which attempt of which grid time a settled run was (what ``retry`` needs to go again)."""

    scheduled_for: datetime
    number: int


def _locked_run(s: Session, run_id: str) -> Any:
    """The columns a settle reads of run ``run_id``, locked (``None``: no such run).

    Locked while read: a dispatcher marking the run published between this read and the
    settle's guarded update would otherwise make the update match nothing and drop the outcome.
    """
    columns = (RunRow.schedule, RunRow.incarnation, RunRow.started_at, RunRow.state, RunRow.error)
    query = (
        select(*columns, RunRow.enqueued_at, RunRow.scheduled_for, RunRow.attempt)
        .where(RunRow.id == run_id)
        .with_for_update()
    )
    return s.execute(query).first()


class RunLife:
    """The worker-side transitions of runs, each in its own transaction (or the caller's).

    A :class:`~.store.Store` holds one (``store.run_life``) on the store's :class:`~.database.Database`.
    """

    def __init__(self, db: Database, *, failing_threshold: int = 1) -> None:
        self.db = db
        #: ``boundedbeat_failing_threshold``: a settle that makes the failure streak this long
        #: announces the schedule failing (:func:`~celery_boundedbeat.core.alerts.on_settled`).
        self.failing_threshold = failing_threshold

    def start_run(
        self, run_id: str, *, worker: str, process: str, now: datetime, max_run_time: float | None
    ) -> bool:
        """queued/published → started (a retry or redelivery of a started run is a no-op)."""
        with self.db.session() as s:
            return self.start_in(
                s, run_id, worker=worker, process=process, now=now, max_run_time=max_run_time
            )

    @staticmethod
    def start_in(
        s: Session,
        run_id: str,
        *,
        worker: str,
        process: str,
        now: datetime,
        max_run_time: float | None,
        repoint: bool = True,
    ) -> bool:
        """``start_run`` inside the caller's transaction (``repoint``: a run started already
        moves to ``process``, the write-behind path's redelivery)."""
        deadline = now + timedelta(seconds=max_run_time) if max_run_time else None
        result = s.execute(
            update(RunRow)
            .where(RunRow.id == run_id, RunRow.state.in_([RunState.QUEUED.value, RunState.PUBLISHED.value]))
            .values(
                state=RunState.STARTED.value,
                started_at=now,
                # A worker holds the message, so it was published by ``now`` at the latest.
                # The dispatcher may have marked it with a later clock reading (its mark
                # committed first, or it read its clock after the worker did): published
                # never follows started.
                published_at=case(
                    (or_(RunRow.published_at.is_(None), RunRow.published_at > now), now),
                    else_=RunRow.published_at,
                ),
                worker=worker,
                process=process,
                deadline_at=deadline,
            )
        )
        if result.rowcount:  # type: ignore[attr-defined]
            s.execute(delete(QueueRow).where(QueueRow.run_id == run_id))
        elif repoint:
            # Redelivered after a worker died: keep the run, point it at the new process.
            s.execute(
                update(RunRow)
                .where(RunRow.id == run_id, RunRow.state == RunState.STARTED.value)
                .values(worker=worker, process=process)
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    def begin_run(
        self, run_id: str, *, worker: str, process: str, now: datetime, max_run_time: float | None
    ) -> Begun:
        """Record a delivery's start of ``run_id`` atomically, before its body runs.

        The first delivery to get here moves the run to ``started`` (as ``start_run``) and
        learns it is first; any other finds the run as that start left it, and the caller
        decides (:meth:`~.tracking.Tracker.begin`) whether its body may run. One round trip
        on PostgreSQL. The run's row is held only by short transactions (a dispatcher's mark,
        a worker's batch, a settle); one whose process froze is ended by the server's
        ``idle_in_transaction_session_timeout`` (60 s, :mod:`.engine`).
        """
        if not self.db.is_postgres:
            with self.db.session() as s:
                before = s.execute(
                    select(RunRow.state, RunRow.process, RunRow.started_at, WorkerRow.heartbeat_at)
                    .outerjoin(WorkerRow, WorkerRow.id == RunRow.process)
                    .where(RunRow.id == run_id)
                ).first()
                limit = max_run_time
                first = self.start_in(
                    s, run_id, worker=worker, process=process, now=now, max_run_time=limit, repoint=False
                )
            if first:
                return Begun(first=True)
            if before is None:
                return Begun(first=False)
            return Begun(
                first=False,
                state=before.state,
                process=before.process,
                started_at=before.started_at,
                heartbeat_at=before.heartbeat_at,
            )
        params = {
            "id": run_id,
            "at": now,
            "worker": worker,
            "process": process,
            "deadline": now + timedelta(seconds=max_run_time) if max_run_time else None,
            "started": RunState.STARTED.value,
            "queued": RunState.QUEUED.value,
            "published": RunState.PUBLISHED.value,
        }
        # One statement in autocommit: one round trip, and the least of the worker's CPU (a
        # pipeline with BEGIN, settings and COMMIT cost a task twice as much of it).
        with self.db.driver(one_statement=True) as conn, conn.cursor() as cur:
            cur.execute(_PG_BEGIN, params)
            count, state, found_process, started_at, heartbeat_at = cur.fetchone()
        if count:
            return Begun(first=True)
        return Begun(
            first=False,
            state=state,
            process=found_process,
            started_at=None if started_at is None else started_at.astimezone(UTC),
            heartbeat_at=None if heartbeat_at is None else heartbeat_at.astimezone(UTC),
        )

    def take_over_run(self, run_id: str, *, worker: str, process: str, previous: str | None) -> bool:
        """Point a started run at the process continuing it (a redelivery after its first
        process died), only if ``previous`` still holds it: two redeliveries take it once."""
        guard = RunRow.process.is_(None) if previous is None else RunRow.process == previous
        with self.db.session() as s:
            result = s.execute(
                update(RunRow)
                .where(RunRow.id == run_id, RunRow.state == RunState.STARTED.value, guard)
                .values(worker=worker, process=process)
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def settle_run(
        self,
        run_id: str,
        state: RunState,
        *,
        now: datetime,
        error: str | None = None,
        stop: bool = False,
        rng: random.Random | None = None,
        expect: Iterable[RunState] | None = None,
        late: bool = False,
    ) -> Settled | None:
        """Move an active run to its one terminal state and free its slot exactly once.

        The rule for duplicate, late and out-of-order reports: **the first terminal state to
        reach the database wins**. Its ``state``, ``finished_at`` and ``elapsed_ms`` stay, it is
        counted once (``runs`` or ``failures``) and frees its slot once; every later report of
        the same run changes no state, no counter and no slot (returns ``None``). That covers
        signals sent twice (success and postrun, parent and child), writes retried after an
        outage that had in fact committed, redelivery with ``acks_late`` and Celery retries.

        A task's own outcome that arrives after the beat decided without it (``lost``,
        ``timed_out`` or ``rejected``: a worker that came back, a thread pool that cannot stop
        a task past ``max_run_time``, a message started after ``start_timeout``) is kept as the
        truth beside the verdict: with ``late=True`` (the worker's reports) it is appended once
        to the run's ``error`` as ``late outcome from the worker at <time>: <state>[: error]``.
        """
        assert state.terminal
        with self.db.session() as s:
            return self.settle_in(
                s, run_id, state, now=now, error=error, stop=stop, rng=rng, expect=expect, late=late
            )

    def settle_in(
        self,
        s: Session,
        run_id: str,
        state: RunState,
        *,
        now: datetime,
        error: str | None = None,
        stop: bool = False,
        rng: random.Random | None = None,
        expect: Iterable[RunState] | None = None,
        late: bool = False,
    ) -> Settled | None:
        """``settle_run`` inside the caller's transaction (see there)."""
        allowed = [st.value for st in (expect or ACTIVE_STATES)]
        schedule_row = self.lock_schedule_of(s, run_id)  # lock order (:mod:`.store`): schedule, run
        run = _locked_run(s, run_id)
        if run is None:
            return None
        if run.state not in allowed:
            if late and run.state in _DECIDED_WITHOUT_THE_TASK and run.state != state.value:
                self.note_late_outcome(s, run_id, run.state, run.error, state, now, error)
            return None
        now = not_before(now, run.enqueued_at, run.started_at)
        elapsed = elapsed_ms(run.started_at, now)
        result = s.execute(
            update(RunRow)
            .where(RunRow.id == run_id, RunRow.state == run.state)
            .values(
                state=state.value,
                finished_at=now,
                elapsed_ms=elapsed,
                error=error,
                # The dispatcher may have marked it published after the worker's report (its own
                # later clock reading): a run is never published after it finished.
                published_at=case((RunRow.published_at > now, now), else_=RunRow.published_at),
            )
        )
        if not result.rowcount:  # type: ignore[attr-defined]
            return None
        s.execute(delete(QueueRow).where(QueueRow.run_id == run_id))
        self._free_slot(
            s,
            schedule_row,
            run.schedule,
            run.incarnation,
            state,
            elapsed,
            now=now,
            stop=stop,
            rng=rng or random.Random(),
            run_id=run_id,
            error=error,
            attempt=Attempt(run.scheduled_for, run.attempt),
        )
        return Settled(run_id=run_id, schedule=run.schedule, state=state, elapsed_ms=elapsed)

    @staticmethod
    def lock_schedule_of(s: Session, run_id: str) -> ScheduleRow | None:
        """Lock the schedule of run ``run_id`` without locking the run (``None``: no such run or
        schedule): the first step of the lock order in :mod:`.store`, schedules before runs.

        A run's ``schedule`` never changes, so reading it unlocked is safe.
        """
        of_run = select(RunRow.schedule).where(RunRow.id == run_id).scalar_subquery()
        return s.scalars(select(ScheduleRow).where(ScheduleRow.name == of_run).with_for_update()).first()

    def _free_slot(
        self,
        s: Session,
        row: ScheduleRow | None,
        schedule: str,
        incarnation: str | None,
        outcome: RunState,
        elapsed: int | None,
        *,
        now: datetime,
        stop: bool,
        rng: random.Random,
        run_id: str,
        error: str | None = None,
        attempt: Attempt | None = None,
    ) -> None:
        """Count a settled run on its schedule (``row``, locked by the caller), free its slot
        (``on_settle``), note its alerts.

        Only onto the incarnation that emitted it: a schedule removed and added again under
        the same name is another schedule (:func:`settles_onto`).
        """
        if row is None or not settles_onto(row, incarnation):
            return
        self.count_settled(
            s, row, outcome, elapsed, now=now, stop=stop, rng=rng, run_id=run_id, error=error, attempt=attempt
        )
        self.db.notify(s, SETTLED_CHANNEL, schedule)

    def count_settled(
        self,
        s: Session,
        row: Any,
        outcome: RunState,
        elapsed: int | None,
        *,
        now: datetime,
        stop: bool,
        rng: random.Random,
        run_id: str,
        error: str | None = None,
        attempt: Attempt | None = None,
    ) -> None:
        """``_free_slot`` on a schedule row the caller has locked (no notification).

        ``row`` is a ``ScheduleRow`` or any object with its attributes (the batched writer's
        plain rows); the changes are made to it, and the caller writes them. ``attempt`` (the
        run's grid time and attempt number) lets the ``retry`` key attempt it again.
        """
        state, policy = state_of(row), Policy.from_json(row.policy)
        new = on_settle(
            policy,
            state,
            outcome=outcome,
            elapsed_ms=elapsed,
            now=now,
            stop=stop,
            gap_s=row.period or 0.0,
            rng=rng,
            run_id=run_id,
            attempt=1 if attempt is None else attempt.number,
            scheduled_for=None if attempt is None else attempt.scheduled_for,
        )
        if len(new.retries) > len(state.retries) and policy.retry is not None:
            again = new.retries[-1]
            logger.info(
                "celery_boundedbeat: %s: run %s ended %s; attempt %d of %d follows at %s",
                row.name,
                run_id,
                outcome.value,
                again.attempt,
                policy.retry.max_attempts,
                again.due_at.isoformat(timespec="milliseconds"),
            )
        if new.pause_reason is not None and row.pause_reason is None:
            logger.warning("celery_boundedbeat: %s paused itself: %s", row.name, new.pause_reason)
        note_settle(
            s,
            row,
            run_id=run_id,
            outcome=outcome,
            error=error,
            streak=new.consecutive_failures,
            threshold=self.failing_threshold,
            now=now,
        )
        apply_state(row, new, now)
        row.last_finished_at = now

    @staticmethod
    def note_late_outcome(
        s: Session,
        run_id: str,
        settled_as: str,
        old_error: str | None,
        state: RunState,
        now: datetime,
        error: str | None,
    ) -> None:
        """Append a late task outcome to a run the beat already settled (once; no counters)."""
        if old_error is not None and LATE_OUTCOME in old_error:
            return
        note = f"{LATE_OUTCOME} at {now.isoformat(timespec='milliseconds')}: {state.value}"
        if error:
            note += f": {error}"
        text_ = f"{old_error}; {note}" if old_error else note
        guard = RunRow.error.is_(None) if old_error is None else RunRow.error == old_error
        s.execute(
            update(RunRow)
            .where(RunRow.id == run_id, RunRow.state == settled_as, guard)
            .values(error=clip_error(text_))
        )

    def heartbeat(self, process: str, hostname: str, pid: int, now: datetime) -> None:
        """One statement per worker process per interval, however many runs it has."""
        with self.db.session() as s:
            self.heartbeat_in(s, process, hostname, pid, now)

    def heartbeat_in(self, s: Session, process: str, hostname: str, pid: int, now: datetime) -> None:
        """``heartbeat`` inside the caller's transaction.

        An upsert where the dialect has one: two runs starting at once in one process (a
        threads pool) would otherwise both miss the row and both insert it, and the loser's
        start and outcome would wait for the tracker's retry.
        """
        values = {"id": process, "hostname": hostname, "pid": pid, "heartbeat_at": now}
        upsert: Any = None
        if self.db.is_postgres:
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            upsert = pg_insert(WorkerRow).values(**values)
        elif self.db.engine.dialect.name == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            upsert = sqlite_insert(WorkerRow).values(**values)
        if upsert is not None:
            s.execute(
                upsert.on_conflict_do_update(
                    index_elements=[WorkerRow.id],
                    set_={"heartbeat_at": upsert.excluded.heartbeat_at, "pid": upsert.excluded.pid},
                )
            )
            return
        result = s.execute(update(WorkerRow).where(WorkerRow.id == process).values(heartbeat_at=now))
        if not result.rowcount:  # type: ignore[attr-defined]
            s.add(WorkerRow(id=process, hostname=hostname, pid=pid, heartbeat_at=now))

    def forget_silent_workers(self, older_than: datetime) -> int:
        """Drop heartbeat rows of processes silent since ``older_than`` (dead or long idle).

        Their runs were reaped long ago; a live process that was idle writes its row again
        when its next run starts.
        """
        with self.db.session() as s:
            result = s.execute(delete(WorkerRow).where(WorkerRow.heartbeat_at < older_than))
            return int(result.rowcount)  # type: ignore[attr-defined]

    def reap(
        self,
        now: datetime,
        *,
        heartbeat_interval: float,
        start_timeout: float,
        rng: random.Random,
    ) -> list[Settled]:
        """Settle runs nobody will finish: dead workers → lost, past deadline → timed_out,
        never started → rejected. Each goes through ``settle_run``, guarded by the state it
        was found in (a run that settled or started meanwhile is left alone)."""
        settled: list[Settled] = []
        for run_id, state, error, found_in in self._reapable(now, heartbeat_interval, start_timeout):
            done = self.settle_run(run_id, state, now=now, error=error, rng=rng, expect=[found_in])
            if done:
                settled.append(done)
        return settled

    def _reapable(
        self, now: datetime, heartbeat_interval: float, start_timeout: float
    ) -> list[tuple[str, RunState, str, RunState]]:
        """``(run id, verdict, error, state it was found in)`` of each run the reaper settles."""
        stale = now - timedelta(seconds=3 * heartbeat_interval)
        started = RunState.STARTED.value
        with self.db.session() as s:
            timed_out = s.scalars(
                select(RunRow.id).where(RunRow.state == started, RunRow.deadline_at < now).limit(500)
            ).all()
            lost = s.scalars(
                select(RunRow.id)
                .outerjoin(WorkerRow, WorkerRow.id == RunRow.process)
                .where(
                    RunRow.state == started,
                    RunRow.started_at < stale,
                    or_(WorkerRow.id.is_(None), WorkerRow.heartbeat_at < stale),
                )
                .limit(500)
            ).all()
            never = s.scalars(
                select(RunRow.id)
                .where(
                    RunRow.state == RunState.PUBLISHED.value,
                    RunRow.published_at < now - timedelta(seconds=start_timeout),
                )
                .limit(500)
            ).all()
        not_started = f"not started within boundedbeat_start_timeout ({start_timeout:g} s)"
        return [
            *((r, RunState.TIMED_OUT, "passed max_run_time", RunState.STARTED) for r in timed_out),
            *((r, RunState.LOST, "worker heartbeat stopped", RunState.STARTED) for r in lost),
            *((r, RunState.REJECTED, not_started, RunState.PUBLISHED) for r in never),
        ]
