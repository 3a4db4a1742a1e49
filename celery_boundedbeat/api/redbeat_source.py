"""RedBeat's entries in Redis as runtime schedules (docs/migrating.md).

RedBeat keeps each entry in a hash ``<prefix><name>`` with two JSON fields, ``definition``
(name, task, args, kwargs, options, schedule, enabled) and ``meta`` (``last_run_at``), and
lists the entry keys in the sorted set ``<prefix>:schedule``. Its JSON tags values with
``__type__`` (``datetime``, ``interval``, ``crontab``, ``rrule``); they are decoded here
without RedBeat itself. As for django-celery-beat, ``start_at`` continues each schedule after
its ``last_run_at``, so nothing runs twice at the switch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

from celery.schedules import crontab

from .importing import Incoming, Refused

DEFAULT_PREFIX = "redbeat:"


def _decode(d: dict[str, Any]) -> Any:
    """RedBeat's tagged JSON objects as plain values (a schedule stays a tagged dict)."""
    kind = d.get("__type__")
    if kind == "datetime":
        fields = {k: v for k, v in d.items() if k not in ("__type__", "timezone")}
        zone = d.get("timezone", "UTC")
        tz = timezone(timedelta(seconds=zone)) if isinstance(zone, int | float) else ZoneInfo(zone)
        return datetime(tzinfo=tz, **fields).astimezone(UTC)
    return d


def read_entries(url: str, prefix: str = DEFAULT_PREFIX) -> list[tuple[str, str | None, str | None]]:
    """``(key, definition, meta)`` of every entry the ``<prefix>:schedule`` set lists, by key."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = sorted(str(_text(k)) for k in client.zrange(f"{prefix}:schedule", 0, -1))
        out: list[tuple[str, str | None, str | None]] = []
        for key in keys:
            definition, meta = client.hmget(key, ["definition", "meta"])
            out.append((key, _text(definition), _text(meta)))
        return out
    finally:
        client.close()


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def map_entries(entries: list[tuple[str, str | None, str | None]], prefix: str) -> list[Incoming | Refused]:
    """Each RedBeat entry as a runtime schedule, or refused with the reason."""
    return [map_entry(key[len(prefix) :] if key.startswith(prefix) else key, d, m) for key, d, m in entries]


def map_entry(name: str, definition: str | None, meta: str | None) -> Incoming | Refused:
    """One entry's ``definition`` and ``meta`` JSON as a runtime schedule."""
    if not definition:
        return Refused(name=name, reason="has no definition (the key is listed but gone)")
    try:
        data = json.loads(definition, object_hook=_decode)
        last = json.loads(meta, object_hook=_decode).get("last_run_at") if meta else None
    except (ValueError, TypeError, KeyError) as exc:
        return Refused(name=name, reason=f"cannot be read ({exc})")
    name = str(data.get("name") or name)
    task = str(data.get("task") or "-")
    timing = data.get("schedule")
    if not isinstance(timing, Mapping):
        return Refused(name=name, task=task, reason=f"has no schedule RedBeat could run, got {timing!r}")
    try:
        schedule, step = _schedule(timing)
    except (ValueError, TypeError, KeyError) as exc:
        return Refused(name=name, task=task, reason=str(exc))
    policy: dict[str, Any] = {}
    if isinstance(last, datetime):
        policy["start_at"] = last + step
    return Incoming(
        name=name,
        task=task,
        schedule=schedule,
        args=list(data.get("args") or ()),
        kwargs=dict(data.get("kwargs") or {}),
        options=dict(data.get("options") or {}),
        policy=policy,
        paused=not data.get("enabled", True),
    )


def _schedule(timing: Mapping[str, Any]) -> tuple[Any, timedelta]:
    kind = timing.get("__type__")
    if kind == "interval":
        if timing.get("relative"):
            raise ValueError("a relative interval (rounded to the period) has no equivalent here")
        every = float(timing["every"])
        return every, timedelta(seconds=every)
    if kind == "crontab":
        fields = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
        return crontab(**{f: timing[f] for f in fields}), timedelta(microseconds=1)
    if kind == "rrule":
        raise ValueError("an rrule schedule has no equivalent here (use a crontab, or several)")
    raise ValueError(f"unknown schedule type {kind!r}")
