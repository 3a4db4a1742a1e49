"""The Celery beat scheduler class: ``celery beat -S celery_boundedbeat.Scheduler``.

Beat's loop calls :meth:`Scheduler.tick`; each tick handles every due schedule in one
transaction (an index range scan on ``next_due_at``, never a walk over all schedules),
wakes the dispatcher, and then waits until the next due time, a completion notice, or the
poll interval, whichever comes first.

High availability: any number of beats may run against one database. Only the holder of
the ``beat`` lease (``boundedbeat_leases``, kept by :class:`~.lease.LeaseKeeper`) ticks,
dispatches and reaps. A holder that cannot renew stops a whole renew interval before its
lease can expire; a standby tries every renew interval and takes over at most
``lease_ttl + lease_renew_interval`` after the holder's last renewal. The unique
``(schedule, scheduled_for)`` key makes a double emission impossible even if two beats ever
believed they held it.

Faults: every tick, reap, renewal, chore and drain is one recorded iteration
(:class:`~.runtime.IterationRecorder`): an exception is logged (with its traceback the first
time in a streak, then one line every 30 s), recorded in ``boundedbeat_iterations`` (once
the database is back, if it was the database that failed), and the loop goes on. After
losing the database the reaper waits three heartbeat intervals before settling anything, so
workers can first write the outcomes they kept.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from datetime import datetime
from typing import Any

from celery import Celery, beat

from ..config.definitions import Resolver, config_definitions
from ..config.settings import Settings, app_name, warn_unknown_settings
from ..core.alerts import on_ticked
from ..core.exceptions import BoundedBeatError, ConfigurationError
from ..core.loops import BackgroundLoop, IterationRecorder
from ..core.spec import Definition
from ..db.faults import is_outage
from ..db.lease import LeaseEvent, LeaseKeeper, LeaseTurn
from ..db.notify import Listener
from ..db.partitions import BEATS_CHANNEL
from ..db.runs import SETTLED_CHANNEL
from ..db.store import QUEUE_CHANNEL, SCHEDULES_CHANNEL, Store, TickResult, utcnow
from ..db.tick import Share
from ..dispatch.dispatcher import Dispatcher
from ..signals import send as send_signals
from .ahead import AheadTicker
from .exporter import MetricsExporter, serve_metrics
from .housekeeping import FULL_LOOK_EVERY, Housekeeping, reaper_grace
from .notices import log_lease_event, log_stopped, log_tick
from .sharing import BeatShare, gather
from .startup import (
    EX_CONFIG,
    EX_UNAVAILABLE,
    banner_info,
    freeze_startup_heap,
    last_drain,
    log_schedules,
    prepare_database,
    runtime_schedule_count,
)

__all__ = [
    "EX_CONFIG",
    "EX_UNAVAILABLE",
    "FULL_LOOK_EVERY",
    "Scheduler",
    "freeze_startup_heap",
    "reaper_grace",
]

logger = logging.getLogger("celery_boundedbeat.beat")


class Scheduler(Housekeeping, beat.Scheduler):  # type: ignore[misc]
    """Bounded policies, SQL run history, a DB-backed queue and a leader lease."""

    #: The cleanup of silent workers' heartbeat rows runs hourly (retention has its own
    #: ``boundedbeat_retention_interval``).
    retention_every: float = 3600.0
    #: Reaper passes per heartbeat interval: a dead worker's run settles ``lost`` at most
    #: 3 1/3 intervals after its last heartbeat (10 s with the default 3 s interval).
    reaps_per_heartbeat: int = 3

    def __init__(self, app: Celery, *args: Any, **kwargs: Any) -> None:
        # Attributes first: the base __init__ calls setup_schedule() at its end.
        self._settings: Settings | None = None
        self._store: Store | None = None
        self._lease: LeaseKeeper | None = None
        #: This beat's share of the partitions (``boundedbeat_partitions`` > 1; :mod:`.sharing`).
        self._share: BeatShare | None = None
        #: This beat's ``beat_schedule`` entries (reconciled when it takes the lease).
        self._config: dict[str, Definition] = {}
        #: Every due row's schedule, rebuilt from its row when it changed (runtime ones too).
        self._resolver: Resolver | None = None
        self._rng = random.Random()
        self._wake = threading.Event()
        self._dispatch_loop: BackgroundLoop | None = None
        self._dispatcher: Dispatcher | None = None
        #: Ticks prepared before they are due (PostgreSQL with the in-beat dispatcher).
        self._ahead: AheadTicker | None = None
        self._listener: Listener | None = None
        self._recorder = IterationRecorder(
            self._write_record, logger=logger, is_outage=is_outage, label="beat "
        )
        self._next_reap_at = 0.0
        self._next_full_reap_at = 0.0
        #: Retention passes, on a thread of their own so a long purge never delays a tick.
        self._retention_loop: BackgroundLoop | None = None
        self._reap_not_before = 0.0
        self._next_housekeeping_at = 0.0
        self._closed = False
        #: A close() that came while a prepared tick ran in this thread, done once it ended.
        self._close_deferred = False
        #: The thread in :meth:`tick` now, if any (a close from a signal handler there waits).
        self._ticking: int | None = None
        #: The ``/metrics`` endpoint, when ``boundedbeat_metrics_port`` is set.
        self._metrics: MetricsExporter | None = None
        #: Whether the schedule rows were reconciled with beat_schedule in this lease term.
        self._reconciled = False
        #: What an idle beat on PostgreSQL may skip (:meth:`_must_tick`, :meth:`_housekeep`):
        #: the earliest due time the last tick saw and whether anything may have changed since
        #: (a notification, a new lease term, a failed tick); whether runs may be active (the
        #: reaper's work) and whether settles may have left alerts to send.
        self._known_due: datetime | None = None
        self._stale = True
        #: Ticks failed in a row (the first is tried again at once: a cut connection).
        self._tick_failures = 0
        self._runs_may_be_active = True
        self._rejectable_at: datetime | None = None
        self._alerts_may_wait = True
        #: Whether no tick has looked since the lease was taken (:meth:`_tick_late`).
        self._first_look = True
        #: Monotonic time of the next look done whatever the above say (a backstop).
        self._next_full_look_at = 0.0
        #: The definition cache's size after its last sweep, and the schedules then present.
        self._swept_size = 0
        self._swept_live = 0
        #: Schedules whose own tick failed and were set aside (logged once until they tick again).
        self._failing_rows: set[str] = set()
        kwargs.pop("schedule_filename", None)
        super().__init__(app, *args, **kwargs)

    # -- the celery.beat contract -------------------------------------------------------

    @property
    def settings(self) -> Settings:
        """The settings, read once; invalid ones end beat with EX_CONFIG and the problems named
        (Celery reads ``info`` for the banner before ``setup_schedule``: both land here)."""
        if self._settings is None:
            try:
                self._settings = Settings.from_conf(self.app.conf)
            except ConfigurationError as exc:
                logger.critical("%s", exc)
                raise SystemExit(EX_CONFIG) from None
        return self._settings

    @property
    def store(self) -> Store:
        if self._store is None:
            raise BoundedBeatError("the scheduler is not set up (setup_schedule() not called)")
        return self._store

    @property
    def resolver(self) -> Resolver:
        if self._resolver is None:
            raise BoundedBeatError("the scheduler is not set up (setup_schedule() not called)")
        return self._resolver

    @property
    def lease(self) -> LeaseKeeper:
        if self._lease is None:
            raise BoundedBeatError("the scheduler is not set up (setup_schedule() not called)")
        return self._lease

    def setup_schedule(self) -> None:
        """Validate every entry, prepare the database, reconcile schedules, start helpers."""
        settings = self.settings
        warn_unknown_settings(self.app.conf, logger)  # here, not in ``info``: logging is set up
        try:
            self._config = config_definitions(self.app, settings.default_policy)
        except ConfigurationError as exc:
            logger.critical("%s", exc)
            raise SystemExit(EX_CONFIG) from None
        self._resolver = Resolver(self.app, self._config)
        self._store = Store(
            prepare_database(settings.database_url, settings.should_auto_migrate, app_name(self.app)),
            failing_threshold=settings.failing_threshold,
        )
        self._lease = LeaseKeeper(
            self._store, ttl=settings.lease_ttl, renew_interval=settings.lease_renew_interval
        )
        # The schedule rows are reconciled with beat_schedule by the lease holder only, when it
        # takes the lease (``_reconcile``): a standby never writes them.
        self._share = share = BeatShare(self._store, settings, self._lease.holder)
        log_schedules(len(self._config), settings.database_url)
        if settings.dispatch_enabled:
            self._dispatcher = Dispatcher(
                self.app,
                self._store,
                settings,
                may_run=lambda: self.lease.acting() or share.acting(),
                record=self._recorder.record,
                notified=self._listening,
            )
            self._dispatch_loop = BackgroundLoop("boundedbeat-dispatch", self._dispatcher.run)
            self._dispatch_loop.start()
            if self._store.is_postgres and settings.prepare_ahead > 0 and not share.partitioned:
                self._ahead = AheadTicker(
                    self.app,
                    self._store,
                    settings,
                    self._resolver,
                    claimer=self._dispatcher.name,
                    still_leading=self._lease.acting,
                )
        self._retention_loop = BackgroundLoop("boundedbeat-retention", self._run_retention)
        self._retention_loop.start()
        if self._store.is_postgres:
            channels = [SETTLED_CHANNEL, QUEUE_CHANNEL, SCHEDULES_CHANNEL]
            if share.partitioned:
                channels.append(BEATS_CHANNEL)
            self._listener = Listener(settings.database_url, channels, self._on_notify)
            self._listener.start()
        if settings.metrics_port is not None:
            self._metrics = serve_metrics(
                self._store.engine,
                host=settings.metrics_host,
                port=settings.metrics_port,
                refresh_interval=settings.metrics_refresh_interval,
                leader=self._lease.acting,
                unstarted_after=settings.unstarted_warning,
            )
        freeze_startup_heap()

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == BEATS_CHANNEL:
            if self._share is not None and self._share.heard(payload):
                self._wake.set()
        elif channel == QUEUE_CHANNEL:
            if self._dispatch_loop is not None:
                self._dispatch_loop.wake()
        else:
            if channel == SCHEDULES_CHANNEL and payload and self._resolver is not None:
                self._resolver.forget(payload)
            if channel == SETTLED_CHANNEL:
                self._alerts_may_wait = True
            self._stale = True
            self._wake.set()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass: keep the lease, emit due runs, reap, then wait for the next reason to look.

        Celery's SIGTERM handler calls :meth:`close` in this thread, wherever the pass is: in
        a tick's transaction, with schedule rows locked, the close would wait for the
        dispatcher and the last drain, and they for those rows, until the server ended the
        transaction. So the close waits for the pass to unwind (:meth:`close`), then runs.
        """
        self._ticking = threading.get_ident()
        try:
            return self._tick()
        finally:
            self._ticking = None
            if self._close_deferred:
                self._close_deferred = False
                self._close_now()
                raise SystemExit()

    def _tick(self) -> float:
        if self._store is None or self._lease is None or self._share is None:
            return float(self.max_interval)
        mono = time.monotonic()
        wait = min(self.settings.poll_interval if self._polling else self.max_interval, self.max_interval)
        leading = self._keep_lease() and self._reconcile()
        share, gained = self._share.keep(lambda what, exc: self._failed(what, exc, utcnow()), self._succeeded)
        self._stale = self._stale or gained  # a partition gained: its schedules are looked at at once
        if not leading and (share is None or not share.mine):
            self._wait(
                max(0.05, min(wait, self.lease.seconds_to_renewal(), self._share.seconds_to_next_look()))
            )
            return 0
        now = utcnow()
        if share is not None and not share.mine:
            result: TickResult | None = TickResult(now=now)  # the leader, with no partition of its own
        elif self._must_tick(now, mono):
            if self._tick_late(now):
                return 0  # the rest of what is due (not certain enough to claim) is looked at now
            # Cleared before the tick reads, never after: a notification that lands while it
            # runs keeps the flag and is acted on at the next look, not at the backstop.
            self._stale = False
            result = self._emit_due(now, share)
            if result is not None and result.emitted:
                gather(result, share, time.monotonic() - mono)
            if result is None:
                self._stale = True
                if self._tick_failures == 1:
                    # A tick that fails right after one worked most likely met a cut
                    # connection, which the pool has dropped: tick again now. Waiting the poll
                    # interval made every run due meanwhile that much late.
                    return 0
            else:
                self._known_due = result.next_due_at
                if self._ahead is not None:
                    self._ahead.saw(len(result.emitted))
                self._log_tick(result)
                if result.emitted:
                    self._runs_may_be_active = True
                    if self._dispatch_loop is not None:
                        self._dispatch_loop.wake()
                self._terminate_replaced(result.revoked)  # the tick has committed
                send_signals(on_ticked(result.outcomes, now))
                self._sweep_definitions(now, result)  # the tick's work is done: off its path
        else:
            result = TickResult(now=now, next_due_at=self._known_due)  # nothing can be due yet
        if leading:
            self._housekeep(mono, now)
        wait = min(self._next_wait(result, wait, leading=leading), self._share.seconds_to_next_look())
        if not self._tick_ahead(result, wait):
            self._wait(wait)
        return 0

    def _listening(self) -> bool:
        """Whether this beat's LISTEN connection is known to work now (its notifications arrive)."""
        return self._listener is not None and self._listener.listening

    @property
    def _polling(self) -> bool:
        """Whether changes must be looked for (SQLite, or while LISTEN is down) rather than heard."""
        return self.store.is_sqlite_like or not self._listening()

    def _must_tick(self, now: datetime, mono: float) -> bool:
        """Whether a tick transaction can find anything to do.

        On PostgreSQL every change that can make a schedule due sooner (a settle, a trigger, a
        pause, resume, add or update) sends a notification; without one since the last tick,
        nothing is due before the due time that tick saw, and an idle beat stays off the
        database. A look every minute whatever is the backstop.
        """
        if self._polling or self._stale or mono >= self._next_full_look_at:
            self._next_full_look_at = mono + FULL_LOOK_EVERY
            return True
        return self._known_due is not None and self._known_due <= now

    def _tick_ahead(self, result: TickResult | None, wait: float) -> bool:
        """Prepare the next tick if it falls due within ``wait`` (:mod:`.prepared`).

        Sleeps until ``prepare_ahead`` before the due time, prepares, and at the due time
        commits and publishes. Returns whether it took the wait over: then the beat looks again
        at once (for the due schedules that were not certain enough to prepare).
        """
        ahead = self._ahead
        due = None if result is None else result.next_due_at
        if ahead is None or due is None or ahead.lead <= 0:
            return False
        until = (due - utcnow()).total_seconds()
        if until <= 0 or until - ahead.lead > wait:
            return False
        if until > ahead.lead and self._wake.wait(until - ahead.lead):
            self._wake.clear()  # something changed meanwhile: look again first
            return True
        try:
            prepared, failed = self._run_ahead(ahead, due)
        except Exception as exc:
            self._failed("prepared tick", exc, utcnow())
            return True
        if prepared is None:
            # Never longer than the beat's own wait: a clock stepped back must not stall it.
            self._wait(min(wait, max(0.0, (due - utcnow()).total_seconds())))
            return True
        self._prepared_done(prepared, failed, due)
        return True

    def _tick_late(self, now: datetime) -> bool:
        """Tick what fell due before this look the way a prepared tick is published.

        A beat that is behind (its first look, which finds every new schedule due, or a
        tick too large to prepare in its lead) would otherwise commit the runs and leave
        them to the dispatcher loop, which claims them again and publishes them at about
        two thirds of the speed: each tick after the first then fell due before the beat was
        ready for it, and the beat took several ticks to catch up. Only the certain part is
        claimed this way (:func:`.prepared.certain`); the tick that follows decides the rest.
        Returns whether it ticked.
        """
        ahead = self._ahead
        late = self._known_due is not None and self._known_due <= now
        if ahead is None or not (late or self._first_look):
            return False
        self._first_look = False
        try:
            prepared, failed = self._run_ahead(ahead, now)
        except Exception as exc:
            self._failed("prepared tick", exc, now)
            return False  # the regular tick does the work
        if prepared is None:
            return False
        self._prepared_done(prepared, failed, now)
        return True

    def _run_ahead(self, ahead: AheadTicker, due: datetime) -> tuple[TickResult | None, bool]:
        """``ahead.run(due)``, and the close a signal handler asked for meanwhile, then SystemExit.

        The handler's own SystemExit normally ends the tick and Celery's beat closes after it;
        closing here too stops the beat even when an error raised while the tick unwound (a
        rollback on an interrupted connection) took the SystemExit's place.
        """
        try:
            return ahead.run(due, sorted(self._failing_rows))
        finally:
            if self._close_deferred:
                self._close_deferred = False
                self._close_now()
                raise SystemExit()

    def _prepared_done(self, prepared: TickResult, failed: bool, due: datetime) -> None:
        """After a tick committed and published by :class:`~.ahead.AheadTicker`."""
        self._succeeded("prepared tick")
        # The rest due at ``due`` is looked at now, by a regular tick that sets the due time.
        self._stale = self._runs_may_be_active = True
        self._known_due = None
        self._log_tick(prepared)
        send_signals(on_ticked(prepared.outcomes, due))
        if failed and self._dispatch_loop is not None:
            self._dispatch_loop.wake()
        # As after a regular tick: a beat catching up through prepared ticks (a million
        # schedules overdue) otherwise kept every definition it ticked.
        self._sweep_definitions(utcnow(), prepared)

    def _reconcile(self) -> bool:
        """Once per lease taken: bring the schedule rows in line with ``beat_schedule``.

        Only the holder writes schedule rows, so a standby started with another config (an
        older release during a rolling deploy) changes nothing, and two beats starting at
        once on an empty database never both insert the same rows. Nothing is emitted before
        the rows match this beat's config.
        """
        if self._reconciled:
            return True
        now = utcnow()
        try:
            report = self.store.sync_config(self._config.values(), now, self._rng)
        except Exception as exc:
            self._failed("reconcile", exc, now)
            return False
        self._succeeded("reconcile")
        self._reconciled = True
        logger.info(
            "celery_boundedbeat: %s reconciled %d schedule(s) from beat_schedule",
            self.lease.holder,
            len(self._config),
        )
        for name in (*report.changed, *report.removed):
            self.resolver.forget(name)
        return True

    def _emit_due(self, now: datetime, share: Share | None = None) -> TickResult | None:
        """The tick proper: every due schedule (of the share) in one transaction (``None`` if it failed)."""
        try:
            result = self.store.tick(
                self.resolver,
                now,
                self._rng,
                self.settings.tick_batch_size,
                expires_after=self.settings.start_timeout,
                share=share,
            )
        except Exception as exc:
            self._tick_failures += 1
            self._failed("tick", exc, now)
            return None
        self._tick_failures = 0
        self._succeeded("tick")
        return result

    def _terminate_replaced(self, run_ids: list[str]) -> None:
        """Ask the workers to terminate the runs a committed tick replaced (``replace``).

        The rows are settled already; a worker that cannot terminate (threads, solo) or never
        hears this lets the task finish, and its late outcome changes nothing.
        """
        if not run_ids:
            return
        logger.info("celery_boundedbeat: replaced %d active run(s): %s", len(run_ids), ", ".join(run_ids))
        try:
            self.app.control.revoke(run_ids, terminate=True)
        except Exception as exc:  # a broker hiccup: the runs are settled, only the tasks go on
            logger.warning(
                "celery_boundedbeat: could not ask the workers to terminate replaced run(s) %s (%s: %s)",
                ", ".join(run_ids),
                type(exc).__name__,
                exc,
            )

    def _log_tick(self, result: TickResult) -> None:
        log_tick(result, self._failing_rows)

    def _next_wait(self, result: TickResult | None, wait: float, *, leading: bool = True) -> float:
        """Seconds until the next reason to look: a due schedule, the lease, the reaper.

        A partitioned beat that does not hold the lease has no reaper to run and only its next
        attempt at the lease to keep: counting the leader's reasons, which are always due for
        it, it looked again at once and spun a whole core between its ticks.
        """
        if result is not None and result.next_due_at is not None:
            until_due = (result.next_due_at - utcnow()).total_seconds()
            if result.emitted and len(result.outcomes) >= self.settings.tick_batch_size:
                until_due = 0
            elif not result.emitted and result.now is not None and result.next_due_at <= result.now:
                until_due = wait  # still due after a tick that looked at it: do not spin
            # A row due after the tick's ``now`` fell due while it ran: look again at once.
            wait = min(wait, max(until_due, 0.0))
        if not leading:
            return min(wait, max(self.lease.seconds_to_renewal(), 0.0))
        return min(wait, self.lease.seconds_to_next_look(), max(self._next_reap_at - time.monotonic(), 0.0))

    def _wait(self, seconds: float) -> None:
        """Sleep until ``seconds`` pass or a completion / trigger notice wakes the beat."""
        if seconds > 0:
            self._wake.wait(seconds)
        self._wake.clear()

    # -- leader lease ---------------------------------------------------------------------

    def _keep_lease(self) -> bool:
        """Renew the lease when due, log and act on what changed; whether this beat may act."""
        turn = self.lease.keep()
        if turn.renewal_started is not None:
            if turn.error is not None:
                self._failed("lease renewal", turn.error, turn.renewal_started)
            else:
                self._succeeded("lease renewal")
        for event in turn.events:
            self._on_lease_event(event, turn)
        return turn.acting

    def _on_lease_event(self, event: LeaseEvent, turn: LeaseTurn) -> None:
        holder = self.lease.holder
        if event is not LeaseEvent.STANDING_BY:
            self._reconciled = False  # the next holder term starts with a reconcile
        if event is LeaseEvent.GAINED:
            # Another beat's runs and changes made before this term: look at everything once.
            self._stale = self._runs_may_be_active = self._alerts_may_wait = True
            self._rejectable_at = None
            self._first_look = True
            if self._dispatch_loop is not None:
                self._dispatch_loop.wake()
            if self._retention_loop is not None:
                self._retention_loop.wake()  # a pass as soon as this beat leads
        log_lease_event(event, holder, turn.other_holder, self.settings.lease_renew_interval)

    # -- shutdown and banner ----------------------------------------------------------------

    def close(self) -> None:
        """Stop the dispatcher and listener, give up the lease so a standby takes over at once."""
        if self._closed:
            return
        if self._ticking == threading.get_ident() or (self._ahead is not None and self._ahead.running_here()):
            # A signal handler (Celery's SIGTERM handler) that interrupted a pass of this beat
            # in this thread: the SystemExit it raises next unwinds the pass, which rolls back
            # its transaction (a prepared tick records what the broker took and gives back the
            # rest), with no row left locked; the close follows (:meth:`tick`, :meth:`_run_ahead`).
            self._close_deferred = True
            return
        self._close_now()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        grace = self.settings.shutdown_grace if self._settings else 1.0
        if self._dispatch_loop is not None and not self._dispatch_loop.stop(grace):
            logger.warning("celery_boundedbeat: dispatcher did not stop within %g s; abandoning it", grace)
        elif self._dispatcher is not None:
            last_drain(self._dispatcher, grace)
        if self._share is not None:
            self._share.leave()
        if self._retention_loop is not None and not self._retention_loop.stop(grace):
            logger.warning("celery_boundedbeat: retention did not stop within %g s; abandoning it", grace)
        if self._listener is not None:
            self._listener.stop()
        if self._metrics is not None:
            self._metrics.stop()
        if self._lease is not None:
            try:
                released: bool | None = self._lease.release()
            except Exception:
                released = None
                logger.debug("celery_boundedbeat: could not release the lease", exc_info=True)
            log_stopped(released, self.settings.lease_ttl)
        super().close()

    def sync(self) -> None:
        """Nothing to flush: every state change is already committed."""

    @property
    def schedule(self) -> dict[str, Any]:
        return {}

    @property
    def info(self) -> str:
        """The banner's lines (Celery prints them from a second, lazy scheduler before setup)."""
        settings = self.settings
        configured = len(self.app.conf.beat_schedule or {})
        return banner_info(settings, configured, runtime_schedule_count(settings.database_url))
