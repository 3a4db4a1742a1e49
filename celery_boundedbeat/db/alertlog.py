"""The alert rows: written with the transition they announce, taken out by the beat.

An alert is decided by :mod:`~celery_boundedbeat.core.alerts` inside the transaction that makes
the change (a settle in a worker or in the reaper), and stored in ``boundedbeat_alerts`` by
that same transaction: a rollback leaves no alert behind. The beat holding the lease takes
rows out with one ``DELETE ... RETURNING`` per batch and sends the signals only after that
delete committed, so a row is sent at most once even with two beats or a retried drain.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import Engine, delete, insert, select
from sqlalchemy.orm import Session

from ..core.alerts import Alert, on_settled
from ..core.enums import AlertKind, RunState
from ..core.messages import clip_error
from .tables import AlertRow, ScheduleRow

#: Most alert rows taken out (and signals sent) per batch.
TAKE_BATCH = 500


def note_settle(
    s: Session,
    row: ScheduleRow,
    *,
    run_id: str,
    outcome: RunState,
    error: str | None,
    streak: int,
    threshold: int,
    now: datetime,
) -> None:
    """Decide the alerts of one settled run and store them with the row's ``failing_since``."""
    decided = on_settled(
        schedule=row.name,
        run_id=run_id,
        outcome=outcome,
        error=error,
        streak=streak,
        failing_since=row.failing_since,
        threshold=threshold,
        now=now,
    )
    if decided.failing_since != row.failing_since:
        row.failing_since = decided.failing_since
    record(s, decided.alerts)


def record(s: Session, alerts: Iterable[Alert]) -> None:
    """Store alerts in the caller's transaction."""
    rows = [
        {
            "kind": a.kind.value,
            "schedule": a.schedule,
            "at": a.at,
            "run_id": a.run_id,
            "state": None if a.state is None else a.state.value,
            "count": a.count,
            "error": None if a.error is None else clip_error(a.error),
            "since": a.since,
        }
        for a in alerts
    ]
    if rows:
        s.execute(insert(AlertRow), rows)


def take(engine: Engine, limit: int = TAKE_BATCH) -> list[Alert]:
    """Delete up to ``limit`` of the oldest alert rows and return them, oldest first (committed)."""
    oldest = (
        select(AlertRow.id).order_by(AlertRow.id).limit(limit).with_for_update(skip_locked=True)
    ).scalar_subquery()
    statement = (
        delete(AlertRow)
        .where(AlertRow.id.in_(oldest))
        .returning(
            AlertRow.id,
            AlertRow.kind,
            AlertRow.schedule,
            AlertRow.at,
            AlertRow.run_id,
            AlertRow.state,
            AlertRow.count,
            AlertRow.error,
            AlertRow.since,
        )
    )
    with Session(engine) as s, s.begin():
        taken = sorted(s.execute(statement).all(), key=lambda r: r.id)
    return [
        Alert(
            kind=AlertKind(r.kind),
            schedule=r.schedule,
            at=r.at,
            run_id=r.run_id,
            state=None if r.state is None else RunState(r.state),
            count=r[6],  # ``Row.count`` is the tuple method
            error=r.error,
            since=r.since,
        )
        for r in taken
    ]
