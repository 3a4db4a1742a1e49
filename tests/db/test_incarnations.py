"""A schedule removed and added again under the same name is another schedule (docs/runtime-schedules.md).

The runs of the removed incarnation go on (``remove_schedule`` without ``revoke_active``, or
a ``beat_schedule`` entry dropped and restored across beat restarts) and settle onto nothing:
never onto the new schedule's slot, counters, failure streak, alerts or stop flag. Each run
keeps the incarnation that emitted it in ``boundedbeat_runs.incarnation``.

The beat is played by ``Store.tick`` with the resolver a beat uses, on SQLite and PostgreSQL;
a settle goes the way of a worker's single report (``Store.settle_run``) or of its batched
writer (``worklog.write_reports``, the PostgreSQL batch path there).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from celery import Celery
from helpers.clock import T0, sec
from sqlalchemy import Engine, MetaData, Table, insert, select, text

from celery_boundedbeat import add_schedule, history, remove_schedule, snapshot
from celery_boundedbeat.config.definitions import Resolver, define
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.core.spec import Definition
from celery_boundedbeat.db.migrate import upgrade
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import AlertRow, RunRow, ScheduleRow
from celery_boundedbeat.worker.worklog import OutcomeReport, write_reports

RNG = random.Random(5)


@pytest.fixture
def app(migrated: Engine, db_url: str) -> Celery:
    app = Celery("incarnations", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    return app


@pytest.fixture
def store(engine: Engine, app: Celery) -> Store:
    return Store(engine, failing_threshold=1)


Settle = Callable[[Store, str, RunState, datetime, bool], None]


def error_of(state: RunState) -> str | None:
    return None if state is RunState.COMPLETED else "boom"


def settle_one(store: Store, run_id: str, state: RunState, at: datetime, stop: bool) -> None:
    assert store.run_life.settle_run(run_id, state, now=at, stop=stop, error=error_of(state))


def settle_batched(store: Store, run_id: str, state: RunState, at: datetime, stop: bool) -> None:
    error = error_of(state)
    report = OutcomeReport(run_id=run_id, state=state, at=at, error=error, stop=stop)
    assert write_reports(store, [], [report]) != [None]


SETTLES = [pytest.param(settle_one, id="settle_run"), pytest.param(settle_batched, id="write_reports")]


def row(store: Store, name: str) -> ScheduleRow:
    (found,) = store.schedules([name])
    return found


def tick(app: Celery, store: Store, at: datetime) -> list[str]:
    """One beat tick at ``at``: the ids of the runs it emitted."""
    return [e.id for e in store.tick(Resolver(app, {}), at, RNG, 100).emitted]


def start(store: Store, run_id: str, at: datetime) -> None:
    assert store.run_life.start_run(run_id, worker="w@host", process="host:1", now=at, max_run_time=None)


def run_due(app: Celery, store: Store, name: str) -> tuple[str, datetime]:
    """Emit and start the schedule's due run: its id and the time it started."""
    due = row(store, name).next_due_at
    assert due is not None
    (run_id,) = tick(app, store, due)
    start(store, run_id, due)
    return run_id, due


def counters(r: ScheduleRow) -> dict[str, Any]:
    return {
        "active_runs": r.active_runs,
        "runs": r.runs,
        "failures": r.failures,
        "consecutive_failures": r.consecutive_failures,
        "failing_since": r.failing_since,
        "stopped": r.stopped,
        "stop_reason": r.stop_reason,
        "paused": r.paused,
        "pause_reason": r.pause_reason,
        "last_finished_at": r.last_finished_at,
    }


def alerts(store: Store) -> list[Any]:
    with store.session() as s:
        return list(s.execute(select(AlertRow.kind, AlertRow.schedule, AlertRow.run_id)).all())


def replaced_after_the_old_run(
    app: Celery, store: Store, policy: dict[str, Any] | None = None
) -> tuple[str, str, datetime]:
    """``x`` added, its run started, removed (the run goes on), added again and its first run
    started: ``(old run, new run, when the new one started)``."""
    assert add_schedule(app, "x", "proj.t", 10, policy=policy) == "scheduled"
    old_run, _ = run_due(app, store, "x")
    assert remove_schedule(app, "x") is True
    assert add_schedule(app, "x", "proj.t", 10, policy=policy) == "scheduled"
    new_run, at = run_due(app, store, "x")
    return old_run, new_run, at


@pytest.mark.parametrize("settle", SETTLES)
@pytest.mark.parametrize("outcome", [RunState.COMPLETED, RunState.FAILED])
def test_the_old_runs_settle_frees_no_slot_of_the_re_added_schedule(
    app: Celery, store: Store, settle: Settle, outcome: RunState
) -> None:
    """The old run ends while the new schedule's run is active: the new row does not move, no
    alert is written for it, and its next tick finds its one slot still taken (no overlap)."""
    old_run, new_run, at = replaced_after_the_old_run(app, store, policy={"pause_on_failure": 1})
    before = counters(row(store, "x"))
    assert before["active_runs"] == 1
    settle(store, old_run, outcome, at + sec(1), False)
    assert counters(row(store, "x")) == before
    assert alerts(store) == []
    next_due = row(store, "x").next_due_at
    assert next_due is not None
    assert tick(app, store, next_due) == [], "a second run of the new schedule while its first is active"
    # The new schedule's own run frees its own slot.
    settle(store, new_run, RunState.COMPLETED, next_due + sec(1), False)
    after = row(store, "x")
    assert (after.active_runs, after.runs) == (0, 1)


@pytest.mark.parametrize("settle", SETTLES)
def test_stop_schedule_in_the_old_run_stops_nothing_new(app: Celery, store: Store, settle: Settle) -> None:
    """``stop_schedule()`` called in the removed schedule's run leaves the new schedule running."""
    old_run, _new_run, at = replaced_after_the_old_run(app, store)
    settle(store, old_run, RunState.COMPLETED, at + sec(1), True)
    again = row(store, "x")
    assert (again.stopped, again.stop_reason, again.active_runs) == (False, None, 1)


def test_the_old_runs_stay_in_the_history_with_their_incarnation(app: Celery, store: Store) -> None:
    """Each run names the incarnation that emitted it; the removed one's runs stay, settled."""
    assert add_schedule(app, "x", "proj.t", 10) == "scheduled"
    (first,) = snapshot(app)
    old_run, at = run_due(app, store, "x")
    assert remove_schedule(app, "x") is True
    assert add_schedule(app, "x", "proj.t", 10) == "scheduled"
    (second,) = snapshot(app)
    assert first.incarnation and second.incarnation and first.incarnation != second.incarnation
    new_run, _ = run_due(app, store, "x")
    assert store.run_life.settle_run(old_run, RunState.COMPLETED, now=at + sec(1)) is not None
    seen = {r.id: (r.incarnation, r.state) for r in history(app, name="x")}
    assert seen == {
        old_run: (first.incarnation, RunState.COMPLETED),
        new_run: (second.incarnation, RunState.STARTED),
    }
    with store.engine.connect() as conn:
        joined = conn.execute(
            text(
                "SELECT r.id FROM boundedbeat_runs r JOIN boundedbeat_schedules s "
                "ON s.incarnation = r.incarnation WHERE s.name = 'x'"
            )
        ).scalars()
        assert list(joined) == [new_run]


def test_a_replace_tick_revokes_only_its_own_incarnations_run(app: Celery, store: Store) -> None:
    """``missed_ticks: "replace"`` gives its slot to a newer tick by revoking its own oldest run,
    never the removed schedule's (which holds none of its slots)."""
    old_run, new_run, _ = replaced_after_the_old_run(app, store, policy={"missed_ticks": "replace"})
    due = row(store, "x").next_due_at
    assert due is not None
    result = store.tick(Resolver(app, {}), due, RNG, 100)
    assert result.revoked == [new_run]
    old = store.run(old_run)
    assert old is not None and old.state == RunState.STARTED.value
    assert row(store, "x").active_runs == 1


def test_remove_with_revoke_active_revokes_only_this_incarnations_runs(
    app: Celery, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing the new schedule with ``revoke_active`` leaves the earlier one's run running."""
    calls: list[list[str]] = []
    monkeypatch.setattr(app.control, "revoke", lambda ids, **_kw: calls.append(sorted(ids)))
    old_run, new_run, _ = replaced_after_the_old_run(app, store)
    assert remove_schedule(app, "x", revoke_active=True) is True
    assert calls == [[new_run]]
    old = store.run(old_run)
    assert old is not None and old.state == RunState.STARTED.value


def config(app: Celery, name: str) -> Definition:
    return define(name, {"task": f"proj.{name}", "schedule": 10}, app, {})


@pytest.mark.parametrize("settle", SETTLES)
def test_a_config_entry_removed_and_restored_across_beat_starts_is_a_new_schedule(
    app: Celery, store: Store, settle: Settle
) -> None:
    """A ``beat_schedule`` entry dropped by one beat start and restored by the next (a rolled
    back deploy) is a new incarnation: the first one's run settles onto nothing of it."""
    store.sync_config([config(app, "c")], T0, RNG)
    first = row(store, "c").incarnation
    old_run, _ = run_due(app, store, "c")
    assert store.sync_config([], T0 + sec(1), RNG).removed == ["c"]
    assert store.sync_config([config(app, "c")], T0 + sec(2), RNG).added == ["c"]
    assert row(store, "c").incarnation != first
    new_run, at = run_due(app, store, "c")
    before = counters(row(store, "c"))
    settle(store, old_run, RunState.FAILED, at + sec(1), True)
    assert counters(row(store, "c")) == before
    assert alerts(store) == []
    with store.session() as s:
        owners = {r.id: r.incarnation for r in s.execute(select(RunRow.id, RunRow.incarnation))}
    assert owners == {old_run: first, new_run: row(store, "c").incarnation}


def test_a_restart_with_an_unchanged_entry_keeps_its_incarnation(app: Celery, store: Store) -> None:
    """Reconciling an entry that stayed (changed or not) keeps the schedule and its identity."""
    store.sync_config([config(app, "c")], T0, RNG)
    first = row(store, "c").incarnation
    store.sync_config([config(app, "c")], T0 + sec(1), RNG)
    changed = define("c", {"task": "proj.c", "schedule": 20}, app, {})
    assert store.sync_config([changed], T0 + sec(2), RNG).changed == ["c"]
    assert row(store, "c").incarnation == first


def test_incarnations_are_never_reused(app: Celery, store: Store) -> None:
    """Added and removed again and again, every schedule of the name gets a reference of its own."""
    seen = set()
    for _ in range(5):
        assert add_schedule(app, "x", "proj.t", 10) == "scheduled"
        seen.add(row(store, "x").incarnation)
        assert remove_schedule(app, "x") is True
    assert len(seen) == 5


def test_migration_0009_attributes_the_runs_it_can(engine: Engine) -> None:
    """0009 gives each schedule an incarnation and each run enqueued since its schedule's row
    was created that incarnation; an older run of the name (an earlier schedule) and a run of
    a name no longer present keep NULL. A NULL run still active settles by name, as before."""
    upgrade(engine, "0008_outbox_expired")
    schedules = Table("boundedbeat_schedules", MetaData(), autoload_with=engine)
    runs = Table("boundedbeat_runs", MetaData(), autoload_with=engine)
    assert "incarnation" not in schedules.c and "incarnation" not in runs.c
    counters = dict.fromkeys(
        ("runs", "skips", "busy_skips", "window_drops", "buffer_drops", "replaced", "overlaps",
         "failures", "pending_runs", "grid_runs", "consecutive_failures"),
        0,
    )  # fmt: skip
    with engine.begin() as conn:
        conn.execute(
            insert(schedules).values(
                name="m", task="proj.m", mode="fixed_rate_no_overlap", policy=Policy().to_json(),
                schedule="every 10s", period=10.0, args=[], kwargs={}, options={}, origin="config",
                config_hash="", version=1, paused=False, stopped=False, active_runs=1, pending=[],
                triggers=[], backfill=[], grid_at=T0, next_due_at=T0 + sec(20), created_at=T0,
                updated_at=T0, **counters,
            )
        )  # fmt: skip
        for run_id, name, at, state in [
            ("before", "m", T0 - sec(30), RunState.COMPLETED.value),
            ("after", "m", T0 + sec(10), RunState.STARTED.value),
            ("gone", "removed", T0 + sec(10), RunState.COMPLETED.value),
        ]:
            conn.execute(
                insert(runs).values(
                    id=run_id, schedule=name, task="proj.m", state=state, scheduled_for=at, enqueued_at=at
                )
            )
    upgrade(engine)
    store = Store(engine)
    incarnation = row(store, "m").incarnation
    assert incarnation
    with store.session() as s:
        owners = {r.id: r.incarnation for r in s.execute(select(RunRow.id, RunRow.incarnation))}
    assert owners == {"before": None, "after": incarnation, "gone": None}
    assert store.run_life.settle_run("after", RunState.COMPLETED, now=T0 + sec(11)) is not None
    assert (row(store, "m").active_runs, row(store, "m").runs) == (0, 1)
