"""A fixed origin for fake clocks and a shorthand for durations in seconds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

#: The origin of the fake clocks: any fixed UTC instant far from today.
T0 = datetime(2030, 1, 1, tzinfo=UTC)

#: A winter morning, 06:00 UTC: the Django pictures print its date and time of day.
MORNING_T0 = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)


def sec(n: float) -> timedelta:
    return timedelta(seconds=n)
