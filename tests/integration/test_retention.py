"""Retention per schedule under a real beat and worker: keep_runs holds while the schedule ticks."""

from __future__ import annotations

import pytest

from .harness import Harness
from .reads import ACTIVE_STATES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_keep_runs_bounds_the_history_while_beat_ticks_and_leaves_other_schedules_alone(bb: Harness) -> None:
    """keep_runs 3 on a 0.5 s schedule with 1 s retention passes: after 12 runs only the 3 newest
    settled runs stay, while a schedule without the key keeps every run; no process logs an error."""
    bb.write_app(
        {
            "kept": bb.entry("kept", 0.5, policy={"keep_runs": 3}, durations=[0.05]),
            "all": bb.entry("all", 0.5, durations=[0.05]),
        },
        boundedbeat_retention_interval=1.0,
    )
    bb.start(concurrency=2)
    bb.wait_until(lambda: bb.schedule("kept")["runs"] >= 12, 60, "12 completed runs of 'kept'")
    for name in ("kept", "all"):
        bb.celery("boundedbeat", "pause", name, check=True)
    bb.wait_until(
        lambda: all(bb.schedule(n)["active_runs"] == 0 for n in ("kept", "all")), 30, "every run settled"
    )
    bb.wait_until(
        lambda: len([r for r in bb.runs("kept") if r.state not in ACTIVE_STATES]) == 3,
        30,
        "retention to bring 'kept' down to 3 settled runs",
    )
    kept, everything = bb.runs("kept"), bb.runs("all")
    row, other = bb.schedule("kept"), bb.schedule("all")
    assert [r.state for r in kept] == ["completed"] * 3
    assert row["runs"] >= 12, "the counters are never lowered by retention"
    assert len(everything) == other["runs"] + other["failures"], "the schedule without keys keeps every run"
    assert len(everything) >= 12
    bb.assert_no_errors()
