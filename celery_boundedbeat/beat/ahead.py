"""The beat's side of prepared ticks: prepare ahead, build the messages, commit and publish at due.

:mod:`~celery_boundedbeat.beat.prepared` writes the tick in a transaction held open until its due
time; here the beat builds the messages of its runs meanwhile (:meth:`Publisher.prepare`),
waits for the due instant, commits, and publishes them at once under the claim of its own
dispatcher, then marks them published. A run whose message the broker did not take goes back
to the queue for the dispatcher loop, exactly as a run it had claimed itself. A stop signal
waits for the end of that record (:func:`held_stop_signals`); a publish cut short all the same
records the rows it handed to the broker and gives back only the others.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import datetime
from types import FrameType
from typing import Any

from celery import Celery

from ..config.settings import MAX_PREPARE_AHEAD, Settings
from ..db.claims import Claimed
from ..db.store import Store, TickResult, utcnow
from ..dispatch.dispatcher import claim_margin, retried_mark
from ..dispatch.publish import Publisher, Ready
from .prepared import PreparedTick, Resolve, prepare_tick

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
        #: The thread in :meth:`run`, if any.
        self._running: int | None = None

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

    def run(self, due: datetime, set_aside: Sequence[str] = ()) -> tuple[TickResult | None, bool]:
        """Prepare the tick at ``due``, wait for it, commit and publish.

        Returns the committed tick (``None`` if nothing was certain enough to prepare) and
        whether a message failed to publish (the dispatcher loop then retries it). Schedules
        named in ``set_aside`` are left to the tick at ``due`` (:func:`.prepared.prepare_tick`).

        A stop signal from the commit to the record of the publish waits for that record
        (:func:`held_stop_signals`). Before the commit it goes through: Celery's handler calls
        ``Scheduler.close()``, which leaves the work to this call's unwinding
        (:meth:`running_here`), and the SystemExit it raises drops the tick uncommitted, its
        transaction rolled back, before the beat closes.
        """
        self._running = threading.get_ident()
        try:
            return self._run(due, set_aside)
        finally:
            self._running = None

    def running_here(self) -> bool:
        """Whether this thread is in :meth:`run`: true inside a signal handler that interrupted it."""
        return self._running == threading.get_ident()

    def _run(self, due: datetime, set_aside: Sequence[str]) -> tuple[TickResult | None, bool]:
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
            set_aside=set_aside,
        )
        if prepared is None:
            return None, False
        with ExitStack() as held:
            try:
                # Held until the publish: its frames are built for that producer's channel.
                ready = self._publisher.prepare(prepared.claimed, hold=True)
                self._last_runs = len(prepared.claimed)
                self._per_run = (time.monotonic() - started) / max(1, self._last_runs)
                if not sleep_until(due, longest=self.lead + CLOCK_STEP_SLACK) or not self.still_leading():
                    prepared.abandon()
                    self._publisher.close()
                    return None, False
                held.enter_context(held_stop_signals())
            except BaseException:
                prepared.abandon()
                self._publisher.close()
                raise
            return prepared.result, self._commit_and_publish(prepared, ready)

    def _commit_and_publish(self, prepared: PreparedTick, ready: dict[int, Ready]) -> bool:
        """Commit, publish and record; whether a message failed to publish.

        Cut short anywhere (SystemExit from a signal handler, an error), the rows the broker
        took or may have taken are recorded published and only the others go back to the
        queue, at once: giving back a row whose message was written published it twice.
        """
        claimed = prepared.claimed
        self._publisher.handed = []
        sent: list[Claimed] | None = None  # what the broker took, once the publish returned
        try:
            deadline = self._deadline(prepared.due)
            prepared.commit()
            sent, error = self._publisher.publish(claimed, deadline=deadline, ready=ready)
            self._publisher.close()
            return self._record(claimed, sent, error)
        except BaseException:
            self._publisher.close()
            self._settle(claimed, self._publisher.handed if sent is None else sent)
            raise

    def _deadline(self, due: datetime) -> float:
        """When the publish stops, on the monotonic clock.

        The claim runs from ``due`` (:func:`.prepared.prepare_tick` writes ``due +
        dispatch_claim_timeout``), so the deadline counts from ``due`` too: a commit later than
        ``due`` (a tick found late, a long preparation) leaves the publish that much less time
        instead of letting it outlive the claim another dispatcher may then take over.
        """
        timeout = self.settings.dispatch_claim_timeout
        late = max(0.0, (utcnow() - due).total_seconds())
        return time.monotonic() - late + timeout - claim_margin(timeout)

    def _record(self, claimed: list[Claimed], done: list[Claimed], error: str | None) -> bool:
        """Mark what the broker took (retried as the dispatcher's mark), give back the rest."""
        try:
            self._mark(done)
            if error is not None:
                accepted = {row.id for row in done}
                self.store.release_claims(self.claimer, [r for r in claimed if r.id not in accepted], error)
        except Exception:
            # The claims expire and the dispatcher takes the rows over (same task ids).
            logger.warning("celery_boundedbeat: recording a prepared tick's publish failed", exc_info=True)
            return True
        return error is not None

    def _mark(self, rows: list[Claimed]) -> None:
        """The dispatcher's mark, retried the same way (:func:`.dispatch.retried_mark`)."""
        retried_mark(lambda: self.store.mark_published(self.claimer, rows, utcnow()), "a prepared tick")

    def _settle(self, claimed: list[Claimed], sent: list[Claimed]) -> None:
        """After a cut-short publish: ``sent`` is published, the rest goes back to the queue now.

        Nothing of the interrupted transaction is left open (it was rolled back as the
        exception unwound it), so a stopping beat holds no lock through its last drain.
        """
        ids = {row.id for row in sent}
        try:
            if sent:
                self._mark(sent)
            self.store.release_claims(self.claimer, [r for r in claimed if r.id not in ids], "beat stopping")
        except Exception:
            logger.warning("celery_boundedbeat: could not record an interrupted prepared tick", exc_info=True)


#: The signals Celery's beat stops on: its handler calls ``Scheduler.close()``, then raises
#: SystemExit wherever the beat thread is.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def held_stop_signals() -> Iterator[None]:
    """SIGTERM and SIGINT received in the block take effect at its end, not in its middle.

    Celery's beat handler calls ``Scheduler.close()`` and raises SystemExit wherever the beat
    thread is: in a prepared tick's publish that cut it at an arbitrary message, in its
    record even, with the record's transaction left open while the last drain ran. Held
    here, the publish ends and is recorded (its deadline bounds it), then the signal is
    raised again for its own handler. Only the main thread sets handlers (and runs them):
    elsewhere nothing is held, and no handler can interrupt the block either.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not None:  # None: set outside Python, could not be put back
                previous[sig] = signal.signal(sig, hold)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


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
