"""The tick state machine: what happens to a schedule's state at each event.

Every event a schedule sees (first sight, due time, settle, trigger, resume, a changed
config entry) is one pure function of the policy, the state and ``now`` that returns the
next state. The store only loads a row, calls one of these and writes the result back, so
every decision is tested with a fake clock (the seeds' ``start_paused`` tests port directly).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from .enums import MissedTicks, Mode, RunState
from .policy import EntrySpec, Policy
from .runtime import effective_jitter_cap
from .timing import Timing


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleState:
    """What the scheduler remembers about one schedule between ticks (one DB row)."""

    active_runs: int = 0
    pending: tuple[datetime, ...] = ()
    grid_at: datetime | None = None
    next_due_at: datetime | None = None
    runs: int = 0
    skips: int = 0
    overlaps: int = 0
    failures: int = 0
    last_drift_ms: int | None = None
    last_elapsed_ms: int | None = None
    max_elapsed_ms: int | None = None
    stopped: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Emission:
    """One run to emit now, for the grid time it belongs to."""

    scheduled_for: datetime
    drift_ms: int
    overlap: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class TickOutcome:
    """The result of looking at one due schedule."""

    state: ScheduleState
    emit: tuple[Emission, ...] = ()
    skipped: int = 0
    coalesced: bool = False
    ticks: int = 0


def _ms(delta: timedelta) -> int:
    return max(0, int(delta.total_seconds() * 1000))


def jitter_delay(policy: Policy, gap_s: float, rng: random.Random) -> timedelta:
    """A uniform positive delay in ``[0, min(jitter, gap / 10)]`` (runtime.rs's cap)."""
    if not policy.jitter:
        return timedelta(0)
    cap = effective_jitter_cap(gap_s, policy.jitter)
    if cap <= 0:
        return timedelta(0)
    return timedelta(seconds=rng.uniform(0.0, cap))


def initial_state(policy: Policy, timing: Timing, now: datetime, rng: random.Random) -> ScheduleState:
    """State of a schedule seen for the first time: first run due after ``initial_delay``."""
    first = now + timedelta(seconds=policy.initial_delay)
    if policy.mode is Mode.FIXED_DELAY:
        return ScheduleState(next_due_at=first)
    grid = timing.first_at_or_after(first)
    return ScheduleState(grid_at=grid, next_due_at=grid + jitter_delay(policy, timing.gap(grid), rng))


@dataclass(kw_only=True, slots=True)
class _Due:
    """The working copy of one :func:`on_due` call: frozen state in, frozen outcome out.

    Mutable on purpose: starting a run, moving the grid and counting skips each touch a few
    of these fields, and one object keeps the per-mode helpers short.
    """

    policy: Policy
    now: datetime
    active: int
    pending: list[datetime]
    overlaps: int
    skips: int
    drift: int | None
    grid_at: datetime | None
    next_due: datetime | None
    emit: list[Emission] = field(default_factory=list)
    skipped: int = 0
    coalesced: bool = False
    ticks: int = 0

    @classmethod
    def of(cls, policy: Policy, state: ScheduleState, now: datetime) -> _Due:
        return cls(
            policy=policy,
            now=now,
            active=state.active_runs,
            pending=list(state.pending),
            overlaps=state.overlaps,
            skips=state.skips,
            drift=state.last_drift_ms,
            grid_at=state.grid_at,
            next_due=state.next_due_at,
        )

    def has_slot(self) -> bool:
        return self.active < self.policy.limit

    def reserve(self, scheduled_for: datetime) -> None:
        """Take a slot for a run of ``scheduled_for`` (an overlap if another is active)."""
        overlap = self.active > 0
        self.overlaps += int(overlap)
        self.active += 1
        drift_ms = _ms(self.now - scheduled_for)
        self.emit.append(Emission(scheduled_for=scheduled_for, drift_ms=drift_ms, overlap=overlap))

    def start_pending(self) -> None:
        """Pending runs take free slots, oldest first."""
        while self.pending and self.has_slot():
            self.reserve(self.pending.pop(0))

    def outcome(self, state: ScheduleState) -> TickOutcome:
        new = replace(
            state,
            active_runs=self.active,
            pending=tuple(self.pending),
            grid_at=self.grid_at,
            next_due_at=self.next_due,
            overlaps=self.overlaps,
            skips=self.skips,
            last_drift_ms=self.drift,
        )
        emit = tuple(self.emit)
        return TickOutcome(
            state=new, emit=emit, skipped=self.skipped, coalesced=self.coalesced, ticks=self.ticks
        )


def _due_fixed_delay(due: _Due) -> None:
    """One run when due and a slot is free; either way wait for a settle to set the next."""
    if due.next_due is None or due.next_due > due.now:
        return
    if due.has_slot():
        due.drift = _ms(due.now - due.next_due)
        # A triggered (pending) run stands in for the due one: one run, not two.
        due.reserve(due.pending.pop(0) if due.pending else due.next_due)
        due.ticks = 1
    due.next_due = None


def _anchor_grid(due: _Due, timing: Timing, rng: random.Random) -> None:
    """No grid (a resumed calendar schedule): ticks passed while paused are not missed;
    anchor on the first tick from now."""
    due.grid_at = timing.first_at_or_after(due.now)
    due.next_due = due.grid_at + jitter_delay(due.policy, timing.gap(due.grid_at), rng)


def _due_on_grid(due: _Due, grid_at: datetime, timing: Timing, rng: random.Random) -> None:
    """Count the grid ticks passed, start as many as slots are free, hand the rest to
    ``missed_ticks`` and move the grid past ``now`` (``fixed_rate_driver``)."""
    # Pending runs are older than the ticks passed now: they take the free slots first.
    due.start_pending()
    count, tick_at, next_grid = timing.passed(grid_at, due.now)
    due.ticks = count
    due.drift = _ms(due.now - grid_at)
    n_start = min(max(due.policy.limit - due.active, 0), count)
    if due.policy.missed_ticks is MissedTicks.CATCH_UP:
        started, rest = range(n_start), range(n_start, count)
    else:
        started, rest = range(count - n_start, count), range(count - n_start)
    for i in started:
        due.reserve(tick_at(i))
    _handle_missed(due, tick_at, rest)
    due.skips += due.skipped
    due.grid_at = next_grid
    due.next_due = next_grid + jitter_delay(due.policy, timing.gap(next_grid), rng)


def _handle_missed(due: _Due, tick_at: Callable[[int], datetime], rest: range) -> None:
    """Ticks that found every slot busy go to ``missed_ticks`` (``queue_missed_ticks``).

    ``rest`` indexes the grid ticks lazily: a long outage on a short period may have passed
    very many, and only the ones kept as pending runs are ever built.
    """
    missed = len(rest)
    if not missed:
        return
    if due.policy.missed_ticks is MissedTicks.SKIP:
        due.skipped = missed
    elif due.policy.missed_ticks is MissedTicks.COALESCE_LATEST:
        due.skipped = missed - 1 if not due.pending else missed
        due.pending = [tick_at(rest[-1])]
        due.coalesced = True
    else:
        assert due.policy.max_pending is not None
        room = max(due.policy.max_pending - len(due.pending), 0)
        added = min(room, missed)
        due.pending.extend(tick_at(rest[i]) for i in range(added))
        due.skipped = missed - added


def on_due(
    policy: Policy, timing: Timing, state: ScheduleState, now: datetime, rng: random.Random
) -> TickOutcome:
    """Handle a schedule whose ``next_due_at`` has come (``fixed_rate_driver`` + fixed delay).

    Fixed rate: every grid tick passed counts (``1 + overdue // period``); as many start as
    slots are free, the rest go to ``missed_ticks``; the grid advances past ``now``. Then
    pending runs start while slots are free. Fixed delay: one run, then wait for its finish.
    """
    if state.stopped:
        return TickOutcome(state=replace(state, next_due_at=None))
    due = _Due.of(policy, state, now)
    if policy.mode is Mode.FIXED_DELAY:
        _due_fixed_delay(due)
    elif due.grid_at is None:
        _anchor_grid(due, timing, rng)
    elif due.grid_at <= now:
        _due_on_grid(due, due.grid_at, timing, rng)
    due.start_pending()
    if policy.mode is Mode.FIXED_DELAY and due.emit:
        due.next_due = None
    elif due.grid_at is not None and due.next_due is not None and due.next_due <= now:
        # A due time set for pending runs (settle, trigger) must not stay in the past, or
        # the beat would spin until the next grid tick: pending runs wait for a settle.
        due.next_due = due.grid_at + jitter_delay(policy, timing.gap(due.grid_at), rng)
    return due.outcome(state)


def on_settle(
    policy: Policy,
    state: ScheduleState,
    *,
    outcome: RunState,
    elapsed_ms: int | None,
    now: datetime,
    stop: bool,
    gap_s: float,
    rng: random.Random,
) -> ScheduleState:
    """Free one slot exactly once and count the outcome (``ScheduledRunGuard``'s drop).

    Fixed delay: the next run is due ``period`` after this finish. Otherwise pending runs
    become due at once so they start as soon as the beat sees the freed slot.
    """
    assert outcome.terminal, outcome
    stopped = state.stopped or stop
    last_elapsed = state.last_elapsed_ms
    max_elapsed = state.max_elapsed_ms
    if elapsed_ms is not None:
        last_elapsed = elapsed_ms
        max_elapsed = max(max_elapsed or 0, elapsed_ms)
    next_due = state.next_due_at
    if stopped:
        next_due = None
    elif policy.mode is Mode.FIXED_DELAY:
        next_due = now + timedelta(seconds=gap_s) + jitter_delay(policy, gap_s, rng)
        if state.pending:
            next_due = now
    elif state.pending:
        next_due = now if next_due is None else min(next_due, now)
    return replace(
        state,
        active_runs=max(state.active_runs - 1, 0),
        runs=state.runs + int(not outcome.counts_as_failure),
        failures=state.failures + int(outcome.counts_as_failure),
        last_elapsed_ms=last_elapsed,
        max_elapsed_ms=max_elapsed,
        stopped=stopped,
        next_due_at=next_due,
    )


def on_trigger(state: ScheduleState, now: datetime) -> ScheduleState:
    """Ask for one extra run now: a pending run at ``now``, due no later than ``now``.

    A pending run rather than an emission: the next :func:`on_due` starts it only when a
    slot is free, so a trigger never breaks the concurrency bound.
    """
    due = now if state.next_due_at is None else min(state.next_due_at, now)
    return replace(state, pending=(*state.pending, now), next_due_at=due)


def on_resume(policy: Policy, state: ScheduleState, now: datetime, *, period: float | None) -> ScheduleState:
    """Resume a paused (or stopped) schedule: ticks passed meanwhile are not missed ticks.

    Fixed delay is due at once unless a run is still active (its settle sets the next due).
    An interval grid rejoins at its first tick after ``now``; a past calendar grid (no
    ``period``) is cleared and due now, so :func:`on_due` re-anchors it without emitting. A
    future grid keeps its (jittered) due time. Pending runs make it due at once.
    """
    grid_at, next_due = state.grid_at, state.next_due_at
    if policy.mode is Mode.FIXED_DELAY:
        if state.active_runs == 0:
            next_due = now
    elif grid_at is not None and grid_at < now and period:
        step = timedelta(seconds=period)
        grid_at = grid_at + step * ((now - grid_at) // step + 1)
        next_due = grid_at
    elif grid_at is not None and grid_at < now:
        grid_at, next_due = None, now
    elif grid_at is not None:
        next_due = max(grid_at, next_due or grid_at)
    if state.pending:
        next_due = now
    return replace(state, stopped=False, grid_at=grid_at, next_due_at=next_due)


def on_config_change(
    spec: EntrySpec,
    state: ScheduleState,
    *,
    config_changed: bool,
    old_schedule: str,
    old_mode: Mode,
    now: datetime,
    rng: random.Random,
) -> ScheduleState:
    """Reconcile a stored schedule with its config entry at beat start.

    Counters, pending runs and pause/stop survive. Only a new timing (another schedule or
    mode) restarts the grid from ``now``, as a new entry would; a fixed-delay run still
    active keeps the due time its settle will set. An unchanged entry whose fixed-delay run
    was settled while no period was known gets the due time it never received.
    """
    if config_changed:
        if old_schedule == spec.schedule_repr and old_mode == spec.policy.mode:
            return state
        fresh = initial_state(spec.policy, spec.timing, now, rng)
        wait_for_settle = state.active_runs != 0 and spec.policy.mode is Mode.FIXED_DELAY
        next_due = state.next_due_at if wait_for_settle else fresh.next_due_at
        return replace(state, grid_at=fresh.grid_at, next_due_at=next_due)
    if state.next_due_at is None and not state.stopped and state.active_runs == 0:
        return replace(state, next_due_at=initial_state(spec.policy, spec.timing, now, rng).next_due_at)
    return state
