"""The grids schedules tick on: how many ticks passed and which one comes next."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from helpers.clock import T0, sec

from celery_boundedbeat.core.timing import CalendarTiming, IntervalTiming


def every_minute(t: datetime) -> datetime:
    """A calendar grid: the first whole minute strictly after ``t``."""
    return t.replace(second=0, microsecond=0) + timedelta(minutes=1)


@pytest.mark.parametrize(("overdue", "count"), [(0, 1), (9.999, 1), (10, 2), (35, 4), (40, 5)])
def test_interval_timing_counts_one_plus_overdue_over_period(overdue: float, count: int) -> None:
    """A tick seen `overdue` seconds late has passed 1 + overdue // period grid ticks."""
    passed, tick_at, next_tick = IntervalTiming(10).passed(T0, T0 + sec(overdue))
    assert passed == count
    assert [tick_at(i) for i in range(passed)] == [T0 + sec(10 * i) for i in range(count)]
    assert next_tick == T0 + sec(10 * count)
    assert next_tick > T0 + sec(overdue)


def test_interval_timing_counts_nothing_before_the_grid() -> None:
    """Before its grid time nothing has passed and the next tick is the grid time."""
    passed, _tick_at, next_tick = IntervalTiming(10).passed(T0, T0 - sec(1))
    assert (passed, next_tick) == (0, T0)


def test_calendar_timing_counts_every_tick_passed() -> None:
    """A calendar grid counts the ticks in [grid, now] one by one and names the next after now."""
    timing = CalendarTiming(every_minute)
    assert timing.first_at_or_after(T0) == T0
    assert timing.first_at_or_after(T0 + sec(1)) == T0 + sec(60)
    count, tick_at, next_tick = timing.passed(T0, T0 + sec(150))
    assert count == 3
    assert [tick_at(i) for i in range(count)] == [T0, T0 + sec(60), T0 + sec(120)]
    assert next_tick == T0 + sec(180)
    assert timing.gap(T0) == 60.0
