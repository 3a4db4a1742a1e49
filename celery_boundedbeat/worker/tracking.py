"""The worker side's record of run starts, write-behind of outcomes, and the per-process heartbeat.

A run's start is recorded before its body runs (:meth:`Tracker.begin`, one round trip): the
atomic start tells a second delivery of the same message that the run is taken, and a worker
killed right after the body began leaves a ``started`` run (settled ``lost``), not one that
looks never started. The Celery signal receivers (:mod:`.receivers`) hand each outcome to
the process's :class:`Tracker`, which queues it and returns: the task thread does not wait
for the database to record an outcome.
The tracker's thread writes whatever is queued in one transaction (:mod:`.worklog`), so a
burst of short tasks costs a few statements per batch, not two commits per run. A batch that
cannot reach the database (an outage) stays queued in order and is retried every second, so
an outcome is never dropped while the worker process lives; the database's guarded
transitions make a retried write that had in fact been committed a no-op. A process that
exits writes what it queued first (``worker_process_shutdown`` / ``worker_shutdown``); one
killed outright loses at most the last few milliseconds of reports, and the beat's reaper
settles those runs ``lost``.

Heartbeats: each worker process with at least one active run, or a report not yet written,
writes one row of ``boundedbeat_workers`` per ``boundedbeat_heartbeat_interval`` (one
statement per process, however many runs it has), from a thread of its own and in a
transaction of its own, so a batch that waits never holds it up; the beat's reaper settles
the runs of a process whose heartbeat is older than three intervals as ``lost``. A prefork
child killed mid-run is reported at once by the pool's ``WorkerLostError`` (settled ``lost``
by the parent process); a whole worker killed is found by the reaper.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import islice
from typing import Any

from celery import Celery
from celery.concurrency import get_implementation
from celery.concurrency.thread import TaskPool as ThreadsPool
from sqlalchemy.engine import make_url

from ..config.settings import Settings
from ..core.enums import RunState
from ..core.loops import OutageLog
from ..db.engine import get_engine
from ..db.faults import is_outage
from ..db.runs import Begun, Settled
from ..db.store import Store, utcnow
from .report_writer import ReportProcess
from .worklog import Beat, OutcomeReport, StartReport, write_reports

logger = logging.getLogger("celery_boundedbeat.tracking")

#: Task ids remembered by a worker's parent process, to name the run of a pool failure.
_KNOWN_TASKS = 4096
#: Seconds between attempts to write kept starts and outcomes while the database is away.
_RETRY_EVERY = 1.0
#: At most this many starts and outcomes per transaction.
BATCH = 500
#: Seconds the writer lets reports gather after the first one is queued: ``LINGER_PER_WRITE``
#: times as long as the last batch took to write, between ``LINGER_MIN`` and ``LINGER_MAX``.
#: A transaction costs a few milliseconds of CPU whatever its size, so under load batches grow;
#: the cap keeps an outcome's slot free within a few tens of milliseconds of the task's end
#: (a pending run starts then: at 200 ms a coalesced tick lost its slot to the next grid tick).
LINGER_MIN = 0.002
LINGER_MAX = 0.02
LINGER_PER_WRITE = 10
#: Run ids of this process's recent outcomes: a second report of one is dropped here.
_RECENT_SETTLES = 1024


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


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs on this host (one that is not ours to signal counts).

    A process killed but not yet reaped by its parent is a zombie: signalling it succeeds, yet
    it runs nothing, and its broker connection is already closed, which is exactly when the
    broker redelivers its message. On Linux its state in ``/proc`` tells the two apart.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[:1]
    except FileNotFoundError:  # it ended meanwhile, unless there is no /proc (not Linux)
        return not os.path.isdir("/proc/self")
    except OSError:
        return True
    return state not in ([b"Z"], [b"X"])


def _in_memory(settings: Settings) -> bool:
    """Whether the database lives in this process's memory (SQLite ``:memory:``)."""
    url = make_url(settings.database_url)
    return url.get_backend_name() == "sqlite" and (
        (url.database or "") in ("", ":memory:") or url.query.get("mode") == "memory"
    )


class Tracker:
    """Per-app, per-process tracking state: store, active runs, pending writes, heartbeat thread."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._settings: Settings | None = None
        self._pid = -1
        self._settled: deque[str] = deque()
        self._settled_set: set[str] = set()
        self._stop_requested: set[str] = set()
        #: Task names already reported as unknown (logged once per process).
        self._unknown_names: set[str] = set()
        self._rng = random.Random()
        self._last_heartbeat = 0.0
        #: The worker's pool class, from ``worker_init`` (``None``: not seen, not a worker).
        self._pool: type | None = None
        #: ``writer``, decided once it is asked (the pool is known by then).
        self._writer: str | None = None
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """What belongs to one process: a forked pool child starts these afresh."""
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._active: set[str] = set()
        #: Starts and outcomes not yet written, oldest first (the writer's queue).
        self._queue: deque[_Pending] = deque()
        #: While the database is away: the monotonic time of the next attempt.
        self._retry_at = 0.0
        #: The last write failed even when tried again at once (the database is away).
        self._down = False
        #: When the queue last went from empty to not empty (monotonic).
        self._queued_at = 0.0
        #: Seconds the last batch took to write (sets how long the next one gathers).
        self._last_write = 0.0
        #: task id -> run id of messages this process received (a prefork parent names the
        #: run of a child that died or hit its hard time limit from these).
        self._known: OrderedDict[str, str] = OrderedDict()
        #: The child process writing this process's reports (``report_writer = "process"``).
        self._reports: ReportProcess | None = None
        self._hb_thread: threading.Thread | None = None
        self._hb_wake = threading.Event()
        #: Set by ``stop``: the writer and heartbeat threads end.
        self._stopped = threading.Event()
        self._writes = OutageLog(logger, "recording runs in the database")
        self._starts = OutageLog(logger, "recording run starts before their tasks run")
        self._beats = OutageLog(logger, "the worker heartbeat")
        self._writer_thread: threading.Thread | None = None
        #: Until then (monotonic) starts are written behind without the duplicate check: the
        #: database failed the last one (an outage or a held row).
        self._check_after = 0.0

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_conf(self.app.conf)
        return self._settings

    @property
    def store(self) -> Store:
        return Store(
            get_engine(self.settings.database_url), failing_threshold=self.settings.failing_threshold
        )

    @property
    def process(self) -> str:
        return f"{socket.gethostname()}:{os.getpid()}"

    def note_pool(self, pool_cls: Any) -> None:
        """Remember the worker's pool (``worker_init``): ``report_writer = "auto"`` follows it."""
        try:
            resolved = get_implementation(pool_cls)
        except Exception:  # a pool Celery itself cannot resolve fails the worker, not us
            logger.debug("celery_boundedbeat: pool %r not resolved", pool_cls, exc_info=True)
            return
        self._pool = resolved if isinstance(resolved, type) else None
        self._writer = None

    @property
    def writer(self) -> str:
        """Where this process writes its reports: ``"thread"`` or ``"process"``.

        ``"auto"`` picks the process for the threads pool only: there the tasks, the consumer
        and a writer thread share one GIL, and the tasks waited for the writer (0.69 of an
        untracked worker's throughput, against 0.80 with the process). A prefork child runs one
        task at a time and would need a writer process each; an in-memory SQLite database is
        not shared with a child.
        """
        if self._writer is None:
            chosen = self.settings.report_writer
            if chosen == "auto":
                threads = self._pool is not None and issubclass(self._pool, ThreadsPool)
                chosen = "process" if threads and not _in_memory(self.settings) else "thread"
            self._writer = chosen
        return self._writer

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

    def begin(self, run_id: str, hostname: str, limit: float | None, *, retried: bool = False) -> bool:
        """A delivery of a run is about to run its body: record the start first, atomically,
        and say whether the body may run (False: another delivery started the run and may
        still be running it; this one must not run it again).

        A delivery of a run this process is running or settled recently is skipped without
        asking. Otherwise a database that cannot be asked (an outage)
        cannot tell: the start is then recorded behind, as the outcomes are, and the body
        runs; for the next second the other starts of this process do the same, so tasks do
        not each wait for a database that is away.
        ``retried``: a Celery retry of the run (``request.retries`` > 0), whose first
        execution ended by asking for it: a continuation, never a duplicate.
        """
        self._after_fork_check()
        at = utcnow()
        if self.settings.skip_duplicate_deliveries and not retried and self._began_here(run_id):
            # Known without asking the database, which may be away (a restart after which a
            # dispatcher published the run again, its first publish never recorded).
            logger.warning(
                "celery_boundedbeat: run %s is not run again by this delivery of its message: "
                "this process started it already",
                run_id,
            )
            return False
        if not self.settings.skip_duplicate_deliveries or time.monotonic() < self._check_after:
            # The database just failed a check: tasks do not each wait for it while it is away.
            self.started(run_id, hostname, limit, at=at)
            return True
        try:
            self._beat_if_due()  # the process's heartbeat row exists before its run shows started
            found = self.store.run_life.begin_run(
                run_id, worker=hostname, process=self.process, now=at, max_run_time=limit
            )
            why = self._duplicate(run_id, found, hostname, retried=retried)
        except Exception as exc:
            self._starts.failed(exc)
            self._check_after = time.monotonic() + _RETRY_EVERY
            self.started(run_id, hostname, limit, at=at)
            return True
        self._starts.succeeded()
        if why is not None:
            logger.warning(
                "celery_boundedbeat: run %s is not run again by this delivery of its message: %s",
                run_id,
                why,
            )
            return False
        with self._lock:
            self._active.add(run_id)
        self._ensure_heartbeat()
        return True

    def _began_here(self, run_id: str) -> bool:
        """Whether this process runs the run now or settled it recently (its last 1,024)."""
        with self._lock:
            return run_id in self._active or run_id in self._settled_set

    def _duplicate(self, run_id: str, found: Begun, hostname: str, *, retried: bool) -> str | None:
        """Why a delivery whose start was not the first must not run the body (None: it may)."""
        if found.first or found.state is None:
            return None
        if found.state == RunState.STARTED.value:
            if not retried and (found.process == self.process or not self._gone(found)):
                at = found.started_at.isoformat(timespec="milliseconds") if found.started_at else "?"
                return f"another delivery started it at {at} in {found.process}, which may still run it"
            # A Celery retry, or a redelivery after the first process died: a continuation.
            if not self.store.run_life.take_over_run(
                run_id, worker=hostname, process=self.process, previous=found.process
            ):
                return "another delivery took it over first"
            return None
        if found.started_at is not None or found.state == RunState.REVOKED.value:
            return f"it is {found.state} already"
        return None  # settled without a start (rejected): runs late, its outcome noted beside

    def _gone(self, found: Begun) -> bool:
        """Whether the process that recorded a run's start can no longer be running it: a
        process of this host whose pid is gone, or one whose heartbeat the reaper calls dead."""
        host, _, pid = (found.process or "").rpartition(":")
        if host == socket.gethostname() and pid.isdigit():
            return not _alive(int(pid))
        silent_since = utcnow() - timedelta(seconds=3 * self.settings.heartbeat_interval)
        return found.heartbeat_at is None or found.heartbeat_at < silent_since

    def started(self, run_id: str, hostname: str, limit: float | None, *, at: datetime | None = None) -> None:
        """A run began here: vouch for it by heartbeat and record its start later (write-behind)."""
        self._after_fork_check()
        with self._lock:
            self._active.add(run_id)
        self._ensure_heartbeat()
        self._submit(_PendingStart(run_id=run_id, worker=hostname, at=at or utcnow(), limit=limit))

    def settle(self, run_id: str, state: RunState, error: str | None = None) -> None:
        """A run ended here (the first report of it in this process wins)."""
        self._after_fork_check()
        with self._lock:
            self._active.discard(run_id)
            self._known.pop(run_id, None)
            if run_id in self._settled_set:
                return
            self._settled.append(run_id)
            self._settled_set.add(run_id)
            if len(self._settled) > _RECENT_SETTLES:
                self._settled_set.discard(self._settled.popleft())
        stop = run_id in self._stop_requested
        self._stop_requested.discard(run_id)
        self._submit(_PendingSettle(run_id=run_id, state=state, at=utcnow(), error=error, stop=stop))

    def _submit(self, item: _Pending) -> None:
        """Queue the report for the writer thread, in order, and wake it."""
        with self._lock:
            if not self._queue:
                self._queued_at = time.monotonic()
            self._queue.append(item)
        self._ensure_heartbeat()
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
        return self.store.run_life.settle_run(
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
        self._beat_if_due()
        self.store.run_life.start_run(
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

    def flush(self, *, drain: bool = True) -> bool:
        """Write the queued starts and outcomes in order, a batch per transaction.

        False if some are still queued (the database is away). Whatever part of a batch was
        written is taken off the queue; the rest keeps its place at the front. The writer
        thread writes one batch per call (``drain=False``) and lets the next one gather.
        """
        with self._flush_lock:  # the writer thread and a shutdown must not write one item twice
            # A failure while the database answered a moment ago is most likely one cut
            # connection (pg_terminate_backend, a restarted proxy): the pool has dropped it and
            # the next connection works, so that batch is tried again at once. Waiting the
            # outage's second held every report of this process, and a run that had ended kept
            # its slot: the next tick of its schedule was skipped as busy.
            again = not self._down
            while True:
                with self._lock:
                    batch = list(islice(self._queue, BATCH))
                if not batch:
                    return True
                began = time.monotonic()
                written = self._write_batch(batch)
                self._last_write = time.monotonic() - began
                with self._lock:
                    for _ in range(written):
                        self._queue.popleft()
                    # What arrived while this batch was written gathers afresh for the next.
                    self._queued_at = time.monotonic()
                if written < len(batch):
                    if again:
                        again = False
                        continue
                    self._down = True
                    self._retry_at = time.monotonic() + _RETRY_EVERY
                    return False
                self._down = False
                if not drain:
                    return True

    def _write_batch(self, batch: list[_Pending]) -> int:
        """Write a batch in one transaction; how many items from its front were written.

        A data error somewhere in it sends every item down the one-by-one path, which finds
        the refused item and records what it can of it (see :meth:`_write`).
        """
        starts = [
            StartReport(run_id=i.run_id, worker=i.worker, process=self.process, at=i.at, limit=i.limit)
            for i in batch
            if isinstance(i, _PendingStart)
        ]
        outcomes = [
            OutcomeReport(run_id=i.run_id, state=i.state, at=i.at, error=i.error, stop=i.stop)
            for i in batch
            if isinstance(i, _PendingSettle)
        ]
        try:
            if starts:  # its own transaction: a batch that waits for a row never holds the heartbeat
                self._beat_if_due()
            done = self._write_many(starts, outcomes, None)
        except Exception as exc:
            if is_outage(exc):
                self._writes.failed(exc)
                return 0
            logger.warning(
                "celery_boundedbeat: the database refused a batch of %d run report(s) (%s); "
                "writing them one by one",
                len(batch),
                type(exc).__name__,
            )
            for written, item in enumerate(batch):
                if not self._write(item):
                    return written
            return len(batch)
        self._writes.succeeded()
        for item, settled in zip((i for i in batch if isinstance(i, _PendingSettle)), done, strict=True):
            self._log_written(item, settled)
        return len(batch)

    def _write_many(
        self, starts: list[StartReport], outcomes: list[OutcomeReport], beat: Beat | None
    ) -> list[Settled | None]:
        if self.writer == "process":
            reports = self._report_process()
            if reports.ready():  # else (starting, or replacing one that died) write it here
                return reports.write(starts, outcomes, beat)
        return write_reports(self.store, starts, outcomes, beat=beat, rng=self._rng)

    def _report_process(self) -> ReportProcess:
        with self._lock:
            if self._reports is None:
                self._reports = ReportProcess(self.settings.database_url, self.settings.failing_threshold)
            return self._reports

    def start_writer(self) -> None:
        """Start the writer process now (``worker_ready``), not with the first run's report."""
        self._after_fork_check()
        if self.writer == "process":
            self._report_process().ready()

    def _beat_if_due(self) -> None:
        """The heartbeat before a start, in a transaction of its own: a process's first run
        needs its row first (and a row held by a batch would hold every later heartbeat)."""
        if time.monotonic() - self._last_heartbeat < self.settings.heartbeat_interval / 2:
            return
        self.store.run_life.heartbeat(self.process, socket.gethostname(), os.getpid(), utcnow())
        self._last_heartbeat = time.monotonic()

    def shutdown(self) -> None:
        """The process is exiting: one last attempt at what it kept; say loudly what is lost."""
        if self._pid != os.getpid():
            return
        if self._queue and not self.flush():
            logger.error(
                "celery_boundedbeat: %d run start(s)/outcome(s) could not be written before this process "
                "exits; the beat's reaper will settle those runs lost",
                len(self._queue),
            )
        if self._reports is not None:
            self._reports.close()

    def stop(self, timeout: float = 5.0) -> None:
        """End this process's writer and heartbeat threads, whose loops otherwise last as long
        as the process: a tracker dropped while its process goes on (a test's) would keep
        beating for runs it will never settle, on a database that may be gone. What is still
        queued stays queued (``flush`` writes it)."""
        self._stopped.set()
        self._hb_wake.set()
        for thread in (self._writer_thread, self._hb_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)

    # -- heartbeat ----------------------------------------------------------------------

    def _ensure_heartbeat(self) -> None:
        """Start this process's two threads if they are not running: the writer of reports and
        the heartbeat. Apart, so a batch waiting for a row another process holds (or for the
        report process) never holds the heartbeat that tells the reaper this process lives."""
        if self._writer_thread is None or not self._writer_thread.is_alive():
            self._writer_thread = threading.Thread(
                target=self._writer_loop, name="boundedbeat-writer", daemon=True
            )
            self._writer_thread.start()
        if self._hb_thread is None or not self._hb_thread.is_alive():
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, name="boundedbeat-heartbeat", daemon=True
            )
            self._hb_thread.start()

    def _writer_loop(self) -> None:
        interval = self.settings.heartbeat_interval
        while not self._stopped.is_set():
            self._hb_wake.wait(self._idle_for(interval))
            self._hb_wake.clear()
            if self._stopped.is_set():
                return
            try:
                if self._queue and time.monotonic() >= self._retry_at:
                    gathered = time.monotonic() - self._queued_at
                    linger = min(LINGER_MAX, max(LINGER_MIN, LINGER_PER_WRITE * self._last_write))
                    if gathered < linger and len(self._queue) < BATCH:
                        time.sleep(linger - gathered)
                    self.flush(drain=False)
            except Exception:  # never let the thread die: it carries the pending outcomes
                logger.exception("celery_boundedbeat: report writer iteration failed")

    def _heartbeat_loop(self) -> None:
        """One heartbeat per interval while a run of this process is active *or its report
        is not yet written*: a run that finished here and whose outcome is still on its way
        (a database outage, a row held elsewhere) is never settled ``lost`` while the
        process lives."""
        interval = self.settings.heartbeat_interval
        hostname = socket.gethostname()
        while not self._stopped.wait(
            max(self._last_heartbeat + interval * 0.9 - time.monotonic(), interval * 0.1)
        ):
            try:
                with self._lock:
                    busy = bool(self._active) or bool(self._queue)
                if busy and time.monotonic() - self._last_heartbeat >= interval * 0.9:
                    try:
                        self.store.run_life.heartbeat(self.process, hostname, os.getpid(), utcnow())
                    except Exception as exc:
                        self._beats.failed(exc)
                    else:
                        self._last_heartbeat = time.monotonic()
                        self._beats.succeeded()
            except Exception:  # never let the thread die
                logger.exception("celery_boundedbeat: heartbeat iteration failed")

    def _idle_for(self, interval: float) -> float:
        """How long the thread may sleep: until the next retry while the database is away
        (new reports do not hasten it), else until the next heartbeat or a report wakes it."""
        if self._queue:
            return max(0.0, min(interval, self._retry_at - time.monotonic()))
        return interval
