"""Crontab fields checked one by one, so an error names the field and its range.

Celery's own parser can blame the wrong field: ``crontab(minute="abc")`` raises "Invalid
weekday literal", and ``crontab(minute="1,,2")`` raises a ``ParseException`` that is not a
``ValueError``. Every place that builds a crontab from text (a stored timing, the CLI's
``--crontab``, the admin's form) goes through :func:`build_crontab` instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery.schedules import ParseException, crontab

from ..core.exceptions import ConfigurationError
from ..core.policy import Problem

#: The crontab fields, in ``crontab()``'s keyword names and the order they are stored.
CRONTAB_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
#: What each field takes, said the way an error message needs it.
CRONTAB_RANGES: dict[str, str] = {
    "minute": "0-59 (as '*', '*/15', '0-30' or '5,35')",
    "hour": "0-23 (as '*', '*/2', '9-17' or '0,12')",
    "day_of_week": "0-6 with Sunday 0, or sun-sat (as '*', '1-5' or 'mon,wed')",
    "day_of_month": "1-31 (as '*', '1', '1-15' or '1,15')",
    "month_of_year": "1-12 (as '*', '1', '1-6' or '3,6,9,12')",
}


def crontab_problem(field: str, value: Any) -> str | None:
    """Why Celery refuses ``value`` for crontab ``field``, naming field and range (``None``: valid)."""
    try:
        crontab(**{field: value})
    except (ValueError, TypeError, ParseException) as exc:
        said = str(exc).strip()
        # Celery's parser calls any word it cannot read a "weekday literal", whatever the field.
        detail = "" if not said or ("weekday" in said and field != "day_of_week") else f" ({said})"
        return f"{field} must be {CRONTAB_RANGES[field]}, got {value!r}{detail}"
    return None


def crontab_problems(entry: str, fields: Mapping[str, Any]) -> list[Problem]:
    """One problem per refused field of ``fields`` (``crontab()`` keywords), keyed by the field."""
    problems: list[Problem] = []
    for field in CRONTAB_FIELDS:
        if field in fields:
            reason = crontab_problem(field, fields[field])
            if reason is not None:
                problems.append((entry, field, reason))
    unknown = sorted(set(fields) - set(CRONTAB_FIELDS))
    problems += [(entry, key, f"is not a crontab field ({', '.join(CRONTAB_FIELDS)})") for key in unknown]
    return problems


def build_crontab(entry: str, fields: Mapping[str, Any], app: Celery | None = None) -> crontab:
    """``crontab(**fields)``; raises :class:`ConfigurationError` naming each refused field and its range."""
    problems = crontab_problems(entry, fields)
    if problems:
        raise ConfigurationError(problems)
    return crontab(**fields, app=app)
