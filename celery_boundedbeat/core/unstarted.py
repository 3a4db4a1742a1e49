"""Runs handed to the broker that no worker started: a queue nobody consumes, said out loud.

A run is ``published`` from the moment its message reaches the broker until a worker starts
it. A worker that consumes the queue starts it within moments; one that stays ``published``
longer than ``boundedbeat_unstarted_warning`` (5 minutes by default) most likely went to a
queue no worker reads (a typo in the entry's ``options``, a worker started without ``-Q``
for it), every worker is down, or the workers run it without ``celery_boundedbeat.install(app)``
(so nobody records the start). The run holds its slot until ``boundedbeat_start_timeout``
(an hour) settles it ``rejected``, and meanwhile every tick finds the slot busy: without this
warning the schedule just looks busy.

Pure: rows in, summaries and words out. The read is :func:`celery_boundedbeat.db.unstarted.read_unstarted`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

#: Default of ``boundedbeat_unstarted_warning`` (seconds); 0 turns the warning off.
DEFAULT_UNSTARTED_WARNING = 300.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Unstarted:
    """One schedule's published runs that no worker started within the bound."""

    schedule: str
    #: The ``queue`` of the schedule's options; ``None``: Celery's routing picks it (by
    #: default ``task_default_queue``).
    queue: str | None
    #: How many of its runs wait.
    runs: int
    #: When the longest-waiting one was handed to the broker.
    oldest_published_at: datetime

    def waited(self, now: datetime) -> float:
        """Seconds the longest-waiting run has been published (never negative)."""
        return max((now - self.oldest_published_at).total_seconds(), 0.0)

    @property
    def text(self) -> str:
        """``waiting for a worker on queue x``: what ``status`` and the admin show."""
        return waiting_for(self.queue)


def queue_of(options: Mapping[str, Any] | None) -> str | None:
    """The queue a schedule's message options name, or ``None`` when routing decides.

    Celery takes ``queue`` as a name or a ``kombu.Queue``; stored options are JSON, so a
    name. An empty or non-string value names no queue either.
    """
    queue = (options or {}).get("queue")
    return queue if isinstance(queue, str) and queue else None


def waiting_for(queue: str | None) -> str:
    """The words for a run no worker started: the queue when the options name one."""
    return f"waiting for a worker on queue {queue}" if queue else "waiting for a worker on its default queue"


def summarise(
    counts: Mapping[str, tuple[int, datetime]], options: Mapping[str, Any]
) -> tuple[Unstarted, ...]:
    """Per schedule (``name -> (runs, oldest published_at)``), with its options' queue, by name."""
    return tuple(
        Unstarted(schedule=name, queue=queue_of(options.get(name)), runs=runs, oldest_published_at=oldest)
        for name, (runs, oldest) in sorted(counts.items())
    )


def describe(found: tuple[Unstarted, ...], now: datetime, bound: float) -> str:
    """One line for ``health``: how many runs, the longest wait, and each schedule's queue."""
    runs = sum(u.runs for u in found)
    longest = max(u.waited(now) for u in found)
    where = "; ".join(f"{u.schedule} ({u.runs}): {u.text}" for u in found[:3])
    more = f"; and {len(found) - 3} more schedule(s)" if len(found) > 3 else ""
    return (
        f"{runs} published run(s) not started by any worker within {bound:g} s "
        f"(the oldest published {longest:.1f} s ago): {where}{more} "
        f"(does a worker consume that queue, with celery_boundedbeat.install(app)?)"
    )
