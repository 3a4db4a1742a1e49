"""django-celery-beat's ``PeriodicTask`` rows as runtime schedules (docs/migrating.md).

The rows are plain dicts keyed by column name, read with SQL from the URL given
(:func:`read_tables`) or through Django's ORM (:mod:`celery_boundedbeat.contrib.django.dcb`):
one mapping (:func:`map_tasks`) serves both. Each schedule continues where django-celery-beat
left it: ``start_at`` is its next due time after ``last_run_at`` (an interval's grid goes on
from there, a calendar skips the fire times it already ran), so nothing runs twice at the
switch and a tick that fell due while neither beat ran runs at once, as django-celery-beat
would have run it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.schedules import crontab, solar

from .importing import Incoming, Refused

#: django-celery-beat's tables, by the schedule kind each holds.
TABLES = {
    "task": "django_celery_beat_periodictask",
    "interval": "django_celery_beat_intervalschedule",
    "crontab": "django_celery_beat_crontabschedule",
    "solar": "django_celery_beat_solarschedule",
    "clocked": "django_celery_beat_clockedschedule",
}
KINDS = ("interval", "crontab", "solar", "clocked")

#: Seconds in each ``IntervalSchedule.period``.
PERIODS = {"days": 86400.0, "hours": 3600.0, "minutes": 60.0, "seconds": 1.0, "microseconds": 1e-6}

#: The period of the interval a clocked schedule becomes: one grid time, ``max_runs: 1``.
CLOCKED_PERIOD = 365 * 86400.0

Rows = Mapping[str, Mapping[Any, Mapping[str, Any]]]


def as_utc(value: Any) -> datetime | None:
    """A stored time as aware UTC; naive ones are UTC (Django's ``USE_TZ`` stores UTC)."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        raise ValueError(f"not a time: {value!r}")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def read_tables(url: str) -> Rows:
    """Every row of django-celery-beat's five tables, by kind and id, with plain SQL."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            tables: dict[str, dict[Any, Mapping[str, Any]]] = {}
            for kind, table in TABLES.items():
                result = conn.execute(text(f"SELECT * FROM {table}"))
                tables[kind] = {row["id"]: dict(row) for row in result.mappings()}
            return tables
    finally:
        engine.dispose()


def map_tasks(rows: Rows) -> list[Incoming | Refused]:
    """Each ``PeriodicTask`` as a runtime schedule, or refused with the reason, by name."""
    tasks = sorted(rows["task"].values(), key=lambda t: str(t["name"]))
    return [map_task(task, rows) for task in tasks]


def _json(task: Mapping[str, Any], key: str, empty: str, kind: type) -> Any:
    raw = task.get(key) or empty
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise _Unmappable(f"{key} is not JSON ({exc})") from None
    if not isinstance(value, kind):
        raise _Unmappable(f"{key} must be a JSON {'array' if kind is list else 'object'}, got {raw!r}")
    return value


class _Unmappable(Exception):
    """A row that has no faithful runtime schedule; the message says why."""


def map_task(task: Mapping[str, Any], rows: Rows) -> Incoming | Refused:
    """One ``PeriodicTask`` row (and the schedule row it points at) as a runtime schedule."""
    name = str(task["name"])
    try:
        return _map(task, rows)
    except (_Unmappable, ValueError, TypeError, KeyError) as exc:
        return Refused(name=name, task=str(task.get("task") or "-"), reason=str(exc))


def _map(task: Mapping[str, Any], rows: Rows) -> Incoming:
    kinds = [k for k in KINDS if task.get(f"{k}_id") is not None]
    if len(kinds) != 1:
        raise _Unmappable("has no schedule" if not kinds else f"has several schedules ({', '.join(kinds)})")
    kind = kinds[0]
    found = rows[kind].get(task[f"{kind}_id"])
    if found is None:
        raise _Unmappable(f"its {kind} schedule {task[f'{kind}_id']} is missing")
    one_off = bool(task.get("one_off")) or kind == "clocked"
    policy: dict[str, Any] = {}
    schedule, step, shown = _timing(kind, found, policy)
    if one_off:
        policy["max_runs"] = 1
    end_at = as_utc(task.get("expires"))
    if end_at is not None:
        policy["end_at"] = end_at
    start_at = _start_at(task, kind, step, found)
    if start_at is not None and (end_at is None or start_at <= end_at):
        policy["start_at"] = start_at
    ran = one_off and int(task.get("total_run_count") or 0) > 0  # django-celery-beat disables it next
    return Incoming(
        name=str(task["name"]),
        task=str(task["task"]),
        schedule=schedule,
        args=_json(task, "args", "[]", list),
        kwargs=_json(task, "kwargs", "{}", dict),
        options=_options(task),
        policy=policy,
        paused=not task.get("enabled", True) or ran,
        shown=shown,
    )


def _timing(kind: str, found: Mapping[str, Any], policy: dict[str, Any]) -> tuple[Any, timedelta, str | None]:
    """The schedule value, how far after ``last_run_at`` its next time is looked for, its label."""
    if kind == "interval":
        period = str(found["period"])
        if period not in PERIODS:
            raise _Unmappable(f"unknown interval period {period!r}")
        seconds = float(found["every"]) * PERIODS[period]
        return seconds, timedelta(seconds=seconds), None
    if kind == "crontab":
        fields = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
        cron = crontab(**{f: str(found[f]) for f in fields})
        zone = found.get("timezone")
        if zone:
            policy["timezone"] = str(getattr(zone, "key", zone))
        return cron, timedelta(microseconds=1), None
    if kind == "solar":
        return (
            solar(str(found["event"]), float(found["latitude"]), float(found["longitude"])),
            timedelta(microseconds=1),
            None,
        )
    at = as_utc(found["clocked_time"])
    assert at is not None
    return CLOCKED_PERIOD, timedelta(0), f"clocked {at.isoformat()}"


def _start_at(
    task: Mapping[str, Any], kind: str, step: timedelta, found: Mapping[str, Any]
) -> datetime | None:
    """The first time the schedule may run here: after what django-celery-beat already ran.

    ``last_run_at`` (else ``date_changed``, as django-celery-beat reads it) plus the period
    for an interval, plus 1 µs for a calendar; never before ``start_time``. A clocked schedule
    runs at its clocked time.
    """
    if kind == "clocked":
        return as_utc(found["clocked_time"])
    start_time = as_utc(task.get("start_time"))
    last = as_utc(task.get("last_run_at"))
    if last is None and start_time is None:
        last = as_utc(task.get("date_changed"))
    after = None if last is None else last + step
    times = [t for t in (start_time, after) if t is not None]
    return max(times) if times else None


def _options(task: Mapping[str, Any]) -> dict[str, Any]:
    """Routing as django-celery-beat sends it: queue, exchange, routing key, priority, headers."""
    options: dict[str, Any] = {}
    for key in ("queue", "exchange", "routing_key", "priority"):
        if task.get(key) is not None:
            options[key] = task[key]
    # A message expiry as django-celery-beat sets it: ``expire_seconds``, else ``expires``
    # (ISO 8601 text, which Celery reads as it reads a datetime).
    expires = as_utc(task.get("expires"))
    if task.get("expire_seconds"):
        options["expires"] = task["expire_seconds"]
    elif expires is not None:
        options["expires"] = expires.isoformat()
    headers = _json(task, "headers", "{}", dict)
    headers["periodic_task_name"] = str(task["name"])
    options["headers"] = headers
    return options
