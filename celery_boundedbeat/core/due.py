"""A due tick: what a schedule does when its time comes (``on_due``).

Emit, skip, coalesce, catch up within the window or keep pending, as the policy says: the
biggest of the tick state machine's events, kept apart from the others in
:mod:`~celery_boundedbeat.core.ticks` (which holds the state values it works on).
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from .enums import MissedTicks, Mode
from .policy import Policy
from .retries import RetryDue
from .ticks import (
    BACKFILL_PER_TICK,
    MICROSECOND,
    Emission,
    ScheduleState,
    TickOutcome,
    end_reason,
    ended_if_over,
    jitter_delay,
    ms,
    opening,
)
from .timing import Timing


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
    retries: list[RetryDue]
    overlaps: int
    skips: int
    drift: int | None
    grid_at: datetime | None
    next_due: datetime | None
    grid_runs: int = 0
    retried: int = 0
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
            retries=list(state.retries),
            overlaps=state.overlaps,
            skips=state.skips,
            drift=state.last_drift_ms,
            grid_at=state.grid_at,
            next_due=state.next_due_at,
            grid_runs=state.grid_runs,
            retried=state.retried,
            revocable=revocable,
        )

    def has_slot(self) -> bool:
        return self.active < self.policy.limit

    def grid_room(self) -> int:
        """Grid runs ``max_runs`` still allows (triggers never count)."""
        if self.policy.max_runs is None:
            return 1 << 62
        return max(self.policy.max_runs - self.grid_runs, 0)

    def reserve(
        self,
        scheduled_for: datetime,
        *,
        triggered: bool = False,
        backfilled: bool = False,
        retry: RetryDue | None = None,
    ) -> None:
        """Take a slot for a run of ``scheduled_for`` (an overlap if another is active)."""
        overlap = self.active > 0
        self.overlaps += int(overlap)
        self.active += 1
        self.grid_runs += int(not triggered and not backfilled and retry is None)
        self.retried += int(retry is not None)
        drift_ms = ms(self.now - scheduled_for)
        self.emit.append(
            Emission(
                scheduled_for=scheduled_for,
                drift_ms=drift_ms,
                overlap=overlap,
                triggered=triggered,
                backfilled=backfilled,
                attempt=1 if retry is None else retry.attempt,
                retry_of=None if retry is None else retry.retry_of,
            )
        )

    def start_retries(self) -> None:
        """Retries whose backoff has passed take the free slots first, oldest due first.

        They come before every other waiting run: each is a grid time the schedule already
        owed and failed to do, and it waited out its backoff.
        """
        for retry in sorted(self.retries, key=lambda r: (r.due_at, r.scheduled_for)):
            if retry.due_at > self.now or not self.has_slot():
                continue
            self.retries.remove(retry)
            self.reserve(retry.scheduled_for, retry=retry)

    def wake_for_retries(self) -> None:
        """The next due time comes no later than the first retry still in its backoff (one whose
        backoff passed but found no slot waits for a settle, as every waiting run does)."""
        later = [r.due_at for r in self.retries if r.due_at > self.now]
        if later:
            self.next_due = min(later) if self.next_due is None else min(self.next_due, min(later))

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
                at += MICROSECOND
            self.triggers[i] = at

    def outcome(self, state: ScheduleState) -> TickOutcome:
        new = replace(
            state,
            active_runs=self.active,
            pending=tuple(self.pending),
            triggers=tuple(self.triggers),
            backfill=tuple(self.backfill),
            retries=tuple(self.retries),
            grid_at=self.grid_at,
            next_due_at=self.next_due,
            overlaps=self.overlaps,
            skips=self.skips,
            last_drift_ms=self.drift,
            grid_runs=self.grid_runs,
            retried=self.retried,
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
        due.drift = ms(due.now - due.next_due)
        if due.triggers:
            # A queued trigger stands in for the due run: one run, not two.
            due.reserve(due.triggers.pop(0), triggered=True)
        else:
            due.reserve(due.next_due)
        due.ticks = 1
    due.next_due = None


def _anchor_grid(due: _Due, timing: Timing, rng: random.Random) -> None:
    """No grid (a resumed calendar schedule): ticks passed while paused are not missed;
    anchor on the first tick from now (and not before ``start_at``)."""
    due.grid_at = opening(due.policy, timing, due.now)
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
    due.drift = ms(due.now - grid_at)
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
    if not state.asked and end_reason(policy, state) is not None:
        # The next grid tick (or fixed-delay due time) is past the end: nothing more to emit.
        return ended_if_over(policy, TickOutcome(state=state))
    due = _Due.of(policy, state, now, revocable)
    due.start_retries()
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
    due.wake_for_retries()
    return ended_if_over(policy, due.outcome(state))


def _due_ended(policy: Policy, state: ScheduleState, now: datetime) -> TickOutcome:
    """An ended schedule starts only the triggers and backfill queued before its end, as slots free."""
    due = _Due.of(policy, state, now)
    due.start_retries()
    while due.triggers and due.has_slot():
        due.reserve(due.triggers.pop(0), triggered=True)
    due.start_backfill()
    due.next_due = now if due.backfill and due.has_slot() else None
    due.wake_for_retries()
    return ended_if_over(policy, due.outcome(state))
