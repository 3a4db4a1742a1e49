"""Partitioned beats on the database: shares, claims, handover and what status shows.

A tick with a :class:`~celery_boundedbeat.db.tick.Share` looks only at the schedules of its
partitions; claims are rows of ``boundedbeat_leases`` that two beats never hold at once;
:class:`~celery_boundedbeat.db.partitions.PartitionKeeper` on the real rows hands a joining
beat its share. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from celery import Celery
from sqlalchemy import Engine, text, update

from celery_boundedbeat import add_schedule, snapshot
from celery_boundedbeat.api.queries import beats
from celery_boundedbeat.config.definitions import Resolver
from celery_boundedbeat.core.partitions import partition_of, slot_of
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.lease import LEASE_NAME
from celery_boundedbeat.db.migrate import upgrade
from celery_boundedbeat.db.partitions import PartitionKeeper, PartitionRows, claim_name
from celery_boundedbeat.db.store import Store, utcnow
from celery_boundedbeat.db.tables import LeaseRow
from celery_boundedbeat.db.tick import Share

RNG = random.Random(3)
NAMES = [f"tenant-{n}" for n in range(24)]


@pytest.fixture
def app(engine: Engine, db_url: str) -> Celery:
    upgrade(engine)
    app = Celery("partitions", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    return app


@pytest.fixture
def store(engine: Engine, app: Celery) -> Store:
    return Store(engine)


def add_all(app: Celery) -> None:
    for name in NAMES:
        assert add_schedule(app, name, "proj.poll", 3600.0) == "scheduled"


def emitted(app: Celery, store: Store, at: datetime, share: Share | None) -> list[str]:
    return sorted(e.schedule for e in store.tick(Resolver(app, {}), at, RNG, 1000, share=share).emitted)


def test_a_tick_with_a_share_emits_only_the_schedules_of_its_partitions(app: Celery, store: Store) -> None:
    add_all(app)
    at = utcnow() + timedelta(seconds=1)
    mine = Share(4, (1, 3))
    first = emitted(app, store, at, mine)
    assert first == sorted(n for n in NAMES if slot_of(n) % 4 in (1, 3))
    assert first and len(first) < len(NAMES), "the names fall in several partitions"
    assert store.next_due_at(mine) is not None and store.next_due_at(mine) > at, "its own are all ticked"
    assert store.next_due_at() is not None and store.next_due_at() <= at, "the others' are still due"
    rest = emitted(app, store, at, Share(4, (0, 2)))
    assert sorted(first + rest) == sorted(NAMES), "each schedule ticked once, by its partition's owner"
    assert emitted(app, store, at, None) == []


def test_a_partition_is_claimed_by_one_beat_until_released_expired_or_left(store: Store) -> None:
    rows = PartitionRows(store.db)
    now = utcnow()
    assert rows.renew_member("a", now, 15) == ["a"]
    assert rows.renew_member("b", now, 15) == ["a", "b"]
    assert rows.claim_partitions("a", [0, 1], now, 15) == {0, 1}
    assert rows.claim_partitions("b", [1, 2], now, 15) == {2}, "a holds 1"
    assert rows.claim_partitions("a", [0, 1], now, 15) == {0, 1}, "a renews its own"
    rows.release_partitions("a", [1])
    assert rows.claim_partitions("b", [1, 2], now, 15) == {1, 2}, "a handed 1 over"
    with store.session() as s:  # a's claim on 0 ran out (as after a kill -9)
        s.execute(
            update(LeaseRow).where(LeaseRow.name == claim_name(0)).values(expires_at=now - timedelta(1))
        )
    assert rows.claim_partitions("b", [0], now, 15) == {0}
    assert rows.owners(now) == {0: "b", 1: "b", 2: "b"}
    rows.leave("b")
    assert rows.owners(now) == {} and [m for m, _j, _r in rows.members(now)] == ["a"]


def test_two_beats_claiming_a_new_partition_at_once_do_not_fail_the_whole_claim(
    migrated_postgres_url: str,
) -> None:
    """Beats started together both claim never-claimed partitions: the loser of one insert
    keeps the rest of its claim (it used to fail it all with a unique violation, logged as a
    failed renewal). PostgreSQL only: SQLite has one writer, so two claims cannot interleave."""
    store = Store(get_engine(migrated_postgres_url))
    rows = PartitionRows(store.db)
    url = migrated_postgres_url.replace("+psycopg", "")
    with psycopg.connect(url) as first, psycopg.connect(url, autocommit=True) as watch:
        first.execute(  # beat a claims partition 0, between its insert and its commit
            "INSERT INTO boundedbeat_leases (name, holder, acquired_at, renewed_at, expires_at) "
            "VALUES ('partition:0', 'a', now(), now(), now() + interval '15 seconds')"
        )
        out: dict[str, object] = {}

        def claim() -> None:
            try:
                out["got"] = rows.claim_partitions("b", [0, 1], utcnow(), 15)
            except Exception as exc:
                out["error"] = exc

        thread = threading.Thread(target=claim)
        thread.start()
        waiting = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        deadline = time.monotonic() + 10
        while watch.execute(waiting).fetchone() != (1,):  # b's insert waits on a's
            assert time.monotonic() < deadline and thread.is_alive(), out
            time.sleep(0.01)
        first.commit()
        thread.join(10)
    assert out == {"got": {1}}, "b takes the free partition and leaves a's"
    assert rows.owners(utcnow()) == {0: "a", 1: "b"}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def keeper(store: Store, member: str, clock: Clock, partitions: int = 4) -> PartitionKeeper:
    return PartitionKeeper(
        PartitionRows(store.db),
        member=member,
        partitions=partitions,
        ttl=15,
        renew_interval=5,
        clock=clock,
        now=utcnow,
    )


def test_a_joining_beat_gets_its_share_once_the_holder_hands_it_over(store: Store) -> None:
    """Cooperative: the holder gives up what the new assignment moves, then the newcomer claims it."""
    clock = Clock()
    a, b = keeper(store, "beat-a", clock), keeper(store, "beat-b", clock)
    assert a.keep().acting == {0, 1, 2, 3}, "alone, a beat owns every partition"
    joined = b.keep()
    assert joined.acting == frozenset() and joined.members == ("beat-a", "beat-b"), "a still holds them"
    a.renew_now()
    handed = a.keep()
    assert handed.lost and len(handed.acting) == 2, handed
    b.renew_now()
    taken = b.keep()
    assert taken.gained == handed.lost and taken.acting == handed.lost
    assert a.acting() | b.acting() == {0, 1, 2, 3} and not a.acting() & b.acting()
    clock.t += 10.1  # past ttl - renew_interval without a renewal: neither trusts its claims
    assert a.acting() == frozenset() and b.acting() == frozenset()


def test_a_beat_that_leaves_gives_every_partition_to_the_others_at_once(store: Store) -> None:
    clock = Clock()
    a, b = keeper(store, "beat-a", clock), keeper(store, "beat-b", clock)
    a.keep(), b.keep()
    a.renew_now(), a.keep()
    b.renew_now(), b.keep()
    assert len(b.acting()) == 2
    b.leave()
    a.renew_now()
    assert a.keep().acting == {0, 1, 2, 3}, "no wait for b's claims to expire"


def test_status_and_beats_show_each_schedules_partition_and_owner(app: Celery, store: Store) -> None:
    add_all(app)
    app.conf.boundedbeat_partitions = 4
    clock = Clock()
    a, b = keeper(store, "beat-a", clock), keeper(store, "beat-b", clock)
    a.keep(), b.keep()
    a.renew_now(), a.keep()
    b.renew_now(), b.keep()
    owners = {p: "beat-a" for p in a.acting()} | {p: "beat-b" for p in b.acting()}
    for s in snapshot(app):
        assert s.partition == partition_of(slot_of(s.name), 4)
        assert s.owner == owners[s.partition]
        assert s.to_json()["owner"] == s.owner
    found = {r.id: sorted(r.partitions) for r in beats(app)}
    assert found == {"beat-a": sorted(a.acting()), "beat-b": sorted(b.acting())}


def test_with_one_partition_the_lease_holder_owns_every_schedule(app: Celery, store: Store) -> None:
    add_all(app)
    assert store.acquire_lease(LEASE_NAME, "host:1:abc", utcnow(), 15)
    assert {(s.partition, s.owner) for s in snapshot(app)} == {(0, "host:1:abc")}
    (only,) = beats(app)
    assert (only.id, only.partitions, only.leader) == ("host:1:abc", [0], True)


#: A schedule row as migration 0010 left the table (no slot yet).
INSERT_0010 = text(
    "INSERT INTO boundedbeat_schedules (name, incarnation, task, mode, policy, schedule, origin,"
    " args, kwargs, options, paused, stopped, runs, skips, busy_skips, window_drops, buffer_drops,"
    ' replaced, "overlaps", failures, active_runs, pending_runs, pending, triggers, backfill,'
    " retries, retried, grid_runs, consecutive_failures, version, config_hash, created_at, updated_at)"
    " VALUES (:n, :n, 't', 'fixed_rate_no_overlap', '{}', 'every 1s', 'runtime', '[]', '{}', '{}',"
    " false, false, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, '[]', '[]', '[]', '[]', 0, 0, 0, 1, 'x', :at, :at)"
)


def test_the_migration_gives_existing_schedules_their_slot(engine: Engine) -> None:
    upgrade(engine, "0010_retries")
    with engine.begin() as conn:
        now = datetime(2030, 1, 1, tzinfo=UTC)
        for name in ("alpha", "beta", "gamma"):
            conn.execute(INSERT_0010, {"n": name, "at": now})
    upgrade(engine)
    with engine.connect() as conn:
        slots = dict(conn.execute(text("SELECT name, slot FROM boundedbeat_schedules")).all())
    assert slots == {n: slot_of(n) for n in ("alpha", "beta", "gamma")}
    assert len(set(slots.values())) > 1
