"""Crontab fields refused with the field's name and range, never Celery's "weekday" for a minute."""

from __future__ import annotations

from typing import Any

import pytest
from celery.schedules import crontab

from celery_boundedbeat.config.cron import build_crontab, crontab_problem, crontab_problems
from celery_boundedbeat.core.exceptions import ConfigurationError


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("minute", "61", "minute must be 0-59"),
        ("minute", "abc", "minute must be 0-59"),
        ("minute", 61, "minute must be 0-59"),
        ("minute", "*/0", "minute must be 0-59"),
        ("hour", "25", "hour must be 0-23"),
        ("hour", "1,,2", "hour must be 0-23"),
        ("day_of_week", "8", "day_of_week must be 0-6 with Sunday 0, or sun-sat"),
        ("day_of_week", "funday", "day_of_week must be 0-6 with Sunday 0, or sun-sat"),
        ("day_of_month", "0", "day_of_month must be 1-31"),
        ("month_of_year", "13", "month_of_year must be 1-12"),
    ],
)
def test_a_refused_field_is_named_with_its_range(field: str, value: Any, said: str) -> None:
    """Each refused value names its own field and that field's range, and the value given."""
    reason = crontab_problem(field, value)
    assert reason is not None and reason.startswith(said) and repr(value) in reason, reason
    if field != "day_of_week":
        assert "weekday" not in reason, reason


def test_celery_itself_blames_the_weekday_for_a_minute() -> None:
    """The defect worked around: Celery's parser says "weekday" for a word in the minute field."""
    with pytest.raises(ValueError, match="weekday"):
        crontab(minute="abc")


def test_valid_fields_pass_and_build_the_same_crontab() -> None:
    """Valid text gives no problem and the crontab Celery would build."""
    fields = {"minute": "*/15", "hour": "9-17", "day_of_week": "mon-fri", "day_of_month": "1,15"}
    assert crontab_problems("job", fields) == []
    assert build_crontab("job", fields) == crontab(**fields)


def test_every_refused_field_is_reported_at_once() -> None:
    """build_crontab raises one ConfigurationError listing every refused field, keyed by field."""
    with pytest.raises(ConfigurationError) as info:
        build_crontab("job", {"minute": "61", "hour": "3", "month_of_year": "13", "second": "0"})
    assert [(entry, key) for entry, key, _ in info.value.problems] == [
        ("job", "minute"),
        ("job", "month_of_year"),
        ("job", "second"),
    ]
