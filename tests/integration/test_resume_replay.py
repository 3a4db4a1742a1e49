"""`resume` rejoins the grid; `resume --replay` hands the paused ticks to `missed_ticks` (real beat)."""

from __future__ import annotations

import time

import pytest

from .harness import Harness
from .reads import epoch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PERIOD = 1.0
PAUSED_FOR = 4.5


def test_plain_resume_skips_the_paused_ticks_and_replay_runs_them_once_each(bb: Harness) -> None:
    """Both paused 4.5 s: after `resume` no run belongs to the pause; after `resume --replay` every
    grid tick of the pause runs once (catch_up), oldest first, and the grid goes on."""
    policy = {"missed_ticks": "catch_up", "max_pending": 10}
    bb.write_app(
        {
            "plain": bb.entry("plain", PERIOD, policy=policy, durations=[0.05]),
            "replay": bb.entry("replay", PERIOD, policy=policy, durations=[0.05]),
        }
    )
    bb.start(concurrency=4)
    for name in ("plain", "replay"):
        bb.wait_until(lambda n=name: len(bb.finished(n)) >= 2, timeout=30, what=f"2 completed runs of {name}")
    for name in ("plain", "replay"):
        bb.celery("boundedbeat", "pause", name, check=True)
    paused = {name: max(epoch(r.scheduled_for) for r in bb.runs(name)) for name in ("plain", "replay")}
    time.sleep(PAUSED_FOR)
    resumed = time.time()
    bb.celery("boundedbeat", "resume", "plain", check=True)
    bb.celery("boundedbeat", "resume", "replay", "--replay", check=True)

    # Every grid tick the pause passed (after the last run before it, up to the resume).
    passed = int((resumed - paused["replay"]) // PERIOD)
    assert passed >= 4, (resumed, paused)
    bb.wait_until(
        lambda: (
            len([r for r in bb.finished("replay") if paused["replay"] < epoch(r.scheduled_for) < resumed])
            >= passed
        ),
        timeout=30,
        what=f"the {passed} paused ticks of 'replay' completed",
    )
    bb.wait_until(
        lambda: any(epoch(r.scheduled_for) > resumed for r in bb.finished("plain")),
        timeout=20,
        what="'plain' back on its grid",
    )
    replayed = sorted(
        epoch(r.scheduled_for)
        for r in bb.runs("replay")
        if paused["replay"] < epoch(r.scheduled_for) < resumed
    )
    assert replayed == pytest.approx([paused["replay"] + k * PERIOD for k in range(1, passed + 1)], abs=0.005)
    starts = [
        epoch(r.started_at)
        for r in sorted(bb.runs("replay"), key=lambda r: r.scheduled_for)
        if r.started_at is not None and paused["replay"] < epoch(r.scheduled_for) < resumed
    ]
    assert starts == sorted(starts), "replayed ticks start oldest first"
    in_pause = [r for r in bb.runs("plain") if paused["plain"] < epoch(r.scheduled_for) < resumed]
    assert in_pause == [], [r.short() for r in in_pause]
    for name in ("plain", "replay"):
        (row,) = bb.sql(
            "SELECT paused, window_drops, buffer_drops FROM boundedbeat_schedules WHERE name = :n", n=name
        )
        assert (row["paused"], row["window_drops"], row["buffer_drops"]) == (False, 0, 0), (name, row)
    bb.assert_no_errors()
