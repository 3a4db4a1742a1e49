"""The tick state machine driven by a fake clock."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers.beats import TickBeat
from helpers.clock import T0, sec

from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.enums import Mode, RunState
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import (
    MAX_QUEUED_TRIGGERS,
    ScheduleState,
    Triggered,
    TriggerRefused,
    jitter_delay,
    on_config_change,
    on_resume,
    on_settle,
    on_trigger,
)
from celery_boundedbeat.core.timing import CalendarTiming, IntervalTiming


def parse(raw: dict[str, Any] | None = None, **kwargs: Any) -> Policy:
    policy, problems = parse_policy("entry", raw or {}, **kwargs)
    assert problems == [], problems
    assert policy is not None
    return policy


# -- fixed delay ---------------------------------------------------------------------------


def test_fixed_delay_waits_for_the_first_delay_and_then_for_each_completion() -> None:
    """The first run is due after initial_delay, nothing while it runs, the next `period` after it ends."""
    beat = TickBeat(parse({"mode": "fixed_delay", "initial_delay": 2}), period=3)
    assert beat.look() == []
    assert beat.advance(1.999) == []
    first = beat.advance(0.001)
    assert [e.scheduled_for for e in first] == [T0 + sec(2)]
    assert first[0].drift_ms == 0
    assert beat.step(1, 10) == []  # ten seconds pass while the run is active
    assert beat.state.active_runs == 1
    assert beat.state.next_due_at is None
    completion = beat.now
    beat.finish()
    assert beat.state.next_due_at == completion + sec(3)
    assert beat.advance(2.999) == []
    second = beat.advance(0.001)
    assert [e.scheduled_for for e in second] == [completion + sec(3)]
    beat.finish()
    assert (beat.state.runs, beat.state.failures, beat.state.active_runs) == (2, 0, 0)
    assert beat.max_active == 1


def test_fixed_delay_counts_from_the_finish_whatever_the_outcome() -> None:
    """A failed run also schedules the next one `period` after it finished."""
    beat = TickBeat(parse({"mode": "fixed_delay"}), period=10)
    beat.look()
    beat.advance(4)
    beat.finish(RunState.FAILED)
    assert beat.state.next_due_at == T0 + sec(14)
    assert (beat.state.runs, beat.state.failures) == (0, 1)


def test_a_controlled_schedule_ends_after_a_stop() -> None:
    """A run that settles with stop=True leaves the schedule stopped; nothing more is emitted."""
    beat = TickBeat(parse({"mode": "fixed_delay"}), period=1)
    calls = len(beat.look())
    for _ in range(5):
        if beat.active:
            beat.finish(stop=calls == 2)
        calls += len(beat.advance(1))
    assert calls == 2
    assert beat.state.stopped is True
    assert beat.state.next_due_at is None
    assert (beat.state.runs, beat.state.active_runs) == (2, 0)
    # A beat that still looks (e.g. a stale due time) gets nothing from a stopped schedule.
    outcome = on_due(
        beat.policy, IntervalTiming(1), replace(beat.state, next_due_at=beat.now), beat.now, beat.rng
    )
    assert outcome.emit == ()
    assert outcome.state.next_due_at is None


def test_a_stopped_fixed_rate_schedule_emits_nothing() -> None:
    """stop=True on a grid schedule also ends its emissions, pending runs included."""
    beat = TickBeat(parse({"missed_ticks": "coalesce_latest"}), period=1)
    beat.look()
    beat.advance(1)
    assert len(beat.state.pending) == 1
    beat.finish(stop=True)
    assert beat.state.stopped and beat.state.next_due_at is None
    assert beat.step(1, 5) == []


def test_a_timed_out_run_releases_its_slot_once_and_counts_as_a_failure() -> None:
    """A run settled timed_out frees its one slot and counts as a failure; the next run is then due."""
    beat = TickBeat(parse({"mode": "fixed_delay", "max_run_time": 1}), period=1)
    beat.look()
    beat.advance(1)  # the deadline passes: the reaper settles it
    beat.finish(RunState.TIMED_OUT)
    assert (beat.state.active_runs, beat.state.failures, beat.state.runs) == (0, 1, 0)
    assert beat.state.last_elapsed_ms == 1000
    assert len(beat.advance(1)) == 1
    beat.finish(stop=True)
    assert (beat.state.active_runs, beat.state.runs, beat.state.failures) == (0, 1, 1)


# -- bounded fixed-rate schedules ---------------------------------------------------------


def test_coalesced_serial_schedule_never_exceeds_one_active_and_one_pending_run() -> None:
    """With coalesce_latest busy ticks keep one pending run and skip the rest; it starts when a slot frees."""
    beat = TickBeat(parse({"missed_ticks": "coalesce_latest"}), period=1)
    assert len(beat.look()) == 1
    for _ in range(5):
        assert beat.advance(1) == []
        assert beat.state.active_runs == 1
        assert len(beat.state.pending) <= 1
    assert beat.state.skips >= 4
    assert len(beat.emitted) == 1
    beat.finish()
    started = beat.look()
    assert [e.scheduled_for for e in started] == [T0 + sec(5)]  # the latest busy tick
    assert beat.state.pending == ()
    assert len(beat.emitted) == 2
    assert beat.max_active == 1
    beat.finish()
    assert beat.state.active_runs == 0
    assert beat.state.runs == 2


def test_overlapping_runs_stay_within_the_policy_bound() -> None:
    """fixed_rate with max_concurrency=2 overlaps once, then skips ticks while both slots are busy."""
    beat = TickBeat(parse({"mode": "fixed_rate", "max_concurrency": 2}), period=1)
    for _ in range(5):
        beat.advance(1)
    assert beat.max_active == 2
    assert beat.state.active_runs == 2
    assert beat.state.overlaps == 1
    assert beat.state.skips >= 3
    beat.finish()
    beat.finish()
    assert beat.state.active_runs == 0
    assert beat.state.runs == 2


def test_overlap_is_flagged_on_the_emission_that_overlaps() -> None:
    """Only a run started while another is active is marked as an overlap."""
    beat = TickBeat(parse({"mode": "fixed_rate", "max_concurrency": 3}), period=10)
    first = beat.look()
    second = beat.advance(10)
    assert [e.overlap for e in first + second] == [False, True]
    beat.finish()
    beat.finish()
    assert beat.advance(10)[0].overlap is False


# -- grid and missed ticks ---------------------------------------------------------------


def test_a_late_tick_skips_the_missed_grid_ticks_and_runs_the_latest() -> None:
    """35 s late on a 10 s grid counts 4 ticks: the latest runs, 3 are skips, the grid moves 4 periods."""
    beat = TickBeat(parse({}), period=10)
    beat.now = T0 + sec(35)
    started = beat.look()
    assert [e.scheduled_for for e in started] == [T0 + sec(30)]
    assert started[0].drift_ms == 5000
    assert beat.state.skips == 3
    assert beat.state.grid_at == T0 + sec(40)
    assert beat.state.next_due_at == T0 + sec(40)
    assert beat.state.last_drift_ms == 35_000


def test_a_late_tick_starts_as_many_runs_as_slots_are_free() -> None:
    """fixed_rate with 3 slots, 5 ticks late: three start, each with its own grid time, two are skipped."""
    beat = TickBeat(parse({"mode": "fixed_rate", "max_concurrency": 3}), period=10)
    beat.now = T0 + sec(45)
    started = beat.look()
    assert sorted(e.scheduled_for for e in started) == [T0 + sec(20), T0 + sec(30), T0 + sec(40)]
    assert beat.state.skips == 2
    assert beat.state.overlaps == 2
    assert beat.state.grid_at == T0 + sec(50)


def test_a_late_coalesced_tick_keeps_exactly_one_pending_run() -> None:
    """Coalesce while busy: six missed ticks leave one pending run (the latest) and five skips."""
    beat = TickBeat(parse({"missed_ticks": "coalesce_latest"}), period=1)
    beat.look()
    beat.now = T0 + sec(6)
    assert beat.look() == []
    assert beat.state.pending == (T0 + sec(6),)
    assert beat.state.skips == 5


def test_catch_up_never_holds_more_than_max_pending() -> None:
    """catch_up keeps at most max_pending pending runs, oldest first; the excess is counted as skips."""
    beat = TickBeat(parse({"missed_ticks": "catch_up", "max_pending": 2}), period=1)
    beat.look()
    for n in range(1, 6):
        beat.advance(1)
        assert len(beat.state.pending) == min(n, 2)
    assert beat.state.pending == (T0 + sec(1), T0 + sec(2))
    assert beat.state.skips == 3
    beat.finish()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(1)]
    beat.finish()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(2)]
    assert not beat.state.pending


def test_a_late_catch_up_tick_starts_the_oldest_and_keeps_the_next_oldest() -> None:
    """10 ticks late with catch_up: the oldest runs, the next max_pending wait, the rest are skips."""
    beat = TickBeat(parse({"missed_ticks": "catch_up", "max_pending": 2}), period=1)
    beat.now = T0 + sec(10)
    assert [e.scheduled_for for e in beat.look()] == [T0]
    assert beat.state.pending == (T0 + sec(1), T0 + sec(2))
    assert beat.state.skips == 8
    assert beat.state.grid_at == T0 + sec(11)


def test_pending_runs_start_before_newer_ticks_when_a_slot_frees() -> None:
    """A slot freed just before a grid tick goes to the oldest pending run, not to the new tick."""
    beat = TickBeat(parse({"missed_ticks": "catch_up", "max_pending": 3}), period=1)
    beat.look()
    beat.step(1, 2)
    assert beat.state.pending == (T0 + sec(1), T0 + sec(2))
    beat.now += sec(0.5)
    beat.finish()  # the beat only looks again at the next grid tick
    beat.now = T0 + sec(3)
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(1)]
    assert beat.state.pending == (T0 + sec(2), T0 + sec(3))
    assert beat.state.skips == 0


def test_a_drained_pending_run_leaves_the_next_due_time_on_the_grid() -> None:
    """After a pending run starts between grid ticks, the schedule is next due on the grid, not before."""
    beat = TickBeat(parse({"missed_ticks": "coalesce_latest"}), period=60)
    beat.look()
    beat.advance(60)
    assert len(beat.state.pending) == 1
    beat.advance(5)
    beat.finish()
    assert beat.state.next_due_at == beat.now
    assert len(beat.look()) == 1
    assert beat.state.next_due_at == T0 + sec(120)


def test_a_trigger_while_busy_does_not_leave_the_schedule_due_in_the_past() -> None:
    """A triggered run waiting for a busy slot does not keep the schedule due (the beat would spin)."""
    beat = TickBeat(parse({}), period=60)
    beat.look()
    beat.advance(5)
    beat.trigger()
    assert beat.look() == []
    assert beat.state.triggers == (T0 + sec(5),)
    assert beat.state.next_due_at is not None and beat.state.next_due_at > beat.now
    beat.advance(1)
    beat.finish()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(5)]


def test_a_trigger_on_an_idle_fixed_delay_schedule_runs_once() -> None:
    """Triggering an idle fixed-delay schedule starts exactly one extra run, then the delay resumes."""
    beat = TickBeat(parse({"mode": "fixed_delay"}), period=60)
    beat.look()
    beat.advance(1)
    beat.finish()
    beat.advance(9)
    beat.trigger()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(10)]
    assert beat.state.triggers == ()
    beat.advance(1)
    beat.finish()
    assert beat.state.next_due_at == T0 + sec(71)
    assert beat.step(1, 59) == []
    assert len(beat.emitted) == 2


def test_a_trigger_on_a_busy_fixed_delay_schedule_runs_once_after_it() -> None:
    """Triggering a running fixed-delay schedule runs once after the active run, then waits `period`."""
    beat = TickBeat(parse({"mode": "fixed_delay"}), period=60)
    beat.look()
    beat.advance(5)
    beat.trigger()
    assert beat.look() == []
    beat.advance(1)
    beat.finish()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(5)]
    beat.advance(1)
    beat.finish()
    assert beat.state.next_due_at == beat.now + sec(60)
    assert beat.step(1, 30) == []
    assert len({e.scheduled_for for e in beat.emitted}) == len(beat.emitted) == 2


def every_minute(t: datetime) -> datetime:
    """A calendar grid: the first whole minute strictly after ``t``."""
    return t.replace(second=0, microsecond=0) + timedelta(minutes=1)


def test_a_calendar_schedule_skips_missed_ticks_like_an_interval() -> None:
    """A crontab-like schedule 3 minutes late runs the latest tick and skips the others."""
    beat = TickBeat(parse({}, schedule_kind="crontab"), period=60, timing=CalendarTiming(every_minute))
    beat.now = T0 + sec(190)
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(180)]
    assert beat.state.skips == 3
    assert beat.state.grid_at == T0 + sec(240)


# -- settlement ----------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", [s for s in RunState if s.terminal])
def test_each_terminal_state_counts_once_as_run_or_failure(outcome: RunState) -> None:
    """Settling frees one slot and counts `completed` as a run, every other terminal state as a failure."""
    policy = parse({"mode": "fixed_rate", "max_concurrency": 2})
    state = ScheduleState(active_runs=2, grid_at=T0, next_due_at=T0)
    new = on_settle(
        policy, state, outcome=outcome, elapsed_ms=5, now=T0, stop=False, gap_s=1, rng=random.Random(0)
    )
    assert new.active_runs == 1
    assert (new.runs, new.failures) == ((1, 0) if outcome is RunState.COMPLETED else (0, 1))
    assert new.last_elapsed_ms == 5


def test_settling_never_drives_active_runs_negative() -> None:
    """A settle with no active run leaves active_runs at zero."""
    policy = parse({})
    state = on_settle(
        policy,
        ScheduleState(active_runs=0),
        outcome=RunState.LOST,
        elapsed_ms=None,
        now=T0,
        stop=False,
        gap_s=1,
        rng=random.Random(0),
    )
    assert state.active_runs == 0
    assert state.failures == 1


def test_max_elapsed_keeps_the_longest_run() -> None:
    """last_elapsed_ms follows the latest run while max_elapsed_ms keeps the longest."""
    policy = parse({"mode": "fixed_rate", "max_concurrency": 2})
    state = ScheduleState(active_runs=2)
    kw: dict[str, Any] = {"now": T0, "stop": False, "gap_s": 1, "rng": random.Random(0)}
    state = on_settle(policy, state, outcome=RunState.COMPLETED, elapsed_ms=900, **kw)
    state = on_settle(policy, state, outcome=RunState.COMPLETED, elapsed_ms=100, **kw)
    assert (state.last_elapsed_ms, state.max_elapsed_ms) == (100, 900)


def test_settling_with_pending_runs_makes_the_schedule_due_now() -> None:
    """A freed slot with a pending run behind it makes the schedule due immediately."""
    policy = parse({"missed_ticks": "coalesce_latest"})
    state = ScheduleState(active_runs=1, pending=(T0,), grid_at=T0 + sec(60), next_due_at=T0 + sec(60))
    new = on_settle(
        policy,
        state,
        outcome=RunState.COMPLETED,
        elapsed_ms=1,
        now=T0 + sec(2),
        stop=False,
        gap_s=60,
        rng=random.Random(0),
    )
    assert new.next_due_at == T0 + sec(2)


# -- jitter ----------------------------------------------------------------------------------


def test_jitter_is_bounded_by_a_tenth_of_the_period() -> None:
    """Jitter is a positive delay of at most min(jitter, period / 10)."""
    rng = random.Random(3)
    big = parse({"jitter": 30})
    small = parse({"jitter": 0.2})
    delays = [jitter_delay(big, 5, rng) for _ in range(200)]
    assert all(timedelta(0) <= d <= sec(0.5) for d in delays)
    assert max(delays) > sec(0.25)  # it really is random, not always zero
    assert all(timedelta(0) <= jitter_delay(small, 3600, rng) <= sec(0.2) for _ in range(200))
    assert jitter_delay(parse({}), 3600, rng) == timedelta(0)
    assert jitter_delay(big, 0, rng) == timedelta(0)


def test_jitter_delays_due_times_but_never_moves_the_grid() -> None:
    """With jitter, runs are due a little after their grid time but keep that exact time as scheduled_for."""
    beat = TickBeat(parse({"jitter": 100}), period=10)
    assert beat.state.grid_at == T0
    assert T0 <= beat.state.next_due_at <= T0 + sec(1)  # type: ignore[operator]
    delays = []
    for i in range(50):
        due = beat.state.next_due_at
        assert due is not None
        grid = T0 + sec(10 * i)
        assert beat.state.grid_at == grid
        assert grid <= due <= grid + sec(1)
        delays.append(due - grid)
        beat.now = due
        started = beat.look()
        assert [e.scheduled_for for e in started] == [grid]
        beat.finish()
    assert beat.state.skips == 0
    assert len(set(delays)) > 1


def test_fixed_delay_jitter_is_added_after_the_delay() -> None:
    """A fixed-delay schedule with jitter is due between finish + period and finish + period * 1.1."""
    beat = TickBeat(parse({"mode": "fixed_delay", "jitter": 5}), period=10)
    for _ in range(20):
        due = beat.state.next_due_at
        assert due is not None
        beat.now = due
        assert len(beat.look()) == 1
        beat.advance(3)
        finish = beat.now
        beat.finish()
        assert finish + sec(10) <= beat.state.next_due_at <= finish + sec(11)  # type: ignore[operator]


def test_a_rate_schedule_without_a_grid_anchors_on_the_next_tick_without_emitting() -> None:
    """A resumed calendar schedule (grid cleared) rejoins its grid at the next tick: no missed ticks."""
    import random
    from datetime import datetime, timedelta

    from celery_boundedbeat.core.due import on_due
    from celery_boundedbeat.core.policy import Policy
    from celery_boundedbeat.core.ticks import ScheduleState
    from celery_boundedbeat.core.timing import CalendarTiming

    def every_minute(t: datetime) -> datetime:
        return t.replace(second=0, microsecond=0) + timedelta(minutes=1)

    now = datetime(2026, 1, 1, 10, 0, 30, tzinfo=UTC)
    outcome = on_due(
        Policy(), CalendarTiming(every_minute), ScheduleState(next_due_at=now), now, random.Random(0)
    )
    assert outcome.emit == ()
    assert outcome.state.grid_at == datetime(2026, 1, 1, 10, 1, tzinfo=UTC)
    assert outcome.state.next_due_at == outcome.state.grid_at
    assert outcome.state.skips == 0


# -- trigger ---------------------------------------------------------------------------------


def test_a_trigger_queues_one_run_apart_and_never_delays_an_earlier_due_time() -> None:
    """A trigger queues a run at now apart from pending ticks, due now or at an earlier due time."""
    state = ScheduleState(pending=(T0,), grid_at=T0 + sec(60), next_due_at=T0 + sec(60))
    new = on_trigger(state, T0 + sec(5), paused=False)
    assert isinstance(new, Triggered)
    assert new.scheduled_for == T0 + sec(5)
    assert (new.state.pending, new.state.triggers) == ((T0,), (T0 + sec(5),))
    assert new.state.waiting_runs == 2
    assert (new.state.grid_at, new.state.next_due_at) == (T0 + sec(60), T0 + sec(5))
    earlier = on_trigger(replace(state, next_due_at=T0 + sec(1)), T0 + sec(5), paused=False)
    assert isinstance(earlier, Triggered) and earlier.state.next_due_at == T0 + sec(1)
    idle = on_trigger(ScheduleState(), T0, paused=False)
    assert isinstance(idle, Triggered) and idle.state.next_due_at == T0


def test_a_trigger_on_a_busy_coalescing_schedule_survives_missed_ticks() -> None:
    """Missed ticks on a busy coalesce_latest schedule never replace a queued trigger, and each is counted."""
    beat = TickBeat(parse({"missed_ticks": "coalesce_latest"}), period=1)
    beat.look()
    beat.advance(0.5)
    assert isinstance(beat.trigger(), Triggered)
    assert beat.step(1, 5) == []  # five grid ticks find the slot busy
    assert beat.state.triggers == (T0 + sec(0.5),)
    assert beat.state.pending == (T0 + sec(5),)
    assert (beat.state.skips, beat.state.waiting_runs) == (4, 2)
    assert beat.ticks_accounted() == 6
    beat.finish()
    started = beat.look()
    assert [(e.scheduled_for, e.triggered) for e in started] == [(T0 + sec(0.5), True)]
    assert started[0].drift_ms == 5000  # waited from the trigger to the free slot
    beat.finish()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(5)]
    assert beat.ticks_accounted() == 6
    assert beat.max_active == 1


def test_queued_triggers_go_before_pending_ticks_and_leave_them_their_room() -> None:
    """Triggers take the next free slot before catch_up's pending ticks, and do not use up max_pending."""
    beat = TickBeat(parse({"missed_ticks": "catch_up", "max_pending": 2}), period=1)
    beat.look()
    beat.advance(0.25)
    beat.trigger()
    beat.trigger()
    beat.step(1, 3)  # ticks at 1, 2 and 3 find the slot busy
    assert beat.state.pending == (T0 + sec(1), T0 + sec(2))
    assert beat.state.triggers == (T0 + sec(0.25), T0 + sec(0.25) + timedelta(microseconds=1))
    assert beat.state.skips == 1
    order = []
    for _ in range(4):
        beat.finish()
        order.extend((e.scheduled_for, e.triggered) for e in beat.look())
    assert order == [
        (T0 + sec(0.25), True),
        (T0 + sec(0.25) + timedelta(microseconds=1), True),
        (T0 + sec(1), False),
        (T0 + sec(2), False),
    ]
    assert beat.ticks_accounted() == 4


def test_queued_triggers_are_bounded_and_the_one_past_the_bound_is_refused() -> None:
    """At most MAX_QUEUED_TRIGGERS wait; one more is refused with a reason, and accepted once one started."""
    beat = TickBeat(parse({}), period=3600)
    beat.look()
    for _ in range(MAX_QUEUED_TRIGGERS):
        assert isinstance(beat.trigger(), Triggered)
    refused = beat.trigger()
    assert isinstance(refused, TriggerRefused)
    assert f"{MAX_QUEUED_TRIGGERS} triggered runs already wait" in refused.reason
    assert len(beat.state.triggers) == MAX_QUEUED_TRIGGERS
    beat.advance(1)
    beat.finish()
    assert len(beat.look()) == 1
    assert isinstance(beat.trigger(), Triggered)
    assert len(beat.state.triggers) == MAX_QUEUED_TRIGGERS


@pytest.mark.parametrize(("paused", "stopped", "word"), [(True, False, "paused"), (False, True, "stopped")])
def test_a_trigger_on_a_paused_or_stopped_schedule_is_refused(paused: bool, stopped: bool, word: str) -> None:
    """A paused or stopped schedule refuses a trigger with a reason, not a run that waits silently."""
    state = ScheduleState(grid_at=T0 + sec(60), next_due_at=T0 + sec(60), stopped=stopped)
    refused = on_trigger(state, T0, paused=paused)
    assert isinstance(refused, TriggerRefused)
    assert word in refused.reason and "resume" in refused.reason


def test_a_triggered_run_is_scheduled_for_the_trigger_time() -> None:
    """An idle grid schedule runs a trigger at once, with the trigger time as scheduled_for, off the grid."""
    beat = TickBeat(parse({"mode": "fixed_rate", "max_concurrency": 2}), period=10)
    beat.look()
    beat.finish()
    beat.advance(3.5)
    decided = beat.trigger()
    assert isinstance(decided, Triggered) and decided.scheduled_for == T0 + sec(3.5)
    assert [(e.scheduled_for, e.triggered, e.drift_ms) for e in beat.look()] == [(T0 + sec(3.5), True, 0)]
    assert beat.state.next_due_at == T0 + sec(10)  # the grid is untouched
    assert beat.state.skips == 0


def test_triggers_in_one_microsecond_get_distinct_times() -> None:
    """Two triggers at the same instant, or one at the time of a run or pending tick, are moved 1 µs apart."""
    us = timedelta(microseconds=1)
    state = ScheduleState(active_runs=1, pending=(T0,), grid_at=T0 + sec(1), next_due_at=T0 + sec(1))
    first = on_trigger(state, T0, paused=False)
    assert isinstance(first, Triggered) and first.scheduled_for == T0 + us  # T0 is the pending tick
    second = on_trigger(first.state, T0, paused=False)
    assert isinstance(second, Triggered) and second.scheduled_for == T0 + 2 * us
    after_a_run = on_trigger(ScheduleState(), T0 + sec(5), paused=False, last_run_at=T0 + sec(5))
    assert isinstance(after_a_run, Triggered) and after_a_run.scheduled_for == T0 + sec(5) + us
    older_run = on_trigger(ScheduleState(), T0 + sec(5), paused=False, last_run_at=T0)
    assert isinstance(older_run, Triggered) and older_run.scheduled_for == T0 + sec(5)


def test_a_trigger_at_the_time_of_a_tick_not_handled_yet_does_not_share_its_time() -> None:
    """A trigger made at the exact time of an overdue grid tick runs 1 µs later, beside that tick's run."""
    beat = TickBeat(parse({"mode": "fixed_rate", "max_concurrency": 3}), period=10)
    beat.look()
    beat.finish()
    beat.now = T0 + sec(20)  # the beat is late: ticks at 10 and 20 are due, not handled yet
    beat.trigger()
    started = sorted((e.scheduled_for, e.triggered) for e in beat.look())
    assert started == [(T0 + sec(10), False), (T0 + sec(20), False), (T0 + sec(20.000001), True)]


def test_a_trigger_on_a_calendar_grid_being_anchored_does_not_share_the_anchor_tick() -> None:
    """A resumed calendar schedule anchored on a tick at now runs a trigger made at now 1 µs after it."""
    now = T0 + sec(120)
    state = on_resume(
        parse({}, schedule_kind="crontab"), ScheduleState(grid_at=T0, next_due_at=T0), now, period=None
    )
    decided = on_trigger(state, now, paused=False)
    assert isinstance(decided, Triggered)
    outcome = on_due(parse({}), CalendarTiming(every_minute), decided.state, now, random.Random(0))
    assert [e.scheduled_for for e in outcome.emit] == [now + timedelta(microseconds=1)]
    assert outcome.state.grid_at == now


def test_a_coalesce_that_replaces_several_pending_ticks_counts_each_as_a_skip() -> None:
    """A row holding two pending ticks (written before the bound was enforced) loses both to one skip each."""
    state = ScheduleState(
        active_runs=1, pending=(T0 + sec(1), T0 + sec(2)), grid_at=T0 + sec(3), next_due_at=T0 + sec(3)
    )
    outcome = on_due(
        parse({"missed_ticks": "coalesce_latest"}), IntervalTiming(1), state, T0 + sec(4), random.Random(0)
    )
    assert outcome.state.pending == (T0 + sec(4),)
    assert outcome.skipped == outcome.state.skips == 3  # ticks 1 and 2 replaced, tick 3 coalesced


@pytest.mark.parametrize(
    ("raw", "kept", "skips"),
    [
        ({"missed_ticks": "catch_up", "max_pending": 3}, (1, 2, 3), 0),
        ({"missed_ticks": "catch_up", "max_pending": 2}, (1, 2), 1),
        ({"missed_ticks": "coalesce_latest"}, (3,), 2),
        ({}, (), 3),
        ({"mode": "fixed_delay"}, (), 3),
    ],
)
def test_a_changed_policy_drops_the_pending_ticks_past_its_bound_as_skips(
    raw: dict[str, Any], kept: tuple[int, ...], skips: int
) -> None:
    """Pending ticks past a new policy's bound are skips (catch_up keeps the oldest, coalesce the latest)."""
    pending = (T0 + sec(1), T0 + sec(2), T0 + sec(3))
    state = ScheduleState(
        active_runs=1, pending=pending, triggers=(T0,), grid_at=T0 + sec(4), next_due_at=T0 + sec(4)
    )
    new = reconcile(spec_of(raw), state)
    assert new.pending == tuple(T0 + sec(k) for k in kept)
    assert (new.skips, new.triggers) == (skips, (T0,))


# -- resume ----------------------------------------------------------------------------------


def test_resuming_an_idle_fixed_delay_schedule_makes_it_due_now_and_lifts_a_stop() -> None:
    """Resume makes an idle fixed-delay schedule due at once and clears stop_schedule()."""
    state = ScheduleState(stopped=True, runs=4)
    new = on_resume(parse({"mode": "fixed_delay"}), state, T0 + sec(50), period=10)
    assert new == replace(state, stopped=False, next_due_at=T0 + sec(50))


def test_resuming_a_busy_fixed_delay_schedule_leaves_the_due_time_to_the_settle() -> None:
    """A fixed-delay schedule resumed while its run is active stays without a due time until it settles."""
    policy = parse({"mode": "fixed_delay"})
    new = on_resume(policy, ScheduleState(active_runs=1), T0 + sec(50), period=10)
    assert (new.next_due_at, new.stopped) == (None, False)
    settled = on_settle(
        policy,
        new,
        outcome=RunState.COMPLETED,
        elapsed_ms=1,
        now=T0 + sec(51),
        stop=False,
        gap_s=10,
        rng=random.Random(0),
    )
    assert settled.next_due_at == T0 + sec(61)


@pytest.mark.parametrize(("paused_until", "rejoin_at"), [(55, 60), (50, 60), (0.5, 10)])
def test_a_resumed_interval_grid_rejoins_at_the_first_tick_after_now(
    paused_until: float, rejoin_at: float
) -> None:
    """Ticks passed while paused are not missed: the grid moves to its first tick after now, none skipped."""
    state = ScheduleState(grid_at=T0, next_due_at=T0 + sec(0.3), skips=1)
    now = T0 + sec(paused_until)
    new = on_resume(parse({}), state, now, period=10)
    assert (new.grid_at, new.next_due_at) == (T0 + sec(rejoin_at), T0 + sec(rejoin_at))
    outcome = on_due(parse({}), IntervalTiming(10), new, T0 + sec(rejoin_at), random.Random(0))
    assert [e.scheduled_for for e in outcome.emit] == [T0 + sec(rejoin_at)]
    assert outcome.state.skips == 1


def test_a_resumed_calendar_grid_in_the_past_is_cleared_and_due_now() -> None:
    """A past calendar grid (no period) is cleared and due now; the next look re-anchors it without a run."""
    state = ScheduleState(grid_at=T0, next_due_at=T0)
    now = T0 + sec(130)
    new = on_resume(parse({}, schedule_kind="crontab"), state, now, period=None)
    assert (new.grid_at, new.next_due_at) == (None, now)
    outcome = on_due(parse({}), CalendarTiming(every_minute), new, now, random.Random(0))
    assert outcome.emit == ()
    assert (outcome.state.grid_at, outcome.state.skips) == (T0 + sec(180), 0)


@pytest.mark.parametrize(
    ("next_due", "resumed_due"),
    [(T0 + sec(60.5), T0 + sec(60.5)), (None, T0 + sec(60)), (T0 + sec(10), T0 + sec(60))],
)
def test_a_resumed_grid_still_ahead_keeps_its_due_time_but_never_before_the_grid(
    next_due: datetime | None, resumed_due: datetime
) -> None:
    """A grid tick still ahead keeps its (jittered) due time; a missing or earlier one moves to that tick."""
    state = ScheduleState(grid_at=T0 + sec(60), next_due_at=next_due)
    new = on_resume(parse({"jitter": 1}), state, T0 + sec(30), period=10)
    assert (new.grid_at, new.next_due_at) == (T0 + sec(60), resumed_due)


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ({}, ScheduleState(active_runs=1, pending=(T0,), grid_at=T0 + sec(60), next_due_at=T0 + sec(60))),
        ({}, ScheduleState(active_runs=1, triggers=(T0,), grid_at=T0 + sec(60), next_due_at=T0 + sec(60))),
        ({"mode": "fixed_delay"}, ScheduleState(active_runs=1, triggers=(T0,))),
    ],
)
def test_waiting_runs_make_a_resumed_schedule_due_now(raw: dict[str, Any], state: ScheduleState) -> None:
    """A resumed schedule with pending ticks or queued triggers is due at once, so a free slot starts them."""
    new = on_resume(parse(raw), state, T0 + sec(30), period=10)
    assert new.next_due_at == T0 + sec(30)
    assert (new.pending, new.triggers) == (state.pending, state.triggers)


# -- config changes at beat start --------------------------------------------------------------


def spec_of(raw: dict[str, Any] | None = None, period: float = 10) -> EntrySpec:
    """An interval entry with the policy ``raw``."""
    return EntrySpec(
        name="entry",
        task="proj.task",
        policy=parse(raw),
        timing=IntervalTiming(period),
        schedule_repr=f"every {period:g}s",
        period=period,
    )


def reconcile(
    spec: EntrySpec,
    state: ScheduleState,
    *,
    changed: bool = True,
    old_schedule: str = "every 10s",
    old_mode: Mode = Mode.FIXED_RATE_NO_OVERLAP,
    now: datetime = T0 + timedelta(seconds=100),
) -> ScheduleState:
    return on_config_change(
        spec,
        state,
        config_changed=changed,
        old_schedule=old_schedule,
        old_mode=old_mode,
        now=now,
        rng=random.Random(0),
    )


def test_an_unchanged_entry_keeps_its_state() -> None:
    """An entry whose config did not change keeps its grid, due time and counters across a restart."""
    state = ScheduleState(grid_at=T0 + sec(10), next_due_at=T0 + sec(10), runs=3, pending=(T0,))
    assert reconcile(spec_of(), state, changed=False) == state


def test_a_changed_entry_with_the_same_timing_keeps_its_grid() -> None:
    """A change to the task, args or other policy keys leaves the grid and due time alone."""
    state = ScheduleState(grid_at=T0 + sec(10), next_due_at=T0 + sec(10.4), runs=3)
    assert reconcile(spec_of({"jitter": 1}), state) == state


def test_a_new_schedule_restarts_the_grid_from_now_and_keeps_the_counters() -> None:
    """Another schedule restarts the grid after initial_delay from now; counters and waiting runs stay."""
    state = ScheduleState(
        active_runs=1, grid_at=T0 + sec(5), next_due_at=T0 + sec(5), runs=3, skips=2, pending=(T0,)
    )
    new = reconcile(
        spec_of({"initial_delay": 2, "missed_ticks": "coalesce_latest"}), state, old_schedule="every 5s"
    )
    assert new == replace(state, grid_at=T0 + sec(102), next_due_at=T0 + sec(102))


def test_a_trigger_queued_before_a_restart_is_due_at_once_when_a_slot_is_free() -> None:
    """A restarted grid with initial_delay does not hold back a queued trigger while a slot is free."""
    decided = on_trigger(ScheduleState(grid_at=T0 + sec(10), next_due_at=T0 + sec(10)), T0, paused=False)
    assert isinstance(decided, Triggered)
    new = reconcile(spec_of({"initial_delay": 1.5}, period=2.5), decided.state, now=T0)
    assert (new.grid_at, new.next_due_at, new.triggers) == (T0 + sec(1.5), T0, (T0,))
    outcome = on_due(parse({"initial_delay": 1.5}), IntervalTiming(2.5), new, T0, random.Random(0))
    assert [(e.scheduled_for, e.triggered) for e in outcome.emit] == [(T0, True)]


def test_a_more_concurrent_policy_starts_waiting_runs_at_once() -> None:
    """Raising max_concurrency makes pending ticks due now instead of at the next grid tick."""
    state = ScheduleState(
        active_runs=1, pending=(T0 + sec(1),), grid_at=T0 + sec(20), next_due_at=T0 + sec(20)
    )
    raw = {"mode": "fixed_rate", "max_concurrency": 2, "missed_ticks": "coalesce_latest"}
    assert reconcile(spec_of(raw), state, old_mode=Mode.FIXED_RATE, now=T0 + sec(15)).next_due_at == T0 + sec(
        15
    )


def test_a_grid_restarted_in_the_microsecond_of_a_run_starts_just_after_it() -> None:
    """A new timing applied at the very time of the newest run starts its grid 1 µs later, not on that run."""
    state = ScheduleState(active_runs=1, grid_at=T0 + sec(110), next_due_at=T0 + sec(110))
    new = on_config_change(
        spec_of({"mode": "fixed_rate", "max_concurrency": 2}),
        state,
        config_changed=True,
        old_schedule="every 10s",
        old_mode=Mode.FIXED_RATE_NO_OVERLAP,
        now=T0 + sec(100),
        rng=random.Random(0),
        last_run_at=T0 + sec(100),
    )
    assert new.grid_at == new.next_due_at == T0 + sec(100) + timedelta(microseconds=1)
    older = reconcile(spec_of({"mode": "fixed_rate", "max_concurrency": 2}), state, now=T0 + sec(100))
    assert older.grid_at == T0 + sec(100)  # no run at that time: the grid starts at now


def test_a_new_mode_restarts_the_grid_from_now() -> None:
    """A fixed-delay entry switched to a grid mode gets a grid starting now and is due now."""
    state = ScheduleState(next_due_at=None, runs=1)
    new = reconcile(spec_of({}), state, old_mode=Mode.FIXED_DELAY)
    assert (new.grid_at, new.next_due_at, new.runs) == (T0 + sec(100), T0 + sec(100), 1)


def test_switching_an_idle_schedule_to_fixed_delay_drops_the_grid_and_is_due_after_the_delay() -> None:
    """An idle grid schedule switched to fixed delay loses its grid and is due initial_delay after now."""
    state = ScheduleState(grid_at=T0 + sec(110), next_due_at=T0 + sec(110))
    new = reconcile(spec_of({"mode": "fixed_delay", "initial_delay": 3}), state)
    assert (new.grid_at, new.next_due_at) == (None, T0 + sec(103))


def test_switching_to_fixed_delay_while_a_run_is_active_waits_for_its_settle() -> None:
    """A schedule switched to fixed delay while a run is active loses its grid but not its due time."""
    state = ScheduleState(active_runs=1, grid_at=T0 + sec(110), next_due_at=T0 + sec(110))
    new = reconcile(spec_of({"mode": "fixed_delay"}), state)
    assert (new.grid_at, new.next_due_at, new.active_runs) == (None, T0 + sec(110), 1)


def test_an_unchanged_idle_fixed_delay_entry_without_a_due_time_is_due_again() -> None:
    """A fixed-delay run settled while no period was known leaves no due time: beat start sets one."""
    state = ScheduleState(next_due_at=None, runs=2)
    new = reconcile(spec_of({"mode": "fixed_delay", "initial_delay": 1}), state, changed=False)
    assert new == replace(state, next_due_at=T0 + sec(101))


@pytest.mark.parametrize("state", [ScheduleState(stopped=True), ScheduleState(active_runs=1)])
def test_a_stopped_or_busy_schedule_without_a_due_time_stays_without_one(state: ScheduleState) -> None:
    """A stopped schedule, or one with an active run (its settle sets the next due), gets no due time."""
    assert reconcile(spec_of({"mode": "fixed_delay"}), state, changed=False) == state
