"""A schedule's definition as data: the row's JSON and back to a validated spec.

Schedules are data (docs/how-it-works.md): a row carries everything needed to rebuild its schedule, so a
beat can run schedules that no ``beat_schedule`` of its own mentions (runtime schedules added
by another process) and a change is one row away. The grid is stored as plain JSON:

- ``{"kind": "interval", "every": 30.0}``
- ``{"kind": "crontab", "minute": "*/15", "hour": "*", "day_of_week": "*",
  "day_of_month": "*", "month_of_year": "*", "timezone": "Europe/Berlin"}``
- ``{"kind": "solar", "event": "sunset", "lat": 52.5, "lon": 13.4, "timezone": "Europe/Berlin"}``
  (a solar event is an instant wherever it is read: its zone is only shown)

``timezone`` is the zone the schedule keeps wall-clock time in: the policy's ``timezone`` key
when it has one (then both say the same), else the app's ``timezone`` when it was defined.

Rebuilding goes through the same :func:`~celery_boundedbeat.config.entries.parse_entry` as a
``beat_schedule`` entry, so a stored definition is held to the same rules and error texts.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from datetime import datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery import Celery
from celery.schedules import crontab, schedule, solar

from ..core.exceptions import ConfigurationError
from ..core.policy import Problem
from ..core.spec import Definition, EntrySpec
from .cron import CRONTAB_FIELDS, build_crontab
from .entries import build_specs, configured_entries, parse_entry, zone_name

logger = logging.getLogger("celery_boundedbeat.beat")


def _cron_field(value: Any) -> Any:
    """A crontab field as JSON: strings and numbers as given, sets and ranges as sorted lists."""
    if isinstance(value, str | int):
        return value
    return sorted(int(v) for v in value)


def timing_json(value: Any, app: Celery, zone: tzinfo | str | None = None) -> dict[str, Any]:
    """The grid of an already validated Celery schedule value, as stored in ``timing``.

    ``zone`` is the calendar schedule's zone (a spec's ``timezone``; default the app's).
    """
    name = zone if isinstance(zone, str) else zone_name(zone or app.timezone)
    if isinstance(value, crontab):
        fields = {f: _cron_field(getattr(value, f"_orig_{f}")) for f in CRONTAB_FIELDS}
        return {"kind": "crontab", **fields, "timezone": name}
    if isinstance(value, solar):
        return {"kind": "solar", "event": value.event, "lat": value.lat, "lon": value.lon, "timezone": name}
    if isinstance(value, timedelta):
        return {"kind": "interval", "every": value.total_seconds()}
    if isinstance(value, schedule):
        return {"kind": "interval", "every": value.run_every.total_seconds()}
    return {"kind": "interval", "every": float(value)}


def schedule_value(name: str, data: Any, app: Celery) -> tuple[Any, tzinfo | None]:
    """The Celery schedule value a stored ``timing`` stands for, and its crontab time zone."""
    if not isinstance(data, Mapping):
        raise ConfigurationError([(name, "timing", f"must be a JSON object, got {data!r}")])
    kind = data.get("kind")
    try:
        if kind == "interval":
            return data["every"], None
        if kind == "crontab":
            zone = ZoneInfo(data["timezone"]) if data.get("timezone") else None
            return build_crontab(name, {f: data.get(f, "*") for f in CRONTAB_FIELDS}, app), zone
        if kind == "solar":
            zone = ZoneInfo(data["timezone"]) if data.get("timezone") else None
            return solar(data["event"], data["lat"], data["lon"], app=app), zone
    except (KeyError, ValueError, TypeError, ZoneInfoNotFoundError) as exc:
        raise ConfigurationError([(name, "timing", f"cannot be read back ({exc!r})")]) from None
    raise ConfigurationError([(name, "timing", f"unknown kind {kind!r} (interval, crontab, solar)")])


def define(
    name: str,
    raw: Mapping[str, Any],
    app: Celery,
    default_policy: Mapping[str, Any],
    *,
    zone: tzinfo | None = None,
) -> Definition:
    """Validate one entry exactly as beat does; raises :class:`ConfigurationError` naming each problem."""
    if isinstance(raw, Mapping) and isinstance(raw.get("schedule"), crontab):
        # As its row will read back (sets and ranges as lists): the schedule text and digest of
        # a runtime schedule must not change when an update rebuilds it from the row.
        raw = {**raw, "schedule": schedule_value(name, timing_json(raw["schedule"], app, zone), app)[0]}
    spec, problems = parse_entry(name, raw, default_policy, tz=zone)
    if problems or spec is None:
        raise ConfigurationError(problems)
    return Definition.of(spec, timing_json(raw["schedule"], app, spec.timezone))


def stored_entry(name: str, row: Any, app: Celery) -> tuple[dict[str, Any], tzinfo | None]:
    """A stored row as the ``beat_schedule``-style entry it was made from (policy fully merged)."""
    value, zone = schedule_value(name, row.timing, app)
    entry = {
        "task": row.task,
        "schedule": value,
        "args": list(row.args or ()),
        "kwargs": dict(row.kwargs or {}),
        "options": dict(row.options or {}),
        "policy": dict(row.policy or {}),
    }
    return entry, zone


def from_row(row: Any, app: Celery) -> Definition:
    """Rebuild a schedule from its row alone (beat's view of a schedule it has no entry for)."""
    if row.timing is None:
        problems: list[Problem] = [
            (row.name, "timing", "is not stored (written by an older release; its beat reconciles it)")
        ]
        raise ConfigurationError(problems)
    entry, zone = stored_entry(row.name, row, app)
    return define(row.name, entry, app, {}, zone=zone)


def config_definitions(app: Celery, default_policy: Mapping[str, Any]) -> dict[str, Definition]:
    """Every ``beat_schedule`` entry, validated as beat does (:func:`~.entries.build_specs`), as data."""
    specs = build_specs(app, default_policy)
    raw = {str(name): entry for name, entry in configured_entries(app).items()}
    return {
        name: Definition.of(spec, timing_json(raw[name]["schedule"], app, spec.timezone))
        for name, spec in specs.items()
    }


#: The growth of a beat's definition cache that makes it sweep: at least this many entries...
SWEEP_SLACK = 1000


def sweep_slack(live: int) -> int:
    """...or a tenth of the cached schedules still present at the last sweep, so that sweeping
    (a read of the cached names) stays a small cost per schedule cached, however many there are."""
    return max(SWEEP_SLACK, live // 10)


class Resolver:
    """Beat's view of the schedules: each due row's spec, rebuilt only when its row changed.

    The cache is keyed by the row's ``version`` and digest, so a change made by any process is seen at
    the row's next tick whether or not a notification arrived; notifications only wake the
    beat sooner and let it drop a removed schedule's copy. The copies of schedules removed
    without one are dropped by the beat's sweeps (:meth:`keep_only`). A config row this beat reconciled
    (same digest) uses the beat's own entry, which keeps any schedule object Celery accepts
    (a custom ``schedule`` subclass) exactly as configured.
    """

    def __init__(self, app: Celery, config: Mapping[str, Definition]) -> None:
        self._app = app
        self._config = config
        self._cache: dict[str, tuple[tuple[int, str], EntrySpec | None]] = {}
        #: Schedules whose stored definition could not be rebuilt (logged once per version).
        self.unusable: dict[str, str] = {}

    def __call__(self, row: Any) -> EntrySpec | None:
        # The digest too: a schedule removed and added again starts over at version 1.
        key = (row.version, row.config_hash)
        cached = self._cache.get(row.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        spec = self._build(row)
        self._cache[row.name] = (key, spec)
        return spec

    def needs_definition(self, row: Any) -> bool:
        """Whether resolving ``row`` reads its stored definition (it is rebuilt from it)."""
        cached = self._cache.get(row.name)
        if cached is not None and cached[0] == (row.version, row.config_hash):
            return False
        own = self._config.get(row.name)
        return not (own is not None and row.origin == "config" and row.config_hash == own.digest)

    def _build(self, row: Any) -> EntrySpec | None:
        own = self._config.get(row.name)
        if own is not None and row.origin == "config" and row.config_hash == own.digest:
            return own.spec
        try:
            spec = from_row(row, self._app).spec
        except ConfigurationError as exc:
            self.unusable[row.name] = str(exc)
            logger.error("celery_boundedbeat: schedule %r is not run: %s", row.name, exc)
            return None
        self.unusable.pop(row.name, None)
        return spec

    def forget(self, name: str) -> None:
        """Drop a schedule's cached copy (it was changed or removed)."""
        self._cache.pop(name, None)

    #: How far ahead a beat keeps the definitions of the schedules it ticked: those due later
    #: are rebuilt from their rows when due (once per period for an hourly schedule), so a
    #: million hourly schedules do not all stay in memory; those due sooner stay cached.
    KEEP_DUE_WITHIN = timedelta(minutes=5)

    def forget_not_due_before(self, due: Mapping[str, datetime | None], horizon: datetime) -> int:
        """Drop the copies of the schedules in ``due`` (name: next due time) not due before
        ``horizon``: a beat keeps in memory what comes due soon, not every schedule it ever
        ticked. A schedule dropped is rebuilt from its row when it is next due. How many.
        """
        gone = [name for name, at in due.items() if at is None or at >= horizon]
        for name in gone:
            self._cache.pop(name, None)
        return len(gone)

    def keep_only(self, names: Collection[str]) -> int:
        """Drop the copies of every schedule not in ``names`` (the schedules that exist); how many.

        A copy resolved meanwhile for a schedule added after ``names`` was read is dropped too,
        and only rebuilt at its next tick.
        """
        gone = [name for name in list(self._cache) if name not in names]
        for name in gone:
            self._cache.pop(name, None)
        for name in [name for name in list(self.unusable) if name not in names]:
            self.unusable.pop(name, None)
        return len(gone)

    def __len__(self) -> int:
        return len(self._cache)

    def names(self) -> set[str]:
        """The schedules this resolver holds anything of: a cached copy, or a failure to build one."""
        return set(self._cache) | set(self.unusable)
