"""The recent runs the admin's pictures draw, read in as few queries as a page allows.

A change list asks once for the last runs of every schedule on its page (one window-function
query, whatever the page size) and once for their unsuccessful runs by state; a schedule's page
asks the same for its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Count, F, Window
from django.db.models.functions import RowNumber

from ...core.enums import RunState
from ...db.tick import REPLACED
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


#: What a run settled in a state other than ``completed`` is counted as in the admin. ``replaced``
#: is a ``revoked`` run that ``missed_ticks: "replace"`` revoked: the policy working as asked.
UNSUCCESSFUL = ("failed", "timed_out", "lost", "rejected", "revoked")


def unsuccessful_counts(alias: str, names: Iterable[str]) -> dict[str, dict[str, int]]:
    """Per schedule, its kept runs in each state of :data:`UNSUCCESSFUL`, in one query.

    The runs ``replace`` revoked are left out (the schedule's ``replaced`` counter has them), so
    ``revoked`` counts only runs revoked otherwise. Read on the ``state`` index: cheap while
    such runs are rare.
    """
    wanted = list(names)
    found: dict[str, dict[str, int]] = {name: {} for name in wanted}
    if not wanted:
        return found
    rows = (
        Run.objects.using(alias)
        .filter(schedule__in=wanted, state__in=UNSUCCESSFUL)
        .exclude(state=RunState.REVOKED.value, error=REPLACED)
        .values_list("schedule", "state")
        .annotate(n=Count("id"))
        .order_by()
    )
    for schedule, state, n in rows:
        found[schedule][state] = n
    return found
