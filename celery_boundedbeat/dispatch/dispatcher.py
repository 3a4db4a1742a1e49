"""The dispatch worker: drains the DB-backed queue to the broker with adaptive backoff.

Rows are claimed in batches (``SKIP LOCKED`` on PostgreSQL, so several dispatchers never
publish a row twice); a claim expires so a dispatcher that died leaves nothing stuck. Every
message is published with ``task_id = run id`` (see :mod:`.publish`): a re-publish after a
crash is the same task. With Celery's ``confirm_publish`` on AMQP, a row is marked published
only once the broker acknowledged its message (collected once per batch).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from celery import Celery

from ..config.settings import Settings
from ..core.loops import Iteration, IterationRecord, OutageLog, run_dispatch_loop, run_recorded_iteration
from ..core.redact import mask_url
from ..db.claims import Claimed
from ..db.runs import Settled
from ..db.store import ExpiredMessage, Store, utcnow
from .fsbroker import use_whole_files
from .publish import CLAIM_EXPIRED, STOPPED, Publisher

logger = logging.getLogger("celery_boundedbeat.dispatch")

T = TypeVar("T")


def claim_margin(claim_timeout: float) -> float:
    """How long before its claim expires a dispatcher stops publishing a batch.

    Covers clock skew between dispatchers (wall clocks compare ``claimed_until``) and the
    time one message takes to write: a tenth of the claim, at least 1 s, at most half.
    """
    return min(max(1.0, claim_timeout / 10), claim_timeout / 2)


#: Attempts at recording a published batch, and the pause before the n-th retry (n x this).
MARK_ATTEMPTS = 3
MARK_RETRY_PAUSE = 0.2

#: Seconds between two looks for queued work past ``publish_timeout`` (an hour by default).
#: Looked for at every drain, it was a sixth of a busy dispatcher's time: with several
#: partitioned beats each drains many small ticks a second.
STALE_LOOK_EVERY = 1.0


def retried_mark(record: Callable[[], T], what: str = "a published batch") -> T:
    """``record()``, tried again after a transient database error (a restart, a pooler reset).

    Recording what the broker took is the one write that must not be lost to a blip: failing
    it leaves the rows claimed, and whoever takes them over when the claim expires publishes
    them again (the same task ids, but a second execution). The dispatcher and a prepared
    tick both record through here. A connection that broke is invalidated by SQLAlchemy, so
    the next attempt gets a fresh one.
    """
    for attempt in range(MARK_ATTEMPTS):
        try:
            return record()
        except Exception:
            if attempt == MARK_ATTEMPTS - 1:
                raise
            logger.warning("celery_boundedbeat: recording %s failed; retrying", what, exc_info=True)
            time.sleep(MARK_RETRY_PAUSE * (attempt + 1))
    raise AssertionError("unreachable")


class Dispatcher:
    """Publishes queued rows. ``drain()`` is one iteration; ``run()`` is the loop."""

    def __init__(
        self,
        app: Celery,
        store: Store,
        settings: Settings,
        *,
        may_run: Callable[[], bool] = lambda: True,
        name: str | None = None,
        record: Callable[[IterationRecord], None] | None = None,
        notified: Callable[[], bool] | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.settings = settings
        self.may_run = may_run
        use_whole_files(app.conf.broker_url)  # a worker never reads half a message file
        #: Called with every drain iteration (the beat records the failed ones).
        self.record = record
        #: Whether a LISTEN on the queue channel wakes this dispatcher now (``None``: nothing does).
        self.notified = notified
        self._outage = OutageLog(logger, "dispatch iteration")
        #: Monotonic time of the next look for stale queued work (:meth:`_reject_stale`).
        self._next_stale_look = 0.0
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.broker_down = False
        self.published_total = 0
        self._rng = random.Random()
        # Wait at most half a claim for confirms: the claim must outlive the wait.
        self._publisher = Publisher(app, confirm_timeout=settings.dispatch_claim_timeout / 2)

    def drain(self, shutdown: threading.Event | None = None, cut: threading.Event | None = None) -> Iteration:
        """Publish everything queued now (batch by batch); one recorded iteration.

        ``shutdown`` set stops the drain after its current batch; ``cut`` set stops that batch
        too, at its next message: what the broker took is recorded, the rest given back.
        """
        return run_recorded_iteration(
            "dispatch", lambda: self._drain(shutdown, cut), logger, self.record, outage=self._outage
        )

    def _drain(self, shutdown: threading.Event | None, cut: threading.Event | None = None) -> Iteration:
        if not self.may_run():
            return Iteration()
        rejected = self._reject_stale()

        def stopping() -> bool:
            return (shutdown is not None and shutdown.is_set()) or not self.may_run()

        try:
            with ThreadPoolExecutor(1, thread_name_prefix="boundedbeat-dispatch-db") as db:
                published, error = self._publish_queued(db, stopping, cut)
            if error is not None:
                self._report_outage(error)
        finally:
            self._publisher.close()
        self.published_total += published
        if error is not None:
            return Iteration(has_activity=bool(published), failed=True)
        if self.broker_down and published:
            self.broker_down = False
            logger.warning(
                "celery_boundedbeat: broker %s is back; publishing resumed",
                mask_url(self.app.conf.broker_url),
            )
        return Iteration(has_activity=published > 0 or bool(rejected))

    def _reject_stale(self) -> list[Settled | ExpiredMessage]:
        """Settle as rejected the queued runs not published within ``publish_timeout``, and move
        the ``enqueue()`` messages as old to ``boundedbeat_outbox_expired``: each one logged.

        At most every :data:`STALE_LOOK_EVERY` seconds (a tenth of the timeout if shorter):
        work past its timeout is settled that much later at most."""
        timeout = self.settings.publish_timeout
        mono = time.monotonic()
        if mono < self._next_stale_look:
            return []
        self._next_stale_look = mono + min(STALE_LOOK_EVERY, timeout / 10)
        now = utcnow()
        rejected, expired = self.store.drop_stale(now, timeout, self._rng)
        for settled in rejected:
            logger.warning(
                "celery_boundedbeat: run %s of %s rejected: not published within %g s",
                settled.run_id,
                settled.schedule,
                timeout,
            )
        for message in expired:
            logger.warning(
                "celery_boundedbeat: enqueued task %s (task id %s, enqueued %s) not published within "
                "%g s (%d attempt(s), last error: %s); kept in boundedbeat_outbox_expired, not sent",
                message.task,
                message.task_id,
                message.enqueued_at.isoformat(),
                timeout,
                message.attempts,
                message.last_error or "none",
            )
        return [*rejected, *expired]

    def _publish_queued(
        self, db: ThreadPoolExecutor, stopping: Callable[[], bool], cut: threading.Event | None = None
    ) -> tuple[int, str | None]:
        """Claim, publish and mark batch after batch; return the count published and the error.

        The database work between two batches (marking the one just published, claiming the
        one after next) runs in ``db``, in one transaction, while the current batch is being
        published: the broker never waits on SQL.
        """
        size = self.settings.dispatch_batch_size
        published = 0
        batch, deadline = ([], 0.0) if stopping() else self._mark_and_claim([], size)
        previous: list[Claimed] = []  # published, not yet marked
        while batch:
            wanted = size if len(batch) == size and not stopping() else 0
            job = db.submit(self._mark_and_claim, previous, wanted)
            done, error = self._publisher.publish(batch, deadline=deadline, cut=cut)
            published += len(done)
            following, deadline = job.result()
            previous = done
            if error is not None:
                self._settle_failed_batch(batch, done, following, error)
                return published, None if error in (CLAIM_EXPIRED, STOPPED) else error
            batch = following
            if batch and stopping():
                self.store.release_claims(self.name, batch, "dispatcher stopping")
                batch = []
        if previous:
            self._mark_and_claim(previous, 0)
        return published, None

    def _settle_failed_batch(
        self, batch: list[Claimed], done: list[Claimed], following: list[Claimed], error: str
    ) -> None:
        """Mark what the broker took; release the rest of the batch and the one claimed after it.

        After a pause past the claim (``CLAIM_EXPIRED``) the release only returns rows that
        no other dispatcher has re-claimed meanwhile (it is guarded by the claimer's name).
        """
        if error == CLAIM_EXPIRED:
            logger.warning(
                "celery_boundedbeat: dispatcher %s was paused past its claim (%g s); it stopped "
                "publishing the batch after %d of %d rows and leaves the rest to the queue",
                self.name,
                self.settings.dispatch_claim_timeout,
                len(done),
                len(batch),
            )
        self._mark_and_claim(done, 0)
        accepted = {row.id for row in done}
        left = [row for row in batch if row.id not in accepted]
        self.store.release_claims(self.name, left + following, error)

    def _mark_and_claim(self, done: list[Claimed], wanted: int) -> tuple[list[Claimed], float]:
        """Record what the broker accepted and claim up to ``wanted`` more rows.

        Returns the claimed rows and their publish deadline on this process's monotonic
        clock: the claim's length less a margin, counted from before the claim was written,
        so the deadline always comes before any other dispatcher may take the rows over.
        Retried, because failing here means re-publishing the batch after its claim expires
        (the same task ids, but a second execution).
        """
        timeout = self.settings.dispatch_claim_timeout

        def record() -> tuple[list[Claimed], float]:
            deadline = time.monotonic() + timeout - claim_margin(timeout)
            return self.store.mark_and_claim(self.name, done, utcnow(), wanted, timeout), deadline

        return retried_mark(record)

    def _report_outage(self, error: str) -> None:
        if not self.broker_down:
            self.broker_down = True
            logger.error(
                "celery_boundedbeat: cannot publish to broker %s (%s); runs stay queued in the "
                "database and are published when it returns",
                mask_url(self.app.conf.broker_url),
                error,
            )
        else:
            logger.debug("celery_boundedbeat: broker still unavailable: %s", error)

    def run(self, shutdown: threading.Event, wakeup: threading.Event) -> None:
        """The loop: drain at startup, then on wakeup or after the backoff sleep."""
        run_dispatch_loop(
            shutdown,
            wakeup,
            lambda: self.drain(shutdown),
            lambda: self.settings.dispatch_interval,
            self._max_idle_sleep,
        )

    def _max_idle_sleep(self) -> float:
        """The cap of the idle backoff: on PostgreSQL, while its listener hears NOTIFY, that wakes
        the loop for new rows; otherwise (SQLite, or a LISTEN connection that is down or
        half-open) nothing wakes it across processes (an ``enqueue`` from a web process, rows a
        beat wrote for a standalone dispatcher), so it looks at least every ``poll_interval``."""
        if self.store.is_postgres and self.notified is not None and self.notified():
            return self.settings.dispatch_max_interval
        return min(self.settings.dispatch_max_interval, self.settings.poll_interval)
