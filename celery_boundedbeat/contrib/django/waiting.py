"""Which schedules' published runs no worker started: the admin's "waiting for a worker on queue x".

The same rule as ``boundedbeat status`` and ``health`` (:mod:`celery_boundedbeat.core.unstarted`),
read through the admin's database alias: one query for a page of schedules.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from django.db.models import Count

from ...core.enums import RunState
from ...core.exceptions import BoundedBeatError
from ...core.unstarted import DEFAULT_UNSTARTED_WARNING
from .conf import boundedbeat_settings
from .models import Run


def unstarted_warning() -> float:
    """``boundedbeat_unstarted_warning`` as the web process sees it (its default if unreadable)."""
    try:
        return boundedbeat_settings().unstarted_warning
    except BoundedBeatError:
        return DEFAULT_UNSTARTED_WARNING


def unstarted_runs(alias: str, names: Iterable[str], now: datetime | None = None) -> dict[str, int]:
    """Per named schedule, its published runs no worker started within the bound (only those with some)."""
    wanted = list(names)
    bound = unstarted_warning()
    if not wanted or not bound:
        return {}
    since = (now or datetime.now(UTC)) - timedelta(seconds=bound)
    rows = (
        Run.objects.using(alias)
        .filter(schedule__in=wanted, state=RunState.PUBLISHED.value, published_at__lt=since)
        .values("schedule")
        .annotate(n=Count("id"))
        .values_list("schedule", "n")
    )
    return {schedule: int(n) for schedule, n in rows}
