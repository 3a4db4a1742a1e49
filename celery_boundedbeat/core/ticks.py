"""The tick state machine: what happens to a schedule's state at each event.

Every event a schedule sees (first sight, due time, settle, trigger, resume, a changed
config entry) is one pure function of the policy, the state and ``now`` that returns the
next state. The store only loads a row, calls one of these and writes the result back, so
every decision is tested with a fake clock.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from .enums import MissedTicks, Mode, RunState, StopReason
from .loops import effective_jitter_cap
from .policy import Policy
from .spec import EntrySpec
from .timing import Timing

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
_MICROSECOND = timedelta(microseconds=1)


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
        """Runs waiting for a slot: pending ticks, triggers and backfill (``pending_runs``)."""
        return len(self.pending) + len(self.triggers) + len(self.backfill)

    @property
    def asked(self) -> bool:
        """Whether runs asked for by hand wait (triggers, backfill): they outlive the schedule's end."""
        return bool(self.triggers or self.backfill)


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


def _ms(delta: timedelta) -> int:
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
    triggers: list[datetime]
    backfill: list[datetime]
    overlaps: int
    skips: int
    drift: int | None
    grid_at: datetime | None
    next_due: datetime | None
    grid_runs: int = 0
    backfilled: int = 0
    #: Active runs the store could revoke for ``replace`` (it found and locked them).
    revocable: int = 0
    emit: list[Emission] = field(default_factory=list)
    skipped: int = 0
    coalesced: bool = False
    ticks: int = 0
    window_dropped: int = 0
    buffer_dropped: int = 0
    revoke: int = 0

    @classmethod
    def of(cls, policy: Policy, state: ScheduleState, now: datetime, revocable: int = 0) -> _Due:
        return cls(
            policy=policy,
            now=now,
            active=state.active_runs,
            pending=list(state.pending),
            triggers=list(state.triggers),
            backfill=list(state.backfill),
            overlaps=state.overlaps,
            skips=state.skips,
            drift=state.last_drift_ms,
            grid_at=state.grid_at,
            next_due=state.next_due_at,
            grid_runs=state.grid_runs,
            revocable=revocable,
        )

    def has_slot(self) -> bool:
        return self.active < self.policy.limit

    def grid_room(self) -> int:
        """Grid runs ``max_runs`` still allows (triggers never count)."""
        if self.policy.max_runs is None:
            return 1 << 62
        return max(self.policy.max_runs - self.grid_runs, 0)

    def reserve(self, scheduled_for: datetime, *, triggered: bool = False, backfilled: bool = False) -> None:
        """Take a slot for a run of ``scheduled_for`` (an overlap if another is active)."""
        overlap = self.active > 0
        self.overlaps += int(overlap)
        self.active += 1
        self.grid_runs += int(not triggered and not backfilled)
        drift_ms = _ms(self.now - scheduled_for)
        self.emit.append(
            Emission(
                scheduled_for=scheduled_for,
                drift_ms=drift_ms,
                overlap=overlap,
                triggered=triggered,
                backfilled=backfilled,
            )
        )

    def start_backfill(self) -> None:
        """Backfilled grid times take the slots left, oldest first, at most ``BACKFILL_PER_TICK``."""
        while self.backfill and self.has_slot() and self.backfilled < BACKFILL_PER_TICK:
            self.backfilled += 1
            self.reserve(self.backfill.pop(0), backfilled=True)

    def start_waiting(self, *, backfill: bool = True) -> None:
        """Waiting runs take the free slots: queued triggers first, then pending ticks, oldest first.

        Triggers go first because ``trigger`` promises a run at the next free slot: behind a
        ``catch_up`` backlog it would wait up to ``max_pending`` runs. Pending ticks lose at most
        :data:`MAX_QUEUED_TRIGGERS` slots to them, and keep their grid time as ``scheduled_for``.
        Backfilled times come last, and after the live grid ticks (``backfill=False`` before
        those): a backfill fills the past without pushing the schedule's own runs aside.
        """
        while self.triggers and self.has_slot():
            self.reserve(self.triggers.pop(0), triggered=True)
        while self.pending and self.has_slot() and self.grid_room():
            self.reserve(self.pending.pop(0))
        if backfill:
            self.start_backfill()

    def dodge(self, is_tick: Callable[[datetime], bool]) -> None:
        """Move a queued trigger that shares a grid tick's time 1 µs later.

        ``(schedule, scheduled_for)`` is unique: a trigger made at the very microsecond of a
        tick the beat had not handled yet would otherwise collide with that tick's run.
        """
        for i, at in enumerate(self.triggers):
            taken = {*self.triggers[:i], *self.triggers[i + 1 :], *self.pending, *self.backfill}
            while is_tick(at) or at in taken:
                at += _MICROSECOND
            self.triggers[i] = at

    def outcome(self, state: ScheduleState) -> TickOutcome:
        new = replace(
            state,
            active_runs=self.active,
            pending=tuple(self.pending),
            triggers=tuple(self.triggers),
            backfill=tuple(self.backfill),
            grid_at=self.grid_at,
            next_due_at=self.next_due,
            overlaps=self.overlaps,
            skips=self.skips,
            last_drift_ms=self.drift,
            grid_runs=self.grid_runs,
            busy_skips=state.busy_skips + self.skipped - self.window_dropped - self.buffer_dropped,
            window_drops=state.window_drops + self.window_dropped,
            buffer_drops=state.buffer_drops + self.buffer_dropped,
            replaced=state.replaced + self.revoke,
            failures=state.failures + self.revoke,
        )
        return TickOutcome(
            state=new,
            emit=tuple(self.emit),
            skipped=self.skipped,
            coalesced=self.coalesced,
            ticks=self.ticks,
            window_dropped=self.window_dropped,
            buffer_dropped=self.buffer_dropped,
            revoke=self.revoke,
        )


def _due_fixed_delay(due: _Due) -> None:
    """One run when due and a slot is free; either way wait for a settle to set the next."""
    if due.next_due is None or due.next_due > due.now:
        return
    if due.has_slot() and (due.triggers or due.grid_room()):
        due.drift = _ms(due.now - due.next_due)
        if due.triggers:
            # A queued trigger stands in for the due run: one run, not two.
            due.reserve(due.triggers.pop(0), triggered=True)
        else:
            due.reserve(due.next_due)
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
    count, tick_at, next_grid = timing.passed(grid_at, due.now)
    due.dodge(lambda at: _among_ticks(at, count, tick_at))
    if due.policy.end_at is not None:
        # Ticks after the end are not the schedule's any more: neither run nor skipped.
        count = bisect_right(range(count), due.policy.end_at, key=tick_at)
    # Waiting runs were asked for before the ticks passed now: they take the free slots first.
    due.start_waiting(backfill=False)
    due.ticks = count
    due.drift = _ms(due.now - grid_at)
    live = _within_window(due, count, tick_at)
    n_start = _slots_for(due, len(live))
    if due.policy.missed_ticks is MissedTicks.CATCH_UP:
        started, rest = live[:n_start], live[n_start:]
    else:
        started, rest = live[len(live) - n_start :], live[: len(live) - n_start]
    for i in started:
        due.reserve(tick_at(i))
    _handle_missed(due, tick_at, rest)
    due.skips += due.skipped
    due.grid_at = next_grid
    due.next_due = next_grid + jitter_delay(due.policy, timing.gap(next_grid), rng)


def _within_window(due: _Due, count: int, tick_at: Callable[[int], datetime]) -> range:
    """The indexes of the passed ticks within ``catchup_window``; the older ones are dropped.

    A tick is older than the window when it is found more than ``catchup_window`` seconds
    after its grid time (``now - tick > window``); one exactly ``window`` old is still run.
    """
    window = due.policy.catchup_window
    if window is None or not count:
        return range(count)
    stale = bisect_left(range(count), due.now - timedelta(seconds=window), key=tick_at)
    due.window_dropped = stale
    due.skipped += stale
    return range(stale, count)


def _slots_for(due: _Due, ticks: int) -> int:
    """How many of ``ticks`` start now; ``replace`` first revokes the oldest active runs it may.

    ``replace`` runs the newest ticks, as many as the bound allows: each that finds no free slot
    takes the slot of the oldest active run, revoked in the same transaction (at most
    ``revocable``: the active runs the store found).
    """
    wanted = min(ticks, due.policy.limit, due.grid_room())
    if due.policy.missed_ticks is MissedTicks.REPLACE:
        # More active than the bound leaves room for (a smaller bound after a change) counts too.
        needed = due.active + wanted - due.policy.limit
        revoked = max(min(needed, due.revocable, due.active), 0)
        due.active -= revoked
        due.revocable -= revoked
        due.revoke += revoked
    return min(max(due.policy.limit - due.active, 0), ticks, due.grid_room())


def _among_ticks(at: datetime, count: int, tick_at: Callable[[int], datetime]) -> bool:
    """Whether ``at`` is one of the ``count`` ascending ticks ``tick_at`` indexes (a bisection)."""
    i = bisect_left(range(count), at, key=tick_at)
    return i < count and tick_at(i) == at


def _handle_missed(due: _Due, tick_at: Callable[[int], datetime], rest: range) -> None:
    """Ticks that found every slot busy go to ``missed_ticks`` (``queue_missed_ticks``).

    ``rest`` indexes the grid ticks lazily: a long outage on a short period may have passed
    very many, and only the ones kept as pending runs are ever built.
    """
    missed = len(rest)
    if not missed:
        return
    if due.policy.missed_ticks in (MissedTicks.SKIP, MissedTicks.REPLACE):
        due.skipped += missed  # busy: ``replace`` ran the newest ticks, these were older
        return
    if due.policy.missed_ticks is MissedTicks.COALESCE_LATEST:
        # The latest missed tick replaces every pending one: each tick replaced is a skip too.
        dropped = missed - 1 + len(due.pending)
        due.pending = [tick_at(rest[-1])]
        due.coalesced = True
    else:
        assert due.policy.max_pending is not None
        room = max(due.policy.max_pending - len(due.pending), 0)
        added = min(room, missed)
        due.pending.extend(tick_at(rest[i]) for i in range(added))
        dropped = missed - added
    due.skipped += dropped
    due.buffer_dropped += dropped


def on_due(
    policy: Policy,
    timing: Timing,
    state: ScheduleState,
    now: datetime,
    rng: random.Random,
    *,
    revocable: int = 0,
) -> TickOutcome:
    """Handle a schedule whose ``next_due_at`` has come (``fixed_rate_driver`` + fixed delay).

    Fixed rate: every grid tick passed counts (``1 + overdue // period``); those found past
    ``catchup_window`` are dropped; as many start as slots are free, the rest go to
    ``missed_ticks``; the grid advances past ``now``. Then pending runs start while slots are
    free. Fixed delay: one run, then wait for its finish. ``revocable`` is how many of the
    active runs ``replace`` may revoke (the store found them; see :attr:`TickOutcome.revoke`).
    """
    if state.stopped:
        return TickOutcome(state=replace(state, next_due_at=None))
    if state.ended:
        return _due_ended(policy, state, now)
    if not state.asked and _end_reason(policy, state) is not None:
        # The next grid tick (or fixed-delay due time) is past the end: nothing more to emit.
        return _ended_if_over(policy, TickOutcome(state=state))
    due = _Due.of(policy, state, now, revocable)
    if policy.mode is Mode.FIXED_DELAY:
        _due_fixed_delay(due)
    elif due.grid_at is None:
        _anchor_grid(due, timing, rng)
        due.dodge(lambda at: at == due.grid_at)
    elif due.grid_at <= now:
        _due_on_grid(due, due.grid_at, timing, rng)
    due.start_waiting()
    if policy.mode is Mode.FIXED_DELAY and due.emit:
        due.next_due = None
    elif due.grid_at is not None and due.next_due is not None and due.next_due <= now:
        # A due time set for waiting runs (settle, trigger) must not stay in the past, or
        # the beat would spin until the next grid tick: waiting runs wait for a settle.
        due.next_due = due.grid_at + jitter_delay(policy, timing.gap(due.grid_at), rng)
    if due.backfill and due.has_slot():
        due.next_due = now  # more backfill than one tick starts: the next tick goes on at once
    return _ended_if_over(policy, due.outcome(state))


def _due_ended(policy: Policy, state: ScheduleState, now: datetime) -> TickOutcome:
    """An ended schedule starts only the triggers and backfill queued before its end, as slots free."""
    due = _Due.of(policy, state, now)
    while due.triggers and due.has_slot():
        due.reserve(due.triggers.pop(0), triggered=True)
    due.start_backfill()
    due.next_due = now if due.backfill and due.has_slot() else None
    return _ended_if_over(policy, due.outcome(state))


def _end_reason(policy: Policy, state: ScheduleState) -> StopReason | None:
    """The end a schedule has reached: ``max_runs`` emitted, or its next due time past ``end_at``."""
    if policy.max_runs is not None and state.grid_runs >= policy.max_runs:
        return StopReason.MAX_RUNS
    upcoming = state.grid_at if state.grid_at is not None else state.next_due_at
    if policy.end_at is not None and upcoming is not None and upcoming > policy.end_at:
        return StopReason.END_AT
    return None


def _ended_if_over(policy: Policy, outcome: TickOutcome) -> TickOutcome:
    """Mark the schedule ended as soon as its last allowed run is emitted (or none is left).

    Pending grid ticks that can no longer start are skips; queued triggers still start. The
    schedule shows ``stopped`` once nothing of it is active or waiting (:func:`_settled_end`).
    """
    state = outcome.state
    reason = state.stop_reason if state.ended else _end_reason(policy, state)
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
) -> ScheduleState:
    """Free one slot exactly once and count the outcome (``ScheduledRunGuard``'s drop).

    Fixed delay: the next run is due ``period`` after this finish. Otherwise waiting runs
    (pending ticks, queued triggers) become due at once so they start as soon as the beat
    sees the freed slot.
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
    next_due = state.next_due_at
    if stopped:
        next_due = None
    elif state.ended:
        next_due = now if state.asked else None
    elif policy.mode is Mode.FIXED_DELAY:
        next_due = now + timedelta(seconds=gap_s) + jitter_delay(policy, gap_s, rng)
        if state.waiting_runs:
            next_due = now
    elif state.waiting_runs:
        next_due = now if next_due is None else min(next_due, now)
    settled = replace(
        state,
        active_runs=max(state.active_runs - 1, 0),
        runs=state.runs + int(not outcome.counts_as_failure),
        failures=state.failures + int(outcome.counts_as_failure),
        last_elapsed_ms=last_elapsed,
        max_elapsed_ms=max_elapsed,
        stopped=stopped,
        stop_reason=reason,
        next_due_at=next_due,
    )
    if not stopped and not state.ended and policy.mode is Mode.FIXED_DELAY:
        end = _end_reason(policy, settled)
        if end is not None:
            settled = replace(settled, stop_reason=end, next_due_at=now if settled.triggers else None)
    return _settled_end(_failure_streak(policy, settled, outcome, run_id))


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

    The run waits in ``triggers`` rather than being emitted: the next :func:`on_due` starts it
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
    at = max([now, *(t + _MICROSECOND for t in taken)])
    due = now if state.next_due_at is None else min(state.next_due_at, now)
    return Triggered(state=replace(state, triggers=(*state.triggers, at), next_due_at=due), scheduled_for=at)


def on_resume(
    policy: Policy, state: ScheduleState, now: datetime, *, period: float | None, replay: bool = False
) -> ScheduleState:
    """Resume a paused (or stopped) schedule: ticks passed meanwhile are not missed ticks.

    Fixed delay is due at once unless a run is still active (its settle sets the next due).
    An interval grid rejoins at its first tick after ``now``; a past calendar grid (no
    ``period``) is cleared and due now, so :func:`on_due` re-anchors it without emitting. A
    future grid keeps its (jittered) due time. Waiting runs make it due at once.

    ``replay`` keeps a past grid where the pause left it and makes it due now: the next
    :func:`on_due` counts the ticks passed meanwhile and hands them to ``missed_ticks``, as
    after a beat outage (``catchup_window`` bounds them).
    """
    grid_at, next_due = state.grid_at, state.next_due_at
    if policy.mode is Mode.FIXED_DELAY:
        if state.active_runs == 0:
            next_due = now
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
    restarts the grid from ``now``, as a new entry would (:func:`_restarted`), and so does a
    calendar grid moved to another zone (``old_timezone``, when known); a fixed-delay
    run still active keeps the due time its settle will set. An unchanged entry whose
    fixed-delay run was settled while no period was known gets the due time it never received.
    """
    if config_changed:
        state = _within_pending_bound(spec.policy, state)
        revived = state.ended and _allows_more(spec.policy, state, now)
        if revived:
            state = replace(state, stop_reason=None, stopped=False)
        moved = old_timezone is not None and old_timezone != spec.timezone
        if revived or moved or old_schedule != spec.schedule_repr or old_mode != spec.policy.mode:
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
    """A new schedule's state; its first tick after ``last_run_at`` (a name used before)."""
    return _restarted(spec, ScheduleState(), now, rng, last_run_at)


def _allows_more(policy: Policy, state: ScheduleState, now: datetime) -> bool:
    """Whether a changed policy gives an ended schedule runs again (a later end, more runs)."""
    if policy.max_runs is not None and state.grid_runs >= policy.max_runs:
        return False
    return policy.end_at is None or policy.end_at > now


def _restarted(
    spec: EntrySpec, state: ScheduleState, now: datetime, rng: random.Random, last_run_at: datetime | None
) -> ScheduleState:
    """A new grid (or fixed-delay due time) from ``now``, after ``last_run_at`` when given.

    ``last_run_at`` (the newest run's ``scheduled_for``, read by the caller) matters when the
    change comes in the very microsecond of a run: the new grid's first tick would repeat
    that run's time and break the unique run key.
    """
    fresh = initial_state(spec.policy, spec.timing, now, rng)
    first = fresh.grid_at or fresh.next_due_at
    if last_run_at is not None and first is not None and first <= last_run_at:
        # Start as if the change came 1 µs after that run, ``initial_delay`` included.
        shifted = last_run_at + _MICROSECOND - timedelta(seconds=spec.policy.initial_delay)
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
