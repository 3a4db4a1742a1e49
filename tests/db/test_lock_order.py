"""The lock order of :mod:`celery_boundedbeat.db.store`, hammered by concurrent transactions on
real PostgreSQL: schedules by name, then runs by id, then queue rows.

Each test races two writers that lock the same rows, round after round, with a short
``deadlock_timeout`` so a deadlock shows within the round instead of stalling a second. Any
error in either thread (``deadlock detected`` above all) fails the test, and every run must
end in the state the writers' rules give it.
"""

from __future__ import annotations

import itertools
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from helpers.clock import T0
from sqlalchemy import Engine, create_engine, insert, select, update

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.messages import message_options
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.db.claims import Claimed
from celery_boundedbeat.db.row_state import RUNTIME
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow, RunRow, ScheduleRow
from celery_boundedbeat.worker.worklog import OutcomeReport, StartReport, write_reports

pytestmark = pytest.mark.postgres

RUNS = 300
ROUNDS = 6
_ROUND = itertools.count()


@pytest.fixture
def engine(migrated_postgres_url: str) -> Iterator[Engine]:
    engine = create_engine(migrated_postgres_url, connect_args={"options": "-c deadlock_timeout=20ms"})
    yield engine
    engine.dispose()


def add_schedules(store: Store, names: list[str]) -> None:
    """Runtime schedules (``remove_schedule`` takes only those) with room for every run."""
    specs = []
    for name in names:
        raw = {"task": "t", "schedule": 10, "policy": {"mode": "fixed_rate", "max_concurrency": 1000}}
        built, problems = parse_entry(name, raw, {})
        assert built is not None, problems
        specs.append(built)
    store.sync_config(specs, T0, random.Random(1))
    with store.engine.begin() as conn:
        conn.execute(update(ScheduleRow).where(ScheduleRow.name.in_(names)).values(origin=RUNTIME))


def add_runs(store: Store, schedules: list[str], state: str) -> list[Claimed]:
    """``RUNS`` runs spread over ``schedules`` (their slots taken), each with its queue row."""
    run_rows, queue_rows = [], []
    at = T0 + timedelta(hours=next(_ROUND))
    for i in range(RUNS):
        run_id, name = str(uuid.uuid4()), schedules[i % len(schedules)]
        run_rows.append(
            {"id": run_id, "schedule": name, "task": "t", "state": state,
             "scheduled_for": at + timedelta(microseconds=i), "enqueued_at": T0, "drift_ms": 0,
             "started_at": T0 if state == "started" else None}
        )  # fmt: skip
        queue_rows.append(
            {"run_id": run_id, "task_id": run_id, "task": "t", "args": [], "kwargs": {},
             "options": message_options({}, Policy(), run_id, name), "due_at": T0, "enqueued_at": T0,
             "attempts": 0, "claimed_by": "d", "claimed_until": T0 + timedelta(hours=1)}
        )  # fmt: skip
    with store.engine.begin() as conn:
        conn.execute(insert(RunRow), run_rows)
        ids = list(conn.scalars(insert(QueueRow).returning(QueueRow.id), queue_rows))
        conn.execute(
            update(ScheduleRow)
            .where(ScheduleRow.name.in_(schedules))
            .values(active_runs=RUNS // len(schedules))
        )
    return [
        Claimed(id=qid, run_id=r["id"], task_id=r["id"], task="t", args=[], kwargs={}, options={}, due_at=T0)
        for qid, r in zip(ids, run_rows, strict=True)
    ]


def race(*writers: Callable[[], Any]) -> None:
    """Run the writers at once; re-raise the first error any of them met."""
    barrier = threading.Barrier(len(writers))
    errors: list[BaseException] = []

    def run(writer: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            writer()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a writer is stuck"
    if errors:
        raise errors[0]


def states(store: Store, ids: list[str]) -> set[str]:
    with store.session() as s:
        return set(s.scalars(select(RunRow.state).where(RunRow.id.in_(ids))))


def test_a_worker_batch_starting_runs_never_deadlocks_with_the_dispatchers_mark(engine: Engine) -> None:
    """A worker's batch of starts (in report order, the reverse of ids here) raced with the
    dispatcher marking the same runs published (by id): neither fails, every run is started."""
    worker, dispatcher = Store(engine), Store(engine)
    add_schedules(worker, ["s"])
    for _ in range(ROUNDS):
        claimed = add_runs(worker, ["s"], "queued")
        ids = sorted(c.run_id or "" for c in claimed)
        starts = [StartReport(run_id=i, worker="w", process="w:1", at=T0, limit=None) for i in reversed(ids)]
        race(
            lambda starts=starts: write_reports(worker, starts, []),
            lambda claimed=claimed: dispatcher.mark_published("d", list(reversed(claimed)), T0),
        )
        assert states(worker, ids) == {RunState.STARTED.value}


def test_a_worker_batch_settling_runs_never_deadlocks_with_remove_schedule_revoke_active(
    engine: Engine,
) -> None:
    """A worker's batch of outcomes (runs, then their schedules before the fix) raced with
    ``remove_schedule(revoke_active=True)`` (the schedule, then its runs): neither fails, and
    each run is settled exactly once, by one or the other."""
    worker, remover = Store(engine), Store(engine)
    for n in range(ROUNDS):
        names = [f"r{n}a", f"r{n}b"]
        add_schedules(worker, names)
        claimed = add_runs(worker, names, "started")
        ids = [c.run_id or "" for c in claimed]
        outcomes = [
            OutcomeReport(run_id=i, state=RunState.COMPLETED, at=T0, error=None, stop=False)
            for i in reversed(ids)
        ]
        race(
            lambda outcomes=outcomes: write_reports(worker, [], outcomes),
            lambda names=names: [remover.remove_schedule(name, T0, revoke_active=True) for name in names],
        )
        assert states(worker, ids) <= {RunState.COMPLETED.value, RunState.REVOKED.value}


def test_the_reaper_settling_runs_never_deadlocks_with_a_worker_batch(engine: Engine) -> None:
    """The reaper's settles (one run at a time) raced with a worker's batch of the same runs'
    outcomes across two schedules: neither fails, every run is settled."""
    worker, reaper = Store(engine), Store(engine)
    for n in range(ROUNDS):
        names = [f"p{n}a", f"p{n}b"]
        add_schedules(worker, names)
        claimed = add_runs(worker, names, "started")
        ids = [c.run_id or "" for c in claimed]
        outcomes = [
            OutcomeReport(run_id=i, state=RunState.COMPLETED, at=T0, error=None, stop=False) for i in ids
        ]
        race(
            lambda outcomes=outcomes: write_reports(worker, [], outcomes),
            lambda ids=ids: [
                reaper.run_life.settle_run(i, RunState.LOST, now=T0, error="lost") for i in reversed(ids)
            ],
        )
        assert states(worker, ids) <= {RunState.COMPLETED.value, RunState.LOST.value}
