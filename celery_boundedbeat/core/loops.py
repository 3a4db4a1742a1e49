"""Background-loop building blocks: backoff, jitter, recorded iterations.

Pure timing decisions live in small classes and functions that take durations and return
durations, so they are tested with plain numbers instead of sleeps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

#: After a failed drain the loop never polls faster than this (seconds).
ERROR_BACKOFF_FLOOR = 5.0
#: A zero interval would hot-spin the loop and the database; it is raised to this.
MIN_INTERVAL = 1.0
#: Failed iterations an :class:`IterationRecorder` keeps while the database is unreachable.
UNRECORDED_MAX = 500


class Trigger(Enum):
    """Why a dispatch iteration runs."""

    STARTUP = "startup"
    TIMER = "timer"
    WAKEUP = "wakeup"


@dataclass(frozen=True, slots=True)
class Iteration:
    """What one drain did: published something, nothing, or failed."""

    has_activity: bool = False
    failed: bool = False


def effective_base_interval(base: float) -> float:
    """Zero means one second (a floor against hot-spinning)."""
    return MIN_INTERVAL if base <= 0 else base


def effective_max_interval(base: float, maximum: float) -> float:
    """The cap is never below the base."""
    return max(maximum, effective_base_interval(base))


class DispatchBackoff:
    """Adaptive idle backoff of a dispatch loop (``BackgroundTaskDispatchBackoff``).

    Idle drains double the sleep up to the max; activity or a wakeup resets it to the base;
    an error sleeps ``max(base, 5 s)`` so a failing broker is not hammered. The intervals
    are passed to every call rather than kept here, so a changed setting counts at once.
    """

    def __init__(self, base: float) -> None:
        self.idle_interval = effective_base_interval(base)
        self.last_error = False

    def sleep_duration(self, base: float, maximum: float) -> float:
        """Seconds to wait before the next drain."""
        base = effective_base_interval(base)
        maximum = effective_max_interval(base, maximum)
        if self.last_error:
            return max(base, ERROR_BACKOFF_FLOOR)
        return min(max(self.idle_interval, base), maximum)

    def record(self, trigger: Trigger, iteration: Iteration, base: float, maximum: float) -> None:
        """Update the state after one drain."""
        base = effective_base_interval(base)
        maximum = effective_max_interval(base, maximum)
        if iteration.failed:
            self.idle_interval = base
            self.last_error = True
            return
        if iteration.has_activity or trigger is Trigger.WAKEUP:
            self.idle_interval = base
            self.last_error = False
            return
        self.idle_interval = min(max(self.idle_interval, base) * 2, maximum)
        self.last_error = False


def effective_jitter_cap(interval: float, cap: float) -> float:
    """Jitter never exceeds a tenth of the interval (``effective_jitter_cap``)."""
    return max(0.0, min(cap, interval / 10.0))


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One recorded loop iteration (``run_recorded_task_iteration``)."""

    name: str
    started_at: float
    finished_at: float
    error: str | None


class OutageLog:
    """Logs a streak of failures of one recurring database access without flooding the log.

    The first failure of a streak (or one of another exception type) is logged with its
    traceback; while the streak lasts, one line at most every ``quiet`` seconds; the first
    success after it is logged once with the streak's length. A loop retrying every second
    through a database outage thus writes a handful of lines, not a traceback a second.
    """

    def __init__(self, log: logging.Logger, what: str, quiet: float = 30.0) -> None:
        self._log = log
        self._what = what
        self._quiet = quiet
        self._since: float | None = None
        self._kind = ""
        self._failures = 0
        self._last_line = 0.0
        self._lock = threading.Lock()

    @property
    def failing(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException) -> None:
        """Record one failure (call from an ``except`` block)."""
        mono = time.monotonic()
        kind = type(exc).__name__
        with self._lock:
            first = self._since is None or kind != self._kind
            if self._since is None:
                self._since = mono
            self._kind = kind
            self._failures += 1
            failures, since = self._failures, self._since
            loud = first or mono - self._last_line >= self._quiet
            if loud:
                self._last_line = mono
        if first:
            self._log.error("celery_boundedbeat: %s failed; retrying", self._what, exc_info=exc)
        elif loud:
            self._log.warning(
                "celery_boundedbeat: %s still failing (%d attempts in %.0f s): %s: %s",
                self._what,
                failures,
                mono - since,
                kind,
                str(exc).strip().splitlines()[0] if str(exc).strip() else "",
            )

    def succeeded(self) -> float | None:
        """Record a success; returns how long the streak it ends lasted (``None`` if none)."""
        with self._lock:
            if self._since is None:
                return None
            lasted, failures = time.monotonic() - self._since, self._failures
            self._since = None
            self._failures = 0
            self._kind = ""
        self._log.warning(
            "celery_boundedbeat: %s works again after %.1f s (%d failed attempts)",
            self._what,
            lasted,
            failures,
        )
        return lasted


def failed_iteration(name: str, exc: BaseException, started_at: float, outage: OutageLog) -> IterationRecord:
    """How every failed background iteration is handled, whichever loop it belongs to.

    It is logged through its loop's :class:`OutageLog` (a traceback once per streak, then
    quietly) and described as the record to keep; the writer cuts the text to fit its row.
    """
    outage.failed(exc)
    return IterationRecord(
        name=name, started_at=started_at, finished_at=time.time(), error=f"{type(exc).__name__}: {exc}"
    )


def run_recorded_iteration(
    name: str,
    body: Callable[[], Iteration],
    logger: logging.Logger,
    record: Callable[[IterationRecord], None] | None = None,
    outage: OutageLog | None = None,
) -> Iteration:
    """Run one iteration; an exception is logged, recorded (:func:`failed_iteration`), and survived.

    With ``outage``, a streak of failures (a database or broker outage) is logged once with
    its traceback and then quietly; without it, every failure is logged with its traceback.
    """
    started = time.time()
    try:
        result = body()
    except Exception as exc:
        done = failed_iteration(name, exc, started, outage or OutageLog(logger, f"{name} iteration"))
        result = Iteration(failed=True)
    else:
        if outage is not None and outage.failing:
            outage.succeeded()
        done = IterationRecord(name=name, started_at=started, finished_at=time.time(), error=None)
    if record is not None:
        try:
            record(done)
        except Exception:
            logger.exception("celery_boundedbeat: could not record %s iteration", name)
    return result


class IterationRecorder:
    """The one owner of failed background iterations: how they are logged, kept and written.

    Every loop of the beat reports here (:meth:`failed`, :meth:`succeeded`), and so does the
    dispatcher, whose ``record=`` callback is :meth:`record`. A failed iteration is logged
    through its loop's :class:`OutageLog` and kept in a bounded queue (the newest
    ``capacity``); the queue is written in order by ``write`` as soon as the database is
    usable. After a failure that ``is_outage`` calls an outage the write is not even tried:
    it waits for the next success, which also ends the outage and reports how long it lasted.

    Pure: the database is reached only through ``write``. Only the thread that calls
    :meth:`failed` and :meth:`succeeded` writes; :meth:`record` only queues, so the
    dispatcher's thread never waits on the database for the beat's bookkeeping.
    """

    def __init__(
        self,
        write: Callable[[IterationRecord], None],
        *,
        logger: logging.Logger,
        is_outage: Callable[[BaseException], bool],
        label: str = "",
        capacity: int = UNRECORDED_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._write = write
        self._log = logger
        self._is_outage = is_outage
        self._label = label
        self._clock = clock
        self._streaks: dict[str, OutageLog] = {}
        self._unwritten: deque[IterationRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        #: Monotonic time of the first outage since the last success (``None``: no outage).
        self.down_since: float | None = None

    def outage_log(self, name: str) -> OutageLog:
        """The streak log of loop ``name`` (``label`` + ``name`` in its lines)."""
        streak = self._streaks.get(name)
        if streak is None:
            streak = self._streaks[name] = OutageLog(self._log, f"{self._label}{name}")
        return streak

    def failed(self, name: str, exc: BaseException, started_at: float) -> None:
        """One failed iteration of ``name`` (call from its ``except`` block): log, keep, go on."""
        self._keep(failed_iteration(name, exc, started_at, self.outage_log(name)))
        if not self._is_outage(exc):
            self.flush()
        elif self.down_since is None:
            self.down_since = self._clock()

    def succeeded(self, name: str) -> float | None:
        """An iteration of ``name`` reached the database: end its streak, write what waits.

        Returns how long the database was out (seconds) when this success ends an outage.
        """
        streak = self._streaks.get(name)
        if streak is not None:
            streak.succeeded()
        down: float | None = None
        if self.down_since is not None:
            down = self._clock() - self.down_since
            self.down_since = None
        self.flush()
        return down

    def record(self, record: IterationRecord) -> None:
        """Another loop's iteration (any thread): a failed one is kept for the next write."""
        if record.error is not None:
            self._keep(record)

    def flush(self) -> bool:
        """Write the kept records oldest first; stop at the first that cannot be written yet.

        Only an outage stops the flush. A record the database refuses for what it holds (a
        data error) would be refused forever and hold every later record behind it: it is
        logged once and dropped.
        """
        while True:
            with self._lock:
                if not self._unwritten:
                    return True
                oldest = self._unwritten[0]
            try:
                self._write(oldest)
            except Exception as exc:
                if self._is_outage(exc):
                    self._log.debug(
                        "celery_boundedbeat: could not record a failed %s iteration yet", oldest.name
                    )
                    return False
                self._log.error(
                    "celery_boundedbeat: dropped the record of a failed %s iteration the database "
                    "refuses (a data error, not retried)",
                    oldest.name,
                    exc_info=exc,
                )
            with self._lock:
                if self._unwritten and self._unwritten[0] is oldest:
                    self._unwritten.popleft()

    @property
    def unwritten(self) -> int:
        """How many failed iterations wait to be written."""
        return len(self._unwritten)

    def _keep(self, record: IterationRecord) -> None:
        with self._lock:
            self._unwritten.append(record)


class BackgroundLoop:
    """A daemon thread running a wakeable loop with a cooperative stop and a grace period.

    Mirrors ``BackgroundTasks``: ``stop()`` sets the shutdown flag, wakes the loop and
    joins it for ``grace`` seconds; a loop that does not finish in time is abandoned (it
    is a daemon thread, so it cannot keep the process alive).
    """

    def __init__(self, name: str, target: Callable[[threading.Event, threading.Event], None]) -> None:
        self.name = name
        self.shutdown = threading.Event()
        self.wakeup = threading.Event()
        self._thread = threading.Thread(
            target=target, args=(self.shutdown, self.wakeup), name=name, daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self.wakeup.set()

    def stop(self, grace: float) -> bool:
        """Ask the loop to stop; returns whether it ended within ``grace`` seconds."""
        self.shutdown.set()
        self.wakeup.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(grace)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def run_dispatch_loop(
    shutdown: threading.Event,
    wakeup: threading.Event,
    drain: Callable[[], Iteration],
    base: Callable[[], float],
    maximum: Callable[[], float],
) -> None:
    """``run_dispatch_worker``: drain at startup, then on timer or wakeup, with backoff."""
    backoff = DispatchBackoff(base())
    if shutdown.is_set():
        return
    backoff.record(Trigger.STARTUP, drain(), base(), maximum())
    while not shutdown.is_set():
        woke = wakeup.wait(backoff.sleep_duration(base(), maximum()))
        if shutdown.is_set():
            break
        wakeup.clear()
        trigger = Trigger.WAKEUP if woke else Trigger.TIMER
        backoff.record(trigger, drain(), base(), maximum())
