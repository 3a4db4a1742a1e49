"""The beat's side of prepared ticks: prepare ahead, build the messages, commit and publish at due.

:mod:`~celery_boundedbeat.prepared` writes the tick in a transaction held open until its due
time; here the beat builds the messages of its runs meanwhile (:meth:`Publisher.prepare`),
waits for the due instant, commits, and publishes them at once under the claim of its own
dispatcher, then marks them published. A run whose message the broker did not take goes back
to the queue for the dispatcher loop, exactly as a run it had claimed itself.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from datetime import datetime

from celery import Celery

from .claims import Claimed
from .dispatch import claim_margin
from .prepared import PreparedTick, Resolve, prepare_tick
from .publish import Publisher, Ready
from .settings import MAX_PREPARE_AHEAD, Settings
from .store import Store, TickResult, utcnow

logger = logging.getLogger("celery_boundedbeat.beat")

#: A prepared tick takes up to this many tick batches (``tick_batch_size``) of due schedules:
#: its lead grows with it, where the tick at the due time would take batch after batch late.
PREPARED_BATCHES = 10

#: Seconds per run a preparation is assumed to take before one was measured: about what 1,000
#: runs took on a slow 2-core machine, so the first prepared tick of a large burst is on time.
ASSUMED_PER_RUN = 0.0004


class AheadTicker:
    """Ticks prepared ``settings.prepare_ahead`` seconds before they are due (PostgreSQL only)."""

    def __init__(
        self,
        app: Celery,
        store: Store,
        settings: Settings,
        resolve: Resolve,
        *,
        claimer: str,
        still_leading: Callable[[], bool],
    ) -> None:
        self.store = store
        self.settings = settings
        self.resolve = resolve
        self.claimer = claimer
        self.still_leading = still_leading
        self._publisher = Publisher(app, confirm_timeout=settings.dispatch_claim_timeout / 2)
        self._rng = random.Random()
        #: Seconds the last preparation took per run it prepared, and how many runs the next
        #: one is expected to hold: the last preparation's, or more if a tick emitted more.
        self._per_run = ASSUMED_PER_RUN
        self._last_runs = 0
        #: The committed rows being published now: their claims are given back if it is cut short.
        self.in_flight: list[Claimed] = []

    @property
    def lead(self) -> float:
        """How long before a due time to start preparing it: ``prepare_ahead``, or longer when
        the last preparation needed more (twice its time, up to ``MAX_PREPARE_AHEAD``), so a
        large tick is still ready at its due time."""
        if not self.store.is_postgres or self.settings.prepare_ahead <= 0:
            return 0.0
        needed = 2 * self._per_run * self._last_runs
        return min(MAX_PREPARE_AHEAD, max(self.settings.prepare_ahead, needed))

    def saw(self, emitted: int) -> None:
        """A tick at its due time emitted ``emitted`` runs: the next preparation may hold as
        many. Without this, the first preparation after a beat's first look at 5,000 due
        schedules started ``prepare_ahead`` early and published its burst seconds late."""
        self._last_runs = max(self._last_runs, emitted)

    def run(self, due: datetime) -> tuple[TickResult | None, bool]:
        """Prepare the tick at ``due``, wait for it, commit and publish.

        Returns the committed tick (``None`` if nothing was certain enough to prepare) and
        whether a message failed to publish (the dispatcher loop then retries it).
        """
        started = time.monotonic()
        prepared = prepare_tick(
            self.store,
            self.resolve,
            due,
            PREPARED_BATCHES * self.settings.tick_batch_size,
            claimer=self.claimer,
            claim_timeout=self.settings.dispatch_claim_timeout,
            expires_after=self.settings.start_timeout,
            rng=self._rng,
        )
        if prepared is None:
            return None, False
        try:
            # Held until the publish: its frames are built for that producer's channel.
            ready = self._publisher.prepare(prepared.claimed, hold=True)
            self._last_runs = len(prepared.claimed)
            self._per_run = (time.monotonic() - started) / max(1, self._last_runs)
            if not sleep_until(due, longest=self.lead + CLOCK_STEP_SLACK) or not self.still_leading():
                prepared.abandon()
                self._publisher.close()
                return None, False
            # The claim is counted from the commit: the publish must end before it expires.
            timeout = self.settings.dispatch_claim_timeout
            deadline = time.monotonic() + timeout - claim_margin(timeout)
            prepared.commit()
        except BaseException:
            prepared.abandon()
            self._publisher.close()
            raise
        self.in_flight = prepared.claimed
        try:
            failed = self._publish(prepared, ready, deadline)
        except BaseException:
            # Stopped between the commit and the end of the publish: give the rows back at
            # once, so the next beat or dispatcher publishes them without waiting out the claim.
            self.give_back()
            raise
        finally:
            self.in_flight = []
        return prepared.result, failed

    def give_back(self) -> None:
        """Release the claims of a publish that was interrupted (SIGTERM's handler runs in the
        beat thread, in the middle of it); rows already marked published have left the queue."""
        claimed, self.in_flight = self.in_flight, []
        if not claimed:
            return
        try:
            self.store.release_claims(self.claimer, claimed, "beat stopping")
        except Exception:
            logger.warning("celery_boundedbeat: could not give back a prepared tick's rows", exc_info=True)

    def _publish(self, prepared: PreparedTick, ready: dict[int, Ready], deadline: float) -> bool:
        done, error = self._publisher.publish(prepared.claimed, deadline=deadline, ready=ready)
        self._publisher.close()
        try:
            self.store.mark_published(self.claimer, done, utcnow())
            if error is not None:
                accepted = {row.id for row in done}
                left = [row for row in prepared.claimed if row.id not in accepted]
                self.store.release_claims(self.claimer, left, error)
        except Exception:
            # The claims expire and the dispatcher takes the rows over (same task ids).
            logger.warning("celery_boundedbeat: recording a prepared tick's publish failed", exc_info=True)
            return True
        return error is not None


#: Seconds a prepared tick may find itself further from its due time than its lead: more means
#: the wall clock was stepped back (NTP) while it was prepared.
CLOCK_STEP_SLACK = 1.0


def sleep_until(
    due: datetime,
    *,
    longest: float,
    now: Callable[[], datetime] = utcnow,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Until the wall clock reads ``due``: never a moment before (nothing is published early).

    False, at once, when ``due`` is more than ``longest`` seconds away: the clock was stepped
    back, and waiting for it would hold the tick's transaction and the beat for as long as the
    step (an hour, a day) while the lease went unrenewed. The caller abandons the tick; the
    beat's next look finds the schedule due when the clock reaches it.
    """
    while (left := (due - now()).total_seconds()) > 0:
        if left > longest:
            return False
        sleep(left)
    return True
