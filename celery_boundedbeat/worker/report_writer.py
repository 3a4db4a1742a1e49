"""A worker's run reports written by a process of its own (``boundedbeat_report_writer = "process"``).

With the threads pool every task, the consumer and the tracker's writer share one GIL: the
writer's statements and psycopg's Python-level protocol handling took 0.2 ms of the worker's
CPU per run, and the tasks waited for it. Here the writer thread only hands each batch to a
child process (one pickled message each way) and the child runs :func:`~.worklog.write_reports`
on its own core. The semantics are the tracker's: a batch that was not answered is an outage,
kept and sent again (starts and outcomes are idempotent), and a child that died is started anew.

The child is ``python -c`` running :func:`main`; the database URL reaches it through
its stdin, never its command line (``ps`` shows command lines).
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from ..db.runs import Settled
from .worklog import Beat, OutcomeReport, StartReport

logger = logging.getLogger("celery_boundedbeat.tracking")

_LENGTH = struct.Struct("!I")
#: The child's command (not ``-m``: the package imports this module before runpy would run it).
_CHILD = "from celery_boundedbeat.worker.report_writer import main; main()"
#: Seconds before a child that could not start is tried again.
_RESTART_DELAY = 10.0


class ReportWriterLost(ConnectionError):
    """The writer process ended or stopped answering: the batch is kept and sent again."""


class ReportsNotWritten(ConnectionError):
    """The writer process could not reach the database (an outage: kept, retried)."""


class ReportsRefused(Exception):
    """The database refused the batch for what it holds (the tracker then writes it one by one)."""


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    (size,) = _LENGTH.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


class ReportProcess:
    """The parent's end: starts the child, sends a batch, returns what it settled.

    The child takes about a second to import its libraries. :meth:`ready` never waits for
    that: until a child has said it is ready (and again after one died) the tracker writes
    its batches in its own thread, so the first runs of a worker are not recorded late.
    """

    def __init__(self, database_url: str, failing_threshold: int) -> None:
        self._init = (database_url, failing_threshold)
        #: A child that said it is ready (set only then).
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._starting: threading.Thread | None = None
        self._start_lock = threading.Lock()
        #: No new background start before this (monotonic): a child that cannot start is not
        #: spawned again for every batch.
        self._start_after = 0.0

    def ready(self) -> bool:
        """Whether a started child is there to write the next batch; if not, start one in the
        background (the caller writes this batch itself)."""
        child = self._child
        if child is not None and child.poll() is None:
            return True
        with self._start_lock:
            busy = self._starting is not None and self._starting.is_alive()
            if not busy and time.monotonic() >= self._start_after:
                self._starting = threading.Thread(
                    target=self._start_quietly, name="boundedbeat-writer-start", daemon=True
                )
                self._starting.start()
        return False

    def write(
        self, starts: Sequence[StartReport], outcomes: Sequence[OutcomeReport], beat: Beat | None
    ) -> list[Settled | None]:
        """Write one batch in the child (one transaction there), as ``write_reports`` would;
        starts the child first (and waits for it) if none is running."""
        with self._lock:
            child = None
            try:
                child = self._running()
                assert child.stdin is not None and child.stdout is not None
                _send(child.stdin, (list(starts), list(outcomes), beat))
                kind, value = _receive(child.stdout)
            except (OSError, EOFError, pickle.PickleError) as exc:
                if child is not None:
                    self._stop(child)
                raise ReportWriterLost(f"the report writer process ended ({type(exc).__name__})") from None
        if kind == "ok":
            return list(value)
        if kind == "outage":
            raise ReportsNotWritten(value)
        raise ReportsRefused(value)

    def start(self) -> None:
        """Start the child and wait until it is ready."""
        with self._lock:
            self._running()

    def _start_quietly(self) -> None:
        try:
            self.start()
        except Exception as exc:  # the tracker's thread goes on writing; try again later
            self._start_after = time.monotonic() + _RESTART_DELAY
            logger.warning(
                "celery_boundedbeat: the report writer process did not start (%s: %s); the worker "
                "writes its reports itself and tries again in %g s",
                type(exc).__name__,
                exc,
                _RESTART_DELAY,
            )

    def close(self) -> None:
        """End the child after what it is writing (the tracker flushed before calling this)."""
        with self._lock:
            if self._child is not None:
                self._stop(self._child)

    def _running(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        assert child.stdin is not None and child.stdout is not None
        try:
            _send(child.stdin, self._init)
            kind, _ = _receive(child.stdout)
            if kind != "ready":
                raise EOFError
        except BaseException:
            self._stop(child)
            raise
        self._child = child
        return child

    def _stop(self, child: subprocess.Popen[bytes]) -> None:
        self._child = None
        for stream in (child.stdin, child.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _serve(inbox: IO[bytes], outbox: IO[bytes]) -> None:
    """The child's loop: one batch in, one answer out, until the parent closes the pipe."""
    from ..core.redact import scrub
    from ..db.engine import get_engine
    from ..db.faults import is_outage
    from ..db.store import Store
    from .worklog import write_reports

    database_url, failing_threshold = _receive(inbox)
    store = Store(get_engine(database_url), failing_threshold=failing_threshold)
    rng = random.Random()
    _send(outbox, ("ready", None))  # imported: the parent may hand over its batches now
    while True:
        try:
            starts, outcomes, beat = _receive(inbox)
        except EOFError:
            return
        try:
            answer: tuple[str, Any] = ("ok", write_reports(store, starts, outcomes, beat=beat, rng=rng))
        except Exception as exc:
            kind = "outage" if is_outage(exc) else "refused"
            text = scrub(" ".join(str(exc).split())[:500], database_url)
            answer = (kind, f"{type(exc).__name__}: {text}")
        _send(outbox, answer)


def main() -> None:
    """Entry point of the child: its stdout is the answer pipe, anything printed goes to stderr.

    Ctrl-C and a service manager's SIGTERM reach the worker's whole process group; the child
    ignores both, so a warm shutdown still writes its last reports here. It ends when the
    worker closes the pipe, or dies (the pipe then reads end of file).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s: %(levelname)s/reportproc] %(message)s")
    _serve(sys.stdin.buffer, outbox)
