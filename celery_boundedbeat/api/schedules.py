"""Runtime schedules: add, change, remove and backfill schedules from any process (docs/runtime-schedules.md).

A schedule per tenant, per feed, per customer, made by application code (a Django view, a
worker task, a script) while beat runs, or with no beat running at all. Each call is one
transaction, validated exactly like a ``beat_schedule`` entry (same :class:`ConfigurationError`
texts), and a running beat applies it within about a second: it is woken by NOTIFY on
PostgreSQL and looks every ``boundedbeat_poll_interval`` on SQLite, and it rebuilds only the
schedules whose row changed.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

from celery import Celery

from ..config.definitions import define, from_row, stored_entry
from ..config.entries import name_problems
from ..config.settings import Settings
from ..core.backfill import Backfilled, BackfillRefused, as_utc, range_refusal
from ..core.exceptions import BackfillRefusedError, ConfigurationError, UnknownScheduleError
from ..core.limits import MAX_SCHEDULE_NAME
from ..core.spec import Definition
from ..db.engine import get_engine
from ..db.store import Store, utcnow
from ..db.tables import ScheduleRow
from .unmigrated import explains_missing_tables

logger = logging.getLogger("celery_boundedbeat")

#: The longest schedule name the tables keep (from :mod:`.schema`).
MAX_NAME_LENGTH = MAX_SCHEDULE_NAME

AddOutcome = Literal["scheduled", "already_present"]


class _Unset:
    """Marks an ``update_schedule`` field that was not given (``None`` is a value there)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()


#: The settings a runtime API call reads (each one read costs microseconds in Celery's conf).
_API_SETTINGS = ("database_url", "default_policy")


def _context(app: Celery) -> tuple[Settings, Store]:
    settings = Settings.from_conf(app.conf, only=_API_SETTINGS)
    return settings, Store(get_engine(settings.database_url))


def _check_name(name: Any) -> str:
    problems = name_problems(name)
    if problems:
        raise ConfigurationError(problems)
    return str(name)


def _entry(task: Any, schedule: Any, args: Any, kwargs: Any, options: Any, policy: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"task": task, "schedule": schedule, "args": args}
    entry["kwargs"] = {} if kwargs is None else kwargs
    entry["options"] = {} if options is None else options
    if policy is not None:
        entry["policy"] = policy
    return entry


@explains_missing_tables
def add_schedule(
    app: Celery,
    name: str,
    task: str,
    schedule: Any,
    *,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    policy: Mapping[str, Any] | None = None,
) -> AddOutcome:
    """Add a runtime schedule; ``"already_present"`` leaves an existing one of that name untouched.

    ``schedule`` is what a ``beat_schedule`` entry takes (seconds, a timedelta, a crontab or a
    solar); ``policy`` is merged over ``boundedbeat_default_policy``. Input is validated before
    the name is looked up, so bad input is always an error, duplicate or not.
    """
    settings, store = _context(app)
    d = define(
        _check_name(name), _entry(task, schedule, args, kwargs, options, policy), app, settings.default_policy
    )
    added = store.add_schedule(d, utcnow(), random.Random())
    return "scheduled" if added else "already_present"


@explains_missing_tables
def update_schedule(
    app: Celery,
    name: str,
    *,
    task: Any = UNSET,
    schedule: Any = UNSET,
    args: Any = UNSET,
    kwargs: Any = UNSET,
    options: Any = UNSET,
    policy: Any = UNSET,
) -> None:
    """Change the given fields of a runtime schedule; the others, its counters and history stay.

    ``policy`` keys are merged over the schedule's current policy (give ``None`` for a key to
    drop it back to its default). A new timing applies from the change on: no tick before the
    change is emitted for it. Raises :class:`UnknownScheduleError` for an unknown name and
    :class:`ConfigurationError` for invalid input or a config schedule (change the config).
    """
    given = {"task": task, "schedule": schedule, "args": args, "kwargs": kwargs, "options": options}
    changes = {key: value for key, value in given.items() if value is not UNSET}
    new_policy: Mapping[str, Any] | None = None
    if not isinstance(policy, _Unset) and policy is not None:
        if not isinstance(policy, Mapping):
            raise ConfigurationError([(name, "policy", f"must be a dict, got {type(policy).__name__}")])
        new_policy = policy
    _, store = _context(app)

    def revise(row: ScheduleRow) -> Definition:
        entry, zone = stored_entry(name, row, app)
        if "schedule" in changes or (new_policy is not None and "timezone" in new_policy):
            # A new crontab, or a changed or dropped policy zone: the policy's ``timezone`` if
            # it has one, else the app's, as a new schedule would.
            zone = None
        entry.update(changes)
        if new_policy is not None:
            entry["policy"] = {**entry["policy"], **new_policy}
        return define(name, entry, app, {}, zone=zone)

    store.update_schedule(_check_name(name), revise, utcnow(), random.Random())


@explains_missing_tables
def remove_schedule(app: Celery, name: str, *, revoke_active: bool = False) -> bool:
    """Remove a runtime schedule (its run history stays); False when there is none of that name.

    With ``revoke_active`` its active runs settle ``revoked`` and the workers are asked to
    terminate them (``app.control.revoke(..., terminate=True)``; the threads and solo pools
    cannot terminate a running task, which then finishes but stays ``revoked``). Without it,
    runs already emitted go on and are recorded as usual. :func:`remove_schedule_revoking`
    does the same and says which runs it revoked.
    """
    return remove_schedule_revoking(app, name, revoke_active=revoke_active) is not None


def remove_schedule_revoking(
    app: Celery, name: str, *, revoke_active: bool = False
) -> tuple[str, ...] | None:
    """:func:`remove_schedule`, returning the ids of the runs it revoked (empty without
    ``revoke_active`` or when none was active), or ``None`` when there is no schedule of that name."""
    _, store = _context(app)
    revoked = store.remove_schedule(_check_name(name), utcnow(), revoke_active=revoke_active)
    if revoked is None:
        return None
    if revoked:
        logger.info("celery_boundedbeat: removed %s and revoked %s", name, plural_runs(len(revoked)))
        try:
            app.control.revoke(revoked, terminate=True)
        except Exception as exc:  # the rows are settled; only the workers' copy is left running
            logger.warning(
                "celery_boundedbeat: removed %s and settled %s revoked, but could not ask the "
                "workers to terminate them (%s: %s)",
                name,
                plural_runs(len(revoked)),
                type(exc).__name__,
                exc,
            )
    return tuple(revoked)


def plural_runs(n: int) -> str:
    """``1 run``, ``2 runs``: how the removal messages count revoked runs."""
    return f"{n} run" if n == 1 else f"{n} runs"


@dataclass(frozen=True, kw_only=True, slots=True)
class BackfillResult:
    """What one ``backfill`` call queued; the runs start as the schedule's slots free."""

    name: str
    #: Grid times queued now, oldest first (each becomes a run whose ``scheduled_for`` it is).
    queued: tuple[datetime, ...]
    #: Grid times in the range that already had a run (never emitted twice).
    had_runs: int
    #: Grid times in the range already waiting (an earlier backfill, a pending tick, a trigger).
    waiting: int

    def describe(self) -> str:
        """One line for people: ``backfill NAME: 12 grid times queued, 3 already had runs``."""
        line = f"backfill {self.name}: {_times(len(self.queued))} queued, {self.had_runs} already had runs"
        if self.waiting:
            line += f", {self.waiting} already waiting"
        if self.queued:
            line += f" (first {self.queued[0].isoformat()}, last {self.queued[-1].isoformat()})"
        return line


def _times(n: int) -> str:
    return f"{n} grid time" if n == 1 else f"{n} grid times"


@explains_missing_tables
def backfill(app: Celery, name: str, start: datetime | str, end: datetime | str) -> BackfillResult:
    """Queue the schedule's grid times in ``[start, end]`` that have no run yet (Temporal's backfill).

    A running beat starts them oldest first as slots free, under the policy's concurrency
    bound, at most :data:`~celery_boundedbeat.core.ticks.BACKFILL_PER_TICK` per tick; they keep the
    grid time as ``scheduled_for`` and do not count toward ``max_runs``. ``start`` and ``end``
    are datetimes or ISO 8601 strings (naive ones are UTC); the range is in the past and holds
    at most :data:`~celery_boundedbeat.core.backfill.BACKFILL_CAP` grid times. Raises
    :class:`UnknownScheduleError`, :class:`ConfigurationError` (a bad range) or
    :class:`BackfillRefusedError` (paused, stopped, ended, ``fixed_delay``, too many waiting).
    """
    _check_name(name)
    bounds = {key: as_utc(value, key) for key, value in (("start", start), ("end", end))}
    bad = [(name, key, v.reason) for key, v in bounds.items() if isinstance(v, BackfillRefused)]
    if bad:
        raise ConfigurationError(bad)
    first, last = bounds["start"], bounds["end"]
    assert isinstance(first, datetime) and isinstance(last, datetime)
    now = utcnow()
    refused = range_refusal(first, last, now)
    if refused is None:
        _, store = _context(app)
        decided = store.backfill(name, first, last, now, lambda row: from_row(row, app).spec)
        if decided is None:
            raise UnknownScheduleError(name)
        if isinstance(decided, Backfilled):
            return BackfillResult(
                name=name, queued=decided.queued, had_runs=decided.had_runs, waiting=decided.waiting
            )
        refused = decided
    if refused.key is not None:
        raise ConfigurationError([(name, refused.key, refused.reason)])
    raise BackfillRefusedError(name, refused.reason)
