"""Backfill: which past grid times of a schedule to queue, and what a conflicting one gives back.

``backfill NAME --start T --end T`` asks for the runs a schedule's grid had in a past range
and did not get (beat was down, the schedule paused, ticks skipped on busy slots). Pure: the
store reads the schedule row and the run times already in the range, asks :func:`on_backfill`
and writes the answer; the grid times then wait in the schedule's ``backfill`` list and the
tick machinery (:mod:`~celery_boundedbeat.core.ticks`) starts them as slots free, under the same
bound as every other run.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from .enums import Mode
from .policy import Policy
from .ticks import Emission, ScheduleState, TickOutcome
from .timing import IntervalTiming, Timing

BACKFILL_CAP = 1000
"""Grid times one backfill call covers, and the most one schedule keeps waiting.

A larger range is refused (split it): each waiting time is a run the workers owe, and the
list lives in the schedule's row, so it is kept small enough to rewrite at every tick.
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class Backfilled:
    """A backfill request that was queued: the new state and what it found in the range."""

    state: ScheduleState
    #: Grid times queued now (they wait for a slot, oldest first).
    queued: tuple[datetime, ...]
    #: Grid times in the range that already had a run: never emitted again.
    had_runs: int
    #: Grid times already waiting (an earlier backfill, a pending tick, a queued trigger).
    waiting: int


@dataclass(frozen=True, kw_only=True, slots=True)
class BackfillRefused:
    """A backfill that was not queued; ``key`` names the argument at fault, if one is."""

    reason: str
    key: str | None = None


def as_utc(value: datetime | str, key: str) -> datetime | BackfillRefused:
    """A range bound as aware UTC; a naive time is UTC, as the CLI reads ``--since``."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return BackfillRefused(key=key, reason=f"must be an ISO 8601 time, got {value!r}")
    if not isinstance(value, datetime):
        return BackfillRefused(key=key, reason=f"must be a datetime or an ISO 8601 string, got {value!r}")
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


def range_refusal(start: datetime, end: datetime, now: datetime) -> BackfillRefused | None:
    """Why the range itself cannot be backfilled: reversed, or reaching past ``now``."""
    if end < start:
        return BackfillRefused(key="end", reason=f"{end.isoformat()} is before start {start.isoformat()}")
    if end > now:
        return BackfillRefused(
            key="end",
            reason=f"{end.isoformat()} is in the future (now {now.isoformat(timespec='seconds')}); "
            "backfill fills past grid times, the schedule emits the coming ones itself",
        )
    return None


def _state_refusal(
    policy: Policy, state: ScheduleState, *, paused: bool, kind: str
) -> BackfillRefused | None:
    if kind == "solar":
        return BackfillRefused(
            reason="a solar schedule's past event times are not computed (its grid is measured from the "
            "wall clock), so it cannot be backfilled"
        )
    if policy.mode is Mode.FIXED_DELAY:
        return BackfillRefused(
            reason="mode 'fixed_delay' has no grid (each run is due a period after the last finished), "
            "so there are no grid times to fill"
        )
    if paused:
        return BackfillRefused(reason="the schedule is paused; resume it first")
    if state.ended:
        return BackfillRefused(
            reason=f"the schedule has ended ({state.stop_reason}); give it a new end with update first"
        )
    if state.stopped:
        return BackfillRefused(reason="the schedule is stopped; resume it first")
    return None


def grid_times(
    timing: Timing, grid_at: datetime, start: datetime, end: datetime, cap: int = BACKFILL_CAP
) -> list[datetime] | BackfillRefused:
    """The grid times in ``[start, end]`` before ``grid_at`` (the grid's next tick), oldest first.

    An interval grid is its current phase extended back from ``grid_at`` (counted by
    arithmetic, so a huge range is refused without being walked); a calendar grid is walked.
    Times at or after ``grid_at`` are the live grid's: ``missed_ticks`` decides them.
    """
    last = min(end, grid_at - timedelta(microseconds=1))
    if last < start:
        return []
    if isinstance(timing, IntervalTiming):
        step = timedelta(seconds=timing.period)
        newest = -((last - grid_at) // step)  # steps back to the newest time <= last (ceil)
        oldest = (grid_at - start) // step  # steps back to the oldest time >= start (floor)
        count = oldest - newest + 1
        if count > cap:
            return _too_many(count, cap)
        return [grid_at - step * k for k in range(oldest, newest - 1, -1)]
    first = timing.first_at_or_after(start)
    if first > last:
        return []
    count, tick_at, _ = timing.passed(first, last)
    if count > cap:
        return _too_many(count, cap)
    return [tick_at(i) for i in range(count)]


def _too_many(count: int, cap: int) -> BackfillRefused:
    shown = f"{count}" if count < 10 * cap else f"more than {10 * cap}"
    return BackfillRefused(
        key="start",
        reason=f"the range holds {shown} grid times; one backfill covers at most {cap} (split the range)",
    )


def on_backfill(
    policy: Policy,
    timing: Timing,
    state: ScheduleState,
    start: datetime,
    end: datetime,
    now: datetime,
    *,
    paused: bool,
    run_times: Collection[datetime],
    kind: str = "interval",
) -> Backfilled | BackfillRefused:
    """Queue the grid times in ``[start, end]`` that have no run and are not already waiting.

    ``run_times`` are the ``scheduled_for`` of the schedule's runs in the range, read in the
    same transaction; the unique run key still guards the write (:func:`without_taken`).
    ``kind`` is the stored grid's kind (``interval``, ``crontab``, ``solar``). The schedule
    becomes due at once, so a running beat starts them as slots free.
    """
    refused = range_refusal(start, end, now) or _state_refusal(policy, state, paused=paused, kind=kind)
    if refused is not None:
        return refused
    anchor = state.grid_at if state.grid_at is not None else now
    times = grid_times(timing, anchor, start, end)
    if isinstance(times, BackfillRefused):
        return times
    has_run = set(run_times)
    waiting = {*state.pending, *state.triggers, *state.backfill}
    new = tuple(t for t in times if t not in has_run and t not in waiting)
    if len(state.backfill) + len(new) > BACKFILL_CAP:
        return BackfillRefused(
            reason=f"{len(state.backfill)} backfilled grid times already wait and {len(new)} more would "
            f"pass the {BACKFILL_CAP} a schedule keeps; try again once some have started"
        )
    merged = tuple(sorted({*state.backfill, *new}))
    due = state.next_due_at
    if new:
        due = now if due is None else min(due, now)
    return Backfilled(
        state=replace(state, backfill=merged, next_due_at=due),
        queued=new,
        had_runs=sum(1 for t in times if t in has_run),
        waiting=sum(1 for t in times if t in waiting and t not in has_run),
    )


def without_taken(outcome: TickOutcome, taken: Sequence[datetime], now: datetime) -> TickOutcome:
    """A tick outcome minus backfilled runs whose grid time turned out to have a run already.

    The write found the run key taken (``ON CONFLICT DO NOTHING`` inserted nothing): their
    slots were never used, so they are given back, and the schedule stays due so the next
    backfilled time takes them.
    """
    if not taken:
        return outcome
    gone = set(taken)
    dropped = [e for e in outcome.emit if e.backfilled and e.scheduled_for in gone]
    state = outcome.state
    # Overlaps recounted over the runs really started, in their order, from the slots held before.
    active = state.active_runs - len(outcome.emit)
    overlaps = state.overlaps - sum(e.overlap for e in outcome.emit)
    kept: list[Emission] = []
    for emission in outcome.emit:
        if emission in dropped:
            continue
        kept.append(replace(emission, overlap=active > 0))
        overlaps += int(active > 0)
        active += 1
    due = now if state.next_due_at is None else min(state.next_due_at, now)
    state = replace(
        state,
        active_runs=max(active, 0),
        overlaps=max(overlaps, 0),
        next_due_at=due if state.backfill else state.next_due_at,
    )
    if state.ended and state.active_runs == 0 and not state.asked:
        state = replace(state, stopped=True, next_due_at=None)  # it was the ended schedule's last run
    return replace(outcome, state=state, emit=tuple(kept))
