"""Retention: old runs leave the history in small batches, each its own short transaction.

Per schedule, the policy keys ``keep_runs`` (at most this many settled runs, newest by
``scheduled_for``) and ``keep_for`` (settled runs finished longer ago than this go); the
global ``boundedbeat_retention_days`` covers every other run, including those of removed
schedules. A schedule's own ``keep_for`` replaces the global age for it; ``keep_runs`` is a
bound beside whichever age applies.

The tick locks schedule rows and inserts runs; a purge only deletes settled run rows (never
an active one, never a schedule row), a batch at a time, so it holds no lock the tick needs,
and on SQLite it takes the single write lock for one short batch at a time. Between batches
``may_go`` is asked, so a beat that loses its lease or shuts down stops within one batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete, or_, select
from sqlalchemy.orm import Session

from ..core.enums import ACTIVE_STATES
from .tables import RunRow, ScheduleRow

#: Runs deleted per transaction: short enough that a tick waiting on SQLite's write lock barely notices.
PURGE_BATCH = 500

_ACTIVE = [s.value for s in ACTIVE_STATES]
_KEEP_RUNS = ScheduleRow.policy["keep_runs"].as_integer()
_KEEP_FOR = ScheduleRow.policy["keep_for"].as_float()


@dataclass(frozen=True, kw_only=True, slots=True)
class Kept:
    """One schedule's own retention (policy keys ``keep_runs`` / ``keep_for``)."""

    name: str
    keep_runs: int | None
    keep_for: float | None


@dataclass(kw_only=True, slots=True)
class Purged:
    """What one retention pass deleted (for the log), and whether it was cut short."""

    by_count: int = 0
    by_age: int = 0
    global_age: int = 0
    stopped: bool = False

    @property
    def total(self) -> int:
        return self.by_count + self.by_age + self.global_age


def retained(engine: Engine) -> list[Kept]:
    """The schedules with a retention of their own (one query; a JSON key lookup per row)."""
    query = (
        select(ScheduleRow.name, _KEEP_RUNS, _KEEP_FOR)
        .where(or_(_KEEP_RUNS.is_not(None), _KEEP_FOR.is_not(None)))
        .order_by(ScheduleRow.name)
    )
    with Session(engine) as s:
        return [Kept(name=n, keep_runs=r, keep_for=f) for n, r, f in s.execute(query)]


def purge_pass(
    engine: Engine,
    now: datetime,
    *,
    retention_days: float | None,
    may_go: Callable[[], bool],
    batch: int = PURGE_BATCH,
) -> Purged:
    """One retention pass: every schedule's own keys, then the global age for the rest."""
    done = Purged()
    for kept in retained(engine):
        if kept.keep_for is not None:
            older = now - timedelta(seconds=kept.keep_for)
            n, stopped = _in_batches(
                engine, batch, may_go, RunRow.schedule == kept.name, RunRow.finished_at < older
            )
            done.by_age += n
            if stopped:
                done.stopped = True
                return done
        if kept.keep_runs is not None:
            cutoff = _newest_kept(engine, kept.name, kept.keep_runs)
            if cutoff is not None:
                n, stopped = _in_batches(
                    engine, batch, may_go, RunRow.schedule == kept.name, RunRow.scheduled_for < cutoff
                )
                done.by_count += n
                if stopped:
                    done.stopped = True
                    return done
    if retention_days is not None:
        own_age = select(ScheduleRow.name).where(_KEEP_FOR.is_not(None))
        older = now - timedelta(days=retention_days)
        n, done.stopped = _in_batches(
            engine, batch, may_go, RunRow.finished_at < older, RunRow.schedule.not_in(own_age)
        )
        done.global_age += n
    return done


def _newest_kept(engine: Engine, name: str, keep_runs: int) -> datetime | None:
    """The ``scheduled_for`` of the oldest settled run ``keep_runs`` keeps (None: fewer exist)."""
    query = (
        select(RunRow.scheduled_for)
        .where(RunRow.schedule == name, RunRow.state.not_in(_ACTIVE))
        .order_by(RunRow.scheduled_for.desc())
        .offset(keep_runs - 1)
        .limit(1)
    )
    with Session(engine) as s:
        return s.scalar(query)


def _in_batches(engine: Engine, batch: int, may_go: Callable[[], bool], *where: Any) -> tuple[int, bool]:
    """Delete settled runs matching ``where``, ``batch`` per transaction; (deleted, stopped early)."""
    total = 0
    while True:
        if not may_go():
            return total, True
        with Session(engine) as s, s.begin():
            ids = list(s.scalars(select(RunRow.id).where(*where, RunRow.state.not_in(_ACTIVE)).limit(batch)))
            if not ids:
                return total, False
            # Guarded again: a settled run never becomes active, but the guard costs nothing.
            s.execute(delete(RunRow).where(RunRow.id.in_(ids), RunRow.state.not_in(_ACTIVE)))
        total += len(ids)
        if len(ids) < batch:
            return total, False
