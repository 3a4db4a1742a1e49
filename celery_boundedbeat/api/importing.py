"""Importing schedules: a plan first (one line per schedule), then applying it (docs/migrating.md).

Every source (django-celery-beat's tables, RedBeat's Redis keys, a file written by
``boundedbeat export``) is read into :class:`Incoming` values, or :class:`Refused` ones naming
why a schedule cannot be mapped. :func:`plan_import` compares them with the runtime schedules
stored and decides one action per schedule without changing anything (the dry run);
:func:`apply_import` carries the plan out through the store's own add, update, pause and
remove, so an import is validated and versioned exactly like ``add_schedule``. A second import
of the same source finds every schedule ``already_present`` and changes nothing.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import tzinfo
from enum import StrEnum
from typing import Any

from celery import Celery

from ..config.definitions import define
from ..config.settings import Settings
from ..core.enums import StopReason
from ..core.exceptions import BoundedBeatError, ConfigurationError, UnknownScheduleError
from ..core.policy import Policy
from ..core.spec import Definition
from ..db.engine import get_engine
from ..db.row_state import RUNTIME
from ..db.store import Store, utcnow
from ..db.tables import ScheduleRow

#: Names Celery itself puts in ``beat_schedule``; other schedulers copy them into their store.
CELERY_OWN = frozenset({"celery.backend_cleanup"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Incoming:
    """One schedule as a source defines it, as the ``beat_schedule``-style entry it maps to."""

    name: str
    task: str
    #: A number of seconds, a timedelta, a crontab or a solar (what an entry's ``schedule`` takes).
    schedule: Any
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    policy: Mapping[str, Any] = field(default_factory=dict)
    paused: bool = False
    #: Stopped or ended as exported (a file only; other sources never say).
    stop_reason: StopReason | None = None
    #: The zone a calendar schedule was stored with (a file's ``timing``), when its policy has none.
    zone: tzinfo | None = None
    #: Whether ``boundedbeat_default_policy`` applies (not to a file: its policies are complete).
    merge_default: bool = True
    #: How the source names the timing, when ours reads differently (a clocked time).
    shown: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Refused:
    """A schedule of the source that cannot be mapped, and why."""

    name: str
    reason: str
    task: str = "-"


class Action(StrEnum):
    """What an import does to one schedule (the table's ACTION column)."""

    #: New here: added (``--apply``).
    ADD = "add"
    #: Stored, but different: changed to what the source says.
    UPDATE = "update"
    #: Stored exactly as the source says: nothing to do.
    ALREADY_PRESENT = "already_present"
    #: A runtime schedule the file lacks, removed with ``--prune``.
    REMOVE = "remove"
    #: Cannot be mapped (the line says why); nothing is done to it.
    REFUSED = "refused"
    #: Defined in this app's ``beat_schedule``: left to it (beat reconciles config entries).
    CONFIG = "left_to_beat_schedule"


@dataclass(frozen=True, kw_only=True, slots=True)
class Line:
    """One schedule of a plan: what it is and what the import does (or did) to it."""

    name: str
    task: str
    schedule: str
    flags: str
    action: Action
    reason: str = ""
    definition: Definition | None = None
    incoming: Incoming | None = None
    #: After :func:`apply_import`: whether the action was carried out.
    done: bool = False

    def row(self) -> list[str]:
        """The table row: name, task, schedule, policy/flags, action (with the reason, if any)."""
        action = self.action.value
        if self.done and self.action in _PAST:
            action = _PAST[self.action]
        if self.reason:
            action = f"{action}: {self.reason}"
        return [self.name, self.task, self.schedule, self.flags or "-", action]


_PAST = {Action.ADD: "added", Action.UPDATE: "updated", Action.REMOVE: "removed"}


@dataclass(frozen=True, slots=True)
class Plan:
    """Every schedule of an import, in the source's order (removals last)."""

    lines: tuple[Line, ...]

    @property
    def refused(self) -> list[Line]:
        return [line for line in self.lines if line.action is Action.REFUSED]

    @property
    def changes(self) -> list[Line]:
        return [line for line in self.lines if line.action in _PAST]

    def table(self) -> str:
        """One line per schedule under the headers, columns aligned (the command's output)."""
        rows = [HEADERS, *(line.row() for line in self.lines)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
        text = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        text.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(text)

    def summary(self, *, applied: bool) -> str:
        """The last line: how many schedules each action touched, and whether anything changed."""
        counts: dict[str, int] = {}
        for line in self.lines:
            label = line.row()[4].split(":")[0]
            counts[label] = counts.get(label, 0) + 1
        told = ", ".join(f"{n} {label}" for label, n in counts.items()) or "no schedules"
        if not self.changes:
            return f"{told}: nothing to change"
        return told if applied else f"{told}: dry run, nothing changed (give --apply to apply)"


HEADERS = ["NAME", "TASK", "SCHEDULE", "POLICY/FLAGS", "ACTION"]

_DEFAULT_POLICY = Policy().to_json()


def _flags(d: Definition, paused: bool, stop_reason: StopReason | None) -> str:
    """The policy keys that differ from the defaults, and the paused and stopped flags."""
    shown = [f"{k}={v}" for k, v in d.spec.policy.to_json().items() if v != _DEFAULT_POLICY.get(k)]
    if paused:
        shown.insert(0, "paused")
    if stop_reason is not None:
        shown.insert(0, f"stopped({stop_reason.value})")
    return ", ".join(shown)


def _define(app: Celery, item: Incoming, default_policy: Mapping[str, Any]) -> Definition | str:
    entry = {
        "task": item.task,
        "schedule": item.schedule,
        "args": list(item.args),
        "kwargs": dict(item.kwargs),
        "options": dict(item.options),
        "policy": dict(item.policy),
    }
    try:
        return define(item.name, entry, app, default_policy if item.merge_default else {}, zone=item.zone)
    except ConfigurationError as exc:
        return "; ".join(f"{key}: {reason}" for _, key, reason in exc.problems)


def _differs(row: ScheduleRow, d: Definition, item: Incoming, *, with_state: bool) -> bool:
    if row.config_hash != d.digest or row.timing != d.timing or bool(row.paused) != item.paused:
        return True
    return with_state and row.stop_reason != (None if item.stop_reason is None else item.stop_reason.value)


def _config_names(app: Celery) -> frozenset[str]:
    return frozenset(app.conf.beat_schedule or {}) | CELERY_OWN


def plan_import(
    app: Celery,
    items: Iterable[Incoming | Refused],
    *,
    prune: bool = False,
    with_state: bool = False,
    leave_config: bool = True,
) -> Plan:
    """Decide one action per schedule against the stored runtime schedules; changes nothing.

    ``with_state`` (a file) also compares the paused and stopped state; ``leave_config``
    (another scheduler's store, which copies ``beat_schedule`` into itself) leaves the names
    of this app's config entries to beat. ``prune`` removes the runtime schedules not given.
    """
    settings = Settings.from_conf(app.conf, only=("database_url", "default_policy"))
    store = Store(get_engine(settings.database_url))
    items = list(items)
    stored = {row.name: row for row in store.schedules([i.name for i in items])}
    config = _config_names(app) if leave_config else frozenset()
    lines: list[Line] = []
    for item in items:
        if isinstance(item, Refused):
            lines.append(
                Line(
                    name=item.name,
                    task=item.task,
                    schedule="-",
                    flags="",
                    action=Action.REFUSED,
                    reason=item.reason,
                )
            )
            continue
        lines.append(_line(app, item, stored.get(item.name), settings.default_policy, config, with_state))
    if prune:
        given = {i.name for i in items}
        for row in store.schedules():
            if row.origin == RUNTIME and row.name not in given:
                lines.append(
                    Line(name=row.name, task=row.task, schedule=row.schedule, flags="", action=Action.REMOVE)
                )
    return Plan(tuple(lines))


def _line(
    app: Celery,
    item: Incoming,
    row: ScheduleRow | None,
    default_policy: Mapping[str, Any],
    config: frozenset[str],
    with_state: bool,
) -> Line:
    d = _define(app, item, default_policy)
    if isinstance(d, str):
        return Line(
            name=item.name,
            task=item.task,
            schedule=item.shown or "-",
            flags="",
            action=Action.REFUSED,
            reason=d,
        )
    schedule = item.shown or d.spec.schedule_repr + (f" {d.spec.timezone}" if d.spec.timezone else "")
    line = Line(
        name=item.name,
        task=item.task,
        schedule=schedule,
        action=Action.ADD,
        definition=d,
        incoming=item,
        flags=_flags(d, item.paused, item.stop_reason if with_state else None),
    )
    if item.name in config:
        return replace(line, action=Action.CONFIG)
    if row is None:
        return line
    if row.origin != RUNTIME:
        return replace(line, action=Action.REFUSED, reason="a beat_schedule entry of this name is stored")
    if _differs(row, d, item, with_state=with_state):
        return replace(line, action=Action.UPDATE)
    return replace(line, action=Action.ALREADY_PRESENT)


def apply_import(app: Celery, plan: Plan, *, with_state: bool = False) -> Plan:
    """Carry out a plan's adds, updates and removals; each line says what was done."""
    settings = Settings.from_conf(app.conf, only=("database_url",))
    store = Store(get_engine(settings.database_url))
    rng = random.Random()
    done: list[Line] = []
    for line in plan.lines:
        try:
            done.append(_apply_line(store, line, rng, with_state=with_state))
        except BoundedBeatError as exc:  # the row changed since the plan: ended, removed, ...
            reason = str(exc).splitlines()[-1].strip(" -")
            done.append(replace(line, action=Action.REFUSED, reason=reason))
    return Plan(tuple(done))


def _apply_line(store: Store, line: Line, rng: random.Random, *, with_state: bool) -> Line:
    now = utcnow()
    if line.action is Action.REMOVE:
        return replace(line, done=store.remove_schedule(line.name, now, revoke_active=False) is not None)
    d, item = line.definition, line.incoming
    if d is None or item is None or line.action not in (Action.ADD, Action.UPDATE):
        return line
    stop = item.stop_reason if with_state else None
    if line.action is Action.ADD:
        added = store.add_schedule(d, now, rng, paused=item.paused, stop_reason=stop)
        return replace(line, done=True) if added else replace(line, action=Action.ALREADY_PRESENT)
    found = store.schedules([line.name])
    if not found:
        raise UnknownScheduleError(line.name)
    (row,) = found
    if row.config_hash != d.digest or row.timing != d.timing:
        store.update_schedule(line.name, lambda _row: d, now, rng)
    paused = bool(row.paused)
    if with_state and stop is not None and row.stop_reason != stop.value:
        store.set_stopped(line.name, stop, now)
    elif with_state and stop is None and row.stopped:
        store.set_paused(line.name, False, now)  # lifts a stop (an ended schedule refuses)
        paused = False
    if paused != item.paused:
        store.set_paused(line.name, item.paused, now)
    return replace(line, done=True)
