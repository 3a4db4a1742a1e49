"""The ``retry`` policy key in the pure tick state machine, with a fake clock.

A run that ends in a state ``retry.on`` names is attempted again for the same grid time after
its backoff (doubling, capped), inside the concurrency bound, as attempt 2..``max_attempts``;
attempts never count toward ``max_runs``, and a stopped schedule retries nothing.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import Any

import pytest
from helpers.clock import T0, sec

from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.enums import Mode, RunState, StopReason
from celery_boundedbeat.core.policy import Policy, Retry, parse_policy
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import (
    Emission,
    ScheduleState,
    initial_state,
    on_config_change,
    on_settle,
)
from celery_boundedbeat.core.timing import IntervalTiming

TIMING = IntervalTiming(10)
RNG = random.Random(0)


def parse(raw: dict[str, Any]) -> Policy:
    policy, problems = parse_policy("entry", raw)
    assert problems == [] and policy is not None, problems
    return policy


def problems(raw: dict[str, Any]) -> list[tuple[str, str]]:
    return [(key, reason) for _entry, key, reason in parse_policy("entry", raw)[1]]


def due(policy: Policy, state: ScheduleState, at: datetime) -> tuple[ScheduleState, tuple[Emission, ...]]:
    outcome = on_due(policy, TIMING, state, at, RNG)
    return outcome.state, outcome.emit


def settle(
    policy: Policy, state: ScheduleState, at: datetime, outcome: RunState, run: Emission, run_id: str
) -> ScheduleState:
    return on_settle(
        policy,
        state,
        outcome=outcome,
        elapsed_ms=1000,
        now=at,
        stop=False,
        gap_s=10,
        rng=RNG,
        run_id=run_id,
        attempt=run.attempt,
        scheduled_for=run.scheduled_for,
    )


LOST_RETRY = {"retry": {"on": ["lost"], "max_attempts": 3, "backoff": 5, "max_backoff": 300}}


def test_a_lost_run_is_attempted_again_for_its_grid_time_after_the_backoff_until_max_attempts() -> None:
    policy = parse(LOST_RETRY)
    state = initial_state(policy, TIMING, T0, RNG)
    state, (first,) = due(policy, state, T0)
    assert (first.scheduled_for, first.attempt, first.retry_of) == (T0, 1, None)

    state = settle(policy, state, T0 + sec(2), RunState.LOST, first, "run-1")
    assert state.next_due_at == T0 + sec(7), "woken for the retry, before the next grid tick"
    state, emitted = due(policy, state, T0 + sec(6.9))
    assert emitted == (), "not before its backoff"
    state, (second,) = due(policy, state, T0 + sec(7))
    assert (second.scheduled_for, second.attempt, second.retry_of) == (T0, 2, "run-1")
    assert state.grid_runs == 1 and state.retries == ()
    assert state.next_due_at == T0 + sec(10), "the grid goes on as before"

    state = settle(policy, state, T0 + sec(8), RunState.LOST, second, "run-2")
    (waiting,) = state.retries
    assert waiting.due_at == T0 + sec(18), "the backoff doubles: 5 s, then 10 s"
    state, (grid,) = due(policy, state, T0 + sec(10))
    assert (grid.scheduled_for, grid.attempt) == (T0 + sec(10), 1)
    state = settle(policy, state, T0 + sec(11), RunState.COMPLETED, grid, "run-3")
    state, (third,) = due(policy, state, T0 + sec(18))
    assert (third.scheduled_for, third.attempt, third.retry_of) == (T0, 3, "run-2")

    state = settle(policy, state, T0 + sec(19), RunState.LOST, third, "run-4")
    assert state.retries == (), "three attempts in all: no fourth"
    assert state.failures == 3 and state.runs == 1


@pytest.mark.parametrize(
    "outcome", [RunState.COMPLETED, RunState.FAILED, RunState.REVOKED, RunState.TIMED_OUT]
)
def test_only_the_states_retry_on_names_are_retried(outcome: RunState) -> None:
    policy = parse(LOST_RETRY)
    state, (first,) = due(policy, initial_state(policy, TIMING, T0, RNG), T0)
    state = settle(policy, state, T0 + sec(1), outcome, first, "run-1")
    assert state.retries == ()
    assert state.next_due_at == T0 + sec(10)


def test_the_default_retries_lost_and_timed_out_runs_but_not_failed_ones() -> None:
    policy = parse({"retry": {}})
    assert policy.retry == Retry()
    for outcome, retried in ((RunState.LOST, True), (RunState.TIMED_OUT, True), (RunState.FAILED, False)):
        state, (first,) = due(policy, initial_state(policy, TIMING, T0, RNG), T0)
        state = settle(policy, state, T0 + sec(1), outcome, first, "run-1")
        assert bool(state.retries) is retried, outcome


def test_a_retry_waits_for_a_free_slot_and_the_grid_tick_it_meets_is_skipped() -> None:
    """Inside the bound: a due retry finds the slot busy, waits, and starts first when it frees."""
    policy = parse({"retry": {"on": ["lost"], "backoff": 1}})
    state, (first,) = due(policy, initial_state(policy, TIMING, T0, RNG), T0)
    state = settle(policy, state, T0 + sec(9.5), RunState.LOST, first, "run-1")
    state, (grid,) = due(policy, state, T0 + sec(10))
    assert grid.attempt == 1, "the grid tick came first: the retry was not due yet"
    state, emitted = due(policy, state, T0 + sec(10.5))
    assert emitted == () and state.active_runs == 1 and len(state.retries) == 1
    state, emitted = due(policy, state, T0 + sec(20))
    assert emitted == () and state.busy_skips == 1, "the retry waits; the grid tick meets a busy slot"
    state = settle(policy, state, T0 + sec(21), RunState.COMPLETED, grid, "run-2")
    assert state.next_due_at == T0 + sec(21), "the freed slot wakes the waiting retry at once"
    state, (again,) = due(policy, state, T0 + sec(21))
    assert (again.scheduled_for, again.attempt) == (T0, 2)
    assert state.active_runs == 1


def test_attempts_do_not_count_toward_max_runs_and_an_ended_schedule_still_retries() -> None:
    policy = parse({"max_runs": 1, **LOST_RETRY})
    state, (first,) = due(policy, initial_state(policy, TIMING, T0, RNG), T0)
    assert state.stop_reason is StopReason.MAX_RUNS and not state.stopped
    state = settle(policy, state, T0 + sec(1), RunState.LOST, first, "run-1")
    assert not state.stopped and state.next_due_at == T0 + sec(6)
    state, (second,) = due(policy, state, T0 + sec(6))
    assert second.attempt == 2 and state.grid_runs == 1
    state = settle(policy, state, T0 + sec(7), RunState.COMPLETED, second, "run-2")
    assert state.stopped and state.next_due_at is None


def test_fixed_delay_retries_first_then_waits_its_delay_after_the_attempt() -> None:
    policy = parse({"mode": "fixed_delay", **LOST_RETRY})
    state, (first,) = due(policy, initial_state(policy, TIMING, T0, RNG), T0)
    state = settle(policy, state, T0 + sec(1), RunState.LOST, first, "run-1")
    assert state.next_due_at == T0 + sec(6), "the retry (5 s) comes before the delay (10 s)"
    state, (second,) = due(policy, state, T0 + sec(6))
    assert second.attempt == 2 and state.next_due_at is None
    state = settle(policy, state, T0 + sec(8), RunState.COMPLETED, second, "run-2")
    assert state.next_due_at == T0 + sec(18)
    state, (third,) = due(policy, state, T0 + sec(18))
    assert (third.scheduled_for, third.attempt) == (T0 + sec(18), 1)


def test_a_run_that_stops_its_schedule_is_not_retried() -> None:
    policy = parse(LOST_RETRY)
    state, _ = due(policy, initial_state(policy, TIMING, T0, RNG), T0)
    state = on_settle(
        policy,
        state,
        outcome=RunState.LOST,
        elapsed_ms=None,
        now=T0 + sec(1),
        stop=True,
        gap_s=10,
        rng=RNG,
        run_id="run-1",
        attempt=1,
        scheduled_for=T0,
    )
    assert state.retries == () and state.stopped


def test_a_bounded_overlap_schedule_retries_each_lost_run_within_its_bound() -> None:
    policy = parse({"mode": "fixed_rate", "max_concurrency": 2, **LOST_RETRY})
    state, (a,) = due(policy, initial_state(policy, TIMING, T0, RNG), T0)
    state, (b,) = due(policy, state, T0 + sec(10))
    state = settle(policy, state, T0 + sec(11), RunState.LOST, a, "a")
    state = settle(policy, state, T0 + sec(11), RunState.LOST, b, "b")
    state, emitted = due(policy, state, T0 + sec(16))
    assert [(e.scheduled_for, e.attempt, e.retry_of) for e in emitted] == [
        (T0, 2, "a"),
        (T0 + sec(10), 2, "b"),
    ]
    state, emitted = due(policy, state, T0 + sec(20))
    assert emitted == () and state.active_runs == 2, "both slots hold retries: the grid tick is skipped"


def test_removing_the_retry_key_drops_the_waiting_retries() -> None:
    policy = parse(LOST_RETRY)
    state, (first,) = due(policy, initial_state(policy, TIMING, T0, RNG), T0)
    state = settle(policy, state, T0 + sec(1), RunState.LOST, first, "run-1")
    spec = EntrySpec(
        name="entry", task="t", policy=parse({}), timing=TIMING, schedule_repr="every 10s", period=10
    )
    changed = on_config_change(
        spec,
        state,
        config_changed=True,
        old_schedule="every 10s",
        old_mode=Mode.FIXED_RATE_NO_OVERLAP,
        now=T0 + sec(2),
        rng=RNG,
    )
    assert changed.retries == ()


def test_the_backoff_doubles_and_stops_at_max_backoff() -> None:
    retry = Retry(backoff=10, max_backoff=35, max_attempts=6)
    assert [retry.delay(n) for n in range(1, 6)] == [sec(10), sec(20), sec(35), sec(35), sec(35)]
    assert Retry(backoff=0).delay(3) == timedelta(0)


def test_the_retry_key_round_trips_through_the_stored_policy() -> None:
    policy = parse(
        {"retry": {"on": ["failed", "lost"], "max_attempts": 4, "backoff": 2.5, "max_backoff": 60}}
    )
    assert Policy.from_json(policy.to_json()) == policy
    assert policy.to_json()["retry"] == {
        "on": ["failed", "lost"],
        "max_attempts": 4,
        "backoff": 2.5,
        "max_backoff": 60,
    }
    assert "retry" not in parse({}).to_json(), "a policy without it keeps its stored digest"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            "yes",
            [("policy.retry", "must be a dict (keys on, max_attempts, backoff, max_backoff), got 'yes'")],
        ),
        (
            {"on": []},
            [
                (
                    "policy.retry.on",
                    "must be a non-empty list of states (lost, timed_out, rejected, failed), got []",
                )
            ],
        ),
        (
            {"on": "lost"},
            [
                (
                    "policy.retry.on",
                    "must be a non-empty list of states (lost, timed_out, rejected, failed), got 'lost'",
                )
            ],
        ),
        (
            {"on": ["completed"]},
            [("policy.retry.on", "cannot retry on 'completed' (use lost, timed_out, rejected, failed)")],
        ),
        (
            {"max_attempts": 1},
            [("policy.retry.max_attempts", "must be >= 2 (it counts the first run), got 1")],
        ),
        ({"max_attempts": True}, [("policy.retry.max_attempts", "must be an integer >= 1, got True")]),
        ({"backoff": -1}, [("policy.retry.backoff", "must be >= 0 seconds, got -1")]),
        (
            {"backoff": 60, "max_backoff": 30},
            [("policy.retry.max_backoff", "must be >= backoff (60 s), got 30")],
        ),
        (
            {"tries": 3},
            [("policy.retry.tries", "unknown retry key (known: on, max_attempts, backoff, max_backoff)")],
        ),
    ],
)
def test_a_bad_retry_key_names_what_is_wrong(raw: Any, expected: list[tuple[str, str]]) -> None:
    assert problems({"retry": raw}) == expected
