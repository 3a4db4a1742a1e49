"""The Celery beat scheduler class: ``celery beat -S celery_boundedbeat.Scheduler``.

Beat's loop calls :meth:`Scheduler.tick`; each tick handles every due schedule in one
transaction (an index range scan on ``next_due_at``, never a walk over all schedules),
wakes the dispatcher, and then waits until the next due time, a completion notice, or the
poll interval, whichever comes first.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

from celery import Celery, beat

from .dispatch import Dispatcher
from .engine import get_engine, safe_url
from .exceptions import BoundedBeatError, ConfigurationError
from .migrate import require_current, upgrade
from .notify import Listener
from .policy import EntrySpec
from .runtime import BackgroundLoop
from .settings import Settings
from .store import QUEUE_CHANNEL, SETTLED_CHANNEL, Store, TickResult, utcnow

logger = logging.getLogger("celery_boundedbeat.beat")

LEASE_NAME = "beat"
#: Exit status when the configuration is invalid (EX_CONFIG).
EX_CONFIG = 78


class Scheduler(beat.Scheduler):  # type: ignore[misc]
    """Bounded policies, SQL run history, a DB-backed queue and a leader lease."""

    #: Seconds between reaper passes are the heartbeat interval; retention runs hourly.
    retention_every: float = 3600.0

    def __init__(self, app: Celery, *args: Any, **kwargs: Any) -> None:
        # Attributes first: the base __init__ calls setup_schedule() at its end.
        self._settings: Settings | None = None
        self._store: Store | None = None
        self._specs: dict[str, EntrySpec] = {}
        self._rng = random.Random()
        self._wake = threading.Event()
        self._dispatch_loop: BackgroundLoop | None = None
        self._dispatcher: Dispatcher | None = None
        self._listener: Listener | None = None
        self._holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._leader_until = 0.0
        self._next_lease_at = 0.0
        self._next_reap_at = 0.0
        self._next_retention_at = 0.0
        self._was_leader = False
        self._closed = False
        kwargs.pop("schedule_filename", None)
        super().__init__(app, *args, **kwargs)

    # -- the celery.beat contract -------------------------------------------------------

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_conf(self.app.conf)
        return self._settings

    @property
    def store(self) -> Store:
        if self._store is None:
            raise BoundedBeatError("the scheduler is not set up (setup_schedule() not called)")
        return self._store

    def setup_schedule(self) -> None:
        """Validate every entry, prepare the database, reconcile schedules, start helpers."""
        try:
            settings = self.settings
            from .entries import build_specs

            self._specs = build_specs(self.app, settings.default_policy)
        except ConfigurationError as exc:
            logger.critical("%s", exc)
            raise SystemExit(EX_CONFIG) from None
        engine = get_engine(settings.database_url)
        if settings.should_auto_migrate:
            upgrade(engine)
        else:
            try:
                require_current(engine, safe_url(settings.database_url))
            except BoundedBeatError as exc:
                logger.critical("%s", exc)
                raise SystemExit(EX_CONFIG) from None
        self._store = Store(engine)
        self._store.sync_config(self._specs.values(), utcnow(), self._rng)
        logger.info(
            "celery_boundedbeat: %d schedule(s) from %s; database %s",
            len(self._specs),
            "beat_schedule",
            safe_url(settings.database_url),
        )
        if settings.dispatch_enabled:
            self._dispatcher = Dispatcher(self.app, self._store, settings, may_run=self._is_leader)
            self._dispatch_loop = BackgroundLoop("boundedbeat-dispatch", self._dispatcher.run)
            self._dispatch_loop.start()
        if self._store.is_postgres:
            self._listener = Listener(
                settings.database_url, [SETTLED_CHANNEL, QUEUE_CHANNEL], self._on_notify
            )
            self._listener.start()

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == QUEUE_CHANNEL:
            if self._dispatch_loop is not None:
                self._dispatch_loop.wake()
        else:
            self._wake.set()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass: keep the lease, emit due runs, reap, then wait for the next reason to look."""
        if self._store is None:
            return float(self.max_interval)
        mono = time.monotonic()
        wait = min(
            self.settings.poll_interval if self.store.is_sqlite_like else self.max_interval, self.max_interval
        )
        if mono >= self._next_lease_at:
            self._renew_lease(mono)
        if not self._is_leader():
            self._wake.wait(max(0.05, min(wait, self._next_lease_at - time.monotonic())))
            self._wake.clear()
            return 0
        now = utcnow()
        result: TickResult | None = None
        try:
            result = self.store.tick(self._specs, now, self._rng, self.settings.tick_batch_size)
        except Exception:
            logger.exception("celery_boundedbeat: tick failed; retrying")
            self._record_failure("tick", now)
        if result is not None:
            self._log_tick(result)
            if result.emitted and self._dispatch_loop is not None:
                self._dispatch_loop.wake()
        if mono >= self._next_reap_at:
            self._next_reap_at = mono + self.settings.heartbeat_interval
            self._reap(now)
        if self.settings.retention_days is not None and mono >= self._next_retention_at:
            self._next_retention_at = mono + self.retention_every
            try:
                self.store.purge(now - timedelta(days=self.settings.retention_days))
            except Exception:
                logger.exception("celery_boundedbeat: retention purge failed")
        if result is not None and result.next_due_at is not None:
            until_due = (result.next_due_at - utcnow()).total_seconds()
            if result.emitted and len(result.outcomes) >= self.settings.tick_batch_size:
                until_due = 0
            if until_due <= 0 and not result.emitted:
                until_due = wait  # due rows this beat has no definition for: do not spin
            wait = min(wait, max(until_due, 0.0))
        wait = min(
            wait,
            max(self._next_lease_at - time.monotonic(), 0.0),
            max(self._next_reap_at - time.monotonic(), 0.0),
        )
        if wait > 0:
            self._wake.wait(wait)
        self._wake.clear()
        return 0

    def _log_tick(self, result: TickResult) -> None:
        for run in result.emitted:
            logger.info(
                "celery_boundedbeat: emitted %s run %s (scheduled for %s, drift %d ms%s)",
                run.schedule,
                run.id,
                run.scheduled_for.isoformat(),
                run.drift_ms,
                ", overlapping" if run.overlap else "",
            )
        for name, outcome in result.outcomes.items():
            if outcome.skipped:
                logger.info(
                    "celery_boundedbeat: %s skipped %d tick(s): every slot busy", name, outcome.skipped
                )
            if outcome.coalesced:
                logger.info("celery_boundedbeat: %s coalesced missed ticks into one pending run", name)

    def _reap(self, now: datetime) -> None:
        try:
            settled = self.store.reap(
                now,
                heartbeat_interval=self.settings.heartbeat_interval,
                start_timeout=self.settings.start_timeout,
                rng=self._rng,
            )
        except Exception:
            logger.exception("celery_boundedbeat: reaper failed; retrying")
            self._record_failure("reap", now)
            return
        for run in settled:
            logger.warning(
                "celery_boundedbeat: run %s of %s settled %s by the reaper",
                run.run_id,
                run.schedule,
                run.state.value,
            )

    def _record_failure(self, loop: str, started: datetime) -> None:
        try:
            exc = sys.exc_info()[1]
            error = f"{type(exc).__name__}: {exc}" if exc is not None else None
            self.store.record_iteration(loop, self._holder, started, utcnow(), error)
        except Exception:
            logger.debug("celery_boundedbeat: could not record failed %s iteration", loop, exc_info=True)

    # -- leader lease ---------------------------------------------------------------------

    def _renew_lease(self, mono: float) -> None:
        settings = self.settings
        self._next_lease_at = mono + settings.lease_renew_interval
        try:
            held = self.store.acquire_lease(LEASE_NAME, self._holder, utcnow(), settings.lease_ttl)
        except Exception:
            logger.warning("celery_boundedbeat: could not renew the beat lease", exc_info=True)
            held = False
            self._next_lease_at = mono + min(1.0, settings.lease_renew_interval)
        if held:
            # Stop acting a renew interval before the lease could expire for the others.
            self._leader_until = mono + max(settings.lease_ttl - settings.lease_renew_interval, 0.5)
            if not self._was_leader:
                logger.info("celery_boundedbeat: %s holds the beat lease; scheduling", self._holder)
                self._was_leader = True
                if self._dispatch_loop is not None:
                    self._dispatch_loop.wake()
        elif self._was_leader and not self._is_leader():
            logger.warning("celery_boundedbeat: lost the beat lease; standing by")
            self._was_leader = False
        elif not self._was_leader and self._next_lease_at - settings.lease_renew_interval == mono:
            logger.debug("celery_boundedbeat: another beat holds the lease; standing by")

    def _is_leader(self) -> bool:
        return time.monotonic() < self._leader_until

    # -- shutdown and banner ----------------------------------------------------------------

    def close(self) -> None:
        """Stop the dispatcher and listener, give up the lease so a standby takes over at once."""
        if self._closed:
            return
        self._closed = True
        grace = self.settings.shutdown_grace if self._settings else 1.0
        if self._dispatch_loop is not None and not self._dispatch_loop.stop(grace):
            logger.warning("celery_boundedbeat: dispatcher did not stop within %g s; abandoning it", grace)
        if self._listener is not None:
            self._listener.stop()
        if self._store is not None and self._was_leader:
            try:
                self.store.release_lease(LEASE_NAME, self._holder)
            except Exception:
                logger.debug("celery_boundedbeat: could not release the lease", exc_info=True)
        super().close()

    def sync(self) -> None:
        """Nothing to flush: every state change is already committed."""

    @property
    def schedule(self) -> dict[str, Any]:
        return {}

    @property
    def info(self) -> str:
        settings = self.settings
        lines = [
            f"database -> {safe_url(settings.database_url)}",
            ". dispatcher -> "
            + ("in beat" if settings.dispatch_enabled else "external (boundedbeat dispatch)"),
            f". entries -> {len(self.app.conf.beat_schedule or {})}",
        ]
        return "\n".join(lines)
