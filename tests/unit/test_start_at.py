"""The ``start_at`` policy key: validation, storage, and no tick before it, on a fake clock."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.schedules import crontab
from helpers.clock import T0 as MIDNIGHT
from helpers.clock import sec

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import (
    ScheduleState,
    first_state,
    initial_state,
    on_config_change,
    on_resume,
)

T0 = MIDNIGHT + timedelta(hours=12)  # noon of the shared day: calendar cases read better
RNG = random.Random(0)


def spec(schedule: Any, **policy: Any) -> EntrySpec:
    parsed, problems = parse_entry("job", {"task": "t", "schedule": schedule, "policy": policy}, {}, tz=UTC)
    assert problems == [] and parsed is not None
    return parsed


def emitted(s: EntrySpec, state: ScheduleState, until: datetime) -> list[datetime]:
    """Every scheduled_for a schedule emits when looked at on each due time up to ``until``."""
    times: list[datetime] = []
    while state.next_due_at is not None and state.next_due_at <= until:
        out = on_due(s.policy, s.timing, state, state.next_due_at, RNG)
        times.extend(e.scheduled_for for e in out.emit)
        state = replace_active(out.state)
    return times


def replace_active(state: ScheduleState) -> ScheduleState:
    from dataclasses import replace

    return replace(state, active_runs=0)


def test_start_at_accepts_aware_datetime_and_iso_text() -> None:
    """An aware datetime and ISO 8601 text with an offset are both read as the same UTC instant."""
    a, _ = parse_policy("job", {"start_at": datetime(2030, 1, 1, 13, tzinfo=UTC)})
    b, _ = parse_policy("job", {"start_at": "2030-01-01T14:00:00+01:00"})
    assert (
        a is not None and b is not None and a.start_at == b.start_at == datetime(2030, 1, 1, 13, tzinfo=UTC)
    )


def test_start_at_problems_are_reported_with_the_others() -> None:
    """A naive or unreadable start_at is refused in the same call as every other bad key."""
    _, problems = parse_policy("job", {"start_at": "2030-01-01T10:00", "max_runs": 0})
    assert (
        "job",
        "policy.start_at",
        "must carry a time zone (an aware datetime), got datetime.datetime(2030, 1, 1, 10, 0)",
    ) in problems
    assert any(key == "policy.max_runs" for _, key, _ in problems)
    _, problems = parse_policy("job", {"start_at": "soon"})
    assert problems == [("job", "policy.start_at", "must be an ISO 8601 time with a UTC offset, got 'soon'")]


def test_end_before_start_is_refused() -> None:
    """end_at before start_at names both: such a schedule could never run."""
    _, problems = parse_policy(
        "job", {"start_at": "2030-01-02T00:00:00+00:00", "end_at": "2030-01-01T00:00:00+00:00"}
    )
    assert [key for _, key, _ in problems] == ["policy.end_at"]


def test_start_at_survives_the_json_round_trip() -> None:
    """The stored policy keeps start_at; a policy without it stores no key (digests unchanged)."""
    p, _ = parse_policy("job", {"start_at": "2030-01-01T13:00:00+00:00"})
    assert p is not None
    assert Policy.from_json(p.to_json()) == p
    assert "start_at" not in Policy().to_json()


def test_interval_grid_starts_at_a_future_start_at() -> None:
    """An interval added before start_at emits its first run at start_at, then every period."""
    s = spec(60.0, start_at=T0 + sec(90))
    state = first_state(s, T0, RNG)
    assert state.grid_at == T0 + sec(90)
    assert emitted(s, state, T0 + sec(250)) == [T0 + sec(90), T0 + sec(150), T0 + sec(210)]


def test_interval_with_past_start_at_runs_the_tick_in_progress_at_once_on_its_phase() -> None:
    """A new interval whose start_at passed keeps start_at's phase; the latest grid time runs at once."""
    s = spec(60.0, start_at=T0 - sec(130))
    state = first_state(s, T0, RNG)
    assert state.grid_at == T0 - sec(10)
    assert emitted(s, state, T0 + sec(100)) == [T0 - sec(10), T0 + sec(50)]


def test_interval_change_keeps_start_at_phase_without_reaching_back() -> None:
    """A changed interval restarts from now on start_at's phase: no grid time before the change."""
    s = spec(60.0, start_at=T0 - sec(130))
    state = on_config_change(
        s,
        ScheduleState(grid_at=T0 - sec(10), next_due_at=T0 - sec(10)),
        config_changed=True,
        old_schedule="<every 30 s>",
        old_mode=s.policy.mode,
        now=T0,
        rng=RNG,
    )
    assert state.grid_at == T0 + sec(50)


def test_crontab_skips_fire_times_before_start_at() -> None:
    """A calendar schedule's first run is its first fire time at or after start_at."""
    s = spec(crontab(minute="*/15"), start_at=T0 + sec(20 * 60))
    state = first_state(s, T0, RNG)
    assert state.grid_at == T0 + sec(30 * 60)
    assert emitted(s, state, T0 + sec(50 * 60)) == [T0 + sec(30 * 60), T0 + sec(45 * 60)]


def test_new_crontab_with_past_start_at_runs_its_latest_fire_time_at_once() -> None:
    """A calendar schedule added after start_at starts with its latest fire time since start_at."""
    s = spec(crontab(minute="*/15"), start_at=T0 - sec(3600))
    state = first_state(s, T0 + sec(60), RNG)
    assert state.grid_at == T0
    assert emitted(s, state, T0 + sec(16 * 60)) == [T0, T0 + sec(15 * 60)]


def test_new_crontab_with_no_fire_time_since_start_at_waits_for_the_next() -> None:
    """No fire time between a past start_at and now: the first is the next one, none at once."""
    s = spec(crontab(minute="*/15"), start_at=T0 + sec(60))
    assert first_state(s, T0 + sec(120), RNG).grid_at == T0 + sec(15 * 60)


def test_changed_crontab_with_past_start_at_does_not_reach_back() -> None:
    """A changed calendar schedule restarts at its next fire time, whatever start_at says."""
    s = spec(crontab(minute="*/15"), start_at=T0 - sec(3600))
    state = on_config_change(
        s,
        ScheduleState(grid_at=T0, next_due_at=T0),
        config_changed=True,
        old_schedule="<crontab: */5 * * * * (m/h/dM/MY/d)>",
        old_mode=s.policy.mode,
        now=T0 + sec(60),
        rng=RNG,
    )
    assert state.grid_at == T0 + sec(15 * 60)


def test_fixed_delay_waits_for_start_at() -> None:
    """A fixed-delay schedule's first due time is start_at, and resuming before it waits too."""
    s = spec(30.0, mode="fixed_delay", start_at=T0 + sec(600))
    assert initial_state(s.policy, s.timing, T0, RNG).next_due_at == T0 + sec(600)
    resumed = on_resume(s.policy, ScheduleState(), T0, period=30.0)
    assert resumed.next_due_at == T0 + sec(600)


def test_resumed_calendar_anchors_no_earlier_than_start_at() -> None:
    """A calendar schedule resumed (grid cleared) before start_at re-anchors at start_at's fire time."""
    s = spec(crontab(minute="*/15"), start_at=T0 + sec(40 * 60))
    resumed = on_resume(
        s.policy, ScheduleState(grid_at=T0 - sec(60), next_due_at=T0 - sec(60)), T0, period=None
    )
    out = on_due(s.policy, s.timing, resumed, T0, RNG)
    assert out.emit == () and out.state.grid_at == T0 + sec(45 * 60)


def test_a_start_at_added_later_moves_the_next_tick_to_it() -> None:
    """A changed policy whose start_at is after the next due time moves the grid there: nothing before it."""
    s = spec(60.0, start_at=T0 + sec(3600))
    running = ScheduleState(grid_at=T0 + sec(30), next_due_at=T0 + sec(30), runs=4)
    state = on_config_change(
        s, running, config_changed=True, old_schedule=s.schedule_repr, old_mode=s.policy.mode, now=T0, rng=RNG
    )
    assert (state.grid_at, state.runs) == (T0 + sec(3600), 4)


def test_a_past_start_at_added_later_leaves_the_grid_alone() -> None:
    """A start_at already passed changes nothing for a running schedule: its grid goes on."""
    s = spec(60.0, start_at=T0 - sec(3600))
    running = ScheduleState(grid_at=T0 + sec(30), next_due_at=T0 + sec(30))
    state = on_config_change(
        s, running, config_changed=True, old_schedule=s.schedule_repr, old_mode=s.policy.mode, now=T0, rng=RNG
    )
    assert state.grid_at == T0 + sec(30)
