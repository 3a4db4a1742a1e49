"""Signals an application connects to for alerting, sent by the beat (like ``celery.signals``).

Each signal is sent once per transition, never once per tick, by the beat that holds the
lease, after the transaction that made the change committed (a rolled-back tick or settle
sends nothing). The sender is the schedule's name, so a receiver can listen to one schedule
with ``connect(sender="nightly-export")``. Every signal also passes ``schedule`` and ``at``
(the aware UTC time of the transition).

- ``schedule_failing(schedule, at, failures, run_id, state, error)``: ``failures`` counted
  failures (``failed``, ``timed_out``, ``lost``) in a row reached
  ``boundedbeat_failing_threshold``. Sent once; the next one comes only after a recovery.
- ``schedule_recovered(schedule, at, run_id, since)``: the first ``completed`` run after
  ``schedule_failing``; ``since`` is when failing was announced.
- ``ticks_dropped(schedule, at, count)``: a tick dropped ``count`` missed ticks (``skips``
  rose by ``count``): once per tick that dropped, none for the ticks that drop nothing.
- ``run_lost(schedule, at, run_id, state, error)``: a run settled ``lost`` (its worker died).
- ``run_timed_out(schedule, at, run_id, state, error)``: a run settled ``timed_out``.

Receivers run in the beat's tick thread: keep them quick (hand slow work to a queue or a
thread). Celery logs and swallows a receiver's exception; the beat goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from celery.utils.dispatch import Signal

from .core.alerts import Alert
from .core.enums import AlertKind

__all__ = ["run_lost", "run_timed_out", "schedule_failing", "schedule_recovered", "send", "ticks_dropped"]

logger = logging.getLogger("celery_boundedbeat.beat")

schedule_failing = Signal(
    name="schedule_failing", providing_args={"schedule", "at", "failures", "run_id", "state", "error"}
)
schedule_recovered = Signal(name="schedule_recovered", providing_args={"schedule", "at", "run_id", "since"})
ticks_dropped = Signal(name="ticks_dropped", providing_args={"schedule", "at", "count"})
run_lost = Signal(name="run_lost", providing_args={"schedule", "at", "run_id", "state", "error"})
run_timed_out = Signal(name="run_timed_out", providing_args={"schedule", "at", "run_id", "state", "error"})

_SIGNALS = {
    AlertKind.FAILING: schedule_failing,
    AlertKind.RECOVERED: schedule_recovered,
    AlertKind.TICKS_DROPPED: ticks_dropped,
    AlertKind.RUN_LOST: run_lost,
    AlertKind.RUN_TIMED_OUT: run_timed_out,
}


def _arguments(alert: Alert) -> dict[str, object]:
    """The keyword arguments of one alert's signal (the fields its kind documents)."""
    named: dict[str, object] = {"schedule": alert.schedule, "at": alert.at}
    if alert.kind is AlertKind.TICKS_DROPPED:
        named["count"] = alert.count
        return named
    named["run_id"] = alert.run_id
    if alert.kind is AlertKind.RECOVERED:
        named["since"] = alert.since
        return named
    named["state"] = None if alert.state is None else alert.state.value
    named["error"] = alert.error
    if alert.kind is AlertKind.FAILING:
        named["failures"] = alert.count
    return named


def _log(alert: Alert) -> None:
    """Say a failing schedule and its recovery in words (the other alerts have their own lines:
    the tick's drops, the reaper's settles); the signal sent is a DEBUG line."""
    if alert.kind is AlertKind.FAILING:
        logger.warning(
            "celery_boundedbeat: schedule %r is failing: %d failure(s) in a row, the last run %s %s",
            alert.schedule,
            alert.count,
            alert.run_id,
            "ended" if alert.state is None else alert.state.value,
        )
    elif alert.kind is AlertKind.RECOVERED:
        logger.info(
            "celery_boundedbeat: schedule %r recovered: run %s completed", alert.schedule, alert.run_id
        )
    logger.debug(
        "celery_boundedbeat: sending the %s signal for %r", _SIGNALS[alert.kind].name, alert.schedule
    )


def send(alerts: Iterable[Alert]) -> None:
    """Send each alert's signal, in order; one receiver's failure never stops the others."""
    for alert in alerts:
        _log(alert)
        _SIGNALS[alert.kind].send(sender=alert.schedule, **_arguments(alert))
