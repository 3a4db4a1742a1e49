"""A run's times in order (enqueued, started, finished) although different clocks stamp them;
SQLite and PostgreSQL."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from helpers.clock import T0
from sqlalchemy import Engine, update

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.row_state import RUNTIME
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import ScheduleRow
from celery_boundedbeat.worker.worklog import OutcomeReport, write_reports

RNG = random.Random(3)


@pytest.fixture
def store(migrated: Engine) -> Iterator[Store]:
    yield Store(migrated)


def emit(store: Store, now: datetime) -> str:
    """One run of a runtime schedule ``s``, queued at ``now``."""
    built, problems = parse_entry("s", {"task": "t", "schedule": 10}, {})
    assert built is not None, problems
    store.sync_config([built], now, RNG)
    with store.session() as s:
        s.execute(update(ScheduleRow).where(ScheduleRow.name == "s").values(origin=RUNTIME))
    (emitted,) = store.tick({"s": built}, now, RNG, 10).emitted
    return emitted.id


def test_a_revoke_stamped_by_an_earlier_clock_never_finishes_a_run_before_it_was_enqueued(
    store: Store,
) -> None:
    """remove_schedule(revoke_active) called with a clock behind the beat's: finished_at is not
    before enqueued_at (the run's times never go backwards)."""
    run_id = emit(store, T0)
    revoked = store.remove_schedule("s", T0 - timedelta(seconds=3), revoke_active=True)
    assert revoked == [run_id]
    run = store.run(run_id)
    assert run is not None and run.state == "revoked"
    assert run.finished_at is not None and run.enqueued_at is not None
    assert run.finished_at >= run.enqueued_at, (run.enqueued_at, run.finished_at)


def test_an_outcome_stamped_before_its_start_finishes_the_run_after_it(store: Store) -> None:
    """A worker batch whose outcome time is earlier than the start another clock stamped."""
    run_id = emit(store, T0)
    store.run_life.start_run(
        run_id, worker="w", process="h:1", now=T0 + timedelta(seconds=2), max_run_time=None
    )
    outcome = OutcomeReport(
        run_id=run_id, state=RunState.COMPLETED, at=T0 + timedelta(seconds=1), error=None, stop=False
    )
    (settled,) = write_reports(store, [], [outcome])
    assert settled is not None and settled.elapsed_ms == 0
    run: Any = store.run(run_id)
    assert run.finished_at >= run.started_at >= run.enqueued_at, (
        run.enqueued_at,
        run.started_at,
        run.finished_at,
    )
