"""Scale: 100,000 schedules on PostgreSQL, next to stock Celery beat (issue 11, item 7).

Run: ``.venv/bin/python bench/scale_bench.py [--quick] [--only 1,2,3,4] [--json PATH]``
(needs the local PostgreSQL and Redis; ``--quick`` runs everything at a tenth of the size to
check the benchmark itself). Each scenario creates a throwaway database ``bb_scale_*``, starts
what it needs (beats are real ``celery beat`` processes running ``bench/scale_app.py``), and
drops and stops everything afterwards. bench/README.md says what each figure means.

1. 100,000 runtime schedules (1 h period, first due times staggered over the hour): beat
   start-up, RSS, CPU idle and at the hour's 27.8 runs/s, then a full pass (every schedule
   due once), and the rates of ``add_schedule`` / ``update_schedule`` / ``remove_schedule``.
2. 100,000 ``beat_schedule`` entries: start-up and RSS on an empty and on a populated
   database, next to Celery's ``PersistentScheduler`` on the same entries.
3. One tick transaction with 100 schedules due, among 1,000 and among 100,000 (in-process,
   ``Store.tick`` with a fake clock).
4. Changes from other processes (target 1,000/s) while 1,000 runs/s come due: change-to-effect
   latency and tick drift next to the same load without changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery
from sqlalchemy import Engine, insert, select, text

from celery_boundedbeat import add_schedule, remove_schedule, update_schedule
from celery_boundedbeat.config.definitions import Resolver, define
from celery_boundedbeat.core.partitions import slot_of
from celery_boundedbeat.core.spec import config_hash
from celery_boundedbeat.db.definition_writes import fresh_values
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.migrate import upgrade
from celery_boundedbeat.db.row_state import RUNTIME
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import ScheduleRow, new_incarnation

HERE = Path(__file__).resolve().parent
#: ``PYTHONPATH`` of the processes a benchmark starts: the app modules here, the package beside.
CHECKOUT_PATH = os.pathsep.join([str(HERE), str(HERE.parent)])
ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
PG = "postgresql+psycopg://postgres@127.0.0.1:5432/{db}"
REDIS = "redis://127.0.0.1:6379/0"
CELERY = str(Path(sys.executable).parent / "celery")
TASK = "bench.noop"
HOUR = 3600.0
#: fixed_rate with room for every run: nothing is ever started (no worker), so no slot frees.
UNBOUNDED = {"mode": "fixed_rate", "max_concurrency": 1_000_000}

# -- sizes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    schedules: int = 100_000  # scenarios 1 and 2
    api_calls: int = 1000  # add/update/remove calls timed in scenario 1
    idle_window: float = 60.0  # scenario 1: CPU with nothing due
    steady_window: float = 60.0  # scenario 1: CPU at N/3600 runs/s
    lead: float = 150.0  # scenario 1: nothing due for this long after beat is launched
    config_window: float = 30.0  # scenario 2: CPU after each start
    config_lead: float = 900.0  # scenario 2: first config run due this long after reconcile
    tick_sizes: tuple[int, int] = (1000, 100_000)  # scenario 3
    tick_rate: int = 100  # scenario 3: schedules due per (fake) second, one tick per second
    ticks: int = 200  # scenario 3: ticks timed per case
    load: int = 1000  # scenario 4: schedules of 1 s = runs due per second
    change_rate: int = 1000  # scenario 4: changes per second asked for
    change_window: float = 30.0  # scenario 4: each measured phase
    clients: int = 4  # scenario 4: processes making changes


QUICK = Sizes(
    schedules=10_000,
    api_calls=200,
    idle_window=10.0,
    steady_window=10.0,
    lead=45.0,
    config_window=10.0,
    config_lead=300.0,
    tick_sizes=(1000, 10_000),
    ticks=40,
    change_window=10.0,
)

# -- small helpers ----------------------------------------------------------------------


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``nan`` for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def dist(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p99": pct(values, 99),
        "max": max(values) if values else math.nan,
    }


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.5))


def utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


# -- the machine --------------------------------------------------------------------------


def machine(admin: psycopg.Connection[Any]) -> dict[str, Any]:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    import celery
    import sqlalchemy

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "celery_boundedbeat"],
        cwd=HERE.parent,
        capture_output=True,
        text=True,
    )
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "memory_gb": round(mem_kb / 1024 / 1024, 1),
        "python": platform.python_version(),
        "postgresql": admin.execute("SHOW server_version").fetchone()[0],  # type: ignore[index]
        "celery": celery.__version__,
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": psycopg.__version__,
        "commit": head.stdout.strip(),
        "package_files_changed_in_tree": [line[3:] for line in dirty.stdout.splitlines()],
        "loadavg_at_start": os.getloadavg(),
    }


def admin_connection() -> psycopg.Connection[Any]:
    return psycopg.connect(ADMIN, autocommit=True)


def make_db(admin: psycopg.Connection[Any]) -> str:
    name = f"bb_scale_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    return name


def drop_db(admin: psycopg.Connection[Any], name: str) -> None:
    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def steady(db: str, *tables: str) -> None:
    """Vacuum and analyze after a bulk change, so its aftermath is not charged to beat."""
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{db}", autocommit=True) as conn:
        for table in tables or ("boundedbeat_schedules",):
            conn.execute(f"VACUUM ANALYZE {table}")


def bench_app(url: str, queue: str) -> Celery:
    """The application side (the process calling ``add_schedule``)."""
    app = Celery("scale_bench", broker=REDIS, set_as_current=False)
    app.conf.update(boundedbeat_database_url=url, task_default_queue=queue)
    return app


def purge_redis(queue: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS)
    for key in client.scan_iter(match=f"*{queue}*"):
        client.delete(key)
    client.close()


# -- CPU from /proc ------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a process; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(") ")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def proc_memory(pid: int) -> dict[str, float]:
    """Resident memory now and at its peak (``VmRSS``, ``VmHWM``), in MB."""
    out = {"rss_mb": math.nan, "peak_rss_mb": math.nan}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_mb"] = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    out["peak_rss_mb"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds summed over every core since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / TICK, sum(values) / TICK


@dataclasses.dataclass(kw_only=True)
class CpuSnap:
    t: float
    beat: float
    pg: dict[int, float]
    busy: float
    total: float


class CpuMeter:
    """CPU over a window: the beat, the PostgreSQL backends serving our database, the machine.

    Everything is given as a percentage of one core (the machine's maximum is cores x 100 %);
    ``other`` is what the rest of the machine used meanwhile (other engineers' tests, the
    benchmark's own client processes unless given as ``clients``).
    """

    def __init__(self, admin: psycopg.Connection[Any], dbs: Sequence[str], pid: int | None) -> None:
        self.admin = admin
        self.dbs = list(dbs)
        self.pid = pid

    def snap(self) -> CpuSnap:
        pids = [
            r[0]
            for r in self.admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = ANY(%s)", [self.dbs]
            )
        ]
        busy, total = machine_busy()
        return CpuSnap(
            t=time.time(),
            beat=proc_cpu(self.pid) if self.pid else 0.0,
            pg={p: proc_cpu(p) for p in pids},
            busy=busy,
            total=total,
        )

    @staticmethod
    def usage(a: CpuSnap, b: CpuSnap, clients: float = 0.0) -> dict[str, float]:
        elapsed = b.t - a.t
        cores = os.cpu_count() or 1
        beat = (b.beat - a.beat) / elapsed * 100
        pg = sum(v - a.pg.get(p, 0.0) for p, v in b.pg.items()) / elapsed * 100
        whole = (b.busy - a.busy) / max(b.total - a.total, 1e-9) * cores * 100
        client = clients / elapsed * 100
        return {
            "seconds": elapsed,
            "beat_pct": beat,
            "postgres_pct": pg,
            "clients_pct": client,
            "machine_pct": whole,
            "other_pct": max(whole - beat - pg - client, 0.0),
        }


# -- beat processes -------------------------------------------------------------------------


class Beat:
    """One ``celery beat`` process running ``bench/scale_app.py``, its log and marks file."""

    def __init__(
        self,
        label: str,
        tmp: Path,
        env: dict[str, str],
        *,
        stock: bool = False,
        loglevel: str = "INFO",
        profile: Path | None = None,
    ) -> None:
        self.label = label
        self.tmp = tmp
        self.log = tmp / f"{label}.log"
        self.marks = tmp / f"{label}.marks"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY", "BENCH_"))}
        self.env.update(env)
        # The bench folder for the app module, then this checkout: the beat runs the package
        # next to the script, not whichever checkout the virtualenv has installed.
        self.env.update(BENCH_MARKS=str(self.marks), PYTHONPATH=CHECKOUT_PATH, PYTHONUNBUFFERED="1")
        scheduler = "scale_app:MarkedStock" if stock else "scale_app:Marked"
        self.cmd = [CELERY, "-A", "scale_app", "beat", "-S", scheduler, "--loglevel", loglevel]
        self.cmd += ["-s", str(tmp / "stock-schedule")]
        self.profile = profile
        self.popen: subprocess.Popen[bytes] | None = None
        self.spy: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self) -> Beat:
        self.marks.unlink(missing_ok=True)
        with open(self.log, "wb") as fh:
            self.started = time.time()
            self.popen = subprocess.Popen(
                self.cmd,
                cwd=self.tmp,
                env=self.env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        if self.profile is not None:
            self.profile.mkdir(parents=True, exist_ok=True)
            spy = Path(sys.executable).parent / "py-spy"
            out = self.profile / f"{self.label}.txt"
            time.sleep(0.2)
            self.spy = subprocess.Popen(
                [str(spy), "record", "--pid", str(self.pid), "-r", "50", "-f", "raw", "-o", str(out)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def events(self, name: str) -> list[list[str]]:
        try:
            lines = self.marks.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [line.split()[1:] for line in lines if line.split()[:1] == [name]]

    def first(self, name: str) -> float | None:
        found = self.events(name)
        return float(found[0][0]) if found else None

    def wait_ticking(self, timeout: float) -> float:
        """The end of the first tick (see scale_app); fails if beat exits or takes too long."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = self.events("tick")
            if found:
                return float(found[0][0]) + float(found[0][1])
            if not self.alive():
                raise SystemExit(f"{self.label}: beat exited before ticking:\n{self.tail()}")
            time.sleep(0.02)
        raise SystemExit(f"{self.label}: beat not ticking after {timeout:.0f} s:\n{self.tail()}")

    def ticks(self, a: float, b: float) -> list[tuple[float, float, int, int]]:
        """Tick transactions started in ``[a, b)``: (start, seconds, runs emitted, rows handled)."""
        out = []
        for start, took, emitted, handled in self.events("tick"):
            if a <= float(start) < b:
                out.append((float(start), float(took), int(emitted), int(handled)))
        return out

    def pauses(self, a: float, b: float) -> list[float]:
        """Seconds of each collection of the oldest generation started in ``[a, b)``."""
        return [float(took) for start, took in self.events("gc") if a <= float(start) < b]

    def memory(self) -> dict[str, float]:
        return proc_memory(self.pid)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def problems(self) -> list[str]:
        text_ = self.log.read_text(errors="replace") if self.log.exists() else ""
        lines = text_.splitlines()
        # Each error line, and the exception that ends its traceback (the line that says why).
        return [
            line
            for i, line in enumerate(lines)
            if "ERROR/" in line
            or "CRITICAL/" in line
            or (
                line
                and not line[0].isspace()
                and not line.startswith(("Traceback", "[", "The above", "During handling"))
                and i > 0
                and lines[i - 1].startswith("    ")
            )
        ]

    def stop(self, timeout: float = 90.0) -> float:
        """SIGTERM and wait; returns the seconds it took to exit."""
        if self.spy is not None:
            self.spy.send_signal(signal.SIGINT)
        t0 = time.time()
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        if self.spy is not None:
            try:
                self.spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.spy.kill()
        return time.time() - t0

    def startup(self) -> dict[str, float]:
        """Seconds from the process start to each mark, up to ticking."""
        out: dict[str, float] = {}
        for name in ("imported", "app", "setup_start", "setup_end"):
            t = self.first(name)
            if t is not None:
                out[f"{name}_s"] = t - self.started
        ticks = self.events("tick")
        if ticks:
            out["ticking_s"] = float(ticks[0][0]) + float(ticks[0][1]) - self.started
            out["first_tick_transaction_s"] = float(ticks[0][1])
        return out


def beat_env(db: str, queue: str, *, dispatch: bool, **extra: str) -> dict[str, str]:
    return {
        "BENCH_DB_URL": PG.format(db=db),
        "BENCH_BROKER": REDIS,
        "BENCH_QUEUE": queue,
        "BENCH_DISPATCH": "1" if dispatch else "0",
        **extra,
    }


# -- rows as add_schedule writes them -----------------------------------------------------------


def runtime_rows(
    app: Celery,
    count: int,
    *,
    prefix: str,
    period: float,
    policy: dict[str, Any] | None,
    first_due: Callable[[int], datetime],
    start: int = 0,
) -> Iterable[dict[str, Any]]:
    """The rows ``add_schedule(app, f"{prefix}{i:06d}", TASK, period, args=[i], policy=policy)``
    writes (``catalog.insert_runtime``), with the first due time ``first_due(i)`` instead of now."""
    entry = {"task": TASK, "schedule": period, "args": [0], "kwargs": {}, "options": {}}
    if policy is not None:
        entry["policy"] = policy
    d = define(f"{prefix}template", entry, app, {})
    now = datetime.now(UTC)
    template = fresh_values(d, now, random.Random(0), origin=RUNTIME, last_run_at=None)
    for i in range(start, start + count):
        due = first_due(i)
        spec = dataclasses.replace(d.spec, name=f"{prefix}{i:06d}", args=(i,))
        yield {
            **template,
            "name": spec.name,
            "incarnation": new_incarnation(),
            "args": [i],
            "config_hash": config_hash(spec),
            "slot": slot_of(spec.name),  # the template's would put every row in one partition
            "grid_at": due,
            "next_due_at": due,
        }


def bulk_insert(engine: Engine, rows: Iterable[dict[str, Any]], chunk: int = 5000) -> int:
    total = 0
    batch: list[dict[str, Any]] = []
    with engine.begin() as conn:
        for row in rows:
            batch.append(row)
            if len(batch) == chunk:
                conn.execute(insert(ScheduleRow), batch)
                total += len(batch)
                batch = []
        if batch:
            conn.execute(insert(ScheduleRow), batch)
            total += len(batch)
    return total


def check_parity(app: Celery, store: Store) -> None:
    """A bulk row equals the row ``add_schedule`` writes, apart from name and times."""
    name = "parity-000007"
    assert add_schedule(app, name, TASK, HOUR, args=[7]) == "scheduled"
    real = store.schedules([name])[0]
    due = real.next_due_at
    assert due is not None
    bulk = next(
        iter(
            runtime_rows(app, 1, prefix="parity-", period=HOUR, policy=None, first_due=lambda i: due, start=7)
        )
    )
    differ = {"created_at", "updated_at", "incarnation"}  # an incarnation is random per schedule
    for column in ScheduleRow.__table__.columns:
        if column.key not in differ and getattr(real, column.key) != bulk[column.key]:
            raise SystemExit(
                f"bulk rows differ from add_schedule's in {column.key}: "
                f"{bulk[column.key]!r} != {getattr(real, column.key)!r}"
            )
    assert remove_schedule(app, name)


def runs_since(engine: Engine, since: float) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(
                text("SELECT count(*) FROM boundedbeat_runs WHERE enqueued_at >= :t"), {"t": utc(since)}
            )
            or 0
        )


def queue_depth(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text("SELECT count(*) FROM boundedbeat_queue")) or 0)


def drift_of(engine: Engine, like: str, a: float, b: float) -> list[float]:
    """``enqueued_at - scheduled_for`` (s) of the runs of schedules ``LIKE like`` due in ``[a, b)``."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT extract(epoch FROM enqueued_at - scheduled_for) FROM boundedbeat_runs "
                "WHERE schedule LIKE :like AND scheduled_for >= :a AND scheduled_for < :b"
            ),
            {"like": like, "a": utc(a), "b": utc(b)},
        ).all()
    return [float(r[0]) for r in rows]


# -- scenario 1: 100,000 runtime schedules ---------------------------------------------------------


def api_rates(app: Celery, calls: int) -> dict[str, float]:
    """Sequential calls per second of the public API, into the full table, one process."""
    for i in range(5):  # connect, warm caches
        add_schedule(app, f"api-warm-{i}", TASK, HOUR)
        remove_schedule(app, f"api-warm-{i}")
    out = {}
    t0 = time.perf_counter()
    for i in range(calls):
        add_schedule(app, f"api-{i:06d}", TASK, HOUR, args=[i])
    out["add_schedule_per_s"] = calls / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(calls):
        update_schedule(app, f"api-{i:06d}", kwargs={"v": 1})
    out["update_schedule_per_s"] = calls / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(calls):
        remove_schedule(app, f"api-{i:06d}")
    out["remove_schedule_per_s"] = calls / (time.perf_counter() - t0)
    return out


def scenario_runtime(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes
    n = sz.schedules
    db = make_db(ctx.admin)
    queue = f"bb_scale_{uuid.uuid4().hex[:8]}"
    beat: Beat | None = None
    out: dict[str, Any] = {"schedules": n, "dispatch": "on, to Redis (no worker)", "period_s": HOUR}
    try:
        url = PG.format(db=db)
        engine = get_engine(url)
        upgrade(engine)
        app = bench_app(url, queue)
        store = Store(engine)
        far = time.time() + 10 * HOUR
        say(f"scenario 1: inserting {n:,} runtime schedules (rows as add_schedule writes them)")
        t0 = time.perf_counter()
        bulk_insert(
            engine,
            runtime_rows(
                app, n, prefix="s", period=HOUR, policy=None, first_due=lambda i: utc(far + i * HOUR / n)
            ),
        )
        out["bulk_insert_s"] = time.perf_counter() - t0
        check_parity(app, store)
        say(f"scenario 1: timing {sz.api_calls} add_schedule, update_schedule, remove_schedule calls")
        out["api"] = api_rates(app, sz.api_calls)
        # The hour starts `lead` seconds after launch, so beat first idles with nothing due.
        launch = time.time() + 5
        shift = far - (launch + sz.lead)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE boundedbeat_schedules SET grid_at = grid_at - make_interval(secs => :s), "
                    "next_due_at = next_due_at - make_interval(secs => :s)"
                ),
                {"s": shift},
            )
        steady(db)
        sleep_until(launch)
        beat = Beat("runtime", ctx.tmp, beat_env(db, queue, dispatch=True), profile=ctx.profile).start()
        meter = CpuMeter(ctx.admin, [db], beat.pid)
        ticking = beat.wait_ticking(300)
        out["startup"] = beat.startup()
        out["memory_at_ticking"] = beat.memory()
        say(f"scenario 1: ticking after {out['startup']['ticking_s']:.1f} s; idle window")
        first_due = launch + sz.lead
        idle_from = ticking + 2
        idle_to = min(idle_from + sz.idle_window, first_due - 2)
        if idle_to - idle_from < 5:
            raise SystemExit(f"scenario 1: start-up took too long for an idle window before {sz.lead:.0f} s")
        sleep_until(idle_from)
        a = meter.snap()
        sleep_until(idle_to)
        out["idle"] = meter.usage(a, meter.snap())
        out["idle"]["due_in_window"] = 0
        out["memory_after_idle"] = beat.memory()
        say("scenario 1: steady window (the hour's runs coming due)")
        steady_from = max(time.time(), first_due + 5)
        sleep_until(steady_from)
        a = meter.snap()
        sleep_until(steady_from + sz.steady_window)
        b = meter.snap()
        out["steady"] = meter.usage(a, b)
        ticks = beat.ticks(a.t, b.t)
        out["steady"]["runs_emitted_per_s"] = sum(t[2] for t in ticks) / (b.t - a.t)
        out["steady"]["runs_due_per_s"] = n / HOUR
        out["steady"]["tick_transaction_ms"] = dist([t[1] * 1000 for t in ticks])
        out["steady"]["ticks_per_s"] = len(ticks) / (b.t - a.t)
        time.sleep(2)
        drift = drift_of(engine, "s%", a.t, b.t)
        out["steady"]["drift_s"] = dist(drift)
        out["steady"]["runs_later_than_500ms"] = sum(1 for d in drift if d > 0.5)
        out["memory_after_steady"] = beat.memory()
        out["schedules_ticked_by_then"] = runs_since(engine, 0)
        # The full pass: every schedule due once (overdue by up to an hour, in grid order).
        say(f"scenario 1: full pass, all {n:,} schedules due")
        with engine.begin() as conn:
            pass_from = time.time()
            conn.execute(
                text(
                    "UPDATE boundedbeat_schedules SET active_runs = 0, pending = '[]', pending_runs = 0, "
                    "grid_at = :t - make_interval(secs => 3600 - (args->>0)::float * 3600 / :n), "
                    "next_due_at = :t - make_interval(secs => 3600 - (args->>0)::float * 3600 / :n)"
                ),
                {"t": utc(pass_from), "n": n},
            )
            conn.execute(text("SELECT pg_notify('boundedbeat_schedules', '')"))
        a = meter.snap()
        # A million schedules take longer than 100,000 to tick once each: room for 500/s.
        deadline = time.time() + max(900.0, n / 500)
        while runs_since(engine, pass_from) < n and time.time() < deadline:
            time.sleep(0.5)
        b = meter.snap()
        out["full_pass"] = meter.usage(a, b)
        out["full_pass"]["runs_emitted"] = runs_since(engine, pass_from)
        out["full_pass"]["tick_s"] = b.t - pass_from
        out["full_pass"]["runs_per_s"] = out["full_pass"]["runs_emitted"] / (b.t - pass_from)
        out["memory_after_full_pass"] = beat.memory()
        while queue_depth(engine) > 0 and time.time() < deadline:
            time.sleep(1)
        out["full_pass"]["dispatched_s"] = time.time() - pass_from
        out["full_pass"]["queue_left"] = queue_depth(engine)
        time.sleep(5)
        out["memory_after_full_pass_dispatched"] = beat.memory()
        out["problems"] = beat.problems()
        out["stop_s"] = beat.stop()
        beat = None
        engine.dispose()
    finally:
        if beat is not None:
            beat.stop()
        drop_db(ctx.admin, db)
        purge_redis(queue)
    return out


# -- scenario 2: 100,000 beat_schedule entries, ours and stock ---------------------------------------------


def one_start(ctx: Context, label: str, env: dict[str, str], db: str, *, stock: bool) -> dict[str, Any]:
    """Start a beat, measure start-up, memory and CPU over the window after it, stop it."""
    beat = Beat(label, ctx.tmp, env, stock=stock, profile=ctx.profile).start()
    out: dict[str, Any] = {}
    try:
        meter = CpuMeter(ctx.admin, [] if stock else [db], beat.pid)
        ticking = beat.wait_ticking(600)
        out.update(startup=beat.startup(), memory_at_ticking=beat.memory())
        sleep_until(ticking + 2)
        a = meter.snap()
        sleep_until(ticking + 2 + ctx.sizes.config_window)
        out["window"] = meter.usage(a, meter.snap())
        out["memory_after_window"] = beat.memory()
        out["problems"] = beat.problems()
        say(
            f"scenario 2: {label}: ticking after {out['startup']['ticking_s']:.1f} s, "
            f"RSS {out['memory_after_window']['rss_mb']:.0f} MB"
        )
    finally:
        out["stop_s"] = beat.stop()
    return out


def scenario_config(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes
    db = make_db(ctx.admin)
    queue = f"bb_scale_{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {"entries": sz.schedules, "dispatch": "on, to Redis (no worker)"}
    try:
        url = PG.format(db=db)
        engine = get_engine(url)
        upgrade(engine)
        engine.dispose()
        entries = {"BENCH_CONFIG_ENTRIES": str(sz.schedules), "BENCH_CONFIG_LEAD": str(sz.config_lead)}
        ours = beat_env(db, queue, dispatch=True, BENCH_CONFIG_KIND="ours", **entries)
        stock = beat_env(db, queue, dispatch=True, BENCH_CONFIG_KIND="stock", **entries)
        say(f"scenario 2: {sz.schedules:,} beat_schedule entries, ours on an empty database")
        out["ours_empty_db"] = one_start(ctx, "config-ours-1", ours, db, stock=False)
        with get_engine(url).connect() as conn:
            out["rows_after_first_start"] = conn.scalar(text("SELECT count(*) FROM boundedbeat_schedules"))
        get_engine(url).dispose()
        steady(db)
        out["ours_populated_db"] = one_start(ctx, "config-ours-2", ours, db, stock=False)
        out["stock_new_file"] = one_start(ctx, "config-stock-1", stock, db, stock=True)
        out["stock_schedule_file_mb"] = sum(p.stat().st_size for p in ctx.tmp.glob("stock-schedule*")) / 1e6
        out["stock_existing_file"] = one_start(ctx, "config-stock-2", stock, db, stock=True)
    finally:
        drop_db(ctx.admin, db)
        purge_redis(queue)
        for p in ctx.tmp.glob("stock-schedule*"):
            p.unlink()
    return out


# -- scenario 3: one tick among 1,000 and among 100,000 ----------------------------------------------------

_DUE_SQL = (
    "SELECT * FROM boundedbeat_schedules WHERE next_due_at <= :now AND paused IS false "
    "AND stopped IS false ORDER BY next_due_at LIMIT 1000 FOR UPDATE SKIP LOCKED"
)
_NEXT_SQL = "SELECT min(next_due_at) FROM boundedbeat_schedules WHERE paused IS false AND stopped IS false"


def explain(engine: Engine, sql: str, now: datetime) -> dict[str, Any]:
    """The plan's top scan node and its buffer reads (in a transaction rolled back)."""
    with engine.connect() as conn:
        plan = conn.execute(text(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"), {"now": now}).scalar_one()
        conn.rollback()
    node = plan[0]["Plan"]
    scan = node
    while scan.get("Plans") and "Scan" not in scan["Node Type"]:
        scan = scan["Plans"][0]
    return {
        "scan": f"{scan['Node Type']} {scan.get('Index Name', '')}".strip(),
        "rows": node.get("Actual Rows"),
        "buffers": node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0),
        "ms": plan[0].get("Execution Time"),
    }


class TickCase:
    """``n`` schedules of which ``rate`` come due per (fake) second, and a beat's view of them."""

    def __init__(self, ctx: Context, n: int) -> None:
        self.ctx = ctx
        self.n = n
        self.rate = ctx.sizes.tick_rate
        self.db = make_db(ctx.admin)
        self.engine = get_engine(PG.format(db=self.db))
        self.app = bench_app(PG.format(db=self.db), "unused")
        self.store = Store(self.engine)
        self.rng = random.Random(1)
        self.resolver = Resolver(self.app, {})
        self.t0 = datetime.now(UTC).replace(microsecond=0)
        self.k = 0
        self.out: dict[str, Any] = {"schedules": n, "period_s": n / self.rate, "due_per_tick": self.rate}

    def setup(self) -> None:
        upgrade(self.engine)
        rows = runtime_rows(
            self.app,
            self.n,
            prefix="t",
            period=self.n / self.rate,  # every schedule due once per period: `rate` per second
            policy=UNBOUNDED,
            first_due=lambda i: self.t0 + timedelta(seconds=i / self.rate),
        )
        bulk_insert(self.engine, rows)
        steady(self.db)
        # Warm: every schedule's spec already in the resolver (rows unchanged since beat saw
        # them). The cache's memory is traced over the first 10,000 only (tracing is slow).
        traced = min(self.n, 10_000)
        query = select(ScheduleRow).order_by(ScheduleRow.name).execution_options(yield_per=2000)
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        with self.store.session() as s:
            for row in s.scalars(query.limit(traced)):
                self.resolver(row)
        gc.collect()
        self.out["resolver_cache_bytes_per_schedule"] = (tracemalloc.get_traced_memory()[0] - base) / traced
        tracemalloc.stop()
        with self.store.session() as s:
            for row in s.scalars(query.offset(traced)):
                self.resolver(row)
        assert len(self.resolver) == self.n

    def tick(self, *, fresh: bool) -> float:
        """One tick transaction one (fake) second after the last; its milliseconds."""
        self.k += 1
        if fresh:  # cold: every due row's spec rebuilt from the row
            self.resolver = Resolver(self.app, {})
        started = time.perf_counter()
        result = self.store.tick(
            self.resolver, self.t0 + timedelta(seconds=self.k), self.rng, 1000, expires_after=3600
        )
        took = (time.perf_counter() - started) * 1000
        if not self.rate <= len(result.emitted) <= self.rate + 1:
            raise SystemExit(f"tick {self.k} among {self.n} emitted {len(result.emitted)}, not {self.rate}")
        return took

    def explain(self) -> None:
        now = self.t0 + timedelta(seconds=self.k + 1)
        self.out["due_query"] = explain(self.engine, _DUE_SQL, now)
        self.out["next_due_query"] = explain(self.engine, _NEXT_SQL, now)

    def close(self) -> None:
        self.engine.dispose()
        drop_db(self.ctx.admin, self.db)


def scenario_ticks(ctx: Context) -> dict[str, Any]:
    """Both sizes tick in turn (alternating which goes first), so a busy machine weighs on both."""
    sz = ctx.sizes
    cases: list[TickCase] = []
    try:
        for n in sz.tick_sizes:
            say(f"scenario 3: {n:,} schedules, {sz.tick_rate} due per second")
            case = TickCase(ctx, n)
            cases.append(case)
            case.setup()
        for case in cases:
            for _ in range(5):  # connections, statement caches
                case.tick(fresh=False)
        if ctx.profile is not None:
            from pyinstrument import Profiler

            ctx.profile.mkdir(parents=True, exist_ok=True)
            for case in cases:
                profiler = Profiler(interval=0.0005)
                profiler.start()
                for _ in range(min(50, sz.ticks)):
                    case.tick(fresh=False)
                profiler.stop()
                text_ = profiler.output_text(unicode=False, show_all=False)
                (ctx.profile / f"tick-{case.n}.txt").write_text(text_)
        say(f"scenario 3: {sz.ticks} warm and {sz.ticks} cold ticks each, in turn")
        meter = CpuMeter(ctx.admin, [case.db for case in cases], os.getpid())
        for kind in ("warm", "cold"):
            took: dict[int, list[float]] = {case.n: [] for case in cases}
            a = meter.snap()
            for i in range(sz.ticks):
                for case in cases if i % 2 == 0 else cases[::-1]:
                    took[case.n].append(case.tick(fresh=kind == "cold"))
            usage = meter.usage(a, meter.snap())
            for case in cases:
                case.out[f"{kind}_ms"] = dist(took[case.n])
                case.out[f"{kind}_cpu"] = usage  # "beat" is this process here
        for case in cases:
            case.explain()
        return {str(case.n): case.out for case in cases}
    finally:
        for case in cases:
            case.close()


# -- scenario 4: changes while 1,000 runs per second come due -----------------------------------------------


def change_client(
    idx: int, url: str, commands: mp.Queue[Any], results: mp.Queue[Any], nice: bool = False
) -> None:
    """A process making changes through the public API, at a paced rate, until told to stop.

    Each name goes add (due at once: its first run is the add's effect) -> 3 s later update
    (a new period: the grid restarts from the change, so a run at the change is its effect)
    -> 3 s later remove (no run of it may be enqueued after the remove returned). Their policy
    lets runs overlap: with no worker the add's run never ends, and under the default
    ``fixed_rate_no_overlap`` the update's run would be skipped as busy.

    ``nice``: at the lowest CPU priority, as if the application making the changes ran on
    other machines; the PostgreSQL work of each change still shares the beat's cores.
    """
    if nice:
        os.nice(19)
    app = bench_app(url, "unused")
    remove_schedule(app, f"chg-warmup-{idx}")  # connect
    results.put(("ready", idx))
    seq = 0
    while True:
        command = commands.get()
        if command is None:
            return
        rate, start, end = command
        added: deque[tuple[str, float]] = deque()
        updated: deque[tuple[str, float]] = deque()
        ops: list[tuple[str, str, float, float, str]] = []
        cpu0 = time.process_time()
        sleep_until(start)
        k = 0
        while True:
            due = start + k / rate
            now = time.time()
            if due > now:
                if due >= end:
                    break
                time.sleep(due - now)
            elif now >= end:
                break
            k += 1
            t = time.time()
            error = ""
            try:
                if updated and t - updated[0][1] >= 3:
                    name, _ = updated.popleft()
                    op = "remove"
                    remove_schedule(app, name)
                elif added and t - added[0][1] >= 3:
                    name, _ = added.popleft()
                    op = "update"
                    update_schedule(app, name, schedule=HOUR / 2)
                    updated.append((name, time.time()))
                else:
                    seq += 1
                    name = f"chg-{idx}-{seq}"
                    op = "add"
                    add_schedule(app, name, TASK, HOUR, args=[seq], policy=UNBOUNDED)
                    added.append((name, time.time()))
            except Exception as exc:  # counted and reported; the phase goes on
                error = f"{type(exc).__name__}: {exc}"
            ops.append((op, name, t, time.time(), error))
        results.put(("done", idx, ops, time.process_time() - cpu0))


def change_effects(engine: Engine, ops: list[tuple[str, str, float, float, str]]) -> dict[str, Any]:
    """Latency from each change's call returning to the run it causes (or must prevent)."""
    names = {o[1] for o in ops}
    runs: dict[str, list[tuple[float, float]]] = {}
    with engine.connect() as conn:
        for name, due, enqueued in conn.execute(
            text(
                "SELECT schedule, extract(epoch FROM scheduled_for), extract(epoch FROM enqueued_at) "
                "FROM boundedbeat_runs WHERE schedule LIKE 'chg-%'"
            )
        ):
            if name in names:
                runs.setdefault(name, []).append((float(due), float(enqueued)))
    for found in runs.values():
        found.sort()
    add_lat, update_lat, missing, after_remove = [], [], {"add": 0, "update": 0}, 0
    for op, name, t0, t1, error in ops:
        if error:
            continue
        found = runs.get(name, [])
        if op == "add":
            if found:
                add_lat.append(found[0][1] - t1)
            else:
                missing["add"] += 1
        elif op == "update":
            later = [r for r in found if r[0] >= t0]
            if later:
                update_lat.append(later[0][1] - t1)
            else:
                missing["update"] += 1
        elif op == "remove":
            after_remove += sum(1 for r in found if r[1] > t1)
    both = add_lat + update_lat
    return {
        "latency_s": dist(both),
        "add_latency_s": dist(add_lat),
        "update_latency_s": dist(update_lat),
        "effects_missing": missing,
        "runs_after_remove": after_remove,
    }


def scenario_changes(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes
    db = make_db(ctx.admin)
    beat: Beat | None = None
    clients: list[Any] = []
    commands: list[mp.Queue[Any]] = []
    out: dict[str, Any] = {
        "load_schedules": sz.load,
        "load_period_s": 1.0,
        "dispatch": "off (runs measured in the runs table)",
        "clients_niced": ctx.nice_clients,
    }
    try:
        url = PG.format(db=db)
        engine = get_engine(url)
        upgrade(engine)
        app = bench_app(url, "unused")
        start = time.time() + 10
        bulk_insert(
            engine,
            runtime_rows(
                app,
                sz.load,
                prefix="load-",
                period=1.0,
                policy=UNBOUNDED,
                first_due=lambda i: utc(start + i / sz.load),
            ),
        )
        steady(db)
        beat = Beat(
            "changes",
            ctx.tmp,
            beat_env(db, "unused", dispatch=False),
            loglevel="WARNING",
            profile=ctx.profile,
        ).start()
        meter = CpuMeter(ctx.admin, [db], beat.pid)
        ticking = beat.wait_ticking(120)
        running = beat
        spawn = mp.get_context("spawn")
        results: mp.Queue[Any] = spawn.Queue()
        for idx in range(sz.clients):
            q: mp.Queue[Any] = spawn.Queue()
            p = spawn.Process(
                target=change_client, args=(idx, url, q, results, ctx.nice_clients), daemon=True
            )
            p.start()
            clients.append(p)
            commands.append(q)
        for _ in clients:
            assert results.get(timeout=120)[0] == "ready"
        w = sz.change_window

        def window(label: str, a: float, rate: float | None = None, load: int = sz.load) -> dict[str, Any]:
            """One measured phase; with ``rate`` the clients make changes during it."""
            if rate is not None:
                for q in commands:
                    q.put((rate / sz.clients, a, a + w))
            sleep_until(a)
            s0 = meter.snap()
            sleep_until(a + w)
            ops: list[tuple[str, str, float, float, str]] = []
            client_cpu = 0.0
            if rate is not None:
                for _ in clients:
                    _, _, found, cpu = results.get(timeout=120)
                    ops.extend(found)
                    client_cpu += cpu
            s1 = meter.snap()
            time.sleep(3)  # let the runs due in the window (and the changes' effects) land
            res: dict[str, Any] = {"cpu": meter.usage(s0, s1, clients=client_cpu)}
            ticks = running.ticks(a, a + w)
            res["ticks_per_s"] = len(ticks) / w
            res["tick_transaction_ms"] = dist([t[1] * 1000 for t in ticks])
            res["rows_per_tick"] = statistics.mean(t[3] for t in ticks) if ticks else 0
            # Time between one tick transaction's end and the next one's start: the beat's
            # other work, or a pause of its process (the oldest generation's collections).
            res["tick_gap_ms"] = dist([(b[0] - a[0] - a[1]) * 1000 for a, b in pairwise(ticks)])
            pauses = running.pauses(a, a + w)
            res["gc_pauses"] = {"n": len(pauses), "max_ms": max(pauses, default=0.0) * 1000}
            res["runs_emitted_per_s"] = sum(t[2] for t in ticks) / w
            drift = drift_of(engine, "load-%", a, a + w)
            drifts[label] = drift
            res["load_runs"] = len(drift)
            res["load_runs_expected"] = round(w * load)
            res["drift_s"] = dist(drift)
            res["runs_later_than_500ms"] = sum(1 for d in drift if d > 0.5)
            if rate is not None:
                done = [o for o in ops if a <= o[3] < a + w]
                res["changes_asked_per_s"] = rate
                res["changes_per_s"] = len(done) / w
                res["changes_by_kind"] = {
                    k: sum(1 for o in done if o[0] == k) for k in ("add", "update", "remove")
                }
                res["change_errors"] = sorted({o[4] for o in ops if o[4]})[:5]
                res["change_call_ms"] = dist([(o[3] - o[2]) * 1000 for o in done])
                res["client_cpu_us_per_change"] = client_cpu / max(len(ops), 1) * 1e6
                res.update(change_effects(engine, ops))
            say(
                f"scenario 4: {label}: drift p99 {res['drift_s']['p99']:.3f} s"
                + (
                    f", {res['changes_per_s']:.0f} changes/s, latency p99 {res['latency_s']['p99']:.3f} s"
                    if rate
                    else ""
                )
            )
            return res

        # Every phase with changes is bracketed by two without, and its drift compared with
        # theirs pooled: other processes' load on the machine comes and goes within minutes.
        drifts: dict[str, list[float]] = {}
        baselines = [window("no changes 1", ticking + 10)]
        phases = [("changes", sz.change_rate)]
        while phases:
            key, rate = phases.pop(0)
            out[key] = window(key, time.time() + 3, rate=rate)
            baselines.append(window(f"no changes {len(baselines) + 1}", time.time() + 3))
            pooled = drifts[f"no changes {len(baselines) - 1}"] + drifts[f"no changes {len(baselines)}"]
            out[key]["baseline_drift_s"] = dist(pooled)
            out[key]["drift_p99_ratio"] = out[key]["drift_s"]["p99"] / out[key]["baseline_drift_s"]["p99"]
            achieved = out["changes"]["changes_per_s"]
            if key == "changes" and achieved < 0.95 * sz.change_rate:
                # Not sustained: the same at a half and a quarter of the rate reached.
                phases = [
                    (k, max(5, round(achieved / share)))
                    for k, share in (("changes_half", 2), ("changes_quarter", 4))
                ]
        out["no_changes"] = baselines[0]
        out["no_changes_all"] = {
            "windows": len(baselines),
            "drift_s": dist([d for k, v in drifts.items() if k.startswith("no changes") for d in v]),
            "drift_p99_each_s": [b["drift_s"]["p99"] for b in baselines],
            "other_load_pct_each": [b["cpu"]["other_pct"] for b in baselines],
            "runs_emitted_per_s": statistics.mean(b["runs_emitted_per_s"] for b in baselines),
        }
        # The same number of runs per second as during the changes, from static schedules.
        extra = max(0, round(out["changes"]["runs_emitted_per_s"] - sz.load))
        out["matched_extra"] = extra
        if extra:
            first = time.time() + 3
            bulk_insert(
                engine,
                runtime_rows(
                    app,
                    extra,
                    prefix="load-x",
                    period=1.0,
                    policy=UNBOUNDED,
                    first_due=lambda i: utc(first + i / extra),
                ),
            )
            with engine.begin() as conn:
                conn.execute(text("SELECT pg_notify('boundedbeat_schedules', '')"))
            out["no_changes_matched_runs"] = window(
                f"no changes, {sz.load + extra} runs/s", first + 2, load=sz.load + extra
            )
            ratio = out["changes"]["drift_s"]["p99"] / out["no_changes_matched_runs"]["drift_s"]["p99"]
            out["changes"]["drift_p99_ratio_to_matched_runs"] = ratio
        out["problems"] = beat.problems()
        for q in commands:
            q.put(None)
        out["stop_s"] = beat.stop()
        beat = None
        engine.dispose()
    finally:
        for p in clients:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if beat is not None:
            beat.stop()
        drop_db(ctx.admin, db)
    return out


# -- the report ------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class Context:
    sizes: Sizes
    admin: psycopg.Connection[Any]
    tmp: Path
    profile: Path | None
    nice_clients: bool = False


def fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{unit}"


def table(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, measured, target or baseline, ratio) rows for the printed table."""
    rows: list[tuple[str, str, str, str]] = []

    def add(label: str, measured: str, target: str = "", ratio: float | None = None) -> None:
        rows.append((label, measured, target, "" if ratio is None else f"{ratio:.2f}"))

    r1 = results.get("1_runtime")
    if r1:
        n = r1["schedules"]
        su = r1["startup"]
        add(
            f"1 runtime {n:,}: start-up to ticking",
            fmt(su["ticking_s"], " s"),
            "<= 10 s",
            su["ticking_s"] / 10,
        )
        add("  of which: setup (import, validate, DB check)", fmt(su["setup_end_s"], " s"))
        add("  of which: lease + reconcile + first tick", fmt(su["ticking_s"] - su["setup_end_s"], " s"))
        for key, label in (
            ("memory_at_ticking", "RSS at ticking"),
            ("memory_after_steady", f"RSS after steady window ({r1['schedules_ticked_by_then']:,} ticked)"),
            ("memory_after_full_pass", "RSS after full pass (every schedule ticked)"),
            ("memory_after_full_pass_dispatched", "RSS after full pass dispatched"),
        ):
            m = r1[key]
            add(f"  {label}", fmt(m["rss_mb"], " MB", 0), "<= 300 MB", m["rss_mb"] / 300)
        add(
            "  peak RSS (VmHWM) by then",
            fmt(r1["memory_after_full_pass_dispatched"]["peak_rss_mb"], " MB", 0),
            "<= 300 MB",
        )
        add("  CPU idle (nothing due)", fmt(r1["idle"]["beat_pct"], " % core", 2), "stock 0 %")
        add("  PostgreSQL CPU for it", fmt(r1["idle"]["postgres_pct"], " % core", 2))
        st = r1["steady"]
        add(f"  CPU at {st['runs_due_per_s']:.1f} runs/s due", fmt(st["beat_pct"], " % core", 1))
        add(
            "  tick transaction p50 / p99",
            " / ".join(fmt(st["tick_transaction_ms"][p], " ms") for p in ("p50", "p99")),
        )
        add("  runs enqueued > 0.5 s late", f"{st['runs_later_than_500ms']} of {st['drift_s']['n']}")
        add(
            "  drift p50 / p99",
            f"{fmt(st['drift_s']['p50'] * 1000, ' ms', 0)} / {fmt(st['drift_s']['p99'] * 1000, ' ms', 0)}",
        )
        fp = r1["full_pass"]
        add("  full pass: runs emitted per s", fmt(fp["runs_per_s"], "/s", 0))
        add(
            "  full pass: ticked / dispatched in",
            f"{fmt(fp['tick_s'], ' s')} / {fmt(fp['dispatched_s'], ' s')}",
        )
        api = r1["api"]
        add("  add_schedule calls/s (1 process)", fmt(api["add_schedule_per_s"], "/s", 0))
        add("  update_schedule calls/s (1 process)", fmt(api["update_schedule_per_s"], "/s", 0))
        add("  remove_schedule calls/s (1 process)", fmt(api["remove_schedule_per_s"], "/s", 0))
    r2 = results.get("2_config")
    if r2:
        n = r2["entries"]
        se, sp = r2["ours_empty_db"], r2["ours_populated_db"]
        ke, kp = r2["stock_new_file"], r2["stock_existing_file"]
        for label, ours, stock in (("empty DB / new file", se, ke), ("populated DB / existing file", sp, kp)):
            o, s = ours["startup"]["ticking_s"], stock["startup"]["ticking_s"]
            add(f"2 config {n:,}, {label}: start-up", fmt(o, " s"), f"stock {fmt(s, ' s')}; <= 10 s", o / s)
            add(
                "  of which: setup (import, validate, DB check)",
                fmt(ours["startup"]["setup_end_s"], " s"),
                f"stock {fmt(stock['startup']['setup_end_s'], ' s')}",
            )
            om, sm = ours["memory_after_window"]["rss_mb"], stock["memory_after_window"]["rss_mb"]
            add("  RSS after start-up", fmt(om, " MB", 0), f"stock {fmt(sm, ' MB', 0)}; <= 300 MB", om / sm)
            op, spk = ours["memory_after_window"]["peak_rss_mb"], stock["memory_after_window"]["peak_rss_mb"]
            add("  peak RSS (VmHWM)", fmt(op, " MB", 0), f"stock {fmt(spk, ' MB', 0)}", op / spk)
            add(
                "  CPU idle",
                fmt(ours["window"]["beat_pct"], " % core", 2),
                f"stock {fmt(stock['window']['beat_pct'], ' % core', 2)}",
            )
    r3 = results.get("3_ticks")
    if r3:
        small, big = (r3[str(k)] for k in sorted(int(k) for k in r3 if k.isdigit()))
        for kind in ("warm", "cold"):
            s, b = small[f"{kind}_ms"], big[f"{kind}_ms"]
            add(
                f"3 tick, {small['due_per_tick']} due among {big['schedules']:,} "
                f"vs {small['schedules']:,} ({kind}) p50",
                fmt(b["p50"], " ms"),
                f"{fmt(s['p50'], ' ms')} at {small['schedules']:,}",
                b["p50"] / s["p50"],
            )
            add(
                "  p99",
                fmt(b["p99"], " ms"),
                f"{fmt(s['p99'], ' ms')} at {small['schedules']:,}",
                b["p99"] / s["p99"],
            )
        add(
            "  due query: buffers read (EXPLAIN ANALYZE)",
            str(big["due_query"]["buffers"]),
            f"{small['due_query']['buffers']} at {small['schedules']:,}",
            big["due_query"]["buffers"] / small["due_query"]["buffers"],
        )
        add(
            "  due query plan",
            "index scan" if "Index" in big["due_query"]["scan"] else big["due_query"]["scan"],
        )
        add("  resolver cache per schedule", fmt(big["resolver_cache_bytes_per_schedule"] / 1024, " KiB", 2))
    r4 = results.get("4_changes")
    if r4:
        ch, every = r4["changes"], r4["no_changes_all"]
        add(
            f"4 changes, {r4['load_schedules']:,} runs/s due"
            + (" (clients niced)" if r4.get("clients_niced") else "")
            + f": asked {ch['changes_asked_per_s']}/s, sustained",
            fmt(ch["changes_per_s"], "/s", 0),
            f"{ch['changes_asked_per_s']}/s",
            ch["changes_per_s"] / ch["changes_asked_per_s"],
        )
        p99s = ", ".join(fmt(v * 1000, "", 0) for v in every["drift_p99_each_s"])
        add(
            f"  tick drift p99 without changes ({every['windows']} windows)",
            fmt(every["drift_s"]["p99"] * 1000, " ms", 0),
            f"each: {p99s} ms",
        )
        for key, label in (
            ("changes", "at that rate"),
            ("changes_half", "at half that rate"),
            ("changes_quarter", "at a quarter of it"),
        ):
            c = r4.get(key)
            if not c:
                continue
            if key != "changes":
                add(
                    f"  changes asked {c['changes_asked_per_s']}/s, sustained",
                    fmt(c["changes_per_s"], "/s", 0),
                )
            add(
                f"  change-to-effect p50 / p99 {label}",
                f"{fmt(c['latency_s']['p50'], ' s', 3)} / {fmt(c['latency_s']['p99'], ' s', 3)}",
                "p99 <= 2 s",
                c["latency_s"]["p99"] / 2,
            )
            add(
                f"  tick drift p99 {label}",
                fmt(c["drift_s"]["p99"] * 1000, " ms", 0),
                f"windows around it {fmt(c['baseline_drift_s']['p99'] * 1000, ' ms', 0)}; <= 1.5x",
                c["drift_p99_ratio"],
            )
            add(
                f"  runs emitted/s {label}",
                fmt(c["runs_emitted_per_s"], "/s", 0),
                f"without changes {fmt(every['runs_emitted_per_s'], '/s', 0)}",
            )
        m = r4.get("no_changes_matched_runs")
        if m:
            add(
                f"  tick drift p99 without changes, {r4['load_schedules'] + r4['matched_extra']:,} runs/s",
                fmt(m["drift_s"]["p99"] * 1000, " ms", 0),
                f"with changes {fmt(ch['drift_s']['p99'] * 1000, ' ms', 0)}",
                ch["drift_s"]["p99"] / m["drift_s"]["p99"],
            )
    return rows


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    widths = [
        max(len(r[i]) for r in [*rows, ("figure", "measured", "target / baseline", "ratio")])
        for i in range(4)
    ]
    header = ("figure", "measured", "target / baseline", "ratio")
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}")


def load_notes(results: dict[str, Any]) -> list[str]:
    """How busy the rest of the machine was during each measured window."""
    notes = []
    for scenario, data in results.items():
        if not isinstance(data, dict):
            continue
        stack = [(scenario, data)]
        while stack:
            path, node = stack.pop()
            for key, value in node.items():
                if isinstance(value, dict):
                    if "other_pct" in value and "machine_pct" in value:
                        notes.append(
                            f"  {path}.{key}: machine {value['machine_pct']:.0f} % of one core busy, "
                            f"{value['other_pct']:.0f} % by other processes"
                        )
                    else:
                        stack.append((f"{path}.{key}", value))
    return notes


SCENARIOS: dict[str, tuple[str, Callable[[Context], dict[str, Any]]]] = {
    "1": ("1_runtime", scenario_runtime),
    "2": ("2_config", scenario_config),
    "3": ("3_ticks", scenario_ticks),
    "4": ("4_changes", scenario_changes),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the size, short windows")
    parser.add_argument("--only", default="1,2,3,4", help="scenarios to run, e.g. 1,3")
    parser.add_argument("--json", default=None, help="where to write the results (default: a temp file)")
    parser.add_argument("--profile", default=None, help="directory for py-spy / pyinstrument profiles")
    parser.add_argument(
        "--nice-clients",
        action="store_true",
        help="scenario 4: run the change clients at the lowest CPU priority (as if on other machines)",
    )
    parser.add_argument(
        "--schedules",
        type=int,
        default=None,
        help="scenarios 1 and 2: the number of schedules (default 100,000; 1,000,000 for the million)",
    )
    args = parser.parse_args()
    sizes = QUICK if args.quick else Sizes()
    if args.schedules is not None:
        # Scenario 3 then times one tick among 1,000 and among as many schedules.
        sizes = dataclasses.replace(sizes, schedules=args.schedules, tick_sizes=(1000, args.schedules))
    tmp = Path(tempfile.mkdtemp(prefix="bb_scale_"))
    json_path = (
        Path(args.json)
        if args.json
        else Path(tempfile.gettempdir()) / f"boundedbeat-scale-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    with admin_connection() as admin:
        ctx = Context(
            sizes=sizes,
            admin=admin,
            tmp=tmp,
            profile=Path(args.profile) if args.profile else None,
            nice_clients=args.nice_clients,
        )
        results: dict[str, Any] = {
            "machine": machine(admin),
            "sizes": dataclasses.asdict(sizes),
            "quick": args.quick,
        }
        m = results["machine"]
        print(
            f"machine: {m['cores']} cores ({m['cpu']}), {m['memory_gb']} GB, Python {m['python']}, "
            f"PostgreSQL {m['postgresql']}, Celery {m['celery']}, SQLAlchemy {m['sqlalchemy']}; "
            f"commit {m['commit']}; load average {m['loadavg_at_start'][0]:.2f}"
        )
        if m["package_files_changed_in_tree"]:
            print(
                "  package files changed in the working tree: "
                + ", ".join(m["package_files_changed_in_tree"])
            )
        try:
            for key in args.only.split(","):
                name, run = SCENARIOS[key.strip()]
                t0 = time.time()
                results[name] = run(ctx)
                results[name]["scenario_s"] = time.time() - t0
                json_path.write_text(json.dumps(results, indent=2, default=str))
        finally:
            results["machine"]["loadavg_at_end"] = os.getloadavg()
            json_path.write_text(json.dumps(results, indent=2, default=str))
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print_table(table(results))
    print("\nload on the machine during each window (percent of one core; 2 cores = 200 %):")
    print("\n".join(load_notes(results)))
    problems = [(k, p) for k, v in results.items() if isinstance(v, dict) for p in v.get("problems", [])]
    for k, v in results.items():
        if isinstance(v, dict):
            for sub in v.values():
                if isinstance(sub, dict):
                    problems += [(k, p) for p in sub.get("problems", [])]
    if problems:
        print("\nbeat logged errors:")
        for k, p in problems[:20]:
            print(f"  {k}: {p}")
    print(f"\nresults: {json_path}")


if __name__ == "__main__":
    main()
