"""What recording a run's start before its body runs costs per run.

A worker records each run's start in ``task_prerun``, atomically and before the task's body
runs (``RunLife.begin_run``): that is what lets a second delivery of the same message find the
start and skip the body. The alternative it replaced wrote starts behind the task, many per
transaction (``write_reports``). This measures both on the local PostgreSQL, one thread, runs
of one schedule queued as a tick writes them:

* ``begin_run``: the time each call takes (what a task waits before its body), median and 99th
  percentile, and the runs per second of one thread doing nothing else;
* ``write_reports`` with batches of ``--batch`` starts: the time per run.

Usage: ``.venv/bin/python bench/start_bench.py [--runs 2000] [--batch 20]``. Needs PostgreSQL on
127.0.0.1:5432 (user ``postgres``); it creates and drops a database ``bb_bench_start_*``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
from sqlalchemy import create_engine, insert

from celery_boundedbeat.core.messages import message_options
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.db.migrate import upgrade
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow, RunRow
from celery_boundedbeat.worker.worklog import StartReport, write_reports

ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{db}"
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def fill(store: Store, n: int, offset: int) -> list[str]:
    """``n`` published runs of schedule ``s`` with their queue rows; their ids."""
    ids = [str(uuid.uuid4()) for _ in range(n)]
    at = [T0 + timedelta(seconds=offset + i) for i in range(n)]
    with store.engine.begin() as conn:
        conn.execute(
            insert(RunRow),
            [{"id": i, "schedule": "s", "task": "t", "state": "published", "scheduled_for": a,
              "enqueued_at": a, "published_at": a, "drift_ms": 0} for i, a in zip(ids, at, strict=True)],
        )  # fmt: skip
        conn.execute(
            insert(QueueRow),
            [{"run_id": i, "task_id": i, "task": "t", "args": [], "kwargs": {},
              "options": message_options({}, Policy(), i, "s"), "due_at": a, "enqueued_at": a,
              "attempts": 0} for i, a in zip(ids, at, strict=True)],
        )  # fmt: skip
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=20)
    args = parser.parse_args()
    db = f"bb_bench_start_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db}"')
    engine = create_engine(URL.format(db=db))
    try:
        upgrade(engine)
        store = Store(engine)
        store.run_life.heartbeat("bench:1", "bench", 1, datetime.now(UTC))
        # Warm the pool and the plans.
        for run_id in fill(store, 50, 0):
            store.run_life.begin_run(
                run_id, worker="w", process="bench:1", now=datetime.now(UTC), max_run_time=None
            )

        ids = fill(store, args.runs, 100)
        waits = []
        began = time.perf_counter()
        for run_id in ids:
            t = time.perf_counter()
            store.run_life.begin_run(
                run_id, worker="w", process="bench:1", now=datetime.now(UTC), max_run_time=None
            )
            waits.append(time.perf_counter() - t)
        sync_total = time.perf_counter() - began

        ids = fill(store, args.runs, 100 + args.runs)
        rng = random.Random(1)
        began = time.perf_counter()
        for k in range(0, len(ids), args.batch):
            now = datetime.now(UTC)
            starts = [
                StartReport(run_id=i, worker="w", process="bench:1", at=now, limit=None)
                for i in ids[k : k + args.batch]
            ]
            write_reports(store, starts, [], rng=rng)
        batched_total = time.perf_counter() - began
    finally:
        engine.dispose()
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE "{db}" WITH (FORCE)')

    waits.sort()
    p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
    print(f"begin_run (start recorded before the body), {args.runs} runs, one thread:")
    print(f"  wait per run: median {statistics.median(waits) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms")
    print(f"  {args.runs / sync_total:,.0f} runs/s ({sync_total / args.runs * 1e6:.0f} µs per run)")
    print(f"write_reports, batches of {args.batch} starts (write-behind):")
    print(f"  {args.runs / batched_total:,.0f} runs/s ({batched_total / args.runs * 1e6:.0f} µs per run)")


if __name__ == "__main__":
    main()
