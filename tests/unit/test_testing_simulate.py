"""``celery_boundedbeat.testing.simulate``: each policy's timeline against hand-computed expectations.

Every expectation below is worked out by hand from the policy's rules (docs/policies.md), not
by running the code; the comments show the reasoning. Times are seconds after the start.
"""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_boundedbeat.config.definitions import config_definitions
from celery_boundedbeat.core.exceptions import ConfigurationError
from celery_boundedbeat.testing import DEFAULT_START, EventKind, Timeline, simulate

MINUTE = 1 / 60  # hours


def starts(tl: Timeline) -> list[tuple[float, float, float]]:
    """Each run as (scheduled_for, start, finish) in seconds after the start."""
    return [
        (tl.seconds(r.scheduled_for), tl.seconds(r.start), tl.seconds(r.finish))
        for r in tl.runs
        if r.start is not None and r.finish is not None
    ]


def at(tl: Timeline, kind: EventKind) -> list[tuple[float, float]]:
    """The ticks of one kind as (scheduled_for, when dealt with) in seconds."""
    return [(tl.seconds(e.scheduled_for), tl.seconds(e.at)) for e in tl.of_kind(kind)]


@pytest.fixture
def app() -> Celery:
    return Celery("simtest", broker="memory://", set_as_current=False)


def test_fixed_delay_waits_the_period_after_each_finish(app: Celery) -> None:
    """fixed_delay: due 10 s after the previous run finished, whatever it took (3 s, 5 s, ...)."""
    entry = {"task": "t", "schedule": 10, "policy": {"mode": "fixed_delay"}}
    tl = simulate(entry, hours=MINUTE, task_seconds=[3, 5], app=app)
    # 0-3, due 13: 13-18, due 28: 28-31, due 41: 41-46, due 56: 56-59, due 69 > 60.
    assert starts(tl) == [(0, 0, 3), (13, 13, 18), (28, 28, 31), (41, 41, 46), (56, 56, 59)], tl
    assert (tl.skips, tl.overlaps, tl.max_active, tl.completed) == (0, 0, 1, 5)


def test_a_timeline_counts_in_words_with_plurals(app: Celery) -> None:
    """A timeline's first line says "1 run" and "0 skips", never "1 runs"."""
    tl = simulate({"task": "t", "schedule": 100}, hours=MINUTE, task_seconds=1, app=app)
    assert str(tl).splitlines()[0].endswith(": 1 run, 0 skips, 0 overlaps"), str(tl)


def test_no_overlap_skip_drops_every_tick_that_finds_the_run_active(app: Celery) -> None:
    """fixed_rate_no_overlap + skip: a 25 s task on a 10 s grid runs at 0 and 30; 10, 20, 40, 50 dropped."""
    tl = simulate({"task": "t", "schedule": 10}, hours=MINUTE, task_seconds=25, app=app)
    assert starts(tl) == [(0, 0, 25), (30, 30, 55)], tl
    assert at(tl, EventKind.SKIPPED) == [(10, 10), (20, 20), (40, 40), (50, 50)], tl
    assert (tl.skips, tl.overlaps, tl.max_active) == (4, 0, 1)


def test_coalesce_latest_keeps_only_the_latest_missed_tick(app: Celery) -> None:
    """coalesce_latest: 10 waits, 20 replaces it and starts at 25; 30 waits, 40 replaces it, starts at 50."""
    entry = {"task": "t", "schedule": 10, "policy": {"missed_ticks": "coalesce_latest"}}
    tl = simulate(entry, hours=MINUTE, task_seconds=25, app=app)
    assert starts(tl) == [(0, 0, 25), (20, 25, 50), (40, 50, 75)], tl
    assert at(tl, EventKind.COALESCED) == [(10, 20), (30, 40)], tl
    # At 50 the freed slot goes to the waiting tick 40 first, so tick 50 waits in its turn.
    assert at(tl, EventKind.PENDING) == [(50, 60)], tl
    assert tl.skipped == ()
    assert tl.skips == 2


def test_catch_up_keeps_max_pending_oldest_first_and_drops_the_rest(app: Celery) -> None:
    """catch_up, max_pending 2: 10 and 20 wait; 40 finds [20, 30] waiting and is dropped."""
    entry = {"task": "t", "schedule": 10, "policy": {"missed_ticks": "catch_up", "max_pending": 2}}
    tl = simulate(entry, hours=MINUTE, task_seconds=25, app=app)
    # 0-25; 10 starts at 25 (25-50); 20 starts at 50 (50-75); 30 and 50 still wait at the end.
    assert starts(tl) == [(0, 0, 25), (10, 25, 50), (20, 50, 75)], tl
    assert at(tl, EventKind.SKIPPED) == [(40, 40)], tl
    assert at(tl, EventKind.PENDING) == [(30, 60), (50, 60)], tl
    assert tl.skips == 1


def test_fixed_rate_runs_at_most_max_concurrency_at_once(app: Celery) -> None:
    """fixed_rate, max_concurrency 2: 25 s runs at 0, 10, 30, 40; 20 and 50 find both slots busy."""
    entry = {"task": "t", "schedule": 10, "policy": {"mode": "fixed_rate", "max_concurrency": 2}}
    tl = simulate(entry, hours=MINUTE, task_seconds=25, app=app)
    assert starts(tl) == [(0, 0, 25), (10, 10, 35), (30, 30, 55), (40, 40, 65)], tl
    assert [r.overlap for r in tl.runs] == [False, True, True, True]
    assert at(tl, EventKind.SKIPPED) == [(20, 20), (50, 50)], tl
    assert (tl.skips, tl.overlaps, tl.max_active) == (2, 3, 2)


def test_initial_delay_moves_the_first_run_and_the_grid(app: Celery) -> None:
    """initial_delay 15 on a 10 s grid: runs at 15, 25, 35, 45, 55, nothing before 15."""
    entry = {"task": "t", "schedule": 10, "policy": {"initial_delay": 15}}
    tl = simulate(entry, hours=MINUTE, task_seconds=1, app=app)
    assert [s for s, _, _ in starts(tl)] == [15, 25, 35, 45, 55], tl
    assert len(tl.events) == 5


def test_jitter_delays_each_run_by_the_seeded_draws_within_a_tenth_of_the_period(app: Celery) -> None:
    """jitter 30 on a 100 s grid is capped at 10 s; with seed 7 each start is the grid plus the i-th draw."""
    entry = {"task": "t", "schedule": 100, "policy": {"jitter": 30}}
    tl = simulate(entry, hours=1000 / 3600, task_seconds=1, seed=7, app=app)
    rng = random.Random(7)
    draws = [rng.uniform(0.0, 10.0) for _ in range(10)]  # one draw per grid tick, in order
    assert [r.scheduled_for for r in tl.runs] == [
        DEFAULT_START + timedelta(seconds=100 * i) for i in range(10)
    ]
    for i, run in enumerate(tl.runs):
        assert abs(run.drift - timedelta(seconds=draws[i])) <= timedelta(microseconds=1), tl
    assert simulate(entry, hours=1000 / 3600, task_seconds=1, seed=7, app=app) == tl
    assert simulate(entry, hours=1000 / 3600, task_seconds=1, seed=8, app=app) != tl


def test_max_runs_and_end_at_end_the_timeline(app: Celery) -> None:
    """max_runs 3 stops after the third run; end_at 35 s lets no run scheduled after it out."""
    limited = simulate(
        {"task": "t", "schedule": 10, "policy": {"max_runs": 3}}, hours=MINUTE, task_seconds=1, app=app
    )
    assert [s for s, _, _ in starts(limited)] == [0, 10, 20]
    assert len(limited.events) == 3
    end_at = (DEFAULT_START + timedelta(seconds=35)).isoformat()
    ended = simulate(
        {"task": "t", "schedule": 10, "policy": {"end_at": end_at}}, hours=MINUTE, task_seconds=1, app=app
    )
    assert [s for s, _, _ in starts(ended)] == [0, 10, 20, 30]


def test_a_crontab_runs_at_its_wall_clock_time_in_the_apps_zone(app: Celery) -> None:
    """crontab 04:00 in Europe/Berlin (UTC+1 in January): one run a day at 03:00 UTC."""
    app.conf.timezone = "Europe/Berlin"
    entry = {"task": "t", "schedule": crontab(minute=0, hour=4, app=app)}
    tl = simulate(entry, hours=72, task_seconds=60, app=app)
    assert [r.scheduled_for for r in tl.runs] == [datetime(2025, 1, d, 3, tzinfo=UTC) for d in (6, 7, 8)], tl


def test_a_simulated_crontab_follows_the_dst_rule_in_its_policy_zone(app: Celery) -> None:
    """02:30 Berlin over the spring-forward night (UTC app): 01:30 UTC, then 03:00 CEST (01:00 UTC), then
    00:30 UTC; the hourly job beside it keeps elapsed time."""
    berlin = {"timezone": "Europe/Berlin"}
    start = datetime(2026, 3, 28, tzinfo=UTC)
    daily = simulate({"task": "t", "schedule": crontab(minute=30, hour=2, app=app), "policy": berlin},
                     hours=72, task_seconds=60, start=start, app=app)  # fmt: skip
    assert [r.scheduled_for for r in daily.runs] == [
        datetime(2026, 3, 28, 1, 30, tzinfo=UTC),
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
        datetime(2026, 3, 30, 0, 30, tzinfo=UTC),
    ]
    hourly = simulate({"task": "t", "schedule": crontab(minute=0, app=app), "policy": berlin},
                      hours=48, task_seconds=60, start=start, app=app)  # fmt: skip
    times = [r.scheduled_for for r in hourly.runs]
    assert len(times) == 48 and all(b - a == timedelta(hours=1) for a, b in itertools.pairwise(times))


def test_task_seconds_may_be_a_function_of_the_run_index(app: Celery) -> None:
    """A callable gives each run's duration by its index: here 1 s, 2 s, 3 s, ..."""
    entry = {"task": "t", "schedule": 5, "policy": {"mode": "fixed_delay"}}
    tl = simulate(entry, hours=30 / 3600, task_seconds=lambda i: i + 1, app=app)
    # 0-1, 6-8, 13-16, 21-25, 30 is the end.
    assert starts(tl) == [(0, 0, 1), (6, 6, 8), (13, 13, 16), (21, 21, 25)], tl


def test_a_negative_duration_is_refused(app: Celery) -> None:
    with pytest.raises(ValueError, match="negative duration for run 0"):
        simulate({"task": "t", "schedule": 5}, hours=MINUTE, task_seconds=-1, app=app)


@pytest.mark.parametrize(
    "entry",
    [
        {"task": "t", "schedule": 0},
        {"task": "t", "schedule": crontab(minute=0), "policy": {"mode": "fixed_delay"}},
        {"task": "t", "schedule": 10, "policy": {"mode": "fixed_rate", "missed_ticks": "catch_up", "x": 1}},
        {"schedule": 10, "policy": {"mode": "sometimes"}, "colour": "red"},
    ],
    ids=["zero-period", "crontab-fixed-delay", "missing-bounds-unknown-key", "no-task-bad-mode"],
)
def test_an_invalid_entry_is_refused_with_the_text_beat_logs(app: Celery, entry: dict[str, Any]) -> None:
    """The ConfigurationError is the one beat's own validation raises for the same beat_schedule."""
    app.conf.beat_schedule = {"nightly": entry}
    with pytest.raises(ConfigurationError) as beat:
        config_definitions(app, {})
    with pytest.raises(ConfigurationError) as simulated:
        simulate(entry, name="nightly", app=app)
    assert str(simulated.value) == str(beat.value)
    assert simulated.value.problems == beat.value.problems


def test_a_zero_period_names_entry_key_and_reason(app: Celery) -> None:
    with pytest.raises(ConfigurationError) as exc:
        simulate({"task": "t", "schedule": 0}, name="poll", app=app)
    assert str(exc.value) == (
        "invalid celery_boundedbeat configuration (1 problem):\n"
        "  - entry 'poll', key 'schedule': period must be > 0 seconds, got 0"
    )


def test_the_apps_default_policy_applies_and_a_bad_one_is_refused_as_beat_does(app: Celery) -> None:
    """boundedbeat_default_policy is merged under the entry's own keys; a broken one names the setting."""
    app.conf.boundedbeat_default_policy = {"mode": "fixed_delay"}
    tl = simulate({"task": "t", "schedule": 10}, hours=MINUTE, task_seconds=5, app=app)
    assert [s for s, _, _ in starts(tl)] == [0, 15, 30, 45]  # 10 s after each 5 s run
    app.conf.boundedbeat_default_policy = {"mode": "often"}
    with pytest.raises(ConfigurationError, match="boundedbeat_default_policy"):
        simulate({"task": "t", "schedule": 10}, app=app)


@pytest.mark.parametrize(
    "policy",
    [
        {},
        {"missed_ticks": "coalesce_latest"},
        {"missed_ticks": "catch_up", "max_pending": 3},
        {"mode": "fixed_rate", "max_concurrency": 3, "missed_ticks": "coalesce_latest"},
        {"mode": "fixed_rate", "max_concurrency": 2, "missed_ticks": "catch_up", "max_pending": 1},
    ],
)
def test_every_grid_tick_is_one_event_and_the_drops_are_the_skips(
    app: Celery, policy: dict[str, Any]
) -> None:
    """Exact accounting over a day of 7 s ticks with run times of 3-40 s: runs + dropped + pending = ticks."""
    rng = random.Random(3)
    tl = simulate(
        {"task": "t", "schedule": 7, "policy": policy},
        hours=24,
        task_seconds=lambda _i: rng.uniform(3, 40),
        app=app,
    )
    grid = [DEFAULT_START + timedelta(seconds=7 * i) for i in range(24 * 3600 // 7 + 1)]
    assert [e.scheduled_for for e in tl.events] == grid
    assert len(tl.skipped) + len(tl.coalesced) == tl.skips > 0
    assert tl.max_active <= policy.get("max_concurrency", 1)
    assert all(e.start is not None and e.start >= e.scheduled_for for e in tl.runs)


def test_replace_revokes_each_run_at_the_next_tick(app: Celery) -> None:
    """replace, 10 s grid, 25 s runs: each run is revoked by the next tick, which starts at once."""
    entry = {"task": "t", "schedule": 10, "policy": {"missed_ticks": "replace"}}
    tl = simulate(entry, hours=35 / 3600, task_seconds=25, app=app)
    # Runs at 0, 10, 20, 30; each of the first three ends (revoked) when the next one starts.
    assert starts(tl) == [(0, 0, 10), (10, 10, 20), (20, 20, 30), (30, 30, 55)]
    assert [r.revoked for r in tl.runs] == [True, True, True, False]
    assert (tl.max_active, tl.skips, tl.completed) == (1, 0, 0)
