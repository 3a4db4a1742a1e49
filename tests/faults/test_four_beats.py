"""Four partitioned beats under load through every fault: nothing doubled, nothing untracked.

Real ``celery beat`` processes (``boundedbeat_partitions = 16``, TTL 6 s, renew 2 s) and a
real worker run 48 schedules at 1 s. The first scenario stops one beat with SIGTERM (a beat
removed), starts another (a beat added), kills one with ``kill -9`` and freezes the lease
holder with SIGSTOP for twice the TTL before SIGCONT; the second restarts PostgreSQL (a
private cluster) under four beats. Each fault's window is measured from the beats' logs (a
killed or frozen beat's partitions ticked again within the TTL plus one renewal, a stopped
one's within 2 s), the resumed beat's log must show no run emitted for a partition before it
claimed it again, and the books are then checked whole: no grid time emitted twice, no run
executed twice, every run settled and every execution a run of the books, every grid time
outside the fault windows run exactly once, the ones inside counted as dropped by the policy
(``skips``) and the counters equal to the rows.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterable
from datetime import datetime

import pytest
from integration.harness import Harness
from integration.processes import Proc
from integration.reads import ACTIVE_STATES

from celery_boundedbeat.core.partitions import partition_of, slot_of

from .conftest import Measure
from .support import PrivatePostgres, check_books, check_grid, doubled, executions, kill9

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TTL, RENEW = 6.0, 2.0
PARTITIONS = 16
BEATS = 4
PERIOD = 1.0
SCHEDULES = 48
CONF = {
    "boundedbeat_lease_ttl": TTL,
    "boundedbeat_lease_renew_interval": RENEW,
    "boundedbeat_partitions": PARTITIONS,
    "boundedbeat_dispatch_claim_timeout": 5.0,
}
NAMES = [f"s{i:02d}" for i in range(SCHEDULES)]
PARTITION = {name: partition_of(slot_of(name), PARTITIONS) for name in NAMES}
#: Runs may overlap: a run slow to start on two busy cores skips no tick as busy, so every
#: grid time missed is one no beat ticked in time. A beat taking a partition over runs its
#: passed grid times up to 2 s old and counts the older ones (``window_drops``, in ``skips``).
POLICY = {"mode": "fixed_rate", "max_concurrency": 20, "catchup_window": 2.0}
#: A killed or frozen beat's partitions are claimed within TTL + RENEW; slack for two busy cores.
SLACK = 2.0
#: A SIGTERM hands the partitions over at once: the others tick them within this.
HANDOVER = 2.0

#: A short task that records each execution (its run id and schedule).
TALLY = """

@app.task(bind=True)
def tally(self, name):
    _record(event="start", name=name, id=self.request.id, t=time.time(), pid=os.getpid())
"""

Window = tuple[float, float]


def write_app(bb: Harness) -> None:
    schedule = {
        n: {"task": f"{bb.module}.tally", "schedule": PERIOD, "kwargs": {"name": n}, "policy": POLICY}
        for n in NAMES
    }
    module = bb.write_app(schedule, **CONF)
    path = bb.tmp / f"{module}.py"
    path.write_text(path.read_text() + TALLY)


def shares(bb: Harness) -> dict[str, set[int]]:
    """The partitions each beat holds an unexpired claim on, by the database's clock."""
    rows = bb.sql(
        "SELECT name, holder FROM boundedbeat_leases WHERE name LIKE 'partition:%' AND expires_at > now()"
    )
    held: dict[str, set[int]] = {}
    for row in rows:
        held.setdefault(row["holder"], set()).add(int(row["name"].split(":")[1]))
    return held


def settled(bb: Harness, procs: Iterable[Proc]) -> bool:
    """Exactly these beats hold every partition, each its fair share (floor or ceil)."""
    pids = [p.popen.pid for p in procs]
    held = shares(bb)
    fair = {PARTITIONS // len(pids), -(-PARTITIONS // len(pids))}
    return (
        len(held) == len(pids)
        and all(any(f":{pid}:" in member for member in held) for pid in pids)
        and all(len(parts) in fair for parts in held.values())
        and sum(len(parts) for parts in held.values()) == PARTITIONS
    )


def share_of(bb: Harness, proc: Proc) -> set[int]:
    return next(parts for member, parts in shares(bb).items() if f":{proc.popen.pid}:" in member)


def stamp(line: str) -> float:
    """A log line's time (the beats log local time to the millisecond)."""
    at = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
    return time.mktime(at.timetuple()) + at.microsecond / 1e6


def listed(text: str) -> set[int]:
    return {int(p) for p in text.split(" of ", 1)[0].split(", ")}


def gains(proc: Proc, since: int) -> list[tuple[float, set[int]]]:
    """When the beat's log says it began ticking which partitions (from character ``since`` on)."""
    found = []
    for line in proc.output()[since:].splitlines():
        if " now ticks partition(s) " in line:
            found.append((stamp(line), listed(line.split(" now ticks partition(s) ", 1)[1])))
    return found


def taken_over(procs: Iterable[Proc], since: dict[int, int], partitions: set[int]) -> float | None:
    """When the other beats' logs show every one of ``partitions`` ticked again (``None``: not yet)."""
    seen = sorted(g for p in procs for g in gains(p, since[p.popen.pid]))
    left = set(partitions)
    for at, parts in seen:
        left -= parts
        if not left:
            return at
    return None


def offsets(procs: Iterable[Proc]) -> dict[int, int]:
    return {p.popen.pid: len(p.output()) for p in procs}


def tick_partitions_only_when_held(proc: Proc, since: int) -> int:
    """Every run the beat emitted after ``since`` is of a partition it gained after ``since``.

    For a beat frozen past its trust window: it emits nothing for the partitions it lost until
    it has claimed them again. Returns how many runs it emitted.
    """
    held: set[int] = set()
    count = 0
    for line in proc.output()[since:].splitlines():
        if " now ticks partition(s) " in line:
            held |= listed(line.split(" now ticks partition(s) ", 1)[1])
        elif " gave up partition(s) " in line:
            held -= {int(p) for p in line.split(" gave up partition(s) ", 1)[1].split(" (", 1)[0].split(", ")}
        elif "celery_boundedbeat: emitted " in line:
            name = line.split("celery_boundedbeat: emitted ", 1)[1].split()[0]
            assert PARTITION[name] in held, f"emitted {name} without holding its partition: {line}"
            count += 1
    return count


def start_beats(bb: Harness, count: int) -> list[Proc]:
    """The first beat migrates and takes the lease; the others join it."""
    _worker, first = bb.start(pool="threads", concurrency=16)
    return [first, *(bb.start_beat(migrate=False, wait_lease=False) for _ in range(count - 1))]


def wait_settled(bb: Harness, procs: list[Proc], what: str, timeout: float = 40) -> None:
    bb.wait_until(lambda: settled(bb, procs), timeout, what, interval=0.25)


def check_books_whole(bb: Harness, windows: list[Window], settle: float = 30) -> dict[str, int]:
    """The checks of the module docstring; returns figures for the report."""

    def unsettled() -> int:
        return sum(1 for r in bb.sql("SELECT state FROM boundedbeat_runs") if r["state"] in ACTIVE_STATES)

    bb.wait_until(lambda: unsettled() == 0, settle, "every run emitted to settle")
    ran = executions(bb)
    runs = bb.runs()
    keys = Counter((r.schedule, r.scheduled_for) for r in runs)
    assert [k for k, n in keys.items() if n > 1] == [], "a grid time emitted twice"
    assert doubled(bb) == [], "a run executed twice"
    states = Counter(r.state for r in runs)
    assert set(states) == {"completed"}, f"untracked: runs not completed {states}\n{bb.diagnostics()}"
    ids = {r.id for r in runs}
    assert set(ran) == ids, f"executions without a run row or runs never executed: {set(ran) ^ ids}"
    missed = 0
    for name in NAMES:
        row, rows = bb.books(name)
        ticks = check_grid(bb, name, PERIOD)  # rows + skips (+ pending) == grid times passed
        check_books(bb, name)  # counters == rows
        first = min(r.scheduled_for for r in rows).timestamp()
        have = {round((r.scheduled_for.timestamp() - first) / PERIOD) for r in rows}
        gaps = [first + k * PERIOD for k in range(ticks) if k not in have]
        outside = [t for t in gaps if not any(lo <= t <= hi for lo, hi in windows)]
        assert outside == [], f"{name} missed grid times outside the fault windows: {outside} {windows}"
        assert row["skips"] == len(gaps), f"{name}: {len(gaps)} grid times missed, {row['skips']} counted"
        missed += len(gaps)
    busy = bb.sql("SELECT name FROM boundedbeat_schedules WHERE busy_skips > 0")
    assert busy == [], f"ticks skipped as busy (not a fault): {busy}"
    return {"runs": len(runs), "missed": missed}


def test_four_beats_through_sigterm_a_join_kill_9_and_sigstop(bb: Harness, measure: Measure) -> None:
    write_app(bb)
    assert set(PARTITION.values()) == set(range(PARTITIONS))
    a, b, c, d = start_beats(bb, BEATS)
    wait_settled(bb, [a, b, c, d], "four beats holding four partitions each")
    windows: list[Window] = []
    time.sleep(2 * PERIOD)  # all four tick their share

    # SIGTERM (a beat removed): handed over at once, no window.
    parts, since = share_of(bb, d), offsets([a, b, c])
    signalled = time.time()
    assert bb.stop(d) == 0
    wait_settled(bb, [a, b, c], "three beats holding every partition", timeout=15)
    handover = bb.wait_until(lambda: taken_over([a, b, c], since, parts), 5, "the handover") - signalled
    assert handover <= HANDOVER, f"a stopped beat's partitions were ticked again {handover:.2f} s later"
    measure("SIGTERM: signal to every handed-over partition ticked again", handover, " s")

    # A beat added: it takes its share, handed over cooperatively, no window.
    joined = time.time()
    e = bb.start_beat(migrate=False, wait_lease=False)
    wait_settled(bb, [a, b, c, e], "the new beat holding its share")
    measure("a beat added: start to four fair shares", time.time() - joined, " s")

    # kill -9: claims expire; taken within TTL + one renewal.
    parts, since = share_of(bb, b), offsets([a, c, e])
    killed = kill9(b)
    back = bb.wait_until(
        lambda: taken_over([a, c, e], since, parts), TTL + RENEW + 3 * SLACK, "the killed beat's partitions"
    )
    takeover = back - killed
    windows.append((killed - PERIOD, back + PERIOD))
    assert takeover <= TTL + RENEW + SLACK, f"kill -9 takeover {takeover:.2f} s"
    measure("kill -9: kill to every orphaned partition ticked again", takeover, " s")
    wait_settled(bb, [a, c, e], "three beats after the kill")

    # SIGSTOP the lease holder for twice the TTL, then SIGCONT: it rejoins.
    parts, since = share_of(bb, a), offsets([c, e])
    frozen = time.time()
    os.killpg(a.popen.pid, signal.SIGSTOP)
    try:
        back = bb.wait_until(
            lambda: taken_over([c, e], since, parts), TTL + RENEW + 3 * SLACK, "the frozen beat's partitions"
        )
        windows.append((frozen - PERIOD, back + PERIOD))
        measure("SIGSTOP: stop to every partition of the frozen beat ticked again", back - frozen, " s")
        assert back - frozen <= TTL + RENEW + SLACK, f"SIGSTOP takeover {back - frozen:.2f} s"
        time.sleep(max(frozen + 2 * TTL - time.time(), 0))
    finally:
        resumed_from = len(a.output())
        os.killpg(a.popen.pid, signal.SIGCONT)
    resumed = time.time()
    wait_settled(bb, [a, c, e], "the resumed beat holding its share again")
    measure("SIGCONT: resume to fair shares with the resumed beat", time.time() - resumed, " s")
    time.sleep(2 * PERIOD)
    emitted = tick_partitions_only_when_held(a, resumed_from)
    assert emitted > 0, "the resumed beat ticks its share again"

    for proc in (a, c, e):
        assert bb.stop(proc) == 0
    figures = check_books_whole(bb, windows)
    measure("runs / grid times missed inside the fault windows", f"{figures['runs']} / {figures['missed']}")


def test_four_beats_through_a_postgresql_restart(
    outage_bb: Harness, cluster: PrivatePostgres, measure: Measure
) -> None:
    bb = outage_bb
    write_app(bb)
    beats = start_beats(bb, BEATS)
    wait_settled(bb, beats, "four beats holding four partitions each")
    time.sleep(2 * PERIOD)
    since = offsets(beats)
    stopped = time.time()
    cluster.stop("fast")
    bb.watch(TTL, lambda: None, interval=0.5)  # past every trust window: every claim lapses
    cluster.start()
    restarted = time.time()
    back = bb.wait_until(
        lambda: taken_over(beats, since, set(range(PARTITIONS))),
        TTL + RENEW + 3 * SLACK,
        "every partition ticked again",
    )
    assert back - restarted <= TTL + RENEW + SLACK, f"{back - restarted:.2f} s after the restart"
    measure("PostgreSQL restart: back to every partition ticked", back - restarted, " s")
    wait_settled(bb, beats, "four fair shares after the restart")
    time.sleep(2 * PERIOD)
    for proc in beats:
        assert bb.stop(proc) == 0
    figures = check_books_whole(bb, [(stopped - PERIOD, back + PERIOD)])
    measure("runs / grid times missed inside the outage", f"{figures['runs']} / {figures['missed']}")
