"""When an application hears about a schedule: the transitions behind the alert signals.

Pure. A settle or a tick hands over what it saw (the outcome, the failure streak before and
after, whether the schedule is already announced failing) and gets back the alerts to send and
the new ``failing_since``; the store writes both in the transaction that made the change, and
the beat sends the alerts after that commit (:mod:`~celery_boundedbeat.signals`). Deciding here
keeps "once per transition, never per tick" testable without a database or a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from .enums import AlertKind, RunState
from .ticks import TickOutcome

#: Outcomes that lengthen the failure streak (as ``pause_on_failure`` counts them).
STREAK_OUTCOMES = frozenset({RunState.FAILED, RunState.TIMED_OUT, RunState.LOST})
#: Run outcomes that are an alert of their own, whatever the streak.
_RUN_ALERTS = {RunState.LOST: AlertKind.RUN_LOST, RunState.TIMED_OUT: AlertKind.RUN_TIMED_OUT}


@dataclass(frozen=True, kw_only=True, slots=True)
class Alert:
    """One transition to announce; the fields a kind does not use stay ``None``."""

    kind: AlertKind
    schedule: str
    #: When the transition happened (the settle's or the tick's ``now``).
    at: datetime
    run_id: str | None = None
    #: The run's terminal state (settle alerts).
    state: RunState | None = None
    #: ``schedule_failing``: the failures in a row; ``ticks_dropped``: the ticks dropped.
    count: int | None = None
    #: The failing run's error text (``schedule_failing``, ``run_lost``, ``run_timed_out``).
    error: str | None = None
    #: ``schedule_recovered``: when the schedule was announced failing.
    since: datetime | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SettleAlerts:
    """What one settle announces, and the schedule's ``failing_since`` after it."""

    alerts: tuple[Alert, ...]
    failing_since: datetime | None


def on_settled(
    *,
    schedule: str,
    run_id: str,
    outcome: RunState,
    error: str | None,
    streak: int,
    failing_since: datetime | None,
    threshold: int,
    now: datetime,
) -> SettleAlerts:
    """The alerts of one settled run, given the failure streak after it (``consecutive_failures``).

    ``schedule_failing`` once, when a streak reaches ``threshold`` while the schedule is not
    announced failing; later failures of the same streak, or of a new streak after a ``resume``
    reset the count, send nothing more. ``schedule_recovered`` once, with the first completed
    run after that. ``revoked`` and ``rejected`` runs neither start nor end a failing spell.
    ``run_lost`` and ``run_timed_out`` are sent for every such run: each is its own transition.
    """
    alerts: list[Alert] = []
    run_alert = _RUN_ALERTS.get(outcome)
    if run_alert is not None:
        alerts.append(
            Alert(kind=run_alert, schedule=schedule, at=now, run_id=run_id, state=outcome, error=error)
        )
    if outcome in STREAK_OUTCOMES and failing_since is None and streak >= threshold:
        failing_since = now
        alerts.append(
            Alert(
                kind=AlertKind.FAILING,
                schedule=schedule,
                at=now,
                run_id=run_id,
                state=outcome,
                count=streak,
                error=error,
            )
        )
    elif outcome is RunState.COMPLETED and failing_since is not None:
        alerts.append(
            Alert(
                kind=AlertKind.RECOVERED,
                schedule=schedule,
                at=now,
                run_id=run_id,
                state=outcome,
                since=failing_since,
            )
        )
        failing_since = None
    return SettleAlerts(alerts=tuple(alerts), failing_since=failing_since)


def on_ticked(outcomes: Mapping[str, TickOutcome], now: datetime) -> list[Alert]:
    """One ``ticks_dropped`` per schedule whose tick dropped ticks, with how many.

    A tick that drops nothing (every passed tick started, or was kept pending) sends nothing,
    so a schedule hears about dropping only in the ticks where ``skips`` rose.
    """
    return [
        Alert(kind=AlertKind.TICKS_DROPPED, schedule=name, at=now, count=outcome.skipped)
        for name, outcome in outcomes.items()
        if outcome.skipped > 0
    ]
