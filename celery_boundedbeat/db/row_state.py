"""A schedule row and the values it stands for: the tick state and the definition.

One owner for the mapping between ``boundedbeat_schedules`` columns and
:class:`~celery_boundedbeat.core.ticks.ScheduleState`, so every transaction that loads a row,
asks the state machine and writes the answer back (ticks, settles, triggers, runtime
changes, config reconciling) reads and writes the same columns the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from functools import cache
from typing import Any

from ..core.enums import StopReason
from ..core.partitions import slot_of
from ..core.retries import RetryDue
from ..core.spec import EntrySpec
from ..core.ticks import ScheduleState
from .tables import ScheduleRow, new_incarnation

#: ``origin`` of a schedule from ``beat_schedule`` / ``add_periodic_task``.
CONFIG = "config"
#: ``origin`` of a schedule added through the API or CLI.
RUNTIME = "runtime"

#: Every column key of ``boundedbeat_schedules``.
COLUMNS: tuple[str, ...] = tuple(c.key for c in ScheduleRow.__table__.columns)


def zero_values(name: str, now: datetime, *, origin: str = CONFIG) -> dict[str, Any]:
    """A new schedule's columns with zeroed counters, as plain values for a bulk insert.

    Every new row is a new incarnation of its name: runs of an earlier schedule of the same
    name never settle onto it.
    """
    return {
        "name": name,
        "incarnation": new_incarnation(),
        "origin": origin,
        "paused": False,
        "stopped": False,
        "runs": 0,
        "skips": 0,
        "busy_skips": 0,
        "window_drops": 0,
        "buffer_drops": 0,
        "replaced": 0,
        "overlaps": 0,
        "failures": 0,
        "active_runs": 0,
        "pending_runs": 0,
        "pending": [],
        "triggers": [],
        "backfill": [],
        "retries": [],
        "retried": 0,
        "slot": slot_of(name),
        "grid_runs": 0,
        "consecutive_failures": 0,
        "version": 1,
        "created_at": now,
    }


def new_row(name: str, now: datetime, *, origin: str = CONFIG) -> ScheduleRow:
    """A schedule with zeroed counters; the caller writes its state and definition."""
    return ScheduleRow(**zero_values(name, now, origin=origin))


def definition_values(
    spec: EntrySpec, digest: str, timing: dict[str, Any] | None, *, origin: str
) -> dict[str, Any]:
    """A schedule's definition as its columns: schedules are data (docs/how-it-works.md)."""
    return {
        "task": spec.task,
        "mode": spec.policy.mode.value,
        "policy": spec.policy.to_json(),
        "schedule": spec.schedule_repr,
        "period": spec.period,
        "args": list(spec.args),
        "kwargs": dict(spec.kwargs),
        "options": dict(spec.options),
        "config_hash": digest,
        "timing": timing,
        "origin": origin,
    }


def write_definition(
    row: ScheduleRow, spec: EntrySpec, digest: str, timing: dict[str, Any] | None, *, origin: str
) -> None:
    """Copy a schedule's definition into its row."""
    for key, value in definition_values(spec, digest, timing, origin=origin).items():
        setattr(row, key, value)


def state_of(row: ScheduleRow) -> ScheduleState:
    """The row as the tick state machine sees it (:mod:`~celery_boundedbeat.core.ticks`)."""
    return ScheduleState(
        active_runs=row.active_runs,
        pending=tuple(datetime.fromisoformat(p) for p in (row.pending or [])),
        triggers=tuple(datetime.fromisoformat(t) for t in (row.triggers or [])),
        backfill=tuple(datetime.fromisoformat(t) for t in (row.backfill or [])),
        retries=tuple(_retry_of(r) for r in (row.retries or [])),
        retried=row.retried or 0,
        grid_at=row.grid_at,
        next_due_at=row.next_due_at,
        runs=row.runs,
        skips=row.skips,
        busy_skips=row.busy_skips or 0,
        window_drops=row.window_drops or 0,
        buffer_drops=row.buffer_drops or 0,
        replaced=row.replaced or 0,
        overlaps=row.overlaps,
        failures=row.failures,
        last_drift_ms=row.last_drift_ms,
        last_elapsed_ms=row.last_elapsed_ms,
        max_elapsed_ms=row.max_elapsed_ms,
        stopped=row.stopped,
        grid_runs=row.grid_runs or 0,
        stop_reason=None if row.stop_reason is None else StopReason(row.stop_reason),
        consecutive_failures=row.consecutive_failures or 0,
        pause_reason=row.pause_reason,
    )


def _retry_of(data: Mapping[str, Any]) -> RetryDue:
    return RetryDue(
        scheduled_for=datetime.fromisoformat(data["scheduled_for"]),
        attempt=int(data["attempt"]),
        retry_of=str(data["retry_of"]),
        due_at=datetime.fromisoformat(data["due_at"]),
    )


def _retry_json(retry: RetryDue) -> dict[str, Any]:
    return {
        "scheduled_for": retry.scheduled_for.isoformat(),
        "attempt": retry.attempt,
        "retry_of": retry.retry_of,
        "due_at": retry.due_at.isoformat(),
    }


def apply_state(row: ScheduleRow, state: ScheduleState, now: datetime) -> None:
    """Store the state machine's answer and stamp the row as changed at ``now``."""
    write_state(row, state)
    row.updated_at = now


def state_values(state: ScheduleState) -> dict[str, Any]:
    """The state's columns as plain values (``paused`` aside: see :func:`write_state`)."""
    return {
        "active_runs": state.active_runs,
        "pending": [p.isoformat() for p in state.pending],
        "triggers": [t.isoformat() for t in state.triggers],
        "backfill": [t.isoformat() for t in state.backfill],
        "retries": [_retry_json(r) for r in state.retries],
        "retried": state.retried,
        "pending_runs": state.waiting_runs,
        "grid_at": state.grid_at,
        "next_due_at": state.next_due_at,
        "runs": state.runs,
        "skips": state.skips,
        "busy_skips": state.busy_skips,
        "window_drops": state.window_drops,
        "buffer_drops": state.buffer_drops,
        "replaced": state.replaced,
        "overlaps": state.overlaps,
        "failures": state.failures,
        "last_drift_ms": state.last_drift_ms,
        "last_elapsed_ms": state.last_elapsed_ms,
        "max_elapsed_ms": state.max_elapsed_ms,
        "stopped": state.stopped,
        "grid_runs": state.grid_runs,
        "stop_reason": None if state.stop_reason is None else state.stop_reason.value,
        "consecutive_failures": state.consecutive_failures,
        "pause_reason": state.pause_reason,
    }


def write_state(row: ScheduleRow, state: ScheduleState) -> None:
    """The state's columns only; callers decide whether this is an update to stamp."""
    if state.pause_reason is not None and row.pause_reason is None:
        row.paused = True  # pause_on_failure: the state machine asked for it, naming the run
    for key, value in state_values(state).items():
        setattr(row, key, value)


@cache
def _column_defaults() -> Mapping[str, Any]:
    """Each column's Python-side default (``None`` where it has none), as an INSERT would apply it.

    Computed once; callers copy it and replace every mutable value they write.
    """
    values: dict[str, Any] = {}
    for column in ScheduleRow.__table__.columns:
        default = column.default
        arg = getattr(default, "arg", None)
        if default is None or arg is None:
            values[column.key] = None
        elif getattr(default, "is_callable", False):
            values[column.key] = arg(None)  # SQLAlchemy wraps a callable default to take a context
        else:
            values[column.key] = arg
    return values


def fresh_values(
    spec: EntrySpec,
    state: ScheduleState,
    digest: str,
    timing: dict[str, Any] | None,
    now: datetime,
    *,
    origin: str,
) -> dict[str, Any]:
    """Every column of a new schedule row, built without an ORM object (bulk inserts at 100k)."""
    values = dict(_column_defaults())
    values.update(zero_values(spec.name, now, origin=origin))
    values.update(state_values(state))
    values["paused"] = state.pause_reason is not None
    values["updated_at"] = now
    values.update(definition_values(spec, digest, timing, origin=origin))
    return values
