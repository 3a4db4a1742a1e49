"""The real ``celery`` processes of an end-to-end test: start, signal, kill, inspect.

``Processes`` runs ``celery -A <the test's app module>`` commands in the test's directory
with a clean environment: short commands to completion (``celery``, ``migrate``), and beats
and workers in the background (``start_beat``, ``start_worker``, ``start``), each in its own
session with its output in a log file (a ``Proc``). It stops them with a chosen signal,
kills whatever is left at teardown, and reports their logs when something goes wrong.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine

from celery_boundedbeat.db.migrate import upgrade

from .waiting import wait_for_log

VENV_BIN = Path(sys.executable).parent
CELERY = str(VENV_BIN / "celery") if (VENV_BIN / "celery").exists() else "celery"


#: The lease holder's log line once its schedule rows match beat_schedule (scheduler._reconcile).
RECONCILED = " reconciled "


@dataclass(kw_only=True)
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    expect_alive: bool = True

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-lines:])


def kill(proc: Proc) -> None:
    """SIGKILL the process and everything in its session, and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=10)


class Processes:
    """The processes of one test; ``migrates`` runs ``boundedbeat migrate`` before a beat."""

    def __init__(
        self,
        *,
        tmp: Path,
        module: str,
        queue: str,
        uid: str,
        migrates: bool,
        known_url: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.tmp = tmp
        self.module = module
        self.queue = queue
        self.uid = uid
        self.migrates = migrates
        self.known_url = known_url
        self.procs: list[Proc] = []
        self._counter = 0
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY")}
        # The test's app module first, then the test run's own PYTHONPATH: the processes import
        # the celery_boundedbeat the tests import (a checkout on PYTHONPATH, not another install).
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH")) if p)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.pop("PYTHONSTARTUP", None)

    def spawn(self, name: str, args: list[str], expect_alive: bool = True) -> Proc:
        self._counter += 1
        log = self.tmp / f"{name}-{self._counter}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(
                [CELERY, "-A", self.module, *args],
                cwd=self.tmp,
                env=self.env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(name=f"{name}-{self._counter}", popen=popen, log=log, expect_alive=expect_alive)
        self.procs.append(proc)
        return proc

    def celery(
        self, *args: str, timeout: float = 60, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run a short ``celery -A module ...`` command to completion."""
        result = subprocess.run(
            [CELERY, "-A", self.module, *args],
            cwd=self.tmp,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"`celery {' '.join(args)}` exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def migrate(self) -> subprocess.CompletedProcess[str]:
        return self.celery("boundedbeat", "migrate", check=True)

    def migrate_before_beat(self) -> None:
        """Migrate the app's database before a beat starts.

        In this process when the app's database URL is known (``known_url``): the same
        ``upgrade`` the ``boundedbeat migrate`` command runs, without the 2 s a ``celery``
        process takes to start on two busy cores. Otherwise (a module a test wrote itself, a
        URL computed in the module) the command. The command itself is tested on its own.
        """
        url = self.known_url()
        if url is None:
            self.migrate()
            return
        engine = create_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()

    def start_beat(self, *extra: str, migrate: bool = True, wait_lease: bool = True) -> Proc:
        """Start ``celery beat -S celery_boundedbeat.Scheduler`` (migrating PostgreSQL first)."""
        if migrate and self.migrates:
            self.migrate_before_beat()
        proc = self.spawn(
            "beat", ["beat", "-S", "celery_boundedbeat.Scheduler", "--loglevel", "INFO", *extra]
        )
        if wait_lease:
            # The holder logs the lease before it reconciles beat_schedule: wait for the rows too.
            wait_for_log(proc, "holds the beat lease", timeout=30)
            wait_for_log(proc, RECONCILED, timeout=30)
        return proc

    def start_worker(self, pool: str = "threads", concurrency: int = 4, wait_ready: bool = True) -> Proc:
        """Start a worker for this test's queue with the given pool."""
        node = f"w{self.uid}-{self._counter + 1}@%h"
        proc = self.spawn(
            "worker",
            [
                "worker",
                "-P",
                pool,
                "-c",
                str(concurrency),
                "-n",
                node,
                "-Q",
                self.queue,
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "INFO",
            ],
        )
        if wait_ready:
            wait_for_log(proc, " ready.", timeout=40)
        return proc

    def start(
        self, pool: str = "threads", concurrency: int = 4, beat_args: tuple[str, ...] = ()
    ) -> tuple[Proc, Proc]:
        """Start a worker and a beat side by side (their start-ups overlap), wait for both."""
        worker = self.start_worker(pool=pool, concurrency=concurrency, wait_ready=False)
        beat = self.start_beat(*beat_args, wait_lease=False)
        wait_for_log(worker, " ready.", timeout=40)
        wait_for_log(beat, "holds the beat lease", timeout=40)
        wait_for_log(beat, RECONCILED, timeout=30)
        return worker, beat

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Signal the process (not its group) and wait for it to exit; returns its exit status."""
        proc.expect_alive = False
        if proc.alive:
            proc.popen.send_signal(sig)
        try:
            return proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill(proc)
            raise AssertionError(
                f"{proc.name} did not exit within {timeout} s of signal {sig}\n{proc.tail()}"
            ) from None

    def close(self) -> None:
        for proc in self.procs:
            kill(proc)

    def report(self, lines: int = 40) -> list[str]:
        """Each process's state and the end of its log."""
        parts = []
        for proc in self.procs:
            state = "running" if proc.alive else f"exited {proc.popen.returncode}"
            parts.append(f"-- {proc.name} ({state}), last {lines} lines of {proc.log}:\n{proc.tail(lines)}")
        return parts

    def check_alive(self, describe: Callable[[], str]) -> None:
        """Fail, with ``describe()``, if a process expected to be running has exited."""
        for proc in self.procs:
            if proc.expect_alive and not proc.alive:
                status = proc.popen.returncode
                raise AssertionError(f"{proc.name} exited unexpectedly with status {status}\n{describe()}")

    def assert_no_errors(self, *allowed: str) -> None:
        """No process logged an error or a traceback, apart from lines containing ``allowed`` text."""
        for proc in self.procs:
            bad = [
                line
                for line in proc.output().splitlines()
                if ("ERROR/" in line or "CRITICAL/" in line or line.startswith("Traceback"))
                and not any(text in line for text in allowed)
            ]
            assert not bad, f"{proc.name} logged errors:\n" + "\n".join(bad) + f"\n{proc.tail(60)}"
