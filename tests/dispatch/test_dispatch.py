"""The DB-backed queue and its dispatcher against real PostgreSQL and real brokers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kombu import Connection, Exchange, Queue
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

import celery_boundedbeat
from celery_boundedbeat.db.tables import QueueRow

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

RABBIT = "amqp://guest:guest@127.0.0.1:5672//"
VENV_BIN = Path(sys.executable).parent


def _write_app(tmp_path: Path, module: str, broker: str, db_url: str, queue: str, extra: str = "") -> None:
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            import celery_boundedbeat

            app = Celery({module!r}, broker={broker!r})
            app.conf.task_default_queue = {queue!r}
            app.conf.boundedbeat_database_url = {db_url!r}
            app.conf.boundedbeat_dispatch_interval = 0.2
            app.conf.boundedbeat_dispatch_max_interval = 0.5
            app.conf.boundedbeat_dispatch_batch_size = 100
            {extra}
            celery_boundedbeat.install(app)
            """
        )
    )


def _start_dispatcher(tmp_path: Path, module: str, log: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    out = open(tmp_path / log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [str(VENV_BIN / "celery"), "-A", module, "boundedbeat", "dispatch"],
        cwd=tmp_path,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
            return -9
    return proc.returncode


def _enqueue_many(engine: Engine, n: int, task: str = "tests.noop") -> list[str]:
    ids: list[str] = []
    with engine.begin() as conn:
        for i in range(n):
            ids.append(celery_boundedbeat.enqueue(conn, task, args=(i,)))
    return ids


def _queue_depth(engine: Engine) -> int:
    with Session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(QueueRow)) or 0)


def _wait(predicate, timeout: float, what: str, logs: list[Path] = ()) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}\n{tails}")


def _drain_broker(url: str, queue: str, expect: int, timeout: float = 30) -> list[str]:
    """Consume every message of ``queue``; returns the task ids in arrival order."""
    ids: list[str] = []
    deadline = time.monotonic() + timeout
    with Connection(url) as conn:
        q = Queue(queue, Exchange(queue, type="direct"), routing_key=queue)
        simple = conn.SimpleQueue(q)
        try:
            while len(ids) < expect and time.monotonic() < deadline:
                try:
                    message = simple.get(timeout=1)
                except simple.Empty:
                    continue
                ids.append(message.headers["id"])
                message.ack()
            # Anything beyond ``expect`` would be a duplicate: look briefly for it.
            while True:
                try:
                    message = simple.get(timeout=1)
                except simple.Empty:
                    break
                ids.append(message.headers["id"])
                message.ack()
        finally:
            simple.close()
    return ids


@pytest.mark.timeout(120)
def test_two_dispatchers_publish_every_row_exactly_once(
    tmp_path: Path, pg_url: str, pg_engine: Engine, queue_name: str
) -> None:
    """Two standalone dispatchers draining one PostgreSQL queue publish each row once and all rows."""
    _write_app(tmp_path, "twodisp", RABBIT, pg_url, queue_name)
    ids = _enqueue_many(pg_engine, 3000)
    first = _start_dispatcher(tmp_path, "twodisp", "d1.log")
    second = _start_dispatcher(tmp_path, "twodisp", "d2.log")
    try:
        _wait(
            lambda: _queue_depth(pg_engine) == 0,
            90,
            "the queue to drain",
            [tmp_path / "d1.log", tmp_path / "d2.log"],
        )
    finally:
        codes = (_stop(first), _stop(second))
    assert codes == (0, 0), (tmp_path / "d1.log").read_text()[-2000:]
    published = _drain_broker(RABBIT, queue_name, expect=len(ids))
    assert len(published) == len(ids), f"{len(published)} messages for {len(ids)} rows"
    assert sorted(published) == sorted(ids), "a row was published twice or not at all"
    counts = [
        int(line.rsplit(" ", 2)[-2])
        for name in ("d1.log", "d2.log")
        for line in (tmp_path / name).read_text().splitlines()
        if "published" in line and "message(s)" in line
    ]
    assert sum(counts) == len(ids)
    assert all(c > 0 for c in counts), f"both dispatchers should take part: {counts}"


@pytest.mark.timeout(60)
def test_a_rolled_back_enqueue_is_never_published(
    tmp_path: Path, pg_url: str, pg_engine: Engine, queue_name: str
) -> None:
    """enqueue() is a transactional outbox: a rollback leaves nothing to publish, a commit publishes."""
    _write_app(tmp_path, "outbox", RABBIT, pg_url, queue_name)
    with pg_engine.connect() as conn:
        trans = conn.begin()
        doomed = celery_boundedbeat.enqueue(conn, "tests.noop", args=("rolled back",))
        trans.rollback()
    with Session(pg_engine) as session, session.begin():
        kept = celery_boundedbeat.enqueue(session, "tests.noop", kwargs={"kept": True})
    assert _queue_depth(pg_engine) == 1
    proc = _start_dispatcher(tmp_path, "outbox", "d.log")
    try:
        _wait(lambda: _queue_depth(pg_engine) == 0, 30, "the committed row to publish", [tmp_path / "d.log"])
    finally:
        assert _stop(proc) == 0
    assert _drain_broker(RABBIT, queue_name, expect=1) == [kept]
    assert doomed != kept


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis(port: int, tmp_path: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail(f"redis-server did not start on port {port}")


@pytest.mark.timeout(90)
def test_an_idle_dispatcher_is_woken_by_the_commit_of_an_enqueue(
    tmp_path: Path, pg_url: str, pg_engine: Engine, queue_name: str
) -> None:
    """The wake-up sent after the caller's commit reaches a dispatcher that would sleep a minute.

    enqueue() sends no NOTIFY in the caller's transaction; its process sends one after the
    commit. With a 60 s idle interval only that notification can bring a row out in seconds.
    """
    slow = "app.conf.boundedbeat_dispatch_interval = app.conf.boundedbeat_dispatch_max_interval = 60.0"
    _write_app(tmp_path, "woken", RABBIT, pg_url, queue_name, extra=slow)
    proc = _start_dispatcher(tmp_path, "woken", "d.log")
    try:
        # Its listener looks once when it starts listening: a first row shows it is past that.
        _enqueue_many(pg_engine, 1)
        _wait(lambda: _queue_depth(pg_engine) == 0, 30, "the first row to publish", [tmp_path / "d.log"])
        for what in ("a Connection's commit", "a Session's commit"):
            committed = time.monotonic()
            if what.startswith("a Connection"):
                _enqueue_many(pg_engine, 1)
            else:
                with Session(pg_engine) as session, session.begin():
                    celery_boundedbeat.enqueue(session, "tests.noop")
            _wait(lambda: _queue_depth(pg_engine) == 0, 20, f"the row of {what}", [tmp_path / "d.log"])
            assert time.monotonic() - committed < 20
    finally:
        assert _stop(proc) == 0
    assert len(_drain_broker(RABBIT, queue_name, expect=3)) == 3


@pytest.mark.timeout(120)
def test_a_broker_outage_loses_nothing_and_is_logged_once(
    tmp_path: Path, pg_url: str, pg_engine: Engine, queue_name: str
) -> None:
    """With the broker down, rows wait in the queue, the outage is logged once, and all publish on return."""
    port = _free_port()
    broker = f"redis://127.0.0.1:{port}/0"
    redis = _start_redis(port, tmp_path)
    _write_app(tmp_path, "outage", broker, pg_url, queue_name)
    proc = _start_dispatcher(tmp_path, "outage", "d.log")
    log = tmp_path / "d.log"
    try:
        before = _enqueue_many(pg_engine, 50)
        _wait(lambda: _queue_depth(pg_engine) == 0, 30, "the first rows to publish", [log])
        redis.terminate()
        redis.wait(10)
        during = _enqueue_many(pg_engine, 200)
        time.sleep(6)  # several backoff cycles against a dead broker
        assert _queue_depth(pg_engine) == len(during), "nothing may leave the queue while the broker is down"
        assert proc.poll() is None, "the dispatcher must survive the outage"
        redis = _start_redis(port, tmp_path)
        _wait(lambda: _queue_depth(pg_engine) == 0, 40, "the queued rows to publish after the outage", [log])
        with Connection(broker) as conn:
            raw = conn.default_channel.client.lrange(queue_name, 0, -1)
    finally:
        code = _stop(proc)
        redis.terminate()
        redis.wait(10)
    text_log = log.read_text()
    assert code == 0, text_log[-2000:]
    assert text_log.count("cannot publish to broker") == 1, text_log[-3000:]
    assert "is back" in text_log
    assert f":{port}" in text_log
    # Redis was restarted empty, so it holds exactly the rows queued during the outage.
    ids = [json.loads(m)["headers"]["id"] for m in raw]
    assert sorted(ids) == sorted(during)
    # kombu's Redis transport LPUSHes, so the list holds the newest first: published in due order.
    assert list(reversed(ids)) == during
    assert not set(ids) & set(before)


@pytest.mark.timeout(60)
def test_unpublishable_runs_settle_rejected_after_the_publish_timeout(
    tmp_path: Path, pg_url: str, pg_engine: Engine, queue_name: str
) -> None:
    """A queued run that cannot be published within boundedbeat_publish_timeout settles as rejected."""
    import random
    from datetime import UTC, datetime, timedelta

    from celery import Celery

    from celery_boundedbeat.config.settings import Settings
    from celery_boundedbeat.core.policy import Policy
    from celery_boundedbeat.core.spec import EntrySpec
    from celery_boundedbeat.core.timing import IntervalTiming
    from celery_boundedbeat.db.store import Store
    from celery_boundedbeat.dispatch.dispatcher import Dispatcher

    store = Store(pg_engine)
    spec = EntrySpec(
        name="s",
        task="tests.noop",
        policy=Policy(),
        timing=IntervalTiming(60.0),
        schedule_repr="every 60s",
        period=60.0,
    )
    past = datetime.now(UTC) - timedelta(seconds=30)
    store.sync_config([spec], past, random.Random(1))
    result = store.tick({"s": spec}, past, random.Random(1), 10)
    assert len(result.emitted) == 1
    app = Celery("dead", broker=f"redis://127.0.0.1:{_free_port()}/0", set_as_current=False)
    settings = Settings(database_url=pg_url, publish_timeout=5.0)
    outcome = Dispatcher(app, store, settings).drain()
    assert not outcome.failed, "rows past the limit are rejected before any publish is attempted"
    run = store.run(result.emitted[0].id)
    assert run is not None and run.state == "rejected"
    assert "publish_timeout" in (run.error or "")
    assert _queue_depth(pg_engine) == 0
    row = store.schedules(["s"])[0]
    assert (row.failures, row.active_runs) == (1, 0)


@pytest.mark.timeout(60)
def test_dispatch_command_stops_gracefully_on_sigterm(tmp_path: Path, pg_url: str, queue_name: str) -> None:
    """`boundedbeat dispatch` exits 0 soon after SIGTERM."""
    _write_app(tmp_path, "graceful", RABBIT, pg_url, queue_name)
    proc = _start_dispatcher(tmp_path, "graceful", "d.log")
    log = tmp_path / "d.log"
    _wait(lambda: "draining" in log.read_text(), 30, "the dispatcher to start", [log])
    assert proc.poll() is None, log.read_text()
    started = time.monotonic()
    assert _stop(proc) == 0
    assert time.monotonic() - started < 10
    assert "stopped" in (tmp_path / "d.log").read_text()
