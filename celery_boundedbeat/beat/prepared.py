"""Ticks prepared before they are due: at the due instant only a commit and the broker writes are left.

A tick of a thousand schedules costs a few hundred milliseconds of SQL and message building;
done at the due instant, every run of the tick is published that much late. On PostgreSQL the
beat instead opens the tick's transaction ``boundedbeat_prepare_ahead`` seconds before the due
time ``due`` and, in it:

1. locks the schedules due by ``due`` with a free slot and nothing waiting, and of those
   takes the ones whose outcome cannot change before ``due``: the policy emits their tick and
   nothing is left waiting, skipped or coalesced (a slot only frees up before ``due``, so a
   schedule whose slot is free now is certain to run; one that waits on a busy slot is not
   locked and is left to the tick at ``due``, which decides it then);
2. decides them as of ``due`` and writes their runs and queue rows, the queue rows already
   claimed by this beat's dispatcher (no other dispatcher takes them);
3. holds the transaction open, uncommitted, until ``due``: until then nothing of it is
   visible, and nobody can change the locked schedules; a pause, an update or a finished run
   of one of them waits for the commit and takes effect from the next tick on.

At ``due`` the transaction commits and the prepared messages go to the broker; nothing is
ever published before its due time. If the beat dies or the commit fails, nothing was written:
the tick at ``due`` does the work as without preparing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, text
from sqlalchemy.orm import Session

from ..core.spec import EntrySpec
from ..core.ticks import ScheduleState, TickOutcome
from ..db.bulk import insert_many
from ..db.claims import Claimed
from ..db.driver import Sql
from ..db.locked import TICK_LEAVES_OUT, hold, prefetch_definitions, write_changed
from ..db.store import Store
from ..db.tables import QueueRow, RunRow
from ..db.tick import TickResult, decide_due

#: A due row's schedule (an ORM row or a :class:`~.held.Held` one).
Resolve = Callable[[Any], EntrySpec | None]

RUNS = cast(Table, RunRow.__table__)
QUEUE = cast(Table, QueueRow.__table__)
#: ``n`` new queue row ids, in order, from the id column's own sequence (PostgreSQL).
_QUEUE_IDS = text(
    "SELECT nextval(pg_get_serial_sequence('boundedbeat_queue', 'id')) FROM generate_series(1, :n)"
)


def certain(before: ScheduleState, outcome: TickOutcome) -> bool:
    """Whether a tick decided now ends the same whenever it is decided until its due time.

    Slots only free up in the meantime (only the lease holder starts runs): an outcome that
    emits without skipping, coalescing or keeping anything waiting is the outcome at the due
    time too. Queued triggers, backfill and retries compete for slots, so their schedules are never
    prepared. An outcome that drops a tick (busy, past ``catchup_window``, or from the buffer)
    or revokes a run to replace it is left to the tick at the due time too (``on_due`` is asked
    without runs to revoke here, so ``replace`` never revokes in a prepared tick).
    """
    return (
        bool(outcome.emit)
        and outcome.skipped == 0
        and outcome.revoke == 0
        and not outcome.coalesced
        and not outcome.state.pending
        and not before.triggers
        and not outcome.state.triggers
        and not before.backfill
        and not outcome.state.backfill
        and not before.retries
        and not outcome.state.retries
    )


@dataclass(kw_only=True)
class PreparedTick:
    """A tick written ahead, in a transaction left open until its due time."""

    due: datetime
    session: Session
    result: TickResult
    #: The queue rows of the emitted runs, claimed by ``claimer`` until the claim expires.
    claimed: list[Claimed] = field(default_factory=list)

    def commit(self) -> None:
        """Make the tick visible (call at ``due``, not before)."""
        try:
            self.session.commit()
        finally:
            self.session.close()

    def abandon(self) -> None:
        """Drop everything the preparation wrote; the tick at ``due`` does the work instead."""
        try:
            self.session.rollback()
        finally:
            self.session.close()


def prepare_tick(
    store: Store,
    resolve: Resolve,
    due: datetime,
    limit: int,
    *,
    claimer: str,
    claim_timeout: float,
    expires_after: float | None = None,
    rng: random.Random | None = None,
    set_aside: Sequence[str] = (),
) -> PreparedTick | None:
    """Write the certain part of the tick at ``due``, uncommitted; ``None`` when nothing is certain.

    ``set_aside`` names schedules whose own tick failed on their data: they are left to the
    tick at ``due``, which takes them one at a time, so one bad row cannot fail every
    preparation it falls due in.

    Only on PostgreSQL: SQLite has one writer at a time, so a transaction held open for the
    lead would stop every other writer (workers, the API) for as long.
    """
    if not store.is_postgres:
        return None
    rng = rng or random.Random()
    session = Session(store.engine, expire_on_commit=False)
    session.begin()
    try:
        prepared = _prepare(
            session, resolve, due, limit, claimer, claim_timeout, expires_after, rng, set_aside
        )
    except BaseException:
        session.rollback()
        session.close()
        raise
    if prepared is None:
        session.rollback()
        session.close()
    return prepared


#: The due schedules with a free slot and nothing waiting, locked unless another transaction
#: holds them (``active_runs`` against the policy's ``max_concurrency``, 1 when it has none).
#: Sent to psycopg directly (:mod:`~celery_boundedbeat.db.driver`): the ORM's result
#: processing was a fifth of a preparation. PostgreSQL only.
CERTAIN = Sql(
    "next_due_at <= %(due)s AND paused IS false AND stopped IS false AND pending_runs = 0 "
    "AND active_runs < coalesce(CAST(policy ->> 'max_concurrency' AS integer), 1) "
    "AND name <> ALL(CAST(%(set_aside)s AS text[])) "
    "ORDER BY next_due_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
)


def _prepare(
    session: Session,
    resolve: Resolve,
    due: datetime,
    limit: int,
    claimer: str,
    claim_timeout: float,
    expires_after: float | None,
    rng: random.Random,
    set_aside: Sequence[str],
) -> PreparedTick | None:
    result = TickResult(now=due)
    # Only rows with a free slot and nothing waiting are locked (SKIP LOCKED: a row another
    # transaction holds, a settle or a pause, is left to the tick at ``due``); a busy one stays
    # unlocked, so the settle that frees its slot is not held up.
    held = hold(
        session,
        CERTAIN,
        {"due": due, "limit": limit, "set_aside": list(set_aside)},
        leave_out=TICK_LEAVES_OUT,
    )
    prefetch_definitions(session, held, resolve)
    # As the tick at ``due`` decides them, keeping only the certain outcomes (rare otherwise:
    # an ending): the schedules left locked but untouched are decided by that tick.
    decided = decide_due(session, held, resolve, due, rng, expires_after, result, keep=certain)
    run_rows, queue_rows = decided.runs, decided.queue
    if not run_rows:
        return None
    write_changed(session, held)
    # COPY, and the queue ids taken from their sequence in one statement: an ORM bulk insert,
    # an INSERT ... RETURNING the ids, then an executemany took most of a preparation's time.
    insert_many(session, RUNS, run_rows)
    ids = session.execute(_QUEUE_IDS, {"n": len(queue_rows)}).scalars().all()
    until = due + timedelta(seconds=claim_timeout)
    for queue_id, queued in zip(ids, queue_rows, strict=True):
        queued.update(id=queue_id, claimed_by=claimer, claimed_until=until, attempts=1)
    insert_many(session, QUEUE, queue_rows)
    claimed = [_claimed(queued) for queued in queue_rows]
    return PreparedTick(due=due, session=session, result=result, claimed=claimed)


def _claimed(queued: dict[str, Any]) -> Claimed:
    return Claimed(
        id=queued["id"],
        run_id=queued["run_id"],
        task_id=queued["task_id"],
        task=queued["task"],
        args=queued["args"],
        kwargs=queued["kwargs"],
        options=queued["options"],
        due_at=queued["due_at"],
    )
