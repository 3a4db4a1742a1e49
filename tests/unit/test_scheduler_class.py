"""The beat class in-process: Celery's scheduler contract, banner, retention."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from celery import Celery

from celery_boundedbeat.enums import RunState
from celery_boundedbeat.scheduler import Scheduler
from celery_boundedbeat.store import Store


def _app(url: str, **conf: object) -> Celery:
    app = Celery("schedtest", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = url
    app.conf.update(conf)
    return app


def test_the_lazy_banner_scheduler_does_no_io_and_hides_the_password() -> None:
    """Celery's lazy banner scheduler touches no database and never prints the password."""
    app = _app("postgresql+psycopg://bob:s3cr3t@127.0.0.1:1/nowhere")
    scheduler = Scheduler(app, lazy=True)
    info = scheduler.info
    assert "s3cr3t" not in info
    assert "127.0.0.1:1/nowhere" in info
    assert scheduler._store is None


def test_retention_purges_old_settled_runs_from_the_beat_loop(sqlite_url: str) -> None:
    """With boundedbeat_retention_days set, a beat tick deletes settled runs older than that."""
    app = _app(
        sqlite_url,
        boundedbeat_retention_days=1,
        boundedbeat_dispatch_enabled=False,
        boundedbeat_poll_interval=0.05,
        beat_schedule={"keep": {"task": "proj.keep", "schedule": 3600.0}},
    )
    scheduler = Scheduler(app)
    try:
        store: Store = scheduler.store
        spec = scheduler._specs["keep"]
        old = datetime.now(UTC) - timedelta(days=3)
        rng = random.Random(0)
        with store.session() as s:
            from celery_boundedbeat.schema import ScheduleRow

            row = s.get(ScheduleRow, "keep")
            assert row is not None
            row.next_due_at = old
            row.grid_at = old
        emitted = store.tick({"keep": spec}, old, rng, 10).emitted
        assert len(emitted) == 1
        store.settle_run(emitted[0].id, RunState.COMPLETED, now=old + timedelta(seconds=1))
        scheduler.tick()
        assert store.run(emitted[0].id) is None, "the old settled run is purged"
        fresh = [r for r in store.runs(name="keep") if r.id != emitted[0].id]
        assert fresh, "the tick itself still emitted the current run"
        assert all(r.enqueued_at > old for r in fresh)
    finally:
        scheduler.close()
