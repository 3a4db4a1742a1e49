"""Partitioned beats: beat CPU per 1,000 runs with 1, 2 and 4 beats (issue 36, item 5).

Run: ``.venv/bin/python bench/partition_bench.py [--schedules 1000] [--period 1]
[--partitions 16] [--seconds 60] [--rounds 2] [--json PATH]`` (needs the local PostgreSQL and
Redis). bench/README.md says what each figure means.

Each configuration gets a fresh migrated database ``bb_part_*`` with the same runtime
schedules (``add_schedule``, same names, so the same hash slots and partitions), then starts
its beats together (real ``celery beat -S scale_app:Marked`` processes running
``bench/scale_app.py``, ``boundedbeat_partitions = P``, the in-beat dispatcher on, Redis
broker, no worker), waits until ``boundedbeat beats --json`` shows each beat with its fair
share, lets them warm up and measures one window: the beats' CPU (user + system from
``/proc/<pid>/stat``, summed over the beats), the runs they emitted and published, and the
PostgreSQL backends of that database apart. Configurations run in the order 1, 2, 4, 4, 2, 1
beats (``--rounds 2``) so a machine that drifts weighs on each alike; one beat with a single
partition (the lease-holder beat) runs first in each round as a reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from scale_bench import (
    CELERY,
    CHECKOUT_PATH,
    PG,
    TASK,
    TICK,
    UNBOUNDED,
    Beat,
    admin_connection,
    beat_env,
    bench_app,
    drop_db,
    machine,
    machine_busy,
    proc_cpu,
    purge_redis,
    say,
    sleep_until,
)

from celery_boundedbeat import add_schedule
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.migrate import upgrade

#: Target of issue 36: CPU per 1,000 runs at 4 beats within 1.15x of one beat.
TARGET_RATIO = 1.15


@dataclass(frozen=True, kw_only=True)
class Plan:
    schedules: int
    period: float
    partitions: int
    seconds: float
    warmup: float
    rounds: int
    reference: bool

    def order(self) -> list[tuple[int, int]]:
        """(beats, partitions) per configuration: 1, 2, 4 then 4, 2, 1, and so on."""
        up = [(1, self.partitions), (2, self.partitions), (4, self.partitions)]
        out: list[tuple[int, int]] = []
        for i in range(self.rounds):
            leg = up if i % 2 == 0 else up[::-1]
            out += ([(1, 1)] if self.reference else []) + leg
        return out


def main_thread_cpu(pid: int) -> float:
    """CPU seconds of a process's main thread alone: the tick loop, renewals and membership.

    The rest of the process is its other threads: the in-beat dispatcher above all.
    """
    return proc_cpu_path(f"/proc/{pid}/task/{pid}/stat")


def proc_cpu_path(path: str) -> float:
    try:
        with open(path) as f:
            fields = f.read().rpartition(") ")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


@dataclass(kw_only=True)
class Snap:
    t: float
    beats: list[float]
    mains: list[float]
    pg: dict[int, float]
    busy: float
    total: float
    runs: int
    published: int
    #: Transactions committed in the configuration's database (``pg_stat_database``).
    commits: int


@dataclass(kw_only=True)
class Config:
    """One configuration's database, queue and beats."""

    beats: int
    partitions: int
    tmp: Path
    db: str = field(default_factory=lambda: f"bb_part_{uuid.uuid4().hex[:10]}")
    queue: str = field(default_factory=lambda: f"bb_part_{uuid.uuid4().hex[:8]}")
    procs: list[Beat] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return beat_env(self.db, self.queue, dispatch=True, BENCH_PARTITIONS=str(self.partitions))


def db_conn(db: str) -> psycopg.Connection[Any]:
    return psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{db}", autocommit=True)


def prepare(admin: psycopg.Connection[Any], cfg: Config, plan: Plan) -> None:
    """A migrated database holding the plan's runtime schedules, added through the public API."""
    admin.execute(f'CREATE DATABASE "{cfg.db}"')
    url = PG.format(db=cfg.db)
    engine = get_engine(url)
    upgrade(engine)
    engine.dispose()
    app = bench_app(url, cfg.queue)
    for i in range(plan.schedules):
        add_schedule(app, f"p-{i:06d}", TASK, plan.period, args=[i], policy=UNBOUNDED)
    with db_conn(cfg.db) as conn:
        conn.execute("VACUUM ANALYZE boundedbeat_schedules")


def live_beats(cfg: Config) -> list[dict[str, Any]]:
    """``celery -A scale_app boundedbeat beats --json``, as an operator would ask."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY", "BENCH_"))}
    env.update(cfg.env, BENCH_MARKS=str(cfg.tmp / "cli.marks"), PYTHONPATH=CHECKOUT_PATH)
    out = subprocess.run(
        [CELERY, "-A", "scale_app", "boundedbeat", "beats", "--json"],
        cwd=cfg.tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise SystemExit(f"boundedbeat beats failed:\n{out.stderr}")
    return list(json.loads(out.stdout))


def wait_shared(cfg: Config, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Until every beat is live and the partitions are split fairly among them."""
    deadline = time.time() + timeout
    fair = {cfg.partitions // cfg.beats, -(-cfg.partitions // cfg.beats)}
    found: list[dict[str, Any]] = []
    while time.time() < deadline:
        for p in cfg.procs:
            if not p.alive():
                raise SystemExit(f"{p.label}: exited:\n{p.tail()}")
        found = live_beats(cfg)
        owned = sorted(q for b in found for q in b["partitions"])
        if (
            len(found) == cfg.beats
            and owned == list(range(cfg.partitions))
            and {len(b["partitions"]) for b in found} <= fair
        ):
            return found
        time.sleep(1.0)
    raise SystemExit(f"beats not sharing after {timeout:.0f} s: {found}")


def snap(admin: psycopg.Connection[Any], conn: psycopg.Connection[Any], cfg: Config) -> Snap:
    query = "SELECT pid FROM pg_stat_activity WHERE datname = %s"
    pids = [r[0] for r in admin.execute(query, [cfg.db])]
    counts = conn.execute("SELECT count(*), count(published_at) FROM boundedbeat_runs").fetchone()
    assert counts is not None
    busy, total = machine_busy()
    stat = "SELECT xact_commit FROM pg_stat_database WHERE datname = %s"
    commits = admin.execute(stat, [cfg.db]).fetchone()
    return Snap(
        t=time.time(),
        beats=[proc_cpu(p.pid) for p in cfg.procs],
        mains=[main_thread_cpu(p.pid) for p in cfg.procs],
        pg={p: proc_cpu(p) for p in pids if p != conn.info.backend_pid},
        busy=busy,
        total=total,
        runs=int(counts[0]),
        published=int(counts[1]),
        commits=int(commits[0]) if commits else 0,
    )


#: Publish time minus scheduled time of the runs published in a window (ms): p50, p99, max.
DRIFT = (
    "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d), percentile_cont(0.99) WITHIN GROUP "
    "(ORDER BY d), max(d), min(d) FROM (SELECT extract(epoch FROM published_at - scheduled_for) * 1000 "
    "AS d FROM boundedbeat_runs WHERE published_at >= %s AND published_at < %s) AS w"
)


def drift(conn: psycopg.Connection[Any], a: Snap, b: Snap) -> dict[str, float]:
    """Drift of the runs published in the window: never negative (nothing early), small."""
    since, until = (datetime.fromtimestamp(s.t, UTC) for s in (a, b))
    row = conn.execute(DRIFT, [since, until]).fetchone()
    assert row is not None
    names = ("p50", "p99", "max", "min")
    return {k: float(v) if v is not None else float("nan") for k, v in zip(names, row, strict=True)}


def figures(a: Snap, b: Snap, cfg: Config, plan: Plan) -> dict[str, Any]:
    """CPU per 1,000 runs, rates and the load of the machine over one window."""
    elapsed = b.t - a.t
    beat_cpu = [y - x for x, y in zip(a.beats, b.beats, strict=True)]
    main_cpu = sum(y - x for x, y in zip(a.mains, b.mains, strict=True))
    pg_cpu = sum(v - a.pg.get(p, 0.0) for p, v in b.pg.items())
    runs = b.runs - a.runs
    cores = os.cpu_count() or 1
    machine_pct = (b.busy - a.busy) / max(b.total - a.total, 1e-9) * cores * 100
    ticks = [len(p.ticks(a.t, b.t)) for p in cfg.procs]
    tick_s = [t[1] for p in cfg.procs for t in p.ticks(a.t, b.t)]
    return {
        "beats": cfg.beats,
        "partitions": cfg.partitions,
        "seconds": elapsed,
        "runs": runs,
        "runs_per_s": runs / elapsed,
        "due_per_s": plan.schedules / plan.period,
        "published_per_s": (b.published - a.published) / elapsed,
        "beat_cpu_s": sum(beat_cpu),
        "beat_cpu_s_each": beat_cpu,
        "beat_cpu_s_per_1000": sum(beat_cpu) / runs * 1000 if runs else float("nan"),
        "beat_pct": sum(beat_cpu) / elapsed * 100,
        "main_thread_cpu_s_per_1000": main_cpu / runs * 1000 if runs else float("nan"),
        "postgres_cpu_s_per_1000": pg_cpu / runs * 1000 if runs else float("nan"),
        "postgres_pct": pg_cpu / elapsed * 100,
        "machine_pct": machine_pct,
        "other_pct": max(machine_pct - (sum(beat_cpu) + pg_cpu) / elapsed * 100, 0.0),
        "ticks_per_s_each": [n / elapsed for n in ticks],
        "commits_per_run": (b.commits - a.commits) / runs if runs else float("nan"),
        "tick_transaction_ms_mean": statistics.fmean(tick_s) * 1000 if tick_s else float("nan"),
        "loadavg": os.getloadavg(),
    }


def run_config(admin: psycopg.Connection[Any], cfg: Config, plan: Plan) -> dict[str, Any]:
    say(f"{cfg.beats} beat(s), P={cfg.partitions}: preparing {plan.schedules} schedules")
    try:
        prepare(admin, cfg, plan)
        cfg.procs = [
            Beat(f"b{cfg.beats}-{i}-{cfg.db[-4:]}", cfg.tmp, cfg.env, loglevel="WARNING").start()
            for i in range(cfg.beats)
        ]
        for p in cfg.procs:
            p.wait_ticking(120)
        shares = wait_shared(cfg) if cfg.partitions > 1 else live_beats(cfg)
        start = time.time() + plan.warmup
        sleep_until(start)
        with db_conn(cfg.db) as conn:
            a = snap(admin, conn, cfg)
            sleep_until(start + plan.seconds)
            b = snap(admin, conn, cfg)
            time.sleep(1.0)  # the window's last runs are published
            late = drift(conn, a, b)
        after = live_beats(cfg)
        out = figures(a, b, cfg, plan)
        out["drift_ms"] = late
        out["shares"] = {s["id"]: len(s["partitions"]) for s in shares}
        owners = [{s["id"]: s["partitions"] for s in found} for found in (shares, after)]
        out["membership_stable"] = owners[0] == owners[1]
        out["problems"] = [line for p in cfg.procs for line in p.problems()][:10]
        say(
            f"  {out['runs_per_s']:,.0f} runs/s, beats {out['beat_pct']:.0f} % core, "
            f"{out['beat_cpu_s_per_1000']:.3f} CPU s per 1,000 runs, machine {out['machine_pct']:.0f} %"
        )
        return out
    finally:
        for p in cfg.procs:
            p.stop()
        drop_db(admin, cfg.db)
        purge_redis(cfg.queue)


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: the mean of its rounds, its spread, and the ratio to one beat (same P)."""
    keys = sorted({(r["beats"], r["partitions"]) for r in results}, key=lambda k: (k[1] > 1, k[0]))
    rows = []
    for beats, parts in keys:
        mine = [r for r in results if (r["beats"], r["partitions"]) == (beats, parts)]
        per = [r["beat_cpu_s_per_1000"] for r in mine]
        rows.append(
            {
                "beats": beats,
                "partitions": parts,
                "rounds": per,
                "cpu_per_1000": statistics.fmean(per),
                "pg_per_1000": statistics.fmean(r["postgres_cpu_s_per_1000"] for r in mine),
                "main_per_1000": statistics.fmean(r["main_thread_cpu_s_per_1000"] for r in mine),
                "runs_per_s": statistics.fmean(r["runs_per_s"] for r in mine),
                "beat_pct": statistics.fmean(r["beat_pct"] for r in mine),
                "machine_pct": statistics.fmean(r["machine_pct"] for r in mine),
                "ticks_per_s": statistics.fmean(sum(r["ticks_per_s_each"]) for r in mine),
                "commits_per_run": statistics.fmean(r["commits_per_run"] for r in mine),
                "drift_p50": statistics.fmean(r["drift_ms"]["p50"] for r in mine),
                "drift_p99": statistics.fmean(r["drift_ms"]["p99"] for r in mine),
                "drift_min": min(r["drift_ms"]["min"] for r in mine),
            }
        )
    base = next((r["cpu_per_1000"] for r in rows if r["beats"] == 1 and r["partitions"] > 1), None)
    for r in rows:
        r["ratio"] = r["cpu_per_1000"] / base if base else float("nan")
    return rows


def print_summary(rows: list[dict[str, Any]], plan: Plan) -> None:
    print(
        f"\n{plan.schedules:,} schedules x {plan.period:g} s, {plan.seconds:g} s windows, "
        f"beat CPU = sum over the beats (user + sys); ratio to 1 beat at P={plan.partitions} "
        f"(target at 4 beats <= {TARGET_RATIO})"
    )
    head = (
        "| beats | P | beat CPU s / 1,000 runs (rounds) | ratio to 1 beat | runs/s "
        "| beats % core | of it main thread / others per 1,000 runs | PostgreSQL CPU s / 1,000 runs "
        "| ticks/s (all beats) | commits / run | drift p50 / p99 ms (min) | machine % busy |"
    )
    print(head)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        each = ", ".join(f"{v:.3f}" for v in r["rounds"])
        print(
            f"| {r['beats']} | {r['partitions']} | {r['cpu_per_1000']:.3f} ({each}) | {r['ratio']:.2f}x "
            f"| {r['runs_per_s']:,.0f} | {r['beat_pct']:.0f} % "
            f"| {r['main_per_1000']:.3f} / {r['cpu_per_1000'] - r['main_per_1000']:.3f} "
            f"| {r['pg_per_1000']:.3f} "
            f"| {r['ticks_per_s']:.1f} | {r['commits_per_run']:.2f} "
            f"| {r['drift_p50']:.0f} / {r['drift_p99']:.0f} ({r['drift_min']:.0f}) "
            f"| {r['machine_pct']:.0f} % |"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--period", type=float, default=1.0, help="seconds between runs of each schedule")
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0, help="each measured window")
    parser.add_argument("--warmup", type=float, default=10.0, help="after the beats share, before the window")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-reference", action="store_true", help="skip one beat with one partition")
    parser.add_argument("--json", default=None, help="where to write the results (default: a temp file)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    plan = Plan(
        schedules=args.schedules,
        period=args.period,
        partitions=args.partitions,
        seconds=args.seconds,
        warmup=args.warmup,
        rounds=args.rounds,
        reference=not args.no_reference,
    )
    tmp = Path(tempfile.mkdtemp(prefix="bb_part_"))
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    json_path = Path(args.json or Path(tempfile.gettempdir()) / f"boundedbeat-partitions-{stamp}.json")
    with admin_connection() as admin:
        m = machine(admin)
        print(
            f"machine: {m['cores']} cores ({m['cpu']}), {m['memory_gb']} GB, Python {m['python']}, "
            f"PostgreSQL {m['postgresql']}, Celery {m['celery']}; commit {m['commit']}; "
            f"load average {' '.join(f'{v:.2f}' for v in m['loadavg_at_start'])}",
            flush=True,
        )
        results: list[dict[str, Any]] = []
        out: dict[str, Any] = {"machine": m, "plan": plan.__dict__, "configs": results}
        try:
            for beats, parts in plan.order():
                results.append(run_config(admin, Config(beats=beats, partitions=parts, tmp=tmp), plan))
                json_path.write_text(json.dumps(out, indent=2, default=str))
        finally:
            if any(r["problems"] for r in results):
                print(f"beat logs kept in {tmp}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        out["summary"] = summary(results)
        out["machine"]["loadavg_at_end"] = os.getloadavg()
        json_path.write_text(json.dumps(out, indent=2, default=str))
    print_summary(out["summary"], plan)
    print("\nload average at end: " + " ".join(f"{v:.2f}" for v in out["machine"]["loadavg_at_end"]))
    for r in results:
        if r["problems"] or not r["membership_stable"]:
            stable = r["membership_stable"]
            print(f"  {r['beats']} beats P={r['partitions']}: membership stable {stable}; {r['problems']}")
    print(f"results: {json_path}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
