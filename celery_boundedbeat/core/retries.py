"""The ``retry`` policy key's part of the tick state machine: which runs go again, and when.

Pure, like :mod:`~celery_boundedbeat.core.ticks`, which calls these at a settle, a due time
and a changed policy; kept apart so the state machine's module stays readable.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .enums import RunState
from .policy import Policy


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryDue:
    """A grid time attempted again after its run ended as ``retry.on`` names (the ``retry`` key)."""

    scheduled_for: datetime
    #: The attempt this run will be: 2 for the first retry, up to ``retry.max_attempts``.
    attempt: int
    #: The run it retries (the attempt before).
    retry_of: str
    #: Not before this instant (the backoff after the attempt before ended).
    due_at: datetime


def retried(
    policy: Policy,
    waiting: tuple[RetryDue, ...],
    outcome: RunState,
    now: datetime,
    run_id: str | None,
    attempt: int,
    scheduled_for: datetime | None,
) -> tuple[RetryDue, ...]:
    """The waiting retries once a run settled: its next attempt joins them if ``retry`` asks."""
    retry = policy.retry
    if retry is None or run_id is None or scheduled_for is None or not retry.wants(outcome, attempt):
        return waiting
    again = RetryDue(
        scheduled_for=scheduled_for, attempt=attempt + 1, retry_of=run_id, due_at=now + retry.delay(attempt)
    )
    return (*waiting, again)


def with_retries(
    next_due: datetime | None, waiting: tuple[RetryDue, ...], now: datetime, stopped: bool
) -> datetime | None:
    """A due time that also wakes the beat for the first waiting retry (never before ``now``)."""
    if stopped or not waiting:
        return next_due
    first = max(min(r.due_at for r in waiting), now)
    return first if next_due is None else min(next_due, first)


def within_retry_bound(policy: Policy, waiting: tuple[RetryDue, ...]) -> tuple[RetryDue, ...]:
    """The waiting retries a changed policy still asks for: none without a ``retry`` key, none
    past a lower ``max_attempts``."""
    bound = 0 if policy.retry is None else policy.retry.max_attempts
    return tuple(r for r in waiting if r.attempt <= bound)
