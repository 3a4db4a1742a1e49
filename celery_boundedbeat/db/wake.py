"""Wake the dispatchers after an application's commit, off its commit path, one NOTIFY per window.

A ``NOTIFY`` inside a transaction makes its commit take a lock that serialises every
notifying commit of the whole cluster until the commit is flushed: an application whose
transactions each enqueue would wait on each other there. So :func:`~..api.outbox.enqueue`
sends nothing in the caller's transaction; once the caller has committed it asks this
process's :class:`Waker` for its database, which sends the notification from a connection and
a thread of its own: at once when idle, then at most one per ``window`` seconds, however
many commits asked meanwhile. A waker that cannot reach the database only logs: the
dispatchers poll (``boundedbeat_dispatch_max_interval``), so nothing waits longer than that.

Where the caller's only hook runs just before its commit (a SQLAlchemy ``Connection``), the
request names the transaction (its ``pg_current_xact_id()``) and the waker sends once
``pg_xact_status`` says it committed; an aborted one sends nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

logger = logging.getLogger("celery_boundedbeat")

#: Seconds between two notifications of one waker: a burst of commits costs one each window.
WINDOW = 0.01
#: Seconds a waker with nothing to send keeps its thread and connection before closing both.
IDLE = 30.0

#: Seconds after a transaction's commit was sent before the waker first looks whether it ended.
FIRST_LOOK = 0.002
#: Seconds before a transaction still committing is looked at again (doubling up to ``WINDOW``).
RECHECK = 0.001

#: One round trip: the asked-about transactions' states, and the notification if one is due.
_SEND = """
WITH asked AS (SELECT x::text AS x, pg_xact_status(x) AS s FROM unnest(%(w)s::text[]::xid8[]) AS x),
sent AS (SELECT pg_notify(%(c)s, '') WHERE %(due)s OR EXISTS (SELECT FROM asked WHERE s = 'committed'))
SELECT (SELECT count(*) FROM sent), ARRAY(SELECT x FROM asked WHERE s = 'in progress')
"""


class Waker:
    """Sends ``NOTIFY channel`` for the commits that ask, coalesced; never raises into them."""

    def __init__(
        self,
        connect: Callable[[], Any],
        channel: str,
        *,
        window: float = WINDOW,
        idle: float = IDLE,
    ) -> None:
        """``connect()`` opens a DBAPI (psycopg or psycopg2) connection for this waker alone."""
        self._connect = connect
        self._channel = channel
        self._window = window
        self._idle = idle
        self._cond = threading.Condition()
        self._due = False
        self._waiting: set[str] = set()  # transactions about to commit (xid8 as text)
        self._thread: threading.Thread | None = None
        self._failing = False
        #: Notifications sent (read by tests and the benchmark).
        self.sent = 0

    def wake(self, after_xid: str | None = None) -> None:
        """Ask for a notification; ``after_xid``: once that transaction has committed."""
        with self._cond:
            if after_xid is None:
                self._due = True
            else:
                self._waiting.add(after_xid)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="boundedbeat-wake", daemon=True)
                self._thread.start()
            else:
                self._cond.notify()

    def _take(self) -> tuple[bool, set[str]] | None:
        """The next requests, after waiting up to ``idle``; ``None``: none came, the thread ends."""
        with self._cond:
            if not self._due and not self._waiting:
                self._cond.wait(self._idle)
            if not self._due and not self._waiting:
                self._thread = None
                return None
            due, waiting = self._due, self._waiting
            self._due, self._waiting = False, set()
            return due, waiting

    def _run(self) -> None:
        conn: Any = None
        recheck = RECHECK
        try:
            while (taken := self._take()) is not None:
                soon = False
                if taken[1] and not taken[0]:
                    time.sleep(FIRST_LOOK)  # their commits were just sent: look once they are done
                try:
                    if conn is None:
                        conn = self._open()
                    soon = self._send(conn, *taken)
                    self._failing = False
                except Exception as exc:
                    _close(conn)
                    conn = None
                    self._failed(exc)
                if soon:  # only commits still under way: they end in about a WAL flush
                    time.sleep(min(recheck, self._window))
                    recheck *= 2
                else:
                    time.sleep(self._window)
                    recheck = RECHECK
        finally:
            _close(conn)

    def _open(self) -> Any:
        """An autocommit connection whose commits do not wait for their WAL flush.

        A ``NOTIFY`` gives its transaction an id, so its commit writes a commit record; with
        ``synchronous_commit`` on, each wake-up would wait for a flush of its own while holding
        the notification lock, beside the application's. A notification has nothing to lose in
        a crash: the rows it announces are committed already.
        """
        conn = self._connect()
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SET synchronous_commit = off")
        return conn

    def _send(self, conn: Any, due: bool, waiting: set[str]) -> bool:
        """Notify if asked to or an awaited transaction committed; whether to look again soon."""
        with conn.cursor() as cur:
            cur.execute(_SEND, {"w": sorted(waiting), "c": self._channel, "due": due})
            sent, still = cur.fetchone()
        if still:
            with self._cond:
                self._waiting.update(still)
        self.sent += sent
        return bool(still) and not sent

    def _failed(self, exc: Exception) -> None:
        """Once a warning, then quiet until it works again: the dispatchers poll meanwhile."""
        log = logger.debug if self._failing else logger.warning
        log(
            "celery_boundedbeat: could not wake the dispatchers (%s: %s); they find the rows by polling",
            type(exc).__name__,
            str(exc).strip().splitlines()[0] if str(exc).strip() else "",
        )
        self._failing = True


def _close(conn: Any) -> None:
    if conn is not None:
        with contextlib.suppress(Exception):  # a broken connection's close has nothing to add
            conn.close()


_lock = threading.Lock()
_wakers: dict[tuple[Hashable, str], Waker] = {}


def waker_for(key: Hashable, connect: Callable[[], Any], channel: str) -> Waker:
    """This process's waker of ``channel`` on ``key`` (one database), made with ``connect`` on first use."""
    with _lock:
        waker = _wakers.get((key, channel))
        if waker is None:
            waker = _wakers[(key, channel)] = Waker(connect, channel)
        return waker


def _forget_in_child() -> None:
    """A forked child has none of the parent's threads and must not share its connections."""
    global _lock
    _lock = threading.Lock()
    _wakers.clear()


os.register_at_fork(after_in_child=_forget_in_child)
