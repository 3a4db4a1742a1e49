"""The beat's log lines: what a tick emitted, dropped or coalesced, the schedules set aside, the lease."""

from __future__ import annotations

import logging

from ..db.lease import LeaseEvent
from ..db.store import TickResult

logger = logging.getLogger("celery_boundedbeat.beat")


def log_tick(result: TickResult, failing_rows: set[str]) -> None:
    """Log what ``result`` did; ``failing_rows`` (the schedules set aside) is updated in place."""
    for name, error in result.failed.items():
        if name not in failing_rows:
            failing_rows.add(name)
            logger.error(
                "celery_boundedbeat: schedule %r is not run: its tick failed (%s); it is set aside "
                "and retried every minute, every other schedule goes on",
                name,
                error,
            )
    for name in failing_rows & result.outcomes.keys():
        failing_rows.discard(name)
        logger.warning("celery_boundedbeat: schedule %r ticks again", name)
    for run in result.emitted:
        logger.info(
            "celery_boundedbeat: emitted %s run %s (scheduled for %s, drift %d ms%s)",
            run.schedule,
            run.id,
            run.scheduled_for.isoformat(),
            run.drift_ms,
            ", overlapping" if run.overlap else "",
        )
    for name, outcome in result.outcomes.items():
        if outcome.busy_skipped:
            logger.info(
                "celery_boundedbeat: %s skipped %d tick(s): every slot busy", name, outcome.busy_skipped
            )
        if outcome.window_dropped:
            logger.info(
                "celery_boundedbeat: %s dropped %d tick(s) found past catchup_window",
                name,
                outcome.window_dropped,
            )
        if outcome.buffer_dropped:
            logger.info(
                "celery_boundedbeat: %s dropped %d tick(s) from its pending buffer",
                name,
                outcome.buffer_dropped,
            )
        if outcome.coalesced:
            logger.info("celery_boundedbeat: %s coalesced missed ticks into one pending run", name)


def log_lease_event(event: LeaseEvent, holder: str, other_holder: str | None, renew_interval: float) -> None:
    """One line per lease transition this beat saw."""
    if event is LeaseEvent.GAINED:
        logger.info("celery_boundedbeat: %s holds the beat lease; scheduling", holder)
    elif event is LeaseEvent.TAKEN:
        logger.warning("celery_boundedbeat: another beat took the beat lease; standing by")
    elif event is LeaseEvent.STANDING_BY:
        logger.info(
            "celery_boundedbeat: %s is standing by; the beat lease is held by %s",
            holder,
            other_holder or "another beat",
        )
    elif event is LeaseEvent.EXPIRED:
        logger.warning(
            "celery_boundedbeat: could not renew the beat lease in time; stopped scheduling "
            "%g s before it can expire; standing by",
            renew_interval,
        )


def log_stopped(released: bool | None, lease_ttl: float) -> None:
    """The line of a beat that stopped cleanly; ``released``: None when the release failed."""
    if released:
        logger.info("celery_boundedbeat: beat stopped (lease released)")
    elif released is None:
        logger.info(
            "celery_boundedbeat: beat stopped (the lease could not be released; it expires within %g s)",
            lease_ttl,
        )
    else:
        logger.info("celery_boundedbeat: beat stopped (it was standing by)")
