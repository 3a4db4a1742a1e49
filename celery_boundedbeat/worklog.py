"""A worker's run starts and outcomes, written many per transaction.

One transaction per signal cost a no-op task about 8 ms on PostgreSQL (two commits, two
pool checkouts, the ORM per run). The tracker's writer thread hands this module everything
that arrived while it was writing, and the batch costs a few statements whatever its size.

The semantics are those of :meth:`Store.start_run` and :meth:`Store.settle_run` applied to
each report in order, starts before outcomes (in one process a run starts before it ends).
A batch is one transaction: it lands whole or not at all, and the tracker keeps it for a
retry after an outage.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import String, any_, literal, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from .enums import ACTIVE_STATES, RunState
from .held import SCHEDULES, hold, light_select, write_changed
from .schema import RunRow
from .store import _DECIDED_WITHOUT_THE_TASK, SETTLED_CHANNEL, Settled, Store, elapsed_ms


@dataclass(frozen=True, slots=True)
class StartReport:
    """A run began in this process."""

    run_id: str
    worker: str
    process: str
    at: datetime
    #: Seconds after the start when the reaper may call the run timed out (its hard limit).
    limit: float | None


@dataclass(frozen=True, slots=True)
class OutcomeReport:
    """A run ended in this process (``stop``: the task called ``stop_schedule()``)."""

    run_id: str
    state: RunState
    at: datetime
    error: str | None
    stop: bool


@dataclass(frozen=True, slots=True)
class Beat:
    """The process's heartbeat, written first so a run never shows started without one."""

    process: str
    hostname: str
    pid: int
    at: datetime


#: Every start of the batch in one statement. A redelivered run that is already started keeps
#: its start and only moves to the new process, as ``Store.start_in`` does.
_PG_START = text(
    """
    UPDATE boundedbeat_runs AS r SET
        state = :started,
        started_at = CASE WHEN r.state = :started THEN r.started_at ELSE v.at END,
        published_at = CASE
            WHEN r.state = :started THEN r.published_at
            WHEN r.published_at IS NULL OR r.published_at > v.at THEN v.at
            ELSE r.published_at END,
        deadline_at = CASE WHEN r.state = :started THEN r.deadline_at ELSE v.deadline END,
        worker = v.worker,
        process = v.process
    FROM unnest(
        CAST(:ids AS text[]), CAST(:ats AS timestamptz[]), CAST(:workers AS text[]),
        CAST(:processes AS text[]), CAST(:deadlines AS timestamptz[])
    ) AS v(id, at, worker, process, deadline)
    WHERE r.id = v.id AND r.state IN (:queued, :published, :started)
    """
)

#: Every outcome of the batch in one statement (the rows are locked by this transaction).
_PG_FINISH = text(
    """
    UPDATE boundedbeat_runs AS r SET
        state = v.state, finished_at = v.at, elapsed_ms = v.elapsed, error = v.error,
        published_at = CASE WHEN r.published_at > v.at THEN v.at ELSE r.published_at END
    FROM unnest(
        CAST(:ids AS text[]), CAST(:states AS text[]), CAST(:ats AS timestamptz[]),
        CAST(:elapsed AS bigint[]), CAST(:errors AS text[])
    ) AS v(id, state, at, elapsed, error)
    WHERE r.id = v.id
    """
)

_PG_UNQUEUE = text("DELETE FROM boundedbeat_queue WHERE run_id = ANY(CAST(:ids AS text[]))")

_ACTIVE = frozenset(s.value for s in ACTIVE_STATES)


def write_reports(
    store: Store,
    starts: Sequence[StartReport],
    outcomes: Sequence[OutcomeReport],
    *,
    beat: Beat | None = None,
    rng: random.Random | None = None,
) -> list[Settled | None]:
    """Write the batch in one transaction; per outcome, what it settled (``None``: already settled)."""
    rng = rng or random.Random()
    with store.session() as s:
        if beat is not None:
            store.heartbeat_in(s, beat.process, beat.hostname, beat.pid, beat.at)
        if store.is_postgres:
            _start_many(s, starts)
            settled = _finish_many(store, s, outcomes, rng)
            done = {r.run_id for r in starts} | {x.run_id for x in settled if x is not None}
            if done:  # a started or settled run has no queue row left (a worker may beat the mark)
                s.execute(_PG_UNQUEUE, {"ids": sorted(done)})
            return settled
        # SQLite holds the write lock for the whole transaction: report by report is correct.
        for start in starts:
            store.start_in(
                s,
                start.run_id,
                worker=start.worker,
                process=start.process,
                now=start.at,
                max_run_time=start.limit,
            )
        return [
            store.settle_in(s, o.run_id, o.state, now=o.at, error=o.error, stop=o.stop, rng=rng, late=True)
            for o in outcomes
        ]


def _start_many(s: Session, starts: Sequence[StartReport]) -> None:
    if not starts:
        return
    # A run started twice in one batch (redelivered): its first start counts, as report by
    # report, and it ends up pointing at the process of the last.
    first: dict[str, StartReport] = {}
    last: dict[str, StartReport] = {}
    for r in starts:
        first.setdefault(r.run_id, r)
        last[r.run_id] = r
    s.execute(
        _PG_START,
        {
            "ids": list(first),
            "ats": [r.at for r in first.values()],
            "workers": [last[i].worker for i in first],
            "processes": [last[i].process for i in first],
            "deadlines": [r.at + timedelta(seconds=r.limit) if r.limit else None for r in first.values()],
            "queued": RunState.QUEUED.value,
            "published": RunState.PUBLISHED.value,
            "started": RunState.STARTED.value,
        },
    )


def _finish_many(
    store: Store, s: Session, outcomes: Sequence[OutcomeReport], rng: random.Random
) -> list[Settled | None]:
    """Settle the outcomes: the first terminal state of a run wins, as in ``Store.settle_run``."""
    if not outcomes:
        return []
    ids = sorted({o.run_id for o in outcomes})
    # Locked in id order, so two batches (or a batch and the reaper) cannot deadlock on them.
    runs: dict[str, Any] = {
        row.id: row
        for row in s.execute(
            select(RunRow.id, RunRow.schedule, RunRow.started_at, RunRow.state, RunRow.error)
            .where(RunRow.id == any_(literal(ids, ARRAY(String()))))
            .order_by(RunRow.id)
            .with_for_update()
        )
    }
    settled: list[Settled | None] = []
    finished: dict[str, tuple[OutcomeReport, int | None]] = {}
    repeats: list[OutcomeReport] = []
    for o in outcomes:
        run = runs.get(o.run_id)
        if run is None or o.run_id in finished:
            if run is not None:
                repeats.append(o)
            settled.append(None)
            continue
        if run.state not in _ACTIVE:
            if run.state in _DECIDED_WITHOUT_THE_TASK and run.state != o.state.value:
                store.note_late_outcome(s, o.run_id, run.state, run.error, o.state, o.at, o.error)
            settled.append(None)
            continue
        elapsed = elapsed_ms(run.started_at, o.at)
        finished[o.run_id] = (o, elapsed)
        settled.append(Settled(run_id=o.run_id, schedule=run.schedule, state=o.state, elapsed_ms=elapsed))
    if finished:
        _write_finished(s, finished)
        _count_on_schedules(store, s, [x for x in settled if x is not None], finished, rng)
    for o in repeats:  # a second report of a run this batch settled: as it would be after it
        first, _ = finished[o.run_id]
        if first.state.value in _DECIDED_WITHOUT_THE_TASK and first.state != o.state:
            store.note_late_outcome(s, o.run_id, first.state.value, first.error, o.state, o.at, o.error)
    return settled


def _write_finished(s: Session, finished: dict[str, tuple[OutcomeReport, int | None]]) -> None:
    items = list(finished.values())
    s.execute(
        _PG_FINISH,
        {
            "ids": [o.run_id for o, _ in items],
            "states": [o.state.value for o, _ in items],
            "ats": [o.at for o, _ in items],
            "elapsed": [elapsed for _, elapsed in items],
            "errors": [o.error for o, _ in items],
        },
    )


def _count_on_schedules(
    store: Store,
    s: Session,
    settled: Sequence[Settled],
    finished: dict[str, tuple[OutcomeReport, int | None]],
    rng: random.Random,
) -> None:
    """Free each settled run's slot on its schedule, in report order, one lock per schedule."""
    names = sorted({x.schedule for x in settled})
    rows = hold(
        s,
        light_select()
        .where(SCHEDULES.c.name == any_(literal(names, ARRAY(String()))))
        .order_by(SCHEDULES.c.name)
        .with_for_update(),
    )
    for x in settled:
        row = rows.get(x.schedule)
        if row is None:
            continue
        report, elapsed = finished[x.run_id]
        store.count_settled(
            s,
            row,
            x.state,
            elapsed,
            now=report.at,
            stop=report.stop,
            rng=rng,
            run_id=x.run_id,
            error=report.error,
        )
    write_changed(s, rows)
    s.execute(text("SELECT pg_notify(:c, :p)"), {"c": SETTLED_CHANNEL, "p": names[0]})
