"""Fake beats: a fake clock driving one schedule's state through the pure tick functions.

Three kinds, each the way its tests need it (they differ, so they keep distinct names):

* ``TickBeat`` starts from ``initial_state`` and settles runs oldest or newest first
  (the tick state machine tests);
* ``BackfillBeat`` starts on an interval grid already handled up to ``now`` and queues
  backfills (the backfill tests; its random source, ``BACKFILL_RNG``, is shared on purpose
  with the tests that call the tick functions themselves);
* ``EndingBeat`` starts from ``first_state`` of an entry and never looks at a stopped
  schedule (the ``end_at`` / ``max_runs`` tests).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime

from celery_boundedbeat.core.backfill import Backfilled, BackfillRefused, on_backfill
from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import (
    Emission,
    ScheduleState,
    Triggered,
    TriggerRefused,
    first_state,
    initial_state,
    on_settle,
    on_trigger,
)
from celery_boundedbeat.core.timing import IntervalTiming, Timing
from helpers.clock import T0, sec

#: The backfill tests' one random source (none of their policies has jitter).
BACKFILL_RNG = random.Random(0)


def queued(decided: Backfilled | BackfillRefused) -> Backfilled:
    assert isinstance(decided, Backfilled), decided
    return decided


@dataclass
class TickBeat:
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
    paused: bool = False

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

    def trigger(self) -> Triggered | TriggerRefused:
        """What ``Store.trigger`` does to the state: one queued trigger due now, or a refusal."""
        newest = max((e.scheduled_for for e in self.emitted), default=None)
        decided = on_trigger(self.state, self.now, paused=self.paused, last_run_at=newest)
        if isinstance(decided, Triggered):
            self.state = decided.state
        return decided

    def ticks_accounted(self) -> int:
        """Grid runs emitted + skips + pending ticks: every grid tick passed is exactly one of them."""
        return sum(not e.triggered for e in self.emitted) + self.state.skips + len(self.state.pending)


class BackfillBeat:
    """A fake beat for one interval schedule whose grid runs every ``period`` seconds from T0."""

    def __init__(self, policy: Policy, period: float = 10.0, now: datetime | None = None) -> None:
        now = now or T0 + sec(100)
        self.policy = policy
        self.timing = IntervalTiming(period)
        self.period = period
        self.now = now
        # The grid started at T0 and the beat has handled every tick up to ``now``.
        after = int((now - T0).total_seconds() // period) + 1
        grid = T0 + sec(period) * after
        self.state = ScheduleState(grid_at=grid, next_due_at=grid)
        self.active: list[Emission] = []
        self.emitted: list[Emission] = []
        self.max_active = 0

    def backfill(self, start: datetime, end: datetime, runs: tuple[datetime, ...] = ()) -> Backfilled:
        decided = queued(
            on_backfill(
                self.policy, self.timing, self.state, start, end, self.now, paused=False, run_times=runs
            )
        )
        self.state = decided.state
        return decided

    def look(self) -> list[Emission]:
        due = self.state.next_due_at
        if due is None or due > self.now:
            return []
        outcome = on_due(self.policy, self.timing, self.state, self.now, BACKFILL_RNG)
        self.state = outcome.state
        self.active.extend(outcome.emit)
        self.emitted.extend(outcome.emit)
        assert self.state.active_runs == len(self.active)
        self.max_active = max(self.max_active, len(self.active))
        return list(outcome.emit)

    def finish_all(self) -> None:
        while self.active:
            self.active.pop(0)
            self.state = on_settle(
                self.policy,
                self.state,
                outcome=RunState.COMPLETED,
                elapsed_ms=5,
                now=self.now,
                stop=False,
                gap_s=self.period,
                rng=BACKFILL_RNG,
            )


@dataclass
class EndingBeat:
    """A fake beat driving one schedule's state through the pure functions, as the store does."""

    policy: Policy
    timing: Timing
    gap_s: float = 10.0
    now: datetime = T0
    rng: random.Random = field(default_factory=lambda: random.Random(3))
    state: ScheduleState = field(init=False)
    active: list[Emission] = field(default_factory=list)
    emitted: list[Emission] = field(default_factory=list)
    skipped: int = 0

    def __post_init__(self) -> None:
        spec = EntrySpec(
            name="entry",
            task="proj.task",
            policy=self.policy,
            timing=self.timing,
            schedule_repr="grid",
            period=self.gap_s,
        )
        self.state = first_state(spec, self.now, self.rng)

    def look(self) -> list[Emission]:
        """``Store.tick``: a due, not stopped schedule is handed to ``on_due``."""
        due = self.state.next_due_at
        if self.state.stopped or due is None or due > self.now:
            return []
        before = self.state
        outcome = on_due(self.policy, self.timing, before, self.now, self.rng)
        assert outcome.state.skips - before.skips == outcome.skipped
        self.skipped += outcome.skipped
        self.state = outcome.state
        self.active.extend(outcome.emit)
        self.emitted.extend(outcome.emit)
        assert self.state.active_runs == len(self.active) <= self.policy.limit
        return list(outcome.emit)

    def at(self, seconds: float) -> list[Emission]:
        """Move the clock to ``T0 + seconds`` and look."""
        self.now = T0 + sec(seconds)
        return self.look()

    def finish(self, outcome: RunState = RunState.COMPLETED, *, stop: bool = False) -> None:
        """Settle the oldest active run now."""
        self.active.pop(0)
        self.state = on_settle(
            self.policy,
            self.state,
            outcome=outcome,
            elapsed_ms=1,
            now=self.now,
            stop=stop,
            gap_s=self.gap_s,
            rng=self.rng,
        )
        assert self.state.active_runs == len(self.active)

    def trigger(self) -> Triggered | TriggerRefused:
        newest = max((e.scheduled_for for e in self.emitted), default=None)
        decided = on_trigger(self.state, self.now, paused=False, last_run_at=newest)
        if isinstance(decided, Triggered):
            self.state = decided.state
        return decided

    def grid_times(self) -> list[datetime]:
        return [e.scheduled_for for e in self.emitted if not e.triggered]
