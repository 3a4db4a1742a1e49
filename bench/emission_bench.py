"""Emission next to stock Celery beat and the send_task floor, seen from the broker (issue 14).

Run: ``.venv/bin/python bench/emission_bench.py [--quick] [--broker redis,rabbitmq]
[--seconds 60] [--only 1,2,3,4] [--json PATH]`` (needs the local PostgreSQL, Redis and
RabbitMQ). Everything else it starts itself: real ``celery beat`` and ``celery worker``
processes running ``bench/emission_app.py``, a kombu consumer process per measured phase, a
throwaway database ``bb_emit_*`` per scenario and a queue ``bb_emit_*`` per phase, dropped and
deleted afterwards. bench/README.md says what each figure means.

1. Emission at 1,000 entries x 1 s and 5,000 x 5 s on each broker, no worker: a plain
   ``app.send_task`` loop publishing the same bursts (the floor), Celery's
   ``PersistentScheduler`` and ``celery_boundedbeat.Scheduler`` on the same entries, in that
   order, then the floor again. Publishes/s and drift (arrival at the consumer - due time),
   CPU of the beat process (its dispatcher thread included) and of PostgreSQL apart.
2. Idle: 100 schedules of 1 h, first due an hour away: CPU of beat after start-up, ours and stock.
3. Tracking cost: 5,000 runs of a no-op task through one threads-pool worker, with and
   without ``celery_boundedbeat.install(app)``.
4. End to end: 200 schedules of 1 s, ``fixed_rate_no_overlap``, a 100 ms task, 4 worker
   threads: due-to-start latency and runs lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery
from kombu import connection as _kombu_connection
from kombu import entity as _kombu_entity
from scale_bench import (
    CELERY,
    HOUR,
    PG,
    TASK,
    UNBOUNDED,
    Beat,
    admin_connection,
    dist,
    drop_db,
    fmt,
    load_notes,
    machine,
    machine_busy,
    print_table,
    proc_cpu,
    purge_redis,
    say,
    sleep_until,
)
from sqlalchemy import text

from celery_boundedbeat.core.messages import SCHEDULE_HEADER, SCHEDULED_FOR_HEADER
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.migrate import upgrade

#: kombu is untyped: its classes are used through ``Any``.
Connection: Any = _kombu_connection.Connection
Exchange: Any = _kombu_entity.Exchange
Queue: Any = _kombu_entity.Queue

BROKERS = {"redis": "redis://127.0.0.1:6379/0", "rabbitmq": "amqp://guest:guest@127.0.0.1:5672//"}
#: The broker servers' process names, whose CPU is shown apart (``/proc/<pid>/comm``).
BROKER_PROCESSES = {"redis": "redis-server", "rabbitmq": "beam.smp"}
NO_OVERLAP = {"mode": "fixed_rate_no_overlap"}
#: The tracking scenario's first runs are due at once, whatever a new schedule's default is.
AT_ONCE = {"initial_delay": 0}
#: Stretch target of issue 14: drift p99 at 1,000 x 1 s on RabbitMQ.
STRETCH_P99_S = 0.100


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    seconds: float = 60.0  # scenario 1: each measured window (rounded to whole periods)
    cases: tuple[tuple[int, float], ...] = ((1000, 1.0), (5000, 5.0))  # entries, period (s)
    floors: int = 2  # scenario 1: floor runs per case (before the beats and after them)
    idle_schedules: int = 100
    idle_window: float = 60.0
    tracking_tasks: int = 5000
    #: without install(app) ("off"), with it and the report writer thread or process, in turn
    #: (ABCCBA, so a drifting machine weighs on all three)
    tracking_rounds: tuple[str, ...] = ("off", "auto", "thread", "thread", "auto", "off")
    e2e_schedules: int = 200
    e2e_window: float = 60.0
    e2e_threads: int = 4
    e2e_task_s: float = 0.1


QUICK = Sizes(
    seconds=5.0,
    floors=1,
    idle_window=10.0,
    tracking_tasks=1000,
    tracking_rounds=("off", "auto", "thread"),
    e2e_window=10.0,
)


@dataclasses.dataclass(kw_only=True)
class Context:
    sizes: Sizes
    admin: psycopg.Connection[Any]
    tmp: Path
    brokers: list[str]


# -- databases, queues, brokers -----------------------------------------------------------------


def fresh_db(ctx: Context) -> str:
    """A migrated throwaway database (ours needs the schema; beat does not migrate PostgreSQL)."""
    name = f"bb_emit_{uuid.uuid4().hex[:10]}"
    ctx.admin.execute(f'CREATE DATABASE "{name}"')
    engine = get_engine(PG.format(db=name))
    upgrade(engine)
    engine.dispose()
    return name


def new_queue() -> str:
    return f"bb_emit_{uuid.uuid4().hex[:8]}"


def kombu_queue(name: str) -> Any:
    """The queue as Celery declares its ``task_default_queue`` (a direct exchange of its name)."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def delete_queue(broker: str, queue: str) -> None:
    if broker == "redis":
        purge_redis(queue)
        return
    with Connection(BROKERS[broker]) as conn:
        channel = conn.default_channel
        kombu_queue(queue)(channel).delete()
        Exchange(queue, type="direct")(channel).delete()


def queue_count(broker: str, queue: str) -> int:
    """Messages waiting in a queue (0 for a queue never declared)."""
    if broker == "redis":
        import redis

        client = redis.Redis.from_url(BROKERS["redis"])
        try:
            return int(client.llen(queue))
        finally:
            client.close()
    with Connection(BROKERS[broker]) as conn:
        try:
            return int(conn.default_channel.queue_declare(queue, passive=True).message_count)
        except Exception:
            return 0


def check_services(brokers: Sequence[str]) -> dict[str, str]:
    """Fail early, naming what is down; return the brokers' versions for the machine line."""
    versions = {}
    for broker in brokers:
        try:
            with Connection(BROKERS[broker], connect_timeout=5) as conn:
                conn.ensure_connection(max_retries=1)
                if broker == "rabbitmq":
                    props = conn.connection.server_properties
                    versions[broker] = str(props.get("version", "?"))
                else:
                    info = conn.default_channel.client.info("server")
                    versions[broker] = str(info.get("redis_version", "?"))
        except Exception as exc:
            raise SystemExit(
                f"{broker} at {BROKERS[broker]} is not reachable ({type(exc).__name__}: {exc}); "
                "scripts/test starts the local services"
            ) from None
    return versions


# -- CPU from /proc ------------------------------------------------------------------------------


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its descendants (all threads; children found in /proc)."""
    total, stack, seen = 0.0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        total += proc_cpu(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return total


def pids_named(comm: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == comm:
                    out.append(int(pid))
        except OSError:
            pass
    return out


@dataclasses.dataclass(kw_only=True)
class Snap:
    t: float
    procs: dict[str, float]
    pg: dict[int, float]
    busy: float
    total: float


class Meter:
    """CPU over a window, in % of one core: named process trees, the PostgreSQL backends of
    the given databases, the broker server, the whole machine, and what other processes used.

    The beat's figure is its process tree: the in-beat dispatcher is a thread of it.
    """

    def __init__(
        self, admin: psycopg.Connection[Any], dbs: Sequence[str], procs: dict[str, int], broker: str
    ) -> None:
        self.admin = admin
        self.dbs = list(dbs)
        self.procs = dict(procs)
        self.broker_pids = pids_named(BROKER_PROCESSES[broker])

    def snap(self) -> Snap:
        pids: list[int] = []
        if self.dbs:
            query = "SELECT pid FROM pg_stat_activity WHERE datname = ANY(%s)"
            pids = [r[0] for r in self.admin.execute(query, [self.dbs])]
        busy, total = machine_busy()
        procs = {label: tree_cpu(pid) for label, pid in self.procs.items()}
        procs["broker"] = sum(proc_cpu(p) for p in self.broker_pids)
        return Snap(t=time.time(), procs=procs, pg={p: proc_cpu(p) for p in pids}, busy=busy, total=total)

    @staticmethod
    def usage(a: Snap, b: Snap) -> dict[str, float]:
        elapsed = b.t - a.t
        cores = os.cpu_count() or 1
        out = {"seconds": elapsed}
        for label, value in b.procs.items():
            out[f"{label}_pct"] = (value - a.procs.get(label, 0.0)) / elapsed * 100
        out["postgres_pct"] = sum(v - a.pg.get(p, 0.0) for p, v in b.pg.items()) / elapsed * 100
        out["machine_pct"] = (b.busy - a.busy) / max(b.total - a.total, 1e-9) * cores * 100
        ours = sum(out[f"{label}_pct"] for label in b.procs) + out["postgres_pct"]
        out["other_pct"] = max(out["machine_pct"] - ours, 0.0)
        return out


# -- processes -----------------------------------------------------------------------------------


class Proc(Beat):
    """A ``celery beat`` or ``celery worker`` running bench/emission_app.py.

    scale_bench's ``Beat`` (start, SIGTERM stop, marks file, log problems) with another command.
    """

    def __init__(self, label: str, tmp: Path, env: dict[str, str], args: Sequence[str]) -> None:
        super().__init__(label, tmp, env, loglevel="WARNING")
        self.cmd = [CELERY, "-A", "emission_app", *args]


def beat_proc(ctx: Context, label: str, env: dict[str, str], *, stock: bool) -> Proc:
    """Beat at Celery's default log level (WARNING): stock beat logs every send at INFO."""
    for old in ctx.tmp.glob(f"{label}-schedule*"):
        old.unlink()
    scheduler = "emission_app:StampedStock" if stock else "emission_app:Marked"
    args = ["beat", "-S", scheduler, "--loglevel", "WARNING", "-s", str(ctx.tmp / f"{label}-schedule")]
    return Proc(label, ctx.tmp, env, args)


def worker_proc(ctx: Context, label: str, env: dict[str, str], queue: str, threads: int) -> Proc:
    args = ["worker", "-P", "threads", "-c", str(threads), "-Q", queue, "--loglevel", "WARNING"]
    args += ["--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"{label}@%h"]
    return Proc(label, ctx.tmp, {**env, "BENCH_WORKER": "1"}, args)


def app_env(
    broker: str,
    queue: str,
    db: str | None,
    *,
    kind: str,
    entries: int = 0,
    period: float = 1.0,
    policy: dict[str, Any] | None = None,
    **extra: str,
) -> dict[str, str]:
    return {
        "BENCH_BROKER": BROKERS[broker],
        "BENCH_QUEUE": queue,
        "BENCH_DB_URL": PG.format(db=db or "postgres"),
        "BENCH_KIND": kind,
        "BENCH_ENTRIES": str(entries),
        "BENCH_PERIOD": repr(period),
        "BENCH_POLICY": json.dumps(policy) if policy is not None else "",
        **extra,
    }


def wait_mark(proc: Proc, name: str, timeout: float) -> list[str]:
    """The first ``name`` line of a process's marks file; fails if it exits or takes too long."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = proc.events(name)
        if found:
            return found[0]
        if not proc.alive():
            raise SystemExit(f"{proc.label}: exited before '{name}':\n{proc.tail()}")
        time.sleep(0.02)
    raise SystemExit(f"{proc.label}: no '{name}' after {timeout:.0f} s:\n{proc.tail()}")


# -- the broker's point of view: a kombu consumer process -----------------------------------------


def consume(url: str, queue: str, out: str, ready: Any, stop: Any) -> None:
    """Record (arrival time, due time as sent, schedule) of every message, until told to stop.

    A process of its own, so the beat's CPU and this bookkeeping never share a GIL. It acks
    nothing (``no_ack``), decodes no body, and keeps the raw header; the due time is parsed
    afterwards. It drains what is left once ``stop`` is set, then writes its records. On
    RabbitMQ it reads the socket itself (:func:`consume_amqp`).
    """
    records: list[tuple[float, Any, Any]] = []
    append = records.append

    def keep(at: float, headers: Any) -> None:
        due = headers.get(SCHEDULED_FOR_HEADER) or headers.get("bench_due")
        append((at, due, headers.get(SCHEDULE_HEADER) or headers.get("bench_entry")))

    if url.startswith("amqp"):
        consume_amqp(url, queue, keep, ready, stop)
    else:
        with (
            Connection(url) as conn,
            conn.Consumer(
                kombu_queue(queue),
                on_message=lambda m: keep(time.time(), m.headers),
                no_ack=True,
                accept=["json"],
            ),
        ):
            ready.set()
            drain(conn, stop)
    Path(out).write_text(json.dumps(records))


def drain(conn: Any, stop: Any) -> None:
    while True:
        try:
            conn.drain_events(timeout=0.25)
        except TimeoutError:  # socket.timeout: nothing came for a while
            if stop.is_set():
                return


def consume_amqp(url: str, queue: str, keep: Callable[[float, Any], None], ready: Any, stop: Any) -> None:
    """The consumer on RabbitMQ: the socket read raw while messages come, parsed afterwards.

    A Python consumer that parses each message as it comes is itself the bottleneck of a
    burst: py-amqp's took about 140 µs a message here (kombu's 290 µs), so a burst written in
    under a millisecond was seen arriving over 0.14 s. Here the window's bytes are only read
    and stamped (one ``recv`` of up to 1 MiB each); a message's arrival is the time the read
    that completed it returned, never earlier than the broker delivered it. The frames are
    decoded with py-amqp's own property decoder once the phase is over.
    """
    import amqp

    with Connection(url) as declaring:
        kombu_queue(queue)(declaring.default_channel).declare()
    parts = Connection(url)
    conn = amqp.Connection(
        f"{parts.hostname}:{parts.port or 5672}", userid=parts.userid, password=parts.password
    )
    conn.connect()
    chunks: list[tuple[float, bytes]] = []
    try:
        channel = conn.channel()
        channel.basic_consume(queue, no_ack=True)
        sock = conn.transport.sock
        if conn.transport._read_buffer:
            chunks.append((time.time(), bytes(conn.transport._read_buffer)))
        sock.settimeout(0.25)
        ready.set()
        now, recv, append = time.time, sock.recv, chunks.append
        while True:
            try:
                data = recv(1 << 20)
            except TimeoutError:  # socket.timeout: nothing came for a while
                if stop.is_set():
                    break
                continue
            if not data:
                break
            append((now(), data))
    finally:
        conn.collect()  # the socket's bytes were taken from under py-amqp: no orderly close
    for at, headers in delivered(chunks):
        keep(at, headers)


def delivered(chunks: list[tuple[float, bytes]]) -> list[tuple[float, dict[str, Any]]]:
    """(arrival, headers) of each message in the bytes read: AMQP 0-9-1 content frames."""
    import struct

    from amqp.serialization import decode_properties_basic

    data = b"".join(c for _, c in chunks)
    ends, total = [], 0
    for _, c in chunks:
        total += len(c)
        ends.append(total)
    times = [t for t, _ in chunks]
    out: list[tuple[float, dict[str, Any]]] = []
    pos, headers, left, k = 0, None, 0, 0
    while pos + 7 <= len(data):
        kind, _channel, size = struct.unpack_from(">BHI", data, pos)
        payload, end = pos + 7, pos + 7 + size + 1
        if end > len(data):
            break
        if kind == 2:  # content header: class, weight, body size, properties
            (left,) = struct.unpack_from(">Q", data, payload + 4)
            props, _ = decode_properties_basic(data, payload + 12)
            headers = props.get("application_headers") or {}
        elif kind == 3:
            left -= size
        if headers is not None and left <= 0 and kind in (2, 3):
            while ends[k] < end:
                k += 1
            out.append((times[k], headers))
            headers = None
        pos = end
    return out


def due_time(raw: Any) -> float | None:
    """A due time as a header carried it: ours in ISO 8601, the bench's stamps as a float."""
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str):
        try:
            return datetime.fromisoformat(raw).timestamp()
        except ValueError:
            return None
    return None


class Consumer:
    """The spawned consumer process of one phase and its records."""

    def __init__(self, ctx: Context, broker: str, queue: str, label: str) -> None:
        spawn = mp.get_context("spawn")
        self.out = ctx.tmp / f"{label}.arrivals.json"
        self.ready = spawn.Event()
        self.stop = spawn.Event()
        self.proc = spawn.Process(
            target=consume, args=(BROKERS[broker], queue, str(self.out), self.ready, self.stop), daemon=True
        )

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def start(self) -> Consumer:
        self.proc.start()
        if not self.ready.wait(90):
            self.proc.terminate()
            raise SystemExit("the consumer process did not start consuming within 90 s")
        return self

    def finish(self) -> list[tuple[float, float | None, str | None]]:
        """Stop after the queue went quiet; (arrival, due, schedule) per message."""
        self.stop.set()
        self.proc.join(timeout=300)
        if self.proc.is_alive():
            self.proc.terminate()
            raise SystemExit("the consumer process did not finish")
        raw = json.loads(self.out.read_text())
        return [(float(a), due_time(d), e) for a, d, e in raw]


# -- scenario 1: emission ------------------------------------------------------------------------


def floor_sender(url: str, queue: str, n: int, period: float, commands: Any, results: Any) -> None:
    """The floor: bursts of ``n`` plain ``app.send_task`` calls, one per ``period``, in a process.

    Each message carries the burst's start (``bench_due``), so its drift is the time from the
    burst's start to its arrival. A burst that overruns its period skips the slots it covered.
    """
    app = Celery("emission_floor", broker=url, set_as_current=False)
    app.conf.task_default_queue = queue
    app.send_task(TASK, args=(-1,), headers={"bench_due": "warm-up"})  # connection and queue
    results.put(("ready", os.getpid()))
    start, end = commands.get()
    loops: list[tuple[float, float]] = []
    k = 0
    while (slot := start + k * period) < end:
        sleep_until(slot)
        t0 = time.time()
        with app.producer_or_acquire() as producer:
            for i in range(n):
                app.send_task(TASK, args=(i,), producer=producer, headers={"bench_due": t0})
        loops.append((t0, time.time() - t0))
        k = max(k + 1, math.ceil((time.time() - start) / period))
    results.put(("done", loops))


def wire_sender(url: str, queue: str, n: int, period: float, commands: Any, results: Any) -> None:
    """The wire limit (RabbitMQ): each burst's AMQP frames built before its slot, one write at it.

    Messages as the prepared ticks build them (Celery's ``send_task_message`` recorded, then
    py-amqp's framing), stamped with the slot as their due time: what is left between the due
    time and a consumer's receipt is the socket, the broker and the consumer itself.
    """
    from types import SimpleNamespace

    from celery_boundedbeat.dispatch.frames import Framer
    from celery_boundedbeat.dispatch.publish import _Recorder

    app = Celery("emission_wire", broker=url, set_as_current=False)
    app.conf.task_default_queue = queue
    app.send_task(TASK, args=(-1,), headers={"bench_due": "warm-up"})  # connection and queue
    with app.producer_or_acquire() as producer:
        framer, recorder = Framer.of(producer), _Recorder(producer)
        assert framer is not None, "frames are built for py-amqp channels only"

        def burst(slot: float) -> bytes:
            frames = []
            for i in range(n):
                message = app.amqp.create_task_message(str(uuid.uuid4()), TASK, (i,), {})
                ready = SimpleNamespace(task=TASK, message=message, headers={"bench_due": slot}, options={})
                wire = recorder.record(app, ready)  # type: ignore[arg-type]
                frames.append((framer.frames(producer, wire) if wire is not None else None) or b"")
            return b"".join(frames)

        results.put(("ready", os.getpid()))
        start, end = commands.get()
        loops: list[tuple[float, float]] = []
        k = 0
        while (slot := start + k * period) < end:
            data = burst(slot)
            sleep_until(slot)
            framer.write(data)
            loops.append((slot, time.time() - slot))
            k = max(k + 1, math.ceil((time.time() - start) / period))
    results.put(("done", loops))


def floor_phase(
    ctx: Context,
    broker: str,
    n: int,
    period: float,
    window: float,
    label: str,
    sender_fn: Callable[..., None] = floor_sender,
) -> dict[str, Any]:
    queue = new_queue()
    consumer = Consumer(ctx, broker, queue, label).start()
    spawn = mp.get_context("spawn")
    commands, results = spawn.Queue(), spawn.Queue()
    sender = spawn.Process(
        target=sender_fn, args=(BROKERS[broker], queue, n, period, commands, results), daemon=True
    )
    sender.start()
    try:
        assert results.get(timeout=120)[0] == "ready"
        meter = Meter(ctx.admin, [], {"sender": sender.pid or 0, "consumer": consumer.pid}, broker)
        start = math.ceil(time.time()) + 1.0
        commands.put((start, start + window))
        sleep_until(start)
        a = meter.snap()
        sleep_until(start + window)
        _, loops = results.get(timeout=window + 300)
        b = meter.snap()
        sender.join(timeout=30)
    finally:
        if sender.is_alive():
            sender.terminate()
        records = consumer.finish()
        delete_queue(broker, queue)
    out = floor_summary(records, loops, n)
    out["cpu"] = Meter.usage(a, b)
    return out


def floor_summary(
    records: list[tuple[float, float | None, str | None]], loops: list[tuple[float, float]], n: int
) -> dict[str, Any]:
    """Burst time (start to its last message's arrival), drift, and the loop's own time."""
    bursts: dict[float, list[float]] = {t0: [] for t0, _ in loops}
    for arrival, due, _ in records:
        if due is not None and due in bursts:
            bursts[due].append(arrival)
    complete = {t0: arrivals for t0, arrivals in bursts.items() if len(arrivals) == n}
    burst_s = [max(arrivals) - t0 for t0, arrivals in complete.items()]
    drift = [arrival - t0 for t0, arrivals in complete.items() for arrival in arrivals]
    loop_s = [d for _, d in loops]
    return {
        "bursts": len(loops),
        "bursts_incomplete": len(loops) - len(complete),
        "burst_s": dist(burst_s),
        "burst_p50_s": statistics.median(burst_s) if burst_s else math.nan,
        "loop_s": dist(loop_s),
        "loop_msgs_per_s": n / statistics.median(loop_s) if loop_s else math.nan,
        "drift_s": dist(drift),
    }


def beat_phase(
    ctx: Context, broker: str, n: int, period: float, window: float, *, stock: bool
) -> dict[str, Any]:
    """One scheduler on the case's entries: start, warm up a period, measure a window, stop."""
    kind = "stock" if stock else "ours"
    label = f"{kind}-{broker}-{n}"
    queue = new_queue()
    db = None if stock else fresh_db(ctx)
    out: dict[str, Any] = {"scheduler": "celery.beat.PersistentScheduler" if stock else "celery_boundedbeat"}
    try:
        consumer = Consumer(ctx, broker, queue, label).start()
        env = app_env(broker, queue, db, kind=kind, entries=n, period=period, policy=UNBOUNDED)
        beat = beat_proc(ctx, label, env, stock=stock)
        beat.start()
        try:
            meter = Meter(ctx.admin, [db] if db else [], {"beat": beat.pid, "consumer": consumer.pid}, broker)
            ticking = beat.wait_ticking(300)
            out["startup"] = beat.startup()
            sleep_until(ticking + period + 2)
            a = meter.snap()
            sleep_until(a.t + window)
            b = meter.snap()
            out["cpu"] = Meter.usage(a, b)
            out["problems"] = beat.problems()
            ticks = beat.ticks(a.t, b.t)
            if ticks:
                out["ticks_per_s"] = len(ticks) / (b.t - a.t)
                out["tick_transaction_ms"] = dist([t[1] * 1000 for t in ticks])
        finally:
            out["stop_s"] = beat.stop()
            records = consumer.finish()
    finally:
        delete_queue(broker, queue)
        if db:
            drop_db(ctx.admin, db)
    out.update(arrival_summary(records, a.t, b.t, n, period, ticking))
    out["window_start_s"] = a.t - ticking  # per_tick's times are from ``ticking`` too
    return out


def arrival_summary(
    records: list[tuple[float, float | None, str | None]],
    a: float,
    b: float,
    n: int,
    period: float,
    t0: float,
) -> dict[str, Any]:
    """Publishes/s and drift of the messages that reached the broker in ``[a, b)``."""
    inside = [(arrival, due) for arrival, due, _ in records if a <= arrival < b]
    drift = [arrival - due for arrival, due in inside if due is not None]
    first: dict[str, float] = {}
    for arrival, _, entry in records:
        if entry is not None and entry not in first:
            first[entry] = arrival
    return {
        "window_s": b - a,
        "arrivals": len(inside),
        "publishes_per_s": len(inside) / (b - a),
        "due_per_s": n / period,
        "share_of_due": len(inside) / (b - a) / (n / period),
        "drift_s": dist(drift),
        "without_due_time": len(inside) - len(drift),
        # Published before its due time (0.5 ms allows for the header's rounding).
        "early": sum(1 for d in drift if d < -0.0005),
        "entries_published": len(first),
        "entries": n,
        "latest_first_publish_s": max(first.values()) - t0 if first else math.nan,
        "per_tick": per_tick(records, t0),
    }


def per_tick(records: list[tuple[float, float | None, str | None]], t0: float) -> list[list[float]]:
    """Each due time's messages: ``[due - t0, count, first drift, last drift]`` (seconds).

    Shows what one percentile over the window cannot: whether a few ticks after start-up were
    late (a burst still being published) or every tick is.
    """
    by_due: dict[float, list[float]] = {}
    for arrival, due, _ in records:
        if due is not None:
            by_due.setdefault(round(due, 3), []).append(arrival - due)
    return [[due - t0, len(d), min(d), max(d)] for due, d in sorted(by_due.items())]


def settled_after(ticks: list[list[float]], start: float) -> tuple[int, float]:
    """Ticks due in the window before the first whose first message came within 100 ms of its
    due time, and the worst last-message drift of the ticks from there on."""
    inside = [t for t in ticks if t[0] >= start]
    late = next((i for i, t in enumerate(inside) if t[2] <= 0.1), len(inside))
    rest = [t[3] for t in inside[late:]]
    return late, max(rest) if rest else math.nan


def emission_case(ctx: Context, broker: str, n: int, period: float) -> dict[str, Any]:
    window = max(period, round(ctx.sizes.seconds / period) * period)
    out: dict[str, Any] = {"broker": broker, "entries": n, "period_s": period, "window_s": window}
    name = f"{broker} {n:,} x {period:g} s"
    say(f"scenario 1: {name}: floor (plain send_task bursts)")
    floors = [floor_phase(ctx, broker, n, period, window, f"floor1-{broker}-{n}")]
    for stock in (True, False):
        say(f"scenario 1: {name}: {'stock beat' if stock else 'celery_boundedbeat'}")
        out["stock" if stock else "ours"] = beat_phase(ctx, broker, n, period, window, stock=stock)
    if ctx.sizes.floors > 1:
        say(f"scenario 1: {name}: floor again")
        floors.append(floor_phase(ctx, broker, n, period, window, f"floor2-{broker}-{n}"))
    out["floors"] = floors
    if broker == "rabbitmq":
        say(f"scenario 1: {name}: wire limit (frames built ahead, one write at each due time)")
        out["wire"] = floor_phase(ctx, broker, n, period, window, f"wire-{broker}-{n}", wire_sender)
    out["floor_burst_s"] = statistics.mean(f["burst_p50_s"] for f in floors)
    ours = out["ours"]["drift_s"]["p99"]
    out["ours_p99_over_floor_burst"] = ours / out["floor_burst_s"]
    say(
        f"scenario 1: {name}: floor burst {out['floor_burst_s'] * 1000:.0f} ms; drift p99 "
        f"stock {out['stock']['drift_s']['p99']:.3f} s, ours {ours:.3f} s"
    )
    return out


def scenario_emission(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for broker in ctx.brokers:
        for n, period in ctx.sizes.cases:
            out[f"{broker}_{n}x{period:g}"] = emission_case(ctx, broker, n, period)
    return out


# -- scenario 2: idle ----------------------------------------------------------------------------


def idle_phase(ctx: Context, broker: str, *, stock: bool) -> dict[str, Any]:
    """CPU of a beat with nothing due for an hour, over the window after its first tick."""
    sz = ctx.sizes
    kind = "stock" if stock else "ours"
    queue = new_queue()
    db = None if stock else fresh_db(ctx)
    # Ours runs a new schedule at once unless told otherwise; stock waits one period.
    env = app_env(
        broker, queue, db, kind=kind, entries=sz.idle_schedules, period=HOUR, policy={"initial_delay": HOUR}
    )
    out: dict[str, Any] = {}
    try:
        beat = beat_proc(ctx, f"idle-{kind}", env, stock=stock)
        beat.start()
        try:
            meter = Meter(ctx.admin, [db] if db else [], {"beat": beat.pid}, broker)
            ticking = beat.wait_ticking(120)
            out["startup"] = beat.startup()
            sleep_until(ticking + 2)
            a = meter.snap()
            sleep_until(a.t + sz.idle_window)
            out["cpu"] = Meter.usage(a, meter.snap())
            out["problems"] = beat.problems()
        finally:
            out["stop_s"] = beat.stop()
        out["messages_published"] = queue_count(broker, queue)
    finally:
        delete_queue(broker, queue)
        if db:
            drop_db(ctx.admin, db)
    return out


def scenario_idle(ctx: Context) -> dict[str, Any]:
    broker = ctx.brokers[0]
    out: dict[str, Any] = {"schedules": ctx.sizes.idle_schedules, "period_s": HOUR, "broker": broker}
    for stock in (False, True):
        say(f"scenario 2: idle, {'stock beat' if stock else 'celery_boundedbeat'}")
        out["stock" if stock else "ours"] = idle_phase(ctx, broker, stock=stock)
    return out


# -- scenario 3: tracking cost -------------------------------------------------------------------


def scalar(db: str, sql: str, **params: Any) -> Any:
    engine = get_engine(PG.format(db=db))
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql), params).scalar()
    finally:
        engine.dispose()


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def tracking_round(ctx: Context, broker: str, writer: str) -> dict[str, Any]:
    """n runs emitted by our beat into the queue (worker stopped), then drained by one worker.

    Both cases get the same messages, our headers included; without ``install(app)`` the
    worker just does not record them. Timed from the first task body to the last.
    """
    n = ctx.sizes.tracking_tasks
    install = writer != "off"
    queue = new_queue()
    db = fresh_db(ctx)
    out: dict[str, Any] = {"install": install, "writer": writer, "tasks": n}
    try:
        env = app_env(broker, queue, db, kind="ours", entries=n, period=HOUR, policy=AT_ONCE)
        beat = beat_proc(ctx, f"track-beat-{int(install)}", env, stock=False)
        beat.start()
        try:
            published = "SELECT count(*) FROM boundedbeat_runs WHERE state = 'published'"
            wait_for(f"{n} published runs", lambda: scalar(db, published) == n, 300)
        finally:
            beat.stop()
        extra = {"BENCH_INSTALL": "1" if install else "0", "BENCH_EXPECT": str(n)}
        extra["BENCH_REPORT_WRITER"] = writer if install else "auto"
        worker = worker_proc(ctx, f"track-worker-{int(install)}", {**env, **extra}, queue, 4)
        worker.start()
        try:
            meter = Meter(ctx.admin, [db], {"worker": worker.pid}, broker)
            wait_mark(worker, "ready", 120)
            a = meter.snap()
            first, last, _ = (float(v) for v in wait_mark(worker, "done", 600))
            b = meter.snap()
            if install:
                done = "SELECT count(*) FROM boundedbeat_runs WHERE state = 'completed'"
                wait_for(f"{n} completed runs", lambda: scalar(db, done) == n, 120)
            out["problems"] = worker.problems()
        finally:
            worker.stop()
        out["runs_completed"] = scalar(db, "SELECT count(*) FROM boundedbeat_runs WHERE state = 'completed'")
    finally:
        delete_queue(broker, queue)
        drop_db(ctx.admin, db)
    out["tasks_per_s"] = (n - 1) / (last - first)
    out["cpu"] = Meter.usage(a, b)
    out["worker_cpu_ms_per_task"] = out["cpu"]["worker_pct"] / 100 * out["cpu"]["seconds"] / n * 1000
    out["postgres_cpu_ms_per_task"] = out["cpu"]["postgres_pct"] / 100 * out["cpu"]["seconds"] / n * 1000
    return out


def scenario_tracking(ctx: Context) -> dict[str, Any]:
    broker = ctx.brokers[0]
    out: dict[str, Any] = {
        "tasks": ctx.sizes.tracking_tasks,
        "broker": broker,
        "pool": "threads",
        "threads": 4,
    }
    rounds = []
    for writer in ctx.sizes.tracking_rounds:
        how = "without install" if writer == "off" else f"with install, report writer {writer}"
        say(f"scenario 3: {ctx.sizes.tracking_tasks} no-op runs, {how}")
        rounds.append(tracking_round(ctx, broker, writer))
        say(f"scenario 3: {rounds[-1]['tasks_per_s']:.0f} tasks/s")
    out["rounds"] = rounds
    for key, writer in (("without", "off"), ("with", "auto"), ("with_thread", "thread")):
        mine = [r for r in rounds if r["writer"] == writer]
        if not mine:
            continue
        out[key] = {
            "tasks_per_s": statistics.mean(r["tasks_per_s"] for r in mine),
            "tasks_per_s_each": [r["tasks_per_s"] for r in mine],
            "worker_cpu_ms_per_task": statistics.mean(r["worker_cpu_ms_per_task"] for r in mine),
            "postgres_cpu_ms_per_task": statistics.mean(r["postgres_cpu_ms_per_task"] for r in mine),
        }
    out["ratio"] = out["with"]["tasks_per_s"] / out["without"]["tasks_per_s"]
    out["ms_added_per_run"] = (1 / out["with"]["tasks_per_s"] - 1 / out["without"]["tasks_per_s"]) * 1000
    if "with_thread" in out:
        thread = out["with_thread"]["tasks_per_s"]
        out["ratio_thread"] = thread / out["without"]["tasks_per_s"]
        out["ms_added_per_run_thread"] = (1 / thread - 1 / out["without"]["tasks_per_s"]) * 1000
    out["runs_completed_with"] = [r["runs_completed"] for r in rounds if r["install"]]
    return out


# -- scenario 4: end to end ----------------------------------------------------------------------

_LATENCY_SQL = (
    "SELECT extract(epoch FROM started_at - scheduled_for) FROM boundedbeat_runs "
    "WHERE scheduled_for >= to_timestamp(:a) AND scheduled_for < to_timestamp(:b) AND started_at IS NOT NULL"
)
_STATES_SQL = (
    "SELECT state, count(*) FROM boundedbeat_runs "
    "WHERE scheduled_for >= to_timestamp(:a) AND scheduled_for < to_timestamp(:b) GROUP BY state"
)
#: Per schedule: grid ticks passed since its first run, and the ticks accounted for (a grid run
#: emitted, a tick skipped, or one waiting); the difference is ticks lost from the grid.
_GRID_SQL = (
    "SELECT s.name, extract(epoch FROM s.grid_at - f.first) / s.period, "
    "s.grid_runs + s.skips + json_array_length(s.pending::json) "
    "FROM boundedbeat_schedules s JOIN (SELECT schedule, min(scheduled_for) AS first "
    "FROM boundedbeat_runs GROUP BY schedule) f ON f.schedule = s.name"
)


def e2e_rows(db: str, a: float, b: float) -> dict[str, Any]:
    engine = get_engine(PG.format(db=db))
    try:
        with engine.connect() as conn:
            latency = [float(r[0]) for r in conn.execute(text(_LATENCY_SQL), {"a": a, "b": b})]
            states = {str(s): int(c) for s, c in conn.execute(text(_STATES_SQL), {"a": a, "b": b})}
    finally:
        engine.dispose()
    return {"latency": latency, "states": states}


def grid_accounting(db: str) -> dict[str, int]:
    engine = get_engine(PG.format(db=db))
    try:
        with engine.connect() as conn:
            rows = [(str(n), float(t), int(c)) for n, t, c in conn.execute(text(_GRID_SQL))]
    finally:
        engine.dispose()
    expected = [round(t) for _, t, _ in rows]
    return {
        "schedules": len(rows),
        "grid_ticks": sum(expected),
        "accounted": sum(c for _, _, c in rows),
        "missing": sum(max(e - c, 0) for e, (_, _, c) in zip(expected, rows, strict=True)),
        "extra": sum(max(c - e, 0) for e, (_, _, c) in zip(expected, rows, strict=True)),
    }


def e2e_measure(ctx: Context, db: str, beat: Proc, worker: Proc, broker: str) -> dict[str, Any]:
    """The window's CPU, then (after the runs due in it had time to settle) its runs."""
    meter = Meter(ctx.admin, [db], {"beat": beat.pid, "worker": worker.pid}, broker)
    ticking = beat.wait_ticking(120)
    sleep_until(ticking + 5)
    a = meter.snap()
    sleep_until(a.t + ctx.sizes.e2e_window)
    b = meter.snap()
    active = (
        "SELECT count(*) FROM boundedbeat_runs WHERE scheduled_for < to_timestamp(:b) "
        "AND state IN ('queued', 'published', 'started')"
    )
    deadline = time.time() + 120
    while scalar(db, active, b=b.t) and time.time() < deadline:
        time.sleep(0.5)
    found = e2e_rows(db, a.t, b.t)
    window = b.t - a.t
    terminal = {"completed", "failed", "timed_out", "revoked", "rejected", "lost"}
    due = sum(found["states"].values())
    return {
        "cpu": Meter.usage(a, b),
        "window_s": window,
        "latency_s": dist(found["latency"]),
        "states": found["states"],
        "runs_in_window": due,
        "runs_started_per_s": len(found["latency"]) / window,
        "runs_never_terminal": sum(c for s, c in found["states"].items() if s not in terminal),
        "runs_lost_state": found["states"].get("lost", 0),
        "settle_wait_s": time.time() - b.t,
    }


def scenario_e2e(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes
    broker = ctx.brokers[0]
    queue = new_queue()
    db = fresh_db(ctx)
    out: dict[str, Any] = {"schedules": sz.e2e_schedules, "period_s": 1.0, "broker": broker}
    out.update(threads=sz.e2e_threads, task_s=sz.e2e_task_s, policy=NO_OVERLAP)
    out["capacity_runs_per_s"] = sz.e2e_threads / sz.e2e_task_s
    env = app_env(broker, queue, db, kind="ours", entries=sz.e2e_schedules, period=1.0, policy=NO_OVERLAP)
    env.update(BENCH_TASK="bench.sleep", BENCH_TASK_SECONDS=repr(sz.e2e_task_s), BENCH_INSTALL="1")
    say(
        f"scenario 4: {sz.e2e_schedules} schedules of 1 s, {sz.e2e_task_s:g} s task, {sz.e2e_threads} threads"
    )
    try:
        worker = worker_proc(ctx, "e2e-worker", env, queue, sz.e2e_threads)
        worker.start()
        try:
            wait_mark(worker, "ready", 120)
            beat = beat_proc(ctx, "e2e-beat", env, stock=False)
            beat.start()
            try:
                out.update(e2e_measure(ctx, db, beat, worker, broker))
                out["problems"] = beat.problems()
            finally:
                beat.stop()
            out["grid"] = grid_accounting(db)
            out["problems"] = out.get("problems", []) + worker.problems()
        finally:
            worker.stop()
    finally:
        delete_queue(broker, queue)
        drop_db(ctx.admin, db)
    say(
        f"scenario 4: due-to-start p99 {out['latency_s']['p99']:.3f} s, grid missing {out['grid']['missing']}"
    )
    return out


# -- the report ----------------------------------------------------------------------------------

Row = tuple[str, str, str, str]


def ms(seconds: float) -> str:
    return fmt(seconds * 1000, " ms", 0) if seconds < 10 else fmt(seconds, " s", 1)


def trio(d: dict[str, float]) -> str:
    return " / ".join(ms(d[k]) for k in ("p50", "p99", "max"))


def row(label: str, measured: str, target: str = "", ratio: float | None = None) -> Row:
    return (label, measured, target, "" if ratio is None or math.isnan(ratio) else f"{ratio:.2f}")


def emission_rows(case: dict[str, Any]) -> list[Row]:
    n, period, broker = case["entries"], case["period_s"], case["broker"]
    floor, stock, ours = case["floor_burst_s"], case["stock"], case["ours"]
    fl = case["floors"][0]
    limit = 1.2 * floor
    rows = [
        row(f"1 {broker}, {n:,} x {period:g} s: floor burst (send_task loop)", ms(floor), "reference"),
        row("  floor: loop alone / msgs/s", f"{ms(fl['loop_s']['p50'])} / {fl['loop_msgs_per_s']:,.0f}/s"),
        row("  floor drift p50 / p99 / max", trio(fl["drift_s"])),
    ]
    for key, who in (("stock", "stock"), ("ours", "ours")):
        r = case[key]
        due = r["due_per_s"]
        rows.append(
            row(
                f"  {who}: publishes/s",
                fmt(r["publishes_per_s"], "/s", 0),
                f"due {due:,.0f}/s",
                r["share_of_due"],
            )
        )
        rows.append(row(f"  {who}: drift p50 / p99 / max", trio(r["drift_s"])))
        if key == "ours" and r.get("per_tick") and "window_start_s" in r:  # stock's due times slide
            late, worst = settled_after(r["per_tick"], r["window_start_s"])
            rows.append(
                row(
                    f"  {who}: window's ticks still catching up / worst tick after that (last msg)",
                    f"{late} / {ms(worst) if not math.isnan(worst) else '-'}",
                )
            )
        cpu = r["cpu"]
        rows.append(
            row(
                f"  {who}: CPU beat{' + dispatcher' if key == 'ours' else ''}",
                fmt(cpu["beat_pct"], " % core", 1),
                "<= 40 % core" if key == "ours" and (n, period) == (1000, 1.0) else "",
                cpu["beat_pct"] / 40 if key == "ours" and (n, period) == (1000, 1.0) else None,
            )
        )
        if key == "ours":
            rows.append(row("  ours: PostgreSQL CPU", fmt(cpu["postgres_pct"], " % core", 1)))
        rows.append(
            row(
                f"  {who}: entries published / latest first publish",
                f"{r['entries_published']:,} / {fmt(r['latest_first_publish_s'], ' s', 1)}",
                f"of {n:,} entries",
            )
        )
        side = f"{cpu['consumer_pct']:.0f} / {cpu['broker_pct']:.0f} % core"
        rows.append(row(f"  {who}: meanwhile consumer / broker server CPU", side))
    floor_cpu = statistics.mean(f["cpu"]["sender_pct"] for f in case["floors"])
    rows.insert(3, row("  floor: CPU of the send_task process", fmt(floor_cpu, " % core", 1)))
    p99 = ours["drift_s"]["p99"]
    rows.append(row("  ours: drift p99 vs floor burst", ms(p99), f"<= 1.2x floor = {ms(limit)}", p99 / limit))
    if broker == "rabbitmq" and (n, period) == (1000, 1.0):
        rows.append(row("  ours: drift p99 (stretch)", ms(p99), "<= 100 ms", p99 / STRETCH_P99_S))
    wire = case.get("wire")
    if wire is not None:
        limit_p99 = wire["drift_s"]["p99"]
        rows.append(
            row(
                "  wire limit (frames prebuilt, one write at due): drift p50 / p99 / max",
                trio(wire["drift_s"]),
            )
        )
        rows.append(
            row("  ours: drift p99 vs the wire limit", ms(p99), f"limit {ms(limit_p99)}", p99 / limit_p99)
        )
    rows.append(row("  ours: published before due", str(ours["early"]), "0"))
    sp99 = stock["drift_s"]["p99"]
    rows.append(row("  ours vs stock: drift p99", ms(p99), f"stock {ms(sp99)}", p99 / sp99 if sp99 else None))
    return rows


def other_rows(results: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    idle = results.get("2_idle")
    if idle:
        o, s = idle["ours"]["cpu"], idle["stock"]["cpu"]
        rows.append(
            row(
                f"2 idle, {idle['schedules']} x 1 h: ours beat CPU",
                fmt(o["beat_pct"], " % core", 2),
                "<= 0.2 % core",
                o["beat_pct"] / 0.2,
            )
        )
        rows.append(row("  stock beat CPU", fmt(s["beat_pct"], " % core", 2)))
        rows.append(row("  ours: PostgreSQL CPU", fmt(o["postgres_pct"], " % core", 2)))
        published = f"{idle['ours']['messages_published']} / {idle['stock']['messages_published']}"
        rows.append(row("  messages published (ours / stock)", published, "0 / 0"))
    tr = results.get("3_tracking")
    if tr:
        w, wo = tr["with"], tr["without"]
        each = ", ".join(f"{v:,.0f}" for v in wo["tasks_per_s_each"])
        rows.append(
            row(
                f"3 tracking, {tr['tasks']:,} no-op runs, threads x 4: without install",
                fmt(wo["tasks_per_s"], " tasks/s", 0),
                f"rounds {each}",
            )
        )
        each = ", ".join(f"{v:,.0f}" for v in w["tasks_per_s_each"])
        label = "  with install(app): default writer (a process, for the threads pool)"
        rows.append(row(label, fmt(w["tasks_per_s"], " tasks/s", 0), f"rounds {each}"))
        rows.append(row("  ratio with / without", f"{tr['ratio']:.2f}", ">= 0.8", tr["ratio"] / 0.8))
        rows.append(
            row(
                "  wall time added per run",
                fmt(tr["ms_added_per_run"], " ms", 2),
                "<= 1 ms",
                tr["ms_added_per_run"],
            )
        )
        cpu = f"{wo['worker_cpu_ms_per_task']:.2f} / {w['worker_cpu_ms_per_task']:.2f} ms"
        rows.append(row("  worker CPU per run without / with (its process tree: the writer included)", cpu))
        wt = tr.get("with_thread")
        if wt:
            each = ", ".join(f"{v:,.0f}" for v in wt["tasks_per_s_each"])
            label = '  with install(app), boundedbeat_report_writer = "thread"'
            rows.append(row(label, fmt(wt["tasks_per_s"], " tasks/s", 0), f"rounds {each}"))
            ratio = tr["ratio_thread"]
            rows.append(row("  ratio with (writer thread) / without", f"{ratio:.2f}", "(not the default)"))
            added = tr["ms_added_per_run_thread"]
            rows.append(row("  wall time added per run (writer thread)", fmt(added, " ms", 2)))
            cpu = f"{wt['worker_cpu_ms_per_task']:.2f} ms"
            rows.append(row("  worker CPU per run with the writer thread", cpu))
        rows.append(row("  PostgreSQL CPU per run with", fmt(w["postgres_cpu_ms_per_task"], " ms", 2)))
        done = ", ".join(str(v) for v in tr["runs_completed_with"])
        rows.append(row("  runs recorded completed (with)", done, f"{tr['tasks']:,} each"))
    rows += e2e_table(results.get("4_e2e"))
    return rows


def e2e_table(e: dict[str, Any] | None) -> list[Row]:
    if not e:
        return []
    lat = e["latency_s"]
    cpu = e["cpu"]
    grid = e["grid"]
    return [
        row(
            f"4 e2e, {e['schedules']} x 1 s no-overlap, {e['task_s']:g} s task: due-to-start p50 / p99",
            f"{ms(lat['p50'])} / {ms(lat['p99'])}",
        ),
        row(
            "  runs started/s",
            fmt(e["runs_started_per_s"], "/s", 1),
            f"capacity {e['capacity_runs_per_s']:.0f}/s ({e['threads']} threads), due {e['schedules']}/s",
        ),
        row(
            "  runs never terminal (of runs due in window)",
            f"{e['runs_never_terminal']} of {e['runs_in_window']}",
            "0",
        ),
        row("  runs settled lost", str(e["runs_lost_state"]), "0"),
        row(
            "  grid ticks missing (neither run nor skipped)",
            f"{grid['missing']} of {grid['grid_ticks']:,}",
            "0",
        ),
        row(
            "  CPU beat / worker / PostgreSQL",
            f"{cpu['beat_pct']:.0f} / {cpu['worker_pct']:.0f} / {cpu['postgres_pct']:.0f} % core",
        ),
    ]


def table(results: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for case in results.get("1_emission", {}).values():
        if isinstance(case, dict) and "ours" in case:
            rows += emission_rows(case)
    return rows + other_rows(results)


# -- main ----------------------------------------------------------------------------------------

SCENARIOS: dict[str, tuple[str, Callable[[Context], dict[str, Any]]]] = {
    "1": ("1_emission", scenario_emission),
    "2": ("2_idle", scenario_idle),
    "3": ("3_tracking", scenario_tracking),
    "4": ("4_e2e", scenario_e2e),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, fewer tasks: a self-check")
    parser.add_argument(
        "--broker", default="redis,rabbitmq", help="brokers for scenario 1 (the first for 2-4)"
    )
    parser.add_argument("--seconds", type=float, default=None, help="each measured window (default 60)")
    parser.add_argument("--only", default="1,2,3,4", help="scenarios to run, e.g. 1,3")
    parser.add_argument("--json", default=None, help="where to write the results (default: a temp file)")
    args = parser.parse_args()
    unknown = [b for b in args.broker.split(",") if b not in BROKERS]
    if unknown:
        parser.error(f"unknown broker(s) {', '.join(unknown)}; choose from {', '.join(BROKERS)}")
    return args


def describe(m: dict[str, Any]) -> None:
    print(
        f"machine: {m['cores']} cores ({m['cpu']}), {m['memory_gb']} GB, Python {m['python']}, "
        f"PostgreSQL {m['postgresql']}, Celery {m['celery']}, SQLAlchemy {m['sqlalchemy']}, "
        + ", ".join(f"{k} {v}" for k, v in m["brokers"].items())
        + f"; commit {m['commit']}; load average {m['loadavg_at_start'][0]:.2f}"
    )
    if m["package_files_changed_in_tree"]:
        print("  package files changed in the working tree: " + ", ".join(m["package_files_changed_in_tree"]))


def main() -> None:
    args = parse_args()
    sizes = QUICK if args.quick else Sizes()
    if args.seconds:
        sizes = dataclasses.replace(
            sizes, seconds=args.seconds, idle_window=args.seconds, e2e_window=args.seconds
        )
    brokers = args.broker.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="bb_emit_"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = (
        Path(args.json) if args.json else Path(tempfile.gettempdir()) / f"boundedbeat-emission-{stamp}.json"
    )
    versions = check_services(brokers)
    with admin_connection() as admin:
        ctx = Context(sizes=sizes, admin=admin, tmp=tmp, brokers=brokers)
        results: dict[str, Any] = {"machine": {**machine(admin), "brokers": versions}}
        results.update(sizes=dataclasses.asdict(sizes), quick=args.quick, brokers=brokers)
        describe(results["machine"])
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
    report(results, json_path)


def report(results: dict[str, Any], json_path: Path) -> None:
    print()
    print("ratio: measured / target (or / baseline); drift = arrival at the broker's consumer - due time")
    print_table(table(results))
    print("\nload on the machine during each window (percent of one core; 2 cores = 200 %):")
    print("\n".join(load_notes(results)))
    problems = []
    stack: list[tuple[str, Any]] = [(k, v) for k, v in results.items() if isinstance(v, dict)]
    while stack:
        path, node = stack.pop()
        problems += [(path, p) for p in node.get("problems", [])]
        stack += [(f"{path}.{k}", v) for k, v in node.items() if isinstance(v, dict)]
    if problems:
        print("\nprocesses logged errors:")
        for path, p in problems[:20]:
            print(f"  {path}: {p}")
    print(f"\nresults: {json_path}")


if __name__ == "__main__":
    main()
