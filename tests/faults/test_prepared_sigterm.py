"""SIGTERM of the lease holder at the due instant of a burst of prepared publishes, again and again.

What an orchestrator does in a rolling deploy: stop the beat that holds the lease (SIGTERM,
``celery beat``'s own handler) while a standby waits to take over. Each stop lands at the due
instant of a prepared tick of a few hundred schedules, as its messages go to the broker. No
worker runs: the messages stay in RabbitMQ and are counted per run at the end.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime

import pytest
from integration.backends import AMQP_URL
from integration.harness import Harness
from integration.processes import Proc
from kombu import Connection

from .conftest import Measure
from .support import holder_pid

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SCHEDULES, PERIOD = 500, 2.0
#: Beats started: the first holds the lease, each of the others takes over from a stopped one.
BEATS = 7
#: Where after the due instant each SIGTERM lands: from the commit to the end of the publish.
OFFSETS = (0.0, 0.01, 0.03, 0.06, 0.1, 0.15)
CONF = {
    "boundedbeat_prepare_ahead": 0.5,
    "boundedbeat_lease_ttl": 6.0,
    "boundedbeat_lease_renew_interval": 1.0,
    # A row a stopped beat left claimed is published again this soon: a double shows in the test.
    "boundedbeat_dispatch_claim_timeout": 5.0,
}
FREE = {"mode": "fixed_rate", "max_concurrency": 1000}  # no worker: every tick emits regardless


def messages(bb: Harness) -> Counter[str]:
    """Messages per task id (= run id) in the test's RabbitMQ queue."""
    counts: Counter[str] = Counter()
    with Connection(AMQP_URL) as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(bb.queue, no_ack=True)) is not None:
            counts[message.headers["id"]] += 1
    return counts


def next_due(bb: Harness) -> datetime:
    rows = bb.sql("SELECT min(next_due_at) AS due FROM boundedbeat_schedules")
    due: datetime = rows[0]["due"]
    return due


def due_ahead(bb: Harness) -> datetime | None:
    """The next due instant if it is far enough off for the holder to prepare it (its lead)."""
    due = next_due(bb)
    return due if (due - datetime.now(UTC)).total_seconds() > 0.7 else None


def left_claimed(bb: Harness, beat: Proc) -> int:
    rows = bb.sql(
        "SELECT count(*) AS n FROM boundedbeat_queue WHERE claimed_by LIKE :pid", pid=f"%:{beat.popen.pid}:%"
    )
    return int(rows[0]["n"])


def test_sigterm_of_the_holder_during_prepared_bursts_publishes_every_run_once(
    bb: Harness, measure: Measure
) -> None:
    schedule = {f"b{i}": bb.entry(f"b{i}", PERIOD, policy=FREE) for i in range(SCHEDULES)}
    bb.write_app(schedule, **CONF)
    beats = [bb.start_beat()]
    beats += [bb.start_beat(migrate=False, wait_lease=False) for _ in range(BEATS - 1)]
    for standby in beats[1:]:
        bb.wait_for_log(standby, "is standing by", timeout=60)
    by_pid = {beat.popen.pid: beat for beat in beats}
    exits: list[float] = []
    left: list[int] = []  # rows each stopped beat left claimed (until the claim expires)
    last_stop = 0.0
    for offset in OFFSETS:
        pid = bb.wait_until(lambda: holder_pid(bb), 20, "a beat to hold the lease")
        holder = by_pid[pid]
        # A due instant at least a lead away, so this holder prepares its tick.
        due = bb.wait_until(
            lambda: due_ahead(bb),
            2 * PERIOD + 5,
            "a due instant ahead",
            interval=0.05,
        )
        time.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds() + offset))
        last_stop = time.monotonic()
        status = bb.stop(holder, timeout=30)
        exits.append(time.monotonic() - last_stop)
        assert status == 0, f"the holder exited {status} on SIGTERM\n{holder.tail()}"
        left.append(left_claimed(bb, holder))
        bb.wait_until(
            lambda stopped=pid: holder_pid(bb) not in (None, stopped), 20, "a standby to take the lease over"
        )
    survivor = by_pid[holder_pid(bb)]
    stopped_at = datetime.now(UTC)
    # The standby carries on: a full tick of its own after the last stop is published.
    bb.wait_until(
        lambda: len([r for r in bb.runs() if r.enqueued_at > stopped_at and r.published_at]) >= SCHEDULES,
        30,
        "the last standby to publish a tick of its own",
    )
    assert bb.stop(survivor, timeout=30) == 0, survivor.tail()
    for beat in beats:
        assert not beat.alive or bb.stop(beat, timeout=30) == 0, beat.tail()

    runs = bb.runs()
    unpublished = [r.id for r in runs if r.published_at is None]
    queued = bb.sql("SELECT count(*) AS n FROM boundedbeat_queue")[0]["n"]
    counts = messages(bb)
    doubled = {run_id: n for run_id, n in counts.items() if n > 1}
    missing = [r.id for r in runs if counts[r.id] == 0]
    measure("runs / doubled / missing", f"{len(runs)} / {len(doubled)} / {len(missing)}")
    measure("beat exit after SIGTERM, longest", max(exits), " s")
    assert doubled == {}, f"{len(doubled)} of {len(runs)} runs published more than once; left claimed {left}"
    assert left == [0] * len(OFFSETS), f"stopped beats left rows claimed until the claim expired: {left}"
    assert unpublished == [] and queued == 0 and missing == [], (len(unpublished), queued, len(missing))
    assert set(counts) <= {r.id for r in runs}, "a message for no run"
    assert max(exits) < 8.0, f"a stopping beat took {max(exits):.1f} s to exit: {exits}"
