"""Schedules, durations and times in words: the admin's names for :mod:`celery_boundedbeat.core.words`."""

from __future__ import annotations

from ...core.words import (
    DAY_NAMES,
    MONTH_NAMES,
    describe_crontab,
    describe_timing,
    every,
    format_ms,
    format_when,
)

__all__ = [
    "DAY_NAMES",
    "MONTH_NAMES",
    "describe_crontab",
    "describe_timing",
    "every",
    "format_ms",
    "format_when",
]
