"""Worker-side run tracking through Celery signals, plus the per-process heartbeat.

Receivers are module-level and connected once per app by :func:`install` with a
``dispatch_uid``. Celery swallows receiver exceptions, so every receiver logs its own
failures loudly; a settle that cannot reach the database is kept and retried by the
heartbeat thread, so an outcome is never dropped.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery import Celery, signals
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from .engine import get_engine
from .enums import RunState
from .exceptions import NotInScheduledRunError
from .settings import Settings
from .store import MAX_RUN_TIME_HEADER, RUN_HEADER, Store, utcnow

logger = logging.getLogger("celery_boundedbeat.tracking")

_trackers: weakref.WeakKeyDictionary[Celery, Tracker] = weakref.WeakKeyDictionary()
_local = threading.local()


@dataclass(frozen=True, slots=True)
class _PendingSettle:
    run_id: str
    state: RunState
    at: datetime
    error: str | None
    stop: bool


class Tracker:
    """Per-app, per-process tracking state: store, active runs, heartbeat thread."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._settings: Settings | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._active: set[str] = set()
        self._settled: deque[str] = deque(maxlen=1024)
        self._stop_requested: set[str] = set()
        self._retry: deque[_PendingSettle] = deque()
        self._hb_thread: threading.Thread | None = None
        self._hb_wake = threading.Event()
        self._rng = random.Random()
        self._last_heartbeat = 0.0

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_conf(self.app.conf)
        return self._settings

    @property
    def store(self) -> Store:
        return Store(get_engine(self.settings.database_url))

    @property
    def process(self) -> str:
        return f"{socket.gethostname()}:{os.getpid()}"

    def _after_fork_check(self) -> None:
        if self._pid != os.getpid():
            # A forked pool child: inherited threads and sets belong to the parent.
            self._pid = os.getpid()
            self._active = set()
            self._retry = deque()
            self._hb_thread = None
            self._hb_wake = threading.Event()

    # -- lifecycle --------------------------------------------------------------------

    def started(self, run_id: str, hostname: str, max_run_time: float | None) -> None:
        self._after_fork_check()
        with self._lock:
            self._active.add(run_id)
        self._ensure_heartbeat()
        now = utcnow()
        try:
            mono = time.monotonic()
            if mono - self._last_heartbeat >= self.settings.heartbeat_interval / 2:
                self._last_heartbeat = mono
                self.store.heartbeat(self.process, hostname, os.getpid(), now)
            self.store.start_run(
                run_id, worker=hostname, process=self.process, now=now, max_run_time=max_run_time
            )
        except Exception:
            logger.exception("celery_boundedbeat: could not record the start of run %s", run_id)

    def settle(self, run_id: str, state: RunState, error: str | None = None) -> None:
        self._after_fork_check()
        if run_id in self._settled:
            return
        self._settled.append(run_id)
        with self._lock:
            self._active.discard(run_id)
        stop = run_id in self._stop_requested
        self._stop_requested.discard(run_id)
        item = _PendingSettle(run_id=run_id, state=state, at=utcnow(), error=error, stop=stop)
        if not self._write(item):
            self._retry.append(item)
            self._ensure_heartbeat()

    def _write(self, item: _PendingSettle) -> bool:
        try:
            done = self.store.settle_run(
                item.run_id, item.state, now=item.at, error=item.error, stop=item.stop, rng=self._rng
            )
        except Exception:
            logger.exception(
                "celery_boundedbeat: could not settle run %s as %s; will retry", item.run_id, item.state.value
            )
            return False
        if done is not None:
            logger.info(
                "celery_boundedbeat: run %s of %s settled %s%s",
                item.run_id,
                done.schedule,
                item.state.value,
                " (schedule stopped by the task)" if item.stop else "",
            )
        return True

    def request_stop(self, run_id: str) -> None:
        self._stop_requested.add(run_id)

    # -- heartbeat ----------------------------------------------------------------------

    def _ensure_heartbeat(self) -> None:
        if self._hb_thread is not None and self._hb_thread.is_alive():
            return
        self._hb_thread = threading.Thread(
            target=self._heartbeat_loop, name="boundedbeat-heartbeat", daemon=True
        )
        self._hb_thread.start()

    def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval
        hostname = socket.gethostname()
        while True:
            self._hb_wake.wait(interval)
            self._hb_wake.clear()
            while self._retry:
                item = self._retry[0]
                if not self._write(item):
                    break
                self._retry.popleft()
            with self._lock:
                busy = bool(self._active)
            if busy:
                try:
                    self._last_heartbeat = time.monotonic()
                    self.store.heartbeat(self.process, hostname, os.getpid(), utcnow())
                except Exception:
                    logger.warning("celery_boundedbeat: heartbeat write failed; retrying", exc_info=True)


def _tracker_for(task: Any) -> Tracker | None:
    app = getattr(task, "app", None)
    return _trackers.get(app) if app is not None else None


def _run_id_of(task: Any) -> str | None:
    request = getattr(task, "request", None)
    if request is None:
        return None
    run_id = request.get(RUN_HEADER) if hasattr(request, "get") else None
    if run_id is None:
        headers = getattr(request, "headers", None) or {}
        run_id = headers.get(RUN_HEADER)
    return str(run_id) if run_id else None


def _error_text(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    return f"{type(exc).__name__}: {exc}"[:4000]


_Receiver = Callable[..., None]


def _guard(name: str) -> Callable[[_Receiver], _Receiver]:
    def wrap(fn: _Receiver) -> _Receiver:
        def receiver(*args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except Exception:
                logger.exception("celery_boundedbeat: %s handler failed", name)

        receiver.__name__ = fn.__name__
        return receiver

    return wrap


@_guard("task_prerun")
def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
    task = task or sender
    tracker = _tracker_for(task)
    run_id = _run_id_of(task)
    if tracker is None or run_id is None:
        return
    _local.run_id = run_id
    request = task.request
    max_run_time = request.get(MAX_RUN_TIME_HEADER) if hasattr(request, "get") else None
    tracker.started(
        run_id, request.hostname or socket.gethostname(), float(max_run_time) if max_run_time else None
    )


@_guard("task_success")
def _on_success(sender: Any = None, result: Any = None, **_: Any) -> None:
    tracker = _tracker_for(sender)
    run_id = _run_id_of(sender)
    if tracker is not None and run_id is not None:
        tracker.settle(run_id, RunState.COMPLETED)


@_guard("task_failure")
def _on_failure(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
) -> None:
    tracker = _tracker_for(sender)
    run_id = _run_id_of(sender)
    if tracker is None or run_id is None:
        return
    if isinstance(exception, SoftTimeLimitExceeded | TimeLimitExceeded):
        tracker.settle(run_id, RunState.TIMED_OUT, _error_text(exception))
    else:
        tracker.settle(run_id, RunState.FAILED, _error_text(exception))


@_guard("task_postrun")
def _on_postrun(
    sender: Any = None,
    task_id: str | None = None,
    task: Any = None,
    state: str | None = None,
    retval: Any = None,
    **_: Any,
) -> None:
    task = task or sender
    tracker = _tracker_for(task)
    run_id = _run_id_of(task)
    _local.run_id = None
    if tracker is None or run_id is None or state in (None, "RETRY"):
        return
    # A safety net: success/failure handlers normally settled it already (then a no-op).
    if state == "SUCCESS":
        tracker.settle(run_id, RunState.COMPLETED)
    elif state == "FAILURE":
        tracker.settle(
            run_id, RunState.FAILED, _error_text(retval if isinstance(retval, BaseException) else None)
        )
    elif state == "REVOKED":
        tracker.settle(run_id, RunState.REVOKED, "revoked")
    else:
        tracker.settle(run_id, RunState.FAILED, f"ended in state {state}")


@_guard("task_revoked")
def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
) -> None:
    tracker = _tracker_for(sender)
    if tracker is None or request is None:
        return
    headers = getattr(request, "request_dict", None) or {}
    # The task id is the run id; a task that is not ours finds no active run (a no-op).
    run_id = headers.get(RUN_HEADER) or getattr(request, "id", None)
    if run_id is None:
        return
    if expired:
        tracker.settle(str(run_id), RunState.REJECTED, "expired before it started")
    else:
        tracker.settle(str(run_id), RunState.REVOKED, "terminated" if terminated else "revoked")


@_guard("task_rejected")
def _on_rejected(sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    tracker = _trackers.get(app) if app is not None else None
    headers = getattr(message, "headers", None) or {}
    run_id = headers.get(RUN_HEADER)
    if tracker is not None and run_id:
        # The worker refused the message (unknown task, bad payload): it will never run.
        tracker.settle(str(run_id), RunState.REJECTED, _error_text(exc) if exc else "rejected by the worker")


@_guard("task_internal_error")
def _on_internal_error(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
) -> None:
    tracker = _tracker_for(sender)
    run_id = _run_id_of(sender)
    if tracker is not None and run_id is not None:
        tracker.settle(run_id, RunState.FAILED, "internal error: " + _error_text(exception))


_RECEIVERS: list[tuple[Any, Any]] = [
    (signals.task_prerun, _on_prerun),
    (signals.task_success, _on_success),
    (signals.task_failure, _on_failure),
    (signals.task_postrun, _on_postrun),
    (signals.task_revoked, _on_revoked),
    (signals.task_rejected, _on_rejected),
    (signals.task_internal_error, _on_internal_error),
]


def install(app: Celery) -> None:
    """Connect run tracking for ``app`` in every process that imports it (idempotent)."""
    if app not in _trackers:
        _trackers[app] = Tracker(app)
    for signal, receiver in _RECEIVERS:
        signal.connect(receiver, weak=False, dispatch_uid=f"celery_boundedbeat.{receiver.__name__}")


def stop_schedule() -> None:
    """End the current run's schedule after this run finishes (persisted; ``resume`` lifts it)."""
    run_id = getattr(_local, "run_id", None)
    if run_id is None:
        raise NotInScheduledRunError(
            "stop_schedule() must be called inside a task run emitted by celery_boundedbeat "
            "(is celery_boundedbeat.install(app) called in the worker's app module?)"
        )
    for tracker in list(_trackers.values()):
        tracker.request_stop(run_id)
