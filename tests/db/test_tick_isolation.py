"""One schedule row that cannot be ticked never stops the others (SQLite and PostgreSQL)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from helpers.clock import T0
from sqlalchemy import Engine, update

from celery_boundedbeat.beat.scheduler import Scheduler
from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import UNUSABLE_RETRY, ScheduleState, TickOutcome
from celery_boundedbeat.db.store import Store, TickResult
from celery_boundedbeat.db.tables import ScheduleRow

RNG = random.Random(7)


def spec(name: str, **raw: Any) -> EntrySpec:
    built, problems = parse_entry(name, {"task": f"proj.{name}", "schedule": 10, **raw}, {})
    assert problems == [] and built is not None, problems
    return built


@pytest.fixture
def store(migrated: Engine) -> Iterator[Store]:
    yield Store(migrated)


def corrupt(store: Store, name: str, **values: Any) -> None:
    """Write ``values`` into a schedule row directly, as a hand edit or a bad restore would."""
    with store.session() as s:
        s.execute(update(ScheduleRow).where(ScheduleRow.name == name).values(**values))


def test_a_row_whose_state_cannot_be_read_is_set_aside_and_the_others_run(store: Store) -> None:
    """A due row with garbage in its pending buffer fails alone: every other due schedule emits."""
    entries = {s.name: s for s in (spec("a"), spec("bad"), spec("c"))}
    store.sync_config(entries.values(), T0, RNG)
    corrupt(store, "bad", pending=["not a time"])
    result = store.tick(entries, T0, RNG, 100)
    assert sorted(e.schedule for e in result.emitted) == ["a", "c"]
    assert list(result.failed) == ["bad"] and "not a time" in result.failed["bad"]
    assert store.schedules(["bad"])[0].next_due_at == T0 + UNUSABLE_RETRY
    # The next grid tick of the others goes on as usual, the bad row is not looked at again yet.
    later = store.tick(entries, T0 + timedelta(seconds=10), RNG, 100)
    assert later.failed == {}
    assert sorted(later.outcomes) == ["a", "c"]


def test_a_row_whose_run_the_database_refuses_is_set_aside_and_the_others_run(store: Store) -> None:
    """A row rewound onto a grid time that has a run already (the unique run key refuses the
    insert) fails alone: the schedule due beside it in the same batch still emits."""
    bad = spec("bad")
    good = spec("good", policy={"initial_delay": 5})
    entries = {"bad": bad, "good": good}
    store.sync_config(entries.values(), T0, RNG)
    before = store.schedules(["bad"])[0]
    assert [e.schedule for e in store.tick(entries, T0, RNG, 100).emitted] == ["bad"]
    corrupt(
        store,
        "bad",
        grid_at=before.grid_at,
        next_due_at=before.next_due_at,
        active_runs=0,
        runs=0,
        grid_runs=0,
    )
    result = store.tick(entries, T0 + timedelta(seconds=5), RNG, 100)
    assert [e.schedule for e in result.emitted] == ["good"]
    assert list(result.failed) == ["bad"]
    assert result.next_due_at is not None


def test_the_beat_logs_a_failing_schedule_once_and_again_when_it_ticks(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every failed tick of a set-aside schedule is one ERROR line in all until it ticks again."""
    app = Celery("isolation", broker="memory://", set_as_current=False)
    app.conf.update(boundedbeat_database_url=sqlite_url, boundedbeat_dispatch_enabled=False)
    scheduler = Scheduler(app)
    try:
        with caplog.at_level(logging.INFO, logger="celery_boundedbeat"):
            for _ in range(3):
                scheduler._log_tick(TickResult(now=T0, failed={"bad": "ValueError: not a time"}))
            scheduler._log_tick(TickResult(now=T0, outcomes={"bad": TickOutcome(state=ScheduleState())}))
            scheduler._log_tick(TickResult(now=T0, outcomes={"bad": TickOutcome(state=ScheduleState())}))
    finally:
        scheduler.close()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "'bad'" in r.getMessage()]
    assert [level for level, _ in said] == [logging.ERROR, logging.WARNING], said
    assert "schedule 'bad' is not run: its tick failed (ValueError: not a time)" in said[0][1]
    assert "schedule 'bad' ticks again" in said[1][1]
