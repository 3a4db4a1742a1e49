"""Turn ``beat_schedule`` entries into validated :class:`EntrySpec` values.

Every entry is checked before anything is emitted; all problems are collected so one
failed start shows the user everything to fix.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta, tzinfo
from functools import partial
from typing import Any
from zoneinfo import ZoneInfo

from celery import Celery
from celery.schedules import crontab, schedule, solar

from ..core.exceptions import ConfigurationError
from ..core.limits import MAX_SCHEDULE_NAME, MAX_SCHEDULE_TEXT, MAX_TASK_NAME, text_problem
from ..core.policy import Policy, Problem, parse_policy
from ..core.spec import EntrySpec
from ..core.timing import CalendarTiming, IntervalTiming, Timing
from ..core.wallclock import CronFields, next_fire

logger = logging.getLogger("celery_boundedbeat.beat")

#: Keys a ``beat_schedule`` entry may carry (Celery's own, plus ``policy``).
ENTRY_KEYS = frozenset({"task", "schedule", "args", "kwargs", "options", "relative", "policy"})


def _crontab_next(cron: crontab, tz: tzinfo | None = None) -> Callable[[datetime], datetime]:
    """The crontab's next fire time in ``tz`` (default its app's), DST by Vixie cron's rule."""
    zone = tz or cron.tz
    fields = CronFields.of(
        minutes=cron.minute,
        hours=cron.hour,
        days_of_month=cron.day_of_month,
        months=cron.month_of_year,
        days_of_week=cron.day_of_week,
        hour_field=cron._orig_hour,
    )
    return partial(next_fire, fields, zone)


#: Celery's own bound on how far a solar event is looked for (polar days and nights).
SOLAR_SEARCH_DAYS = 366


def _solar_next(sol: solar) -> Callable[[datetime], datetime]:
    """The first solar event strictly after the time asked about, whatever the wall clock says.

    ``solar.remaining_estimate`` measures from ``now()``; here the event is asked of ephem from
    the given time on, with a copy of the observer (the schedule's own is shared). ephem's next
    transit started at a transit is that transit again, so the search restarts just after it.
    """
    ephem = sol.ephem
    sun = ephem.Sun()
    extra = {"use_center": True} if sol.use_center else {}

    def next_after(t: datetime) -> datetime:
        cal = sol.cal.copy()
        start = ephem.Date(t.astimezone(UTC).replace(tzinfo=None))
        for _ in range(SOLAR_SEARCH_DAYS):
            try:
                found = getattr(cal, sol.method)(sun, start=start, **extra)
            except ephem.CircumpolarError:
                start = cal.next_antitransit(sun, start=start)
                continue
            event: datetime = found.datetime().replace(tzinfo=UTC)
            if event > t:
                return event
            start = ephem.Date(found + ephem.second)
        stop: datetime = start.datetime().replace(tzinfo=UTC)
        return stop  # nothing within a year: look again then

    return next_after


def timing_for(
    entry: str, value: Any, tz: tzinfo | None = None
) -> tuple[Timing | None, str, str, float | None, list[Problem]]:
    """The grid of a Celery schedule value: (timing, kind, repr, period seconds, problems).

    ``tz`` is the zone a crontab keeps wall-clock time in (default: the app's ``timezone``).
    """
    if isinstance(value, bool):
        return (
            None,
            "",
            "",
            None,
            [(entry, "schedule", f"must be seconds, a timedelta, crontab or solar, got {value!r}")],
        )
    period: float | None = None
    if isinstance(value, int | float):
        period = float(value)
    elif isinstance(value, timedelta):
        period = value.total_seconds()
    elif isinstance(value, crontab):
        return CalendarTiming(_crontab_next(value, tz)), "crontab", repr(value), None, []
    elif isinstance(value, solar):
        return CalendarTiming(_solar_next(value)), "solar", repr(value), None, []
    elif isinstance(value, schedule):
        period = value.run_every.total_seconds()
    else:
        return (
            None,
            "",
            "",
            None,
            [
                (
                    entry,
                    "schedule",
                    f"must be seconds, a timedelta, crontab or solar, got {type(value).__name__}",
                )
            ],
        )
    if not period or period <= 0 or period != period:
        return None, "", "", None, [(entry, "schedule", f"period must be > 0 seconds, got {value!r}")]
    return IntervalTiming(period), "interval", f"every {period:g}s", period, []


def zone_name(zone: tzinfo) -> str | None:
    """The IANA name of a zone object (``ZoneInfo``, pytz), as stored and shown."""
    key = getattr(zone, "key", None) or getattr(zone, "zone", None)
    if key:
        return str(key)
    return "UTC" if zone is UTC else None


def _zoned(value: Any, timing: Timing, policy: Policy, tz: tzinfo | None) -> tuple[Timing, str | None]:
    """A calendar grid in its zone: the policy's ``timezone`` wins over the zone the schedule was
    stored with (``tz``), which wins over the app's ``timezone``; an interval has none."""
    if not isinstance(value, crontab | solar):
        return timing, None
    if policy.timezone is None:
        return timing, zone_name(tz or value.tz)
    zone = ZoneInfo(policy.timezone)
    if isinstance(value, crontab):
        timing = CalendarTiming(_crontab_next(value, zone))
    return timing, policy.timezone  # a solar event is an instant: the zone is only shown


def _json_problem(entry: str, key: str, value: Any) -> Problem | None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        return (entry, key, f"must be JSON-serializable to be stored in the queue ({exc})")
    return None


def entry_label(name: str) -> str:
    """How a problem names an entry: an over-long name is cut, so the message stays readable."""
    return name if len(name) <= MAX_SCHEDULE_NAME else name[:40] + "..."


def name_problems(name: Any) -> list[Problem]:
    """A schedule name's problems: the one check of names for config, API, CLI and admin."""
    if not isinstance(name, str) or not name.strip():
        return [(repr(name), "name", "must be a non-empty string")]
    reason = text_problem(name, MAX_SCHEDULE_NAME)
    return [] if reason is None else [(entry_label(name), "name", reason)]


def _task_problems(name: str, task: Any) -> list[Problem]:
    if not isinstance(task, str) or not task:
        return [(name, "task", f"must be a task name string, got {task!r}")]
    reason = text_problem(task, MAX_TASK_NAME)
    return [] if reason is None else [(name, "task", reason)]


def _entry_timing(
    name: str, raw: Mapping[str, Any], tz: tzinfo | None
) -> tuple[Timing | None, str, str, float | None, list[Problem]]:
    """:func:`timing_for` of the entry's ``schedule``, whose text must also fit its column."""
    if "schedule" not in raw:
        return None, "interval", "", None, [(name, "schedule", "is required")]
    timing, kind, srepr, period, found = timing_for(name, raw["schedule"], tz)
    reason = text_problem(srepr, MAX_SCHEDULE_TEXT)
    if reason is not None:
        found = [*found, (name, "schedule", f"its text {reason}")]
    return timing, kind, srepr, period, found


def parse_entry(
    name: str, raw: Any, default_policy: Mapping[str, Any], *, tz: tzinfo | None = None
) -> tuple[EntrySpec | None, list[Problem]]:
    """Validate one entry; returns the spec or every problem found in it."""
    named = name_problems(name)
    name = entry_label(name)  # every later problem names the entry readably
    if not isinstance(raw, Mapping):
        return None, [*named, (name, "entry", f"must be a dict, got {type(raw).__name__}")]
    problems: list[Problem] = list(named)
    for key in sorted(set(raw) - ENTRY_KEYS):
        problems.append((name, key, f"unknown entry key (known: {', '.join(sorted(ENTRY_KEYS))})"))
    task = raw.get("task")
    problems.extend(_task_problems(name, task))
    timing, kind, srepr, period, found = _entry_timing(name, raw, tz)
    problems.extend(found)
    # None means "not given"; any other value must have the right type (0 or "" is not empty).
    args = () if raw.get("args") is None else raw["args"]
    if not isinstance(args, list | tuple):
        problems.append((name, "args", f"must be a list or tuple, got {type(args).__name__}"))
        args = ()
    kwargs = {} if raw.get("kwargs") is None else raw["kwargs"]
    if not isinstance(kwargs, Mapping):
        problems.append((name, "kwargs", f"must be a dict, got {type(kwargs).__name__}"))
        kwargs = {}
    raw_options = {} if raw.get("options") is None else raw["options"]
    if not isinstance(raw_options, Mapping):
        problems.append((name, "options", f"must be a dict, got {type(raw_options).__name__}"))
        raw_options = {}
    options = dict(raw_options)
    raw_policy = raw.get("policy")
    if raw_policy is None and "policy" in options:
        raw_policy = options.pop("policy")  # app.add_periodic_task(..., policy={...})
    for key, value in (("args", list(args)), ("kwargs", dict(kwargs)), ("options", options)):
        problem = _json_problem(name, key, value)
        if problem:
            problems.append(problem)
    policy, found = parse_policy(name, raw_policy, default_policy, schedule_kind=kind or "interval")
    problems.extend(found)
    if problems or policy is None or timing is None or not isinstance(task, str):
        return None, problems
    timing, zone = _zoned(raw["schedule"], timing, policy, tz)
    return (
        EntrySpec(
            name=name,
            task=task,
            policy=policy,
            timing=timing,
            schedule_repr=srepr,
            period=period,
            args=tuple(args),
            kwargs=dict(kwargs),
            options=options,
            timezone=zone,
        ),
        [],
    )


def celery_default_entries(app: Celery) -> dict[str, Any]:
    """The entries stock beat adds on its own (``celery.beat.Scheduler.install_default_entries``).

    ``celery.backend_cleanup`` purges expired results from backends that cannot expire them
    themselves (the database backend, django-celery-results); without it their tables grow.
    Added only when a result backend is configured and the user has no entry of that name.
    """
    conf = app.conf
    if not (conf.result_expires and conf.result_backend) or app.backend.supports_autoexpire:
        return {}
    return {
        "celery.backend_cleanup": {
            "task": "celery.backend_cleanup",
            "schedule": crontab("0", "4", "*"),
            "options": {"expires": 12 * 3600},
        }
    }


def configured_entries(app: Celery) -> dict[str, Any]:
    """The raw ``beat_schedule`` entries, Celery's own defaults included (config schedules)."""
    return {**celery_default_entries(app), **(app.conf.beat_schedule or {})}


def build_specs(app: Celery, default_policy: Mapping[str, Any]) -> dict[str, EntrySpec]:
    """Every configured entry, validated; raises :class:`ConfigurationError` listing all problems."""
    entries = configured_entries(app)
    specs = validate_entries(entries, default_policy)
    relative = sorted(name for name, raw in entries.items() if raw.get("relative"))
    if relative:
        logger.warning(
            "celery_boundedbeat: 'relative' is ignored (ticks stay on the schedule's own grid) for: %s",
            ", ".join(relative),
        )
    return specs


def validate_entries(entries: Mapping[Any, Any], default_policy: Mapping[str, Any]) -> dict[str, EntrySpec]:
    """``beat_schedule``-style entries, validated as beat validates them; raises listing all problems.

    One owner of beat's rules, shared by beat, ``boundedbeat check`` and ``testing.simulate``,
    so a simulated entry is refused with the very texts beat would log.
    """
    problems: list[Problem] = []
    _, default_problems = parse_policy("boundedbeat_default_policy", {}, default_policy)
    problems.extend(default_problems)
    # A broken default is reported once, against the setting, not blamed on every entry.
    usable_default = {} if default_problems else default_policy
    specs: dict[str, EntrySpec] = {}
    for name, raw in entries.items():
        spec, found = parse_entry(str(name), raw, usable_default)
        problems.extend(found)
        if spec is not None:
            specs[spec.name] = spec
    if problems:
        raise ConfigurationError(problems)
    return specs
