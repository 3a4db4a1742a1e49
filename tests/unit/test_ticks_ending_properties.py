"""Properties of ``end_at`` and ``max_runs`` under random event sequences (Hypothesis, fake clock).

A simulated beat drives the pure functions of :mod:`celery_boundedbeat.core.ticks` as the store
does (looks only at a due, running schedule; settles, triggers, pauses, resumes and policy
changes in between, the clock jumping by random amounts) with a policy that ends. After every
event it checks the bounds against its own record: grid runs never exceed ``max_runs``, no
grid run is scheduled after ``end_at``, an ended schedule emits no grid run, refuses triggers
and resumes, and shows ``stopped`` exactly when nothing of it is active or waiting. At the
end every accepted trigger has run and nothing is left active.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from helpers.clock import T0
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.enums import RunState, StopReason
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import (
    Emission,
    ScheduleState,
    Triggered,
    TriggerRefused,
    first_state,
    on_config_change,
    on_resume,
    on_settle,
    on_trigger,
    resume_refusal,
)
from celery_boundedbeat.core.timing import CalendarTiming, IntervalTiming, Timing

TERMINAL = [s for s in RunState if s.terminal]
SECOND = 1_000_000

PROPERTIES = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclass(frozen=True)
class Look:
    """The beat wakes and handles the schedule if it is due."""


@dataclass(frozen=True)
class Settle:
    """One active run (``pick`` modulo their number) ends in ``outcome``."""

    pick: int
    outcome: RunState
    stop: bool


@dataclass(frozen=True)
class Trigger:
    """Someone runs ``boundedbeat trigger``."""


@dataclass(frozen=True)
class Pause:
    """Someone runs ``boundedbeat pause``."""


@dataclass(frozen=True)
class Resume:
    """Someone runs ``boundedbeat resume`` (refused once the schedule ended)."""


@dataclass(frozen=True)
class NewEnd:
    """``update_schedule`` with a new ``max_runs`` and/or ``end_at`` (seconds after T0)."""

    max_runs: int | None
    end_s: float | None


Event = Look | Settle | Trigger | Pause | Resume | NewEnd

END_SECONDS = st.one_of(st.none(), st.sampled_from([-1.0, 0.0, 2.0, 3.5, 6.0, 10.0, 20.0]))
MAX_RUNS = st.one_of(st.none(), st.integers(1, 6))


@st.composite
def base_policies(draw: st.DrawFn, calendar: bool) -> dict[str, Any]:
    modes = ["fixed_rate_no_overlap", "fixed_rate"] + ([] if calendar else ["fixed_delay"])
    mode = draw(st.sampled_from(modes))
    raw: dict[str, Any] = {"mode": mode}
    if mode == "fixed_rate":
        raw["max_concurrency"] = draw(st.integers(1, 3))
    if mode != "fixed_delay":
        raw["missed_ticks"] = draw(st.sampled_from(["skip", "coalesce_latest", "catch_up"]))
        if raw["missed_ticks"] == "catch_up":
            raw["max_pending"] = draw(st.integers(1, 3))
    raw["jitter"] = draw(st.sampled_from([None, 0.2]))
    return raw


def events() -> st.SearchStrategy[tuple[int, Event]]:
    quarters = st.integers(1, 12).map(lambda q: q * SECOND // 4)
    jump = st.one_of(st.just(0), quarters, quarters, st.integers(1, 8 * SECOND))
    event = st.one_of(
        st.just(Look()),
        st.just(Look()),
        st.just(Look()),
        st.builds(
            Settle, st.integers(0, 5), st.sampled_from(TERMINAL), st.integers(0, 9).map(lambda n: n == 0)
        ),
        st.builds(Settle, st.integers(0, 5), st.just(RunState.COMPLETED), st.just(False)),
        st.just(Trigger()),
        st.just(Pause()),
        st.just(Resume()),
        st.builds(NewEnd, MAX_RUNS, END_SECONDS),
    )
    return st.tuples(jump, event)


def calendar_every(seconds: float) -> CalendarTiming:
    step = timedelta(seconds=seconds)
    return CalendarTiming(lambda t: T0 + step * ((t - T0) // step + 1))


def parse(raw: dict[str, Any], calendar: bool) -> Policy:
    policy, problems = parse_policy("p", raw, schedule_kind="crontab" if calendar else "interval")
    assert problems == [] and policy is not None, problems
    return policy


def with_end(raw: dict[str, Any], max_runs: int | None, end_s: float | None) -> dict[str, Any]:
    end_at = None if end_s is None else T0 + timedelta(seconds=end_s)
    return {**raw, "max_runs": max_runs, "end_at": end_at}


@dataclass
class Sim:
    """A fake beat with its own record of the runs it emitted, checked after every event."""

    calendar: bool
    raw: dict[str, Any]
    step: float
    rng: random.Random
    now: datetime = T0
    paused: bool = False
    policy: Policy = field(init=False)
    timing: Timing = field(init=False)
    state: ScheduleState = field(init=False)
    active: list[Emission] = field(default_factory=list)
    emitted: list[Emission] = field(default_factory=list)
    accepted: int = 0
    triggers_started: int = 0
    #: A run called ``stop_schedule()`` since the schedule last ran freely (stopped at once).
    stop_called: bool = False

    def __post_init__(self) -> None:
        self.policy = parse(self.raw, self.calendar)
        self.timing = calendar_every(self.step) if self.calendar else IntervalTiming(self.step)
        self.state = first_state(self.spec(), self.now, self.rng)

    def spec(self) -> EntrySpec:
        return EntrySpec(
            name="p",
            task="t",
            policy=self.policy,
            timing=self.timing,
            schedule_repr=f"every {self.step:g}s",
            period=None if self.calendar else self.step,
        )

    def grid_runs(self) -> int:
        return sum(not e.triggered for e in self.emitted)

    def look_twice(self) -> None:
        """A look leaves the schedule due later, or due now for one more look at most: no spinning."""
        self.look()
        due = self.state.next_due_at
        if due is not None and due <= self.now and not (self.paused or self.state.stopped):
            self.look()
            due = self.state.next_due_at
            assert due is None or due > self.now, "the beat would spin on this schedule"

    def look(self) -> None:
        due = self.state.next_due_at
        if self.paused or self.state.stopped or due is None or due > self.now:
            return
        before = self.state
        outcome = on_due(self.policy, self.timing, before, self.now, self.rng)
        self.state = outcome.state
        grid = [e for e in outcome.emit if not e.triggered]
        if before.ended:
            assert grid == [], f"an ended schedule emitted grid runs {grid}"
        for emission in outcome.emit:
            assert emission.scheduled_for not in {e.scheduled_for for e in self.emitted}, emission
            self.emitted.append(emission)
            self.active.append(emission)
            self.triggers_started += emission.triggered
        if grid and self.policy.max_runs is not None:
            assert self.grid_runs() <= self.policy.max_runs, (self.grid_runs(), self.policy)
        if self.policy.end_at is not None:
            late = [e for e in grid if e.scheduled_for > self.policy.end_at]
            assert late == [], f"grid runs scheduled after end_at {self.policy.end_at}: {late}"
        if self.policy.max_runs is not None and self.state.grid_runs >= self.policy.max_runs:
            assert self.state.ended, "max_runs reached but the schedule did not end"

    def settle(self, event: Settle) -> None:
        if not self.active:
            return
        run = self.active.pop(event.pick % len(self.active))
        self.now = max(self.now, run.scheduled_for + timedelta(microseconds=1))
        self.state = on_settle(
            self.policy,
            self.state,
            outcome=event.outcome,
            elapsed_ms=1,
            now=self.now,
            stop=event.stop,
            gap_s=self.step,
            rng=self.rng,
        )
        self.stop_called = self.stop_called or event.stop

    def trigger(self) -> None:
        newest = max((e.scheduled_for for e in self.emitted), default=None)
        decided = on_trigger(self.state, self.now, paused=self.paused, last_run_at=newest)
        if self.state.ended:
            assert isinstance(decided, TriggerRefused), "a trigger on an ended schedule was queued"
            assert self.paused or "ended" in decided.reason, decided
        if isinstance(decided, Triggered):
            self.accepted += 1
            self.state = decided.state

    def resume(self) -> None:
        refusal = resume_refusal(self.state)
        if self.state.ended:
            assert refusal is not None, "resume would revive an ended schedule"
            return
        assert refusal is None
        self.paused = False
        period = None if self.calendar else self.step
        self.state = on_resume(self.policy, self.state, self.now, period=period)
        assert self.state.stop_reason is None

    def new_end(self, event: NewEnd) -> None:
        old = self.spec()
        self.raw = with_end(self.raw, event.max_runs, event.end_s)
        self.policy = parse(self.raw, self.calendar)
        before = self.state
        newest = max((e.scheduled_for for e in self.emitted), default=None)
        self.state = on_config_change(
            self.spec(),
            before,
            config_changed=True,
            old_schedule=old.schedule_repr,
            old_mode=old.policy.mode,
            now=self.now,
            rng=self.rng,
            last_run_at=newest,
        )
        if before.ended and not self.state.ended:
            still = self.policy.max_runs is not None and before.grid_runs >= self.policy.max_runs
            assert not still, "revived although max_runs is still reached"
            assert self.policy.end_at is None or self.policy.end_at > self.now, "revived past end_at"

    def check(self) -> None:
        state = self.state
        assert state.active_runs == len(self.active)
        assert state.grid_runs == self.grid_runs()
        assert self.accepted == self.triggers_started + len(state.triggers)
        if state.ended:
            # An ended schedule with nothing active or waiting shows stopped at once; one still
            # running or with triggers queued before the end does not (stop_schedule() aside).
            idle = state.active_runs == 0 and not state.triggers
            assert state.stopped == idle or (state.stopped and self.stop_called), state
            assert state.pending == (), "an ended schedule keeps pending ticks"
            assert state.stop_reason in (StopReason.END_AT, StopReason.MAX_RUNS)

    def apply(self, jump_us: int, event: Event) -> None:
        self.now += timedelta(microseconds=jump_us)
        if isinstance(event, Look):
            self.look_twice()
        elif isinstance(event, Settle):
            self.settle(event)
        elif isinstance(event, Trigger):
            self.trigger()
        elif isinstance(event, Pause):
            self.paused = True
        elif isinstance(event, Resume):
            self.resume()
        else:
            self.new_end(event)
        self.stop_called = self.stop_called and self.state.stopped
        self.check()

    def drain(self) -> None:
        """Unpause and settle every run, looking in between: every accepted trigger runs."""
        self.paused = False
        if resume_refusal(self.state) is None and self.state.stopped:
            self.resume()
        for _ in range(60):
            self.look()
            self.check()
            if not self.active:
                break
            self.settle(Settle(0, RunState.COMPLETED, stop=False))
            self.check()
        if not self.state.stopped:
            assert self.state.triggers == (), f"triggers never ran: {self.state}"
        assert self.active == []


@dataclass(frozen=True)
class Scenario:
    calendar: bool
    step: float
    raw: dict[str, Any]
    seed: int
    events: tuple[tuple[int, Event], ...]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    calendar = draw(st.booleans())
    raw = with_end(draw(base_policies(calendar)), draw(MAX_RUNS), draw(END_SECONDS))
    return Scenario(
        calendar=calendar,
        step=float(draw(st.sampled_from([1.0, 2.5]))),
        raw=raw,
        seed=draw(st.integers(0, 99)),
        events=tuple(draw(st.lists(events(), min_size=15, max_size=50))),
    )


BUSY_END = {"mode": "fixed_rate_no_overlap", "missed_ticks": "skip", "end_at": T0 + timedelta(seconds=1.5)}


@PROPERTIES
@given(scenarios())
# A trigger waiting behind a busy run when end_at ends the schedule (found while writing this).
@example(
    Scenario(
        calendar=False,
        step=1.0,
        raw=BUSY_END,
        seed=0,
        events=(
            (0, Look()),
            (SECOND // 4, Trigger()),
            (SECOND, Look()),
            (SECOND // 4, Settle(0, RunState.COMPLETED, stop=False)),
            (0, Look()),
        ),
    )
)
def test_random_event_sequences_never_exceed_max_runs_or_run_past_end_at(scenario: Scenario) -> None:
    """Under any events, grid runs stay within max_runs and end_at, and an ended schedule stops cleanly."""
    sim = Sim(
        calendar=scenario.calendar, raw=scenario.raw, step=scenario.step, rng=random.Random(scenario.seed)
    )
    sim.check()
    for jump_us, event in scenario.events:
        sim.apply(jump_us, event)
    sim.drain()
