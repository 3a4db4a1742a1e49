"""Worker-side run tracking through Celery signals, plus the per-process heartbeat.

Receivers are module-level and connected once per app by :func:`install` with a
``dispatch_uid``. Celery swallows receiver exceptions, so every receiver logs its own
failures loudly. A start or an outcome that cannot reach the database (an outage) is kept
in order and retried by the heartbeat thread every second, so an outcome is
never dropped while the worker process lives; the database's guarded transitions make a
retried write that had in fact been committed a no-op.

Heartbeats: each worker process with at least one active run writes one row of
``boundedbeat_workers`` per ``boundedbeat_heartbeat_interval`` (one statement per process,
however many runs it has); the beat's reaper settles the runs of a process whose heartbeat
is older than three intervals as ``lost``. A prefork child killed mid-run is reported at
once by the pool's ``WorkerLostError`` (settled ``lost`` by the parent process); a whole
worker killed is found by the reaper.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery import Celery, signals
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError

from .engine import get_engine
from .enums import RunState
from .exceptions import NotInScheduledRunError
from .faults import is_outage
from .messages import MAX_RUN_TIME_HEADER, RUN_HEADER, error_text
from .runtime import OutageLog
from .settings import Settings
from .store import Settled, Store, utcnow

logger = logging.getLogger("celery_boundedbeat.tracking")

_trackers: weakref.WeakKeyDictionary[Celery, Tracker] = weakref.WeakKeyDictionary()
_local = threading.local()


#: Task ids remembered by a worker's parent process, to name the run of a pool failure.
_KNOWN_TASKS = 4096
#: Seconds between attempts to write kept starts and outcomes while the database is away.
_RETRY_EVERY = 1.0


@dataclass(frozen=True, slots=True)
class _PendingStart:
    run_id: str
    worker: str
    at: datetime
    #: Seconds after the start when the reaper may call the run timed out (its hard limit).
    limit: float | None


@dataclass(frozen=True, slots=True)
class _PendingSettle:
    run_id: str
    state: RunState
    at: datetime
    error: str | None
    stop: bool


_Pending = _PendingStart | _PendingSettle


class Tracker:
    """Per-app, per-process tracking state: store, active runs, pending writes, heartbeat thread."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._settings: Settings | None = None
        self._pid = -1
        self._settled: deque[str] = deque(maxlen=1024)
        self._stop_requested: set[str] = set()
        #: Task names already reported as unknown (logged once per process).
        self._unknown_names: set[str] = set()
        self._rng = random.Random()
        self._last_heartbeat = 0.0
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """What belongs to one process: a forked pool child starts these afresh."""
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._active: set[str] = set()
        #: Starts and outcomes not yet written (database unreachable), oldest first.
        self._retry: deque[_Pending] = deque()
        #: task id -> run id of messages this process received (a prefork parent names the
        #: run of a child that died or hit its hard time limit from these).
        self._known: OrderedDict[str, str] = OrderedDict()
        self._hb_thread: threading.Thread | None = None
        self._hb_wake = threading.Event()
        self._writes = OutageLog(logger, "recording runs in the database")
        self._beats = OutageLog(logger, "the worker heartbeat")

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
            # A forked pool child: inherited threads, sets and locks belong to the parent.
            self._pid = os.getpid()
            self._reset_process_state()

    # -- lifecycle --------------------------------------------------------------------

    def received(self, task_id: str, run_id: str) -> None:
        """Remember which run a received message belongs to (bounded)."""
        self._after_fork_check()
        with self._lock:
            self._known[task_id] = run_id
            while len(self._known) > _KNOWN_TASKS:
                self._known.popitem(last=False)

    def run_of_task(self, task_id: str | None) -> str | None:
        if task_id is None:
            return None
        self._after_fork_check()
        with self._lock:
            return self._known.get(task_id)

    def started(self, run_id: str, hostname: str, limit: float | None) -> None:
        """A run began here: vouch for it by heartbeat and record its start (now or later)."""
        self._after_fork_check()
        with self._lock:
            self._active.add(run_id)
        self._ensure_heartbeat()
        self._submit(_PendingStart(run_id=run_id, worker=hostname, at=utcnow(), limit=limit))

    def settle(self, run_id: str, state: RunState, error: str | None = None) -> None:
        """A run ended here (the first report of it in this process wins)."""
        self._after_fork_check()
        with self._lock:
            self._active.discard(run_id)
            self._known.pop(run_id, None)
        if run_id in self._settled:
            return
        self._settled.append(run_id)
        stop = run_id in self._stop_requested
        self._stop_requested.discard(run_id)
        self._submit(_PendingSettle(run_id=run_id, state=state, at=utcnow(), error=error, stop=stop))

    def _submit(self, item: _Pending) -> None:
        # Earlier writes still waiting for the database go first: a start before its outcome.
        if self._retry or not self._write(item):
            self._retry.append(item)
            self._ensure_heartbeat()
            # The heartbeat thread may be in a full-interval sleep: retry on the short cadence.
            self._hb_wake.set()

    def _write(self, item: _Pending) -> bool:
        """Write one start or outcome; False only when the database is unreachable (retry later).

        Any other failure is a data error: retrying the same item would fail forever and hold
        every later write of this process behind it. The item is written once more with what
        can be recorded (no error text), and otherwise dropped with one loud log line.
        """
        try:
            done = self._apply(item)
        except Exception as exc:
            if is_outage(exc):
                self._writes.failed(exc)
                return False
            try:
                done = self._write_despite(item, exc)
            except Exception as again:  # only an outage gets out: keep the item for a retry
                self._writes.failed(again)
                return False
        self._writes.succeeded()
        self._log_written(item, done)
        return True

    def _apply(self, item: _Pending) -> Settled | None:
        if isinstance(item, _PendingStart):
            self._write_start(item)
            return None
        return self.store.settle_run(
            item.run_id,
            item.state,
            now=item.at,
            error=item.error,
            stop=item.stop,
            rng=self._rng,
            late=True,
        )

    def _write_despite(self, item: _Pending, exc: Exception) -> Settled | None:
        """A data error: record the outcome without its error text, or give the item up."""
        logger.error(
            "celery_boundedbeat: the database refused to record %s of run %s (a data error, not retried)",
            "the start" if isinstance(item, _PendingStart) else "the outcome",
            item.run_id,
            exc_info=exc,
        )
        if isinstance(item, _PendingSettle) and item.error is not None:
            bare = _PendingSettle(
                run_id=item.run_id,
                state=item.state,
                at=item.at,
                error=f"(error text not recordable: {type(exc).__name__})",
                stop=item.stop,
            )
            try:
                return self._apply(bare)
            except Exception as again:
                if is_outage(again):
                    raise
                logger.error("celery_boundedbeat: run %s: outcome dropped", item.run_id, exc_info=again)
        return None

    @staticmethod
    def _log_written(item: _Pending, done: Settled | None) -> None:
        if not isinstance(item, _PendingSettle):
            return
        if done is not None:
            logger.info(
                "celery_boundedbeat: run %s of %s settled %s%s",
                item.run_id,
                done.schedule,
                item.state.value,
                " (schedule stopped by the task)" if item.stop else "",
            )
        else:
            logger.info(
                "celery_boundedbeat: run %s was already settled; its %s outcome is not counted again",
                item.run_id,
                item.state.value,
            )

    def _write_start(self, item: _PendingStart) -> None:
        mono = time.monotonic()
        if mono - self._last_heartbeat >= self.settings.heartbeat_interval / 2:
            # A process's first run: its heartbeat row exists before the run shows started.
            self.store.heartbeat(self.process, socket.gethostname(), os.getpid(), utcnow())
            self._last_heartbeat = mono
        self.store.start_run(
            item.run_id, worker=item.worker, process=self.process, now=item.at, max_run_time=item.limit
        )

    def unknown_task(self, run_id: str, name: str) -> None:
        """A run whose task this worker does not know: it settles ``rejected`` now, not at a timeout."""
        if name not in self._unknown_names:
            self._unknown_names.add(name)
            logger.error(
                "celery_boundedbeat: task %r is not registered in this worker; its runs settle rejected "
                "(is the task module imported by the worker's app?)",
                name,
            )
        self.settle(run_id, RunState.REJECTED, f"unknown task {name!r}: not registered in the worker")

    def request_stop(self, run_id: str) -> None:
        self._stop_requested.add(run_id)

    def flush(self) -> bool:
        """Write pending starts and outcomes in order; False if some are still pending."""
        with self._flush_lock:  # the heartbeat thread and a shutdown must not pop each other's item
            while self._retry:
                if not self._write(self._retry[0]):
                    return False
                self._retry.popleft()
            return True

    def shutdown(self) -> None:
        """The process is exiting: one last attempt at what it kept; say loudly what is lost."""
        if self._pid != os.getpid() or not self._retry:
            return
        if not self.flush():
            logger.error(
                "celery_boundedbeat: %d run start(s)/outcome(s) could not be written before this process "
                "exits; the beat's reaper will settle those runs lost",
                len(self._retry),
            )

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
            # Pending writes are retried every second (cheap while the database refuses
            # connections), so outcomes land soon after it returns; heartbeats keep their period.
            self._hb_wake.wait(min(interval, _RETRY_EVERY) if self._retry else interval)
            self._hb_wake.clear()
            try:
                self.flush()
                with self._lock:
                    busy = bool(self._active)
                if busy and time.monotonic() - self._last_heartbeat >= interval * 0.9:
                    try:
                        self.store.heartbeat(self.process, hostname, os.getpid(), utcnow())
                    except Exception as exc:
                        self._beats.failed(exc)
                    else:
                        self._last_heartbeat = time.monotonic()
                        self._beats.succeeded()
            except Exception:  # never let the thread die: it carries the pending outcomes
                logger.exception("celery_boundedbeat: heartbeat loop iteration failed")


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
    tracker.started(run_id, request.hostname or socket.gethostname(), _time_limit(request))


def _time_limit(request: Any) -> float | None:
    """Seconds after its start when a run is past saving: its hard time limit, else ``max_run_time``.

    The reaper settles a run still active then as ``timed_out``; until then the pool's own soft
    limit (the task may clean up) and hard limit (prefork kills the child) have their turn.
    """
    limits = getattr(request, "timelimit", None) or (None, None)
    hard = limits[0] if isinstance(limits, list | tuple) and limits else None
    if hard:
        return float(hard)
    max_run_time = request.get(MAX_RUN_TIME_HEADER) if hasattr(request, "get") else None
    return float(max_run_time) if max_run_time else None


def _remembered_run(sender: Any, task_id: str | None) -> tuple[Tracker | None, str | None]:
    """Tracker and run id of a task signal, also in a prefork parent (which has no task context)."""
    tracker = _tracker_for(sender)
    if tracker is None:
        return None, None
    return tracker, _run_id_of(sender) or tracker.run_of_task(task_id)


@_guard("task_received")
def _on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    app = getattr(getattr(request, "task", None), "app", None) or getattr(sender, "app", None)
    tracker = _trackers.get(app) if app is not None else None
    if tracker is None or request is None:
        return
    headers = getattr(request, "request_dict", None) or {}
    run_id = headers.get(RUN_HEADER)
    task_id = getattr(request, "id", None)
    if run_id and task_id:
        tracker.received(str(task_id), str(run_id))


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
    # In a prefork parent (hard time limit, a child that died) the task has no request
    # context: the run is found from the message the parent received.
    tracker, run_id = _remembered_run(sender, task_id)
    if tracker is None or run_id is None:
        return
    if isinstance(exception, SoftTimeLimitExceeded | TimeLimitExceeded):
        tracker.settle(run_id, RunState.TIMED_OUT, error_text(exception))
    elif isinstance(exception, WorkerLostError):
        tracker.settle(run_id, RunState.LOST, "worker process died: " + error_text(exception))
    else:
        tracker.settle(run_id, RunState.FAILED, error_text(exception))


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
            run_id, RunState.FAILED, error_text(retval if isinstance(retval, BaseException) else None)
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
        tracker.settle(str(run_id), RunState.REJECTED, error_text(exc) if exc else "rejected by the worker")


@_guard("task_unknown")
def _on_unknown(sender: Any = None, message: Any = None, name: str | None = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    tracker = _trackers.get(app) if app is not None else None
    headers = getattr(message, "headers", None) or {}
    run_id = headers.get(RUN_HEADER)
    if tracker is not None and run_id:
        # No task of that name is registered in this worker: the message was dropped.
        tracker.unknown_task(str(run_id), str(name or headers.get("task") or "?"))


@_guard("task_internal_error")
def _on_internal_error(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
) -> None:
    tracker = _tracker_for(sender)
    run_id = _run_id_of(sender)
    if tracker is not None and run_id is not None:
        tracker.settle(run_id, RunState.FAILED, "internal error: " + error_text(exception))


@_guard("worker_shutdown")
def _on_shutdown(**_: Any) -> None:
    for tracker in list(_trackers.values()):
        tracker.shutdown()


_RECEIVERS: list[tuple[Any, Any]] = [
    (signals.task_received, _on_received),
    (signals.task_prerun, _on_prerun),
    (signals.task_success, _on_success),
    (signals.task_failure, _on_failure),
    (signals.task_postrun, _on_postrun),
    (signals.task_revoked, _on_revoked),
    (signals.task_rejected, _on_rejected),
    (signals.task_unknown, _on_unknown),
    (signals.task_internal_error, _on_internal_error),
    (signals.worker_process_shutdown, _on_shutdown),
    (signals.worker_shutdown, _on_shutdown),
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
