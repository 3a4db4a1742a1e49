"""Runs that never start (no worker, message lost or purged) settle ``rejected``; nothing stays blocked."""

from __future__ import annotations

import pytest
from integration.harness import Harness

from .conftest import Measure
from .support import check_books, run, stuck

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

START_TIMEOUT = 3.0


def test_runs_nobody_starts_are_rejected_after_start_timeout_and_the_schedule_goes_on(
    bb: Harness, measure: Measure
) -> None:
    """Without a worker, each run is rejected start_timeout after publication; the next one follows."""
    bb.write_app(
        {"orphan": bb.entry("orphan", 1.0, durations=[0.2])},
        boundedbeat_start_timeout=START_TIMEOUT,
    )
    beat = bb.start_beat()
    rejected = bb.wait_until(
        lambda: (found := bb.finished("orphan", "rejected")) and len(found) >= 2 and found,
        4 * START_TIMEOUT + 10,
        "two runs rejected for want of a worker",
    )
    for r in rejected:
        assert r.published_at is not None and r.finished_at is not None and r.started_at is None
        waited = (r.finished_at - r.published_at).total_seconds()
        # start_timeout, then at most one reaper pass (1 s) and scheduling slack.
        assert START_TIMEOUT <= waited <= START_TIMEOUT + 3.0, (waited, r.short())
        assert "boundedbeat_start_timeout" in (r.error or ""), r.error
    assert "settled rejected by the reaper" in beat.output()

    # A worker at last: fresh runs complete, while the stale messages still in the queue
    # expire (they carry start_timeout as Celery ``expires``) instead of running late.
    bb.start_worker(pool="threads", concurrency=2)
    bb.wait_until(lambda: len(bb.finished("orphan")) >= 2, 30, "fresh runs to complete")
    executed = {iv.id for iv in bb.intervals("orphan")}
    assert executed, "the fresh runs were executed"
    for r in rejected:
        assert r.id not in executed, f"stale message {r.id} ran after its run was rejected"
        again = run(bb, r.id)
        assert again is not None and again.state == "rejected" and again.finished_at == r.finished_at
    states = check_books(bb, "orphan")
    assert states.get("rejected", 0) >= 2, states
    assert stuck(bb, "orphan") == []
    measure(
        "never-started run rejected after publication",
        max(
            (r.finished_at - r.published_at).total_seconds()
            for r in rejected
            if r.finished_at and r.published_at
        ),
        f" s (start_timeout {START_TIMEOUT:g} s)",
    )
