"""The read behind the "waiting for a worker" warning (:mod:`celery_boundedbeat.core.unstarted`)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, func, select

from ..core.enums import RunState
from ..core.unstarted import Unstarted, summarise
from .tables import RunRow, ScheduleRow


def read_unstarted(conn: Connection, now: datetime, bound: float | None) -> tuple[Unstarted, ...]:
    """Published runs no worker started within ``bound`` seconds, per schedule (``None``/0: none).

    The runs are found on the ``(state, started_at)`` index (published runs are active runs:
    few); the schedules' options are read only when some wait.
    """
    if not bound:
        return ()
    rows = conn.execute(
        select(RunRow.schedule, func.count(), func.min(RunRow.published_at))
        .where(
            RunRow.state == RunState.PUBLISHED.value,
            RunRow.published_at < now - timedelta(seconds=bound),
        )
        .group_by(RunRow.schedule)
    ).all()
    if not rows:
        return ()
    counts = {name: (int(n), oldest) for name, n, oldest in rows if oldest is not None}
    query = select(ScheduleRow.name, ScheduleRow.options).where(ScheduleRow.name.in_(list(counts)))
    options: dict[str, Any] = {name: value for name, value in conn.execute(query).all()}
    return summarise(counts, options)
