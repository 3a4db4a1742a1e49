"""Polling with a useful failure: how end-to-end tests wait for something to happen.

Real processes take their time, so the tests poll: ``wait_until`` a condition holds,
``watch`` an invariant for a while, ``wait_for_log`` until a process logs a line. Each poll
also runs a ``check`` (the harness passes one that fails as soon as a process died), and a
timeout fails with ``describe()`` (the runs and process logs) rather than a bare timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .processes import Proc


def _nothing() -> None:
    pass


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    interval: float = 0.2,
    each: Callable[[], None] | None = None,
    check: Callable[[], None] = _nothing,
    describe: Callable[[], str] = str,
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``describe()`` on timeout.

    ``each`` runs on every poll (invariant checks), then ``check`` after an unsuccessful poll.
    """
    deadline = time.monotonic() + timeout
    while True:
        if each is not None:
            each()
        value = predicate()
        if value:
            return value
        check()
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{describe()}")
        time.sleep(interval)


def watch(
    seconds: float, each: Callable[[], None], interval: float = 0.2, *, check: Callable[[], None] = _nothing
) -> None:
    """Keep checking an invariant (and ``check``) for a while."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        each()
        check()
        time.sleep(interval)


def wait_for_log(proc: Proc, needle: str, timeout: float) -> None:
    """Wait until ``proc`` logs ``needle``; fail with its log if it exits or times out first."""
    deadline = time.monotonic() + timeout
    while needle not in proc.output():
        if not proc.alive:
            raise AssertionError(
                f"{proc.name} exited {proc.popen.returncode} before logging {needle!r}\n{proc.tail(80)}"
            )
        if time.monotonic() >= deadline:
            raise AssertionError(f"{proc.name} did not log {needle!r} within {timeout:g} s\n{proc.tail(80)}")
        time.sleep(0.1)
