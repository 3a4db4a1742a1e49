"""The grids schedules tick on: a fixed interval or a calendar (crontab, solar).

Pure: a grid is asked about times it is given, never reads a clock, so the tick maths in
:mod:`~celery_boundedbeat.core.ticks` can be driven by a fake clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol


class Timing(Protocol):
    """The grid a schedule ticks on (an interval, a crontab, a solar event)."""

    def first_at_or_after(self, t: datetime) -> datetime:
        """The first grid time at or after ``t``."""

    def passed(self, grid_at: datetime, now: datetime) -> tuple[int, Callable[[int], datetime], datetime]:
        """Grid ticks in ``[grid_at, now]``: their count, the i-th tick, and the next one after ``now``."""

    def gap(self, at: datetime) -> float:
        """Seconds between the grid tick ``at`` and the one after it (for the jitter cap)."""


@dataclass(frozen=True, slots=True)
class IntervalTiming:
    """A fixed period in seconds: ``1 + overdue // period`` ticks have passed."""

    period: float

    def first_at_or_after(self, t: datetime) -> datetime:
        return t

    def passed(self, grid_at: datetime, now: datetime) -> tuple[int, Callable[[int], datetime], datetime]:
        if now < grid_at:
            return 0, lambda i: grid_at, grid_at
        overdue = (now - grid_at).total_seconds()
        count = 1 + int(overdue // self.period)
        step = timedelta(seconds=self.period)
        return count, lambda i: grid_at + step * i, grid_at + step * count

    def gap(self, at: datetime) -> float:
        return self.period


#: Calendar grids are walked tick by tick; past this many the count stops (documented).
MAX_COUNTED_CALENDAR_TICKS = 10_000


@dataclass(frozen=True, slots=True)
class CalendarTiming:
    """A grid given by a function returning the first tick strictly after a time."""

    next_after: Callable[[datetime], datetime]

    def first_at_or_after(self, t: datetime) -> datetime:
        return self.next_after(t - timedelta(microseconds=1))

    def passed(self, grid_at: datetime, now: datetime) -> tuple[int, Callable[[int], datetime], datetime]:
        ticks: list[datetime] = []
        tick = grid_at
        while tick <= now and len(ticks) < MAX_COUNTED_CALENDAR_TICKS:
            ticks.append(tick)
            tick = self.next_after(tick)
        if tick <= now:
            tick = self.next_after(now)
        return len(ticks), ticks.__getitem__, tick

    def gap(self, at: datetime) -> float:
        return (self.next_after(at) - at).total_seconds()
