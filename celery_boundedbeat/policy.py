"""Policy parsing and tick arithmetic: pure functions of config, state and ``now``.

Nothing here does I/O or reads a clock, so every decision the scheduler makes can be
tested with a fake clock (the seeds' ``start_paused`` tests port directly).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Protocol

from .enums import MissedTicks, Mode, RunState
from .runtime import effective_jitter_cap

POLICY_KEYS = frozenset(
    {
        "mode",
        "missed_ticks",
        "max_pending",
        "max_concurrency",
        "initial_delay",
        "max_run_time",
        "jitter",
    }
)

Problem = tuple[str, str, str]


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """A validated per-schedule policy (CONTRACT §2)."""

    mode: Mode = Mode.FIXED_RATE_NO_OVERLAP
    missed_ticks: MissedTicks = MissedTicks.SKIP
    max_pending: int | None = None
    max_concurrency: int | None = None
    initial_delay: float = 0.0
    max_run_time: float | None = None
    jitter: float | None = None

    @property
    def limit(self) -> int:
        """How many runs of this schedule may be active at once."""
        if self.mode is Mode.FIXED_RATE:
            assert self.max_concurrency is not None
            return self.max_concurrency
        return 1

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with the contract's key names."""
        return {
            "mode": self.mode.value,
            "missed_ticks": self.missed_ticks.value,
            "max_pending": self.max_pending,
            "max_concurrency": self.max_concurrency,
            "initial_delay": self.initial_delay,
            "max_run_time": self.max_run_time,
            "jitter": self.jitter,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Policy:
        """Inverse of :meth:`to_json` for rows this package wrote itself."""
        return cls(
            mode=Mode(data["mode"]),
            missed_ticks=MissedTicks(data["missed_ticks"]),
            max_pending=data.get("max_pending"),
            max_concurrency=data.get("max_concurrency"),
            initial_delay=float(data.get("initial_delay") or 0.0),
            max_run_time=data.get("max_run_time"),
            jitter=data.get("jitter"),
        )


def _seconds(value: Any) -> float | None:
    """Seconds from a number or timedelta; ``None`` when the type is wrong."""
    if isinstance(value, bool):
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return float(value)
    return None


def parse_policy(
    entry: str,
    raw: Any,
    default: Mapping[str, Any] | None = None,
    *,
    schedule_kind: str = "interval",
) -> tuple[Policy | None, list[Problem]]:
    """Merge ``raw`` over ``default`` and validate; returns the policy or every problem.

    ``schedule_kind`` is ``"interval"`` for numbers and timedeltas, anything else
    (``"crontab"``, ``"solar"``) for calendar schedules, which cannot be fixed-delay.
    """
    problems: list[Problem] = []
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        return None, [(entry, "policy", f"must be a dict, got {type(raw).__name__}")]
    merged: dict[str, Any] = dict(default or {})
    merged.update(raw)
    for key in sorted(set(merged) - POLICY_KEYS):
        problems.append(
            (entry, f"policy.{key}", f"unknown policy key (known: {', '.join(sorted(POLICY_KEYS))})")
        )

    mode: Mode | None = None
    raw_mode = merged.get("mode", Mode.FIXED_RATE_NO_OVERLAP.value)
    try:
        mode = Mode(raw_mode)
    except ValueError:
        problems.append(
            (entry, "policy.mode", f"unknown mode {raw_mode!r} (use {', '.join(m.value for m in Mode)})")
        )

    missed: MissedTicks | None = None
    raw_missed = merged.get("missed_ticks", MissedTicks.SKIP.value)
    try:
        missed = MissedTicks(raw_missed)
    except ValueError:
        problems.append(
            (
                entry,
                "policy.missed_ticks",
                f"unknown missed_ticks {raw_missed!r} (use {', '.join(m.value for m in MissedTicks)})",
            )
        )

    def positive_int(key: str) -> int | None:
        value = merged.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append((entry, f"policy.{key}", f"must be an integer >= 1, got {value!r}"))
            return None
        if value < 1:
            problems.append((entry, f"policy.{key}", f"must be >= 1, got {value}"))
            return None
        return value

    max_pending = positive_int("max_pending")
    max_concurrency = positive_int("max_concurrency")

    def duration(key: str, *, allow_zero: bool) -> float | None:
        value = merged.get(key)
        if value is None:
            return None
        seconds = _seconds(value)
        if seconds is None:
            problems.append(
                (entry, f"policy.{key}", f"must be seconds (number) or a timedelta, got {value!r}")
            )
            return None
        if seconds < 0 or (seconds == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            problems.append((entry, f"policy.{key}", f"must be {bound} seconds, got {value!r}"))
            return None
        return seconds

    initial_delay = duration("initial_delay", allow_zero=True) or 0.0
    max_run_time = duration("max_run_time", allow_zero=False)
    jitter = duration("jitter", allow_zero=True)

    if mode is Mode.FIXED_RATE:
        if merged.get("max_concurrency") is None:
            problems.append(
                (entry, "policy.max_concurrency", "is required (int >= 1) with mode 'fixed_rate'")
            )
    elif mode is not None and merged.get("max_concurrency") is not None:
        problems.append(
            (entry, "policy.max_concurrency", f"is only allowed with mode 'fixed_rate', not {mode.value!r}")
        )
    if missed is MissedTicks.CATCH_UP:
        if merged.get("max_pending") is None:
            problems.append(
                (entry, "policy.max_pending", "is required (int >= 1) with missed_ticks 'catch_up'")
            )
    elif missed is not None and merged.get("max_pending") is not None:
        problems.append(
            (
                entry,
                "policy.max_pending",
                f"is only allowed with missed_ticks 'catch_up', not {missed.value!r}",
            )
        )
    if mode is Mode.FIXED_DELAY:
        if missed is not None and missed is not MissedTicks.SKIP:
            problems.append(
                (
                    entry,
                    "policy.missed_ticks",
                    f"must stay 'skip' with mode 'fixed_delay', got {missed.value!r}",
                )
            )
        if schedule_kind != "interval":
            problems.append(
                (
                    entry,
                    "schedule",
                    f"mode 'fixed_delay' needs a number or timedelta schedule, not a {schedule_kind}",
                )
            )

    if problems or mode is None or missed is None:
        return None, problems
    return (
        Policy(
            mode=mode,
            missed_ticks=missed,
            max_pending=max_pending,
            max_concurrency=max_concurrency,
            initial_delay=initial_delay,
            max_run_time=max_run_time,
            jitter=jitter,
        ),
        [],
    )


class Timing(Protocol):
    """The grid a schedule ticks on (an interval, a crontab, a solar event)."""

    def first_at_or_after(self, t: datetime) -> datetime:
        """The first grid time at or after ``t``."""

    def passed(self, grid_at: datetime, now: datetime) -> tuple[int, Callable[[int], datetime], datetime]:
        """Grid ticks in ``[grid_at, now]``: their count, the i-th tick, and the next one after ``now``."""

    def gap(self, at: datetime) -> float:
        """Seconds between the grid tick ``at`` and the one after it (for the jitter cap)."""


@dataclass(frozen=True, slots=True)
class IntervalTiming:
    """A fixed period in seconds: ``1 + overdue // period`` ticks have passed."""

    period: float

    def first_at_or_after(self, t: datetime) -> datetime:
        return t

    def passed(self, grid_at: datetime, now: datetime) -> tuple[int, Callable[[int], datetime], datetime]:
        if now < grid_at:
            return 0, lambda i: grid_at, grid_at
        overdue = (now - grid_at).total_seconds()
        count = 1 + int(overdue // self.period)
        step = timedelta(seconds=self.period)
        return count, lambda i: grid_at + step * i, grid_at + step * count

    def gap(self, at: datetime) -> float:
        return self.period


#: Calendar grids are walked tick by tick; past this many the count stops (documented).
MAX_COUNTED_CALENDAR_TICKS = 10_000


@dataclass(frozen=True, slots=True)
class CalendarTiming:
    """A grid given by a function returning the first tick strictly after a time."""

    next_after: Callable[[datetime], datetime]

    def first_at_or_after(self, t: datetime) -> datetime:
        return self.next_after(t - timedelta(microseconds=1))

    def passed(self, grid_at: datetime, now: datetime) -> tuple[int, Callable[[int], datetime], datetime]:
        ticks: list[datetime] = []
        tick = grid_at
        while tick <= now and len(ticks) < MAX_COUNTED_CALENDAR_TICKS:
            ticks.append(tick)
            tick = self.next_after(tick)
        if tick <= now:
            tick = self.next_after(now)
        return len(ticks), ticks.__getitem__, tick

    def gap(self, at: datetime) -> float:
        return (self.next_after(at) - at).total_seconds()


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
    limit = policy.limit
    active = state.active_runs
    pending = list(state.pending)
    overlaps = state.overlaps
    skips = state.skips
    emit: list[Emission] = []
    drift = state.last_drift_ms
    grid_at = state.grid_at
    next_due: datetime | None = state.next_due_at
    skipped = 0
    coalesced = False
    ticks = 0

    def reserve(scheduled_for: datetime) -> None:
        nonlocal active, overlaps
        overlap = active > 0
        overlaps += int(overlap)
        active += 1
        emit.append(Emission(scheduled_for=scheduled_for, drift_ms=_ms(now - scheduled_for), overlap=overlap))

    if policy.mode is Mode.FIXED_DELAY:
        if next_due is not None and next_due <= now:
            if active < limit:
                drift = _ms(now - next_due)
                # A triggered (pending) run stands in for the due one: one run, not two.
                reserve(pending.pop(0) if pending else next_due)
                ticks = 1
            next_due = None
    elif grid_at is None:
        # No grid (a resumed calendar schedule): ticks passed while paused are not missed;
        # anchor on the first tick from now.
        grid_at = timing.first_at_or_after(now)
        next_due = grid_at + jitter_delay(policy, timing.gap(grid_at), rng)
    elif grid_at <= now:
        # Pending runs are older than the ticks passed now: they take the free slots first.
        while pending and active < limit:
            reserve(pending.pop(0))
        count, tick_at, next_grid = timing.passed(grid_at, now)
        ticks = count
        drift = _ms(now - grid_at)
        n_start = min(max(limit - active, 0), count)
        if policy.missed_ticks is MissedTicks.CATCH_UP:
            started = range(n_start)
            rest = range(n_start, count)
        else:
            started = range(count - n_start, count)
            rest = range(count - n_start)
        for i in started:
            reserve(tick_at(i))
        missed = len(rest)
        if missed:
            if policy.missed_ticks is MissedTicks.SKIP:
                skipped = missed
            elif policy.missed_ticks is MissedTicks.COALESCE_LATEST:
                skipped = missed - 1 if not pending else missed
                pending = [tick_at(rest[-1])]
                coalesced = True
            else:
                assert policy.max_pending is not None
                room = max(policy.max_pending - len(pending), 0)
                added = min(room, missed)
                pending.extend(tick_at(rest[i]) for i in range(added))
                skipped = missed - added
        skips += skipped
        grid_at = next_grid
        next_due = next_grid + jitter_delay(policy, timing.gap(next_grid), rng)

    while pending and active < limit:
        reserve(pending.pop(0))

    if policy.mode is Mode.FIXED_DELAY and emit:
        next_due = None
    elif grid_at is not None and next_due is not None and next_due <= now:
        # A due time set for pending runs (settle, trigger) must not stay in the past, or
        # the beat would spin until the next grid tick: pending runs wait for a settle.
        next_due = grid_at + jitter_delay(policy, timing.gap(grid_at), rng)
    return TickOutcome(
        state=replace(
            state,
            active_runs=active,
            pending=tuple(pending),
            grid_at=grid_at,
            next_due_at=next_due,
            overlaps=overlaps,
            skips=skips,
            last_drift_ms=drift,
        ),
        emit=tuple(emit),
        skipped=skipped,
        coalesced=coalesced,
        ticks=ticks,
    )


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


@dataclass(frozen=True, kw_only=True, slots=True)
class EntrySpec:
    """A fully validated schedule entry (what beat needs to emit runs of it)."""

    name: str
    task: str
    policy: Policy
    timing: Timing = field(compare=False)
    schedule_repr: str
    period: float | None
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
