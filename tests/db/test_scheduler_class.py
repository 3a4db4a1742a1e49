"""The beat class in-process: Celery's scheduler contract, banner, retention, lease and recorded ticks."""

from __future__ import annotations

import logging
import random
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy.exc import OperationalError

from celery_boundedbeat.beat.scheduler import Scheduler, reaper_grace
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.lease import LEASE_NAME
from celery_boundedbeat.db.store import Store


def _app(url: str, **conf: object) -> Celery:
    app = Celery("schedtest", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = url
    app.conf.update(conf)
    return app


def _free_app(url: str, count: int, period: float, **conf: object) -> tuple[Celery, list[str]]:
    """``count`` schedules with room for every run (``fixed_rate``), so every due tick emits."""
    free = {"mode": "fixed_rate", "max_concurrency": 10}
    names = [f"free{i}" for i in range(count)]
    schedule = {n: {"task": f"proj.{n}", "schedule": period, "options": {"policy": free}} for n in names}
    return _app(url, beat_schedule=schedule, **conf), names


def test_the_lazy_banner_scheduler_does_no_io_and_hides_the_password() -> None:
    """Celery's lazy banner scheduler touches no database and never prints the password."""
    app = _app("postgresql+psycopg://bob:s3cr3t@127.0.0.1:1/nowhere")
    scheduler = Scheduler(app, lazy=True)
    info = scheduler.info
    assert "s3cr3t" not in info
    assert "127.0.0.1:1/nowhere" in info
    assert scheduler._store is None


def test_retention_purges_old_settled_runs_from_the_beat_loop(sqlite_url: str) -> None:
    """With boundedbeat_retention_days set, the lease holder's retention thread deletes older settled runs."""
    app = _app(
        sqlite_url,
        boundedbeat_retention_days=1,
        boundedbeat_dispatch_enabled=False,
        boundedbeat_poll_interval=0.05,
        beat_schedule={"keep": {"task": "proj.keep", "schedule": 3600.0}},
    )
    scheduler = Scheduler(app)
    try:
        store: Store = scheduler.store
        spec = scheduler._config["keep"].spec
        old = datetime.now(UTC) - timedelta(days=3)
        rng = random.Random(0)
        # The rows exist once a lease holder reconciled them (as the first tick would).
        store.sync_config(scheduler._config.values(), datetime.now(UTC), rng)
        with store.session() as s:
            from celery_boundedbeat.db.tables import ScheduleRow

            row = s.get(ScheduleRow, "keep")
            assert row is not None
            row.next_due_at = old
            row.grid_at = old
        emitted = store.tick({"keep": spec}, old, rng, 10).emitted
        assert len(emitted) == 1
        store.run_life.settle_run(emitted[0].id, RunState.COMPLETED, now=old + timedelta(seconds=1))
        scheduler.tick()  # takes the lease, which wakes the retention thread
        deadline = time.monotonic() + 10
        while store.run(emitted[0].id) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.run(emitted[0].id) is None, "the old settled run is purged off the tick thread"
        fresh = [r for r in store.runs(name="keep") if r.id != emitted[0].id]
        assert fresh, "the tick itself still emitted the current run"
        assert all(r.enqueued_at > old for r in fresh)
    finally:
        scheduler.close()


def _quiet_app(url: str, beat_schedule: dict[str, Any] | None = None) -> Celery:
    return _app(
        url,
        boundedbeat_dispatch_enabled=False,
        boundedbeat_poll_interval=0.05,
        beat_schedule=beat_schedule or {"keep": {"task": "proj.keep", "schedule": 3600.0}},
    )


def test_one_beat_schedules_the_other_stands_by_and_takes_over_after_close(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first beat holds the lease, the second says once who does, and takes over once the first closes."""
    first, second = Scheduler(_quiet_app(sqlite_url)), Scheduler(_quiet_app(sqlite_url))
    try:
        with caplog.at_level(logging.INFO, logger="celery_boundedbeat"):
            first.tick()
            second.tick()
            second.lease.next_renewal_at = 0.0
            second.tick()
        messages = [r.getMessage() for r in caplog.records]
        assert f"celery_boundedbeat: {first.lease.holder} holds the beat lease; scheduling" in messages
        standing = [m for m in messages if "is standing by" in m]
        assert standing == [
            f"celery_boundedbeat: {second.lease.holder} is standing by; "
            f"the beat lease is held by {first.lease.holder}"
        ]
        assert first.lease.acting() and not second.lease.acting()
        first.close()
        assert first.store.lease_holder(LEASE_NAME, datetime.now(UTC)) is None, "released on close"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="celery_boundedbeat"):
            second.lease.next_renewal_at = 0.0
            second.tick()
        assert f"celery_boundedbeat: {second.lease.holder} holds the beat lease; scheduling" in caplog.text
        assert second.lease.acting()
    finally:
        first.close()
        second.close()


def test_a_tick_lost_to_the_database_is_recorded_when_it_returns(
    sqlite_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ticks lost to the database are logged once, recorded once it returns, and hold the reaper back."""
    scheduler = Scheduler(_quiet_app(sqlite_url))
    try:
        store = scheduler.store
        scheduler.tick()  # lease, tick, reap and chores all done: nothing else is due for a while
        real_tick, down = store.tick, [True]

        def tick(*args: Any, **kwargs: Any) -> Any:
            if down[0]:
                raise OperationalError("SELECT 1", {}, ConnectionRefusedError("refused"))
            return real_tick(*args, **kwargs)

        monkeypatch.setattr(store, "tick", tick)
        clock = [0.0]  # the outage lasts 5 s: long enough for workers to have missed heartbeats
        monkeypatch.setattr(scheduler._recorder, "_clock", lambda: clock[0])
        with caplog.at_level(logging.INFO, logger="celery_boundedbeat"):
            scheduler.tick()
            scheduler.tick()
            assert scheduler._recorder.unwritten == 2, "kept, not written, while the database is out"
            assert scheduler._reap_not_before == 0.0
            down[0] = False
            clock[0] = 5.0
            scheduler.tick()
        failed = "celery_boundedbeat: beat tick failed; retrying"
        tracebacks = [r for r in caplog.records if r.getMessage() == failed]
        assert len(tracebacks) == 1 and tracebacks[0].exc_info is not None
        assert "is reachable again" in caplog.text
        assert scheduler._reap_not_before > 0
        with store.session() as s:
            from celery_boundedbeat.db.tables import IterationRow

            rows = [
                (r.loop, r.holder, r.error or "") for r in s.query(IterationRow).order_by(IterationRow.id)
            ]
        assert [(loop, holder) for loop, holder, _ in rows] == [("tick", scheduler.lease.holder)] * 2
        assert all(error.startswith("OperationalError: ") for _, _, error in rows)
    finally:
        scheduler.close()


def _schedule_rows(store: Store) -> dict[str, tuple[str, Any, bool, int]]:
    return {r.name: (r.task, r.next_due_at, r.paused, r.runs) for r in store.schedules()}


def test_only_the_lease_holder_writes_schedule_rows_and_a_standby_with_another_config_changes_none(
    sqlite_url: str,
) -> None:
    """A standby started with a different beat_schedule leaves every schedule row as the holder wrote it."""
    holder_conf = {
        "keep": {"task": "proj.keep", "schedule": 60.0},
        "mine": {"task": "proj.mine", "schedule": 60.0},
    }
    standby_conf = {
        "keep": {"task": "proj.other", "schedule": 5.0},
        "new": {"task": "proj.new", "schedule": 5.0},
    }
    first = Scheduler(_quiet_app(sqlite_url, beat_schedule=holder_conf))
    second = Scheduler(_quiet_app(sqlite_url, beat_schedule=standby_conf))
    try:
        assert first.store.schedules() == [], "no beat writes schedule rows before it holds the lease"
        first.tick()
        first.store.set_paused("mine", True, datetime.now(UTC))
        before = _schedule_rows(first.store)
        assert set(before) == {"keep", "mine"}
        for _ in range(3):
            second.lease.next_renewal_at = 0.0
            second.tick()
        assert not second.lease.acting()
        assert _schedule_rows(second.store) == before
        first.close()
        second.lease.next_renewal_at = 0.0
        second.tick()
        assert second.lease.acting()
        after = _schedule_rows(second.store)
        assert set(after) == {"keep", "new"}, (
            "the new holder reconciles its own config when it takes the lease"
        )
        assert after["keep"][0] == "proj.other"
    finally:
        first.close()
        second.close()


def test_invalid_settings_end_the_banner_with_exit_78_naming_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Celery's lazy banner scheduler exits 78 on an invalid setting instead of raising a traceback."""
    app = _app("sqlite:///unused.sqlite3", boundedbeat_lease_ttl="soon")
    scheduler = Scheduler(app, lazy=True)
    with pytest.raises(SystemExit) as info:
        _ = scheduler.info
    assert info.value.code == 78
    assert "boundedbeat_lease_ttl" in caplog.text


def test_a_row_that_fell_due_while_the_tick_ran_is_looked_at_at_once(sqlite_url: str) -> None:
    """A schedule due just after the tick's own now is not taken for an unusable row: no sleep.

    The old rule slept the whole poll interval whenever a tick emitted nothing and a row was
    already due, so a row due 4 ms after the tick looked ran about a second late.
    """
    from celery_boundedbeat.db.store import TickResult

    app = _app(sqlite_url, boundedbeat_dispatch_enabled=False, boundedbeat_poll_interval=1.0)
    scheduler = Scheduler(app)
    try:
        assert scheduler._keep_lease()  # the holder: its next lease look is seconds away
        assert scheduler.lease.seconds_to_next_look() > 1.0
        scheduler._next_reap_at = float("inf")
        looked = datetime.now(UTC) - timedelta(milliseconds=10)
        fell_due = TickResult(now=looked, next_due_at=looked + timedelta(milliseconds=4))
        assert scheduler._next_wait(fell_due, 1.0) == 0.0
        # A row still due after a tick that looked at it (and emitted nothing) is not spun on.
        still_due = TickResult(now=looked, next_due_at=looked - timedelta(milliseconds=4))
        assert scheduler._next_wait(still_due, 0.5) == pytest.approx(
            min(0.5, scheduler.lease.seconds_to_next_look())
        )
    finally:
        scheduler.close()


@pytest.mark.postgres
def test_a_beat_behind_publishes_the_due_runs_itself_not_through_the_dispatcher_loop(
    postgres_url: str,
) -> None:
    """The first look, and a look after a due time that passed unprepared, publish from the beat thread.

    They used to commit the runs and leave them to the dispatcher loop, which claimed and
    published them at about two thirds of the speed: a beat that starts with 1,000 schedules
    due took several ticks to catch up. The dispatcher loop is stopped here, so a run is
    published only if the tick itself published it.
    """
    app, names = _free_app(postgres_url, 5, 1.5, boundedbeat_auto_migrate=True, boundedbeat_prepare_ahead=0.5)
    # A beat wait shorter than any lead: the next tick is never prepared ahead, only found late.
    scheduler = Scheduler(app, max_interval=0.01)
    try:
        assert scheduler._dispatch_loop is not None
        assert scheduler._dispatch_loop.stop(grace=10)
        scheduler.tick()  # the first look: every schedule is due at once
        first = scheduler.store.runs(limit=50)
        assert len(first) == len(names)
        assert all(r.published_at is not None for r in first), [r.id for r in first if r.published_at is None]
        scheduler.tick()  # the regular tick after it: nothing due, the next due time seen
        due = scheduler._known_due
        assert due is not None and due > datetime.now(UTC)
        time.sleep((due - datetime.now(UTC)).total_seconds() + 0.2)
        scheduler.tick()  # found late
        runs = scheduler.store.runs(limit=50)
        assert len(runs) == 2 * len(names)
        assert all(r.published_at is not None for r in runs), [r.id for r in runs if r.published_at is None]
        seen = {r.id for r in first}
        assert {r.scheduled_for for r in runs if r.id not in seen} == {due}
    finally:
        scheduler.close()


def test_a_stopping_beat_publishes_the_runs_it_committed_before_it_exits(sqlite_url: str) -> None:
    """Runs committed just before SIGTERM are published by the stopping beat, not left queued.

    They used to wait in the queue for the next beat or dispatcher: a graceful stop right
    after a tick left its runs ``queued``. The dispatcher loop is stopped first here, so only
    the beat's last drain can publish them.
    """
    app, names = _free_app(sqlite_url, 3, 60)
    scheduler = Scheduler(app)
    closed = False
    try:
        assert scheduler._dispatch_loop is not None
        assert scheduler._dispatch_loop.stop(grace=10)
        scheduler.tick()
        runs = scheduler.store.runs(limit=50)
        assert len(runs) == len(names) and all(r.published_at is None for r in runs), runs
        scheduler.close()
        closed = True
        runs = scheduler.store.runs(limit=50)
        assert all(r.state == RunState.PUBLISHED for r in runs), [(r.schedule, r.state) for r in runs]
    finally:
        if not closed:
            scheduler.close()


@pytest.mark.postgres
def test_sigterm_in_the_middle_of_a_prepared_publish_still_publishes_its_runs(postgres_url: str) -> None:
    """Celery's SIGTERM handler closes the scheduler inside the beat thread, then raises SystemExit.

    When that lands between a prepared tick's commit and the end of its publish, the runs
    used to stay queued and claimed until the claim expired. Here the publish is cut short
    exactly as the handler would: ``close()``, then ``SystemExit``.
    """
    app, names = _free_app(postgres_url, 3, 60, boundedbeat_auto_migrate=True, boundedbeat_prepare_ahead=0.5)
    scheduler = Scheduler(app, max_interval=0.01)
    ahead = scheduler._ahead
    assert ahead is not None

    def sigterm(*args: object, **kwargs: object) -> Any:
        scheduler.close()
        raise SystemExit()

    ahead._publisher.publish = sigterm  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            scheduler.tick()  # the first look publishes its due runs as a prepared tick
    finally:
        scheduler.close()
    runs = scheduler.store.runs(limit=50)
    assert len(runs) == len(names)
    assert all(r.state == RunState.PUBLISHED for r in runs), [(r.schedule, r.state) for r in runs]


def test_setup_freezes_what_start_up_built_out_of_full_collections(sqlite_url: str) -> None:
    """A full collection walks every tracked object with the GIL held: under heavy schedule
    churn the beat's were 90-120 ms pauses of every run due meanwhile. What start-up built is
    frozen (``gc.freeze``), so a full collection walks only what was made after it."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    app = _app(sqlite_url, boundedbeat_dispatch_enabled=False)
    scheduler = Scheduler(app)
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0, "setup_schedule froze nothing"
        assert len(gc.get_objects(generation=2)) < frozen, "most of the heap is out of full collections"
    finally:
        scheduler.close()
        gc.unfreeze()


def test_a_blip_shorter_than_half_a_heartbeat_does_not_hold_the_reaper_back(
    sqlite_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cut connection replaced at once leaves every live worker's heartbeat inside the
    reaper's bound: waiting after each one held the reaper back for as long as cuts went on."""
    scheduler = Scheduler(_quiet_app(sqlite_url))
    try:
        store = scheduler.store
        scheduler.tick()
        real_tick, down = store.tick, [True]

        def tick(*args: Any, **kwargs: Any) -> Any:
            if down[0]:
                raise OperationalError("SELECT 1", {}, ConnectionRefusedError("refused"))
            return real_tick(*args, **kwargs)

        monkeypatch.setattr(store, "tick", tick)
        clock = [0.0]
        monkeypatch.setattr(scheduler._recorder, "_clock", lambda: clock[0])
        with caplog.at_level(logging.INFO, logger="celery_boundedbeat"):
            scheduler.tick()
            down[0] = False
            clock[0] = 0.2
            scheduler.tick()
        assert "is reachable again" not in caplog.text
        assert scheduler._reap_not_before == 0.0
    finally:
        scheduler.close()


def test_the_reapers_grace_after_an_outage_is_three_heartbeats_and_none_after_a_blip() -> None:
    assert reaper_grace(0.0, 3.0) == 0.0
    assert reaper_grace(1.4, 3.0) == 0.0
    assert reaper_grace(1.5, 3.0) == 9.0
    assert reaper_grace(60.0, 3.0) == 9.0


@pytest.mark.postgres
def test_a_stop_signal_in_a_ticks_transaction_closes_after_the_transaction_is_gone(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery's SIGTERM handler calls ``close()`` in the beat thread, wherever it is. Inside a
    tick's transaction the close waited for the dispatcher and the last drain while the tick
    held its schedule rows, and what needed them waited until the server ended the
    transaction (a stopped beat took 10 s to give up its lease). The close now runs once the
    tick has unwound: by then no row of it is locked."""
    import psycopg

    import celery_boundedbeat.db.tick as tick_module

    app = _app(
        postgres_url,
        boundedbeat_auto_migrate=True,
        boundedbeat_prepare_ahead=0,
        beat_schedule={"x": {"task": "proj.x", "schedule": 1.0}},
    )
    scheduler = Scheduler(app)
    scheduler.tick()  # lease, first look (emits x)
    plain = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    locked_at_close: list[bool] = []
    real_close_now, real_on_due = scheduler._close_now, tick_module.on_due

    def close_now() -> None:
        with psycopg.connect(plain, autocommit=True) as other:
            try:
                other.execute("SELECT 1 FROM boundedbeat_schedules WHERE name = 'x' FOR UPDATE NOWAIT")
                locked_at_close.append(False)
            except psycopg.errors.LockNotAvailable:
                locked_at_close.append(True)
        real_close_now()

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        scheduler.close()  # what Celery's handler does, then it raises SystemExit
        raise SystemExit()

    monkeypatch.setattr(scheduler, "_close_now", close_now)
    monkeypatch.setattr(tick_module, "on_due", interrupted)
    monkeypatch.setattr(scheduler, "_known_due", None)
    monkeypatch.setattr(scheduler, "_stale", True)
    time.sleep(1.1)  # x is due again
    try:
        with pytest.raises(SystemExit):
            scheduler.tick()
    finally:
        monkeypatch.setattr(tick_module, "on_due", real_on_due)
        scheduler.close()
    assert locked_at_close == [False], "the close ran while the tick's transaction held its rows"
    assert scheduler._closed


@pytest.mark.parametrize("ticks", ["regular", "prepared"])
def test_a_beat_keeps_in_memory_only_the_definitions_of_schedules_due_soon(
    ticks: str, sqlite_url: str, postgres_url: str
) -> None:
    """Schedules ticked and next due later than the horizon are dropped from the cache, then
    rebuilt from their rows when due again; those due soon stay.

    Whether the beat ticks them in regular ticks (SQLite) or publishes them itself through
    prepared ticks (PostgreSQL, its first look and every look behind its due times: a beat
    catching up on a million overdue schedules kept every definition it ticked that way).
    """
    from celery_boundedbeat import add_schedule

    if ticks == "regular":
        app = _app(sqlite_url, boundedbeat_dispatch_enabled=False, boundedbeat_poll_interval=0.05)
    else:
        app = _app(postgres_url, boundedbeat_auto_migrate=True, boundedbeat_prepare_ahead=0.5)
    scheduler = Scheduler(app)
    if ticks == "prepared":
        assert scheduler._ahead is not None, "this beat ticks through prepared ticks"
    try:
        hourly = [f"hourly-{n}" for n in range(20)]
        for name in hourly:
            assert add_schedule(app, name, "proj.poll", 3600.0) == "scheduled"
        assert add_schedule(app, "often", "proj.poll", 10.0) == "scheduled"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(scheduler.store.runs(limit=100)) < 21:
            scheduler.tick()
        assert len(scheduler.store.runs(limit=100)) == 21, "every schedule ticked once"
        assert len(scheduler.resolver) == 1 and scheduler.resolver.needs_definition(
            scheduler.store.schedules(["hourly-0"])[0]
        ), "only the schedule due within the horizon is kept"
        rows = {r.name: r for r in scheduler.store.schedules()}
        assert not scheduler.resolver.needs_definition(rows["often"])
        assert scheduler.resolver(rows["hourly-3"]) is not None, "rebuilt from its row when needed"
    finally:
        scheduler.close()
