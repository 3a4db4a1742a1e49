"""replace, catchup_window and resume replay through the SQL store, on SQLite and PostgreSQL."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from helpers.clock import T0, sec
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from celery_boundedbeat.api.queries import ScheduleSnapshot
from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.db.engine import dispose_all, get_engine
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow, RunRow, ScheduleRow
from celery_boundedbeat.db.tick import REPLACED
from celery_boundedbeat.ops.metrics import exposition, read_snapshot

RNG = random.Random(5)


def spec(name: str, schedule: Any = 10, **policy: Any) -> EntrySpec:
    built, problems = parse_entry(name, {"task": f"proj.{name}", "schedule": schedule, "policy": policy}, {})
    assert problems == [] and built is not None, problems
    return built


@pytest.fixture
def store(migrated: Engine) -> Iterator[Store]:
    yield Store(migrated)


def setup(store: Store, item: EntrySpec) -> dict[str, EntrySpec]:
    store.sync_config([item], T0, RNG)
    return {item.name: item}


def row(store: Store, name: str) -> ScheduleRow:
    return store.schedules([name])[0]


def started_run(store: Store, entries: dict[str, EntrySpec], now: datetime) -> str:
    emitted = store.tick(entries, now, RNG, 100).emitted
    assert len(emitted) == 1, emitted
    assert store.run_life.start_run(emitted[0].id, worker="w", process="h:1", now=now, max_run_time=None)
    return emitted[0].id


def test_replace_settles_the_old_run_revoked_in_the_tick_and_starts_the_new_one(store: Store) -> None:
    """The busy tick revokes the started run (error says why), queues the new one, keeps one active."""
    entries = setup(store, spec("r", missed_ticks="replace"))
    old = started_run(store, entries, T0)
    result = store.tick(entries, T0 + sec(10), RNG, 100)
    assert result.revoked == [old]
    assert [e.scheduled_for for e in result.emitted] == [T0 + sec(10)]
    revoked = store.run(old)
    assert revoked is not None
    assert (revoked.state, revoked.error, revoked.finished_at) == ("revoked", REPLACED, T0 + sec(10))
    assert revoked.elapsed_ms == 10_000
    r = row(store, "r")
    assert (r.active_runs, r.replaced, r.failures, r.skips, r.last_finished_at) == (1, 1, 1, 0, T0 + sec(10))


def test_the_replaced_runs_late_outcome_changes_nothing(store: Store) -> None:
    """A threads/solo worker finishes the replaced task anyway: its settle is ignored, counted once."""
    entries = setup(store, spec("r", missed_ticks="replace"))
    old = started_run(store, entries, T0)
    new = store.tick(entries, T0 + sec(10), RNG, 100).emitted[0].id
    assert store.run_life.settle_run(old, RunState.COMPLETED, now=T0 + sec(12), late=True) is None
    run = store.run(old)
    assert run is not None and (run.state, run.error) == ("revoked", REPLACED)
    r = row(store, "r")
    assert (r.active_runs, r.runs, r.failures) == (1, 0, 1)
    assert store.run_life.settle_run(new, RunState.COMPLETED, now=T0 + sec(13)) is not None
    assert (row(store, "r").active_runs, row(store, "r").runs) == (0, 1)


def test_a_replaced_run_not_yet_published_leaves_the_queue(store: Store) -> None:
    """A queued run that is replaced never reaches the broker: its queue row goes with it."""
    entries = setup(store, spec("r", missed_ticks="replace"))
    old = store.tick(entries, T0, RNG, 100).emitted[0].id
    new = store.tick(entries, T0 + sec(10), RNG, 100).emitted[0].id
    with store.session() as s:
        queued = set(s.scalars(select(QueueRow.run_id)))
    assert queued == {new}
    assert old != new


@pytest.mark.postgres
def test_replace_skips_a_run_another_transaction_is_settling(migrated_postgres_url: str) -> None:
    """PostgreSQL: a run locked by a settle in progress is not revoked; the tick is a busy skip.

    (SQLite has one writer: no other transaction can hold the run meanwhile.)
    """
    engine = get_engine(migrated_postgres_url)
    store = Store(engine)
    try:
        entries = setup(store, spec("r", missed_ticks="replace"))
        old = started_run(store, entries, T0)
        with Session(store.engine) as other, other.begin():
            other.execute(select(RunRow.id).where(RunRow.id == old).with_for_update())
            result = store.tick(entries, T0 + sec(10), RNG, 100)
        assert (result.revoked, result.emitted) == ([], [])
        r = row(store, "r")
        assert (r.active_runs, r.busy_skips, r.skips, r.replaced) == (1, 1, 1, 0)
    finally:
        dispose_all()


def test_window_drops_are_stored_apart_and_shown_everywhere(store: Store) -> None:
    """A tick found late stores its window drops and busy skips; snapshot and metrics show them."""
    entries = setup(store, spec("w", catchup_window=25))
    result = store.tick(entries, T0 + sec(100), RNG, 100)
    assert [e.scheduled_for for e in result.emitted] == [T0 + sec(100)]
    r = row(store, "w")
    assert (r.skips, r.busy_skips, r.window_drops, r.buffer_drops, r.replaced) == (10, 2, 8, 0, 0)
    snap = ScheduleSnapshot.from_row(r).to_json()
    assert {k: snap[k] for k in ("skips", "busy_skips", "window_drops", "buffer_drops", "replaced")} == {
        "skips": 10,
        "busy_skips": 2,
        "window_drops": 8,
        "buffer_drops": 0,
        "replaced": 0,
    }
    text = exposition(read_snapshot(store.engine, T0 + sec(100)))
    for metric, value in [("skips", 10), ("busy_skips", 2), ("window_drops", 8), ("buffer_drops", 0)]:
        assert f'boundedbeat_schedule_{metric}_total{{schedule="w"}} {float(value)}' in text
    assert 'boundedbeat_schedule_replaced_total{schedule="w"} 0.0' in text


def test_resume_with_replay_hands_the_paused_ticks_to_the_policy(store: Store) -> None:
    """Paused over five ticks: plain resume misses them; with replay catch_up runs them in order."""
    entries = setup(store, spec("p", missed_ticks="catch_up", max_pending=10))
    first = started_run(store, entries, T0)
    store.run_life.settle_run(first, RunState.COMPLETED, now=T0 + sec(1))
    store.set_paused("p", True, T0 + sec(2))
    assert store.set_paused("p", False, T0 + sec(55), replay=True)
    result = store.tick(entries, T0 + sec(55), RNG, 100)
    assert [e.scheduled_for for e in result.emitted] == [T0 + sec(10)]
    r = row(store, "p")
    assert [datetime.fromisoformat(p) for p in r.pending] == [T0 + sec(n) for n in (20, 30, 40, 50)]
    assert r.next_due_at is not None and r.next_due_at > T0 + sec(55)
