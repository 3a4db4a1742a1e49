"""A prepared tick's publish cut short by a stop, or its record by a database blip: each run once.

Celery's beat stops on SIGTERM with a handler that calls ``Scheduler.close()`` wherever the
beat thread is, then raises SystemExit there. These tests cut a real prepared publish the same
way at several points (a patched producer write, the mark's SQL, the commit), never replacing
the publish itself, and count the messages in the broker (kombu's in-memory transport) per run.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.apps.beat import Beat
from kombu.messaging import Producer
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

import celery_boundedbeat.beat.ahead as ahead_module
import celery_boundedbeat.db.store as store_module
from celery_boundedbeat.beat.prepared import PreparedTick
from celery_boundedbeat.beat.scheduler import Scheduler
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.store import utcnow

pytestmark = pytest.mark.postgres

RUNS = 6
GRACE = 8.0


def _scheduler(url: str, **conf: object) -> Scheduler:
    """A beat with ``RUNS`` schedules all due at its first look, which it publishes as a prepared
    tick; its dispatcher loop is stopped, so only the tick and the last drain publish."""
    free = {"mode": "fixed_rate", "max_concurrency": 10}
    app = Celery("interrupted", broker="memory://", set_as_current=False)
    app.conf.update(
        boundedbeat_database_url=url,
        boundedbeat_auto_migrate=True,
        boundedbeat_prepare_ahead=0.5,
        boundedbeat_shutdown_grace=GRACE,
        task_default_queue=f"q{uuid.uuid4().hex[:8]}",
        beat_schedule={
            f"s{i}": {"task": f"proj.s{i}", "schedule": 60.0, "options": {"policy": free}}
            for i in range(RUNS)
        },
        **conf,
    )
    scheduler = Scheduler(app, max_interval=0.01)
    assert scheduler._dispatch_loop is not None and scheduler._dispatch_loop.stop(grace=10)
    dispatcher = scheduler._dispatcher
    assert dispatcher is not None
    drain = dispatcher.drain

    def last_drain(*args: Any, **kwargs: Any) -> Any:
        OPEN_DURING_DRAIN[scheduler] = open_transactions(scheduler)
        return drain(*args, **kwargs)

    dispatcher.drain = last_drain  # type: ignore[method-assign]
    return scheduler


#: Transactions left open (idle, their row locks held) when a beat's last drain started.
OPEN_DURING_DRAIN: dict[Scheduler, int] = {}


def open_transactions(scheduler: Scheduler) -> int:
    """Open transactions that wrote schedules, runs or queue rows: the locks a drain waits on.

    Only writers count (a transaction id and a lock on one of those tables): the beat's other
    loops run short transactions of their own (the retention pass, five seconds after start,
    reads and deletes nothing here; the iteration records lock only their own table), and one
    caught between two statements is no lock the drain could wait on.
    """
    with scheduler.store.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(DISTINCT a.pid) FROM pg_stat_activity a "
                    "JOIN pg_locks l ON l.pid = a.pid JOIN pg_class c ON c.oid = l.relation "
                    "WHERE a.datname = current_database() AND a.state LIKE 'idle in transaction%' "
                    "AND a.backend_xid IS NOT NULL AND l.granted "
                    "AND c.relname IN ('boundedbeat_schedules', 'boundedbeat_runs', 'boundedbeat_queue')"
                )
            ).scalar_one()
        )


def messages(scheduler: Scheduler) -> Counter[str]:
    """Messages per task id (= run id) waiting in the broker."""
    app = scheduler.app
    counts: Counter[str] = Counter()
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(app.conf.task_default_queue, no_ack=True)) is not None:
            counts[message.headers["id"]] += 1
    return counts


def claimed_rows(scheduler: Scheduler) -> int:
    with scheduler.store.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM boundedbeat_queue")).scalar_one())


def sigterm_handler(scheduler: Scheduler) -> Callable[[], None]:
    """What Celery's beat SIGTERM handler does (``Beat.install_sync_handler``), called in place."""
    service = SimpleNamespace(sync=scheduler.close)

    def handler() -> None:
        service.sync()
        raise SystemExit()

    return handler


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Callable[[int], None]]]:
    """Hooks called with the count of broker writes so far, after each write of a message."""
    hooks: list[Callable[[int], None]] = []
    original = Producer._publish
    count = 0

    def publish(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal count
        result = original(self, *args, **kwargs)
        count += 1
        for hook in hooks:
            hook(count)
        return result

    monkeypatch.setattr(Producer, "_publish", publish)
    yield hooks


def check_once(scheduler: Scheduler, stopped_at: float) -> None:
    """Every run committed was published exactly once; none was left claimed; the stop was prompt."""
    took = time.monotonic() - stopped_at
    runs = scheduler.store.runs(limit=50)
    counts = messages(scheduler)
    assert len(runs) == RUNS
    assert {r.id: counts[r.id] for r in runs} == {r.id: 1 for r in runs}, counts
    assert all(r.state == RunState.PUBLISHED for r in runs), [(r.schedule, r.state) for r in runs]
    assert claimed_rows(scheduler) == 0, "rows left claimed until the claim expires"
    assert OPEN_DURING_DRAIN.pop(scheduler) == 0, "the last drain ran with a transaction of the beat open"
    # The stop never waited on a lock of its own open transaction (that took the whole grace).
    assert took < GRACE / 2, f"the stop took {took:.1f} s"


def run_until_stopped(scheduler: Scheduler) -> float:
    started = time.monotonic()
    try:
        with pytest.raises(SystemExit):
            scheduler.tick()  # the first look publishes every due run as a prepared tick
    finally:
        scheduler.close()  # as Celery's beat does after SystemExit
    return started


@pytest.mark.parametrize("after", [1, 3, RUNS])
def test_close_in_the_middle_of_a_prepared_publish_publishes_each_run_once(
    postgres_url: str, writes: list[Callable[[int], None]], after: int
) -> None:
    """The handler runs after ``after`` of the tick's messages were written.

    ``close()`` used to give back every row of the tick, written or not, and its last drain
    published them again: 6 runs gave 8 messages.
    """
    scheduler = _scheduler(postgres_url)
    interrupt = sigterm_handler(scheduler)
    writes.append(lambda n: interrupt() if n == after else None)
    check_once(scheduler, run_until_stopped(scheduler))


def test_close_inside_the_mark_of_a_prepared_publish_publishes_each_run_once(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler runs inside ``mark_published``, its transaction open and its rows locked.

    The last drain used to wait the whole grace on those locks, then publish the tick again.
    """
    scheduler = _scheduler(postgres_url)
    interrupt = sigterm_handler(scheduler)
    original = store_module.mark
    calls = 0

    def mark(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        original(*args, **kwargs)
        if calls == 1:
            interrupt()

    monkeypatch.setattr(store_module, "mark", mark)
    check_once(scheduler, run_until_stopped(scheduler))


def test_close_between_the_commit_and_the_publish_leaves_no_row_claimed(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler runs right after the prepared commit: every row goes back and is published
    by the last drain, none waits out its claim."""
    scheduler = _scheduler(postgres_url)
    interrupt = sigterm_handler(scheduler)
    original = PreparedTick.commit

    def commit(self: PreparedTick) -> None:
        original(self)
        interrupt()

    monkeypatch.setattr(PreparedTick, "commit", commit)
    check_once(scheduler, run_until_stopped(scheduler))


def test_close_during_the_lead_drops_the_tick_with_its_transaction(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler runs while the prepared tick waits for its due time, its transaction open
    with the schedules locked: the tick is dropped and rolled back before the last drain runs."""
    scheduler = _scheduler(postgres_url)
    interrupt = sigterm_handler(scheduler)
    monkeypatch.setattr(ahead_module, "sleep_until", lambda *args, **kwargs: interrupt())
    stopped_at = run_until_stopped(scheduler)
    assert time.monotonic() - stopped_at < GRACE / 2
    assert OPEN_DURING_DRAIN.pop(scheduler) == 0, "the last drain ran with the preparation open"
    assert scheduler.store.runs(limit=50) == [] and claimed_rows(scheduler) == 0 and not messages(scheduler)


def test_a_real_sigterm_during_a_prepared_publish_waits_for_its_record(
    postgres_url: str, writes: list[Callable[[int], None]]
) -> None:
    """SIGTERM delivered by the kernel with Celery's own handler installed, after 2 writes: the
    publish ends and is recorded, then the handler runs (``close()``, SystemExit)."""
    scheduler = _scheduler(postgres_url)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    Beat.install_sync_handler(Any, SimpleNamespace(sync=scheduler.close))  # type: ignore[arg-type]
    writes.append(lambda n: signal.raise_signal(signal.SIGTERM) if n == 2 else None)
    try:
        stopped_at = run_until_stopped(scheduler)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    check_once(scheduler, stopped_at)


def test_a_mark_that_fails_once_is_retried_and_nothing_is_published_twice(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One transient error recording a prepared tick (a PostgreSQL restart, a pooler reset).

    It used to leave the whole tick claimed, and whoever took the rows over when the claim
    expired published every one again. The claim's expiry is brought forward here.
    """
    scheduler = _scheduler(postgres_url)
    original = store_module.mark
    calls = 0

    def mark(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OperationalError("UPDATE boundedbeat_runs", {}, Exception("server closed the connection"))
        original(*args, **kwargs)

    monkeypatch.setattr(store_module, "mark", mark)
    try:
        scheduler.tick()
        with scheduler.store.engine.begin() as conn:  # every claim has expired
            conn.execute(text("UPDATE boundedbeat_queue SET claimed_until = now() - interval '1 second'"))
        assert scheduler._dispatcher is not None
        scheduler._dispatcher.drain()  # another dispatcher's turn after the claim
        runs = scheduler.store.runs(limit=50)
        counts = messages(scheduler)
        assert len(runs) == RUNS
        assert {r.id: counts[r.id] for r in runs} == {r.id: 1 for r in runs}, counts
        assert all(r.state == RunState.PUBLISHED for r in runs)
    finally:
        scheduler.close()


def test_a_late_commit_leaves_the_publish_less_time_never_past_its_claim(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim runs from the due time: a commit 3 s after it has 3 s less to publish.

    The deadline used to be counted from the commit, so a late commit (a tick found late, a
    long preparation) could publish after its claim had expired and another dispatcher took it.
    """
    scheduler = _scheduler(postgres_url, boundedbeat_dispatch_claim_timeout=10.0)
    ahead = scheduler._ahead
    assert ahead is not None
    seen: list[float] = []
    publish = ahead._publisher.publish

    def spy(*args: Any, deadline: float, **kwargs: Any) -> Any:
        seen.append(deadline - time.monotonic())
        return publish(*args, deadline=deadline, **kwargs)

    monkeypatch.setattr(ahead._publisher, "publish", spy)
    try:
        assert scheduler._keep_lease() and scheduler._reconcile()
        due = utcnow()
        monkeypatch.setattr(ahead_module, "utcnow", lambda: due + timedelta(seconds=3))  # committed 3 s late
        prepared, failed = ahead.run(due)
        assert prepared is not None and not failed
        # 10 s claim from ``due``, less its 1 s margin, less the 3 s already gone.
        assert len(seen) == 1 and seen[0] <= 6.0, seen
    finally:
        scheduler.close()
