"""The tick state machine: what happens to a schedule's state at each event.

Every event a schedule sees (first sight, due time, settle, trigger, resume, a changed
config entry) is one pure function of the policy, the state and ``now`` that returns the
next state. The store only loads a row, calls one of these and writes the result back, so
every decision is tested with a fake clock. The due time, the biggest event, has a module of
its own (:mod:`~celery_boundedbeat.core.due`); the state values it works on live here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from .enums import MissedTicks, Mode, RunState, StopReason
from .loops import effective_jitter_cap
from .policy import Policy
from .retries import RetryDue, retried, with_retries, within_retry_bound
from .spec import EntrySpec
from .timing import MAX_COUNTED_CALENDAR_TICKS, IntervalTiming, Timing

MAX_QUEUED_TRIGGERS = 10
"""Triggered runs one schedule keeps waiting for a slot; a trigger past this is refused.

A trigger is a person or a script asking for one more run now. More than a few waiting means
a retry loop or an impatient button rather than intent, and each one waiting is a run the
workers still owe once the schedule's slots free. So the queue is bounded like ``max_pending``,
but the caller hears about it (``TriggerRefused``): a trigger is never dropped silently.
"""

BACKFILL_PER_TICK = 100
"""Backfilled runs one schedule starts in one tick, however many slots are free.

A wide ``fixed_rate`` bound would otherwise turn a long backfill into one huge tick
transaction; the rest start in the ticks right after (the schedule stays due meanwhile).
"""


#: The database's time resolution: the smallest step that keeps two ``scheduled_for`` apart.
MICROSECOND = timedelta(microseconds=1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleState:
    """What the scheduler remembers about one schedule between ticks (one DB row)."""

    active_runs: int = 0
    #: Grid ticks that found every slot busy and wait for one, as ``missed_ticks`` allows.
    pending: tuple[datetime, ...] = ()
    #: Triggered runs waiting for a slot, first asked first: never coalesced, skipped or counted
    #: as grid ticks (at most :data:`MAX_QUEUED_TRIGGERS`).
    triggers: tuple[datetime, ...] = ()
    #: Backfilled grid times waiting for a slot, oldest first (``backfill`` queued them); they
    #: start after triggers and pending ticks, and never count toward ``max_runs``.
    backfill: tuple[datetime, ...] = ()
    #: Runs to attempt again (``retry``), each after its backoff: they start before every other
    #: waiting run once due, outlive the schedule's end, and never count toward ``max_runs``.
    retries: tuple[RetryDue, ...] = ()
    #: Runs emitted again by ``retry`` (attempts 2..N), counted apart from grid runs.
    retried: int = 0
    grid_at: datetime | None = None
    next_due_at: datetime | None = None
    runs: int = 0
    #: Every grid tick dropped, whatever dropped it: the sum of the three counters below.
    skips: int = 0
    #: Ticks dropped because every slot was busy (``skip``; ``replace`` when it cannot revoke).
    busy_skips: int = 0
    #: Ticks dropped because they were found more than ``catchup_window`` after their time.
    window_drops: int = 0
    #: Ticks dropped from the pending buffer: ``coalesce_latest``/``catch_up`` overflow, a
    #: smaller bound after a change, or an end reached with ticks still pending.
    buffer_drops: int = 0
    #: Active runs revoked to make room for a newer tick (``missed_ticks: "replace"``).
    replaced: int = 0
    overlaps: int = 0
    failures: int = 0
    last_drift_ms: int | None = None
    last_elapsed_ms: int | None = None
    max_elapsed_ms: int | None = None
    stopped: bool = False
    #: Runs emitted from the grid (or fixed-delay due times), the count ``max_runs`` bounds.
    grid_runs: int = 0
    #: Why the schedule stops or stopped: ``stop_schedule()``, or the end its policy gave it.
    #: An ended schedule emits no more grid runs and shows ``stopped`` once nothing is active.
    stop_reason: StopReason | None = None
    #: Failed, timed-out or lost runs since the last completed one (``pause_on_failure``).
    consecutive_failures: int = 0
    #: Set when ``pause_on_failure`` paused the schedule: names the failing run; ``resume`` clears it.
    pause_reason: str | None = None

    @property
    def ended(self) -> bool:
        """Whether the policy's ``end_at`` or ``max_runs`` ended the schedule."""
        return self.stop_reason is not None and self.stop_reason.ended

    @property
    def waiting_runs(self) -> int:
        """Runs waiting: pending ticks, triggers, backfill and retries (``pending_runs``)."""
        return self.ready_runs + len(self.retries)

    @property
    def ready_runs(self) -> int:
        """Runs waiting only for a slot: pending ticks, triggers and backfill (not retries in backoff)."""
        return len(self.pending) + len(self.triggers) + len(self.backfill)

    @property
    def asked(self) -> bool:
        """Whether runs owed outside the grid wait (triggers, backfill, retries): they outlive
        the schedule's end."""
        return bool(self.triggers or self.backfill or self.retries)


@dataclass(frozen=True, kw_only=True, slots=True)
class Emission:
    """One run to emit now, for the grid time (or trigger time) it belongs to."""

    scheduled_for: datetime
    drift_ms: int
    overlap: bool
    #: Asked for by ``trigger``, not a grid tick (nor a fixed-delay due time).
    triggered: bool = False
    #: A past grid time queued by ``backfill``: written only if it has no run yet.
    backfilled: bool = False
    #: 1 for a grid, triggered or backfilled run; 2.. for a run of ``retry``.
    attempt: int = 1
    #: The run this one attempts again (``retry``).
    retry_of: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Triggered:
    """A trigger that was queued: the new state and the ``scheduled_for`` its run will carry."""

    state: ScheduleState
    scheduled_for: datetime


@dataclass(frozen=True, kw_only=True, slots=True)
class TriggerRefused:
    """A trigger that was not queued; ``reason`` is written for whoever asked for it."""

    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TickOutcome:
    """The result of looking at one due schedule."""

    state: ScheduleState
    emit: tuple[Emission, ...] = ()
    #: Ticks dropped by this tick, whatever dropped them (``ticks_dropped`` reports this).
    skipped: int = 0
    coalesced: bool = False
    ticks: int = 0
    #: Of ``skipped``: found past ``catchup_window``, and dropped from the pending buffer.
    window_dropped: int = 0
    buffer_dropped: int = 0
    #: Oldest active runs the store must settle ``revoked`` (and the workers terminate) in
    #: this tick's transaction: their slots already went to the new runs (``replace``).
    revoke: int = 0

    @property
    def busy_skipped(self) -> int:
        """Of ``skipped``: ticks dropped because every slot was busy."""
        return self.skipped - self.window_dropped - self.buffer_dropped


def ms(delta: timedelta) -> int:
    return max(0, int(delta.total_seconds() * 1000))


#: How long a due schedule whose stored definition cannot be rebuilt waits before beat looks
#: at it again (an update of it sets its due time at once).
UNUSABLE_RETRY = timedelta(seconds=60)


def set_aside_until(now: datetime) -> datetime:
    """The due time of a schedule beat cannot run now: out of the due range, back in a minute."""
    return now + UNUSABLE_RETRY


def jitter_delay(policy: Policy, gap_s: float, rng: random.Random) -> timedelta:
    """A uniform positive delay in ``[0, min(jitter, gap / 10)]``: a run stays near its tick."""
    if not policy.jitter:
        return timedelta(0)
    cap = effective_jitter_cap(gap_s, policy.jitter)
    if cap <= 0:
        return timedelta(0)
    return timedelta(seconds=rng.uniform(0.0, cap))


def opening(policy: Policy, timing: Timing, t: datetime, *, reach_back: bool = False) -> datetime:
    """The first grid time of a schedule starting at ``t``, never one before ``start_at``.

    A future ``start_at`` is where the grid starts (an interval's first tick is ``start_at``;
    a calendar's first fire time at or after it). A past one keeps an interval on its phase
    (``start_at + k * period``) from ``t`` on. With ``reach_back`` (a schedule just added) the
    grid time in progress, the latest at or before ``t`` and not before ``start_at``, is where
    it starts instead: due at once, as a tick found late.
    """
    start = policy.start_at
    if start is None or start >= t:
        return timing.first_at_or_after(t if start is None else start)
    if not isinstance(timing, IntervalTiming):
        latest = _latest_fire(timing, start, t) if reach_back else None
        return timing.first_at_or_after(t) if latest is None else latest
    step = timedelta(seconds=timing.period)
    latest = start + step * ((t - start) // step)
    return latest if reach_back or latest == t else latest + step


def _latest_fire(timing: Timing, start: datetime, t: datetime) -> datetime | None:
    """A calendar's latest fire time in ``[start, t]``; ``None`` if none, or too many to walk."""
    first = timing.first_at_or_after(start)
    count, tick_at, _ = timing.passed(first, t)
    if count == 0 or count >= MAX_COUNTED_CALENDAR_TICKS:
        return None
    return tick_at(count - 1)


def initial_state(
    policy: Policy, timing: Timing, now: datetime, rng: random.Random, *, reach_back: bool = False
) -> ScheduleState:
    """State of a schedule seen for the first time: first run due after ``initial_delay``.

    Never before ``start_at`` (:func:`opening`; ``reach_back`` for a schedule just added).
    """
    first = now + timedelta(seconds=policy.initial_delay)
    if policy.mode is Mode.FIXED_DELAY:
        start = policy.start_at
        return ScheduleState(next_due_at=first if start is None else max(first, start))
    grid = opening(policy, timing, first, reach_back=reach_back)
    return ScheduleState(grid_at=grid, next_due_at=grid + jitter_delay(policy, timing.gap(grid), rng))


def end_reason(policy: Policy, state: ScheduleState) -> StopReason | None:
    """The end a schedule has reached: ``max_runs`` emitted, or its next due time past ``end_at``."""
    if policy.max_runs is not None and state.grid_runs >= policy.max_runs:
        return StopReason.MAX_RUNS
    upcoming = state.grid_at if state.grid_at is not None else state.next_due_at
    if policy.end_at is not None and upcoming is not None and upcoming > policy.end_at:
        return StopReason.END_AT
    return None


def ended_if_over(policy: Policy, outcome: TickOutcome) -> TickOutcome:
    """Mark the schedule ended as soon as its last allowed run is emitted (or none is left).

    Pending grid ticks that can no longer start are skips; queued triggers still start. The
    schedule shows ``stopped`` once nothing of it is active or waiting (:func:`_settled_end`).
    """
    state = outcome.state
    reason = state.stop_reason if state.ended else end_reason(policy, state)
    if reason is None:
        return outcome
    dropped = len(state.pending)
    ended = replace(
        state,
        stop_reason=reason,
        pending=(),
        skips=state.skips + dropped,
        buffer_drops=state.buffer_drops + dropped,
        grid_at=None,
        next_due_at=state.next_due_at if state.asked else None,
    )
    return replace(
        outcome,
        state=_settled_end(ended),
        skipped=outcome.skipped + dropped,
        buffer_dropped=outcome.buffer_dropped + dropped,
    )


def _settled_end(state: ScheduleState) -> ScheduleState:
    """An ended schedule with nothing active or waiting shows ``stopped``."""
    if state.ended and state.active_runs == 0 and not state.asked:
        return replace(state, stopped=True, next_due_at=None)
    return state


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
    run_id: str | None = None,
    attempt: int = 1,
    scheduled_for: datetime | None = None,
) -> ScheduleState:
    """Free one slot exactly once and count the outcome (``ScheduledRunGuard``'s drop).

    Fixed delay: the next run is due ``period`` after this finish. Otherwise waiting runs
    (pending ticks, queued triggers) become due at once so they start as soon as the beat
    sees the freed slot. A run that ended as ``retry.on`` names, short of
    ``retry.max_attempts``, waits to run again for its ``scheduled_for`` after its backoff.
    """
    assert outcome.terminal, outcome
    stopped = state.stopped or stop
    reason = state.stop_reason
    if stop and reason is None:
        reason = StopReason.STOP_SCHEDULE
    last_elapsed = state.last_elapsed_ms
    max_elapsed = state.max_elapsed_ms
    if elapsed_ms is not None:
        last_elapsed = elapsed_ms
        max_elapsed = max(max_elapsed or 0, elapsed_ms)
    retries = (
        state.retries
        if stopped
        else retried(policy, state.retries, outcome, now, run_id, attempt, scheduled_for)
    )
    next_due = _due_after_settle(policy, state, now, stopped=stopped, gap_s=gap_s, rng=rng)
    settled = replace(
        state,
        active_runs=max(state.active_runs - 1, 0),
        runs=state.runs + int(not outcome.counts_as_failure),
        failures=state.failures + int(outcome.counts_as_failure),
        last_elapsed_ms=last_elapsed,
        max_elapsed_ms=max_elapsed,
        stopped=stopped,
        stop_reason=reason,
        retries=retries,
        next_due_at=with_retries(next_due, retries, now, stopped),
    )
    if not stopped and not state.ended and policy.mode is Mode.FIXED_DELAY:
        end = end_reason(policy, settled)
        if end is not None:
            due = now if settled.triggers else None
            settled = replace(settled, stop_reason=end, next_due_at=with_retries(due, retries, now, False))
    return _settled_end(_failure_streak(policy, settled, outcome, run_id))


def _due_after_settle(
    policy: Policy, state: ScheduleState, now: datetime, *, stopped: bool, gap_s: float, rng: random.Random
) -> datetime | None:
    """The due time once a slot freed: fixed delay's next run, or at once for runs waiting a slot."""
    next_due = state.next_due_at
    if stopped:
        return None
    if state.ended:
        return now if state.ready_runs else None
    if policy.mode is Mode.FIXED_DELAY:
        if state.ready_runs:
            return now
        return now + timedelta(seconds=gap_s) + jitter_delay(policy, gap_s, rng)
    if state.ready_runs:
        return now if next_due is None else min(next_due, now)
    return next_due


#: Outcomes ``pause_on_failure`` ignores: a person or the scheduler chose them, not the task.
_NOT_THE_TASKS_FAILURE = frozenset({RunState.REVOKED, RunState.REJECTED})


def _failure_streak(
    policy: Policy, state: ScheduleState, outcome: RunState, run_id: str | None
) -> ScheduleState:
    """Count consecutive failures; at ``pause_on_failure`` of them, ask for a pause naming the run.

    A completed run ends the streak; revoked and rejected runs neither count nor end it.
    """
    if outcome is RunState.COMPLETED:
        return replace(state, consecutive_failures=0)
    if outcome in _NOT_THE_TASKS_FAILURE:
        return state
    streak = state.consecutive_failures + 1
    state = replace(state, consecutive_failures=streak)
    bound = policy.pause_on_failure
    if bound is not None and streak >= bound and state.pause_reason is None:
        reason = f"pause_on_failure: {streak} failing runs in a row, the last {run_id} ({outcome.value})"
        state = replace(state, pause_reason=reason)
    return state


def on_trigger(
    state: ScheduleState, now: datetime, *, paused: bool, last_run_at: datetime | None = None
) -> Triggered | TriggerRefused:
    """Queue one extra run at ``now``, apart from the grid, or say why not.

    The run waits in ``triggers`` rather than being emitted: the next :func:`~.due.on_due` starts it
    at the first free slot, so a trigger never breaks the concurrency bound, and no missed tick
    can coalesce it away. A paused or stopped schedule refuses (the run would wait silently for
    a resume nobody planned), and so does a full queue (:data:`MAX_QUEUED_TRIGGERS`).
    ``scheduled_for`` is ``now``, moved 1 µs past any later time already taken by a queued
    trigger, a pending tick or the newest run (``last_run_at``): the run key is unique.
    """
    if paused:
        return TriggerRefused(reason="the schedule is paused; resume it first")
    if state.ended:
        return TriggerRefused(
            reason=f"the schedule has ended ({state.stop_reason}); give it a new end with update first"
        )
    if state.stopped:
        return TriggerRefused(reason="the schedule is stopped; resume it first")
    if len(state.triggers) >= MAX_QUEUED_TRIGGERS:
        return TriggerRefused(
            reason=f"{MAX_QUEUED_TRIGGERS} triggered runs already wait for a slot (the most a schedule "
            "queues); try again once one has started"
        )
    taken = [
        t
        for t in (*state.triggers, *state.pending, *state.backfill, last_run_at)
        if t is not None and t >= now
    ]
    at = max([now, *(t + MICROSECOND for t in taken)])
    due = now if state.next_due_at is None else min(state.next_due_at, now)
    return Triggered(state=replace(state, triggers=(*state.triggers, at), next_due_at=due), scheduled_for=at)


def on_resume(
    policy: Policy, state: ScheduleState, now: datetime, *, period: float | None, replay: bool = False
) -> ScheduleState:
    """Resume a paused (or stopped) schedule: ticks passed meanwhile are not missed ticks.

    Fixed delay is due at once unless a run is still active (its settle sets the next due).
    An interval grid rejoins at its first tick after ``now``; a past calendar grid (no
    ``period``) is cleared and due now, so :func:`~.due.on_due` re-anchors it without emitting. A
    future grid keeps its (jittered) due time. Waiting runs make it due at once.

    ``replay`` keeps a past grid where the pause left it and makes it due now: the next
    :func:`~.due.on_due` counts the ticks passed meanwhile and hands them to ``missed_ticks``, as
    after a beat outage (``catchup_window`` bounds them).
    """
    grid_at, next_due = state.grid_at, state.next_due_at
    if policy.mode is Mode.FIXED_DELAY:
        if state.active_runs == 0:
            next_due = now if policy.start_at is None else max(now, policy.start_at)
    elif replay and grid_at is not None and grid_at < now:
        next_due = now
    elif grid_at is not None and grid_at < now and period:
        step = timedelta(seconds=period)
        grid_at = grid_at + step * ((now - grid_at) // step + 1)
        next_due = grid_at
    elif grid_at is not None and grid_at < now:
        grid_at, next_due = None, now
    elif grid_at is not None:
        next_due = max(grid_at, next_due or grid_at)
    if state.waiting_runs:
        next_due = now
    return replace(
        state,
        stopped=False,
        stop_reason=None,
        grid_at=grid_at,
        next_due_at=next_due,
        consecutive_failures=0,
        pause_reason=None,
    )


def stopped_as(state: ScheduleState, reason: StopReason) -> ScheduleState:
    """A schedule recreated in the stopped or ended state it was exported in: nothing more due."""
    return replace(state, stopped=True, stop_reason=reason, grid_at=None, next_due_at=None, pending=())


def resume_refusal(state: ScheduleState) -> str | None:
    """Why ``resume`` must refuse: an ended schedule comes back only with a new end (update)."""
    if state.ended:
        return (
            f"the schedule has ended ({state.stop_reason}); resume does not revive it, "
            "update_schedule with a later end_at or a higher max_runs does"
        )
    return None


def on_config_change(
    spec: EntrySpec,
    state: ScheduleState,
    *,
    config_changed: bool,
    old_schedule: str,
    old_mode: Mode,
    now: datetime,
    rng: random.Random,
    last_run_at: datetime | None = None,
    old_timezone: str | None = None,
) -> ScheduleState:
    """Reconcile a stored schedule with its config entry at beat start.

    Counters, queued triggers, pending runs and pause/stop survive; pending runs beyond the
    new policy's bound become skips (:func:`_within_pending_bound`), and waiting runs that
    now find a free slot are due at once. Only a new timing (another schedule or mode)
    restarts the grid from ``now``, as a new entry would (:func:`_restarted`), and so do a
    calendar grid moved to another zone (``old_timezone``, when known) and a ``start_at``
    after the next due time (the grid moves to it); a fixed-delay
    run still active keeps the due time its settle will set. An unchanged entry whose
    fixed-delay run was settled while no period was known gets the due time it never received.
    """
    if config_changed:
        state = _within_pending_bound(spec.policy, state)
        kept = within_retry_bound(spec.policy, state.retries)
        if len(kept) != len(state.retries):
            state = replace(state, retries=kept)
        revived = state.ended and _allows_more(spec.policy, state, now)
        if revived:
            state = replace(state, stop_reason=None, stopped=False)
        moved = old_timezone is not None and old_timezone != spec.timezone
        retimed = old_schedule != spec.schedule_repr or old_mode != spec.policy.mode
        if revived or moved or retimed or _before_start(spec.policy, state):
            state = _restarted(spec, state, now, rng, last_run_at)
        if state.waiting_runs and state.active_runs < spec.policy.limit and not state.stopped:
            state = replace(state, next_due_at=min(state.next_due_at or now, now))
        return state
    if state.next_due_at is None and not state.stopped and state.active_runs == 0:
        return replace(state, next_due_at=initial_state(spec.policy, spec.timing, now, rng).next_due_at)
    return state


def first_state(
    spec: EntrySpec, now: datetime, rng: random.Random, last_run_at: datetime | None = None
) -> ScheduleState:
    """A new schedule's state; its first tick after ``last_run_at`` (a name used before).

    A past ``start_at`` reaches back: the interval grid time in progress is due at once.
    """
    return _restarted(spec, ScheduleState(), now, rng, last_run_at, reach_back=True)


def _before_start(policy: Policy, state: ScheduleState) -> bool:
    """Whether a (new or later) ``start_at`` comes after the next due time: the grid moves to it."""
    upcoming = state.grid_at or state.next_due_at
    return policy.start_at is not None and upcoming is not None and upcoming < policy.start_at


def _allows_more(policy: Policy, state: ScheduleState, now: datetime) -> bool:
    """Whether a changed policy gives an ended schedule runs again (a later end, more runs)."""
    if policy.max_runs is not None and state.grid_runs >= policy.max_runs:
        return False
    return policy.end_at is None or policy.end_at > now


def _restarted(
    spec: EntrySpec,
    state: ScheduleState,
    now: datetime,
    rng: random.Random,
    last_run_at: datetime | None,
    *,
    reach_back: bool = False,
) -> ScheduleState:
    """A new grid (or fixed-delay due time) from ``now``, after ``last_run_at`` when given.

    ``last_run_at`` (the newest run's ``scheduled_for``, read by the caller) matters when the
    change comes in the very microsecond of a run: the new grid's first tick would repeat
    that run's time and break the unique run key.
    """
    fresh = initial_state(spec.policy, spec.timing, now, rng, reach_back=reach_back)
    first = fresh.grid_at or fresh.next_due_at
    if last_run_at is not None and first is not None and first <= last_run_at:
        # Start as if the change came 1 µs after that run, ``initial_delay`` included.
        shifted = last_run_at + MICROSECOND - timedelta(seconds=spec.policy.initial_delay)
        fresh = initial_state(spec.policy, spec.timing, shifted, rng)
    wait_for_settle = state.active_runs != 0 and spec.policy.mode is Mode.FIXED_DELAY
    next_due = state.next_due_at if wait_for_settle else fresh.next_due_at
    return replace(state, grid_at=fresh.grid_at, next_due_at=next_due)


def pending_bound(policy: Policy) -> int:
    """How many missed grid ticks may wait for a slot: the ``missed_ticks`` bound."""
    if policy.mode is Mode.FIXED_DELAY or policy.missed_ticks in (MissedTicks.SKIP, MissedTicks.REPLACE):
        return 0
    if policy.missed_ticks is MissedTicks.COALESCE_LATEST:
        return 1
    assert policy.max_pending is not None
    return policy.max_pending


def _within_pending_bound(policy: Policy, state: ScheduleState) -> ScheduleState:
    """Drop the pending ticks a changed policy no longer allows, counting each as a skip.

    Kept as ``missed_ticks`` would have kept them: ``coalesce_latest`` the latest, ``catch_up``
    the oldest. Without this, ``skip`` (or fixed delay) would still start old ticks, a smaller
    ``max_pending`` would stay exceeded, and ``coalesce_latest`` would later replace several
    pending ticks at once.
    """
    if policy.mode is Mode.FIXED_DELAY and state.backfill:
        state = replace(state, backfill=())  # no grid any more: its grid times mean nothing now
    bound = pending_bound(policy)
    extra = len(state.pending) - bound
    if extra <= 0:
        return state
    coalesce = policy.missed_ticks is MissedTicks.COALESCE_LATEST
    kept = state.pending[extra:] if coalesce else state.pending[:bound]
    return replace(state, pending=kept, skips=state.skips + extra, buffer_drops=state.buffer_drops + extra)
