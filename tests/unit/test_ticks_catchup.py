"""catchup_window, missed_ticks "replace", resume --replay and the separate drop counters, on a fake clock."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from helpers.clock import T0, sec
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.enums import MissedTicks, RunState
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.ticks import (
    ScheduleState,
    TickOutcome,
    initial_state,
    on_config_change,
    on_resume,
    on_settle,
)
from celery_boundedbeat.core.timing import CalendarTiming, IntervalTiming

RNG = random.Random(3)


def parse(**raw: Any) -> Policy:
    policy, problems = parse_policy("entry", raw)
    assert problems == [], problems
    assert policy is not None
    return policy


def problems(raw: dict[str, Any], **kwargs: Any) -> list[tuple[str, str, str]]:
    policy, found = parse_policy("entry", raw, **kwargs)
    assert policy is None
    return found


def due(policy: Policy, state: ScheduleState, now: datetime, period: float = 10, **kw: Any) -> TickOutcome:
    return on_due(policy, IntervalTiming(period), state, now, RNG, **kw)


def waiting(grid_at: datetime = T0, active: int = 0) -> ScheduleState:
    return ScheduleState(grid_at=grid_at, next_due_at=grid_at, active_runs=active)


def assert_counts_add_up(state: ScheduleState) -> None:
    assert state.skips == state.busy_skips + state.window_drops + state.buffer_drops


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (0, "must be > 0 seconds, got 0"),
        (-5, "must be > 0 seconds, got -5"),
        ("60", "must be seconds (number) or a timedelta, got '60'"),
        (True, "must be seconds (number) or a timedelta, got True"),
    ],
)
def test_catchup_window_must_be_positive_seconds(value: Any, reason: str) -> None:
    """A zero, negative or non-numeric catchup_window names the entry, the key and why."""
    assert problems({"catchup_window": value}) == [("entry", "policy.catchup_window", reason)]


def test_catchup_window_takes_seconds_or_a_timedelta_and_round_trips() -> None:
    """A timedelta becomes seconds, and the stored JSON gives the same policy back."""
    policy = parse(catchup_window=timedelta(minutes=5))
    assert policy.catchup_window == 300.0
    assert Policy.from_json(policy.to_json()) == policy


def test_a_policy_without_catchup_window_stores_the_json_it_stored_before() -> None:
    """Unset, the key is left out of the stored policy, so existing schedules keep their digest."""
    assert "catchup_window" not in parse().to_json()


def test_catchup_window_is_refused_with_fixed_delay() -> None:
    """fixed_delay has no grid to catch up on: the window is an error, not silently ignored."""
    found = problems({"mode": "fixed_delay", "catchup_window": 60})
    assert [(k, r.split(" (")[0]) for _, k, r in found] == [
        ("policy.catchup_window", "is not allowed with mode 'fixed_delay'")
    ]


def test_catchup_window_must_be_longer_than_the_jitter() -> None:
    """A window within the jitter would drop ticks that jitter alone delayed."""
    found = problems({"catchup_window": 2, "jitter": 2})
    assert [k for _, k, _ in found] == ["policy.catchup_window"]
    assert "longer than jitter (2 s)" in found[0][2]
    assert parse(catchup_window=3, jitter=2).catchup_window == 3


def test_replace_is_allowed_with_the_grid_modes_only() -> None:
    """replace works with fixed_rate_no_overlap and fixed_rate; fixed_delay must stay skip."""
    assert parse(missed_ticks="replace").missed_ticks is MissedTicks.REPLACE
    assert parse(missed_ticks="replace", mode="fixed_rate", max_concurrency=2).limit == 2
    found = problems({"missed_ticks": "replace", "mode": "fixed_delay"})
    assert found == [
        ("entry", "policy.missed_ticks", "must stay 'skip' with mode 'fixed_delay', got 'replace'")
    ]


def test_replace_with_max_pending_is_an_error() -> None:
    """max_pending belongs to catch_up: with replace it is refused, as with skip."""
    assert problems({"missed_ticks": "replace", "max_pending": 3}) == [
        ("entry", "policy.max_pending", "is only allowed with missed_ticks 'catch_up', not 'replace'")
    ]


# -- catchup_window ----------------------------------------------------------------------------


def test_ticks_older_than_the_window_are_dropped_and_counted_apart() -> None:
    """Found 100 s late with a 25 s window: the ticks 0..70 s are window drops, 75 s would be the
    oldest kept; skip runs the newest (100 s) and the others are busy skips."""
    policy = parse(catchup_window=25)
    out = due(policy, waiting(), T0 + sec(100))
    assert [e.scheduled_for for e in out.emit] == [T0 + sec(100)]
    assert (out.ticks, out.window_dropped, out.busy_skipped, out.buffer_dropped) == (11, 8, 2, 0)
    s = out.state
    assert (s.skips, s.window_drops, s.busy_skips, s.buffer_drops) == (10, 8, 2, 0)
    assert s.grid_at == T0 + sec(110)


def test_a_tick_exactly_as_old_as_the_window_still_runs() -> None:
    """Older means strictly older: a tick found exactly ``catchup_window`` after its time is kept."""
    policy = parse(missed_ticks="catch_up", max_pending=10, catchup_window=30)
    out = due(policy, waiting(), T0 + sec(100))
    # Ticks 70..100 s are within 30 s of now; catch_up starts the oldest of them.
    assert [e.scheduled_for for e in out.emit] == [T0 + sec(70)]
    assert out.state.pending == (T0 + sec(80), T0 + sec(90), T0 + sec(100))
    assert out.window_dropped == 7


def test_when_every_passed_tick_is_too_old_none_runs() -> None:
    """After an outage longer than the window nothing runs: the schedule waits for its next tick."""
    policy = parse(missed_ticks="coalesce_latest", catchup_window=5)
    out = due(policy, waiting(), T0 + sec(36), period=60)
    assert out.emit == ()
    assert (out.window_dropped, out.state.window_drops, out.state.skips) == (1, 1, 1)
    assert out.state.pending == ()
    assert out.state.next_due_at == T0 + sec(60)


def test_an_on_time_tick_is_never_a_window_drop() -> None:
    """A tick found a few milliseconds late runs as without the window."""
    policy = parse(catchup_window=1)
    out = due(policy, waiting(), T0 + timedelta(milliseconds=40))
    assert [e.scheduled_for for e in out.emit] == [T0]
    assert out.window_dropped == 0


def test_the_window_drops_before_missed_ticks_decides() -> None:
    """A busy slot: the ticks within the window go to missed_ticks, the older ones are window drops."""
    policy = parse(missed_ticks="catch_up", max_pending=2, catchup_window=35)
    out = due(policy, waiting(active=1), T0 + sec(100))
    assert out.emit == ()
    # 70, 80 kept pending; 90, 100 overflow the buffer; 0..60 are past the window.
    assert out.state.pending == (T0 + sec(70), T0 + sec(80))
    assert (out.window_dropped, out.buffer_dropped, out.busy_skipped) == (7, 2, 0)
    assert_counts_add_up(out.state)


def test_the_window_applies_to_calendar_grids() -> None:
    """A calendar grid (every 15 minutes) found an hour late keeps only the ticks within the window."""
    timing = CalendarTiming(
        lambda t: (t - sec(t.minute % 15 * 60 + t.second) + sec(900)).replace(microsecond=0)
    )
    policy = parse(missed_ticks="catch_up", max_pending=5, catchup_window=1800)
    state = ScheduleState(grid_at=T0, next_due_at=T0)
    out = on_due(policy, timing, state, T0 + sec(3600), RNG)
    assert [e.scheduled_for for e in out.emit] == [T0 + sec(1800)]
    assert out.state.pending == (T0 + sec(2700), T0 + sec(3600))
    assert out.window_dropped == 2


# -- replace ------------------------------------------------------------------------------------


def test_replace_revokes_the_oldest_active_run_and_starts_the_new_one() -> None:
    """Every slot busy: one run is revoked (its slot goes to the new run at once), counted replaced."""
    policy = parse(missed_ticks="replace")
    out = due(policy, waiting(active=1), T0 + sec(0.01), revocable=1)
    assert out.revoke == 1
    assert [(e.scheduled_for, e.overlap) for e in out.emit] == [(T0, False)]
    s = out.state
    assert (s.active_runs, s.replaced, s.failures, s.skips) == (1, 1, 1, 0)


def test_replace_with_nothing_it_may_revoke_skips_the_tick() -> None:
    """When the store found no run to revoke (all being settled), the tick is a busy skip."""
    policy = parse(missed_ticks="replace")
    out = due(policy, waiting(active=1), T0, revocable=0)
    assert (out.revoke, out.emit, out.busy_skipped) == (0, (), 1)
    assert (out.state.active_runs, out.state.busy_skips, out.state.replaced) == (1, 1, 0)


def test_replace_does_not_revoke_while_a_slot_is_free() -> None:
    """fixed_rate with a free slot: the tick takes it and nothing is revoked."""
    policy = parse(mode="fixed_rate", max_concurrency=2, missed_ticks="replace")
    out = due(policy, waiting(active=1), T0, revocable=1)
    assert out.revoke == 0
    assert [(e.scheduled_for, e.overlap) for e in out.emit] == [(T0, True)]
    assert out.state.active_runs == 2


def test_a_late_replace_runs_the_newest_ticks_within_the_bound() -> None:
    """Three ticks late, two busy slots: both are replaced by the two newest ticks; the oldest is a skip."""
    policy = parse(mode="fixed_rate", max_concurrency=2, missed_ticks="replace")
    out = due(policy, waiting(active=2), T0 + sec(20), revocable=2)
    assert out.revoke == 2
    assert [e.scheduled_for for e in out.emit] == [T0 + sec(10), T0 + sec(20)]
    assert (out.state.active_runs, out.state.replaced, out.busy_skipped) == (2, 2, 1)
    assert out.state.pending == ()


def test_after_a_replace_the_new_runs_settle_frees_the_last_slot() -> None:
    """The slot bookkeeping stays exact: after a replace, the new run's settle frees the last slot."""
    policy = parse(missed_ticks="replace")
    out = due(policy, waiting(active=1), T0, revocable=1)
    settled = on_settle(
        policy,
        out.state,
        outcome=RunState.COMPLETED,
        elapsed_ms=5,
        now=T0 + sec(1),
        stop=False,
        gap_s=10,
        rng=RNG,
    )
    assert settled.active_runs == 0


def test_a_change_to_replace_drops_pending_ticks_as_buffer_drops() -> None:
    """replace keeps no buffer: pending ticks of an old catch_up policy are dropped and counted."""
    old = parse(missed_ticks="catch_up", max_pending=3)
    out = due(old, waiting(active=1), T0 + sec(20))
    assert len(out.state.pending) == 3
    from celery_boundedbeat.config.entries import parse_entry

    spec, found = parse_entry(
        "entry", {"task": "t", "schedule": 10, "policy": {"missed_ticks": "replace"}}, {}
    )
    assert found == [] and spec is not None
    changed = on_config_change(
        spec,
        out.state,
        config_changed=True,
        old_schedule=spec.schedule_repr,
        old_mode=spec.policy.mode,
        now=T0 + sec(21),
        rng=RNG,
    )
    assert changed.pending == ()
    assert (changed.buffer_drops, changed.skips) == (3, 3)


# -- resume --replay ---------------------------------------------------------------------------


def paused_at_10() -> ScheduleState:
    """A schedule paused before its tick at 10 s ran: its grid waits at 10 s."""
    return ScheduleState(grid_at=T0 + sec(10), next_due_at=T0 + sec(10), runs=1)


def test_plain_resume_rejoins_the_grid_and_misses_nothing() -> None:
    """resume without replay: the next tick after now, no skips."""
    state = on_resume(parse(), paused_at_10(), T0 + sec(65), period=10)
    assert (state.grid_at, state.next_due_at) == (T0 + sec(70), T0 + sec(70))
    assert state.skips == 0


def test_replay_hands_the_paused_ticks_to_missed_ticks() -> None:
    """resume --replay: due now; the six ticks 10..60 s are counted, skip runs the newest."""
    policy = parse()
    state = on_resume(policy, paused_at_10(), T0 + sec(65), period=10, replay=True)
    assert (state.grid_at, state.next_due_at) == (T0 + sec(10), T0 + sec(65))
    out = due(policy, state, T0 + sec(65))
    assert [e.scheduled_for for e in out.emit] == [T0 + sec(60)]
    assert (out.ticks, out.state.busy_skips, out.state.grid_at) == (6, 5, T0 + sec(70))


def test_replay_is_bounded_by_the_catchup_window() -> None:
    """catch_up after --replay: ticks older than the window are dropped, the rest caught up."""
    policy = parse(missed_ticks="catch_up", max_pending=10, catchup_window=20)
    state = on_resume(policy, paused_at_10(), T0 + sec(65), period=10, replay=True)
    out = due(policy, state, T0 + sec(65))
    assert [e.scheduled_for for e in out.emit] == [T0 + sec(50)]
    assert out.state.pending == (T0 + sec(60),)
    assert out.state.window_drops == 4


def test_replay_keeps_a_calendar_grid_where_it_was() -> None:
    """A calendar schedule (no period) resumed with replay keeps its grid instead of re-anchoring."""
    state = on_resume(parse(), paused_at_10(), T0 + sec(65), period=None, replay=True)
    assert (state.grid_at, state.next_due_at) == (T0 + sec(10), T0 + sec(65))
    plain = on_resume(parse(), paused_at_10(), T0 + sec(65), period=None)
    assert plain.grid_at is None


def test_replay_of_a_future_grid_changes_nothing() -> None:
    """Paused and resumed before the next tick: replay has nothing to hand over."""
    state = on_resume(parse(), paused_at_10(), T0 + sec(5), period=10, replay=True)
    assert (state.grid_at, state.next_due_at) == (T0 + sec(10), T0 + sec(10))


# -- counters --------------------------------------------------------------------------------


def test_coalesce_and_catch_up_overflow_are_buffer_drops() -> None:
    """The ticks coalesce_latest replaces and catch_up cannot keep are buffer drops, not busy skips."""
    coalesce = due(parse(missed_ticks="coalesce_latest"), waiting(active=1), T0 + sec(30))
    assert (coalesce.buffer_dropped, coalesce.busy_skipped, coalesce.state.buffer_drops) == (3, 0, 3)
    catch_up = due(parse(missed_ticks="catch_up", max_pending=1), waiting(active=1), T0 + sec(30))
    assert (catch_up.buffer_dropped, catch_up.busy_skipped) == (3, 0)


def test_pending_ticks_dropped_at_the_end_are_buffer_drops() -> None:
    """max_runs reached with ticks pending: they count as buffer drops."""
    policy = parse(missed_ticks="catch_up", max_pending=3, max_runs=1)
    state = replace(waiting(active=1), pending=(T0 - sec(10),))
    out = due(policy, state, T0 + sec(0))
    assert out.emit == ()
    state = on_settle(
        policy,
        out.state,
        outcome=RunState.COMPLETED,
        elapsed_ms=1,
        now=T0 + sec(1),
        stop=False,
        gap_s=10,
        rng=RNG,
    )
    out = due(policy, state, T0 + sec(1))
    assert len(out.emit) == 1
    assert out.state.buffer_drops == out.buffer_dropped == 1
    assert_counts_add_up(out.state)


POLICIES = [
    {},
    {"missed_ticks": "coalesce_latest"},
    {"missed_ticks": "catch_up", "max_pending": 2},
    {"missed_ticks": "replace"},
    {"mode": "fixed_rate", "max_concurrency": 2, "missed_ticks": "replace"},
    {"mode": "fixed_rate", "max_concurrency": 2, "missed_ticks": "catch_up", "max_pending": 3},
]


@settings(max_examples=150, deadline=None)
@given(
    raw=st.sampled_from(POLICIES),
    window=st.one_of(st.none(), st.sampled_from([5.0, 15.0, 45.0])),
    max_runs=st.one_of(st.none(), st.integers(1, 6)),
    steps=st.lists(st.tuples(st.floats(0.5, 60), st.booleans()), min_size=1, max_size=25),
)
def test_every_passed_tick_is_run_dropped_or_pending_and_the_counters_add_up(
    raw: dict[str, Any], window: float | None, max_runs: int | None, steps: list[tuple[float, bool]]
) -> None:
    """Whatever happens, ticks = grid runs + skips + pending, skips = busy + window + buffer drops,
    replaced = runs revoked, and never more than the bound active."""
    policy = parse(**raw, catchup_window=window, max_runs=max_runs)
    rng = random.Random(1)
    now = T0
    state = initial_state(policy, IntervalTiming(10), now, rng)
    ticks = revoked = 0
    active = 0
    for advance, settle in steps:
        now += sec(advance)
        if settle and state.active_runs:
            state = on_settle(
                policy,
                state,
                outcome=RunState.COMPLETED,
                elapsed_ms=1,
                now=now,
                stop=False,
                gap_s=10,
                rng=rng,
            )
            active -= 1
        if state.next_due_at is not None and state.next_due_at <= now:
            out = on_due(policy, IntervalTiming(10), state, now, rng, revocable=state.active_runs)
            ticks += out.ticks
            revoked += out.revoke
            active += len(out.emit) - out.revoke
            state = out.state
        assert state.active_runs == active <= policy.limit
        assert_counts_add_up(state)
        assert ticks == state.grid_runs + state.skips + len(state.pending)
        assert state.replaced == revoked


def test_replace_after_a_smaller_bound_revokes_down_to_the_new_bound() -> None:
    """Two active runs left by fixed_rate 2, now fixed_rate_no_overlap: both go, one new run starts."""
    policy = parse(missed_ticks="replace")
    out = due(policy, waiting(active=2), T0, revocable=2)
    assert (out.revoke, len(out.emit), out.state.active_runs) == (2, 1, 1)


def test_coalesce_latest_after_the_window_runs_the_newest_and_keeps_the_one_before() -> None:
    """As docs/policies.md says: the newest tick within the window runs, the one before it waits."""
    out = due(parse(missed_ticks="coalesce_latest", catchup_window=25), waiting(), T0 + sec(100))
    assert [e.scheduled_for for e in out.emit] == [T0 + sec(100)]
    assert out.state.pending == (T0 + sec(90),)
    assert (out.window_dropped, out.buffer_dropped) == (8, 1)
