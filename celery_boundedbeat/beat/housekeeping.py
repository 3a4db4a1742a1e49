"""The lease holder's chores besides ticking: the reaper, alert signals, retention, silent workers.

A mixin of :class:`~.scheduler.Scheduler` (its state lives on the scheduler, set in its
``__init__``): each chore is one recorded iteration, and an iteration that reaches the database
after an outage holds the reaper back (:func:`reaper_grace`) so workers can first write the
outcomes they kept.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from datetime import UTC, datetime, timedelta

from ..config.definitions import Resolver, sweep_slack
from ..config.settings import Settings
from ..core.loops import Iteration, IterationRecord, IterationRecorder, OutageLog, run_recorded_iteration
from ..core.messages import clip_error
from ..db.alertlog import TAKE_BATCH
from ..db.in_flight import first_published_at, in_flight
from ..db.lease import LeaseKeeper
from ..db.retention import purge_pass
from ..db.store import Store, TickResult, utcnow
from ..signals import send as send_signals

logger = logging.getLogger("celery_boundedbeat.beat")

#: Seconds between two looks an idle beat does whatever its notifications said (a backstop).
FULL_LOOK_EVERY = 60.0


def reaper_grace(down: float, heartbeat_interval: float) -> float:
    """Seconds the reaper waits after the database was out for ``down`` seconds.

    Workers could not write heartbeats or outcomes meanwhile either, so after a real outage
    the reaper gives them three heartbeat intervals. A run is settled ``lost`` once its
    worker's heartbeat is three intervals old; a live worker beats every interval, so after an
    outage shorter than half an interval (a cut connection, replaced at once) its heartbeat is
    at most 2½ intervals old when it next writes: no wait is needed. Waiting after each such
    blip would hold the reaper back for as long as the cuts go on (a pooler restarting every
    few seconds), and a dead worker's runs with it.
    """
    return 0.0 if down < heartbeat_interval / 2 else 3 * heartbeat_interval


class Housekeeping:
    """The reaper, alerts, retention, the definition cache's sweep and the recorded-iteration
    bookkeeping of the beat."""

    retention_every: float
    reaps_per_heartbeat: int
    _recorder: IterationRecorder
    _rng: random.Random
    _next_reap_at: float
    _next_full_reap_at: float
    _reap_not_before: float
    _next_housekeeping_at: float
    _runs_may_be_active: bool
    #: No run waiting published can be rejected before this (``None``: not known, look).
    _rejectable_at: datetime | None
    _alerts_may_wait: bool
    _swept_size: int
    _swept_live: int
    _failing_rows: set[str]

    @property
    def settings(self) -> Settings:
        raise NotImplementedError

    @property
    def store(self) -> Store:
        raise NotImplementedError

    @property
    def lease(self) -> LeaseKeeper:
        raise NotImplementedError

    @property
    def resolver(self) -> Resolver:
        raise NotImplementedError

    @property
    def _polling(self) -> bool:
        raise NotImplementedError

    def _housekeep(self, mono: float, now: datetime) -> None:
        """The leader's periodic chores: the reaper, the alert signals, silent workers' rows."""
        if mono >= self._next_reap_at:
            self._next_reap_at = mono + self.settings.heartbeat_interval / self.reaps_per_heartbeat
            backstop = mono >= self._next_full_reap_at
            if backstop:
                self._next_full_reap_at = mono + FULL_LOOK_EVERY
            if mono >= self._reap_not_before and (self._runs_may_be_active or backstop):
                self._reap(now)
            if self._alerts_may_wait or self._polling or backstop:
                self._send_alerts(now)
        if mono >= self._next_housekeeping_at:
            self._next_housekeeping_at = mono + self.retention_every
            silent = max(self.retention_every, 100 * self.settings.heartbeat_interval)
            try:
                self.store.run_life.forget_silent_workers(now - timedelta(seconds=silent))
            except Exception as exc:
                self._failed("worker row cleanup", exc, now)

    def _send_alerts(self, now: datetime) -> None:
        """Send the alert signals settles wrote (workers' and the reaper's), once each."""
        self._alerts_may_wait = False  # before the read: a settle noticed meanwhile sets it again
        try:
            alerts = self.store.take_alerts()
        except Exception as exc:
            self._alerts_may_wait = True
            self._failed("alerts", exc, now)
            return
        self._succeeded("alerts")
        if len(alerts) >= TAKE_BATCH:
            self._alerts_may_wait = True  # a full batch: more may wait
        send_signals(alerts)

    def _run_retention(self, shutdown: threading.Event, wakeup: threading.Event) -> None:
        """Retention passes every ``retention_interval`` while this beat holds the lease."""
        outage = OutageLog(logger, "retention purge")
        while not shutdown.is_set():
            wait = self.settings.retention_interval
            if self.lease.acting():
                run_recorded_iteration(
                    "retention purge", lambda: self._purge(shutdown), logger, self._recorder.record, outage
                )
            else:
                wait = min(wait, self.settings.lease_renew_interval)
            wakeup.wait(wait)
            wakeup.clear()

    def _purge(self, shutdown: threading.Event) -> Iteration:
        """One pass (:func:`~.retention.purge_pass`), stopped between batches by shutdown or the lease."""
        purged = purge_pass(
            self.store.engine,
            utcnow(),
            retention_days=self.settings.retention_days,
            may_go=lambda: not shutdown.is_set() and self.lease.acting(),
        )
        if purged.total:
            logger.info(
                "celery_boundedbeat: retention deleted %d run(s): %d by keep_runs, %d by keep_for, "
                "%d by boundedbeat_retention_days",
                purged.total,
                purged.by_count,
                purged.by_age,
                purged.global_age,
            )
        return Iteration(has_activity=purged.total > 0)

    def _reap(self, now: datetime) -> None:
        """One reaper pass: a probe of the runs in flight, and the reap itself only when it can
        settle something (:mod:`~.in_flight`).

        While no run is started, none can be lost or time out, and none of those waiting
        published can be rejected before :attr:`_rejectable_at`: the pass is the probe alone,
        so runs waiting for a worker cost an idle beat nothing per run.
        """
        engine = self.store.engine
        try:
            flight = in_flight(engine)
            if not flight.active:
                # Only this beat's ticks make runs active: nothing to reap until it emits again.
                self._runs_may_be_active = False
                self._rejectable_at = None
                self._succeeded("reap")
                return
            rejecting = self._rejectable_at is None or now >= self._rejectable_at
            if not (flight.started or rejecting):
                self._succeeded("reap")
                return
            settled = self.store.run_life.reap(
                now,
                heartbeat_interval=self.settings.heartbeat_interval,
                start_timeout=self.settings.start_timeout,
                rng=self._rng,
            )
            if rejecting:
                # Runs published from now on are rejectable a whole timeout from now at the
                # earliest; the oldest left waiting, a timeout after it was published.
                first = first_published_at(engine)
                self._rejectable_at = min(first or now, now) + timedelta(seconds=self.settings.start_timeout)
        except Exception as exc:
            self._failed("reap", exc, now)
            return
        self._succeeded("reap")
        if settled:
            self._alerts_may_wait = True  # a lost or timed-out run may have left an alert
        for run in settled:
            logger.warning(
                "celery_boundedbeat: run %s of %s settled %s by the reaper",
                run.run_id,
                run.schedule,
                run.state.value,
            )

    # -- recorded iterations ---------------------------------------------------------------

    def _failed(self, loop: str, exc: BaseException, started: datetime) -> None:
        """One failed iteration of ``loop``: the recorder logs and keeps it; the loop goes on."""
        self._recorder.failed(loop, exc, started.timestamp())

    def _succeeded(self, loop: str) -> None:
        """An iteration of ``loop`` reached the database; after an outage, hold the reaper back."""
        down = self._recorder.succeeded(loop)
        if down is None:
            return
        grace = reaper_grace(down, self.settings.heartbeat_interval)
        if grace <= 0:
            return
        self._reap_not_before = time.monotonic() + grace
        logger.warning(
            "celery_boundedbeat: the database is reachable again after %.1f s; the reaper waits "
            "%g s for workers to report the runs that ended meanwhile",
            down,
            grace,
        )

    def _write_record(self, record: IterationRecord) -> None:
        """The recorder's writer: one ``boundedbeat_iterations`` row, signed by this beat."""
        self.store.record_iteration(
            record.name,
            self.lease.holder,
            datetime.fromtimestamp(record.started_at, UTC),
            datetime.fromtimestamp(record.finished_at, UTC),
            None if record.error is None else clip_error(record.error),
        )

    def _sweep_definitions(self, now: datetime, result: TickResult | None = None) -> None:
        """Drop the cached definitions of the schedules just ticked that are not due soon, and
        those of schedules that no longer exist, once the cache has grown.

        A removal's notification only drops its copy when it arrives (never on SQLite); a
        beat that lives for months through per-tenant churn would otherwise keep every
        schedule it ever ran. After each tick, a cache grown by :func:`~.definitions.sweep_slack`
        since the last sweep is swept against the names it holds (index reads of those names
        alone, however many schedules the table has): it holds at most the cached schedules
        still present at the last sweep plus that slack.
        """
        resolver = self.resolver
        if result is not None and result.outcomes:
            due = {name: outcome.state.next_due_at for name, outcome in result.outcomes.items()}
            resolver.forget_not_due_before(due, now + resolver.KEEP_DUE_WITHIN)
        if len(resolver) <= self._swept_size + sweep_slack(self._swept_live):
            return
        try:
            # Only the names this beat holds: a read that follows the cache, not the table
            # (a million schedule names would cost a beat more memory than its whole cache).
            live = self.store.schedule_names(among=resolver.names() | self._failing_rows)
        except Exception as exc:
            self._failed("definition sweep", exc, now)
            return
        resolver.keep_only(live)
        self._failing_rows.intersection_update(live)  # a set-aside schedule removed meanwhile
        self._swept_size, self._swept_live = len(resolver), len(live)
