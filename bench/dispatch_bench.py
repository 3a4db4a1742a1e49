"""Drain N queued runs to RabbitMQ and compare with a plain kombu publish loop.

Run: ``.venv/bin/python bench/dispatch_bench.py [--rows 100000]`` (needs the local
PostgreSQL and RabbitMQ). Both figures are measured in the same run, on the same broker,
with messages of the same shape; the ratio is dispatcher rows/s over plain-loop msgs/s.
"""

from __future__ import annotations

import argparse
import time
import uuid
from datetime import UTC, datetime

import psycopg
from celery import Celery
from kombu import Connection, Exchange, Producer, Queue
from sqlalchemy import insert

from celery_boundedbeat.dispatch import Dispatcher
from celery_boundedbeat.engine import get_engine
from celery_boundedbeat.migrate import upgrade
from celery_boundedbeat.policy import Policy
from celery_boundedbeat.schema import QueueRow, RunRow
from celery_boundedbeat.settings import Settings
from celery_boundedbeat.store import Store, message_options

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/{db}"
BROKER = "amqp://guest:guest@127.0.0.1:5672//"


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


def plain_kombu(app: Celery, rows: int, queue: str) -> float:
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
            producer.publish(
                msg.body,
                exchange=exchange,
                routing_key=queue,
                headers={**msg.headers, "boundedbeat_run": task_id},
                serializer="json",
                delivery_mode=2,
            )
        elapsed = time.perf_counter() - started
        q(conn.default_channel).purge()
    return rows / elapsed


def dispatcher(app: Celery, store: Store, rows: int, queue: str) -> float:
    settings = Settings(database_url=str(store.engine.url), dispatch_batch_size=1000)
    d = Dispatcher(app, store, settings)
    started = time.perf_counter()
    while store.queue_depth() > 0:
        result = d.drain()
        if result.failed:
            raise SystemExit("dispatcher failed; see log")
    elapsed = time.perf_counter() - started
    assert d.published_total == rows, (d.published_total, rows)
    with Connection(BROKER) as conn:
        Queue(queue, Exchange(queue, type="direct"), routing_key=queue)(conn.default_channel).purge()
    return rows / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    queue = f"bb_bench_{uuid.uuid4().hex[:8]}"
    app = Celery("bench", broker=BROKER, set_as_current=False)
    app.conf.task_default_queue = queue
    db = make_db()
    try:
        store = Store(get_engine(PG.format(db=db)))
        upgrade(store.engine)
        fill(store, args.rows, queue)
        # The baseline runs before and after, so a busy machine hurts both sides alike.
        before = plain_kombu(app, args.rows, queue)
        ours = dispatcher(app, store, args.rows, queue)
        after = plain_kombu(app, args.rows, queue)
    finally:
        drop_db(db)
    base = (before + after) / 2
    print(f"rows: {args.rows}")
    print(f"plain kombu publish loop: {base:,.0f} msgs/s (before {before:,.0f}, after {after:,.0f})")
    print(f"boundedbeat dispatcher:   {ours:,.0f} rows/s (claim + publish + mark published in PostgreSQL)")
    print(f"ratio: {ours / base:.2f} (target >= 0.70)")


if __name__ == "__main__":
    main()
