"""Signals twice, late or out of order; outcomes kept through an outage; recorded loop iterations.

These run in-process against real databases (SQLite and PostgreSQL); the process-level
versions of the same faults are in the other modules of this package.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
from typing import Any

import pytest
from celery import Celery
from helpers.clock import T0, sec
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from celery_boundedbeat.beat.scheduler import Scheduler
from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.config.settings import Settings
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.engine import dispose_all, get_engine
from celery_boundedbeat.db.runs import LATE_OUTCOME
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.worker.tracking import Tracker

from .support import free_port

RNG = random.Random(7)


@pytest.fixture
def store(migrated: Engine) -> Store:
    return Store(migrated)


def emit(store: Store, name: str = "a") -> str:
    spec, problems = parse_entry(name, {"task": f"proj.{name}", "schedule": 10}, {})
    assert spec is not None, problems
    store.sync_config([spec], T0, RNG)
    result = store.tick({name: spec}, T0, RNG, 10)
    assert len(result.emitted) == 1
    return result.emitted[0].id


def counters(store: Store, name: str = "a") -> tuple[int, int, int]:
    row = store.schedules([name])[0]
    return row.runs, row.failures, row.active_runs


def test_a_late_success_after_lost_is_noted_but_not_counted(store: Store) -> None:
    """A success reported after the reaper settled the run lost counts nothing and is noted once."""
    run_id = emit(store)
    store.run_life.start_run(run_id, worker="w", process="h:1", now=T0 + sec(1), max_run_time=None)
    assert store.run_life.settle_run(
        run_id, RunState.LOST, now=T0 + sec(12), error="worker heartbeat stopped"
    )
    assert counters(store) == (0, 1, 0)

    assert store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(20), late=True) is None
    assert store.run_life.settle_run(run_id, RunState.FAILED, now=T0 + sec(21), error="x", late=True) is None
    run = store.run(run_id)
    assert run is not None
    assert (run.state, run.finished_at, run.elapsed_ms) == ("lost", T0 + sec(12), 11000)
    assert run.error is not None and run.error.startswith("worker heartbeat stopped; " + LATE_OUTCOME)
    assert run.error.endswith(": completed") and run.error.count(LATE_OUTCOME) == 1
    assert counters(store) == (0, 1, 0)


def test_duplicates_of_a_task_outcome_are_no_ops_and_leave_no_note(store: Store) -> None:
    """The task's own outcome settled first: repeats and contradicting later reports change nothing."""
    run_id = emit(store)
    store.run_life.start_run(run_id, worker="w", process="h:1", now=T0 + sec(1), max_run_time=None)
    assert store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(2), late=True)
    assert store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(2), late=True) is None
    assert store.run_life.settle_run(run_id, RunState.FAILED, now=T0 + sec(3), error="dup", late=True) is None
    assert store.run_life.settle_run(run_id, RunState.LOST, now=T0 + sec(30)) is None  # the reaper, late
    run = store.run(run_id)
    assert run is not None and (run.state, run.error) == ("completed", None)
    assert counters(store) == (1, 0, 0)


def test_an_outcome_before_its_start_settles_once_and_the_late_start_is_ignored(store: Store) -> None:
    """Out of order: an outcome before its start settles the run; the late start changes nothing."""
    run_id = emit(store)
    assert store.run_life.settle_run(
        run_id, RunState.FAILED, now=T0 + sec(2), error="ValueError: x", late=True
    )
    assert (
        store.run_life.start_run(run_id, worker="w", process="h:1", now=T0 + sec(1), max_run_time=None)
        is False
    )
    run = store.run(run_id)
    assert run is not None and (run.state, run.started_at) == ("failed", None)
    assert counters(store) == (0, 1, 0)


def test_racing_reports_of_one_run_settle_it_once(store: Store) -> None:
    """The reaper and several duplicate worker reports racing: one wins, the counters move once."""
    run_id = emit(store)
    store.run_life.start_run(run_id, worker="w", process="h:1", now=T0 + sec(1), max_run_time=None)
    results: list[Any] = []
    barrier = threading.Barrier(6)

    def report(state: RunState, late: bool) -> None:
        barrier.wait()
        results.append(store.run_life.settle_run(run_id, state, now=T0 + sec(5), late=late))

    threads = [threading.Thread(target=report, args=(RunState.COMPLETED, True)) for _ in range(3)]
    threads += [threading.Thread(target=report, args=(RunState.LOST, False)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len([r for r in results if r is not None]) == 1
    runs, failures, active = counters(store)
    assert runs + failures == 1 and active == 0


def _app(url: str, name: str) -> Celery:
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.update(boundedbeat_database_url=url, timezone="UTC")
    return app


@pytest.mark.postgres
def test_a_worker_keeps_starts_and_outcomes_through_an_outage_and_writes_them_in_order(
    migrated_postgres_url: str,
) -> None:
    """Writes that fail are kept in order and land, with their own times, once the database answers."""
    engine = get_engine(migrated_postgres_url)
    store = Store(engine)
    run_id = emit(store)
    tracker = Tracker(_app(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere", "bbf_keep"))
    try:
        tracker.started(run_id, "w@host", None)
        tracker.settle(run_id, RunState.COMPLETED)
        tracker.settle(run_id, RunState.COMPLETED)  # a duplicate signal: nothing more is kept
        assert [type(item).__name__ for item in tracker._queue] == ["_PendingStart", "_PendingSettle"]
        assert store.run(run_id).state == "queued"  # type: ignore[union-attr]
        tracker._settings = Settings(database_url=migrated_postgres_url)  # the database is back
        assert tracker.flush() is True
        run = store.run(run_id)
        assert run is not None and run.state == "completed"
        assert (
            run.started_at is not None and run.finished_at is not None and run.started_at <= run.finished_at
        )
        assert counters(store) == (1, 0, 0)
        assert tracker.flush() is True and not tracker._queue
    finally:
        tracker.stop()
        dispose_all()


@pytest.mark.postgres
def test_failed_beat_iterations_are_logged_once_recorded_and_survived(
    postgres_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing tick, drain and lease renewal are logged (traceback once), recorded, and survived."""
    app = _app(postgres_url, "bbf_iter")
    app.conf.update(
        boundedbeat_auto_migrate=True,
        beat_schedule={"x": {"task": "proj.x", "schedule": 1.0}},
        boundedbeat_dispatch_interval=0.2,
    )
    scheduler = Scheduler(app)
    try:
        store = scheduler.store
        calls = {"tick": 0, "drain": 0, "lease": 0}
        real_tick, real_reject, real_lease = store.tick, store.drop_stale, store.acquire_lease

        def tick(*args: Any, **kwargs: Any) -> Any:
            calls["tick"] += 1
            if calls["tick"] <= 3:
                raise RuntimeError("tick bug")
            return real_tick(*args, **kwargs)

        def reject(*args: Any, **kwargs: Any) -> Any:
            calls["drain"] += 1
            if calls["drain"] == 1:
                raise RuntimeError("drain bug")
            return real_reject(*args, **kwargs)

        def lease(*args: Any, **kwargs: Any) -> Any:
            calls["lease"] += 1
            if calls["lease"] in (2, 3):
                raise OperationalError("SELECT 1", {}, ConnectionRefusedError("refused"))
            return real_lease(*args, **kwargs)

        monkeypatch.setattr(store, "tick", tick)
        monkeypatch.setattr(store, "drop_stale", reject)
        monkeypatch.setattr(store, "acquire_lease", lease)
        monkeypatch.setattr(scheduler.lease, "next_renewal_at", 0.0)
        seconds = itertools.count(0.0, 5.0)  # each look 5 s later: an outage, not a blip
        monkeypatch.setattr(scheduler._recorder, "_clock", lambda: next(seconds))
        with caplog.at_level(logging.INFO, logger="celery_boundedbeat"):
            for _ in range(12):
                scheduler.tick()
                scheduler.lease.next_renewal_at = 0.0  # renew on every pass to reach the failing calls
                if calls["tick"] > 4 and calls["lease"] > 4 and calls["drain"] > 1:
                    break
        tick_logs = [
            r for r in caplog.records if r.getMessage().startswith("celery_boundedbeat: beat tick failed")
        ]
        assert len(tick_logs) == 1 and tick_logs[0].exc_info is not None, "a traceback once per streak"
        assert any("beat tick works again" in r.getMessage() for r in caplog.records)
        assert any("is reachable again" in r.getMessage() for r in caplog.records)
        assert any(
            r.getMessage().startswith("celery_boundedbeat: dispatch iteration failed") for r in caplog.records
        )
        assert scheduler._reap_not_before > 0, "after a lost connection the reaper waits for workers"
        rows = store.runs(name="x")
        assert rows, "the beat emitted once the tick worked again"
        with store.session() as s:
            from celery_boundedbeat.db.tables import IterationRow

            recorded = [(r.loop, r.error) for r in s.query(IterationRow).order_by(IterationRow.id)]
        assert recorded.count(("tick", "RuntimeError: tick bug")) == 3
        assert ("dispatch", "RuntimeError: drain bug") in recorded
        assert len([loop for loop, _ in recorded if loop == "lease renewal"]) == 2
    finally:
        scheduler.close()
        dispose_all()
