"""beat_schedule validation: every accepted form, and every bad entry reported at once."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import celery
import pytest
from celery.schedules import crontab, schedule, solar
from helpers.apps import make_app

from celery_boundedbeat.config.entries import build_specs, parse_entry
from celery_boundedbeat.core.enums import MissedTicks, Mode
from celery_boundedbeat.core.exceptions import ConfigurationError
from celery_boundedbeat.core.timing import CalendarTiming, IntervalTiming


def problems_of(app: celery.Celery, default: dict[str, Any] | None = None) -> list[tuple[str, str, str]]:
    with pytest.raises(ConfigurationError) as info:
        build_specs(app, default or {})
    return info.value.problems


@pytest.mark.parametrize(
    ("value", "period"),
    [
        (30, 30.0),
        (2.5, 2.5),
        (timedelta(minutes=2), 120.0),
        (schedule(run_every=timedelta(seconds=45)), 45.0),
        (schedule(run_every=15), 15.0),
    ],
)
def test_interval_schedules_are_accepted(value: Any, period: float) -> None:
    """Numbers, timedeltas and celery.schedules.schedule become an interval grid of that period."""
    specs = build_specs(make_app({"job": {"task": "proj.job", "schedule": value}}), {})
    spec = specs["job"]
    assert spec.period == period
    assert spec.timing == IntervalTiming(period)
    assert spec.task == "proj.job"
    assert spec.policy.mode is Mode.FIXED_RATE_NO_OVERLAP


def test_crontab_is_a_calendar_grid() -> None:
    """A crontab schedule is accepted as a calendar grid without a period."""
    specs = build_specs(
        make_app({"nightly": {"task": "proj.nightly", "schedule": crontab(minute=0, hour=3)}}), {}
    )
    assert isinstance(specs["nightly"].timing, CalendarTiming)
    assert specs["nightly"].period is None
    assert specs["nightly"].policy.mode is Mode.FIXED_RATE_NO_OVERLAP


def test_solar_is_a_calendar_grid_and_refuses_fixed_delay() -> None:
    """A solar schedule is a calendar grid; fixed_delay on it is refused."""
    pytest.importorskip("ephem", reason="celery's solar schedules need the ephem package")
    dusk = solar("sunset", 48.85, 2.35)
    specs = build_specs(make_app({"dusk": {"task": "proj.dusk", "schedule": dusk}}), {})
    assert isinstance(specs["dusk"].timing, CalendarTiming)
    app = make_app({"dusk": {"task": "proj.dusk", "schedule": dusk, "policy": {"mode": "fixed_delay"}}})
    assert [(e, k) for e, k, _r in problems_of(app)] == [("dusk", "schedule")]


def test_a_crontab_grid_follows_the_crontab() -> None:
    """The crontab grid's next tick after a time is the crontab's next match."""
    from datetime import UTC, datetime

    spec = build_specs(make_app({"q": {"task": "t", "schedule": crontab(minute="*/15")}}), {})["q"]
    t = datetime(2030, 1, 1, 10, 7, tzinfo=UTC)
    assert spec.timing.first_at_or_after(t) == datetime(2030, 1, 1, 10, 15, tzinfo=UTC)
    assert spec.timing.first_at_or_after(datetime(2030, 1, 1, 10, 15, tzinfo=UTC)) == datetime(
        2030, 1, 1, 10, 15, tzinfo=UTC
    )
    count, _tick_at, next_tick = spec.timing.passed(
        datetime(2030, 1, 1, 10, 15, tzinfo=UTC), datetime(2030, 1, 1, 11, 0, tzinfo=UTC)
    )
    assert count == 4
    assert next_tick == datetime(2030, 1, 1, 11, 15, tzinfo=UTC)


def test_args_kwargs_options_and_policy_are_kept() -> None:
    """An entry's args, kwargs, options and policy end up in its spec."""
    app = make_app(
        {
            "refresh": {
                "task": "proj.refresh",
                "schedule": 30.0,
                "args": [1, "a"],
                "kwargs": {"force": True},
                "options": {"queue": "maintenance"},
                "policy": {"mode": "fixed_rate", "max_concurrency": 2, "max_run_time": timedelta(seconds=20)},
            }
        }
    )
    spec = build_specs(app, {})["refresh"]
    assert spec.args == (1, "a")
    assert dict(spec.kwargs) == {"force": True}
    assert dict(spec.options) == {"queue": "maintenance"}
    assert spec.policy.mode is Mode.FIXED_RATE
    assert spec.policy.limit == 2
    assert spec.policy.max_run_time == 20.0


def test_add_periodic_task_policy_inside_options_works() -> None:
    """app.add_periodic_task(..., policy={...}) puts the policy in options; it is taken out and used."""
    app = celery.Celery("t", set_as_current=False)

    @app.task(name="proj.add")  # type: ignore[untyped-decorator]
    def add(x: int, y: int) -> int:
        return x + y

    app.add_periodic_task(10.0, add.s(1, 2), name="add-every-10", policy={"mode": "fixed_delay"}, queue="q")
    spec = build_specs(app, {})["add-every-10"]
    assert spec.task == "proj.add"
    assert spec.args == (1, 2)
    assert spec.policy.mode is Mode.FIXED_DELAY
    assert dict(spec.options) == {"queue": "q"}


def test_add_periodic_task_bad_policy_is_refused() -> None:
    """A bad policy given through add_periodic_task is reported like any other."""
    app = celery.Celery("t", set_as_current=False)
    app.add_periodic_task(10.0, celery.signature("proj.x"), name="x", policy={"mode": "sometimes"})
    assert [(e, k) for e, k, _r in problems_of(app)] == [("x", "policy.mode")]


def test_every_bad_entry_is_listed_in_one_error() -> None:
    """One ConfigurationError names every bad entry with its key and the reason."""
    app = make_app(
        {
            "ok": {"task": "proj.ok", "schedule": 10},
            "zero": {"task": "proj.a", "schedule": 0},
            "negative": {"task": "proj.a", "schedule": timedelta(seconds=-5)},
            "zero-schedule": {"task": "proj.a", "schedule": schedule(run_every=timedelta(0))},
            "nan": {"task": "proj.a", "schedule": float("nan")},
            "bool": {"task": "proj.a", "schedule": True},
            "string": {"task": "proj.a", "schedule": "every minute"},
            "no-schedule": {"task": "proj.a"},
            "no-task": {"schedule": 10},
            "extra": {"task": "proj.a", "schedule": 10, "sometimes": 1},
            "cron-delay": {"task": "proj.a", "schedule": crontab(), "policy": {"mode": "fixed_delay"}},
            "rate": {"task": "proj.a", "schedule": 10, "policy": {"mode": "fixed_rate"}},
            "two": {"task": 5, "schedule": -1, "policy": {"jitter": "x"}},
            "not-a-dict": ["proj.a", 10],
        }
    )
    with pytest.raises(ConfigurationError) as info:
        build_specs(app, {})
    found = {(entry, key) for entry, key, _reason in info.value.problems}
    assert found == {
        ("zero", "schedule"),
        ("negative", "schedule"),
        ("zero-schedule", "schedule"),
        ("nan", "schedule"),
        ("bool", "schedule"),
        ("string", "schedule"),
        ("no-schedule", "schedule"),
        ("no-task", "task"),
        ("extra", "sometimes"),
        ("cron-delay", "schedule"),
        ("rate", "policy.max_concurrency"),
        ("two", "task"),
        ("two", "schedule"),
        ("two", "policy.jitter"),
        ("not-a-dict", "entry"),
    }
    assert all(reason for _e, _k, reason in info.value.problems)
    message = str(info.value)
    for entry in ("zero", "cron-delay", "rate", "not-a-dict"):
        assert repr(entry) in message
    assert "'policy.max_concurrency'" in message
    assert "fixed_rate" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("args", (object(),)),
        ("kwargs", {"when": timedelta(seconds=1)}),
        ("options", {"link": object()}),
        ("args", "abc"),
        ("kwargs", [1]),
        ("options", 3),
    ],
)
def test_non_json_or_wrongly_typed_arguments_are_refused(field: str, value: Any) -> None:
    """args, kwargs and options must be JSON-serializable containers of the right type."""
    app = make_app({"job": {"task": "proj.job", "schedule": 10, field: value}})
    assert [(e, k) for e, k, _r in problems_of(app)] == [("job", field)]


def test_the_default_policy_applies_and_entries_override_it() -> None:
    """boundedbeat_default_policy is the base of every entry's policy; an entry's keys win."""
    app = make_app(
        {
            "plain": {"task": "proj.a", "schedule": 10},
            "own": {
                "task": "proj.b",
                "schedule": 10,
                "policy": {"missed_ticks": "skip", "max_pending": None},
            },
        }
    )
    default = {"missed_ticks": "catch_up", "max_pending": 3}
    specs = build_specs(app, default)
    assert specs["plain"].policy.missed_ticks is MissedTicks.CATCH_UP
    assert specs["plain"].policy.max_pending == 3
    assert specs["own"].policy.missed_ticks is MissedTicks.SKIP
    assert specs["own"].policy.max_pending is None


def test_the_merged_policy_is_validated() -> None:
    """An entry whose keys contradict the default's is refused, naming the entry."""
    app = make_app({"delay": {"task": "proj.a", "schedule": 10, "policy": {"mode": "fixed_delay"}}})
    problems = problems_of(app, {"missed_ticks": "coalesce_latest"})
    assert [(e, k) for e, k, _r in problems] == [("delay", "policy.missed_ticks")]


def test_a_bad_default_policy_is_reported_against_the_setting() -> None:
    """A broken boundedbeat_default_policy is named as such (once), not blamed on each entry."""
    app = make_app({"a": {"task": "proj.a", "schedule": 10}, "b": {"task": "proj.b", "schedule": 10}})
    problems = problems_of(app, {"mode": "sideways", "colour": "red"})
    assert {(e, k) for e, k, _r in problems} == {
        ("boundedbeat_default_policy", "policy.mode"),
        ("boundedbeat_default_policy", "policy.colour"),
    }


def test_an_empty_schedule_builds_nothing() -> None:
    """No beat_schedule means no specs and no error."""
    assert build_specs(make_app(), {}) == {}


def test_relative_is_accepted_and_its_being_ignored_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """An entry with relative=True is accepted, with one warning naming every such entry."""
    app = make_app(
        {
            "a": {"task": "t.a", "schedule": 10, "relative": True},
            "b": {"task": "t.b", "schedule": 10, "relative": True},
            "c": {"task": "t.c", "schedule": 10},
        }
    )
    assert set(build_specs(app, {})) == {"a", "b", "c"}
    lines = [r.getMessage() for r in caplog.records if "relative" in r.getMessage()]
    assert len(lines) == 1 and "a, b" in lines[0]


@pytest.mark.parametrize(("key", "value"), [("args", 0), ("args", ""), ("kwargs", 0), ("options", False)])
def test_a_falsy_value_of_the_wrong_type_is_refused_not_taken_as_empty(key: str, value: object) -> None:
    """args=0 or options=False is an error naming the key, as a truthy wrong value is."""
    spec, problems = parse_entry("job", {"task": "t", "schedule": 5, key: value}, {})
    assert spec is None and [p[1] for p in problems] == [key]
