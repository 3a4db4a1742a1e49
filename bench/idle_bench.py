"""Idle cost with runs in flight, next to stock Celery beat (issue 36, item 2).

Run: ``.venv/bin/python bench/idle_bench.py [--schedules 100] [--seconds 60] [--rounds 1]
[--before DIR] [--json PATH]`` (needs the local PostgreSQL and Redis). bench/README.md says
what each figure means.

Three cases, each a real ``celery beat`` process running ``bench/scale_app.py`` on a fresh
database ``bb_idle_*`` with the in-beat dispatcher on, Redis as the broker and no worker:

* ``stock``: Celery's ``PersistentScheduler`` with ``--schedules`` hourly ``beat_schedule``
  entries (a new schedule file: nothing is due for an hour);
* ``idle``: ``celery_boundedbeat.Scheduler`` with as many hourly entries whose first runs are an
  hour or more away: no run in flight;
* ``in flight``: the same entries with their first runs due at start: each schedule's run is
  published and waits for a worker (none runs) while nothing else is due for an hour.

Each beat is started, the script waits until it ticks (and, in flight, until every run is
``published``), lets it settle for ``--warmup`` seconds and measures one window: the beat
process's CPU (user + system of every thread, ``/proc/<pid>/stat``), the CPU of the PostgreSQL
backends serving its database, the transactions of that database (``pg_stat_database``) and
the voluntary context switches of the beat's main thread (how often it woke). ``--before DIR``
also runs the two cases of ours with the package from ``DIR`` (a checkout of an older commit),
so a change is measured next to what it replaced in the same run of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
from scale_bench import (
    PG,
    Beat,
    CpuMeter,
    admin_connection,
    beat_env,
    drop_db,
    machine,
    purge_redis,
    say,
)
from sqlalchemy import create_engine

from celery_boundedbeat.db.migrate import upgrade

#: The checkout whose package the beats run unless ``--before`` names another one.
HERE_CHECKOUT = str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True)
class Case:
    """One configuration to measure: which scheduler, whether its runs are in flight, which code."""

    name: str
    stock: bool = False
    in_flight: bool = False
    package: str = HERE_CHECKOUT


@dataclass
class Measured:
    case: str
    seconds: float
    beat_pct: float
    postgres_pct: float
    machine_pct: float
    transactions_per_min: float
    wakeups_per_min: float
    runs_in_flight: int


def transactions(admin: psycopg.Connection[Any], db: str) -> int:
    """Transactions committed or rolled back in ``db`` (as far as the statistics have them)."""
    row = admin.execute(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", [db]
    ).fetchone()
    return int(row[0]) if row else 0


def wakeups(pid: int) -> int:
    """Voluntary context switches of the process's main thread: each is a sleep it woke from."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def in_flight(admin: psycopg.Connection[Any], db: str) -> int:
    """Runs ``published`` and waiting for a worker in ``db`` (0 when the tables do not exist)."""
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{db}", autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('boundedbeat_runs') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return 0
        row = conn.execute("SELECT count(*) FROM boundedbeat_runs WHERE state = 'published'").fetchone()
    return int(row[0]) if row else 0


def measure(case: Case, args: argparse.Namespace, admin: psycopg.Connection[Any], tmp: Path) -> Measured:
    n = args.schedules
    db = f"bb_idle_{uuid.uuid4().hex[:10]}"
    queue = f"bb_idle_{uuid.uuid4().hex[:8]}"
    admin.execute(f'CREATE DATABASE "{db}"')
    engine = create_engine(PG.format(db=db))
    upgrade(engine)  # this checkout's schema: the same as the older one's unless it migrates
    engine.dispose()
    work = tmp / f"{case.name.replace(' ', '-')}-{uuid.uuid4().hex[:6]}"
    work.mkdir()
    env = beat_env(
        db,
        queue,
        dispatch=True,
        BENCH_CONFIG_ENTRIES=str(n),
        BENCH_CONFIG_KIND="stock" if case.stock else "ours",
        # Ours: first runs an hour or more away, or all due at start (then hourly).
        BENCH_CONFIG_LEAD="0" if case.in_flight else "3600",
        BENCH_CONFIG_SPREAD="0" if case.in_flight else "3600",
    )
    beat = Beat(case.name.replace(" ", "-"), work, env, stock=case.stock, loglevel="WARNING")
    beat.env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), case.package])
    try:
        beat.start()
        beat.wait_ticking(120)
        if case.in_flight:
            deadline = time.time() + 120
            while in_flight(admin, db) < n:
                if time.time() > deadline or not beat.alive():
                    raise SystemExit(
                        f"{case.name}: {in_flight(admin, db)} of {n} runs published\n{beat.tail()}"
                    )
                time.sleep(0.2)
        time.sleep(args.warmup)
        meter = CpuMeter(admin, [db], beat.pid)
        a, xa, wa = meter.snap(), transactions(admin, db), wakeups(beat.pid)
        time.sleep(args.seconds)
        b, xb, wb = meter.snap(), transactions(admin, db), wakeups(beat.pid)
        usage = CpuMeter.usage(a, b)
        flying = 0 if case.stock else in_flight(admin, db)
        if case.in_flight and flying != n:
            raise SystemExit(f"{case.name}: {flying} of {n} runs still published after the window")
        if not case.in_flight and flying:
            raise SystemExit(f"{case.name}: {flying} runs published where none was due")
        if not beat.alive() or beat.problems():
            raise SystemExit(f"{case.name}: the beat failed:\n{beat.tail()}")
        minutes = usage["seconds"] / 60
        return Measured(
            case=case.name,
            seconds=usage["seconds"],
            beat_pct=usage["beat_pct"],
            postgres_pct=usage["postgres_pct"],
            machine_pct=usage["machine_pct"],
            transactions_per_min=(xb - xa) / minutes,
            wakeups_per_min=(wb - wa) / minutes,
            runs_in_flight=flying,
        )
    finally:
        beat.stop()
        drop_db(admin, db)
        purge_redis(queue)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=60.0, help="each measured window")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds after ticking (and publishing)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every case, alternating order")
    parser.add_argument("--before", help="a checkout of older code: its package runs the cases of ours too")
    parser.add_argument("--only", help="these cases alone, comma-separated (stock,idle,in flight)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    cases = [Case("stock", stock=True), Case("idle"), Case("in flight", in_flight=True)]
    if args.before:
        package = str(Path(args.before).resolve())
        cases += [
            Case("idle (before)", package=package),
            Case("in flight (before)", in_flight=True, package=package),
        ]
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        cases = [case for case in cases if case.name.removesuffix(" (before)") in wanted]
    admin = admin_connection()
    info = machine(admin)
    say(
        f"{info['cores']} cores, {info['cpu']}, Python {info['python']}, PostgreSQL {info['postgresql']}, "
        f"commit {info['commit']}, package files changed: {info['package_files_changed_in_tree'] or 'none'}"
    )
    say(
        f"{args.schedules} hourly schedules, windows of {args.seconds:g} s, {args.rounds} round(s), no worker"
    )
    tmp = Path(tempfile.mkdtemp(prefix="bb_idle_"))
    results: list[Measured] = []
    try:
        for r in range(args.rounds):
            for case in cases if r % 2 == 0 else list(reversed(cases)):
                say(f"round {r + 1}: {case.name} ...")
                m = measure(case, args, admin, tmp)
                say(
                    f"  beat {m.beat_pct:.3f} % of a core, PostgreSQL {m.postgres_pct:.3f} %, "
                    f"{m.transactions_per_min:.0f} transactions/min, {m.wakeups_per_min:.0f} wakeups/min, "
                    f"machine {m.machine_pct:.0f} %"
                )
                results.append(m)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def mean(name: str, field: str) -> float:
        return statistics.fmean(getattr(m, field) for m in results if m.case == name)

    stock = mean("stock", "beat_pct") if any(c.stock for c in cases) else 0.0
    print()
    head = ("case", "beat % core", "x stock", "PG % core", "xact/min", "wakeups/min")
    print(f"{head[0]:<20} {head[1]:>12} {head[2]:>8} {head[3]:>10} {head[4]:>9} {head[5]:>12}")
    for case in cases:
        beat_pct = mean(case.name, "beat_pct")
        ratio = f"{beat_pct / stock:.2f}" if stock > 0 else "-"
        print(
            f"{case.name:<20} {beat_pct:>12.3f} {ratio:>8} {mean(case.name, 'postgres_pct'):>10.3f} "
            f"{mean(case.name, 'transactions_per_min'):>9.0f} {mean(case.name, 'wakeups_per_min'):>12.0f}"
        )
    for suffix in ("", " (before)") if args.before else ("",):
        names = {f"in flight{suffix}", f"idle{suffix}"}
        if not names <= {c.name for c in cases}:
            continue
        flight, idle = mean(f"in flight{suffix}", "beat_pct"), mean(f"idle{suffix}", "beat_pct")
        if idle > 0:
            print(f"in flight / idle{suffix}, beat CPU: {flight / idle:.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": info, "args": vars(args), "runs": [asdict(m) for m in results]}, indent=2)
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
