"""PostgreSQL stopped and started again under a running beat and worker (a private cluster)."""

from __future__ import annotations

import time

import pytest
from integration.harness import Harness

from .conftest import Measure
from .support import (
    PrivatePostgres,
    check_books,
    check_grid,
    doubled,
    executions,
    run,
    stuck,
    tracebacks,
    write_app,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

OUTAGE = 12.0
HEARTBEAT = 3.0


def test_beat_dispatcher_and_workers_survive_a_database_outage(
    outage_bb: Harness, cluster: PrivatePostgres, measure: Measure
) -> None:
    """With PostgreSQL down for 12 s, nothing crashes; runs that ended meanwhile settle afterwards, once."""
    bb = outage_bb
    write_app(
        bb,
        {"steady": bb.entry("steady", 1.0, durations=[2.5])},
        boundedbeat_lease_ttl=6.0,
        boundedbeat_lease_renew_interval=2.0,
    )
    worker, beat = bb.start(pool="prefork", concurrency=2)
    bb.wait_until(lambda: len(bb.finished("steady")) >= 2, 40, "two runs before the outage")
    # Stop the database early in a run, so that run ends while the database is down.
    in_flight = bb.wait_until(
        lambda: next(
            (
                r
                for r in bb.runs("steady")
                if r.state == "started" and r.started_at and time.time() - r.started_at.timestamp() < 1.0
            ),
            None,
        ),
        20,
        "a run that just started",
        interval=0.05,
    )
    tracebacks_before = tracebacks(beat) + tracebacks(worker)
    stopped_at = time.time()
    cluster.stop("fast")
    bb.watch(OUTAGE, lambda: None, interval=0.5)  # every process must stay alive
    cluster.start()
    restarted_at = time.time()

    settled = bb.wait_until(
        lambda: (
            (r := run(bb, in_flight.id)) is not None
            and r.state not in ("queued", "published", "started")
            and r
        ),
        5 * HEARTBEAT,
        "the run that ended during the outage to settle",
    )
    settle_delay = time.time() - restarted_at
    assert settled.state == "completed", settled.short()
    assert settled.finished_at is not None and settled.finished_at.timestamp() < restarted_at, (
        "its outcome was kept with the time it really ended"
    )
    assert any(
        iv.id == in_flight.id and iv.end and stopped_at < iv.end < restarted_at for iv in bb.intervals()
    ), "the run ended while the database was down"
    bb.wait_until(
        lambda: len([r for r in bb.finished("steady") if r.enqueued_at.timestamp() > restarted_at]) >= 2,
        40,
        "two runs emitted after the outage to complete",
    )
    resumed = min(
        r.enqueued_at.timestamp() for r in bb.runs("steady") if r.enqueued_at.timestamp() > restarted_at
    )

    assert beat.alive and worker.alive
    beat_log, worker_log = beat.output(), worker.output()
    assert "is reachable again" in beat_log, beat.tail(80)
    assert "works again after" in worker_log, worker.tail(80)
    # Logged, but not a traceback every few milliseconds: one per loop and streak (beat: tick,
    # drain, reap, renewal; worker: a write per process that had something to write).
    new_tracebacks = tracebacks(beat) + tracebacks(worker) - tracebacks_before
    assert new_tracebacks <= 8, f"{new_tracebacks} tracebacks\n{beat.tail(120)}\n{worker.tail(120)}"
    recorded = bb.sql("SELECT loop, error FROM boundedbeat_iterations")
    loops = {row["loop"] for row in recorded}
    assert "lease renewal" in loops, recorded

    time.sleep(3.0)  # the last run ends
    states = check_books(bb, "steady")
    ticks = check_grid(bb, "steady", 1.0)
    lost = stuck(bb, "steady", older_than=10)
    twice = doubled(bb)
    assert states.get("lost", 0) == 0 and states.get("failed", 0) == 0, states
    assert lost == [] and twice == []
    ran = set(executions(bb))
    settled_ids = {r.id for r in bb.runs() if r.state == "completed"}
    assert ran - settled_ids <= {r.id for r in bb.runs() if r.state == "started"}, (
        "a run ran but was not recorded"
    )
    measure("outage", restarted_at - stopped_at, " s")
    measure("run ended during the outage settled after restart", settle_delay, " s")
    measure("first emission after restart", resumed - restarted_at, " s")
    measure("tracebacks logged during the outage (beat + worker)", new_tracebacks)
    measure("iterations recorded", len(recorded))
    measure("ticks accounted / runs lost / doubled", f"{ticks} / {len(lost)} / {len(twice)}")
