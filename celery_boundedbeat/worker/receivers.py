"""Celery signal receivers: how a worker tells the database what its runs did.

Receivers are module-level and connected once per app by :func:`install` with a
``dispatch_uid``. Celery swallows receiver exceptions, so every receiver logs its own
failures loudly. Each one finds the run (our header, or the task id a prefork parent
remembered) and hands the start or outcome to the process's :class:`~.tracking.Tracker`.
"""

from __future__ import annotations

import logging
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from celery import Celery, signals
from celery.exceptions import Ignore, SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError

from ..config.settings import Settings, warn_unknown_settings
from ..core.enums import RunState
from ..core.exceptions import BoundedBeatError, NotInScheduledRunError
from ..core.messages import (
    MAX_RUN_TIME_HEADER,
    RUN_HEADER,
    SCHEDULE_HEADER,
    SCHEDULED_FOR_HEADER,
    error_text,
    error_with_traceback,
    parse_scheduled_for,
)
from ..core.redact import driver_reason, mask_url, scrub
from ..db.engine import get_engine
from .tracking import Tracker

logger = logging.getLogger("celery_boundedbeat.tracking")

_trackers: weakref.WeakKeyDictionary[Celery, Tracker] = weakref.WeakKeyDictionary()
_local = threading.local()


def _tracker_for(task: Any) -> Tracker | None:
    app = getattr(task, "app", None)
    return _trackers.get(app) if app is not None else None


def _header(task: Any, name: str) -> Any:
    """One of our message headers from the task's request (Celery merges them into it)."""
    request = getattr(task, "request", None)
    if request is None:
        return None
    value = request.get(name) if hasattr(request, "get") else None
    if value is None:
        headers = getattr(request, "headers", None) or {}
        value = headers.get(name)
    return value


def _run_id_of(task: Any) -> str | None:
    run_id = _header(task, RUN_HEADER)
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
    _local.skip = False  # only this delivery's own verdict may skip its body
    tracker = _tracker_for(task)
    run_id = _run_id_of(task)
    if tracker is None or run_id is None:
        return
    _local.run_id = run_id
    _local.run = None
    _local.schedule = _header(task, SCHEDULE_HEADER)
    _local.scheduled_for = parse_scheduled_for(_header(task, SCHEDULED_FOR_HEADER))
    _local.tracker = tracker
    request = task.request
    hostname = request.hostname or socket.gethostname()
    retried = bool(getattr(request, "retries", 0))
    _local.skip = not tracker.begin(run_id, hostname, _time_limit(request), retried=retried)
    if _local.skip and not getattr(type(task).before_start, _SKIPS, False):
        logger.error(
            "celery_boundedbeat: task %s was registered after the worker started; its duplicate "
            "delivery of run %s runs anyway",
            getattr(task, "name", "?"),
            run_id,
        )


#: Marks the ``before_start`` hook :func:`_hook_tasks` puts on every task class of a worker.
_SKIPS = "_boundedbeat_skips_duplicates"


def _hook_tasks(app: Celery) -> None:
    """Give every registered task class a ``before_start`` that skips a duplicate delivery.

    ``task_prerun`` records the run's start and decides (:meth:`~.tracking.Tracker.begin`);
    a signal receiver cannot stop the task (Celery logs its exceptions), but ``Ignore`` from
    ``before_start`` does: the body does not run and the message is acknowledged. A task's
    own ``before_start`` is kept and runs after. Celery builds its tracers after
    ``worker_init``, which calls this; a task registered later is not hooked (it logs so).
    """
    for task in list(app.tasks.values()):
        cls = type(task)
        original = cls.before_start
        if getattr(original, _SKIPS, False):
            continue

        def before_start(self: Any, task_id: str, args: Any, kwargs: Any, _original: Any = original) -> None:
            if getattr(_local, "skip", False):
                raise Ignore()
            _original(self, task_id, args, kwargs)

        setattr(before_start, _SKIPS, True)
        cls.before_start = before_start


#: Seconds past a run's hard time limit before the reaper calls it timed out. Prefork kills the
#: child at the hard limit and reports it from the parent; the reaper waits this long so that
#: report (``TimeLimitExceeded`` with its traceback) is the one kept, not the reaper's.
POOL_REPORT_GRACE = 1.0


def _time_limit(request: Any) -> float | None:
    """Seconds after its start when a run is past saving: its hard time limit (plus the pool's
    turn to report it), else ``max_run_time``.

    The reaper settles a run still active then as ``timed_out``; until then the pool's own soft
    limit (the task may clean up) and hard limit (prefork kills the child) have their turn.
    """
    limits = getattr(request, "timelimit", None) or (None, None)
    hard = limits[0] if isinstance(limits, list | tuple) and limits else None
    if hard:
        return float(hard) + POOL_REPORT_GRACE
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
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    traceback: TracebackType | str | None = None,
    **_: Any,
) -> None:
    # In a prefork parent (hard time limit, a child that died) the task has no request
    # context: the run is found from the message the parent received.
    tracker, run_id = _remembered_run(sender, task_id)
    if tracker is None or run_id is None:
        return
    if isinstance(exception, SoftTimeLimitExceeded | TimeLimitExceeded):
        tracker.settle(run_id, RunState.TIMED_OUT, error_with_traceback(exception, traceback))
    elif isinstance(exception, WorkerLostError):
        tracker.settle(run_id, RunState.LOST, "worker process died: " + error_text(exception))
    else:
        tracker.settle(run_id, RunState.FAILED, error_with_traceback(exception, traceback))


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
    skipped = getattr(_local, "skip", False)
    _forget_run()
    if tracker is None or run_id is None or state in (None, "RETRY") or skipped:
        return  # a skipped duplicate: its run belongs to the delivery that started it
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


@_guard("worker_init")
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    """Hook the tasks (duplicate deliveries: :func:`_hook_tasks`) and tell the trackers which
    pool the worker runs: ``report_writer = "auto"`` follows it."""
    app = getattr(sender, "app", None)
    if app is not None and app in _trackers:
        _hook_tasks(app)
    pool_cls = getattr(sender, "pool_cls", None)
    if pool_cls is None:
        return
    for tracker in [_trackers[app]] if app in _trackers else list(_trackers.values()):
        tracker.note_pool(pool_cls)


@_guard("worker_shutdown")
def _on_shutdown(**_: Any) -> None:
    for tracker in list(_trackers.values()):
        tracker.shutdown()


def database_problem(app: Celery) -> str | None:
    """Why this process cannot write runs to the database right now (one line, masked), or None.

    One connection and ``SELECT 1``: whether the database answers, not whether it is migrated
    (on SQLite beat migrates it, possibly after the worker started).
    """
    try:
        url = Settings.from_conf(app.conf).database_url
    except BoundedBeatError as exc:
        return " ".join(str(exc).split())
    try:
        with get_engine(url).connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except BoundedBeatError as exc:  # an invalid URL: its text names it
        return " ".join(scrub(str(exc), url).split())
    except Exception as exc:
        return f"cannot reach the database {mask_url(url)}: {driver_reason(exc, url)}"
    return None


def _warn_if_unusable(app: Celery) -> None:
    problem = database_problem(app)
    if problem is not None:
        logger.warning(
            "celery_boundedbeat: this worker cannot record its runs: %s (tracking retries until the "
            "database answers)",
            problem,
        )


@_guard("worker_ready")
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Say once, at start, when runs cannot be recorded: the first run would only say it later.
    Also start the report writer process, if this worker has one, before the first run.

    Both on threads of their own: a database that drops packets takes the connect timeout
    (10 s) to answer, and the consumer must not wait for it.
    """
    app = getattr(sender, "app", None)
    for tracked in [app] if app in _trackers else list(_trackers):
        if tracked is not None:
            warn_unknown_settings(tracked.conf, logger)
        threading.Thread(
            target=_warn_if_unusable, args=(tracked,), name="boundedbeat-db-check", daemon=True
        ).start()
        _trackers[tracked].start_writer()  # in the background


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
    (signals.worker_ready, _on_worker_ready),
    (signals.worker_init, _on_worker_init),
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


@dataclass(frozen=True, kw_only=True, slots=True)
class CurrentRun:
    """The run of a schedule a task is executing (what :func:`current_run` returns)."""

    #: The run id: the Celery task id, and ``id`` in ``boundedbeat_runs``.
    id: str
    #: The schedule's name.
    schedule: str
    #: The grid time the run belongs to, aware UTC (for a triggered run: the trigger time).
    scheduled_for: datetime


def current_run() -> CurrentRun | None:
    """Inside a run emitted by celery_boundedbeat: which run it is; anywhere else ``None``.

    Read from the message's headers. A message queued before they carried the grid time is
    answered from the run's row, once per run (an outage then raises the database's error).
    """
    run_id = getattr(_local, "run_id", None)
    if run_id is None:
        return None
    known: CurrentRun | None = getattr(_local, "run", None)
    if known is not None and known.id == run_id:
        return known
    schedule, scheduled_for = getattr(_local, "schedule", None), getattr(_local, "scheduled_for", None)
    tracker: Tracker | None = getattr(_local, "tracker", None)
    if (schedule is None or scheduled_for is None) and tracker is not None:
        row = tracker.store.run(run_id)
        if row is not None:
            schedule, scheduled_for = row.schedule, row.scheduled_for
    if schedule is None or scheduled_for is None:
        return None
    run = CurrentRun(id=run_id, schedule=str(schedule), scheduled_for=scheduled_for)
    _local.run = run
    return run


def _forget_run() -> None:
    """The task ended: nothing of its run stays on the thread for the next task."""
    _local.run_id = None
    _local.run = None
    _local.schedule = None
    _local.scheduled_for = None
    _local.tracker = None
    _local.skip = False
