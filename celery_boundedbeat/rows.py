"""A schedule row and the values it stands for: the tick state and the definition.

One owner for the mapping between ``boundedbeat_schedules`` columns and
:class:`~celery_boundedbeat.ticks.ScheduleState`, so every transaction that loads a row,
asks the state machine and writes the answer back (ticks, settles, triggers, runtime
changes, config reconciling) reads and writes the same columns the same way.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .enums import StopReason
from .policy import EntrySpec
from .schema import ScheduleRow
from .ticks import ScheduleState

#: ``origin`` of a schedule from ``beat_schedule`` / ``add_periodic_task``.
CONFIG = "config"
#: ``origin`` of a schedule added through the API or CLI.
RUNTIME = "runtime"


def new_row(name: str, now: datetime, *, origin: str = CONFIG) -> ScheduleRow:
    """A schedule with zeroed counters; the caller writes its state and definition."""
    return ScheduleRow(
        name=name,
        origin=origin,
        paused=False,
        stopped=False,
        runs=0,
        skips=0,
        overlaps=0,
        failures=0,
        active_runs=0,
        pending_runs=0,
        pending=[],
        triggers=[],
        grid_runs=0,
        consecutive_failures=0,
        version=1,
        created_at=now,
    )


def write_definition(
    row: ScheduleRow, spec: EntrySpec, digest: str, timing: dict[str, Any] | None, *, origin: str
) -> None:
    """Copy a schedule's definition into its row: schedules are data (DESIGN.md)."""
    row.task = spec.task
    row.mode = spec.policy.mode.value
    row.policy = spec.policy.to_json()
    row.schedule = spec.schedule_repr
    row.period = spec.period
    row.args = list(spec.args)
    row.kwargs = dict(spec.kwargs)
    row.options = dict(spec.options)
    row.config_hash = digest
    row.timing = timing
    row.origin = origin


def state_of(row: ScheduleRow) -> ScheduleState:
    """The row as the tick state machine sees it (:mod:`~celery_boundedbeat.ticks`)."""
    return ScheduleState(
        active_runs=row.active_runs,
        pending=tuple(datetime.fromisoformat(p) for p in (row.pending or [])),
        triggers=tuple(datetime.fromisoformat(t) for t in (row.triggers or [])),
        grid_at=row.grid_at,
        next_due_at=row.next_due_at,
        runs=row.runs,
        skips=row.skips,
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


def apply_state(row: ScheduleRow, state: ScheduleState, now: datetime) -> None:
    """Store the state machine's answer and stamp the row as changed at ``now``."""
    write_state(row, state)
    row.updated_at = now


def write_state(row: ScheduleRow, state: ScheduleState) -> None:
    """The state's columns only; callers decide whether this is an update to stamp."""
    row.active_runs = state.active_runs
    row.pending = [p.isoformat() for p in state.pending]
    row.triggers = [t.isoformat() for t in state.triggers]
    row.pending_runs = state.waiting_runs
    row.grid_at = state.grid_at
    row.next_due_at = state.next_due_at
    row.runs = state.runs
    row.skips = state.skips
    row.overlaps = state.overlaps
    row.failures = state.failures
    row.last_drift_ms = state.last_drift_ms
    row.last_elapsed_ms = state.last_elapsed_ms
    row.max_elapsed_ms = state.max_elapsed_ms
    row.stopped = state.stopped
    row.grid_runs = state.grid_runs
    row.stop_reason = None if state.stop_reason is None else state.stop_reason.value
    row.consecutive_failures = state.consecutive_failures
    if state.pause_reason is not None and row.pause_reason is None:
        row.paused = True  # pause_on_failure: the state machine asked for it, naming the run
    row.pause_reason = state.pause_reason
