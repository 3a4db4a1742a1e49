"""Which schedules' published runs no worker started: the admin's "waiting for a worker on queue x".

The same rule as ``boundedbeat status`` and ``health`` (:mod:`celery_boundedbeat.core.unstarted`),
read through the admin's database alias: one query for a page of schedules.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from django.db import connections
from django.db.models import Count

from ...core.enums import RunState
from ...core.exceptions import BoundedBeatError
from ...core.partitions import partition_of
from ...core.unstarted import DEFAULT_UNSTARTED_WARNING
from ...db.lease import LEASE_NAME
from ...db.partitions import PARTITION_PREFIX
from .conf import boundedbeat_settings
from .models import Run


def unstarted_warning() -> float:
    """``boundedbeat_unstarted_warning`` as the web process sees it (its default if unreadable)."""
    try:
        return boundedbeat_settings().unstarted_warning
    except BoundedBeatError:
        return DEFAULT_UNSTARTED_WARNING


def ticked_by(alias: str, slot: int) -> str:
    """Which beat ticks a schedule of hash slot ``slot``, in words (partitioned or not)."""
    try:
        partitions = boundedbeat_settings().partitions
    except BoundedBeatError:
        partitions = 1
    partition = partition_of(slot, partitions)
    name = LEASE_NAME if partitions <= 1 else f"{PARTITION_PREFIX}{partition}"
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT holder, expires_at FROM boundedbeat_leases WHERE name = %s", [name])
        found = cursor.fetchone()
    live = found is not None and _aware(found[1]) > datetime.now(UTC)
    where = "" if partitions <= 1 else f"partition {partition} of {partitions}: "
    return f"{where}{found[0] if live and found else 'no live beat'}"


def _aware(value: datetime | str) -> datetime:
    """A timestamp as the driver returns it (SQLite: naive UTC, or text), aware in UTC."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


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
