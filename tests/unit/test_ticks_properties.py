"""Properties of the tick state machine under random event sequences (Hypothesis, fake clock).

A simulated beat drives the pure functions of :mod:`celery_boundedbeat.core.ticks` the way the
store does: it looks at the schedule only when it is due, not paused and not stopped, and
applies settles, triggers, pauses, resumes and config changes in between, while the clock
jumps by random amounts (on grid times and off them). After every event it checks the
bounds and the exact accounting of grid ticks and triggers against its own record.
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
from celery_boundedbeat.core.enums import MissedTicks, Mode, RunState
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import (
    MAX_QUEUED_TRIGGERS,
    Emission,
    ScheduleState,
    Triggered,
    TriggerRefused,
    initial_state,
    on_config_change,
    on_resume,
    on_settle,
    on_trigger,
)
from celery_boundedbeat.core.timing import CalendarTiming, IntervalTiming, Timing

TERMINAL = [s for s in RunState if s.terminal]
#: Seconds between ticks: interval periods, and the steps of a calendar aligned on T0.
INTERVALS = (1.0, 2.5, 7.0)
CALENDAR_STEPS = (1, 5, 60)
#: How far a dodged trigger may move from the time it was given (1 µs per collision).
MAX_DODGE = timedelta(microseconds=2 * MAX_QUEUED_TRIGGERS + 10)

#: Fast and the same on every run: a fixed search, no example database left behind.
PROPERTIES = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Look:
    """The beat wakes and handles the schedule if it is due (``Store.tick``)."""


@dataclass(frozen=True)
class Settle:
    """One active run (``pick`` modulo their number) ends in ``outcome``."""

    pick: int
    outcome: RunState
    stop: bool


@dataclass(frozen=True)
class Trigger:
    """Someone runs ``boundedbeat trigger`` ``times`` times in a row (an impatient button)."""

    times: int = 1


@dataclass(frozen=True)
class Pause:
    """Someone runs ``boundedbeat pause``."""


@dataclass(frozen=True)
class Resume:
    """Someone runs ``boundedbeat resume`` (``--replay``: the paused ticks go to the policy)."""

    replay: bool = False


@dataclass(frozen=True)
class Reconfigure:
    """Beat restarts with a changed entry: another policy, maybe another period."""

    raw: tuple[tuple[str, Any], ...]
    step: float


@dataclass(frozen=True)
class Restart:
    """Beat restarts with the same entry (``config_changed=False``)."""


Event = Look | Settle | Trigger | Pause | Resume | Reconfigure | Restart


def raw_policies(calendar: bool) -> st.SearchStrategy[tuple[tuple[str, Any], ...]]:
    """Valid policies across modes and missed_ticks (fixed delay only on an interval)."""
    modes = ["fixed_rate_no_overlap", "fixed_rate"] + ([] if calendar else ["fixed_delay"])

    @st.composite
    def build(draw: st.DrawFn) -> tuple[tuple[str, Any], ...]:
        mode = draw(st.sampled_from(modes))
        raw: dict[str, Any] = {"mode": mode}
        if mode == "fixed_rate":
            raw["max_concurrency"] = draw(st.integers(1, 3))
        if mode != "fixed_delay":
            raw["missed_ticks"] = draw(st.sampled_from(["skip", "coalesce_latest", "catch_up", "replace"]))
            if raw["missed_ticks"] == "catch_up":
                raw["max_pending"] = draw(st.integers(1, 3))
            raw["catchup_window"] = draw(st.sampled_from([None, None, 0.9, 20.0]))
        raw["jitter"] = draw(st.sampled_from([None, 0.3]))
        raw["initial_delay"] = draw(st.sampled_from([0, 1.5]))
        return tuple(sorted(raw.items()))

    return build()


def events(calendar: bool) -> st.SearchStrategy[tuple[int, Event]]:
    """A clock jump in µs (none, on quarter seconds, or anywhere) followed by one event."""
    # Mostly no jump or whole quarter seconds: events in one microsecond, and a clock on the
    # grid's own times, are where run times collide; arbitrary jumps cover the rest.
    quarters = st.integers(1, 40).map(lambda q: q * 250_000)
    jump = st.one_of(st.just(0), st.just(0), quarters, quarters, st.integers(1, 30_000_000))
    steps = CALENDAR_STEPS if calendar else INTERVALS
    event = st.one_of(
        st.just(Look()),
        st.just(Look()),
        st.builds(
            Settle, st.integers(0, 5), st.sampled_from(TERMINAL), st.integers(0, 9).map(lambda n: n == 0)
        ),
        st.builds(Settle, st.integers(0, 5), st.just(RunState.COMPLETED), st.just(False)),
        st.just(Trigger()),
        st.builds(Trigger, st.integers(2, MAX_QUEUED_TRIGGERS + 2)),
        st.just(Pause()),
        st.just(Resume()),
        st.just(Resume(replay=True)),
        st.builds(Reconfigure, raw_policies(calendar), st.sampled_from(steps).map(float)),
        st.just(Restart()),
    )
    return st.tuples(jump, event)


# -- the simulated beat -------------------------------------------------------------------


def calendar_every(seconds: float) -> CalendarTiming:
    """A calendar grid on T0 + k * ``seconds`` (like a crontab every minute), exact to the µs."""
    step = timedelta(seconds=seconds)
    return CalendarTiming(lambda t: T0 + step * ((t - T0) // step + 1))


def parse(raw: tuple[tuple[str, Any], ...], calendar: bool) -> Policy:
    policy, problems = parse_policy("p", dict(raw), schedule_kind="crontab" if calendar else "interval")
    assert problems == [] and policy is not None, problems
    return policy


def pending_bound(policy: Policy) -> int:
    """The contract's bound on pending grid ticks, written out independently of ticks.py."""
    if policy.mode is Mode.FIXED_DELAY or policy.missed_ticks in (MissedTicks.SKIP, MissedTicks.REPLACE):
        return 0
    if policy.missed_ticks is MissedTicks.COALESCE_LATEST:
        return 1
    assert policy.max_pending is not None
    return policy.max_pending


@dataclass
class Sim:
    """A fake beat with its own record of what the schedule was asked to do and did."""

    calendar: bool
    policy: Policy
    step: float
    rng: random.Random
    now: datetime = T0
    paused: bool = False
    state: ScheduleState = field(init=False)
    timing: Timing = field(init=False)
    anchor: datetime = field(init=False)
    active: list[Emission] = field(default_factory=list)
    emitted: list[Emission] = field(default_factory=list)
    grid_emitted: int = 0
    ticks_passed: set[datetime] = field(default_factory=set)
    accepted: list[datetime] = field(default_factory=list)
    triggers_started: int = 0
    emitted_at: dict[datetime, datetime] = field(default_factory=dict)
    #: Active runs ``replace`` revoked (the store settles them in the tick).
    revoked: int = 0

    def __post_init__(self) -> None:
        self.timing = calendar_every(self.step) if self.calendar else IntervalTiming(self.step)
        self.state = initial_state(self.policy, self.timing, self.now, self.rng)
        self.anchor = T0 if self.calendar else (self.state.grid_at or T0)

    # -- what the store does --------------------------------------------------------------

    def look(self) -> None:
        """``Store.tick``: only a due, running schedule is handled."""
        due = self.state.next_due_at
        if self.paused or self.state.stopped or due is None or due > self.now:
            return
        before = self.state
        expected = self.grid_ticks(before)
        outcome = on_due(self.policy, self.timing, before, self.now, self.rng, revocable=len(self.active))
        self.state = outcome.state
        assert outcome.state.skips - before.skips == outcome.skipped
        assert outcome.revoke == 0 or self.policy.missed_ticks is MissedTicks.REPLACE
        # The store revokes the oldest active runs (by ``scheduled_for``); their slots are taken.
        for run in sorted(self.active, key=lambda e: e.scheduled_for)[: outcome.revoke]:
            self.active.remove(run)
        self.revoked += outcome.revoke
        assert outcome.state.active_runs <= max(self.policy.limit, before.active_runs)
        if outcome.emit:
            assert outcome.state.active_runs <= self.policy.limit
        if self.policy.mode is Mode.FIXED_DELAY:
            assert outcome.ticks == len(outcome.emit) <= 1
        else:
            assert outcome.ticks == len(expected), (outcome.ticks, expected)
            self.ticks_passed.update(expected)
        for emission in outcome.emit:
            self.record(emission)

    def grid_ticks(self, state: ScheduleState) -> list[datetime]:
        """The grid ticks a look at ``now`` passes, from the grid's own arithmetic."""
        if self.policy.mode is Mode.FIXED_DELAY or state.grid_at is None or state.grid_at > self.now:
            return []
        step = timedelta(seconds=self.step)
        assert (state.grid_at - self.anchor) % step == timedelta(0), "the grid left its lattice"
        count = (self.now - state.grid_at) // step + 1
        return [state.grid_at + step * i for i in range(count)]

    def record(self, emission: Emission) -> None:
        assert emission.scheduled_for not in {e.scheduled_for for e in self.emitted}, emission
        self.emitted.append(emission)
        self.active.append(emission)
        self.emitted_at[emission.scheduled_for] = self.now
        if emission.triggered:
            asked = self.accepted[self.triggers_started]
            assert asked <= emission.scheduled_for <= asked + MAX_DODGE, (asked, emission)
            self.triggers_started += 1
        elif self.policy.mode is not Mode.FIXED_DELAY:
            assert emission.scheduled_for in self.ticks_passed, f"{emission} is no grid tick passed"
            self.grid_emitted += 1

    def settle(self, event: Settle) -> None:
        if not self.active:
            return
        run = self.active.pop(event.pick % len(self.active))
        # No run ends in the microsecond it was emitted: it still has to be published and run.
        self.now = max(self.now, self.emitted_at[run.scheduled_for] + timedelta(microseconds=1))
        before = self.state
        self.state = on_settle(
            self.policy,
            before,
            outcome=event.outcome,
            elapsed_ms=int((self.now - run.scheduled_for).total_seconds() * 1000),
            now=self.now,
            stop=event.stop,
            gap_s=self.step,
            rng=self.rng,
        )
        failed = event.outcome is not RunState.COMPLETED
        assert (self.state.runs - before.runs, self.state.failures - before.failures) == (
            int(not failed),
            int(failed),
        )

    def newest(self) -> datetime | None:
        """The newest run's ``scheduled_for`` (the store reads it from the runs table)."""
        return max((e.scheduled_for for e in self.emitted), default=None)

    def trigger(self) -> None:
        decided = on_trigger(self.state, self.now, paused=self.paused, last_run_at=self.newest())
        full = len(self.state.triggers) >= MAX_QUEUED_TRIGGERS
        if self.paused or self.state.stopped or full:
            assert isinstance(decided, TriggerRefused), decided
            return
        assert isinstance(decided, Triggered), decided
        assert self.now <= decided.scheduled_for <= self.now + MAX_DODGE
        assert decided.state.triggers == (*self.state.triggers, decided.scheduled_for)
        self.accepted.append(decided.scheduled_for)
        self.state = decided.state

    def resume(self, replay: bool = False) -> None:
        """``Store.set_paused(False)``: lifts a pause and a stop."""
        self.paused = False
        period = None if self.calendar else self.step
        self.state = on_resume(self.policy, self.state, self.now, period=period, replay=replay)

    def reconfigure(self, event: Reconfigure | Restart) -> None:
        """``Store.sync_config`` at a beat start, with a changed entry or the same one."""
        old_repr, old_mode = self.repr(), self.policy.mode
        changed = isinstance(event, Reconfigure)
        if changed:
            self.policy = parse(event.raw, self.calendar)
            self.step = event.step
            self.timing = calendar_every(self.step) if self.calendar else IntervalTiming(self.step)
        spec = EntrySpec(
            name="p",
            task="t",
            policy=self.policy,
            timing=self.timing,
            schedule_repr=self.repr(),
            period=None if self.calendar else self.step,
        )
        before = self.state
        self.state = on_config_change(
            spec,
            before,
            config_changed=changed,
            old_schedule=old_repr,
            old_mode=old_mode,
            now=self.now,
            rng=self.rng,
            last_run_at=self.newest(),
        )
        dropped = len(before.pending) - len(self.state.pending)
        assert self.state.skips - before.skips == dropped >= 0
        restarted = changed and (old_repr, old_mode) != (self.repr(), self.policy.mode)
        if restarted and not self.calendar and self.state.grid_at is not None:
            self.anchor = self.state.grid_at

    def repr(self) -> str:
        return f"{'every' if self.calendar else 'interval'} {self.step:g}s"

    # -- the properties -------------------------------------------------------------------

    def check(self) -> None:
        """Bounds and exact accounting after every event."""
        state = self.state
        assert state.active_runs == len(self.active)
        assert len(state.pending) <= pending_bound(self.policy), (state.pending, self.policy)
        assert len(state.triggers) <= MAX_QUEUED_TRIGGERS
        assert state.waiting_runs == len(state.pending) + len(state.triggers)
        # Every grid tick passed is exactly one of: emitted, skipped, still pending.
        assert len(self.ticks_passed) == self.grid_emitted + state.skips + len(state.pending)
        # ... and each dropped one was dropped for one reason; every revoked run is counted.
        assert state.skips == state.busy_skips + state.window_drops + state.buffer_drops, state
        assert state.replaced == self.revoked
        assert set(state.pending) <= self.ticks_passed
        # Every accepted trigger is exactly one of: emitted, still queued.
        assert len(self.accepted) == self.triggers_started + len(state.triggers)
        if (
            not (self.paused or state.stopped)
            and state.waiting_runs
            and state.active_runs < self.policy.limit
        ):
            due = state.next_due_at
            assert due is not None and due <= self.now, "runs wait while a slot is free"

    def no_spin(self) -> None:
        """A look leaves the schedule due later, or due now for a grid tick it has not handled."""
        self.look()
        due = self.state.next_due_at
        if due is not None and due <= self.now and not (self.paused or self.state.stopped):
            self.look()
            due = self.state.next_due_at
            assert due is None or due > self.now, "the beat would spin on this schedule"

    def apply(self, jump_us: int, event: Event) -> None:
        self.now += timedelta(microseconds=jump_us)
        if isinstance(event, Look):
            self.no_spin()
        elif isinstance(event, Settle):
            self.settle(event)
        elif isinstance(event, Trigger):
            for _ in range(event.times):
                self.trigger()
        elif isinstance(event, Pause):
            self.paused = True
        elif isinstance(event, Resume):
            self.resume(event.replay)
        else:
            self.reconfigure(event)
        self.check()

    def drain(self) -> None:
        """Resume, then settle every run (the clock moves by microseconds only): every waiting run starts."""
        self.resume()
        for _ in range(4 * MAX_QUEUED_TRIGGERS + 20):
            self.look()
            self.check()
            if not self.active:
                break
            self.settle(Settle(0, RunState.COMPLETED, stop=False))
            self.check()
        assert (self.state.pending, self.state.triggers, self.active) == ((), (), [])
        assert len(self.accepted) == self.triggers_started


@dataclass(frozen=True)
class Scenario:
    """One schedule (grid kind, step, policy, seed) and the events that happen to it."""

    calendar: bool
    step: float
    raw: tuple[tuple[str, Any], ...]
    seed: int
    events: tuple[tuple[int, Event], ...]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    calendar = draw(st.booleans())
    return Scenario(
        calendar=calendar,
        step=float(draw(st.sampled_from(CALENDAR_STEPS if calendar else INTERVALS))),
        raw=draw(raw_policies(calendar)),
        seed=draw(st.integers(0, 99)),
        # At least 20 events: Hypothesis favours short lists, and bugs need a busy schedule.
        events=tuple(draw(st.lists(events(calendar), min_size=20, max_size=60))),
    )


DEFAULT = (
    ("initial_delay", 0),
    ("jitter", None),
    ("missed_ticks", "skip"),
    ("mode", "fixed_rate_no_overlap"),
)
TWO_SLOTS = (("max_concurrency", 2), ("missed_ticks", "skip"), ("mode", "fixed_rate"))
DONE = Settle(0, RunState.COMPLETED, stop=False)
SECOND = 1_000_000


def pinned(raw: tuple[tuple[str, Any], ...], *steps: tuple[int, Event], calendar: bool = False) -> Scenario:
    """A scenario written out: run times that collide in one microsecond, which random jumps seldom hit."""
    return Scenario(calendar=calendar, step=60.0 if calendar else 1.0, raw=raw, seed=0, events=steps)


@PROPERTIES
@given(scenarios())
# A grid restarted in the microsecond of a run repeated that run's time (found by this test).
@example(pinned(DEFAULT, (0, Look()), (0, Reconfigure(DEFAULT, 2.5))))
# A trigger in the microsecond of an emitted run, or of a tick the beat had not handled yet.
@example(pinned(DEFAULT, (0, Look()), (0, Trigger()), (0, DONE), (0, Look())))
@example(pinned(TWO_SLOTS, (0, Look()), (SECOND // 2, DONE), (SECOND // 2, Trigger()), (0, Look())))
# A trigger on the tick a resumed calendar grid anchors on.
@example(
    pinned(
        TWO_SLOTS,
        *((0, Look()), (SECOND, DONE), (0, Pause()), (119 * SECOND, Resume()), (0, Trigger()), (0, Look())),
        calendar=True,
    )
)
def test_random_event_sequences_keep_every_bound_and_account_for_every_tick_and_trigger(
    scenario: Scenario,
) -> None:
    """Under any sequence of looks, settles, triggers, pauses and changes, bounds hold and nothing is lost."""
    policy = parse(scenario.raw, scenario.calendar)
    sim = Sim(calendar=scenario.calendar, policy=policy, step=scenario.step, rng=random.Random(scenario.seed))
    sim.check()
    for jump_us, event in scenario.events:
        sim.apply(jump_us, event)
    sim.drain()
