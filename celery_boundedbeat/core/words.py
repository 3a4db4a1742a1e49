"""Schedules, durations and times in words, for the admin's pages and the CLI's tables.

Pure: the stored ``timing`` JSON (see :func:`celery_boundedbeat.config.definitions.timing_json`) and
numbers in, short text out. A timing it cannot put in words falls back to the cron fields as
written, so no schedule is ever shown wrongly, only less prettily.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, tzinfo
from typing import Any

DAY_NAMES = ("Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat")
MONTH_NAMES = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_NUMBER = re.compile(r"\d+")
_STEP = re.compile(r"\*/(\d+)")


def format_ms(ms: float | None) -> str:
    """``850 ms``, ``12.3 s``, ``4.1 min``, ``2.0 h``: a duration read at a glance."""
    if ms is None:
        return "—"
    if abs(ms) < 1000:
        return f"{ms:.0f} ms"
    if abs(ms) < 60_000:
        return f"{ms / 1000:.1f} s"
    if abs(ms) < 3_600_000:
        return f"{ms / 60_000:.1f} min"
    return f"{ms / 3_600_000:.1f} h"


def format_when(value: datetime | None, zone: tzinfo, *, short: bool = False) -> str:
    """``2026-12-01 06:00:05``: always with seconds, since schedules tick every few seconds.

    ``short`` drops the year (``12-01 06:00:05``), for list cells that must stay on one line.
    """
    if value is None:
        return "—"
    return value.astimezone(zone).strftime("%m-%d %H:%M:%S" if short else "%Y-%m-%d %H:%M:%S")


def plural(n: int, word: str) -> str:
    """``1 overlap``, ``2 overlaps``, ``0 overlaps``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def every(seconds: float) -> str:
    """``every 5 s``, ``every 15 min``, ``every 2 h``."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"every {seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"every {seconds / 60:g} min"
    return f"every {seconds:g} s"


def describe_timing(timing: Mapping[str, Any] | None, period: float | None, schedule: str) -> str:
    """A schedule in words; ``schedule`` (the stored text) when the timing is unknown."""
    kind = (timing or {}).get("kind")
    if kind == "interval" and isinstance(timing, Mapping):
        return every(float(timing["every"]))
    if kind == "crontab" and isinstance(timing, Mapping):
        return describe_crontab(timing)
    if kind == "solar" and isinstance(timing, Mapping):
        return f"at {timing.get('event')} ({timing.get('lat')}, {timing.get('lon')})"
    if period is not None:
        return every(period)
    return schedule


def _field(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value).strip().replace(" ", "")


def describe_crontab(timing: Mapping[str, Any]) -> str:
    """``at 02:30 every day``, ``every 15 min on Mon-Fri``, or the raw fields in cron order."""
    names = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    minute, hour, dom, month, dow = (_field(timing.get(name, "*")) for name in names)
    zone = timing.get("timezone")
    suffix = f" ({zone})" if zone else ""
    when = _time_of_day(minute, hour)
    days = _days(dom, month, dow)
    if when is None or days is None:
        return f"cron {minute} {hour} {dom} {month} {dow}{suffix}"
    return f"{when}{days}{suffix}"


def _time_of_day(minute: str, hour: str) -> str | None:
    """The minute and hour fields in words, or ``None`` when they are too irregular to say."""
    step = _STEP.fullmatch(minute)
    if hour == "*":
        if minute == "*":
            return "every minute"
        if step:
            return every(int(step.group(1)) * 60)
        if minute.isdigit():
            return f"every hour at :{int(minute):02d}"
        return None
    hours = _numbers(hour)
    minutes = _numbers(minute)
    if hours is not None and minutes is not None and len(hours) * len(minutes) <= 4:
        return "at " + ", ".join(f"{h:02d}:{m:02d}" for h in hours for m in minutes)
    hour_step = _STEP.fullmatch(hour)
    if hour_step and minute.isdigit():
        return f"{every(int(hour_step.group(1)) * 3600)} at :{int(minute):02d}"
    return None


def _numbers(field: str) -> list[int] | None:
    """``"0,30"`` -> ``[0, 30]``; ``None`` for anything but a plain list of numbers."""
    parts = field.split(",")
    if all(_NUMBER.fullmatch(p) for p in parts):
        return sorted(int(p) for p in parts)
    return None


def _days(dom: str, month: str, dow: str) -> str | None:
    """The day fields in words (``" every day"``, ``" on Mon-Fri"``), or ``None``."""
    text = ""
    if dow != "*":
        named = _named(dow, DAY_NAMES, base=0)
        if named is None:
            return None
        text += f" on {named}"
    if dom != "*":
        if not re.fullmatch(r"[\d,\-]+", dom):
            return None
        text += f" on day {dom} of the month"
    if month != "*":
        named = _named(month, MONTH_NAMES, base=1)
        if named is None:
            return None
        text += f" in {named}"
    return text or " every day"


def _named(field: str, names: tuple[str, ...], *, base: int) -> str | None:
    """``"1-5"`` -> ``"Mon-Fri"``, ``"0,6"`` -> ``"Sun, Sat"``; names as written pass through."""
    out = []
    for part in field.split(","):
        ends = part.split("-")
        if len(ends) > 2:
            return None
        words = []
        for end in ends:
            if end.isdigit():
                index = (int(end) - base) % len(names) if base == 0 else int(end) - base
                if not 0 <= index < len(names):
                    return None
                words.append(names[index])
            elif end.isalpha():
                words.append(end.capitalize())
            else:
                return None
        out.append("-".join(words))
    return ", ".join(out)
