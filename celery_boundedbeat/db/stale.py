"""The sweep of queue rows left unpublished past ``boundedbeat_publish_timeout``.

Their runs settle ``rejected``; ``enqueue()`` messages are kept aside in
``boundedbeat_outbox_expired``.

The dispatcher's sweep (:meth:`~.store.Store.drop_stale`); each stale row is taken in a
transaction of its own, guarded by the claim and the run's state it was found with.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, delete, select
from sqlalchemy.orm import Session

from ..core.enums import RunState
from .bulk import insert_many
from .claims import unclaimed
from .database import Database
from .runs import RunLife, Settled
from .tables import OutboxExpiredRow, QueueRow, RunRow

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


class StaleQueue:
    """The sweep of stale queue rows of one store (:meth:`~.store.Store.drop_stale`)."""

    def __init__(self, db: Database, run_life: RunLife) -> None:
        self.db = db
        self.run_life = run_life

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
        with self.db.session() as s:
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
            with self.db.session() as s:
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
            self.run_life.lock_schedule_of(s, run_id)
            state = s.scalar(select(RunRow.state).where(RunRow.id == run_id).with_for_update())
            if state != RunState.QUEUED.value:
                return None
        taken = s.execute(delete(QueueRow).where(QueueRow.id == queue_id, unclaimed(now)))
        if not taken.rowcount or run_id is None:  # type: ignore[attr-defined]
            return None  # claimed meanwhile
        return self.run_life.settle_in(
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
        with self.db.session() as s:
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
