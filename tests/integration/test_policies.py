"""Timing policies under a real beat, a real worker, a real broker and a real database."""

from __future__ import annotations

import itertools

import pytest

from .harness import Harness
from .reads import ACTIVE_STATES, Run, epoch, max_concurrent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def on_grid(runs: list[Run], period: float, tolerance: float = 0.005) -> None:
    """Every run's ``scheduled_for`` lies on the schedule's grid (a whole number of periods apart)."""
    first = epoch(runs[0].scheduled_for)
    for run in runs:
        offset = (epoch(run.scheduled_for) - first) / period
        assert abs(offset - round(offset)) * period < tolerance, f"{run.short()} is off the {period} s grid"


def active_at_most(bb: Harness, schedule: str, limit: int):
    """An invariant for ``wait_until(each=...)``: never more than ``limit`` active rows."""

    def check() -> None:
        active = [r for r in bb.runs(schedule) if r.state in ACTIVE_STATES]
        assert len(active) <= limit, "too many active runs:\n" + "\n".join(r.short() for r in active)

    return check


def db_intervals(runs: list[Run]) -> list[tuple[float, float]]:
    return [(epoch(r.started_at), epoch(r.finished_at)) for r in runs if r.started_at and r.finished_at]


def test_fixed_rate_no_overlap_never_overlaps_and_counts_skips(bb: Harness) -> None:
    """A 1 s fixed_rate_no_overlap schedule with a 2.5 s task never runs twice at once and counts skips."""
    bb.write_app({"slow": bb.entry("slow", 1.0, policy={"mode": "fixed_rate_no_overlap"}, durations=[2.5])})
    bb.start(concurrency=4)
    bb.wait_until(
        lambda: len(bb.finished("slow")) >= 4,
        timeout=35,
        what="4 completed runs of 'slow'",
        each=active_at_most(bb, "slow", 1),
    )
    runs = bb.runs("slow")
    completed = [r for r in runs if r.state == "completed"]
    row = bb.schedule("slow")

    # Our own table: each run starts only after the previous one finished.
    by_start = sorted((r for r in runs if r.started_at), key=lambda r: r.started_at)
    for before, after in itertools.pairwise(by_start):
        assert before.finished_at is not None, f"{before.short()} still active while {after.short()} started"
        assert after.started_at >= before.finished_at, f"overlap:\n{before.short()}\n{after.short()}"
    # What the tasks themselves saw.
    seen = bb.intervals("slow")
    done = [(iv.start, iv.end) for iv in seen if iv.end is not None]
    assert max_concurrent(done) == 1
    for before, after in itertools.pairwise(seen):
        assert before.end is not None and after.start >= before.end, (
            f"task-recorded overlap: {before} {after}"
        )
    assert {iv.id for iv in seen} <= {r.id for r in runs}, "a task ran with an id that is not a run id"
    # Every 2.5 s run passes at least two 1 s ticks, each skipped.
    assert row["skips"] >= 2 * (len(completed) - 1), row
    assert row["overlaps"] == 0, row
    on_grid(runs, 1.0)
    bb.assert_no_errors()


def test_fixed_rate_stays_within_max_concurrency(bb: Harness) -> None:
    """A 1 s fixed_rate schedule with max_concurrency 2 and a 3.5 s task runs two at once, never three."""
    policy = {"mode": "fixed_rate", "max_concurrency": 2}
    bb.write_app({"pair": bb.entry("pair", 1.0, policy=policy, durations=[3.5])})
    bb.start(concurrency=6)
    bb.wait_until(
        lambda: len(bb.finished("pair")) >= 5,
        timeout=35,
        what="5 completed runs of 'pair'",
        each=active_at_most(bb, "pair", 2),
    )
    runs = bb.runs("pair")
    row = bb.schedule("pair")
    seen = [(iv.start, iv.end) for iv in bb.intervals("pair") if iv.end is not None]
    assert max_concurrent(seen) == 2, f"task-recorded concurrency must reach 2 and stay there: {seen}"
    assert max_concurrent(db_intervals(runs)) == 2, "\n".join(r.short() for r in runs)
    assert row["overlaps"] >= 1, row
    # Two 3.5 s runs hold both slots over at least two 1 s ticks each cycle.
    assert row["skips"] >= 2, row
    on_grid(runs, 1.0)
    bb.assert_no_errors()


def test_fixed_delay_waits_a_period_after_each_finish(bb: Harness) -> None:
    """A 1.5 s fixed_delay schedule starts each run 1.5 s (plus latency) after the previous one finished."""
    period = 1.5
    bb.write_app(
        {
            "delay": bb.entry(
                "delay", period, policy={"mode": "fixed_delay"}, durations=[0.2, 1.8, 0.6, 1.2], cycle=True
            )
        }
    )
    bb.start(concurrency=4)
    bb.wait_until(
        lambda: len(bb.finished("delay")) >= 5,
        timeout=35,
        what="5 completed runs of 'delay'",
        each=active_at_most(bb, "delay", 1),
    )
    runs = sorted((r for r in bb.runs("delay") if r.started_at), key=lambda r: r.started_at)
    completed = [r for r in runs if r.state == "completed"]
    gaps = []
    for before, after in itertools.pairwise(runs):
        assert before.finished_at is not None, f"{before.short()} still active when {after.short()} started"
        gap = epoch(after.started_at) - epoch(before.finished_at)
        gaps.append(round(gap, 3))
        assert period - 0.01 <= gap < period + 3.0, f"gap {gap:.3f} s:\n{before.short()}\n{after.short()}"
        queued = epoch(after.enqueued_at) - epoch(before.finished_at)
        assert queued >= period - 0.01, f"emitted {queued:.3f} s after the finish:\n{after.short()}"
    seen = [iv for iv in bb.intervals("delay") if iv.end is not None]
    for before, after in itertools.pairwise(seen):
        assert after.start - before.end >= period - 0.01, f"task-recorded gap too short: {before} {after}"
    elapsed = [r.elapsed_ms for r in completed if r.elapsed_ms is not None]
    assert max(elapsed) - min(elapsed) >= 1000, f"durations should vary: {elapsed}"
    row = bb.schedule("delay")
    assert row["skips"] == 0 and row["overlaps"] == 0, row
    bb.assert_no_errors()


def test_coalesce_latest_keeps_one_pending_run_and_starts_it_after_a_slow_run(bb: Harness) -> None:
    """With coalesce_latest, ticks missed by a slow run become one pending run that starts right after it."""
    period = 3.0
    policy = {"mode": "fixed_rate_no_overlap", "missed_ticks": "coalesce_latest"}
    bb.write_app({"coal": bb.entry("coal", period, policy=policy, durations=[7.0, 0.3])})
    bb.start(concurrency=4)

    def bounded() -> None:
        active_at_most(bb, "coal", 1)()
        row = bb.schedules().get("coal")
        assert row is None or row["pending_runs"] <= 1, row

    bb.wait_until(
        lambda: len(bb.finished("coal")) >= 3, timeout=40, what="3 completed runs of 'coal'", each=bounded
    )
    runs = bb.runs("coal")
    slow, coalesced, resumed = runs[0], runs[1], runs[2]
    assert slow.elapsed_ms is not None and slow.elapsed_ms >= 6900, slow.short()
    t0, finished = epoch(slow.scheduled_for), epoch(slow.finished_at)
    # The pending run is the latest tick that passed while the slow run was busy...
    latest_missed = t0 + period * int((finished - t0) // period)
    assert latest_missed >= t0 + 2 * period
    assert abs(epoch(coalesced.scheduled_for) - latest_missed) < 0.005, (
        f"expected the run for the latest missed tick:\n{slow.short()}\n{coalesced.short()}"
    )
    # ...it starts as soon as the slot frees, not at the next grid tick...
    assert coalesced.started_at is not None
    delay = epoch(coalesced.started_at) - finished
    assert 0 <= delay < 1.5, f"pending run started {delay:.3f} s after the slow run finished"
    # ...the earlier missed ticks were dropped and counted...
    dropped = round((latest_missed - t0) / period) - 1
    assert bb.schedule("coal")["skips"] >= dropped >= 1
    # ...and the schedule goes on on its grid.
    assert epoch(resumed.scheduled_for) > latest_missed
    on_grid(runs, period)
    seen = [(iv.start, iv.end) for iv in bb.intervals("coal") if iv.end is not None]
    assert max_concurrent(seen) == 1
    bb.assert_no_errors()


def test_catch_up_runs_up_to_max_pending_back_to_back_after_a_slow_run(bb: Harness) -> None:
    """With catch_up and max_pending 2, the two oldest ticks a slow run missed run back to back after it."""
    period = 3.0
    policy = {"mode": "fixed_rate_no_overlap", "missed_ticks": "catch_up", "max_pending": 2}
    bb.write_app({"catch": bb.entry("catch", period, policy=policy, durations=[10.0, 0.3])})
    bb.start(concurrency=4)

    def bounded() -> None:
        active_at_most(bb, "catch", 1)()
        row = bb.schedules().get("catch")
        assert row is None or row["pending_runs"] <= 2, row

    bb.wait_until(
        lambda: len(bb.finished("catch")) >= 4, timeout=40, what="4 completed runs of 'catch'", each=bounded
    )
    runs = bb.runs("catch")
    slow = runs[0]
    assert slow.elapsed_ms is not None and slow.elapsed_ms >= 9900, slow.short()
    t0, finished = epoch(slow.scheduled_for), epoch(slow.finished_at)
    missed = int((finished - t0) // period)  # grid ticks that passed while the slow run was busy
    assert missed >= 3, f"the slow run should span three ticks: {slow.short()}"
    catch_up = [r for r in runs[1:] if epoch(r.scheduled_for) < finished]
    assert [round(epoch(r.scheduled_for) - t0, 3) for r in catch_up] == [period, 2 * period], (
        "expected exactly the two oldest missed ticks to be caught up:\n" + "\n".join(r.short() for r in runs)
    )
    # Back to back: each caught-up run starts within moments of the run before it finishing.
    by_start = sorted((r for r in runs if r.started_at), key=lambda r: r.started_at)
    for run in catch_up:
        index = by_start.index(run)
        before = by_start[index - 1]
        delay = epoch(run.started_at) - epoch(before.finished_at)
        assert 0 <= delay < 1.5, (
            f"caught-up run started {delay:.3f} s after:\n{before.short()}\n{run.short()}"
        )
    assert bb.schedule("catch")["skips"] >= missed - 2 >= 1
    on_grid(runs, period)
    seen = [(iv.start, iv.end) for iv in bb.intervals("catch") if iv.end is not None]
    assert max_concurrent(seen) == 1
    bb.assert_no_errors()
