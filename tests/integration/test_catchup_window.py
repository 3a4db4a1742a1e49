"""catchup_window under a real beat that was down: the ticks older than the window are dropped."""

from __future__ import annotations

import time

import pytest

from .harness import Harness
from .reads import ACTIVE_STATES, epoch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PERIOD = 1.0
WINDOW = 2.5


def test_a_restarted_beat_catches_up_only_the_ticks_within_the_window(bb: Harness) -> None:
    """Beat down for 6 s, catch_up with a 2.5 s window: the restart tick runs the passed ticks at most
    2.5 s old, oldest first, and counts every older one in window_drops (not in busy or buffer drops)."""
    policy = {"missed_ticks": "catch_up", "max_pending": 100, "catchup_window": WINDOW}
    bb.write_app({"win": bb.entry("win", PERIOD, policy=policy, durations=[0.1])})
    _worker, beat = bb.start(concurrency=2)
    bb.wait_until(lambda: len(bb.finished("win")) >= 2, timeout=30, what="2 completed runs of 'win'")
    assert bb.stop(beat) == 0, beat.tail()
    bb.wait_until(lambda: not any(r.state in ACTIVE_STATES for r in bb.runs("win")), timeout=15, what="quiet")
    last = max(epoch(r.scheduled_for) for r in bb.runs("win"))
    (before,) = bb.sql("SELECT skips, window_drops FROM boundedbeat_schedules WHERE name = 'win'")
    time.sleep(6 * PERIOD)  # the downtime under test
    bb.start_beat(migrate=False)
    after = bb.wait_until(
        lambda: [r for r in bb.runs("win") if epoch(r.scheduled_for) > last],
        timeout=20,
        what="the restarted beat's first tick",
    )
    found = min(epoch(r.enqueued_at) for r in after)  # the ``now`` of the restart tick
    passed = [last + k * PERIOD for k in range(1, int((found - last) // PERIOD) + 1)]
    within = [t for t in passed if found - t <= WINDOW]
    assert len(passed) >= 6 and 2 <= len(within) <= 3, (found - last, passed)
    # Every tick within the window runs (the pending ones as slots free), none older.
    bb.wait_until(
        lambda: len([r for r in bb.finished("win") if last < epoch(r.scheduled_for) <= found]) == len(within),
        timeout=20,
        what=f"the {len(within)} ticks within the window completed",
    )
    caught_up = sorted(
        epoch(r.scheduled_for) for r in bb.runs("win") if last < epoch(r.scheduled_for) <= found
    )
    assert caught_up == pytest.approx(within, abs=0.005), (caught_up, within)
    (row,) = bb.sql(
        "SELECT skips, busy_skips, window_drops, buffer_drops FROM boundedbeat_schedules WHERE name = 'win'"
    )
    dropped = len(passed) - len(within)
    assert row["window_drops"] - before["window_drops"] == dropped, (row, before, dropped)
    assert row["skips"] - before["skips"] == dropped, (row, before)
    assert (row["busy_skips"], row["buffer_drops"]) == (0, 0), row
    bb.assert_no_errors()
