"""A run's start recorded before its body runs (``begin_run``) and a duplicate delivery's
verdict (``Tracker.begin``); SQLite and PostgreSQL."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from helpers.clock import T0
from sqlalchemy import Engine, update
from sqlalchemy.exc import OperationalError

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.row_state import RUNTIME
from celery_boundedbeat.db.runs import Begun
from celery_boundedbeat.db.store import Store, utcnow
from celery_boundedbeat.db.tables import ScheduleRow
from celery_boundedbeat.worker.tracking import Tracker

RNG = random.Random(3)


@pytest.fixture
def store(migrated: Engine) -> Iterator[Store]:
    yield Store(migrated)


def emit(store: Store, now: datetime = T0) -> str:
    """One run of a runtime schedule ``s``, queued at ``now``."""
    built, problems = parse_entry("s", {"task": "t", "schedule": 10}, {})
    assert built is not None, problems
    store.sync_config([built], now, RNG)
    with store.session() as s:
        s.execute(update(ScheduleRow).where(ScheduleRow.name == "s").values(origin=RUNTIME))
    result = store.tick({"s": built}, now, RNG, 10)
    (emitted,) = result.emitted
    return emitted.id


def begin(store: Store, run_id: str, process: str, at: datetime = T0) -> Begun:
    return store.run_life.begin_run(run_id, worker="w", process=process, now=at, max_run_time=None)


def test_the_first_delivery_records_the_start_and_a_second_learns_who_started_it(store: Store) -> None:
    """begin_run: the first call starts the run; a second (another delivery) changes nothing and
    is told the state, process and start of the first."""
    run_id = emit(store)
    store.run_life.heartbeat("h:1", "h", 1, T0)
    assert begin(store, run_id, "h:1") == Begun(first=True)
    again = begin(store, run_id, "h:2", T0 + timedelta(seconds=1))
    assert again == Begun(first=False, state="started", process="h:1", started_at=T0, heartbeat_at=T0)
    run = store.run(run_id)
    assert run is not None and (run.state, run.process, run.started_at) == ("started", "h:1", T0)
    assert begin(store, "no-such-run", "h:2") == Begun(first=False)


def test_take_over_moves_a_started_run_once(store: Store) -> None:
    """Two redeliveries continuing a run whose first process died: only the first takes it."""
    run_id = emit(store)
    begin(store, run_id, "h:1")
    assert store.run_life.take_over_run(run_id, worker="w2", process="h:2", previous="h:1")
    assert not store.run_life.take_over_run(run_id, worker="w3", process="h:3", previous="h:1")
    run = store.run(run_id)
    assert run is not None and run.process == "h:2"


@pytest.fixture
def tracker(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tracker]:
    """A tracker on ``store``; its heartbeat and writer threads end with the test (``begin``
    starts them, and they would otherwise keep beating on this test's dropped database)."""
    from celery import Celery

    app = Celery("t", set_as_current=False)
    app.conf.boundedbeat_database_url = str(store.engine.url.render_as_string(hide_password=False))
    created = Tracker(app)
    monkeypatch.setattr(Tracker, "store", property(lambda self: store))
    yield created
    created.stop()


@pytest.mark.parametrize(
    ("first_process", "heartbeat_age", "runs"),
    [
        # Another host, its heartbeat fresh: it may still be running the body.
        ("elsewhere:1", 1.0, False),
        # Another host, silent for longer than the reaper allows: it is dead.
        ("elsewhere:1", 3600.0, True),
        # This host, a pid that no longer exists: dead, whatever its heartbeat says.
        (f"{socket.gethostname()}:{2**22 + 17}", 1.0, True),
        # This host, a live process (this one's parent): may still be running it.
        (f"{socket.gethostname()}:{os.getppid()}", 1.0, False),
    ],
)
def test_a_second_delivery_runs_only_when_the_first_process_can_no_longer_run_it(
    store: Store, tracker: Tracker, first_process: str, heartbeat_age: float, runs: bool
) -> None:
    """Tracker.begin: a delivery of a run another process started runs its body only when that
    process is gone (a continuation, which takes the run over); else it is skipped, the run kept."""
    run_id = emit(store, utcnow() - timedelta(seconds=5))
    now = utcnow()
    store.run_life.heartbeat(first_process, "x", 1, now - timedelta(seconds=heartbeat_age))
    begin(store, run_id, first_process, now - timedelta(seconds=2))
    assert tracker.begin(run_id, "w2", None) is runs
    run = store.run(run_id)
    assert run is not None and run.state == "started"
    assert run.process == (tracker.process if runs else first_process)


def test_a_celery_retry_continues_the_run_and_a_repeat_in_the_same_process_does_not(
    store: Store, tracker: Tracker
) -> None:
    """A delivery with retries > 0 continues the run it started; the same process receiving the
    run again without a retry (a duplicate) does not run it again."""
    run_id = emit(store, utcnow() - timedelta(seconds=5))
    assert tracker.begin(run_id, "w", None) is True
    assert tracker.begin(run_id, "w", None) is False
    assert tracker.begin(run_id, "w", None, retried=True) is True


def test_a_delivery_of_a_run_already_settled_after_its_start_does_not_run(
    store: Store, tracker: Tracker
) -> None:
    """A duplicate arriving after the first delivery completed the run: skipped."""
    run_id = emit(store, utcnow() - timedelta(seconds=5))
    begin(store, run_id, "elsewhere:1", utcnow() - timedelta(seconds=2))
    store.run_life.settle_run(run_id, RunState.COMPLETED, now=utcnow())
    assert tracker.begin(run_id, "w2", None) is False


def test_a_database_that_cannot_be_asked_lets_the_body_run_and_is_not_asked_by_every_task(
    store: Store, tracker: Tracker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outage at the start: the body runs (the start written behind), and the next start
    within a second does not wait for the database again."""
    asked: list[str] = []

    def away(run_id: str, **_: object) -> Begun:
        asked.append(run_id)
        raise OperationalError("begin", {}, ConnectionError("the database is away"))

    monkeypatch.setattr(store.run_life, "begin_run", away)
    assert tracker.begin("r1", "w", None) is True
    assert tracker.begin("r2", "w", None) is True
    assert asked == ["r1"]


def test_a_run_this_process_started_is_not_run_again_even_when_the_database_cannot_be_asked(
    store: Store, tracker: Tracker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message published again after a database restart (its publish never recorded, its
    claim expired) reaching the process that ran it while that process cannot ask the
    database: the process knows it started the run and does not run the body twice; a Celery
    retry still continues it."""

    def away(run_id: str, **_: object) -> Begun:
        raise OperationalError("begin", {}, ConnectionError("the database is away"))

    monkeypatch.setattr(store.run_life, "begin_run", away)
    assert tracker.begin("r1", "w", None) is True  # written behind, the body runs
    assert tracker.begin("r1", "w", None) is False  # still running here
    tracker.settle("r1", RunState.COMPLETED)
    assert tracker.begin("r1", "w", None) is False  # ran here already
    assert tracker.begin("r1", "w", None, retried=True) is True
    assert tracker.begin("r2", "w", None) is True


def test_with_the_check_turned_off_every_delivery_runs_and_starts_are_written_behind(
    store: Store, tracker: Tracker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """boundedbeat_skip_duplicate_deliveries = False: the start is not recorded before the body
    and a second delivery runs too (the cheaper write-behind of earlier versions)."""
    tracker.app.conf.boundedbeat_skip_duplicate_deliveries = False
    monkeypatch.setattr(store.run_life, "begin_run", lambda *a, **k: pytest.fail("begin_run was called"))
    assert tracker.begin("r1", "w", None) is True
    assert tracker.begin("r1", "w", None) is True


def test_the_setting_takes_only_true_or_false() -> None:
    from celery_boundedbeat.config.settings import Settings
    from celery_boundedbeat.core.exceptions import ConfigurationError

    conf = {"boundedbeat_database_url": "sqlite://", "boundedbeat_skip_duplicate_deliveries": "no"}
    with pytest.raises(ConfigurationError, match="skip_duplicate_deliveries"):
        Settings.from_conf(conf)
