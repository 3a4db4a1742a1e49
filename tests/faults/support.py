"""Helpers for the fault tests, on top of the integration harness (reused, not copied)."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pgtools
import pytest
from integration.harness import Harness
from integration.processes import Proc
from integration.reads import ACTIVE_STATES, Run

FAILURE_STATES = ("failed", "timed_out", "revoked", "rejected", "lost")

#: Tasks appended to the harness's generated app module (``work`` stays as it is).
EXTRA_TASKS = '''

from celery.exceptions import SoftTimeLimitExceeded

NOTES = EVENTS.replace(".jsonl", ".notes.jsonl")


def _note(**fields):
    with open(NOTES, "a") as fh:
        fh.write(json.dumps(fields) + "\\n")


@app.task(bind=True, acks_late=True)
def redeliverable(self, name, duration=6.0):
    """Acknowledged only when done: a worker killed mid-run gets it redelivered."""
    base = dict(name=name, id=self.request.id, n=_starts(name), pid=os.getpid(), thread=threading.get_ident())
    _record(event="start", t=time.time(), **base)
    time.sleep(duration)
    _record(event="end", t=time.time(), **base)


@app.task(bind=True)
def tidy(self, name, durations=(30.0, 0.2)):
    """Cleans up on its soft time limit and lets it end the run; later runs are short."""
    n = _starts(name)
    base = dict(name=name, id=self.request.id, n=n, pid=os.getpid(), thread=threading.get_ident())
    _record(event="start", t=time.time(), **base)
    try:
        time.sleep(durations[min(n, len(durations) - 1)])
    except SoftTimeLimitExceeded:
        _note(event="cleanup", t=time.time(), **base)
        raise
    finally:
        _record(event="end", t=time.time(), **base)


@app.task(bind=True)
def stubborn(self, name, durations=(30.0, 0.2)):
    """Ignores its soft time limit: only the hard limit (prefork) or the reaper ends it."""
    n = _starts(name)
    base = dict(name=name, id=self.request.id, n=n, pid=os.getpid(), thread=threading.get_ident())
    _record(event="start", t=time.time(), **base)
    deadline = time.time() + durations[min(n, len(durations) - 1)]
    while time.time() < deadline:
        try:
            time.sleep(max(deadline - time.time(), 0))
        except SoftTimeLimitExceeded:
            _note(event="ignored-soft-limit", t=time.time(), **base)
    _record(event="end", t=time.time(), **base)


@app.task(bind=True, max_retries=3)
def flaky(self, name):
    """Retries once (the run stays started), then succeeds."""
    base = dict(name=name, id=self.request.id, n=self.request.retries, pid=os.getpid())
    _note(event="attempt", t=time.time(), **base)
    if self.request.retries == 0:
        raise self.retry(countdown=1)
    return self.request.retries
'''


def write_app(bb: Harness, schedule: dict[str, Any], **conf: Any) -> str:
    """The harness's app module plus the extra tasks above."""
    module = bb.write_app(schedule, **conf)
    path = bb.tmp / f"{module}.py"
    path.write_text(path.read_text() + EXTRA_TASKS)
    return module


def task_entry(
    bb: Harness, task: str, name: str, schedule: Any, policy: dict[str, Any] | None = None, **kwargs: Any
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "task": f"{bb.module}.{task}",
        "schedule": schedule,
        "kwargs": {"name": name, **kwargs},
    }
    if policy is not None:
        entry["policy"] = policy
    return entry


def notes(bb: Harness) -> list[dict[str, Any]]:
    path = Path(str(bb.events_path).replace(".jsonl", ".notes.jsonl"))
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def executions(bb: Harness, name: str | None = None) -> Counter[str]:
    """How many times each run id was started by a task (from the task-recorded events)."""
    try:
        lines = bb.events_path.read_text().splitlines()
    except FileNotFoundError:
        return Counter()
    starts: Counter[str] = Counter()
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event["event"] == "start" and (name is None or event["name"] == name):
            starts[event["id"]] += 1
    return starts


def run(bb: Harness, run_id: str) -> Run | None:
    return next((r for r in bb.runs() if r.id == run_id), None)


def started_run(bb: Harness, name: str) -> Run | None:
    return next((r for r in bb.runs(name) if r.state == "started"), None)


def check_books(bb: Harness, name: str) -> dict[str, int]:
    """The schedule's counters equal its rows: nothing counted twice, nothing dropped.

    Returns the run states counted, for the report.
    """
    row, rows = bb.books(name)
    states = Counter(r.state for r in rows)
    completed = states["completed"]
    failures = sum(states[s] for s in FAILURE_STATES)
    active = sum(states[s] for s in ACTIVE_STATES)
    assert row["runs"] == completed, (
        f"runs counter {row['runs']} != {completed} completed rows\n{bb.diagnostics()}"
    )
    assert row["failures"] == failures, (
        f"failures counter {row['failures']} != {failures} failed rows\n{bb.diagnostics()}"
    )
    assert row["active_runs"] == active, (
        f"active_runs {row['active_runs']} != {active} active rows\n{bb.diagnostics()}"
    )
    return dict(states)


def check_grid(bb: Harness, name: str, period: float) -> int:
    """Every grid tick passed is a run row or a counted skip (nothing lost, nothing twice).

    Returns the number of grid ticks accounted for.
    """
    row, rows = bb.books(name)
    first = min(r.scheduled_for for r in rows)
    ticks = round((row["grid_at"] - first).total_seconds() / period)
    emitted = {r.scheduled_for for r in rows}
    assert len(emitted) == len(rows), "two runs for one tick"
    assert len(rows) + row["skips"] + row["pending_runs"] == ticks, (
        f"{len(rows)} runs + {row['skips']} skips + {row['pending_runs']} pending != {ticks} grid ticks\n"
        f"{bb.diagnostics()}"
    )
    return ticks


def stuck(bb: Harness, name: str | None = None, older_than: float = 20.0) -> list[Run]:
    """Runs still active long after they were emitted: what a fault would have lost."""
    now = time.time()
    return [
        r for r in bb.runs(name) if r.state in ACTIVE_STATES and now - r.enqueued_at.timestamp() > older_than
    ]


def doubled(bb: Harness, name: str | None = None) -> list[str]:
    """Run ids a task started more than once."""
    return [run_id for run_id, n in executions(bb, name).items() if n > 1]


def lease(bb: Harness) -> tuple[str, Any] | None:
    rows = bb.sql("SELECT holder, expires_at FROM boundedbeat_leases WHERE name = 'beat'")
    return (rows[0]["holder"], rows[0]["expires_at"]) if rows else None


def holder_pid(bb: Harness) -> int | None:
    held = lease(bb)
    return int(held[0].split(":")[-2]) if held else None


def kill9(proc: Proc, *, group: bool = True) -> float:
    """SIGKILL a process (and its pool children with ``group``); returns the time of the kill."""
    proc.expect_alive = False
    at = time.time()
    if group:
        os.killpg(proc.popen.pid, signal.SIGKILL)
    else:
        os.kill(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(timeout=10)
    return at


def tracebacks(proc: Proc) -> int:
    """Log records that carry a traceback (a chained exception counts once)."""
    lines = proc.output().splitlines()
    return sum(
        1
        for before, line in itertools.pairwise(lines)
        if line.startswith("Traceback (most recent call last)") and before.startswith("[")
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- a private PostgreSQL cluster the tests may stop and start -----------------------------------


def _pg_bindir() -> Path:
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: int(p.parent.parent.name.split(".")[0]),
    )
    if not found:
        found_on_path = shutil.which("pg_ctl")
        if found_on_path is None:
            pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
        return Path(found_on_path).parent
    return found[-1].parent


@dataclass
class PrivatePostgres:
    """A throwaway PostgreSQL cluster on a spare port (never the shared one)."""

    base: Path
    port: int
    bindir: Path
    running: bool = False

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def admin_dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=5"

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, timeout: float = 90) -> None:
        extra: dict[str, Any] = {}
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            extra = {"user": "postgres", "group": "postgres", "extra_groups": []}
        result = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            cwd=self.base,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
            **extra,
        )
        if result.returncode != 0:
            log = (self.base / "server.log").read_text() if (self.base / "server.log").exists() else ""
            raise RuntimeError(f"{args} failed: {result.stdout}\n{result.stderr}\n{log[-3000:]}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c shared_buffers=16MB -c max_connections=60"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.base / "server.log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")
        self.running = False

    def destroy(self) -> None:
        """Stop the cluster if it runs and delete its files (idempotent)."""
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(Exception):
                self.stop("immediate")
        self.running = False
        shutil.rmtree(self.base, ignore_errors=True)

    def create_database(self, name: str) -> None:
        pgtools.create_database(name, dsn=self.admin_dsn)


def private_postgres() -> PrivatePostgres:
    """Create and start a private cluster; the caller must call ``destroy()``."""
    bindir = _pg_bindir()
    base = Path(tempfile.mkdtemp(prefix="bbfaults-pg-"))
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(base, entry.pw_uid, entry.pw_gid)
    cluster = PrivatePostgres(base=base, port=free_port(), bindir=bindir)
    atexit.register(cluster.destroy)  # a second line of defence behind the fixture
    try:
        cluster.init()
        cluster.start()
    except Exception:
        cluster.destroy()
        raise
    return cluster
