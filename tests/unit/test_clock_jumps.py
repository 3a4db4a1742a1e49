"""Wall-clock jumps (an NTP step forward or back) on interval schedules, on a fake clock.

The grid is anchored in UTC: a step forward is a late tick, every grid time passed counted and
handed to ``missed_ticks``; a step back emits no grid time twice and leaves a due time in the
future, so the beat neither spins on a schedule nor re-emits what it already emitted. A
prepared tick whose clock is stepped back while it waits gives the tick up at once instead of
sleeping out the step.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import Any

import pytest
from helpers.clock import T0, sec
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_boundedbeat.beat.ahead import sleep_until
from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.ticks import ScheduleState, TickOutcome, initial_state, on_settle
from celery_boundedbeat.core.timing import IntervalTiming

PERIOD = 10.0
GRID = IntervalTiming(PERIOD)


def policy(**raw: Any) -> Policy:
    parsed, problems = parse_policy("job", raw)
    assert problems == [] and parsed is not None
    return parsed


def look(p: Policy, state: ScheduleState, now: datetime) -> TickOutcome:
    """What the store does at a tick: a schedule is looked at only when its due time has come."""
    if state.next_due_at is None or state.next_due_at > now:
        return TickOutcome(state=state)
    return on_due(p, GRID, state, now, random.Random(0))


def settle_all(p: Policy, state: ScheduleState, now: datetime) -> ScheduleState:
    for _ in range(state.active_runs):
        state = on_settle(
            p,
            state,
            outcome=RunState.COMPLETED,
            elapsed_ms=1,
            now=now,
            stop=False,
            gap_s=PERIOD,
            rng=random.Random(0),
        )
    return state


@pytest.mark.parametrize(
    ("raw", "started", "pending", "skipped"),
    [
        ({"missed_ticks": "skip"}, [T0 + sec(360)], 0, 36),
        ({"missed_ticks": "coalesce_latest"}, [T0 + sec(360)], 1, 35),
        ({"missed_ticks": "catch_up", "max_pending": 5}, [T0], 5, 31),
        (
            {"mode": "fixed_rate", "max_concurrency": 3, "missed_ticks": "skip"},
            [T0 + sec(340), T0 + sec(350), T0 + sec(360)],
            0,
            34,
        ),
    ],
)
def test_a_step_forward_counts_the_grid_times_passed_as_a_late_tick(
    raw: dict[str, Any], started: list[datetime], pending: int, skipped: int
) -> None:
    """The clock jumps 6 minutes past a due tick: 37 grid times passed, as many start as slots are
    free and ``missed_ticks`` takes the rest; the grid rejoins at the first time after the jump."""
    p = policy(**raw)
    state = initial_state(p, GRID, T0, random.Random(0))
    outcome = look(p, state, T0 + sec(365))
    assert outcome.ticks == 37
    assert [e.scheduled_for for e in outcome.emit] == started
    assert (len(outcome.state.pending), outcome.skipped) == (pending, skipped)
    assert len(outcome.emit) + pending + skipped == outcome.ticks
    assert outcome.state.grid_at == outcome.state.next_due_at == T0 + sec(370)


def test_a_step_back_emits_nothing_again_and_resumes_at_the_next_grid_time() -> None:
    """After ticks up to 10:00:30 the clock steps back an hour: nothing is due (no spin, no repeat)
    until the clock reaches 10:00:40 again, which is then the next run's grid time."""
    p = policy()
    state = initial_state(p, GRID, T0, random.Random(0))
    emitted: list[datetime] = []
    for i in range(4):
        outcome = look(p, state, T0 + sec(PERIOD * i))
        emitted += [e.scheduled_for for e in outcome.emit]
        state = settle_all(p, outcome.state, T0 + sec(PERIOD * i + 1))
    assert emitted == [T0 + sec(s) for s in (0, 10, 20, 30)]
    stepped_back = T0 + sec(31) - timedelta(hours=1)
    for minutes in range(0, 60, 5):
        now = stepped_back + timedelta(minutes=minutes)
        outcome = on_due(p, GRID, state, now, random.Random(0))  # even a forced look emits nothing
        assert outcome.emit == () and outcome.skipped == 0
        assert outcome.state.next_due_at is not None and outcome.state.next_due_at > now
        state = outcome.state
    outcome = look(p, state, T0 + sec(40))
    assert [e.scheduled_for for e in outcome.emit] == [T0 + sec(40)]


@settings(max_examples=150, deadline=None)
@given(
    raw=st.sampled_from(
        [
            {},
            {"missed_ticks": "coalesce_latest"},
            {"missed_ticks": "catch_up", "max_pending": 3},
            {"mode": "fixed_rate", "max_concurrency": 2, "missed_ticks": "catch_up", "max_pending": 2},
        ]
    ),
    steps=st.lists(
        st.tuples(st.floats(0.1, 25.0), st.floats(-3600.0, 3600.0), st.booleans()), min_size=1, max_size=40
    ),
)
def test_jumping_clocks_never_emit_a_grid_time_twice_nor_leave_a_schedule_spinning(
    raw: dict[str, Any], steps: list[tuple[float, float, bool]]
) -> None:
    """Whatever the steps of the clock, emitted grid times are on the UTC grid, each once;
    after every look the due time is in the future; runs + skips + pending == grid ticks counted."""
    p = policy(**raw)
    state = initial_state(p, GRID, T0, random.Random(0))
    real, offset = T0, 0.0
    emitted: list[datetime] = []
    ticks = skips = 0
    for elapsed, jump, settle in steps:
        real += sec(elapsed)
        offset += jump if abs(jump) > 60 else 0.0  # an NTP step, or none
        now = real + sec(offset)
        outcome = look(p, state, now)
        emitted += [e.scheduled_for for e in outcome.emit]
        ticks += outcome.ticks
        skips += outcome.skipped
        state = outcome.state
        assert state.next_due_at is None or state.next_due_at > now
        if settle:
            state = settle_all(p, state, now)
    assert len(emitted) == len(set(emitted))
    assert all((t - T0).total_seconds() % PERIOD == 0 for t in emitted)
    assert len(emitted) + skips + len(state.pending) == ticks


class SteppedClock:
    """A wall clock that an NTP step sets back by ``step`` seconds at its second reading."""

    def __init__(self, start: datetime, step: float) -> None:
        self.now, self.step, self.readings, self.slept = start, step, 0, 0.0

    def read(self) -> datetime:
        self.readings += 1
        if self.readings == 2:
            self.now -= sec(self.step)
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.now += sec(seconds)


def test_a_prepared_tick_waits_out_its_lead_on_a_steady_clock() -> None:
    """With no step, the wait ends exactly at the due time, never before."""
    clock = SteppedClock(T0, step=0.0)
    assert sleep_until(T0 + sec(0.5), longest=1.5, now=clock.read, sleep=clock.sleep)
    assert clock.now == T0 + sec(0.5)


def test_a_prepared_tick_gives_up_when_the_clock_steps_back_instead_of_sleeping_it_out() -> None:
    """A clock set back an hour while a tick is prepared: no hour of sleep, the tick is abandoned."""
    clock = SteppedClock(T0, step=3600.0)
    assert not sleep_until(T0 + sec(0.5), longest=1.5, now=clock.read, sleep=clock.sleep)
    assert clock.slept <= 0.5
