"""Several beats with ``boundedbeat_partitions``: every beat ticks its share, handovers lose nothing.

Real ``celery beat`` processes on one database: two beats split four partitions; one stopped
with SIGTERM hands its partitions over at once (no grid time skipped or emitted twice); a
third killed with SIGKILL has its partitions taken over within the TTL plus one renewal.
"""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest
from integration.harness import Harness
from integration.processes import Proc

from celery_boundedbeat.core.partitions import partition_of, slot_of

from .conftest import Measure
from .support import check_books, check_grid, doubled, kill9

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TTL, RENEW = 6.0, 2.0
PARTITIONS = 4
CONF = {
    "boundedbeat_lease_ttl": TTL,
    "boundedbeat_lease_renew_interval": RENEW,
    "boundedbeat_partitions": PARTITIONS,
    "boundedbeat_dispatch_claim_timeout": 5.0,
}
PERIOD = 2.0


def _two_per_partition() -> list[str]:
    picked: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    for n in range(200):
        name = f"job-{n}"
        share = picked[partition_of(slot_of(name), PARTITIONS)]
        if len(share) < 2:
            share.append(name)
    return sorted(name for names in picked.values() for name in names)


#: Names spread over all four partitions, two each.
NAMES = _two_per_partition()
#: A killed beat's partitions are taken over within TTL + RENEW; slack for two slow cores.
SLACK = 4.0


def beats(bb: Harness) -> list[dict[str, object]]:
    return json.loads(bb.celery("boundedbeat", "beats", "--json", check=True).stdout)


def owners(bb: Harness) -> dict[str, str | None]:
    rows = json.loads(bb.celery("boundedbeat", "status", "--json", check=True).stdout)
    return {r["name"]: r["owner"] for r in rows}


def member_of(bb: Harness, proc: Proc) -> str:
    """The beat's member id (``host:pid:random``), as ``boundedbeat beats`` lists it."""
    return next(str(b["id"]) for b in beats(bb) if f":{proc.popen.pid}:" in str(b["id"]))


def emitted_by(proc: Proc, since: int = 0) -> set[str]:
    """The schedules a beat's log says it emitted runs of (from character ``since`` of the log on)."""
    found = set()
    for line in proc.output()[since:].splitlines():
        if "celery_boundedbeat: emitted " in line:
            found.add(line.split("celery_boundedbeat: emitted ", 1)[1].split()[0])
    return found


def logged_at(proc: Proc, text: str, since: int) -> float:
    """The time of the first log line with ``text`` from character ``since`` on (local time stamps)."""
    line = next(line for line in proc.output()[since:].splitlines() if text in line)
    stamp = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
    return time.mktime(stamp.timetuple()) + stamp.microsecond / 1e6


def shares_settled(bb: Harness, count: int) -> bool:
    shares = sorted(len(b["partitions"]) for b in beats(bb))  # type: ignore[arg-type]
    return shares == [PARTITIONS // count] * count


def test_two_beats_split_the_partitions_and_a_stopped_one_hands_over_without_a_gap(
    bb: Harness, measure: Measure
) -> None:
    assert {partition_of(slot_of(n), PARTITIONS) for n in NAMES} == set(range(PARTITIONS))
    bb.write_app({n: bb.entry(n, PERIOD, durations=[0.1]) for n in NAMES}, **CONF)
    _worker, first = bb.start(pool="threads", concurrency=8)
    second = bb.start_beat(migrate=False, wait_lease=False)
    bb.wait_until(lambda: shares_settled(bb, 2), 30, "two beats owning two partitions each")
    ids = member_of(bb, first), member_of(bb, second)
    by_owner = owners(bb)
    assert set(by_owner.values()) == set(ids), by_owner
    split = len(first.output())
    time.sleep(3 * PERIOD)  # both tick their share for a few periods
    theirs = {n for n, o in by_owner.items() if o == ids[1]}
    bb.wait_until(lambda: theirs <= emitted_by(second), 20, "the second beat to emit its share")
    assert emitted_by(first, split) == set(NAMES) - theirs, "once split, each beat emits its share only"

    stopped_at, handed = time.time(), len(first.output())
    assert bb.stop(second) == 0
    bb.wait_until(lambda: shares_settled(bb, 1), 10, "the first beat to own every partition")
    taken = logged_at(first, "now ticks partition(s)", handed) - stopped_at
    assert taken <= 2.0, f"the partitions came back {taken:.2f} s after the stop (cooperative: at once)"
    time.sleep(3 * PERIOD)
    for name in NAMES:
        row, _runs = bb.books(name)
        check_grid(bb, name, PERIOD)
        assert row["skips"] == 0, f"{name} skipped a tick across the handover\n{bb.diagnostics()}"
        check_books(bb, name)
    assert doubled(bb) == []
    assert emitted_by(first, handed) == set(NAMES), "the first beat ticks the handed-over schedules"
    measure("handover on SIGTERM (signal to the other beat ticking the partitions)", taken, " s")


def test_a_killed_beats_partitions_are_taken_over_within_the_ttl_and_a_renewal(
    bb: Harness, measure: Measure
) -> None:
    bb.write_app({n: bb.entry(n, PERIOD, durations=[0.1]) for n in NAMES}, **CONF)
    _worker, _first = bb.start(pool="threads", concurrency=8)
    second = bb.start_beat(migrate=False, wait_lease=False)
    bb.wait_until(lambda: shares_settled(bb, 2), 30, "two beats owning two partitions each")
    theirs = {n for n, o in owners(bb).items() if o == member_of(bb, second)}
    killed_at = kill9(second)

    def resumed() -> float | None:
        late = [[r.enqueued_at.timestamp() for r in bb.runs(n)] for n in theirs]
        firsts = [min((at for at in ats if at > killed_at), default=None) for ats in late]
        return None if None in firsts else max(at for at in firsts if at is not None)

    back = bb.wait_until(resumed, TTL + RENEW + SLACK + PERIOD, "the killed beat's schedules to run again")
    takeover = back - killed_at
    assert takeover <= TTL + RENEW + SLACK + PERIOD, takeover
    assert shares_settled(bb, 1)
    time.sleep(2 * PERIOD)
    for name in NAMES:
        check_grid(bb, name, PERIOD)  # the missed ticks follow the policy (skip): counted
        check_books(bb, name)
    assert doubled(bb) == []
    measure("kill -9 takeover (kill to every orphaned schedule running again)", takeover, " s")
