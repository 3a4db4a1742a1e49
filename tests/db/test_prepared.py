"""Ticks prepared before they are due (PostgreSQL): invisible until committed, only certain outcomes."""

from __future__ import annotations

import random
import threading
from datetime import datetime
from typing import Any

import pytest
from helpers.clock import T0, sec
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from celery_boundedbeat.beat.prepared import prepare_tick
from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.db.engine import dispose_all, get_engine
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow, RunRow, ScheduleRow

pytestmark = pytest.mark.postgres

RNG = random.Random(3)


def spec(name: str, schedule: float = 10, **raw: Any) -> EntrySpec:
    built, problems = parse_entry(name, {"task": f"proj.{name}", "schedule": schedule, **raw}, {})
    assert problems == [] and built is not None, problems
    return built


@pytest.fixture
def store(pg_store: Store) -> Store:
    return pg_store


def setup(store: Store, *items: EntrySpec) -> dict[str, EntrySpec]:
    """The schedules at T0, each ticked once so their next grid tick is T0 + period."""
    store.sync_config(items, T0, RNG)
    entries = {s.name: s for s in items}
    store.tick(entries, T0, RNG, 100)
    return entries


def runs(store: Store, name: str) -> list[RunRow]:
    with store.session() as s:
        return list(s.scalars(select(RunRow).where(RunRow.schedule == name).order_by(RunRow.scheduled_for)))


def schedule(store: Store, name: str) -> ScheduleRow:
    (row,) = store.schedules([name])
    return row


def prepare(store: Store, entries: dict[str, EntrySpec], due: datetime) -> Any:
    return prepare_tick(
        store, lambda row: entries.get(row.name), due, 100, claimer="beat-disp", claim_timeout=60, rng=RNG
    )


def test_a_prepared_tick_is_invisible_until_committed_then_claimed_by_the_beats_dispatcher(
    store: Store,
) -> None:
    """Runs, queue rows and the advanced grid appear only at the commit, claimed for the publish."""
    entries = setup(store, spec("a", policy={"mode": "fixed_rate", "max_concurrency": 5}), spec("late", 30))
    prepared = prepare(store, entries, T0 + sec(10))
    assert prepared is not None
    assert [e.schedule for e in prepared.result.emitted] == ["a"]  # "late" is due at T0 + 30 s
    assert len(runs(store, "a")) == 1 and schedule(store, "a").next_due_at == T0 + sec(10)
    prepared.commit()
    made = runs(store, "a")
    assert [r.scheduled_for for r in made] == [T0, T0 + sec(10)]
    assert schedule(store, "a").next_due_at == T0 + sec(20)
    with store.session() as s:
        queued = s.scalars(select(QueueRow).where(QueueRow.run_id == made[1].id)).one()
    assert (queued.claimed_by, queued.claimed_until) == ("beat-disp", T0 + sec(70))
    assert [c.run_id for c in prepared.claimed] == [made[1].id] and prepared.claimed[0].id == queued.id
    # The dispatcher's usual claim skips it: the beat publishes it itself.
    others = store.claim_batch("other", T0 + sec(10), 100, 60)
    assert made[0].id in {c.run_id for c in others} and made[1].id not in {c.run_id for c in others}


def test_an_abandoned_preparation_leaves_nothing(store: Store) -> None:
    entries = setup(store, spec("a", policy={"mode": "fixed_rate", "max_concurrency": 5}))
    prepared = prepare(store, entries, T0 + sec(10))
    assert prepared is not None
    prepared.abandon()
    assert len(runs(store, "a")) == 1 and schedule(store, "a").next_due_at == T0 + sec(10)
    assert [e.scheduled_for for e in store.tick(entries, T0 + sec(10), RNG, 100).emitted] == [T0 + sec(10)]


def test_a_schedule_waiting_on_a_busy_slot_is_left_to_the_tick_at_its_due_time(store: Store) -> None:
    """No overlap with its run still active: not prepared and not locked, so that run can finish
    meanwhile and the tick at the due time starts the next one."""
    entries = setup(store, spec("busy"), spec("free", policy={"mode": "fixed_rate", "max_concurrency": 2}))
    (active,) = runs(store, "busy")
    prepared = prepare(store, entries, T0 + sec(10))
    assert prepared is not None
    assert [e.schedule for e in prepared.result.emitted] == ["free"]
    settled = threading.Event()

    def settle() -> None:
        store.run_life.settle_run(active.id, RunState.COMPLETED, now=T0 + sec(9))
        settled.set()

    worker = threading.Thread(target=settle)
    worker.start()
    assert settled.wait(10), "settling a run of an unprepared schedule waited for the prepared tick"
    worker.join()
    prepared.commit()
    tick = store.tick(entries, T0 + sec(10), RNG, 100)
    assert [(e.schedule, e.scheduled_for) for e in tick.emitted] == [("busy", T0 + sec(10))]


def test_a_change_to_a_prepared_schedule_waits_for_the_commit_and_applies_to_later_ticks(
    store: Store,
) -> None:
    """A pause during the lead blocks on the prepared rows, then takes effect from the next tick."""
    entries = setup(store, spec("a", policy={"mode": "fixed_rate", "max_concurrency": 5}))
    prepared = prepare(store, entries, T0 + sec(10))
    assert prepared is not None
    paused = threading.Event()

    def pause() -> None:
        store.set_paused("a", True, T0 + sec(9.8))
        paused.set()

    worker = threading.Thread(target=pause)
    worker.start()
    assert not paused.wait(0.5), "the pause went through a row the prepared tick holds"
    prepared.commit()
    assert paused.wait(10)
    worker.join()
    assert [r.scheduled_for for r in runs(store, "a")] == [T0, T0 + sec(10)]
    assert store.tick(entries, T0 + sec(20), RNG, 100).emitted == []


def test_a_schedule_with_a_queued_trigger_is_not_prepared(store: Store) -> None:
    entries = setup(store, spec("t", policy={"mode": "fixed_rate", "max_concurrency": 5}))
    assert store.trigger("t", T0 + sec(5)) is not None
    with store.session() as s:  # the trigger waits in the row (as if no tick had run since)
        row = s.get(ScheduleRow, "t")
        assert row is not None and row.triggers
    assert prepare(store, entries, T0 + sec(10)) is None


def test_nothing_is_prepared_on_sqlite(migrated_sqlite_url: str) -> None:
    engine = get_engine(migrated_sqlite_url)
    store = Store(engine)
    entries = setup(store, spec("a"))
    assert prepare(store, entries, T0 + sec(10)) is None
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(RunRow)) == 1
    dispose_all()


def test_the_lead_grows_with_the_last_preparation_up_to_the_bound(store: Store) -> None:
    """A tick that took long to prepare is started earlier next time (twice its time), never
    earlier than MAX_PREPARE_AHEAD, never later than prepare_ahead; 0 turns it off."""
    from celery import Celery

    from celery_boundedbeat.beat.ahead import AheadTicker
    from celery_boundedbeat.config.settings import MAX_PREPARE_AHEAD, Settings

    def ticker(prepare_ahead: float) -> AheadTicker:
        app = Celery("lead", broker="memory://", set_as_current=False)
        settings = Settings(prepare_ahead=prepare_ahead)
        return AheadTicker(app, store, settings, lambda row: None, claimer="c", still_leading=lambda: True)

    ahead = ticker(0.5)
    assert ahead.lead == 0.5
    ahead._per_run, ahead._last_runs = 0.0004, 5000  # 2 s to prepare 5,000 runs
    assert ahead.lead == pytest.approx(4.0)
    ahead._last_runs = 50_000
    assert ahead.lead == MAX_PREPARE_AHEAD
    ahead._last_runs = 100
    assert ahead.lead == 0.5
    assert ticker(0).lead == 0


def test_the_first_preparation_after_a_large_tick_starts_early_enough(store: Store) -> None:
    """Before any preparation was measured, a tick at the due time that emitted 5,000 runs sets
    the lead from an assumed cost per run; a smaller tick after it never shortens it."""
    from celery import Celery

    from celery_boundedbeat.beat.ahead import ASSUMED_PER_RUN, AheadTicker
    from celery_boundedbeat.config.settings import Settings

    app = Celery("lead", broker="memory://", set_as_current=False)
    ahead = AheadTicker(
        app, store, Settings(prepare_ahead=0.5), lambda row: None, claimer="c", still_leading=lambda: True
    )
    ahead.saw(5000)
    assert ahead.lead == pytest.approx(2 * ASSUMED_PER_RUN * 5000) and ahead.lead > 2.0
    ahead.saw(10)
    assert ahead.lead == pytest.approx(2 * ASSUMED_PER_RUN * 5000)


def test_a_tick_found_past_its_catchup_window_is_not_prepared_and_the_tick_drops_it(store: Store) -> None:
    """The preparation decides with the same on_due: a tick 10 s late under a 5 s window emits nothing."""
    entries = setup(store, spec("w", 60, policy={"catchup_window": 5}))
    assert prepare(store, entries, T0 + sec(70)) is None
    assert store.tick(entries, T0 + sec(70), RNG, 100).emitted == []
    row = schedule(store, "w")
    assert (row.window_drops, row.skips, row.next_due_at) == (1, 1, T0 + sec(120))


def test_a_schedule_set_aside_for_its_data_is_left_out_of_preparations(store: Store) -> None:
    """A row whose own tick fails (here rewound onto a grid time that has its run already, so
    the unique run key refuses the insert) failed every preparation it fell due in, taking the
    other schedules' prepared publish with it. Named in ``set_aside`` it is left to the tick at
    the due time, which takes it one schedule at a time; the rest is prepared."""
    free = {"mode": "fixed_rate", "max_concurrency": 5}
    entries = setup(store, spec("bad", policy=free), spec("good", policy=free))
    with store.session() as s:
        s.execute(
            update(ScheduleRow).where(ScheduleRow.name == "bad").values(next_due_at=T0, grid_at=T0 - sec(10))
        )
    with pytest.raises(IntegrityError):
        prepare(store, entries, T0 + sec(10))
    prepared = prepare_tick(
        store,
        lambda row: entries.get(row.name),
        T0 + sec(10),
        100,
        claimer="beat-disp",
        claim_timeout=60,
        rng=RNG,
        set_aside=["bad"],
    )
    assert prepared is not None
    assert [e.schedule for e in prepared.result.emitted] == ["good"]
    prepared.commit()
    assert schedule(store, "bad").next_due_at == T0
