"""How django-celery-beat rows and RedBeat entries map to runtime schedules (pure, no database)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from celery.schedules import crontab, solar
from helpers.clock import T0 as MIDNIGHT

from celery_boundedbeat.api.dcb_source import CLOCKED_PERIOD, map_task
from celery_boundedbeat.api.importing import Incoming, Refused
from celery_boundedbeat.api.redbeat_source import map_entry

T0 = MIDNIGHT + timedelta(hours=12)  # noon of the shared day: calendar cases read better


def rows(task: dict[str, Any], **schedules: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    base: dict[str, Any] = {"name": "job", "task": "proj.job", "enabled": True, "args": "[]", "kwargs": "{}"}
    base.update(task)
    tables: dict[str, dict[Any, Any]] = {k: {} for k in ("task", "interval", "crontab", "solar", "clocked")}
    for kind, row in schedules.items():
        tables[kind][1] = row
        base[f"{kind}_id"] = 1
    tables["task"][1] = base
    return base, tables


def mapped(task: dict[str, Any], **schedules: dict[str, Any]) -> Incoming:
    out = map_task(*rows(task, **schedules))
    assert isinstance(out, Incoming), out
    return out


def test_interval_continues_after_last_run_at_with_routing_and_headers() -> None:
    """An interval's next run is last_run_at + period; queue, priority and headers go to options."""
    out = mapped(
        {
            "last_run_at": "2030-01-01 12:00:00",  # SQLite's naive UTC text
            "args": "[1, 2]",
            "kwargs": '{"k": "v"}',
            "queue": "q",
            "priority": 5,
            "exchange": None,
            "headers": '{"h": 1}',
            "expire_seconds": 30,
        },
        interval={"every": 2, "period": "minutes"},
    )
    assert out.schedule == 120.0
    assert out.policy == {"start_at": T0 + timedelta(minutes=2)}
    assert (out.args, out.kwargs) == ([1, 2], {"k": "v"})
    assert out.options == {
        "queue": "q",
        "priority": 5,
        "expires": 30,
        "headers": {"h": 1, "periodic_task_name": "job"},
    }
    assert not out.paused


def test_crontab_keeps_its_zone_and_skips_what_already_ran() -> None:
    """A crontab's time zone becomes the policy's; its fire times up to last_run_at are not run again."""
    fields = {"minute": "*/15", "hour": "*", "day_of_week": "*", "day_of_month": "*", "month_of_year": "*"}
    out = mapped({"last_run_at": T0}, crontab={**fields, "timezone": "Europe/Berlin"})
    assert isinstance(out.schedule, crontab)
    assert out.policy == {"timezone": "Europe/Berlin", "start_at": T0 + timedelta(microseconds=1)}


def test_never_run_schedule_starts_from_date_changed_or_start_time() -> None:
    """Without last_run_at, date_changed stands for it (as in django-celery-beat); start_time bounds it."""
    out = mapped({"date_changed": T0}, interval={"every": 10, "period": "seconds"})
    assert out.policy == {"start_at": T0 + timedelta(seconds=10)}
    out = mapped(
        {"date_changed": T0, "start_time": T0 + timedelta(hours=1)},
        interval={"every": 10, "period": "seconds"},
    )
    assert out.policy == {"start_at": T0 + timedelta(hours=1)}


def test_one_off_expires_and_disabled() -> None:
    """one_off is max_runs 1, expires is end_at, enabled=False is paused, a one-off that ran is paused."""
    out = mapped({"one_off": True, "expires": T0, "enabled": False}, interval={"every": 1, "period": "hours"})
    assert (out.policy["max_runs"], out.policy["end_at"], out.paused) == (1, T0, True)
    assert out.options["expires"] == T0.isoformat()  # the message expiry django-celery-beat sets
    assert "start_at" not in out.policy
    ran = mapped({"one_off": True, "total_run_count": 1}, interval={"every": 1, "period": "hours"})
    assert ran.paused


def test_clocked_is_one_run_at_its_time() -> None:
    """A clocked schedule is one grid time at clocked_time: start_at there and max_runs 1."""
    out = mapped({"one_off": True}, clocked={"clocked_time": T0})
    assert out.schedule == CLOCKED_PERIOD
    assert out.policy == {"max_runs": 1, "start_at": T0}
    assert out.shown == f"clocked {T0.isoformat()}"


def test_solar_coordinates_are_read_as_numbers() -> None:
    """A solar schedule's decimal latitude and longitude become a Celery solar."""
    out = mapped({}, solar={"event": "sunset", "latitude": "52.5", "longitude": "13.4"})
    assert isinstance(out.schedule, solar) and (out.schedule.lat, out.schedule.lon) == (52.5, 13.4)


def test_unmappable_rows_are_refused_with_the_reason() -> None:
    """Bad JSON, no schedule, a missing schedule row or an unknown period: refused, saying why."""
    bad = map_task(*rows({"args": "not json"}, interval={"every": 1, "period": "hours"}))
    assert isinstance(bad, Refused) and bad.reason.startswith("args is not JSON")
    none = map_task(*rows({}))
    assert isinstance(none, Refused) and none.reason == "has no schedule"
    task, tables = rows({}, interval={"every": 1, "period": "fortnights"})
    out = map_task(task, tables)
    assert isinstance(out, Refused) and out.reason == "unknown interval period 'fortnights'"
    tables["interval"].clear()
    out = map_task(task, tables)
    assert isinstance(out, Refused) and out.reason == "its interval schedule 1 is missing"


def _redbeat(schedule: dict[str, Any], **more: Any) -> str:
    return json.dumps(
        {
            "name": "rb",
            "task": "proj.rb",
            "args": [1],
            "kwargs": {},
            "options": {},
            "schedule": schedule,
            "enabled": True,
            **more,
        }
    )


def test_redbeat_interval_continues_after_its_last_run() -> None:
    """RedBeat's tagged JSON is decoded: an interval's start_at is last_run_at + every."""
    meta = json.dumps(
        {
            "last_run_at": {
                "__type__": "datetime",
                "year": 2030,
                "month": 1,
                "day": 1,
                "hour": 13,
                "minute": 0,
                "second": 0,
                "microsecond": 0,
                "timezone": 3600,
            }
        }
    )
    out = map_entry("rb", _redbeat({"__type__": "interval", "every": 30.0, "relative": False}), meta)
    assert isinstance(out, Incoming)
    assert out.policy == {"start_at": T0 + timedelta(seconds=30)} and out.args == [1]


def test_redbeat_refuses_rrule_and_relative_intervals() -> None:
    """RedBeat schedules with no equivalent here are refused, saying so."""
    rel = map_entry("rb", _redbeat({"__type__": "interval", "every": 30.0, "relative": True}), None)
    rr = map_entry("rb", _redbeat({"__type__": "rrule", "freq": 3}), None)
    assert isinstance(rel, Refused) and "relative" in rel.reason
    assert isinstance(rr, Refused) and "rrule" in rr.reason
    gone = map_entry("rb", None, None)
    assert isinstance(gone, Refused)
