"""Partitioned beats past one beat's ceiling: latency-bound publishing, a herd, a rebalance.

Run: ``.venv/bin/python bench/partition_scaling_bench.py [latency] [herd] [rebalance]
[--delays 1,8] [--herd-schedules 100000] [--herd-beats 1,2] [--step 60] [--json PATH]``
(no scenario named: all three; needs the local PostgreSQL and Redis). bench/README.md says
what each figure means. Issue 36, item 5.

1. **latency**: every message waits ``--delays`` ms before it reaches the broker (a
   ``before_task_publish`` receiver in ``bench/scale_app.py`` that sleeps in the publishing
   thread), so a beat's dispatcher is capped by the wait, not by the cores. One beat is
   measured first with more due than it can publish (its cap is the baseline); then 2 and 4
   beats with 1.9x and 3.6x that cap due (the targets), and 4 beats with ``--headroom`` x (3.0)
   for the drift with room to spare: runs/s emitted and published, drift
   (``published_at - scheduled_for``), the backlog left, commits and WAL per run.
2. **herd**: ``--herd-schedules`` runtime schedules all due at the same second, 1, 2 (4)
   beats: time from that second until every run is published, drift p50/p99, 0 doubled, 0
   missed, messages in Redis = runs.
3. **rebalance**: a steady load; one beat added every ``--step`` s up to 4, then one stopped
   (SIGTERM) every ``--step`` s down to 1. Every grid time of every schedule in the window must
   have exactly one run; the largest drift around each join and leave is the handover gap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from partition_bench import Config, db_conn, live_beats, wait_shared
from scale_bench import (
    PG,
    REDIS,
    UNBOUNDED,
    Beat,
    admin_connection,
    bench_app,
    bulk_insert,
    drop_db,
    machine,
    machine_busy,
    purge_redis,
    runtime_rows,
    say,
    sleep_until,
    steady,
)

from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.migrate import upgrade

PARTITIONS = 16
#: Seconds per schedule row written by ``bulk_insert`` (herd: the due second is set before).
args_insert_s_per_row = 0.0006
#: Targets of issue 36, item 5.
TARGET_2, TARGET_4, TARGET_DRIFT_P99 = 1.9, 3.6, 0.200


@dataclass(kw_only=True)
class Run(Config):
    """A configuration with a publish delay (ms per message) for its beats."""

    delay_ms: float = 0.0

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "BENCH_PUBLISH_DELAY_MS": str(self.delay_ms)}

    def start(self, count: int, label: str) -> list[Beat]:
        new = [
            Beat(
                f"{label}-{len(self.procs) + i}-{self.db[-4:]}", self.tmp, self.env, loglevel="WARNING"
            ).start()
            for i in range(count)
        ]
        self.procs += new
        return new


@dataclass(kw_only=True)
class Meter:
    """Machine and PostgreSQL counters at one instant."""

    t: float
    busy: float
    total: float
    commits: int
    wal_bytes: int

    @classmethod
    def now(cls, admin: psycopg.Connection[Any], db: str) -> Meter:
        busy, total = machine_busy()
        commits = admin.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [db]
        ).fetchone()
        wal = admin.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        assert commits is not None and wal is not None
        return cls(t=time.time(), busy=busy, total=total, commits=int(commits[0]), wal_bytes=int(wal[0]))

    def since(self, a: Meter, runs: int) -> dict[str, float]:
        cores = os.cpu_count() or 1
        secs = max(self.t - a.t, 1e-9)
        return {
            "machine_pct": (self.busy - a.busy) / max(self.total - a.total, 1e-9) * cores * 100,
            "commits_per_s": (self.commits - a.commits) / secs,
            "commits_per_run": (self.commits - a.commits) / runs if runs else math.nan,
            "wal_bytes_per_run": (self.wal_bytes - a.wal_bytes) / runs if runs else math.nan,
            "wal_mb_per_s": (self.wal_bytes - a.wal_bytes) / secs / 1e6,
        }


def prepare(admin: psycopg.Connection[Any], run: Run, count: int, period: float, first_due: Any) -> None:
    """A migrated database holding ``count`` runtime schedules (rows as ``add_schedule`` writes)."""
    admin.execute(f'CREATE DATABASE "{run.db}"')
    url = PG.format(db=run.db)
    engine = get_engine(url)
    upgrade(engine)
    rows = runtime_rows(
        bench_app(url, run.queue), count, prefix="s-", period=period, policy=UNBOUNDED, first_due=first_due
    )
    bulk_insert(engine, rows)
    engine.dispose()
    steady(run.db)


def shift_grid(db: str, seconds: float) -> None:
    """Move every schedule's grid ``seconds`` earlier (while no beat runs)."""
    with db_conn(db) as conn:
        shift = timedelta(seconds=seconds)
        conn.execute(
            "UPDATE boundedbeat_schedules SET grid_at = grid_at - %s, next_due_at = next_due_at - %s",
            [shift, shift],
        )


def finish(admin: psycopg.Connection[Any], run: Run, out: dict[str, Any]) -> None:
    """Stop every beat; then count runs and messages (nothing moves any more), keep the beats'
    errors, drop the database and the queue."""
    for p in run.procs:
        p.stop()
    out["problems"] = [f"{p.label}: {line}" for p in run.procs for line in p.problems()][:10]
    try:
        with db_conn(run.db) as conn:
            end = totals(conn)
        queued = messages(run.queue)
        # Every published run has its one message in Redis (no worker takes any): 0 = none twice.
        out.update(
            final_runs=end["runs"],
            final_doubled=end["runs"] - end["keys"],
            final_published=end["published"],
            redis_messages=queued,
            message_mismatch=queued - end["published"],
        )
    finally:
        drop_db(admin, run.db)
        purge_redis(run.queue)


def messages(queue: str) -> int:
    """Task messages waiting in Redis for ``queue`` (no worker runs: every one published stays)."""
    import redis

    client = redis.Redis.from_url(REDIS)
    try:
        return sum(
            int(client.llen(k)) for k in client.scan_iter(match=f"{queue}*") if client.type(k) == b"list"
        )
    finally:
        client.close()


def pct(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def totals(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Runs, distinct run keys and grid times, and published runs: doubled = runs - keys."""
    row = conn.execute(
        "SELECT count(*), count(DISTINCT (schedule, scheduled_for, attempt)),"
        " count(DISTINCT (schedule, scheduled_for)), count(published_at),"
        " (SELECT coalesce(sum(skips), 0) FROM boundedbeat_schedules) FROM boundedbeat_runs"
    ).fetchone()
    assert row is not None
    return {"runs": row[0], "keys": row[1], "grid_times": row[2], "published": row[3], "skips": int(row[4])}


def drifts(conn: psycopg.Connection[Any], a: float, b: float) -> tuple[list[float], int]:
    """``published_at - scheduled_for`` (s) of the runs due in ``[a, b)``, and how many are unpublished."""
    rows = conn.execute(
        "SELECT extract(epoch FROM published_at - scheduled_for) FROM boundedbeat_runs"
        " WHERE scheduled_for >= %s AND scheduled_for < %s",
        [datetime.fromtimestamp(a, UTC), datetime.fromtimestamp(b, UTC)],
    ).fetchall()
    done = [float(r[0]) for r in rows if r[0] is not None]
    return done, len(rows) - len(done)


def counted(conn: psycopg.Connection[Any], column: str, a: float, b: float) -> int:
    sql = f"SELECT count(*) FROM boundedbeat_runs WHERE {column} >= %s AND {column} < %s"
    row = conn.execute(sql, [datetime.fromtimestamp(a, UTC), datetime.fromtimestamp(b, UTC)]).fetchone()
    assert row is not None
    return int(row[0])


# -- 1. latency-bound publishing ------------------------------------------------------------------


def latency_config(
    admin: psycopg.Connection[Any], tmp: Path, beats: int, delay_ms: float, due_per_s: int, seconds: float
) -> dict[str, Any]:
    run = Run(beats=beats, partitions=PARTITIONS, tmp=tmp, delay_ms=delay_ms)
    say(f"latency {delay_ms:g} ms: {beats} beat(s), {due_per_s:,} runs/s due")
    base = time.time() + 3600  # first runs far away until the beats share; then made due
    out: dict[str, Any] = {"beats": beats, "delay_ms": delay_ms, "due_per_s": due_per_s}
    try:
        prepare(admin, run, due_per_s, 1.0, lambda i: datetime.fromtimestamp(base + i / due_per_s, UTC))
        # Every schedule's grid from ``first`` on, spread over each second (before any beat runs).
        first = math.ceil(time.time() + 30 + 10 * beats)
        shift_grid(run.db, base - first)
        run.start(beats, f"lat{delay_ms:g}")
        for p in run.procs:
            p.wait_ticking(120)
        wait_shared(run)
        a_t = max(time.time(), first) + 10.0  # warm-up: the start is behind
        sleep_until(a_t)
        a = Meter.now(admin, run.db)
        with db_conn(run.db) as conn:
            t0 = totals(conn)
            sleep_until(a_t + seconds)
            b = Meter.now(admin, run.db)
            t1 = totals(conn)
            emitted = counted(conn, "enqueued_at", a.t, b.t)
            published = counted(conn, "published_at", a.t, b.t)
            sleep_until(b.t + 3.0)  # what came due in the window had 3 s more to be published
            dr, unpublished = drifts(conn, a.t, b.t)
            backlog = conn.execute(
                "SELECT count(*) FROM boundedbeat_runs WHERE published_at IS NULL"
            ).fetchone()
            end = totals(conn)
        out.update(
            seconds=b.t - a.t,
            emitted_per_s=emitted / (b.t - a.t),
            published_per_s=published / (b.t - a.t),
            drift_p50=pct(dr, 50),
            drift_p99=pct(dr, 99),
            drift_max=max(dr, default=math.nan),
            unpublished_3s_after=unpublished,
            backlog_end=int(backlog[0]) if backlog else -1,
            doubled=end["runs"] - end["keys"],
            published_total=end["published"],
            skips=end["skips"],
            **b.since(a, t1["runs"] - t0["runs"]),
        )
        out["shares"] = {s["id"]: len(s["partitions"]) for s in live_beats(run)}
    finally:
        finish(admin, run, out)
    say(
        f"  published {g(out, 'published_per_s')}/s (emitted {g(out, 'emitted_per_s')}/s), "
        f"drift p99 {g(out, 'drift_p99', scale=1000)} ms, machine {g(out, 'machine_pct')} %"
    )
    return out


def scenario_latency(
    admin: psycopg.Connection[Any], tmp: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    out = []
    for delay in args.delays:
        guess = 1000.0 / (delay + 0.4)  # a beat's cap if its own work costs ~0.4 ms per message
        one = latency_config(admin, tmp, 1, delay, int(guess * 1.5), args.seconds)
        cap = one["published_per_s"]
        rows = [one]
        for beats, target in ((2, TARGET_2), (4, TARGET_4)):
            due = math.ceil(cap * target * 1.02)
            r = latency_config(admin, tmp, beats, delay, due, args.seconds)
            r["ratio"] = r["published_per_s"] / cap
            r["target"] = target
            rows.append(r)
        if args.headroom:
            # The drift with room to spare: 4 beats given less than they can publish.
            r = latency_config(admin, tmp, 4, delay, math.ceil(cap * args.headroom), args.seconds)
            r["ratio"] = r["published_per_s"] / cap
            r["headroom"] = args.headroom
            rows.append(r)
        one["ratio"] = 1.0
        out += rows
    return out


# -- 2. a herd --------------------------------------------------------------------------------


def herd_config(admin: psycopg.Connection[Any], tmp: Path, beats: int, count: int) -> dict[str, Any]:
    run = Run(beats=beats, partitions=PARTITIONS, tmp=tmp)
    say(f"herd: {count:,} schedules due at one second, {beats} beat(s)")
    out: dict[str, Any] = {"beats": beats, "schedules": count}
    # Due once the rows are written and the beats share (checked: ``shared_before_due_s``).
    due = math.ceil(time.time() + 45 + count * args_insert_s_per_row + 10 * beats)
    try:
        t = time.time()
        prepare(admin, run, count, 3600.0, lambda i: datetime.fromtimestamp(due, UTC))
        out["insert_s"] = time.time() - t
        run.start(beats, "herd")
        for p in run.procs:
            p.wait_ticking(180)
        wait_shared(run)
        out["shared_before_due_s"] = due - time.time()
        with db_conn(run.db) as conn:
            sleep_until(due - 1)
            a = Meter.now(admin, run.db)
            deadline = due + 900
            while time.time() < deadline:
                if totals(conn)["published"] >= count:
                    break
                time.sleep(0.5)
            b = Meter.now(admin, run.db)
            end = totals(conn)
            row = conn.execute(
                "SELECT extract(epoch FROM max(enqueued_at)), extract(epoch FROM max(published_at)),"
                " extract(epoch FROM min(scheduled_for)), extract(epoch FROM max(scheduled_for))"
                " FROM boundedbeat_runs"
            ).fetchone()
            assert row is not None
            dr, unpublished = drifts(conn, due - 1, due + 1)
        out.update(
            due=due,
            all_emitted_s=float(row[0]) - due if row[0] is not None else math.nan,
            all_published_s=float(row[1]) - due if row[1] is not None else math.nan,
            scheduled_for_range=[float(row[2] or 0) - due, float(row[3] or 0) - due],
            drift_p50=pct(dr, 50),
            drift_p99=pct(dr, 99),
            runs=end["runs"],
            doubled=end["runs"] - end["keys"],
            missed=count - end["grid_times"],
            unpublished=unpublished,
            published=end["published"],
            skips=end["skips"],
            **b.since(a, end["runs"]),
        )
        out["rate_per_s"] = count / out["all_published_s"] if out["all_published_s"] > 0 else math.nan
    finally:
        finish(admin, run, out)
    say(
        f"  all published {g(out, 'all_published_s', '.1f')} s after the due second, "
        f"drift p99 {g(out, 'drift_p99', '.1f')} s, doubled {out.get('doubled')}, missed {out.get('missed')}"
    )
    return out


# -- 3. rebalance ------------------------------------------------------------------------------


def scenario_rebalance(admin: psycopg.Connection[Any], tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    count, step = args.rebalance_schedules, args.step
    run = Run(beats=1, partitions=PARTITIONS, tmp=tmp)
    say(f"rebalance: {count} schedules of 1 s, a beat added every {step:g} s up to 4, then one stopped")
    anchor = math.ceil(time.time() + 3600)
    out: dict[str, Any] = {"schedules": count, "step_s": step}
    try:
        prepare(admin, run, count, 1.0, lambda i: datetime.fromtimestamp(anchor + i / count, UTC))
        start = math.ceil(time.time() + 15)
        shift_grid(run.db, anchor - start)
        run.start(1, "reb")
        run.procs[0].wait_ticking(120)
        w0 = math.ceil(max(time.time(), start) + 10)
        events: list[dict[str, Any]] = []
        a = Meter.now(admin, run.db)
        for k in range(1, 7):
            sleep_until(w0 + k * step)
            if k <= 3:
                run.start(1, "reb")
                events.append({"t": time.time(), "event": f"join -> {k + 1} beats"})
            else:
                victim = next(p for p in run.procs if p.alive())
                took = victim.stop()
                events.append({"t": time.time() - took, "event": f"SIGTERM -> {7 - k} beats", "exit_s": took})
            say(f"  {events[-1]['event']}")
        w1 = w0 + 7 * step
        sleep_until(w1)
        b = Meter.now(admin, run.db)
        sleep_until(w1 + 5)
        with db_conn(run.db) as conn:
            keys = conn.execute(
                "SELECT schedule, extract(epoch FROM scheduled_for), attempt,"
                " extract(epoch FROM enqueued_at - scheduled_for),"
                " extract(epoch FROM published_at - scheduled_for)"
                " FROM boundedbeat_runs WHERE scheduled_for >= %s AND scheduled_for < %s",
                [datetime.fromtimestamp(w0, UTC), datetime.fromtimestamp(w1, UTC)],
            ).fetchall()
            end = totals(conn)
            grid = dict(
                conn.execute("SELECT name, extract(epoch FROM grid_at) FROM boundedbeat_schedules").fetchall()
            )
        out.update(grid_check(keys, grid, count, w0, w1, start, anchor))
        out["events"] = [dict(e, **gap(keys, e["t"])) for e in events]
        out.update(
            window_s=w1 - w0,
            skips=end["skips"],
            doubled_total=end["runs"] - end["keys"],
            published=end["published"],
            **b.since(a, len(keys)),
        )
    finally:
        finish(admin, run, out)
    say(f"  missed {out.get('missed')}, doubled {out.get('doubled')}, skips {out.get('skips')}")
    return out


def grid_check(
    keys: list[Any], grid: dict[str, Any], count: int, w0: float, w1: float, start: float, anchor: float
) -> dict[str, Any]:
    """Every grid time of every schedule in ``[w0, w1)`` has exactly one run (period 1 s).

    Schedule ``s-i``'s grid is ``start + i / count + k`` (its first due time, shifted).
    """
    seen: dict[tuple[str, int], int] = {}
    for name, at, _attempt, _enq, _pub in keys:
        key = (name, round(float(at) * 1000))
        seen[key] = seen.get(key, 0) + 1
    expected = 0
    missed = 0
    missed_at: list[float] = []
    for i in range(count):
        name = f"s-{i:06d}"
        first = start + i / count
        k = math.ceil(w0 - first - 1e-9)
        while first + k < w1:
            expected += 1
            if (name, round((first + k) * 1000)) not in seen:
                missed += 1
                missed_at.append(first + k)
            k += 1
    off_grid = sum(
        1 for (name, ms) in seen if round((ms / 1000 - start - int(name[2:]) / count) * 1000) % 1000
    )
    return {
        "expected_grid_times": expected,
        "runs_in_window": len(keys),
        "missed": missed,
        "missed_first": sorted(missed_at)[:5],
        "doubled": sum(n - 1 for n in seen.values()),
        "off_grid": off_grid,
        "schedules_seen": len(grid),
    }


def gap(keys: list[Any], t: float) -> dict[str, float]:
    """The largest delay of a run due within 10 s after a join or leave (and in the 10 s before)."""
    after = [
        (float(k[3]), float(k[4]) if k[4] is not None else math.inf)
        for k in keys
        if t <= float(k[1]) < t + 10
    ]
    before = [float(k[4]) for k in keys if t - 10 <= float(k[1]) < t and k[4] is not None]
    return {
        "max_enqueue_delay_after_s": max((e for e, _ in after), default=math.nan),
        "max_publish_delay_after_s": max((p for _, p in after), default=math.nan),
        "publish_delay_p99_before_s": pct(before, 99),
    }


# -- the run -----------------------------------------------------------------------------------


def g(r: dict[str, Any], key: str, spec: str = ",.0f", scale: float = 1.0) -> str:
    """One figure of a result, ``nan`` when the configuration stopped before it."""
    value = r.get(key)
    return "nan" if value is None else format(float(value) * scale, spec)


def print_results(out: dict[str, Any]) -> None:
    if "latency" in out:
        print("\n1. Latency-bound publishing (every message waits the delay in the publishing thread)")
        print(
            "| delay ms | beats | due/s | emitted/s | published/s | ratio to 1 beat (target) "
            "| drift p50 / p99 / max ms | unpublished 3 s after | doubled | Redis msgs - published "
            "| commits/run | WAL B/run | machine % |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in out["latency"]:
            target = f" (>= {r['target']})" if "target" in r else " (baseline)" if r["beats"] == 1 else ""
            drift = " / ".join(g(r, k, scale=1000) for k in ("drift_p50", "drift_p99", "drift_max"))
            print(
                f"| {r['delay_ms']:g} | {r['beats']} | {r['due_per_s']:,} | {g(r, 'emitted_per_s')} "
                f"| {g(r, 'published_per_s')} | {g(r, 'ratio', '.2f')}x{target} | {drift} "
                f"| {r.get('unpublished_3s_after')} | {r.get('doubled')} | {r.get('message_mismatch')} "
                f"| {g(r, 'commits_per_run', '.3f')} | {g(r, 'wal_bytes_per_run')} | {g(r, 'machine_pct')} |"
            )
    if "herd" in out:
        print("\n2. Herd: every schedule due at the same second")
        print(
            "| beats | schedules | all emitted s | all published s | runs/s | drift p50 / p99 s | doubled "
            "| missed | Redis msgs - published | commits/run | WAL B/run | machine % |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in out["herd"]:
            print(
                f"| {r['beats']} | {r['schedules']:,} | {g(r, 'all_emitted_s', '.1f')} "
                f"| {g(r, 'all_published_s', '.1f')} | {g(r, 'rate_per_s')} "
                f"| {g(r, 'drift_p50', '.1f')} / {g(r, 'drift_p99', '.1f')} | {r.get('doubled')} "
                f"| {r.get('missed')} | {r.get('message_mismatch')} | {g(r, 'commits_per_run', '.4f')} "
                f"| {g(r, 'wal_bytes_per_run')} | {g(r, 'machine_pct')} |"
            )
    if "rebalance" in out:
        r = out["rebalance"]
        print("\n3. Rebalance: 1 -> 4 beats, one added per step, then one stopped (SIGTERM) per step")
        print(
            f"grid times expected {r.get('expected_grid_times')}, runs {r.get('runs_in_window')}, "
            f"missed {r.get('missed')}, doubled {r.get('doubled')} (whole table {r.get('doubled_total')}), "
            f"off grid {r.get('off_grid')}, skips {r.get('skips')}, Redis messages {r.get('redis_messages')} "
            f"for {r.get('final_published')} published, machine {g(r, 'machine_pct')} %"
        )
        print(
            "| event | beat exit s | max enqueue delay, 10 s after | max publish delay, 10 s after "
            "| publish delay p99, 10 s before |"
        )
        print("|---|---|---|---|---|")
        for e in r.get("events", []):
            print(
                f"| {e['event']} | {g(e, 'exit_s', '.2f')} "
                f"| {g(e, 'max_enqueue_delay_after_s', scale=1000)} ms "
                f"| {g(e, 'max_publish_delay_after_s', scale=1000)} ms "
                f"| {g(e, 'publish_delay_p99_before_s', scale=1000)} ms |"
            )
    problems = [p for r in out.get("latency", []) + out.get("herd", []) for p in r.get("problems", [])]
    problems += out.get("rebalance", {}).get("problems", [])
    if problems:
        print("\nbeat errors:\n" + "\n".join(problems))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", help="latency, herd, rebalance (default: all three)")
    parser.add_argument("--delays", type=lambda s: [float(v) for v in s.split(",")], default=[1.0, 8.0])
    parser.add_argument("--seconds", type=float, default=30.0, help="each latency window")
    parser.add_argument(
        "--headroom", type=float, default=3.0, help="also 4 beats given this x one beat's rate (0: not)"
    )
    parser.add_argument("--herd-schedules", type=int, default=100_000)
    parser.add_argument("--herd-beats", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2])
    parser.add_argument("--rebalance-schedules", type=int, default=200)
    parser.add_argument("--step", type=float, default=60.0, help="seconds between joins and leaves")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    scenarios = args.scenarios or ["latency", "herd", "rebalance"]
    if unknown := set(scenarios) - {"latency", "herd", "rebalance"}:
        raise SystemExit(f"unknown scenarios: {sorted(unknown)}")
    tmp = Path(tempfile.mkdtemp(prefix="bb_pscale_"))
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    json_path = Path(args.json or Path(tempfile.gettempdir()) / f"boundedbeat-partition-scaling-{stamp}.json")
    with admin_connection() as admin:
        m = machine(admin)
        print(
            f"machine: {m['cores']} cores ({m['cpu']}), Python {m['python']}, PostgreSQL {m['postgresql']}, "
            f"commit {m['commit']}; load average {' '.join(f'{v:.2f}' for v in m['loadavg_at_start'])}",
            flush=True,
        )
        out: dict[str, Any] = {"machine": m, "args": vars(args)}
        try:
            if "latency" in scenarios:
                out["latency"] = scenario_latency(admin, tmp, args)
                json_path.write_text(json.dumps(out, indent=2, default=str))
            if "herd" in scenarios:
                out["herd"] = [herd_config(admin, tmp, b, args.herd_schedules) for b in args.herd_beats]
                json_path.write_text(json.dumps(out, indent=2, default=str))
            if "rebalance" in scenarios:
                out["rebalance"] = scenario_rebalance(admin, tmp, args)
        finally:
            out["machine"]["loadavg_at_end"] = os.getloadavg()
            json_path.write_text(json.dumps(out, indent=2, default=str))
            print(f"beat logs in {tmp} (removed at the end if no beat logged an error)")
    print_results(out)
    print(f"\nload average at end: {' '.join(f'{v:.2f}' for v in out['machine']['loadavg_at_end'])}")
    print(f"results: {json_path}")
    sys.stdout.flush()
    everything = [*out.get("latency", []), *out.get("herd", []), out.get("rebalance", {})]
    if not any(r.get("problems") for r in everything):
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
