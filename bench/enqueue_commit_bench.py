"""Application commits per second when every transaction enqueues: NOTIFY in the transaction or after it.

A ``NOTIFY`` in a transaction makes its commit take a lock that serialises every notifying
commit of the cluster until the commit is flushed: commits that could share one WAL flush
each wait for their own. ``enqueue()`` sends no ``NOTIFY`` in the caller's transaction; a
per-process waker sends one after the commits, at most one per window. This runs
``--clients`` processes, each committing transactions of one application row and one
``enqueue()`` as fast as it can for ``--seconds``, in alternating rounds:

* ``inline``: the old way, the same insert plus ``SELECT pg_notify('boundedbeat_queue', '')``
  in the transaction (what ``enqueue()`` did before);
* ``after commit``: ``enqueue()`` as it is, on a SQLAlchemy ``Connection`` (``engine.begin()``);
* ``session``: ``enqueue()`` on a SQLAlchemy ``Session``.

A connection LISTENs on the channel throughout, as a dispatcher does, and counts what it
hears. Prints each round's commits per second, the medians and their ratio.

Usage: ``.venv/bin/python bench/enqueue_commit_bench.py [--clients 8] [--seconds 10] [--rounds 3]
[--flush-delay-us N]`` (``commit_delay`` of the clients' sessions: a slower WAL flush).
Needs PostgreSQL on 127.0.0.1:5432 (user ``postgres``); it creates and drops a database
``bb_bench_enqueue_*``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time
import uuid
from typing import Any

import psycopg
from sqlalchemy import create_engine, event, insert, text
from sqlalchemy.orm import Session

import celery_boundedbeat
from celery_boundedbeat.db.store import QUEUE_CHANNEL, utcnow
from celery_boundedbeat.db.tables import QueueRow

ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{db}"
PLAIN = "host=127.0.0.1 port=5432 user=postgres dbname={db}"
MODES = ("inline", "after commit", "session")


def _inline(conn: Any, i: int) -> None:
    """What ``enqueue()`` did before: the row and its notification in the caller's transaction."""
    now = utcnow()
    conn.execute(
        insert(QueueRow).values(
            task_id=str(uuid.uuid4()), task="app.receipt", args=[i], kwargs={}, options={},
            due_at=now, enqueued_at=now, attempts=0,
        )
    )  # fmt: skip
    conn.execute(text("SELECT pg_notify(:c, '')"), {"c": QUEUE_CHANNEL})


def client(db: str, mode: str, start_at: float, seconds: float, flush_delay: int, out: Any) -> None:
    """One application process: transactions of an order row and one enqueue, until time is up."""
    engine = create_engine(URL.format(db=db), pool_size=1)
    if flush_delay:

        @event.listens_for(engine, "connect")
        def slow_flush(dbapi_conn: Any, _record: Any) -> None:
            # a WAL flush that takes longer, as on network storage or with a synchronous standby
            was = dbapi_conn.autocommit
            dbapi_conn.autocommit = True
            dbapi_conn.execute(f"SET commit_delay = {flush_delay}; SET commit_siblings = 0")
            dbapi_conn.autocommit = was

    with engine.connect() as warm:
        warm.execute(text("SELECT 1"))
    time.sleep(max(0.0, start_at - time.time()))
    commits, i = 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i += 1
        if mode == "session":
            with Session(engine) as s, s.begin():
                s.execute(text("INSERT INTO orders (n) VALUES (:n)"), {"n": i})
                celery_boundedbeat.enqueue(s, "app.receipt", args=(i,))
            commits += 1
            continue
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO orders (n) VALUES (:n)"), {"n": i})
            if mode == "inline":
                _inline(conn, i)
            else:
                celery_boundedbeat.enqueue(conn, "app.receipt", args=(i,))
        commits += 1
    time.sleep(0.2)  # the waker's last window
    engine.dispose()
    out.put(commits)


def listen(db: str, stop: threading.Event, heard: list[int]) -> None:
    """A dispatcher's LISTEN: counts the notifications (and keeps the queue read)."""
    with psycopg.connect(PLAIN.format(db=db), autocommit=True) as conn:
        conn.execute(f'LISTEN "{QUEUE_CHANNEL}"')
        while not stop.is_set():
            for _ in conn.notifies(timeout=0.2):
                heard[0] += 1


def one_round(db: str, mode: str, clients: int, seconds: float, flush_delay: int) -> tuple[float, int]:
    """Commits per second of ``clients`` processes in ``mode``, and the notifications heard."""
    with psycopg.connect(PLAIN.format(db=db), autocommit=True) as conn:
        conn.execute("TRUNCATE orders, boundedbeat_queue")
        conn.execute("CHECKPOINT")
    stop, heard = threading.Event(), [0]
    listener = threading.Thread(target=listen, args=(db, stop, heard))
    listener.start()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 1.0
    args = (db, mode, start_at, seconds, flush_delay, out)
    procs = [ctx.Process(target=client, args=args) for _ in range(clients)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    time.sleep(0.5)
    stop.set()
    listener.join()
    return total / seconds, heard[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--flush-delay-us",
        type=int,
        default=0,
        help="commit_delay of the clients' sessions: each commit's WAL flush takes this much longer",
    )
    args = parser.parse_args()
    db = f"bb_bench_enqueue_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db}"')
    try:
        from celery_boundedbeat.db.migrate import upgrade

        engine = create_engine(URL.format(db=db))
        upgrade(engine)
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE orders (id bigserial PRIMARY KEY, n int)"))
        engine.dispose()
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        print(
            f"clients: {args.clients} processes, {args.seconds:g} s per round, {args.rounds} rounds,"
            f" flush delay {args.flush_delay_us} µs"
        )
        for r in range(1, args.rounds + 1):
            for mode in MODES if r % 2 else MODES[::-1]:
                rate, heard = one_round(db, mode, args.clients, args.seconds, args.flush_delay_us)
                rates[mode].append(rate)
                print(f"round {r} {mode:>12}: {rate:8,.0f} commits/s, {heard:,} notifications heard")
        inline, after, session = (statistics.median(rates[m]) for m in MODES)
        print(
            f"median: inline {inline:,.0f} commits/s, after commit {after:,.0f} commits/s"
            f" (ratio {after / inline:.2f}), session {session:,.0f} commits/s (ratio {session / inline:.2f})"
        )
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


if __name__ == "__main__":
    main()
