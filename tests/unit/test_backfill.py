"""Backfill's pure decisions on a fake clock: which grid times are queued and how they start."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers.beats import BACKFILL_RNG as RNG
from helpers.beats import BackfillBeat
from helpers.clock import T0, sec
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_boundedbeat.core.backfill import (
    BACKFILL_CAP,
    BackfillRefused,
    as_utc,
    grid_times,
    on_backfill,
    without_taken,
)
from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.enums import StopReason
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.ticks import BACKFILL_PER_TICK, ScheduleState, on_config_change
from celery_boundedbeat.core.timing import CalendarTiming, IntervalTiming


def parse(raw: dict[str, Any] | None = None, **kwargs: Any) -> Policy:
    policy, problems = parse_policy("entry", raw or {}, **kwargs)
    assert problems == [], problems
    assert policy is not None
    return policy


def every_minute(t: datetime) -> datetime:
    return t.replace(second=0, microsecond=0) + timedelta(minutes=1)


def test_interval_grid_times_are_the_grid_extended_back_oldest_first_bounds_included() -> None:
    """An interval grid's times in [start, end] are its phase stepped back from the next tick."""
    times = grid_times(IntervalTiming(10), T0 + sec(100), T0 + sec(20), T0 + sec(50))
    assert times == [T0 + sec(s) for s in (20, 30, 40, 50)]
    between = grid_times(IntervalTiming(10), T0 + sec(100), T0 + sec(21), T0 + sec(49))
    assert between == [T0 + sec(s) for s in (30, 40)]


def test_grid_times_stop_before_the_grids_next_tick() -> None:
    """Times at or after the grid's next tick are left to the live grid (missed_ticks decides them)."""
    times = grid_times(IntervalTiming(10), T0 + sec(100), T0 + sec(80), T0 + sec(130))
    assert times == [T0 + sec(80), T0 + sec(90)]
    assert grid_times(IntervalTiming(10), T0 + sec(100), T0 + sec(100), T0 + sec(130)) == []


def test_calendar_grid_times_are_walked_on_the_calendar() -> None:
    """A crontab-like grid's times in the range are its calendar ticks, whatever the anchor."""
    start, end = T0 + sec(30), T0 + sec(4 * 60)
    times = grid_times(CalendarTiming(every_minute), T0 + sec(3600), start, end)
    assert times == [T0 + sec(60 * m) for m in (1, 2, 3, 4)]


def test_a_range_of_more_grid_times_than_the_cap_is_refused_naming_the_cap() -> None:
    """Exactly the cap is accepted; one more is refused with a reason that names the cap."""
    anchor = T0 + sec(10 * (BACKFILL_CAP + 10))
    fits = grid_times(IntervalTiming(10), anchor, T0 + sec(10), T0 + sec(10 * BACKFILL_CAP))
    assert isinstance(fits, list) and len(fits) == BACKFILL_CAP
    over = grid_times(IntervalTiming(10), anchor, T0, T0 + sec(10 * BACKFILL_CAP))
    assert isinstance(over, BackfillRefused)
    assert over.key == "start" and f"at most {BACKFILL_CAP}" in over.reason and "1001" in over.reason
    calendar = grid_times(CalendarTiming(every_minute), T0 + sec(10**6), T0, T0 + sec(60 * BACKFILL_CAP))
    assert isinstance(calendar, BackfillRefused) and f"at most {BACKFILL_CAP}" in calendar.reason


def test_a_years_long_range_of_a_one_second_grid_is_refused_without_walking_it() -> None:
    """Counting interval grid times is arithmetic: a range of 3e7 ticks is refused at once."""
    anchor = T0 + timedelta(days=400)
    refused = grid_times(IntervalTiming(1), anchor, T0, T0 + timedelta(days=365))
    assert isinstance(refused, BackfillRefused) and "more than" in refused.reason


def test_times_that_have_runs_or_already_wait_are_not_queued_and_are_counted() -> None:
    """Grid times with a run count as had_runs; pending, triggered or backfilled ones as waiting."""
    beat = BackfillBeat(parse({"missed_ticks": "coalesce_latest"}))
    beat.state = ScheduleState(
        grid_at=beat.state.grid_at, next_due_at=beat.state.grid_at, pending=(T0 + sec(60),)
    )
    decided = beat.backfill(T0 + sec(20), T0 + sec(60), runs=(T0 + sec(30), T0 + sec(33)))
    assert decided.queued == (T0 + sec(20), T0 + sec(40), T0 + sec(50))
    assert decided.had_runs == 1  # 33 s is no grid time (a trigger's run): not counted
    assert decided.waiting == 1
    assert beat.state.backfill == decided.queued
    assert beat.state.next_due_at == beat.now  # a running beat starts them at its next look
    again = beat.backfill(T0 + sec(10), T0 + sec(50))
    assert again.queued == (T0 + sec(10), T0 + sec(30)) and again.waiting == 3
    assert beat.state.backfill == tuple(T0 + sec(s) for s in (10, 20, 30, 40, 50))


def test_backfilled_runs_start_oldest_first_one_at_a_time_without_overlap() -> None:
    """fixed_rate_no_overlap: one backfilled run at a time, oldest first, the next at each settle."""
    beat = BackfillBeat(parse({}))
    beat.backfill(T0 + sec(10), T0 + sec(40))
    started: list[datetime] = []
    for _ in range(4):
        emitted = beat.look()
        assert len(emitted) == 1 and emitted[0].backfilled
        started.append(emitted[0].scheduled_for)
        assert beat.look() == []  # the slot is busy: nothing more until it settles
        beat.finish_all()
    assert started == [T0 + sec(s) for s in (10, 20, 30, 40)]
    assert beat.max_active == 1 and beat.state.backfill == ()
    assert beat.state.grid_runs == 0  # backfilled runs do not count toward max_runs


def test_fixed_rate_starts_as_many_backfilled_runs_as_slots_are_free() -> None:
    """fixed_rate with max_concurrency 3 starts three at once, the rest as slots free."""
    beat = BackfillBeat(parse({"mode": "fixed_rate", "max_concurrency": 3}))
    beat.backfill(T0 + sec(10), T0 + sec(50))
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(s) for s in (10, 20, 30)]
    assert beat.look() == []
    beat.finish_all()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(40), T0 + sec(50)]
    assert beat.max_active == 3


def test_a_live_grid_tick_due_with_backfill_waiting_goes_first() -> None:
    """At a grid tick the live run takes the free slot; the backfill waits for its settle."""
    beat = BackfillBeat(parse({}))
    beat.backfill(T0 + sec(10), T0 + sec(20))
    beat.now = beat.state.grid_at or beat.now
    live = beat.look()
    assert [e.backfilled for e in live] == [False]
    beat.finish_all()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(10)]


def test_one_tick_starts_at_most_the_per_tick_bound_and_stays_due() -> None:
    """A wide bound starts BACKFILL_PER_TICK in one tick; the schedule stays due for the rest."""
    beat = BackfillBeat(parse({"mode": "fixed_rate", "max_concurrency": 500}), period=1.0, now=T0 + sec(400))
    beat.backfill(T0 + sec(1), T0 + sec(250))
    assert len(beat.look()) == BACKFILL_PER_TICK
    assert beat.state.next_due_at == beat.now
    assert len(beat.look()) == BACKFILL_PER_TICK
    assert len(beat.look()) == 50
    assert beat.state.next_due_at is not None and beat.state.next_due_at > beat.now


def test_backfilled_runs_do_not_count_toward_max_runs() -> None:
    """With max_runs 2 the schedule still ends after two grid runs, whatever was backfilled."""
    beat = BackfillBeat(parse({"max_runs": 2}))
    beat.backfill(T0 + sec(10), T0 + sec(30))
    for _ in range(3):
        assert beat.look()[0].backfilled
        beat.finish_all()
    for _ in range(2):
        beat.now = beat.state.grid_at or beat.now
        assert [e.backfilled for e in beat.look()] == [False]
        beat.finish_all()
    assert beat.state.stopped and beat.state.stop_reason is StopReason.MAX_RUNS
    assert beat.state.grid_runs == 2


def test_backfill_queued_before_the_end_still_runs_and_the_schedule_then_stops() -> None:
    """Ending with backfill waiting: the waiting times start as slots free, then it shows stopped."""
    beat = BackfillBeat(parse({"max_runs": 1}))
    beat.backfill(T0 + sec(10), T0 + sec(20))
    beat.now = beat.state.grid_at or beat.now
    assert [e.backfilled for e in beat.look()] == [False]  # the last allowed grid run
    assert beat.state.ended and not beat.state.stopped
    beat.finish_all()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(10)]
    beat.finish_all()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(20)]
    beat.finish_all()
    assert beat.state.stopped and beat.state.backfill == ()


@pytest.mark.parametrize(
    ("policy", "state", "paused", "words"),
    [
        ({"mode": "fixed_delay"}, ScheduleState(next_due_at=T0), False, "no grid"),
        ({}, ScheduleState(grid_at=T0 + sec(200)), True, "paused; resume it first"),
        ({}, ScheduleState(grid_at=T0 + sec(200), stopped=True), False, "stopped; resume it first"),
        (
            {"max_runs": 1},
            ScheduleState(stopped=True, stop_reason=StopReason.MAX_RUNS),
            False,
            "has ended (max_runs)",
        ),
    ],
)
def test_a_schedule_that_cannot_take_a_backfill_refuses_it_saying_why(
    policy: dict[str, Any], state: ScheduleState, paused: bool, words: str
) -> None:
    """fixed_delay, paused, stopped and ended schedules refuse, with no argument at fault."""
    decided = on_backfill(
        parse(policy), IntervalTiming(10), state, T0, T0 + sec(50), T0 + sec(100), paused=paused, run_times=()
    )
    assert isinstance(decided, BackfillRefused) and decided.key is None
    assert words in decided.reason


@pytest.mark.parametrize(
    ("start", "end", "words"),
    [(T0 + sec(50), T0 + sec(40), "is before start"), (T0, T0 + sec(101), "is in the future")],
)
def test_a_reversed_or_future_range_is_refused_naming_end(start: datetime, end: datetime, words: str) -> None:
    """end before start, or end after now, is the argument ``end``'s fault."""
    decided = on_backfill(
        parse({}), IntervalTiming(10), ScheduleState(grid_at=T0 + sec(110)), start, end, T0 + sec(100),
        paused=False, run_times=(),
    )  # fmt: skip
    assert isinstance(decided, BackfillRefused) and decided.key == "end" and words in decided.reason


def test_more_waiting_than_the_cap_is_refused() -> None:
    """A schedule keeps at most BACKFILL_CAP backfilled times waiting, across calls."""
    beat = BackfillBeat(parse({}), period=1.0, now=T0 + sec(3 * BACKFILL_CAP))
    beat.backfill(T0, T0 + sec(BACKFILL_CAP - 1))
    decided = on_backfill(
        beat.policy, beat.timing, beat.state, T0 + sec(BACKFILL_CAP), T0 + sec(BACKFILL_CAP),
        beat.now, paused=False, run_times=(),
    )  # fmt: skip
    assert isinstance(decided, BackfillRefused) and f"the {BACKFILL_CAP} a schedule keeps" in decided.reason


def test_naive_bounds_are_utc_and_unreadable_ones_are_named() -> None:
    """A naive time or ISO string is UTC (as --since); an aware one is converted; garbage is refused."""
    assert as_utc("2030-01-01T10:00:00", "start") == datetime(2030, 1, 1, 10, tzinfo=UTC)
    assert as_utc("2030-01-01T12:00:00+02:00", "end") == datetime(2030, 1, 1, 10, tzinfo=UTC)
    assert as_utc(datetime(2030, 1, 1, 10), "start") == datetime(2030, 1, 1, 10, tzinfo=UTC)
    refused = as_utc("yesterday", "start")
    assert isinstance(refused, BackfillRefused) and refused.key == "start" and "'yesterday'" in refused.reason


def test_a_taken_run_key_gives_its_slot_back_and_keeps_the_schedule_due() -> None:
    """without_taken drops the emissions whose time had a run and frees their slots."""
    beat = BackfillBeat(parse({"mode": "fixed_rate", "max_concurrency": 2}))
    beat.backfill(T0 + sec(10), T0 + sec(30))
    outcome = on_due(beat.policy, beat.timing, beat.state, beat.now, RNG)
    assert [e.scheduled_for for e in outcome.emit] == [T0 + sec(10), T0 + sec(20)]
    fixed = without_taken(outcome, [T0 + sec(10)], beat.now)
    assert [e.scheduled_for for e in fixed.emit] == [T0 + sec(20)]
    assert fixed.state.active_runs == 1 and fixed.state.overlaps == 0
    assert fixed.state.backfill == (T0 + sec(30),) and fixed.state.next_due_at == beat.now
    assert without_taken(outcome, [], beat.now) is outcome


def test_an_ended_schedule_whose_last_backfilled_time_was_taken_shows_stopped() -> None:
    """Nothing active or waiting after the taken time is given back: the ended schedule stops."""
    beat = BackfillBeat(parse({"max_runs": 1}))
    beat.backfill(T0 + sec(10), T0 + sec(10))
    beat.now = beat.state.grid_at or beat.now
    beat.look()  # the last grid run
    beat.finish_all()
    outcome = on_due(beat.policy, beat.timing, beat.state, beat.now, RNG)
    assert [e.scheduled_for for e in outcome.emit] == [T0 + sec(10)] and not outcome.state.stopped
    fixed = without_taken(outcome, [T0 + sec(10)], beat.now)
    assert fixed.emit == () and fixed.state.stopped and fixed.state.next_due_at is None


def test_a_change_to_fixed_delay_drops_the_waiting_backfill() -> None:
    """fixed_delay has no grid: grid times still waiting are dropped when the mode changes to it."""
    from celery_boundedbeat.core.spec import EntrySpec

    state = ScheduleState(grid_at=T0 + sec(200), next_due_at=T0 + sec(200), backfill=(T0 + sec(10),))
    spec = EntrySpec(
        name="e", task="t", policy=parse({"mode": "fixed_delay"}), timing=IntervalTiming(10),
        schedule_repr="every 10.0s", period=10.0,
    )  # fmt: skip
    changed = on_config_change(
        spec, state, config_changed=True, old_schedule="every 10.0s", old_mode=parse({}).mode,
        now=T0 + sec(100), rng=RNG,
    )  # fmt: skip
    assert changed.backfill == ()


@settings(max_examples=150, deadline=None)
@given(
    concurrency=st.integers(min_value=1, max_value=4),
    start_s=st.integers(min_value=0, max_value=60),
    width_s=st.integers(min_value=0, max_value=60),
    had=st.sets(st.integers(min_value=0, max_value=12), max_size=12),
)
def test_backfill_emits_exactly_the_missing_grid_times_oldest_first_within_the_bound(
    concurrency: int, start_s: int, width_s: int, had: set[int]
) -> None:
    """Whatever the range and the runs already there: every missing grid time runs once, in order,
    never more active than the bound, and the counts add up to the grid times in the range."""
    raw: dict[str, Any] = {"mode": "fixed_rate", "max_concurrency": concurrency} if concurrency > 1 else {}
    beat = BackfillBeat(parse(raw), period=5.0, now=T0 + sec(200))
    start, end = T0 + sec(start_s), T0 + sec(start_s + width_s)
    runs = tuple(T0 + sec(5 * i) for i in had)
    decided = beat.backfill(start, end, runs)
    expected = [T0 + sec(5 * i) for i in range(41) if start <= T0 + sec(5 * i) <= end]
    assert decided.had_runs + len(decided.queued) == len(expected)
    for _ in range(len(expected) + 1):
        beat.look()
        assert len(beat.active) <= concurrency
        beat.finish_all()
    backfilled = [e.scheduled_for for e in beat.emitted if e.backfilled]
    assert backfilled == [t for t in expected if t not in runs]
    assert beat.max_active <= concurrency and beat.state.backfill == ()
