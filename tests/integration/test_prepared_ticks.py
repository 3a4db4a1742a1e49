"""Ticks prepared ahead of their due time, under a real beat, worker, broker and database.

On PostgreSQL the beat writes each tick ``boundedbeat_prepare_ahead`` before it is due and
commits it at the due instant; a prepared run is recognisable by ``enqueued_at`` equal to its
``scheduled_for``. SQLite never prepares. Either way no run is published before it is due,
every grid tick runs once, and a schedule waiting on a busy slot is still decided at its due
time by its policy.
"""

from __future__ import annotations

from collections import Counter

import pytest

from .harness import Harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FREE = {"mode": "fixed_rate", "max_concurrency": 100}


def test_prepared_ticks_publish_nothing_early_and_every_grid_tick_once(bb: Harness) -> None:
    schedule = {f"free{i}": bb.entry(f"free{i}", 1.0, policy=FREE, durations=[0.05]) for i in range(20)}
    schedule["busy"] = bb.entry("busy", 1.0, policy={"mode": "fixed_rate_no_overlap"}, durations=[2.5])
    bb.write_app(schedule, boundedbeat_prepare_ahead=0.5)
    bb.start(concurrency=8)
    bb.wait_until(
        lambda: len(bb.finished("free0")) >= 6 and len(bb.finished("busy")) >= 2,
        timeout=60,
        what="6 completed runs of free0 and 2 of busy",
    )
    runs = bb.runs()
    early = [r.short() for r in runs if r.published_at is not None and r.published_at < r.scheduled_for]
    assert not early, "published before due:\n" + "\n".join(early)
    doubled = [k for k, n in Counter((r.schedule, r.scheduled_for) for r in runs).items() if n > 1]
    assert not doubled, doubled
    prepared = [r for r in runs if r.schedule.startswith("free") and r.enqueued_at == r.scheduled_for]
    if bb.backend.is_postgres:
        # The first tick at start-up is due at once (nothing to prepare ahead); later ones are prepared.
        free_runs = [r for r in runs if r.schedule.startswith("free")]
        assert len(prepared) >= len(free_runs) // 2, f"{len(prepared)} of {len(free_runs)} runs prepared"
    else:
        assert prepared == []
    # The busy schedule waits on its slot, so it is decided at its due time: it still skips.
    busy = bb.schedule("busy")
    assert busy["skips"] >= 2 * (len(bb.finished("busy")) - 1), busy
    assert busy["overlaps"] == 0, busy
    bb.assert_no_errors()
