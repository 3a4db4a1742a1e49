"""Several beats on one database: only the lease holder acts; a standby takes over."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from integration.apps import Raw
from integration.backends import Backend
from integration.harness import Harness
from integration.processes import Proc

from .conftest import Measure
from .support import check_books, check_grid, doubled, kill9, lease, stuck

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

TTL, RENEW = 6.0, 2.0
LEASE = {
    "boundedbeat_lease_ttl": TTL,
    "boundedbeat_lease_renew_interval": RENEW,
    # A beat killed between claiming and publishing leaves its claim for this long.
    "boundedbeat_dispatch_claim_timeout": 5.0,
}
#: A standby takes over at most TTL + RENEW after the holder's last renewal; slack for slow cores.
SLACK = 4.0


def holder_of(bb: Harness) -> str | None:
    held = lease(bb)
    return held[0] if held else None


def is_holder(bb: Harness, proc: Proc) -> bool:
    holder = holder_of(bb)
    return holder is not None and f":{proc.popen.pid}:" in holder


def emitted_lines(proc: Proc) -> int:
    return proc.output().count("celery_boundedbeat: emitted ")


def only_holder_acts(bb: Harness, holder: Proc, standby: Proc):
    def check() -> None:
        assert is_holder(bb, holder), f"lease moved to {holder_of(bb)}\n{bb.diagnostics()}"
        assert emitted_lines(standby) == 0, f"the standby emitted\n{standby.tail()}"

    return check


def acquired_at(bb: Harness) -> float:
    rows = bb.sql("SELECT acquired_at FROM boundedbeat_leases WHERE name = 'beat'")
    return float(rows[0]["acquired_at"].timestamp())


def test_standby_takes_over_when_the_holder_is_killed(bb: Harness, measure: Measure) -> None:
    """Two beats for 20 s: only the holder emits; after kill -9 the standby takes over within TTL + renew."""
    bb.write_app({"tick": bb.entry("tick", 1.0, durations=[0.1])}, **LEASE)
    _worker, holder = bb.start(pool="threads", concurrency=4)
    standby = bb.start_beat(migrate=False, wait_lease=False)
    bb.wait_for_log(standby, "is standing by", timeout=40)
    bb.watch(20, only_holder_acts(bb, holder, standby))
    status = bb.celery("boundedbeat", "status", check=True).stdout
    assert f":{holder.popen.pid}:" in status, status
    assert len(bb.finished("tick")) >= 15

    killed_at = kill9(holder)
    bb.wait_until(lambda: is_holder(bb, standby), TTL + RENEW + SLACK, "the standby to take the lease")
    failover = acquired_at(bb) - killed_at
    assert failover <= TTL + RENEW + SLACK, failover
    first_new = bb.wait_until(
        lambda: min(
            (r.enqueued_at.timestamp() for r in bb.runs("tick") if r.enqueued_at.timestamp() > killed_at),
            default=None,
        ),
        10,
        "the standby's first emission",
    )
    bb.wait_until(
        lambda: len([r for r in bb.finished("tick") if r.enqueued_at.timestamp() > killed_at]) >= 5,
        20,
        "five runs emitted by the new holder to complete",
    )
    status = bb.celery("boundedbeat", "status", check=True).stdout
    assert f":{standby.popen.pid}:" in status, status
    assert "holds the beat lease" in standby.output()

    time.sleep(1.5)  # let the last emitted run finish
    states = check_books(bb, "tick")
    ticks = check_grid(bb, "tick", 1.0)
    assert doubled(bb) == []
    lost = stuck(bb, "tick", older_than=10)
    assert lost == [], lost
    measure("failover after kill -9 (lease acquired)", failover, f" s (ttl {TTL:g} s + renew {RENEW:g} s)")
    measure("first emission by the standby after the kill", first_new - killed_at, " s")
    measure("ticks accounted / runs lost / doubled", f"{ticks} / {len(lost)} / {len(doubled(bb))}")
    measure("run states", str(states))


@pytest.fixture
def pg_role() -> Iterator[str]:
    """A login role of the shared cluster that a test may lock out (dropped after the test's processes)."""
    role = f"bbfault_{uuid.uuid4().hex[:10]}"
    Backend._pg_admin(f'CREATE ROLE "{role}" LOGIN SUPERUSER')
    try:
        yield role
    finally:
        Backend._pg_admin(
            f'ALTER ROLE "{role}" NOLOGIN',
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",
        )
        for _ in range(20):
            try:
                Backend._pg_admin(f'DROP ROLE IF EXISTS "{role}"')
                break
            except Exception:
                time.sleep(0.5)


def test_a_holder_that_loses_the_database_stands_down_before_its_lease_expires(
    pg_role: str, bb: Harness, measure: Measure
) -> None:
    """A holder cut off from the database stops before its lease expires; the standby takes over."""
    db = bb.backend.pg_database
    shared_url = bb.backend.database_url
    bb.write_app(
        {"tick": bb.entry("tick", 1.0, durations=[0.1])},
        boundedbeat_database_url=Raw(f"os.environ.get('BB_FAULT_DATABASE_URL') or {shared_url!r}"),
        **LEASE,
    )
    worker = bb.start_worker(pool="threads", concurrency=4, wait_ready=False)
    bb.env["BB_FAULT_DATABASE_URL"] = f"postgresql+psycopg://{pg_role}@127.0.0.1:5432/{db}"
    try:
        holder = bb.start_beat()
    finally:
        del bb.env["BB_FAULT_DATABASE_URL"]
    standby = bb.start_beat(migrate=False, wait_lease=False)
    bb.wait_for_log(worker, " ready.", timeout=40)
    bb.wait_for_log(standby, "is standing by", timeout=40)
    bb.watch(5, only_holder_acts(bb, holder, standby))

    # Cut the holder off: its sessions end and it may not log in again.
    held = lease(bb)
    assert held is not None
    cut_at = time.time()
    Backend._pg_admin(
        f'ALTER ROLE "{pg_role}" NOLOGIN',
        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{pg_role}'",
    )
    last_expiry = held[1].timestamp()  # the holder may have renewed just before the cut
    stood_down_at = None
    deadline = time.monotonic() + TTL + RENEW + SLACK
    while time.monotonic() < deadline:
        now = time.time()
        current = lease(bb)
        if current is not None and f":{holder.popen.pid}:" in current[0]:
            last_expiry = max(last_expiry, current[1].timestamp())
        if stood_down_at is None and "stopped scheduling" in holder.output():
            stood_down_at = now
        if stood_down_at is not None and is_holder(bb, standby):
            break
        time.sleep(0.1)
    assert stood_down_at is not None, f"the holder never stood down\n{holder.tail(60)}"
    assert is_holder(bb, standby), f"the standby never took over\n{standby.tail(60)}"
    taken_at = acquired_at(bb)
    assert stood_down_at < last_expiry, (stood_down_at, last_expiry)
    assert taken_at >= last_expiry
    failover = taken_at - cut_at
    assert failover <= TTL + RENEW + SLACK, failover
    emitted_before = emitted_lines(holder)

    # The database comes back for the old holder: it stays a standby.
    Backend._pg_admin(f'ALTER ROLE "{pg_role}" LOGIN')
    bb.wait_for_log(holder, "is reachable again", timeout=20)
    bb.wait_until(
        lambda: len([r for r in bb.finished("tick") if r.enqueued_at.timestamp() > taken_at]) >= 5,
        20,
        "five runs emitted by the new holder to complete",
    )
    assert is_holder(bb, standby)
    assert emitted_lines(holder) == emitted_before, "the old holder emitted after losing the lease"
    assert holder.alive and standby.alive

    time.sleep(1.5)
    check_books(bb, "tick")
    ticks = check_grid(bb, "tick", 1.0)
    lost = stuck(bb, "tick", older_than=10)
    assert lost == [] and doubled(bb) == []
    measure("holder stood down before its lease expired by", last_expiry - stood_down_at, " s")
    measure("failover after the holder lost the database", failover, " s")
    measure("ticks accounted / runs lost / doubled", f"{ticks} / {len(lost)} / {len(doubled(bb))}")
