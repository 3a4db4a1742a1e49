"""Retention per schedule (keep_runs, keep_for) beside the global age, in short batches beside the tick."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from helpers.clock import T0, sec
from sqlalchemy import Engine, event, select, update

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.spec import EntrySpec, config_hash
from celery_boundedbeat.db.retention import purge_pass, retained
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import RunRow, ScheduleRow

RNG = random.Random(11)


def spec(name: str, **policy: Any) -> EntrySpec:
    built, problems = parse_entry(name, {"task": f"proj.{name}", "schedule": 10, "policy": policy}, {})
    assert built is not None, problems
    return built


# -- the policy keys ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"keep_runs": 0}, "must be >= 1, got 0"),
        ({"keep_runs": "10"}, "must be an integer >= 1, got '10'"),
        ({"keep_runs": True}, "must be an integer >= 1, got True"),
        ({"keep_for": 0}, "must be > 0 seconds, got 0"),
        ({"keep_for": -5}, "must be > 0 seconds, got -5"),
        ({"keep_for": "7d"}, "must be seconds (number) or a timedelta, got '7d'"),
    ],
)
def test_bad_retention_keys_are_refused_naming_the_key_and_the_value(
    raw: dict[str, Any], reason: str
) -> None:
    """keep_runs takes an int >= 1, keep_for seconds > 0 or a timedelta; the problem names both."""
    policy, problems = parse_policy("nightly", raw)
    assert policy is None
    assert problems == [("nightly", f"policy.{next(iter(raw))}", reason)]


def test_retention_keys_parse_and_are_stored_only_when_set() -> None:
    """A timedelta keep_for is seconds; unset keys stay out of the JSON, so old digests do not change."""
    policy, problems = parse_policy("a", {"keep_runs": 50, "keep_for": timedelta(days=2)})
    assert problems == [] and policy is not None
    assert (policy.keep_runs, policy.keep_for) == (50, 172800.0)
    assert Policy.from_json(policy.to_json()) == policy
    plain, _ = parse_policy("a", {})
    assert plain is not None and "keep_runs" not in plain.to_json() and "keep_for" not in plain.to_json()
    assert config_hash(spec("a")) != config_hash(spec("a", keep_runs=5))


# -- purging (SQLite and PostgreSQL) --------------------------------------------------------


@pytest.fixture
def store(migrated: Engine) -> Iterator[Store]:
    yield Store(migrated)


def history(store: Store, name: str, settled: int, *, active: int = 0, start: datetime = T0) -> list[str]:
    """``settled`` runs of ``name`` finished 10 s apart from ``start``, then ``active`` started ones."""
    ids = []
    with store.session() as s:
        for i in range(settled + active):
            run_id = f"{name}-{i:04d}"
            at = start + sec(10 * i)
            done = i < settled
            s.add(
                RunRow(
                    id=run_id,
                    schedule=name,
                    task=f"proj.{name}",
                    state=RunState.COMPLETED.value if done else RunState.STARTED.value,
                    scheduled_for=at,
                    enqueued_at=at,
                    started_at=at,
                    finished_at=at + sec(1) if done else None,
                )
            )
            ids.append(run_id)
    return ids


def left(store: Store, name: str) -> list[str]:
    with store.session() as s:
        return sorted(s.scalars(select(RunRow.id).where(RunRow.schedule == name)))


def always() -> bool:
    return True


def test_keep_runs_keeps_the_newest_settled_runs_and_every_active_one(store: Store) -> None:
    """keep_runs 3 over 10 settled and 2 active runs leaves the 3 newest settled and both active."""
    store.sync_config([spec("a", keep_runs=3), spec("b")], T0, RNG)
    ids = history(store, "a", 10, active=2)
    other = history(store, "b", 10)
    purged = purge_pass(store.engine, T0 + sec(1000), retention_days=None, may_go=always)
    assert purged.by_count == 7 and purged.total == 7
    assert left(store, "a") == ids[7:]
    assert left(store, "b") == other  # no policy, no global age: kept


def test_keep_for_deletes_settled_runs_finished_longer_ago_and_replaces_the_global_age(store: Store) -> None:
    """keep_for 1 h keeps a day-old schedule's last hour; the global 1 day age never touches it."""
    store.sync_config(
        [spec("own", keep_for=3600), spec("plain"), spec("longer", keep_for=10 * 86400)], T0, RNG
    )
    now = T0 + timedelta(days=3)
    own = history(store, "own", 4, start=now - sec(7200))  # finished 2 h, 1h50, 1h40, 1h30 ago
    plain = history(store, "plain", 3, start=T0)  # 3 days old
    longer = history(store, "longer", 3, start=T0)
    gone = history(store, "removed", 2, start=T0)  # a removed schedule's runs
    with store.session() as s:  # one run of "own" finished 10 minutes ago
        s.execute(update(RunRow).where(RunRow.id == own[-1]).values(finished_at=now - sec(600)))
    purged = purge_pass(store.engine, now, retention_days=1, may_go=always)
    assert left(store, "own") == [own[-1]]
    assert left(store, "plain") == [] and left(store, "removed") == []
    assert left(store, "longer") == longer, "its own keep_for (10 days) wins over the global day"
    assert (purged.by_age, purged.global_age) == (3, len(plain) + len(gone))


def test_retained_finds_only_schedules_with_keys_of_their_own(store: Store) -> None:
    """The JSON key lookup returns each schedule's keep_runs / keep_for and skips the others."""
    store.sync_config([spec("a", keep_runs=5), spec("b", keep_for=60.5), spec("c")], T0, RNG)
    assert [(k.name, k.keep_runs, k.keep_for) for k in retained(store.engine)] == [
        ("a", 5, None),
        ("b", None, 60.5),
    ]


def test_a_pass_deletes_in_batches_and_stops_between_them_when_told(store: Store) -> None:
    """Batches of 4: a pass told to stop after its first batch has deleted exactly 4 and says it stopped."""
    store.sync_config([spec("a", keep_runs=1)], T0, RNG)
    history(store, "a", 11)
    asked = iter([True, False])
    purged = purge_pass(store.engine, T0, retention_days=None, may_go=lambda: next(asked), batch=4)
    assert (purged.by_count, purged.stopped) == (4, True)
    assert len(left(store, "a")) == 7
    assert purge_pass(store.engine, T0, retention_days=None, may_go=always, batch=4).by_count == 6


def test_purging_beside_a_running_tick_loses_no_active_run_and_ends_at_the_bound(store: Store) -> None:
    """A thread ticks, starts and settles runs while purges run: no error, actives kept, keep_runs held."""
    entries = {"a": spec("a", keep_runs=5, mode="fixed_rate", max_concurrency=3)}
    store.sync_config(entries.values(), T0, RNG)
    history(store, "a", 60, start=T0 - timedelta(days=1))
    errors: list[BaseException] = []
    ticking = threading.Event()
    done = threading.Event()

    def tick_loop() -> None:
        try:
            for i in range(40):
                now = T0 + sec(10 * i)
                for run in store.tick(entries, now, RNG, 100).emitted:
                    assert store.run_life.start_run(
                        run.id, worker="w", process="w:1", now=now, max_run_time=None
                    )
                    if i % 2:  # every other tick leaves its run active for a while
                        assert store.run_life.settle_run(run.id, RunState.COMPLETED, now=now + sec(1))
                ticking.set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            ticking.set()
            done.set()

    worker = threading.Thread(target=tick_loop)
    worker.start()
    assert ticking.wait(30)
    passes = 0
    while not done.is_set() or passes == 0:
        purge_pass(store.engine, T0 + sec(1000), retention_days=None, may_go=always, batch=3)
        passes += 1
    worker.join(60)
    assert errors == []
    purge_pass(store.engine, T0 + sec(1000), retention_days=None, may_go=always, batch=3)
    with store.session() as s:
        states = [r.state for r in s.scalars(select(RunRow).where(RunRow.schedule == "a"))]
        (row,) = s.scalars(select(ScheduleRow).where(ScheduleRow.name == "a"))
    active = [st for st in states if st in ("queued", "published", "started")]
    assert len(active) == row.active_runs, "every active run survived the purges"
    assert len(states) - len(active) == 5


@pytest.mark.postgres
def test_a_purge_batch_holds_no_lock_the_tick_or_a_settle_needs(migrated_postgres_url: str) -> None:
    """While a purge batch has deleted rows and not yet committed, a tick and a settle of the same
    schedule commit in another transaction (PostgreSQL, where a purge and a tick run side by side)."""
    from celery_boundedbeat.db.engine import dispose_all, get_engine

    engine = get_engine(migrated_postgres_url)
    try:
        store = Store(engine)
        entries = {"a": spec("a", keep_runs=1, mode="fixed_rate", max_concurrency=2)}
        store.sync_config(entries.values(), T0, RNG)
        history(store, "a", 6, start=T0 - timedelta(days=1))
        (first,) = store.tick(entries, T0, RNG, 100).emitted
        assert store.run_life.start_run(first.id, worker="w", process="w:1", now=T0, max_run_time=None)
        outcome: dict[str, Any] = {}

        def beside() -> None:
            try:
                outcome["emitted"] = len(store.tick(entries, T0 + sec(10), RNG, 100).emitted)
                outcome["settled"] = store.run_life.settle_run(first.id, RunState.COMPLETED, now=T0 + sec(11))
            except BaseException as exc:
                outcome["error"] = exc

        def inside_the_batch(conn: Any, clause: Any, *args: Any) -> None:
            if str(clause).startswith("DELETE FROM boundedbeat_runs") and "thread" not in outcome:
                outcome["thread"] = t = threading.Thread(target=beside)
                t.start()
                t.join(15)  # the purge's transaction is still open: the tick must not wait for it
                outcome["finished_inside"] = not t.is_alive()

        event.listen(engine, "after_execute", inside_the_batch)
        try:
            purged = purge_pass(engine, T0 + sec(100), retention_days=None, may_go=always)
        finally:
            event.remove(engine, "after_execute", inside_the_batch)
        assert outcome.get("finished_inside") is True, outcome
        assert "error" not in outcome, outcome
        assert outcome["emitted"] == 1 and outcome["settled"] is not None
        assert purged.by_count == 5
    finally:
        dispose_all()
