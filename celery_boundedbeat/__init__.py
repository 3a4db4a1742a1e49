"""celery_boundedbeat: a Celery beat scheduler with bounded policies and SQL run history."""

from __future__ import annotations

from typing import Any

from . import signals
from .api.outbox import enqueue
from .api.queries import RunRecord, ScheduleSnapshot, history, snapshot
from .api.schedules import BackfillResult, add_schedule, backfill, remove_schedule, update_schedule
from .core.enums import MissedTicks, Mode, RunState, StopReason
from .core.exceptions import (
    BackfillRefusedError,
    BoundedBeatError,
    ConfigurationError,
    DatabaseNotMigratedError,
    NotInScheduledRunError,
    ScheduleEndedError,
    UnknownScheduleError,
)
from .worker.receivers import CurrentRun, current_run, install, stop_schedule

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
        from .beat.scheduler import Scheduler

        return Scheduler
    raise AttributeError(name)
