"""Runtime schedules through the Python API (add, update, remove), on SQLite and on PostgreSQL.

An in-process Celery app points ``boundedbeat_database_url`` at the test's database; the beat
is played by ``Store.tick`` with the resolver a beat uses (``definitions.Resolver``), so every
schedule is run from its row alone. The API reads the real clock, so times are bracketed by
``utcnow()`` before and after each call.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.schedules import crontab, solar
from helpers.clock import sec
from sqlalchemy import Engine, event, func, select, text
from sqlalchemy.exc import ProgrammingError

from celery_boundedbeat import (
    ConfigurationError,
    ScheduleEndedError,
    UnknownScheduleError,
    add_schedule,
    history,
    remove_schedule,
    snapshot,
    update_schedule,
)
from celery_boundedbeat.config.definitions import Resolver, define
from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.spec import Definition
from celery_boundedbeat.core.timing import Timing
from celery_boundedbeat.db.engine import normalize_url
from celery_boundedbeat.db.store import REMOVED_WITH_REVOKE, SCHEDULES_CHANNEL, Store, utcnow
from celery_boundedbeat.db.tables import QueueRow, RunRow, ScheduleRow

RNG = random.Random(11)


@pytest.fixture
def app(migrated: Engine, db_url: str) -> Celery:
    """A Celery app on a migrated, empty database (memory broker: nothing is published here)."""
    app = Celery("rtapi", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    return app


@pytest.fixture
def store(engine: Engine, app: Celery) -> Store:
    return Store(engine)


@pytest.fixture
def revoked(app: Celery, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict[str, Any]]]:
    """Every ``app.control.revoke`` call, recorded instead of broadcast."""
    calls: list[tuple[list[str], dict[str, Any]]] = []
    monkeypatch.setattr(app.control, "revoke", lambda ids, **kw: calls.append((sorted(ids), kw)))
    return calls


def raw_row(store: Store, name: str) -> dict[str, Any]:
    """Every column of the schedule row as the driver returns it (no ORM type processing)."""
    with store.engine.connect() as conn:
        rows = [
            dict(r._mapping)
            for r in conn.execute(text("SELECT * FROM boundedbeat_schedules WHERE name = :n"), {"n": name})
        ]
    assert len(rows) == 1, rows
    return rows[0]


def row(store: Store, name: str) -> ScheduleRow:
    rows = store.schedules([name])
    assert len(rows) == 1, rows
    return rows[0]


def count(store: Store, model: Any) -> int:
    with store.session() as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def tick(app: Celery, store: Store, now: datetime) -> list[tuple[str, datetime]]:
    """One beat tick at ``now`` with schedules rebuilt from their rows; the runs it emitted."""
    result = store.tick(Resolver(app, {}), now, RNG, 100)
    return [(e.id, e.scheduled_for) for e in result.emitted]


def run_once(app: Celery, store: Store, name: str, outcome: RunState = RunState.COMPLETED) -> str:
    """Emit the schedule's due run, start it and settle it; its run id."""
    due = row(store, name).next_due_at
    assert due is not None
    emitted = tick(app, store, due)
    assert len(emitted) == 1, emitted
    run_id = emitted[0][0]
    assert store.run_life.start_run(run_id, worker="w@host", process="host:1", now=due, max_run_time=None)
    assert store.run_life.settle_run(run_id, outcome, now=due + sec(0.5)) is not None
    return run_id


def entry_of(
    task: Any, schedule: Any, *, args: Any = (), kwargs: Any = None, options: Any = None, policy: Any = None
) -> dict[str, Any]:
    """The beat_schedule entry an add_schedule call stands for."""
    entry: dict[str, Any] = {"task": task, "schedule": schedule, "args": args}
    entry["kwargs"] = {} if kwargs is None else kwargs
    entry["options"] = {} if options is None else options
    if policy is not None:
        entry["policy"] = policy
    return entry


def config_definition(app: Celery, name: str, schedule: Any = 10, **extra: Any) -> Definition:
    return define(name, {"task": f"proj.{name}", "schedule": schedule, **extra}, app, {})


# -- add ----------------------------------------------------------------------------------


def test_add_writes_a_runtime_row_due_from_now(app: Celery, store: Store) -> None:
    """add_schedule returns scheduled and writes the whole definition, version 1, due now, counters zero."""
    before = utcnow()
    outcome = add_schedule(
        app,
        "feed-1",
        "proj.poll",
        30,
        args=[1, "a"],
        kwargs={"k": 2},
        options={"queue": "q"},
        policy={"max_runs": 3},
    )
    after = utcnow()
    assert outcome == "scheduled"
    r = row(store, "feed-1")
    assert (r.origin, r.task, r.args, r.kwargs, r.options) == (
        "runtime",
        "proj.poll",
        [1, "a"],
        {"k": 2},
        {"queue": "q"},
    )
    assert r.timing == {"kind": "interval", "every": 30.0}
    assert (r.mode, r.period, r.schedule, r.policy["max_runs"]) == (
        "fixed_rate_no_overlap",
        30.0,
        "every 30s",
        3,
    )
    assert r.version == 1 and r.grid_at == r.next_due_at and r.next_due_at is not None
    assert before <= r.next_due_at <= after
    assert (r.runs, r.skips, r.failures, r.grid_runs, r.active_runs, r.stopped, r.stop_reason) == (
        0,
        0,
        0,
        0,
        0,
        False,
        None,
    )
    (snap,) = snapshot(app)
    assert (snap.name, snap.origin, snap.version, snap.stop_reason, snap.grid_runs) == (
        "feed-1",
        "runtime",
        1,
        None,
        0,
    )


def test_an_added_schedule_with_initial_delay_is_due_after_it(app: Celery, store: Store) -> None:
    """initial_delay puts the first tick that long after the add."""
    before = utcnow()
    add_schedule(app, "later", "proj.t", 10, policy={"initial_delay": 120})
    due = row(store, "later").next_due_at
    assert due is not None and before + sec(120) <= due <= utcnow() + sec(120)


def test_a_duplicate_add_leaves_the_row_byte_identical(app: Celery, store: Store) -> None:
    """A second add of a name, with another definition, returns already_present and changes no column."""
    add_schedule(app, "x", "proj.t", 10, args=[1])
    run_once(app, store, "x")
    before, runs = raw_row(store, "x"), count(store, RunRow)
    outcome = add_schedule(
        app, "x", "proj.other", crontab(minute="*/5"), args=[2], kwargs={"a": 1}, policy={"max_runs": 1}
    )
    assert outcome == "already_present"
    assert raw_row(store, "x") == before
    assert count(store, RunRow) == runs


def test_a_duplicate_of_a_config_schedule_leaves_it_untouched(app: Celery, store: Store) -> None:
    """A runtime add under a config schedule's name returns already_present; the config row stays."""
    store.sync_config([config_definition(app, "nightly")], utcnow(), RNG)
    before = raw_row(store, "nightly")
    assert add_schedule(app, "nightly", "proj.runtime", 5) == "already_present"
    assert raw_row(store, "nightly") == before
    assert row(store, "nightly").origin == "config"


def test_two_processes_adding_one_name_at_once_get_one_schedule(app: Celery, store: Store) -> None:
    """Concurrent adds of the same name: exactly one scheduled, the others already_present, one row."""
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def add(i: int) -> None:
        barrier.wait()
        outcomes.append(add_schedule(app, "race", f"proj.t{i}", 10))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == ["already_present"] * 3 + ["scheduled"]
    assert count(store, ScheduleRow) == 1


BAD = [
    pytest.param(dict(schedule=0), id="zero-period"),
    pytest.param(dict(schedule=-5), id="negative-period"),
    pytest.param(dict(schedule="every minute"), id="string-schedule"),
    pytest.param(dict(task=""), id="empty-task"),
    pytest.param(dict(policy={"mode": "sometimes"}), id="unknown-mode"),
    pytest.param(dict(schedule=crontab(minute=0), policy={"mode": "fixed_delay"}), id="fixed-delay-crontab"),
    pytest.param(dict(policy={"mode": "fixed_rate"}), id="fixed-rate-without-max-concurrency"),
    pytest.param(
        dict(policy={"mode": "fixed_delay", "missed_ticks": "catch_up", "max_pending": 2}),
        id="fixed-delay-catch-up",
    ),
    pytest.param(dict(policy={"bogus": 1}), id="unknown-policy-key"),
    pytest.param(dict(policy={"max_runs": 0}), id="max-runs-zero"),
    pytest.param(dict(policy={"max_runs": True}), id="max-runs-bool"),
    pytest.param(dict(policy={"catchup_window": 0}), id="catchup-window-zero"),
    pytest.param(dict(policy={"mode": "fixed_delay", "catchup_window": 5}), id="catchup-window-fixed-delay"),
    pytest.param(dict(policy={"missed_ticks": "replace", "max_pending": 2}), id="replace-max-pending"),
    pytest.param(dict(policy={"end_at": "tomorrow"}), id="end-at-not-iso"),
    pytest.param(dict(policy={"end_at": "2031-01-01T00:00:00"}), id="end-at-naive-text"),
    pytest.param(dict(policy={"end_at": datetime(2031, 1, 1)}), id="end-at-naive-datetime"),
    pytest.param(dict(policy=[("mode", "fixed_delay")]), id="policy-not-a-dict"),
    pytest.param(dict(args=[object()]), id="args-not-json"),
    pytest.param(dict(kwargs=[1]), id="kwargs-not-a-dict"),
    pytest.param(dict(options={"expires": object()}), id="options-not-json"),
    pytest.param(dict(task="t" * 256), id="task-name-too-long-for-its-column"),
    pytest.param(dict(schedule=0, policy={"mode": "sometimes", "max_runs": -1}), id="three-problems"),
]


@pytest.mark.parametrize("bad", BAD)
def test_bad_input_is_refused_with_the_beat_schedule_problems_and_writes_nothing(
    app: Celery, store: Store, bad: dict[str, Any]
) -> None:
    """add_schedule raises ConfigurationError with exactly the problems a beat_schedule entry gets; no row."""
    call: dict[str, Any] = {"task": "proj.t", "schedule": 10, **bad}
    task, schedule = call.pop("task"), call.pop("schedule")
    _spec, expected = parse_entry("bad", entry_of(task, schedule, **call), {})
    assert expected, "the case is not invalid for a beat_schedule entry"
    with pytest.raises(ConfigurationError) as info:
        add_schedule(app, "bad", task, schedule, **call)
    assert info.value.problems == expected
    for name, key, _reason in expected:
        assert f"entry {name!r}, key {key!r}" in str(info.value)
    assert count(store, ScheduleRow) == 0


def test_bad_input_under_an_existing_name_is_an_error_not_a_duplicate(app: Celery, store: Store) -> None:
    """Input is validated before the duplicate check: bad input for a taken name raises, changes nothing."""
    add_schedule(app, "x", "proj.t", 10)
    before = raw_row(store, "x")
    with pytest.raises(ConfigurationError) as info:
        add_schedule(app, "x", "proj.t", 0)
    assert [(k, r) for _n, k, r in info.value.problems] == [("schedule", "period must be > 0 seconds, got 0")]
    assert raw_row(store, "x") == before


@pytest.mark.parametrize("name", ["", "   ", "n" * 201, 7])
def test_a_name_must_be_a_short_non_empty_string(app: Celery, store: Store, name: Any) -> None:
    """Empty, blank, over-long and non-string names are refused naming the key 'name'."""
    with pytest.raises(ConfigurationError) as info:
        add_schedule(app, name, "proj.t", 10)
    assert [key for _n, key, _r in info.value.problems] == ["name"]
    assert count(store, ScheduleRow) == 0


def test_the_default_policy_setting_applies_to_added_schedules(app: Celery, store: Store) -> None:
    """boundedbeat_default_policy is merged under an added schedule's own policy keys."""
    app.conf.boundedbeat_default_policy = {"mode": "fixed_rate", "max_concurrency": 3, "max_run_time": 40}
    add_schedule(app, "x", "proj.t", 10, policy={"max_concurrency": 2})
    policy = row(store, "x").policy
    assert (policy["mode"], policy["max_concurrency"], policy["max_run_time"]) == ("fixed_rate", 2, 40)


# -- update -------------------------------------------------------------------------------

#: Columns any accepted change rewrites.
CHANGE_MARKERS = {"config_hash", "version", "updated_at"}


@pytest.mark.parametrize(
    ("change", "columns"),
    [
        ({"args": [2, 3]}, {"args"}),
        ({"kwargs": {"b": 2}}, {"kwargs"}),
        ({"options": {"queue": "other", "priority": 1}}, {"options"}),
        ({"task": "proj.renamed"}, {"task"}),
        ({"policy": {"max_run_time": 30}}, {"policy"}),
    ],
)
def test_update_changes_only_the_given_fields(
    app: Celery, store: Store, change: dict[str, Any], columns: set[str]
) -> None:
    """Updating one field rewrites that column and the change markers; grid, due time and counters stay."""
    add_schedule(
        app,
        "x",
        "proj.t",
        10,
        args=[1],
        kwargs={"a": 1},
        options={"queue": "q"},
        policy={"mode": "fixed_rate", "max_concurrency": 2},
    )
    run_once(app, store, "x")
    before = raw_row(store, "x")
    update_schedule(app, "x", **change)
    after = raw_row(store, "x")
    differ = {key for key in before if before[key] != after[key]}
    assert differ == columns | CHANGE_MARKERS, differ
    assert after["version"] == before["version"] + 1
    r = row(store, "x")
    assert (r.runs, r.grid_runs) == (1, 1)
    for key, value in change.items():
        if key == "policy":
            assert r.policy["max_run_time"] == 30 and r.policy["max_concurrency"] == 2
        else:
            assert getattr(r, key) == value


def test_update_policy_keys_merge_over_the_current_policy(app: Celery, store: Store) -> None:
    """Given policy keys override the stored ones, the rest stay; None drops a key back to its default."""
    add_schedule(app, "x", "proj.t", 10, policy={"mode": "fixed_rate", "max_concurrency": 2, "jitter": 0.5})
    update_schedule(app, "x", policy={"max_runs": 5})
    p = row(store, "x").policy
    assert (p["mode"], p["max_concurrency"], p["jitter"], p["max_runs"]) == ("fixed_rate", 2, 0.5, 5)
    update_schedule(app, "x", policy={"jitter": None, "max_runs": None})
    p = row(store, "x").policy
    assert (p["mode"], p["max_concurrency"], p["jitter"], p["max_runs"]) == ("fixed_rate", 2, None, None)
    with pytest.raises(ConfigurationError) as info:
        update_schedule(app, "x", policy={"mode": "fixed_rate_no_overlap"})  # max_concurrency still there
    assert [key for _n, key, _r in info.value.problems] == ["policy.max_concurrency"]
    update_schedule(app, "x", policy={"mode": "fixed_rate_no_overlap", "max_concurrency": None})
    assert row(store, "x").mode == "fixed_rate_no_overlap"


def test_an_invalid_update_raises_and_changes_nothing(app: Celery, store: Store) -> None:
    """An update that would make the schedule invalid raises the entry's problems and leaves the row."""
    add_schedule(app, "x", "proj.t", 10)
    before = raw_row(store, "x")
    for change in ({"schedule": 0}, {"policy": {"mode": "bogus"}}, {"args": "not-a-list"}, {"policy": [1]}):
        with pytest.raises(ConfigurationError):
            update_schedule(app, "x", **change)
        assert raw_row(store, "x") == before, change


def test_an_update_that_changes_nothing_keeps_the_version(app: Celery, store: Store) -> None:
    """Updating a field to the value it has already changes no column."""
    add_schedule(app, "x", "proj.t", 10, args=[1], policy={"max_runs": 4})
    before = raw_row(store, "x")
    update_schedule(app, "x", args=[1], schedule=10.0, policy={"max_runs": 4})
    assert raw_row(store, "x") == before


def test_a_new_period_restarts_the_grid_at_the_change_without_a_retroactive_tick(
    app: Celery, store: Store
) -> None:
    """10 s -> 30 s: the next run is at the change, none on the old grid in between; counters kept."""
    add_schedule(app, "x", "proj.t", 10)
    added_at = row(store, "x").grid_at
    assert added_at is not None
    run_once(app, store, "x")
    changed_from = utcnow()
    update_schedule(app, "x", schedule=30)
    changed_to = utcnow()
    r = row(store, "x")
    assert (r.period, r.schedule, r.runs, r.version) == (30.0, "every 30s", 1, 2)
    assert r.grid_at is not None and changed_from <= r.grid_at <= changed_to
    # A beat looking only now, 25 s after the add, passed the old grid's ticks at +10 and +20.
    emitted = tick(app, store, added_at + sec(25))
    assert [at for _id, at in emitted] == [r.grid_at]
    assert row(store, "x").next_due_at == r.grid_at + sec(30)
    times = sorted(run.scheduled_for for run in store.runs(name="x"))
    assert times == [added_at, r.grid_at]


def test_a_new_crontab_timing_starts_at_its_first_tick_after_the_change(app: Celery, store: Store) -> None:
    """Changing an interval to a crontab puts the grid on the crontab's first tick after the change."""
    add_schedule(app, "x", "proj.t", 10)
    changed_from = utcnow()
    update_schedule(app, "x", schedule=crontab(minute="*/5"))
    r = row(store, "x")
    assert r.timing is not None and r.timing["kind"] == "crontab" and r.period is None
    assert r.grid_at is not None and r.grid_at >= changed_from
    assert r.grid_at.minute % 5 == 0 and (r.grid_at.second, r.grid_at.microsecond) == (0, 0)
    assert r.grid_at - changed_from <= timedelta(minutes=5)


def test_updating_the_args_of_a_crontab_with_set_fields_keeps_its_grid_and_schedule_text(
    app: Celery, store: Store
) -> None:
    """A crontab given a set of minutes keeps its schedule text, grid and due time when only args change."""
    add_schedule(app, "x", "proj.t", crontab(minute={0, 30}))
    before = raw_row(store, "x")
    update_schedule(app, "x", args=[1])
    after = raw_row(store, "x")
    differ = {key for key in before if before[key] != after[key]}
    assert differ == {"args"} | CHANGE_MARKERS, differ


def test_update_of_an_unknown_name_raises_unknown_schedule_error(app: Celery, store: Store) -> None:
    """update_schedule of a name nobody added raises UnknownScheduleError naming it; remove returns False."""
    with pytest.raises(UnknownScheduleError, match="'ghost'"):
        update_schedule(app, "ghost", args=[1])
    assert remove_schedule(app, "ghost") is False
    assert count(store, ScheduleRow) == 0


def test_update_and_remove_refuse_a_config_schedule(app: Celery, store: Store) -> None:
    """A config schedule cannot be changed or removed through the API; its row stays as it was."""
    store.sync_config([config_definition(app, "nightly")], utcnow(), RNG)
    before = raw_row(store, "nightly")
    with pytest.raises(ConfigurationError) as info:
        update_schedule(app, "nightly", args=[1])
    assert [(n, k) for n, k, _r in info.value.problems] == [("nightly", "origin")]
    assert "change the config" in str(info.value)
    with pytest.raises(ConfigurationError):
        remove_schedule(app, "nightly", revoke_active=True)
    assert raw_row(store, "nightly") == before


# -- remove -------------------------------------------------------------------------------


def test_remove_keeps_the_history(app: Celery, store: Store, revoked: list[Any]) -> None:
    """remove_schedule deletes the schedule and keeps its runs; a second remove returns False."""
    add_schedule(app, "x", "proj.t", 10)
    run_id = run_once(app, store, "x")
    assert remove_schedule(app, "x") is True
    assert snapshot(app) == []
    assert [(r.id, r.state) for r in history(app, name="x")] == [(run_id, RunState.COMPLETED)]
    assert remove_schedule(app, "x") is False
    assert revoked == []


def test_remove_without_revoke_lets_active_runs_finish_and_be_recorded(
    app: Celery, store: Store, revoked: list[Any]
) -> None:
    """Without revoke_active an active run stays started and later settles normally; nothing is revoked."""
    add_schedule(app, "x", "proj.t", 10)
    due = row(store, "x").next_due_at
    assert due is not None
    ((run_id, _at),) = tick(app, store, due)
    store.run_life.start_run(run_id, worker="w@host", process="host:1", now=due, max_run_time=None)
    assert remove_schedule(app, "x") is True
    run = store.run(run_id)
    assert run is not None and run.state == "started"
    settled = store.run_life.settle_run(run_id, RunState.COMPLETED, now=due + sec(1))
    assert settled is not None and settled.state is RunState.COMPLETED
    assert revoked == []


def test_remove_with_revoke_active_settles_every_active_run_revoked(
    app: Celery, store: Store, revoked: list[Any]
) -> None:
    """revoke_active settles the started and the queued run revoked, drops their queue rows, revokes them."""
    add_schedule(app, "x", "proj.t", 10, policy={"mode": "fixed_rate", "max_concurrency": 3})
    done = run_once(app, store, "x")
    grid = row(store, "x").next_due_at
    assert grid is not None
    ((started, _), (queued, _)) = [*tick(app, store, grid), *tick(app, store, grid + sec(10))]
    store.run_life.start_run(started, worker="w@host", process="host:1", now=grid, max_run_time=None)
    before_remove = utcnow()
    assert remove_schedule(app, "x", revoke_active=True) is True
    states = {r.id: (r.state, r.error) for r in history(app, name="x")}
    assert states == {
        done: (RunState.COMPLETED, None),
        started: (RunState.REVOKED, REMOVED_WITH_REVOKE),
        queued: (RunState.REVOKED, REMOVED_WITH_REVOKE),
    }
    for run_id in (started, queued):
        run = store.run(run_id)
        assert run is not None and run.finished_at is not None and run.finished_at >= before_remove
    assert count(store, QueueRow) == 0
    assert revoked == [(sorted([started, queued]), {"terminate": True})]
    # The worker's own report of the terminated task comes later and changes nothing.
    assert store.run_life.settle_run(started, RunState.REVOKED, now=utcnow()) is None
    assert store.run_life.settle_run(started, RunState.COMPLETED, now=utcnow()) is None


def test_remove_schedule_revoking_returns_the_ids_it_revoked(
    app: Celery, store: Store, revoked: list[Any]
) -> None:
    """remove_schedule_revoking says which runs it revoked: the active ones with revoke_active, none
    without, and None for a name that is not there."""
    from celery_boundedbeat.api.schedules import remove_schedule_revoking

    for name in ("x", "y"):
        add_schedule(app, name, "proj.t", 10)
        due = row(store, name).next_due_at
        assert due is not None
        tick(app, store, due)
    (active,) = [r.id for r in history(app, name="x")]
    assert remove_schedule_revoking(app, "x", revoke_active=True) == (active,)
    assert remove_schedule_revoking(app, "y") == ()
    assert remove_schedule_revoking(app, "y") is None
    assert revoked == [([active], {"terminate": True})]


def test_remove_with_revoke_active_settles_even_if_the_broadcast_fails(
    app: Celery, store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker that refuses the revoke broadcast still leaves the run settled revoked, with a warning."""
    add_schedule(app, "x", "proj.t", 10)
    due = row(store, "x").next_due_at
    assert due is not None
    ((run_id, _),) = tick(app, store, due)

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr(app.control, "revoke", refuse)
    with caplog.at_level(logging.WARNING, logger="celery_boundedbeat"):
        assert remove_schedule(app, "x", revoke_active=True) is True
    run = store.run(run_id)
    assert run is not None and run.state == "revoked"
    assert "could not ask the workers" in caplog.text and "broker down" in caplog.text


# -- ownership ----------------------------------------------------------------------------


def test_config_reconciling_never_touches_a_runtime_schedule(
    app: Celery, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """sync_config with a clashing entry, or without the runtime one, leaves its row; the clash is logged."""
    add_schedule(app, "tenant-7", "proj.t", 10)
    run_once(app, store, "tenant-7")
    before = raw_row(store, "tenant-7")
    clash = config_definition(app, "tenant-7", 99)
    with caplog.at_level(logging.WARNING, logger="celery_boundedbeat"):
        report = store.sync_config([clash, config_definition(app, "nightly")], utcnow(), RNG)
    assert (report.clashes, report.added, report.changed, report.removed) == (
        ["tenant-7"],
        ["nightly"],
        [],
        [],
    )
    assert raw_row(store, "tenant-7") == before
    assert "tenant-7" in caplog.text and "the schedule in the table wins" in caplog.text
    report = store.sync_config([], utcnow(), RNG)  # a beat whose config has nothing at all
    assert (report.removed, report.clashes) == (["nightly"], [])
    assert raw_row(store, "tenant-7") == before


# -- ending -------------------------------------------------------------------------------


def test_an_ended_schedule_is_not_resumed_but_an_update_revives_it(app: Celery, store: Store) -> None:
    """max_runs 1: after its run it is stopped (max_runs); resume raises, max_runs 2 by update revives it."""
    add_schedule(app, "x", "proj.t", 10, policy={"max_runs": 1})
    run_once(app, store, "x")
    (snap,) = snapshot(app)
    assert (snap.stopped, snap.stop_reason, snap.grid_runs, snap.next_due_at) == (True, "max_runs", 1, None)
    with pytest.raises(ScheduleEndedError, match="max_runs"):
        store.set_paused("x", False, utcnow())
    update_schedule(app, "x", args=[1])  # another change, the bound still reached
    assert snapshot(app)[0].stopped is True
    changed_from = utcnow()
    update_schedule(app, "x", policy={"max_runs": 2})
    (snap,) = snapshot(app)
    assert (snap.stopped, snap.stop_reason, snap.runs, snap.grid_runs) == (False, None, 1, 1)
    assert snap.next_due_at is not None and snap.next_due_at >= changed_from
    run_once(app, store, "x")
    (snap,) = snapshot(app)
    assert (snap.stopped, snap.stop_reason, snap.runs, snap.grid_runs) == (True, "max_runs", 2, 2)


def test_an_end_at_already_past_at_add_emits_nothing(app: Celery, store: Store) -> None:
    """A schedule added with end_at in the past is accepted and ends at its first tick without a run."""
    past = (utcnow() - sec(60)).isoformat()
    assert add_schedule(app, "x", "proj.t", 10, policy={"end_at": past}) == "scheduled"
    assert tick(app, store, utcnow()) == []
    (snap,) = snapshot(app)
    assert (snap.stopped, snap.stop_reason) == (True, "end_at")
    assert count(store, RunRow) == 0


# -- the definition through the database --------------------------------------------------


def ticks_from(timing: Timing, start: datetime, n: int) -> list[datetime]:
    out = [timing.first_at_or_after(start)]
    while len(out) < n:
        out.append(timing.passed(out[-1], out[-1])[2])
    return out


SCHEDULES: dict[str, Callable[[Celery], Any]] = {
    "seconds": lambda app: 12.5,
    "timedelta": lambda app: timedelta(hours=1, seconds=3),
    "crontab-sets": lambda app: crontab(minute={5, 35}, hour=[2, 3], day_of_week="mon-fri", app=app),
    "crontab-text": lambda app: crontab(minute="0", hour="*/6", day_of_month="1-7", app=app),
    "solar": lambda app: solar("sunrise", -33.87, 151.21, app=app),
}


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_a_stored_schedule_rebuilt_from_its_row_ticks_like_the_original(
    app: Celery, store: Store, kind: str
) -> None:
    """The row add_schedule wrote, read back from the database, rebuilds the same next ticks (non-UTC app)."""
    app.conf.timezone = "America/New_York"
    schedule = SCHEDULES[kind](app)
    add_schedule(app, "x", "proj.t", schedule)
    original = define("x", entry_of("proj.t", schedule), app, {}).spec.timing
    rebuilt = Resolver(app, {})(row(store, "x"))
    assert rebuilt is not None
    start = utcnow()
    expected, got = ticks_from(original, start, 6), ticks_from(rebuilt.timing, start, 6)
    assert all(abs((a - b).total_seconds()) < 1 for a, b in zip(expected, got, strict=True)), (expected, got)
    assert len(set(expected)) == 6


# -- PostgreSQL notifications ---------------------------------------------------------------


@pytest.fixture
def listener(db_url: str, app: Celery) -> Iterator[psycopg.Connection[Any]]:
    """A connection listening on the schedules channel (SQLite beats poll instead)."""
    conninfo = normalize_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"LISTEN {SCHEDULES_CHANNEL}")
        yield conn


def notified(conn: psycopg.Connection[Any]) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=2, stop_after=1)]


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_each_change_notifies_the_schedules_channel_with_its_name(
    app: Celery, listener: psycopg.Connection[Any]
) -> None:
    """On PostgreSQL add, update and remove each NOTIFY the schedule's name; a duplicate add does not."""
    add_schedule(app, "x", "proj.t", 10)
    assert notified(listener) == ["x"]
    assert add_schedule(app, "x", "proj.t", 10) == "already_present"
    update_schedule(app, "x", args=[1])
    assert notified(listener) == ["x"], "a duplicate add notified, or the update did not"
    assert remove_schedule(app, "x")
    assert notified(listener) == ["x"]


def test_a_beat_never_runs_a_re_added_schedule_from_the_removed_ones_copy(app: Celery, store: Store) -> None:
    """Removed and added again (version 1 both times) with another period, the resolver rebuilds it."""
    resolve = Resolver(app, {})
    add_schedule(app, "x", "proj.t", 10)
    first = resolve(row(store, "x"))
    assert first is not None and first.period == 10
    assert remove_schedule(app, "x")
    add_schedule(app, "x", "proj.t", 20)
    assert row(store, "x").version == 1
    again = resolve(row(store, "x"))
    assert again is not None and again.period == 20


def test_a_name_added_again_at_the_instant_of_its_old_run_starts_after_that_run(
    app: Celery, store: Store
) -> None:
    """The old run's grid time is never repeated: on PostgreSQL this is the add that cannot be
    decided in one statement (the name has runs) and goes the general way."""
    d = define("again", entry_of("proj.t", 10), app, {})
    now = utcnow()
    assert store.add_schedule(d, now, RNG)
    emitted = tick(app, store, now)
    assert [at for _, at in emitted] == [now]
    assert remove_schedule(app, "again")
    assert store.add_schedule(d, now, RNG), "re-adding a removed name said already present"
    again = row(store, "again")
    assert again.next_due_at is not None and again.next_due_at > now, again.next_due_at
    assert store.add_schedule(d, now, RNG) is False


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_an_update_waiting_for_a_tick_holding_the_row_starts_its_grid_after_that_ticks_run(
    app: Celery, store: Store
) -> None:
    """A prepared tick holds the row while its run is written; an update made meanwhile waits
    for it and must see that run (read after the lock), or its new grid would repeat it."""
    add_schedule(app, "held", "proj.t", 10)
    later = utcnow() + sec(1)  # the tick's run is due after the update's ``now``
    errors: list[BaseException] = []

    def update() -> None:
        try:
            update_schedule(app, "held", schedule=3)
        except BaseException as exc:  # reported to the test's thread, asserted below
            errors.append(exc)

    with store.session() as s:
        s.execute(select(ScheduleRow.name).where(ScheduleRow.name == "held").with_for_update())
        s.add(
            RunRow(
                id="tick-run",
                schedule="held",
                task="proj.t",
                state="queued",
                scheduled_for=later,
                enqueued_at=later,
            )
        )
        s.flush()
        worker = threading.Thread(target=update)
        worker.start()
        waiting = text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
        deadline = utcnow() + sec(10)
        with store.engine.connect() as probe:
            while not probe.execute(waiting).scalar() and utcnow() < deadline:
                probe.rollback()
        assert utcnow() < deadline, "the update never waited for the row lock"
    worker.join(10)
    assert not errors, errors
    first = row(store, "held").next_due_at
    assert first is not None and first > later, (
        f"the new grid starts at {first}, not after the run at {later}"
    )


def test_a_tick_reads_the_definitions_of_the_schedules_it_rebuilds_in_one_query(
    app: Celery, store: Store, engine: Engine
) -> None:
    """A tick rebuilding 50 changed schedules sends as many statements as one rebuilding 5:
    the definitions come in one query, not one each (the beat's largest cost under changes)."""
    statements: list[str] = []

    def counted(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    counts = []
    for batch, n in (("a", 5), ("b", 50)):
        for i in range(n):
            add_schedule(app, f"{batch}-{i}", "proj.t", 600)
        statements.clear()
        event.listen(engine, "before_cursor_execute", counted)
        try:
            emitted = tick(app, store, utcnow())
        finally:
            event.remove(engine, "before_cursor_execute", counted)
        assert len(emitted) == n, emitted
        counts.append(len(statements))
    assert counts[0] == counts[1], f"statements per tick: {counts} for 5 and 50 rebuilt schedules"


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_database_errors_of_the_direct_postgresql_path_are_sqlalchemy_errors(
    app: Celery, store: Store
) -> None:
    """add, update and remove talk to psycopg directly on PostgreSQL; what the database refuses
    still reaches the caller as ``sqlalchemy.exc.DBAPIError`` (here: the table is gone)."""
    add_schedule(app, "x", "proj.t", 10)
    with store.engine.begin() as conn:
        conn.execute(text("ALTER TABLE boundedbeat_schedules RENAME TO boundedbeat_elsewhere"))
    try:
        for call in (
            lambda: add_schedule(app, "y", "proj.t", 10),
            lambda: update_schedule(app, "x", schedule=5),
            lambda: remove_schedule(app, "x"),
        ):
            with pytest.raises(ProgrammingError, match="boundedbeat_schedules"):
                call()
    finally:
        with store.engine.begin() as conn:
            conn.execute(text("ALTER TABLE boundedbeat_elsewhere RENAME TO boundedbeat_schedules"))
