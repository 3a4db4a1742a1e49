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
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import NamedTuple, cast

from sqlalchemy import Table
from sqlalchemy.orm import Session

from ..core.enums import ACTIVE_STATES, RunState
from ..db.driver import Driver, Sql, kinds_of
from ..db.locked import HeldRows, hold, write_changed
from ..db.runs import (
    _DECIDED_WITHOUT_THE_TASK,
    SETTLED_CHANNEL,
    Attempt,
    Settled,
    elapsed_ms,
    not_before,
    settles_onto,
)
from ..db.store import Store
from ..db.tables import RunRow


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


# The statements go to the driver directly (:mod:`~celery_boundedbeat.db.driver`): a batch of a
# few reports spent more of the worker's CPU building and executing them through the ORM than
# the database spent running them. Values are always bound (``%(name)s``), never formatted in.
# SQLite runs the same statements where it can; where it has no arrays, it reads the values from
# a JSON document (``json_each``), and it has no row locks (one writer holds the database).

_IN_IDS = "id = ANY(CAST(%(ids)s AS text[]))"
_IN_IDS_SQLITE = "id IN (SELECT value FROM json_each(%(ids)s))"

_SET_STARTED = """
    UPDATE boundedbeat_runs AS r SET
        state = %(started)s,
        started_at = CASE WHEN r.state = %(started)s THEN r.started_at ELSE v.at END,
        published_at = CASE
            WHEN r.state = %(started)s THEN r.published_at
            WHEN r.published_at IS NULL OR r.published_at > v.at THEN v.at
            ELSE r.published_at END,
        deadline_at = CASE WHEN r.state = %(started)s THEN r.deadline_at ELSE v.deadline END,
        worker = v.worker,
        process = v.process
    FROM {values}
    WHERE r.id = v.id AND r.state IN (%(queued)s, %(published)s, %(started)s)
"""
#: Every start of the batch in one statement. A redelivered run that is already started keeps
#: its start and only moves to the new process, as ``RunLife.start_in`` does.
_START = Sql(
    _SET_STARTED.format(
        values="""unnest(
        CAST(%(ids)s AS text[]), CAST(%(ats)s AS timestamptz[]), CAST(%(workers)s AS text[]),
        CAST(%(processes)s AS text[]), CAST(%(deadlines)s AS timestamptz[])
    ) AS v(id, at, worker, process, deadline)"""
    ),
    sqlite=_SET_STARTED.format(
        values="""(SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS at,
        json_extract(value, '$[2]') AS worker, json_extract(value, '$[3]') AS process,
        json_extract(value, '$[4]') AS deadline FROM json_each(%(rows)s)) AS v"""
    ),
)

#: Every run of the batch (starts and outcomes), locked in id order before any is changed:
#: the lock order of :mod:`.store` (an ``UPDATE ... FROM unnest`` locks in report order, and
#: deadlocked with the dispatcher's mark, which locks in id order). PostgreSQL only.
_LOCK_RUNS = Sql(f"SELECT id FROM boundedbeat_runs WHERE {_IN_IDS} ORDER BY id FOR UPDATE")

#: The outcomes' runs as the batch's starts left them (locked above).
_RUN_COLUMNS = (
    "id",
    "schedule",
    "incarnation",
    "started_at",
    "state",
    "error",
    "enqueued_at",
    "scheduled_for",
    "attempt",
)
_RUNS = Sql(
    f"SELECT {', '.join(_RUN_COLUMNS)} FROM boundedbeat_runs WHERE {_IN_IDS}",
    sqlite=f"SELECT {', '.join(_RUN_COLUMNS)} FROM boundedbeat_runs WHERE {_IN_IDS_SQLITE}",
)
_RUN_KINDS = kinds_of(cast(Table, RunRow.__table__).c[c] for c in _RUN_COLUMNS)

_SET_FINISHED = """
    UPDATE boundedbeat_runs AS r SET
        state = v.state, finished_at = v.at, elapsed_ms = v.elapsed, error = v.error,
        published_at = CASE WHEN r.published_at > v.at THEN v.at ELSE r.published_at END
    FROM {values}
    WHERE r.id = v.id
"""
#: Every outcome of the batch in one statement (the rows are locked by this transaction).
_FINISH = Sql(
    _SET_FINISHED.format(
        values="""unnest(
        CAST(%(ids)s AS text[]), CAST(%(states)s AS text[]), CAST(%(ats)s AS timestamptz[]),
        CAST(%(elapsed)s AS bigint[]), CAST(%(errors)s AS text[])
    ) AS v(id, state, at, elapsed, error)"""
    ),
    sqlite=_SET_FINISHED.format(
        values="""(SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS state,
        json_extract(value, '$[2]') AS at, json_extract(value, '$[3]') AS elapsed,
        json_extract(value, '$[4]') AS error FROM json_each(%(rows)s)) AS v"""
    ),
)

#: The schedules of the outcomes' runs, locked in name order before their runs (the lock
#: order of :mod:`.store`); a run's schedule never changes, so it is read unlocked.
_LOCK_SCHEDULES = Sql(
    f"name IN (SELECT schedule FROM boundedbeat_runs WHERE {_IN_IDS}) ORDER BY name FOR UPDATE",
    sqlite=f"name IN (SELECT schedule FROM boundedbeat_runs WHERE {_IN_IDS_SQLITE}) ORDER BY name",
)
_UNQUEUE = Sql(
    "DELETE FROM boundedbeat_queue WHERE run_id = ANY(CAST(%(ids)s AS text[]))",
    sqlite="DELETE FROM boundedbeat_queue WHERE run_id IN (SELECT value FROM json_each(%(ids)s))",
)


#: Seconds a batch waits for a row another transaction holds before it is kept and retried as
#: after an outage (a second later, with one log line): a wait is bounded and says why.
REPORT_LOCK_TIMEOUT = 5.0
_LOCK_TIMEOUT = Sql(f"SET LOCAL lock_timeout = {int(REPORT_LOCK_TIMEOUT * 1000)}")


class _Run(NamedTuple):
    id: str
    schedule: str
    incarnation: str | None
    started_at: datetime | None
    state: str
    error: str | None
    enqueued_at: datetime | None
    scheduled_for: datetime
    attempt: int


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
            store.run_life.heartbeat_in(s, beat.process, beat.hostname, beat.pid, beat.at)
        return _write(store, s, starts, outcomes, rng)


def _start_many(driver: Driver, starts: Sequence[StartReport]) -> None:
    if not starts:
        return
    # A run started twice in one batch (redelivered): its first start counts, as report by
    # report, and it ends up pointing at the process of the last.
    first: dict[str, StartReport] = {}
    last: dict[str, StartReport] = {}
    for r in starts:
        first.setdefault(r.run_id, r)
        last[r.run_id] = r
    params = driver.columns(
        ids=list(first),
        ats=[r.at for r in first.values()],
        workers=[last[i].worker for i in first],
        processes=[last[i].process for i in first],
        deadlines=[r.at + timedelta(seconds=r.limit) if r.limit else None for r in first.values()],
    )
    states = {
        "queued": RunState.QUEUED.value,
        "published": RunState.PUBLISHED.value,
        "started": RunState.STARTED.value,
    }
    driver.execute(_START, {**params, **states})


def _write(
    store: Store,
    s: Session,
    starts: Sequence[StartReport],
    outcomes: Sequence[OutcomeReport],
    rng: random.Random,
) -> list[Settled | None]:
    """The batch in three round trips (pipelines) and a commit, whatever its size.

    Each round trip is a wait the writer thread comes back from wanting the worker's GIL: a
    statement each, eight of them, cost the tasks more than the statements cost PostgreSQL.
    SQLite runs the same steps without the row locks (its one writer holds the database).
    """
    driver = Driver.of(s)
    outcome_ids = sorted({o.run_id for o in outcomes})
    held = None
    with driver.pipeline():
        if driver.postgres:  # a row held elsewhere (a frozen process): retried, logged
            driver.execute(_LOCK_TIMEOUT)
        # Lock order (:mod:`.store`): the outcomes' schedules, then every run of the batch by id.
        if outcome_ids:
            held = hold(s, _LOCK_SCHEDULES, {"ids": outcome_ids})
        if driver.postgres:
            driver.execute(_LOCK_RUNS, {"ids": sorted({r.run_id for r in starts} | set(outcome_ids))})
        _start_many(driver, starts)
        runs = _read_runs(driver, outcome_ids)
    settled, finished, repeats = _decide(store, s, outcomes, runs)
    if finished:
        assert held is not None
        with driver.pipeline():
            _write_finished(driver, finished)
        _count_on_schedules(store, s, held, runs, [x for x in settled if x is not None], finished, rng)
    for o in repeats:  # a second report of a run this batch settled: as it would be after it
        first, _ = finished[o.run_id]
        if first.state.value in _DECIDED_WITHOUT_THE_TASK and first.state != o.state:
            store.run_life.note_late_outcome(
                s, o.run_id, first.state.value, first.error, o.state, o.at, o.error
            )
    done = {r.run_id for r in starts} | set(finished)
    with driver.pipeline():
        if held is not None and finished:
            write_changed(driver, held)
            store.db.notify(s, SETTLED_CHANNEL, min(held.rows, default=""))
        if done:  # a started or settled run has no queue row left (a worker may beat the mark)
            driver.execute(_UNQUEUE, {"ids": sorted(done)})
    return settled


def _read_runs(driver: Driver, ids: list[str]) -> dict[str, _Run]:
    if not ids:
        return {}
    return {row[0]: _Run(*row) for row in driver.rows(_RUNS, {"ids": ids}, _RUN_KINDS)}


_Finished = dict[str, tuple[OutcomeReport, int | None]]


def _decide(
    store: Store, s: Session, outcomes: Sequence[OutcomeReport], runs: dict[str, _Run]
) -> tuple[list[Settled | None], _Finished, list[OutcomeReport]]:
    """Which outcomes settle their run: the first terminal state of a run wins, as in
    ``Store.settle_run``; also the repeats of a run this batch settles."""
    settled: list[Settled | None] = []
    finished: _Finished = {}
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
                store.run_life.note_late_outcome(s, o.run_id, run.state, run.error, o.state, o.at, o.error)
            settled.append(None)
            continue
        at = not_before(o.at, run.enqueued_at, run.started_at)
        if at != o.at:  # another host's clock stamped the run later: its times never go back
            o = replace(o, at=at)
        elapsed = elapsed_ms(run.started_at, at)
        finished[o.run_id] = (o, elapsed)
        settled.append(Settled(run_id=o.run_id, schedule=run.schedule, state=o.state, elapsed_ms=elapsed))
    return settled, finished, repeats


def _write_finished(driver: Driver, finished: _Finished) -> None:
    items = list(finished.values())
    params = driver.columns(
        ids=[o.run_id for o, _ in items],
        states=[o.state.value for o, _ in items],
        ats=[o.at for o, _ in items],
        elapsed=[elapsed for _, elapsed in items],
        errors=[o.error for o, _ in items],
    )
    driver.execute(_FINISH, params)


def _count_on_schedules(
    store: Store,
    s: Session,
    rows: HeldRows,
    runs: dict[str, _Run],
    settled: Sequence[Settled],
    finished: _Finished,
    rng: random.Random,
) -> None:
    """Free each settled run's slot on its schedule (held, locked), in report order: only on
    the incarnation that emitted it (:func:`~celery_boundedbeat.db.runs.settles_onto`)."""
    for x in settled:
        row = rows.get(x.schedule)
        if row is None or not settles_onto(row, runs[x.run_id].incarnation):
            continue
        report, elapsed = finished[x.run_id]
        run = runs[x.run_id]
        store.run_life.count_settled(
            s,
            row,
            x.state,
            elapsed,
            now=report.at,
            stop=report.stop,
            rng=rng,
            run_id=x.run_id,
            error=report.error,
            attempt=Attempt(run.scheduled_for, run.attempt),
        )
