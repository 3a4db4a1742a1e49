"""The recent runs the admin's pictures draw, read in as few queries as a page allows.

A change list asks once for the last runs of every schedule on its page (one window-function
query, whatever the page size); a schedule's page asks once for its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import F, Window
from django.db.models.functions import RowNumber

from .charts import RunPoint
from .models import Run

#: Runs per schedule in a change list's sparkline (and its last-run column).
SPARKLINE_RUNS = 20
#: Runs a schedule's page draws in its timeline and duration/drift chart.
PAGE_RUNS = 50

_COLUMNS = ("id", "state", "scheduled_for", "started_at", "finished_at", "elapsed_ms", "drift_ms", "error")


def _point(values: tuple[object, ...]) -> RunPoint:
    return RunPoint(**dict(zip(_COLUMNS, values, strict=False)))  # type: ignore[arg-type]


def recent_runs(
    alias: str, names: Iterable[str], per_schedule: int = SPARKLINE_RUNS
) -> dict[str, list[RunPoint]]:
    """The newest ``per_schedule`` runs of each named schedule, oldest first, in one query."""
    wanted = list(names)
    if not wanted:
        return {}
    rank = Window(RowNumber(), partition_by=[F("schedule")], order_by=F("scheduled_for").desc())
    rows = (
        Run.objects.using(alias)
        .filter(schedule__in=wanted)
        .annotate(rank=rank)
        .filter(rank__lte=per_schedule)
        .order_by("schedule", "scheduled_for")
        .values_list("schedule", *_COLUMNS)
    )
    found: dict[str, list[RunPoint]] = {name: [] for name in wanted}
    for schedule, *values in rows:
        found[schedule].append(_point(tuple(values)))
    return found


def schedule_runs(alias: str, name: str, limit: int = PAGE_RUNS) -> list[RunPoint]:
    """The newest ``limit`` runs of one schedule, oldest first."""
    rows = (
        Run.objects.using(alias)
        .filter(schedule=name)
        .order_by("-scheduled_for")
        .values_list(*_COLUMNS)[:limit]
    )
    return [_point(tuple(values)) for values in list(rows)[::-1]]
