"""celery_boundedbeat: a Celery beat scheduler with bounded policies and SQL run history."""

from __future__ import annotations

from typing import Any

from . import signals
from .enums import MissedTicks, Mode, RunState, StopReason
from .exceptions import (
    BackfillRefusedError,
    BoundedBeatError,
    ConfigurationError,
    DatabaseNotMigratedError,
    NotInScheduledRunError,
    ScheduleEndedError,
    UnknownScheduleError,
)
from .outbox import enqueue
from .receivers import CurrentRun, current_run, install, stop_schedule
from .reports import RunRecord, ScheduleSnapshot, history, snapshot
from .schedules import BackfillResult, add_schedule, backfill, remove_schedule, update_schedule

__all__ = [
    "BackfillRefusedError",
    "BackfillResult",
    "BoundedBeatError",
    "ConfigurationError",
    "CurrentRun",
    "DatabaseNotMigratedError",
    "MissedTicks",
    "Mode",
    "NotInScheduledRunError",
    "RunRecord",
    "RunState",
    "ScheduleEndedError",
    "ScheduleSnapshot",
    "Scheduler",
    "StopReason",
    "UnknownScheduleError",
    "add_schedule",
    "backfill",
    "current_run",
    "enqueue",
    "history",
    "install",
    "remove_schedule",
    "signals",
    "snapshot",
    "stop_schedule",
    "update_schedule",
]


def __getattr__(name: str) -> Any:
    # Imported lazily: `celery beat -S celery_boundedbeat.Scheduler` resolves it by name,
    # and workers that only call install() never need the beat machinery.
    if name == "Scheduler":
        from .scheduler import Scheduler

        return Scheduler
    raise AttributeError(name)
