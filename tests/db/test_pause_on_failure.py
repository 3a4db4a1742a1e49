"""pause_on_failure: a streak of failing runs pauses the schedule once, naming the last run."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest
from helpers.clock import T0
from sqlalchemy import Engine

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.ticks import ScheduleState, on_resume, on_settle
from celery_boundedbeat.db.store import Store


def policy(**raw: Any) -> Policy:
    parsed, problems = parse_policy("job", raw)
    assert parsed is not None, problems
    return parsed


def settle(p: Policy, state: ScheduleState, outcome: RunState, run_id: str) -> ScheduleState:
    state = ScheduleState(**{**{f: getattr(state, f) for f in state.__slots__}, "active_runs": 1})
    return on_settle(
        p,
        state,
        outcome=outcome,
        elapsed_ms=5,
        now=T0,
        stop=False,
        gap_s=10,
        rng=random.Random(0),
        run_id=run_id,
    )


def test_the_streak_pauses_at_the_bound_and_names_the_last_failing_run() -> None:
    """Three failures in a row with pause_on_failure=3 ask for a pause naming run r3 and its state."""
    p = policy(pause_on_failure=3)
    state = ScheduleState()
    for run_id, outcome in (("r1", RunState.FAILED), ("r2", RunState.LOST)):
        state = settle(p, state, outcome, run_id)
        assert state.pause_reason is None
    state = settle(p, state, RunState.TIMED_OUT, "r3")
    assert state.consecutive_failures == 3
    assert state.pause_reason is not None and "r3" in state.pause_reason and "timed_out" in state.pause_reason


def test_a_completed_run_ends_the_streak_and_revoked_or_rejected_do_not_count() -> None:
    """completed resets the count; revoked and rejected neither count nor reset it."""
    p = policy(pause_on_failure=2)
    state = settle(p, ScheduleState(), RunState.FAILED, "a")
    state = settle(p, state, RunState.REVOKED, "b")
    state = settle(p, state, RunState.REJECTED, "c")
    assert state.consecutive_failures == 1 and state.pause_reason is None
    state = settle(p, state, RunState.COMPLETED, "d")
    assert state.consecutive_failures == 0
    state = settle(p, state, RunState.FAILED, "e")
    assert state.pause_reason is None
    state = settle(p, state, RunState.FAILED, "f")
    assert state.pause_reason is not None and "f" in state.pause_reason


def test_without_the_key_failures_are_counted_but_never_pause() -> None:
    """No pause_on_failure: the streak is kept but no pause is asked for."""
    state = ScheduleState()
    for i in range(20):
        state = settle(policy(), state, RunState.FAILED, f"r{i}")
    assert state.consecutive_failures == 20 and state.pause_reason is None


def test_resume_clears_the_reason_and_resets_the_count() -> None:
    """resume starts a new streak."""
    p = policy(pause_on_failure=1)
    state = settle(p, ScheduleState(grid_at=T0, next_due_at=T0), RunState.FAILED, "x")
    assert state.pause_reason is not None
    resumed = on_resume(p, state, T0 + timedelta(seconds=1), period=10)
    assert resumed.pause_reason is None and resumed.consecutive_failures == 0


@pytest.fixture
def store(migrated: Engine) -> Store:
    return Store(migrated)


def test_the_store_pauses_the_row_and_resume_lifts_it(store: Store) -> None:
    """On SQLite and PostgreSQL: the second failed run pauses the row with its id; resume clears both."""
    spec, problems = parse_entry("job", {"task": "t", "schedule": 10, "policy": {"pause_on_failure": 2}}, {})
    assert spec is not None, problems
    rng = random.Random(1)
    store.sync_config([spec], T0, rng)
    ids = []
    for i in range(2):
        now = T0 + timedelta(seconds=10 * i)
        result = store.tick({"job": spec}, now, rng, 100)
        assert len(result.emitted) == 1
        run_id = result.emitted[0].id
        ids.append(run_id)
        assert store.run_life.start_run(run_id, worker="w", process="w:1", now=now, max_run_time=None)
        assert store.run_life.settle_run(
            run_id, RunState.FAILED, now=now + timedelta(seconds=1), error="boom"
        )
    (row,) = store.schedules(["job"])
    assert row.paused and row.pause_reason is not None and ids[1] in row.pause_reason
    assert store.tick({"job": spec}, T0 + timedelta(seconds=60), rng, 100).emitted == []
    assert store.set_paused("job", False, T0 + timedelta(seconds=61))
    (row,) = store.schedules(["job"])
    assert not row.paused and row.pause_reason is None and row.consecutive_failures == 0
