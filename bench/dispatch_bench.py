"""Drain N queued runs to RabbitMQ and compare with a plain kombu publish loop.

Run: ``.venv/bin/python bench/dispatch_bench.py [--rows 100000] [--rounds 3]`` (needs the
local PostgreSQL and RabbitMQ). Both figures are measured in the same run, on the same broker,
with the same messages (checked); the ratio is dispatcher rows/s over plain-loop msgs/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import uuid
from datetime import UTC, datetime
from typing import Any, cast

import psycopg
from celery import Celery
from kombu import Connection, Exchange, Producer, Queue
from sqlalchemy import func, insert, select

from celery_boundedbeat.config.settings import Settings
from celery_boundedbeat.core.messages import message_options
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.migrate import upgrade
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow, RunRow
from celery_boundedbeat.dispatch.dispatcher import Dispatcher

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/{db}"
BROKER = "amqp://guest:guest@127.0.0.1:5672//"


class CpuMeter:
    """CPU seconds spent by this process, PostgreSQL and RabbitMQ over a measured phase.

    Linux only (reads /proc). It shows where a phase's CPU goes on a machine whose cores the
    broker, the database and the benchmark share.
    """

    SERVERS = {"postgres": "PostgreSQL", "beam.smp": "RabbitMQ"}

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, float]] = {}
        self._start: dict[tuple[str, str], float] = {}

    def _now(self) -> dict[tuple[str, str], float]:
        """CPU seconds per (name, pid); a server process started mid-phase counts in full."""
        tick = os.sysconf("SC_CLK_TCK")
        used = {("this process", "self"): time.process_time()}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    comm, _, rest = f.read().partition(" (")[2].rpartition(") ")
            except OSError:
                continue
            name = self.SERVERS.get(comm)
            if name is not None:
                fields = rest.split()
                used[(name, pid)] = (int(fields[11]) + int(fields[12])) / tick
        return used

    def start(self) -> None:
        self._start = self._now()

    def stop(self, phase: str, rows: int) -> None:
        mine = self.totals.setdefault(phase, {})
        for (name, pid), seconds in self._now().items():
            spent = seconds - self._start.get((name, pid), 0.0)
            mine[name] = mine.get(name, 0.0) + spent / rows * 1e6

    def report(self, rounds: int) -> str:
        lines = []
        for phase, used in self.totals.items():
            parts = ", ".join(f"{k} {v / rounds:.0f}" for k, v in used.items())
            lines.append(f"  {phase}: {parts} (total {sum(used.values()) / rounds:.0f})")
        totals = [sum(used.values()) for used in self.totals.values()]
        if len(totals) == 2 and totals[1]:
            # Less noisy than the rates on a shared machine: where the CPU is the limit (both
            # cores busy), throughput follows CPU cost, so this is the ratio to expect there.
            lines.append(f"  CPU cost ratio (plain loop / dispatcher): {totals[0] / totals[1]:.2f}")
        return "CPU µs per message, mean over rounds:\n" + "\n".join(lines)


def make_db() -> str:
    name = f"bb_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def drop_db(name: str) -> None:
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def fill(store: Store, rows: int, queue: str) -> None:
    now = datetime.now(UTC)
    policy = Policy()
    batch_runs, batch_queue = [], []
    with store.engine.begin() as conn:
        for i in range(rows):
            run_id = str(uuid.uuid4())
            batch_runs.append(
                {
                    "id": run_id,
                    "schedule": "bench",
                    "task": "bench.noop",
                    "state": "queued",
                    "scheduled_for": datetime.fromtimestamp(now.timestamp() + i / 1000, UTC),
                    "enqueued_at": now,
                    "drift_ms": 0,
                }
            )
            batch_queue.append(
                {
                    "run_id": run_id,
                    "task_id": run_id,
                    "task": "bench.noop",
                    "args": [i],
                    "kwargs": {},
                    "options": message_options({"queue": queue}, policy, run_id, "bench"),
                    "due_at": now,
                    "enqueued_at": now,
                    "attempts": 0,
                }
            )
            if len(batch_runs) == 5000:
                conn.execute(insert(RunRow), batch_runs)
                conn.execute(insert(QueueRow), batch_queue)
                batch_runs, batch_queue = [], []
        if batch_runs:
            conn.execute(insert(RunRow), batch_runs)
            conn.execute(insert(QueueRow), batch_queue)


def steady(db: str) -> None:
    """Vacuum and checkpoint after the fill, so its aftermath is not charged to the drain."""
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{db}", autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE boundedbeat_queue")
        conn.execute("VACUUM ANALYZE boundedbeat_runs")
        conn.execute("CHECKPOINT")


def take_sample(conn: Connection, queue: str) -> tuple[list[str], list[str], Any]:
    """Header and property names and the body of one published message (ids vary)."""
    message = conn.default_channel.basic_get(queue)
    assert message is not None, f"nothing was published to {queue}"
    headers = dict(message.headers)
    properties = dict(message.properties)
    properties.pop("application_headers", None)
    return sorted(headers), sorted(properties), json.loads(message.body)


def plain_kombu(app: Celery, rows: int, queue: str, samples: list[Any]) -> float:
    """The baseline: Celery-shaped messages built and published by a bare kombu loop."""
    exchange = Exchange(queue, type="direct")
    q = Queue(queue, exchange, routing_key=queue)
    with Connection(BROKER) as conn:
        q(conn.default_channel).declare()
        producer = Producer(conn.default_channel)
        started = time.perf_counter()
        for i in range(rows):
            task_id = str(uuid.uuid4())
            msg = app.amqp.as_task_v2(task_id, "bench.noop", args=[i], kwargs={})
            # The same message the dispatcher sends: Celery's headers plus ours, and the
            # correlation id and reply-to that ``send_task`` sets.
            producer.publish(
                msg.body,
                exchange=exchange,
                routing_key=queue,
                headers={**msg.headers, "boundedbeat_run": task_id, "boundedbeat_schedule": "bench"},
                serializer="json",
                delivery_mode=2,
                correlation_id=task_id,
                reply_to=app.thread_oid,
            )
        elapsed = time.perf_counter() - started
        samples.append(take_sample(conn, queue))
        q(conn.default_channel).purge()
    return rows / elapsed


def queue_depth(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(QueueRow)) or 0)


def dispatcher(
    app: Celery, store: Store, settings: Settings, rows: int, queue: str, samples: list[Any]
) -> float:
    d = Dispatcher(app, store, settings)
    started = time.perf_counter()
    while queue_depth(store) > 0:
        result = d.drain()
        if result.failed:
            raise SystemExit("dispatcher failed; see log")
    elapsed = time.perf_counter() - started
    assert d.published_total == rows, (d.published_total, rows)
    with Connection(BROKER) as conn:
        samples.append(take_sample(conn, queue))
        Queue(queue, Exchange(queue, type="direct"), routing_key=queue)(conn.default_channel).purge()
    return rows / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the product default")
    parser.add_argument(
        "--confirm-publish",
        action="store_true",
        help="dispatcher with Celery's confirm_publish (batch confirms); the plain loop stays unconfirmed",
    )
    args = parser.parse_args()
    queue = f"bb_bench_{uuid.uuid4().hex[:8]}"
    app = Celery("bench", broker=BROKER, set_as_current=False)
    app.conf.task_default_queue = queue
    if args.confirm_publish:
        app.conf.broker_transport_options = {"confirm_publish": True}
    default_batch = next(f.default for f in dataclasses.fields(Settings) if f.name == "dispatch_batch_size")
    batch_size = args.batch_size or int(cast(int, default_batch))
    confirms = ", dispatcher with publisher confirms" if args.confirm_publish else ""
    print(f"rows: {args.rows} per round, {args.rounds} rounds, dispatch batch size {batch_size}{confirms}")
    ratios = []
    cpu = CpuMeter()
    for n in range(1, args.rounds + 1):
        db = make_db()
        samples: list[Any] = []
        try:
            store = Store(get_engine(PG.format(db=db)))
            upgrade(store.engine)
            fill(store, args.rows, queue)
            steady(db)
            settings = Settings(database_url=str(store.engine.url), dispatch_batch_size=batch_size)
            # The baseline runs before and after, so a busy machine hurts both sides alike.
            cpu.start()
            before = plain_kombu(app, args.rows, queue, samples)
            cpu.stop("plain kombu loop", args.rows)
            cpu.start()
            ours = dispatcher(app, store, settings, args.rows, queue, samples)
            cpu.stop("dispatcher", args.rows)
            after = plain_kombu(app, args.rows, queue, samples)
            store.engine.dispose()
        finally:
            drop_db(db)
        plain, mine, _ = samples
        assert plain[:2] == mine[:2], f"the two loops sent different messages:\n{plain}\n{mine}"
        base = (before + after) / 2
        ratios.append(ours / base)
        print(
            f"round {n}: plain kombu publish loop {base:,.0f} msgs/s "
            f"(before {before:,.0f}, after {after:,.0f}); "
            f"boundedbeat dispatcher {ours:,.0f} rows/s; ratio {ours / base:.2f}"
        )
    print(
        f"ratio: median {statistics.median(ratios):.2f}, "
        f"range {min(ratios):.2f}-{max(ratios):.2f} (target >= 0.85, issue 14)"
    )
    print(cpu.report(args.rounds))


if __name__ == "__main__":
    main()
