"""Policy parsing and tick arithmetic, driven by a fake clock (ports of scheduled.rs tests)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from celery_boundedbeat.enums import MissedTicks, Mode, RunState
from celery_boundedbeat.policy import (
    CalendarTiming,
    Emission,
    IntervalTiming,
    Policy,
    ScheduleState,
    Timing,
    initial_state,
    jitter_delay,
    on_due,
    on_settle,
    parse_policy,
)

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def sec(n: float) -> timedelta:
    return timedelta(seconds=n)


def parse(raw: dict[str, Any] | None = None, **kwargs: Any) -> Policy:
    policy, problems = parse_policy("entry", raw or {}, **kwargs)
    assert problems == [], problems
    assert policy is not None
    return policy


def problems_of(raw: Any, default: dict[str, Any] | None = None, kind: str = "interval") -> list[Any]:
    policy, problems = parse_policy("entry", raw, default, schedule_kind=kind)
    assert policy is None
    assert problems
    return problems


def keys_of(problems: list[Any]) -> set[str]:
    return {key for _entry, key, _reason in problems}


@dataclass
class Beat:
    """A fake beat: a fake clock, the policy functions, and the runs they emitted."""

    policy: Policy
    period: float
    timing: Timing | None = None
    now: datetime = T0
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    state: ScheduleState = field(init=False)
    active: list[Emission] = field(default_factory=list)
    emitted: list[Emission] = field(default_factory=list)
    max_active: int = 0

    def __post_init__(self) -> None:
        if self.timing is None:
            self.timing = IntervalTiming(self.period)
        self.state = initial_state(self.policy, self.timing, self.now, self.rng)

    def look(self) -> list[Emission]:
        """What the beat does when it wakes: handle the schedule if it is due."""
        assert self.timing is not None
        due = self.state.next_due_at
        if due is None or due > self.now:
            return []
        outcome = on_due(self.policy, self.timing, self.state, self.now, self.rng)
        self.state = outcome.state
        self.active.extend(outcome.emit)
        self.emitted.extend(outcome.emit)
        assert self.state.active_runs == len(self.active)
        self.max_active = max(self.max_active, len(self.active))
        return list(outcome.emit)

    def advance(self, seconds: float) -> list[Emission]:
        self.now += sec(seconds)
        return self.look()

    def step(self, seconds: float, times: int) -> list[Emission]:
        """Advance in steps of ``seconds``, the beat looking after every step."""
        out: list[Emission] = []
        for _ in range(times):
            out.extend(self.advance(seconds))
        return out

    def finish(
        self, outcome: RunState = RunState.COMPLETED, *, stop: bool = False, oldest: bool = True
    ) -> Emission:
        """Settle one active run now (the oldest by default) and let the beat look again."""
        run = self.active.pop(0 if oldest else -1)
        self.state = on_settle(
            self.policy,
            self.state,
            outcome=outcome,
            elapsed_ms=int((self.now - run.scheduled_for).total_seconds() * 1000),
            now=self.now,
            stop=stop,
            gap_s=self.period,
            rng=self.rng,
        )
        assert self.state.active_runs == len(self.active)
        return run

    def trigger(self) -> None:
        """What ``Store.trigger`` does to the state: one pending run, due now."""
        due = self.state.next_due_at
        self.state = replace(
            self.state,
            pending=(*self.state.pending, self.now),
            next_due_at=self.now if due is None else min(due, self.now),
        )


# -- the mode/policy contract ------------------------------------------------------------


def test_default_policy_is_fixed_rate_no_overlap_with_skip() -> None:
    """A schedule without a policy is fixed_rate_no_overlap + skip, one run at a time."""
    policy = parse(None)
    assert policy.mode is Mode.FIXED_RATE_NO_OVERLAP
    assert policy.missed_ticks is MissedTicks.SKIP
    assert policy.limit == 1
    assert policy.initial_delay == 0.0
    assert (policy.max_pending, policy.max_concurrency, policy.max_run_time, policy.jitter) == (
        None,
        None,
        None,
        None,
    )


@pytest.mark.parametrize("mode", ["fixed_delay", "fixed_rate_no_overlap"])
def test_serial_modes_refuse_a_concurrency_bound(mode: str) -> None:
    """fixed_delay and fixed_rate_no_overlap are serial: a max_concurrency contradicts them."""
    problems = problems_of({"mode": mode, "max_concurrency": 2})
    assert keys_of(problems) == {"policy.max_concurrency"}
    assert all(entry == "entry" for entry, _k, _r in problems)
    assert mode in problems[0][2]
    assert parse({"mode": mode}).limit == 1


def test_fixed_rate_needs_max_concurrency() -> None:
    """fixed_rate without max_concurrency is refused; with it, the bound is the limit."""
    problems = problems_of({"mode": "fixed_rate"})
    assert keys_of(problems) == {"policy.max_concurrency"}
    assert "required" in problems[0][2]
    assert parse({"mode": "fixed_rate", "max_concurrency": 3}).limit == 3


def test_catch_up_requires_max_pending_and_others_forbid_it() -> None:
    """catch_up needs max_pending, and max_pending is refused with any other missed_ticks."""
    assert keys_of(problems_of({"missed_ticks": "catch_up"})) == {"policy.max_pending"}
    assert keys_of(problems_of({"missed_ticks": "skip", "max_pending": 2})) == {"policy.max_pending"}
    assert keys_of(problems_of({"missed_ticks": "coalesce_latest", "max_pending": 2})) == {
        "policy.max_pending"
    }
    assert parse({"missed_ticks": "catch_up", "max_pending": 4}).max_pending == 4


def test_fixed_delay_refuses_crontab_and_missed_tick_policies() -> None:
    """fixed_delay needs an interval schedule and its missed_ticks must stay skip."""
    problems = problems_of({"mode": "fixed_delay"}, kind="crontab")
    assert keys_of(problems) == {"schedule"}
    assert "crontab" in problems[0][2]
    assert keys_of(problems_of({"mode": "fixed_delay"}, kind="solar")) == {"schedule"}
    assert keys_of(problems_of({"mode": "fixed_delay", "missed_ticks": "coalesce_latest"})) == {
        "policy.missed_ticks"
    }
    assert (
        parse({"mode": "fixed_rate_no_overlap"}, schedule_kind="crontab").mode is Mode.FIXED_RATE_NO_OVERLAP
    )


def test_unknown_keys_modes_and_missed_ticks_are_refused() -> None:
    """Unknown policy keys, modes and missed_ticks values are each named."""
    assert keys_of(problems_of({"max_runs": 2})) == {"policy.max_runs"}
    problems = problems_of({"mode": "fixed_rate_allow_overlap"})
    assert keys_of(problems) == {"policy.mode"}
    assert "fixed_rate_allow_overlap" in problems[0][2]
    assert keys_of(problems_of({"missed_ticks": "latest"})) == {"policy.missed_ticks"}
    assert keys_of(problems_of("fixed_delay")) == {"policy"}


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"mode": "fixed_rate", "max_concurrency": True}, "policy.max_concurrency"),
        ({"mode": "fixed_rate", "max_concurrency": 2.0}, "policy.max_concurrency"),
        ({"mode": "fixed_rate", "max_concurrency": "2"}, "policy.max_concurrency"),
        ({"mode": "fixed_rate", "max_concurrency": 0}, "policy.max_concurrency"),
        ({"missed_ticks": "catch_up", "max_pending": False}, "policy.max_pending"),
        ({"missed_ticks": "catch_up", "max_pending": -1}, "policy.max_pending"),
        ({"initial_delay": "5"}, "policy.initial_delay"),
        ({"initial_delay": True}, "policy.initial_delay"),
        ({"initial_delay": -1}, "policy.initial_delay"),
        ({"max_run_time": 0}, "policy.max_run_time"),
        ({"max_run_time": float("nan")}, "policy.max_run_time"),
        ({"jitter": -0.5}, "policy.jitter"),
        ({"jitter": float("inf")}, "policy.jitter"),
        ({"mode": 1}, "policy.mode"),
    ],
)
def test_wrong_types_and_values_are_refused(raw: dict[str, Any], key: str) -> None:
    """Wrong types (a bool is not an int) and out-of-range values name the offending key."""
    assert keys_of(problems_of(raw)) == {key}


def test_durations_accept_numbers_and_timedeltas() -> None:
    """initial_delay, max_run_time and jitter take seconds or a timedelta."""
    policy = parse(
        {"initial_delay": timedelta(minutes=1), "max_run_time": 2, "jitter": timedelta(seconds=1.5)}
    )
    assert (policy.initial_delay, policy.max_run_time, policy.jitter) == (60.0, 2.0, 1.5)


def test_every_problem_is_reported_at_once() -> None:
    """A policy with several mistakes reports all of them, each naming the entry."""
    problems = problems_of({"mode": "fixed_rate", "missed_ticks": "catch_up", "jitter": "x", "colour": "red"})
    assert keys_of(problems) == {
        "policy.max_concurrency",
        "policy.max_pending",
        "policy.jitter",
        "policy.colour",
    }
    assert {entry for entry, _k, _r in problems} == {"entry"}


def test_entry_keys_override_the_default_and_the_merge_is_validated() -> None:
    """An entry's keys override the default policy's, and the merged result is validated."""
    default = {"mode": "fixed_rate", "max_concurrency": 3}
    assert parse({"max_concurrency": 5}, default=default).limit == 5
    policy, problems = parse_policy("entry", {"mode": "fixed_delay"}, default)
    assert policy is None
    assert keys_of(problems) == {"policy.max_concurrency"}


def test_policy_json_round_trips() -> None:
    """A policy written to the database reads back equal."""
    policy = parse({"mode": "fixed_rate", "max_concurrency": 2, "max_run_time": 5, "jitter": 1})
    assert Policy.from_json(policy.to_json()) == policy


# -- fixed delay ---------------------------------------------------------------------------


def test_fixed_delay_waits_for_the_first_delay_and_then_for_each_completion() -> None:
    """The first run is due after initial_delay, nothing while it runs, the next `period` after it ends."""
    beat = Beat(parse({"mode": "fixed_delay", "initial_delay": 2}), period=3)
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
    beat = Beat(parse({"mode": "fixed_delay"}), period=10)
    beat.look()
    beat.advance(4)
    beat.finish(RunState.FAILED)
    assert beat.state.next_due_at == T0 + sec(14)
    assert (beat.state.runs, beat.state.failures) == (0, 1)


def test_a_controlled_schedule_ends_after_a_stop() -> None:
    """A run that settles with stop=True leaves the schedule stopped; nothing more is emitted."""
    beat = Beat(parse({"mode": "fixed_delay"}), period=1)
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
    beat = Beat(parse({"missed_ticks": "coalesce_latest"}), period=1)
    beat.look()
    beat.advance(1)
    assert len(beat.state.pending) == 1
    beat.finish(stop=True)
    assert beat.state.stopped and beat.state.next_due_at is None
    assert beat.step(1, 5) == []


def test_a_timed_out_run_releases_its_slot_once_and_counts_as_a_failure() -> None:
    """A run settled timed_out frees its one slot and counts as a failure; the next run is then due."""
    beat = Beat(parse({"mode": "fixed_delay", "max_run_time": 1}), period=1)
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
    beat = Beat(parse({"missed_ticks": "coalesce_latest"}), period=1)
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
    beat = Beat(parse({"mode": "fixed_rate", "max_concurrency": 2}), period=1)
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
    beat = Beat(parse({"mode": "fixed_rate", "max_concurrency": 3}), period=10)
    first = beat.look()
    second = beat.advance(10)
    assert [e.overlap for e in first + second] == [False, True]
    beat.finish()
    beat.finish()
    assert beat.advance(10)[0].overlap is False


# -- grid and missed ticks ---------------------------------------------------------------


@pytest.mark.parametrize(("overdue", "count"), [(0, 1), (9.999, 1), (10, 2), (35, 4), (40, 5)])
def test_interval_timing_counts_one_plus_overdue_over_period(overdue: float, count: int) -> None:
    """A tick seen `overdue` seconds late has passed 1 + overdue // period grid ticks."""
    passed, tick_at, next_tick = IntervalTiming(10).passed(T0, T0 + sec(overdue))
    assert passed == count
    assert [tick_at(i) for i in range(passed)] == [T0 + sec(10 * i) for i in range(count)]
    assert next_tick == T0 + sec(10 * count)
    assert next_tick > T0 + sec(overdue)


def test_interval_timing_counts_nothing_before_the_grid() -> None:
    """Before its grid time nothing has passed and the next tick is the grid time."""
    passed, _tick_at, next_tick = IntervalTiming(10).passed(T0, T0 - sec(1))
    assert (passed, next_tick) == (0, T0)


def test_a_late_tick_skips_the_missed_grid_ticks_and_runs_the_latest() -> None:
    """35 s late on a 10 s grid counts 4 ticks: the latest runs, 3 are skips, the grid moves 4 periods."""
    beat = Beat(parse({}), period=10)
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
    beat = Beat(parse({"mode": "fixed_rate", "max_concurrency": 3}), period=10)
    beat.now = T0 + sec(45)
    started = beat.look()
    assert sorted(e.scheduled_for for e in started) == [T0 + sec(20), T0 + sec(30), T0 + sec(40)]
    assert beat.state.skips == 2
    assert beat.state.overlaps == 2
    assert beat.state.grid_at == T0 + sec(50)


def test_a_late_coalesced_tick_keeps_exactly_one_pending_run() -> None:
    """Coalesce while busy: six missed ticks leave one pending run (the latest) and five skips."""
    beat = Beat(parse({"missed_ticks": "coalesce_latest"}), period=1)
    beat.look()
    beat.now = T0 + sec(6)
    assert beat.look() == []
    assert beat.state.pending == (T0 + sec(6),)
    assert beat.state.skips == 5


def test_catch_up_never_holds_more_than_max_pending() -> None:
    """catch_up keeps at most max_pending pending runs, oldest first; the excess is counted as skips."""
    beat = Beat(parse({"missed_ticks": "catch_up", "max_pending": 2}), period=1)
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
    beat = Beat(parse({"missed_ticks": "catch_up", "max_pending": 2}), period=1)
    beat.now = T0 + sec(10)
    assert [e.scheduled_for for e in beat.look()] == [T0]
    assert beat.state.pending == (T0 + sec(1), T0 + sec(2))
    assert beat.state.skips == 8
    assert beat.state.grid_at == T0 + sec(11)


def test_pending_runs_start_before_newer_ticks_when_a_slot_frees() -> None:
    """A slot freed just before a grid tick goes to the oldest pending run, not to the new tick."""
    beat = Beat(parse({"missed_ticks": "catch_up", "max_pending": 3}), period=1)
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
    beat = Beat(parse({"missed_ticks": "coalesce_latest"}), period=60)
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
    beat = Beat(parse({}), period=60)
    beat.look()
    beat.advance(5)
    beat.trigger()
    assert beat.look() == []
    assert beat.state.pending == (T0 + sec(5),)
    assert beat.state.next_due_at is not None and beat.state.next_due_at > beat.now
    beat.advance(1)
    beat.finish()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(5)]


def test_a_trigger_on_an_idle_fixed_delay_schedule_runs_once() -> None:
    """Triggering an idle fixed-delay schedule starts exactly one extra run, then the delay resumes."""
    beat = Beat(parse({"mode": "fixed_delay"}), period=60)
    beat.look()
    beat.advance(1)
    beat.finish()
    beat.advance(9)
    beat.trigger()
    assert [e.scheduled_for for e in beat.look()] == [T0 + sec(10)]
    assert beat.state.pending == ()
    beat.advance(1)
    beat.finish()
    assert beat.state.next_due_at == T0 + sec(71)
    assert beat.step(1, 59) == []
    assert len(beat.emitted) == 2


def test_a_trigger_on_a_busy_fixed_delay_schedule_runs_once_after_it() -> None:
    """Triggering a running fixed-delay schedule runs once after the active run, then waits `period`."""
    beat = Beat(parse({"mode": "fixed_delay"}), period=60)
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


def test_calendar_timing_counts_every_tick_passed() -> None:
    """A calendar grid counts the ticks in [grid, now] one by one and names the next after now."""
    timing = CalendarTiming(every_minute)
    assert timing.first_at_or_after(T0) == T0
    assert timing.first_at_or_after(T0 + sec(1)) == T0 + sec(60)
    count, tick_at, next_tick = timing.passed(T0, T0 + sec(150))
    assert count == 3
    assert [tick_at(i) for i in range(count)] == [T0, T0 + sec(60), T0 + sec(120)]
    assert next_tick == T0 + sec(180)
    assert timing.gap(T0) == 60.0


def test_a_calendar_schedule_skips_missed_ticks_like_an_interval() -> None:
    """A crontab-like schedule 3 minutes late runs the latest tick and skips the others."""
    beat = Beat(parse({}, schedule_kind="crontab"), period=60, timing=CalendarTiming(every_minute))
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
    beat = Beat(parse({"jitter": 100}), period=10)
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
    beat = Beat(parse({"mode": "fixed_delay", "jitter": 5}), period=10)
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
    from datetime import UTC, datetime, timedelta

    from celery_boundedbeat.policy import CalendarTiming, Policy, ScheduleState, on_due

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
