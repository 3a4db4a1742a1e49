"""Runs waiting published for a worker cost the reaper one probe per pass, not a reap.

The beat's reaper passes are driven by hand with a fake clock (``_housekeep(mono, now)``): a
minute of passes with 100 runs waiting, then the moments their guarantees fall due.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, event

from celery_boundedbeat.beat.scheduler import Scheduler
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.store import Store, utcnow

WAITING = 100
START_TIMEOUT = 120.0
HEARTBEAT = 3.0


def _app(url: str) -> Celery:
    app = Celery("reapertest", broker="memory://", set_as_current=False)
    entries = {
        f"s{i:03d}": {"task": "proj.work", "schedule": 3600.0, "options": {"policy": {"initial_delay": 0}}}
        for i in range(WAITING)
    }
    app.conf.update(
        boundedbeat_database_url=url,
        boundedbeat_dispatch_enabled=False,
        boundedbeat_start_timeout=START_TIMEOUT,
        boundedbeat_heartbeat_interval=HEARTBEAT,
        beat_schedule=entries,
    )
    return app


@contextmanager
def counted(engine: Engine) -> Iterator[list[str]]:
    """Statements this thread sends through ``engine`` meanwhile (other threads' are not counted)."""
    me = threading.get_ident()
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.get_ident() == me:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before)


@pytest.fixture
def waiting(db_url: str, migrated: Engine) -> Iterator[tuple[Scheduler, datetime]]:
    """A beat whose 100 schedules each have a run published at the returned time, no worker."""
    scheduler = Scheduler(_app(db_url))
    try:
        store = scheduler.store
        scheduler.tick()
        published = utcnow()
        rows = store.claim_batch("d", published, 1000, claim_timeout=60)
        store.mark_published("d", rows, published)
        assert states(store) == {RunState.PUBLISHED.value: WAITING}
        yield scheduler, published
    finally:
        scheduler.close()


def states(store: Store) -> dict[str, int]:
    found: dict[str, int] = {}
    for run in store.runs(limit=10 * WAITING):
        found[run.state] = found.get(run.state, 0) + 1
    return found


def passes(scheduler: Scheduler, start: datetime, seconds: range) -> None:
    """One reaper pass at each of ``seconds`` after ``start`` (the reaper's cadence is 1 s here)."""
    for s in seconds:
        scheduler._housekeep(10_000.0 + s, start + timedelta(seconds=s))


def test_a_minute_with_100_runs_waiting_for_a_worker_is_one_probe_a_pass(
    waiting: tuple[Scheduler, datetime],
) -> None:
    """Before, every pass (each second) read the active runs and ran the reaper's three reads
    over them: four statements a pass, 240 a minute. No waiting run can be lost or time out
    (none started) nor be rejected before its start timeout: the pass is one probe."""
    scheduler, published = waiting
    passes(scheduler, published, range(0, 2))  # the first pass looks once at everything
    with counted(scheduler.store.engine) as seen:
        passes(scheduler, published, range(2, 62))
    # The reaper's reads (alerts are polled apart on SQLite, which has no notifications).
    reaper = [s for s in seen if "boundedbeat_runs" in s]
    assert len(reaper) == 60, " | ".join(s[:40] for s in reaper[:8])
    assert all(s.lstrip().startswith("SELECT EXISTS") for s in reaper), reaper[:4]
    assert states(scheduler.store) == {RunState.PUBLISHED.value: WAITING}

    # The start timeout still rejects each of them on time: the first pass past it.
    passes(scheduler, published, range(62, int(START_TIMEOUT)))
    assert states(scheduler.store) == {RunState.PUBLISHED.value: WAITING}
    passes(scheduler, published, range(int(START_TIMEOUT) + 1, int(START_TIMEOUT) + 2))
    assert states(scheduler.store) == {RunState.REJECTED.value: WAITING}


def test_a_run_that_starts_among_them_is_still_settled_lost_on_time(
    waiting: tuple[Scheduler, datetime],
) -> None:
    """The probe sees a started run at the next pass; its dead worker's run settles ``lost``
    at the first pass three heartbeat intervals after its start, as before."""
    scheduler, published = waiting
    store = scheduler.store
    passes(scheduler, published, range(0, 10))
    run = store.runs(limit=1)[0]
    started_at = published + timedelta(seconds=10)
    begun = store.run_life.begin_run(run.id, worker="w", process="gone:1", now=started_at, max_run_time=None)
    assert begun.first
    lost_after = 10 + int(3 * HEARTBEAT)
    passes(scheduler, published, range(10, lost_after + 1))
    assert store.run(run.id).state == RunState.STARTED.value  # type: ignore[union-attr]
    passes(scheduler, published, range(lost_after + 1, lost_after + 2))
    assert store.run(run.id).state == RunState.LOST.value  # type: ignore[union-attr]
    assert states(store) == {RunState.PUBLISHED.value: WAITING - 1, RunState.LOST.value: 1}
