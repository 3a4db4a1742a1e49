"""Policy validation: every accepted form, every refused one named, and the entry's change marker."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from celery_boundedbeat.core.enums import MissedTicks, Mode
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.spec import EntrySpec, config_hash
from celery_boundedbeat.core.timing import IntervalTiming


def parse(raw: dict[str, Any] | None = None, **kwargs: Any) -> Policy:
    policy, problems = parse_policy("entry", raw or {}, **kwargs)
    assert problems == [], problems
    assert policy is not None
    return policy


def problems_of(raw: Any, default: dict[str, Any] | None = None, kind: str = "interval") -> list[Any]:
    policy, problems = parse_policy("entry", raw, default, schedule_kind=kind)
    assert policy is None
    assert problems
    return problems


def keys_of(problems: list[Any]) -> set[str]:
    return {key for _entry, key, _reason in problems}


# -- the mode/policy contract ------------------------------------------------------------


def test_default_policy_is_fixed_rate_no_overlap_with_skip() -> None:
    """A schedule without a policy is fixed_rate_no_overlap + skip, one run at a time."""
    policy = parse(None)
    assert policy.mode is Mode.FIXED_RATE_NO_OVERLAP
    assert policy.missed_ticks is MissedTicks.SKIP
    assert policy.limit == 1
    assert policy.initial_delay == 0.0
    assert (policy.max_pending, policy.max_concurrency, policy.max_run_time, policy.jitter) == (
        None,
        None,
        None,
        None,
    )


@pytest.mark.parametrize("mode", ["fixed_delay", "fixed_rate_no_overlap"])
def test_serial_modes_refuse_a_concurrency_bound(mode: str) -> None:
    """fixed_delay and fixed_rate_no_overlap are serial: a max_concurrency contradicts them."""
    problems = problems_of({"mode": mode, "max_concurrency": 2})
    assert keys_of(problems) == {"policy.max_concurrency"}
    assert all(entry == "entry" for entry, _k, _r in problems)
    assert mode in problems[0][2]
    assert parse({"mode": mode}).limit == 1


def test_fixed_rate_needs_max_concurrency() -> None:
    """fixed_rate without max_concurrency is refused; with it, the bound is the limit."""
    problems = problems_of({"mode": "fixed_rate"})
    assert keys_of(problems) == {"policy.max_concurrency"}
    assert "required" in problems[0][2]
    assert parse({"mode": "fixed_rate", "max_concurrency": 3}).limit == 3


def test_catch_up_requires_max_pending_and_others_forbid_it() -> None:
    """catch_up needs max_pending, and max_pending is refused with any other missed_ticks."""
    assert keys_of(problems_of({"missed_ticks": "catch_up"})) == {"policy.max_pending"}
    assert keys_of(problems_of({"missed_ticks": "skip", "max_pending": 2})) == {"policy.max_pending"}
    assert keys_of(problems_of({"missed_ticks": "coalesce_latest", "max_pending": 2})) == {
        "policy.max_pending"
    }
    assert parse({"missed_ticks": "catch_up", "max_pending": 4}).max_pending == 4


def test_fixed_delay_refuses_crontab_and_missed_tick_policies() -> None:
    """fixed_delay needs an interval schedule and its missed_ticks must stay skip."""
    problems = problems_of({"mode": "fixed_delay"}, kind="crontab")
    assert keys_of(problems) == {"schedule"}
    assert "crontab" in problems[0][2]
    assert keys_of(problems_of({"mode": "fixed_delay"}, kind="solar")) == {"schedule"}
    assert keys_of(problems_of({"mode": "fixed_delay", "missed_ticks": "coalesce_latest"})) == {
        "policy.missed_ticks"
    }
    assert (
        parse({"mode": "fixed_rate_no_overlap"}, schedule_kind="crontab").mode is Mode.FIXED_RATE_NO_OVERLAP
    )


def test_unknown_keys_modes_and_missed_ticks_are_refused() -> None:
    """Unknown policy keys, modes and missed_ticks values are each named."""
    assert keys_of(problems_of({"max_retries": 2})) == {"policy.max_retries"}
    problems = problems_of({"mode": "fixed_rate_allow_overlap"})
    assert keys_of(problems) == {"policy.mode"}
    assert "fixed_rate_allow_overlap" in problems[0][2]
    assert keys_of(problems_of({"missed_ticks": "latest"})) == {"policy.missed_ticks"}
    assert keys_of(problems_of("fixed_delay")) == {"policy"}


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"mode": "fixed_rate", "max_concurrency": True}, "policy.max_concurrency"),
        ({"mode": "fixed_rate", "max_concurrency": 2.0}, "policy.max_concurrency"),
        ({"mode": "fixed_rate", "max_concurrency": "2"}, "policy.max_concurrency"),
        ({"mode": "fixed_rate", "max_concurrency": 0}, "policy.max_concurrency"),
        ({"missed_ticks": "catch_up", "max_pending": False}, "policy.max_pending"),
        ({"missed_ticks": "catch_up", "max_pending": -1}, "policy.max_pending"),
        ({"initial_delay": "5"}, "policy.initial_delay"),
        ({"initial_delay": True}, "policy.initial_delay"),
        ({"initial_delay": -1}, "policy.initial_delay"),
        ({"max_run_time": 0}, "policy.max_run_time"),
        ({"max_run_time": float("nan")}, "policy.max_run_time"),
        ({"jitter": -0.5}, "policy.jitter"),
        ({"jitter": float("inf")}, "policy.jitter"),
        ({"mode": 1}, "policy.mode"),
    ],
)
def test_wrong_types_and_values_are_refused(raw: dict[str, Any], key: str) -> None:
    """Wrong types (a bool is not an int) and out-of-range values name the offending key."""
    assert keys_of(problems_of(raw)) == {key}


def test_durations_accept_numbers_and_timedeltas() -> None:
    """initial_delay, max_run_time and jitter take seconds or a timedelta."""
    policy = parse(
        {"initial_delay": timedelta(minutes=1), "max_run_time": 2, "jitter": timedelta(seconds=1.5)}
    )
    assert (policy.initial_delay, policy.max_run_time, policy.jitter) == (60.0, 2.0, 1.5)


def test_every_problem_is_reported_at_once() -> None:
    """A policy with several mistakes reports all of them, each naming the entry."""
    problems = problems_of({"mode": "fixed_rate", "missed_ticks": "catch_up", "jitter": "x", "colour": "red"})
    assert keys_of(problems) == {
        "policy.max_concurrency",
        "policy.max_pending",
        "policy.jitter",
        "policy.colour",
    }
    assert {entry for entry, _k, _r in problems} == {"entry"}


def test_entry_keys_override_the_default_and_the_merge_is_validated() -> None:
    """An entry's keys override the default policy's, and the merged result is validated."""
    default = {"mode": "fixed_rate", "max_concurrency": 3}
    assert parse({"max_concurrency": 5}, default=default).limit == 5
    policy, problems = parse_policy("entry", {"mode": "fixed_delay"}, default)
    assert policy is None
    assert keys_of(problems) == {"policy.max_concurrency"}


def test_policy_json_round_trips() -> None:
    """A policy written to the database reads back equal."""
    policy = parse({"mode": "fixed_rate", "max_concurrency": 2, "max_run_time": 5, "jitter": 1})
    assert Policy.from_json(policy.to_json()) == policy


# -- the change marker ---------------------------------------------------------------------


def entry_spec(**changes: Any) -> EntrySpec:
    fields: dict[str, Any] = {
        "name": "entry",
        "task": "proj.task",
        "policy": Policy(),
        "timing": IntervalTiming(10.0),
        "schedule_repr": "every 10s",
        "period": 10.0,
        "args": (1,),
        "kwargs": {"a": 1},
        "options": {"queue": "q"},
    }
    fields.update(changes)
    return EntrySpec(**fields)


def test_config_hash_ignores_the_grid_object_and_the_name() -> None:
    """Equal entries hash equal whatever grid object (rebuilt per process) and row name they carry."""
    assert config_hash(entry_spec()) == config_hash(entry_spec(timing=IntervalTiming(99.0), name="other"))


@pytest.mark.parametrize(
    "change",
    [
        {"task": "proj.other"},
        {"schedule_repr": "every 20s"},
        {"policy": Policy(jitter=1.0)},
        {"args": (2,)},
        {"kwargs": {"a": 2}},
        {"options": {"queue": "r"}},
    ],
)
def test_config_hash_changes_with_every_configured_field(change: dict[str, Any]) -> None:
    """A change to the task, schedule, policy, args, kwargs or options changes the marker."""
    assert config_hash(entry_spec(**change)) != config_hash(entry_spec())
