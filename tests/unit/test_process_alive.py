"""Whether the process that started a run still runs it: a redelivery decides on this."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from celery_boundedbeat.worker.tracking import _alive


def test_a_running_process_is_alive() -> None:
    assert _alive(os.getpid())


def test_a_reaped_process_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not _alive(child.pid)


def test_a_killed_process_its_parent_has_not_reaped_yet_is_gone() -> None:
    """A zombie: the broker already redelivered its message, so its run must be taken over."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/stat", "rb") as stat:
                if stat.read().rpartition(b")")[2].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        else:
            raise AssertionError("the child did not become a zombie")
        assert not _alive(child.pid)
    finally:
        child.wait()
