"""The waker's coalescing and its failures, on a stand-in connection (no database)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import pytest

from celery_boundedbeat.db import wake
from celery_boundedbeat.db.wake import Waker

pytestmark = pytest.mark.timeout(30)


class _Conn:
    """Records the statements; the first NOTIFY waits until the test lets it go."""

    def __init__(self) -> None:
        self.statements: list[str] = []
        self.first_sent = threading.Event()
        self.release = threading.Event()
        self.autocommit = False
        self.closed = False

    def cursor(self) -> _Conn:
        return self

    def __enter__(self) -> _Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def execute(self, sql: str, params: dict[str, Any] | None = None) -> None:
        if params is None:  # the connection's settings
            return
        self.statements.append(sql)
        self.due = params["due"]
        if len(self.statements) == 1:
            self.first_sent.set()
            assert self.release.wait(10)

    def fetchone(self) -> tuple[int, list[str]]:
        return (1 if self.due else 0), []

    def close(self) -> None:
        self.closed = True


def _wait_idle(waker: Waker) -> None:
    deadline = time.monotonic() + 10
    while waker._thread is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_burst_during_one_notification_costs_one_more() -> None:
    """Asked at once when idle; the hundred requests made while it sends become one notification."""
    conn = _Conn()
    waker = Waker(lambda: conn, "ch", window=0.0, idle=0.1)
    waker.wake()
    assert conn.first_sent.wait(10)
    for _ in range(100):
        waker.wake()
    conn.release.set()
    _wait_idle(waker)
    assert waker.sent == 2 and len(conn.statements) == 2
    assert conn.autocommit and conn.closed  # its own autocommit connection, closed when idle


def test_a_waker_that_cannot_connect_never_raises_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """The caller's commit is done: a failure is logged (the dispatchers poll), never raised."""

    def refuse() -> Any:
        raise OSError("connection refused")

    waker = Waker(refuse, "ch", window=0.0, idle=0.05)
    with caplog.at_level(logging.DEBUG, logger="celery_boundedbeat"):
        for _ in range(3):
            waker.wake()
            _wait_idle(waker)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "connection refused" in warnings[0].getMessage()
    assert waker.sent == 0


def test_a_forked_child_starts_without_the_parents_wakers() -> None:
    """A prefork child must not use the parent's connection nor wait on its (absent) thread."""
    parents = wake.waker_for("test-fork", lambda: _Conn(), "ch")
    try:
        pid = os.fork()
        if pid == 0:  # the child: a fresh waker of its own
            fresh = wake.waker_for("test-fork", lambda: _Conn(), "ch")
            os._exit(0 if fresh is not parents and len(wake._wakers) == 1 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert wake.waker_for("test-fork", lambda: _Conn(), "ch") is parents
    finally:
        wake._wakers.pop(("test-fork", "ch"), None)
