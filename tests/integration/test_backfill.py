"""``celery boundedbeat backfill`` against a real beat and worker (issue #10 point 3).

PostgreSQL + RabbitMQ (the beat is woken by NOTIFY) and SQLite + the filesystem transport (the
beat looks every ``boundedbeat_poll_interval``). Each command runs in its own process. The
schedule is a runtime one on a 2 s grid with ``fixed_rate`` and ``max_concurrency`` 2 whose
task takes 0.6 s, so the backfilled runs queue up behind the bound; the tasks' own start and
end records show how many really ran at once.
"""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta

import pytest

from .harness import Harness
from .reads import Run, max_concurrent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

#: Most seconds from a backfill command's end (or a beat's start) to the first backfilled run
#: accepted by the broker on two busy cores (runtime changes are picked up within 2 s).
PICKUP = 3.0
PERIOD = 2.0
BOUND = 2
POLICY = json.dumps({"mode": "fixed_rate", "max_concurrency": BOUND})


def now() -> datetime:
    return datetime.now(UTC)


def cli(bb: Harness, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return bb.celery("boundedbeat", *args, check=check)


def add_fill(bb: Harness) -> datetime:
    """Add the ``fill`` schedule; returns its ``grid_at`` just after (with no beat: the first tick)."""
    kwargs = json.dumps({"name": "fill", "durations": [0.6]})
    out = cli(
        bb, "add", "fill", f"{bb.module}.work", "--every", str(PERIOD), "--kwargs", kwargs, "--policy", POLICY
    )
    assert out.stdout.strip() == "scheduled", out.stdout
    (row,) = bb.sql("SELECT grid_at FROM boundedbeat_schedules WHERE name = 'fill'")
    grid = row["grid_at"]
    grid = grid if isinstance(grid, datetime) else datetime.fromisoformat(grid)
    return grid if grid.tzinfo else grid.replace(tzinfo=UTC)


def backfilled(bb: Harness, before: datetime) -> list[Run]:
    return [r for r in bb.runs("fill") if r.scheduled_for < before]


def check_emitted_oldest_first_within_the_bound(bb: Harness, runs: list[Run], detail: str) -> None:
    """Backfilled runs were emitted in grid order and never ran more than ``BOUND`` at once."""
    by_time = sorted(runs, key=lambda r: r.scheduled_for)
    enqueued = [r.enqueued_at for r in by_time]
    assert enqueued == sorted(enqueued), f"backfilled runs not emitted oldest first\n{detail}"
    spans = [(iv.start, iv.end) for iv in bb.intervals("fill") if iv.end is not None]
    assert max_concurrent(spans) <= BOUND, f"more than {BOUND} runs of fill at once\n{detail}"


def test_a_backfill_while_beat_runs_emits_exactly_the_missing_grid_times_oldest_first_within_the_bound(
    bb: Harness,
) -> None:
    """Backfilling a range that also holds the schedule's own runs emits only the grid times before it.

    The range is ten grid times before the schedule existed plus the ones it has run since;
    the command says so, the ten start oldest first within ``PICKUP`` of the command, never
    more than the bound at once with the live ticks, each exactly once, and ``grid_runs``
    (what ``max_runs`` bounds) counts none of them.
    """
    bb.write_app({})
    bb.start(concurrency=4)
    add_fill(bb)
    bb.wait_until(lambda: len(bb.finished("fill")) >= 3, timeout=30, what="three runs of the schedule")
    grid = bb.runs("fill")[0].scheduled_for  # the first tick, at the add: the grid's anchor
    own = [r for r in bb.runs("fill") if r.state == "completed"]
    end = own[-1].scheduled_for
    start = grid - timedelta(seconds=10 * PERIOD)
    expected = [grid - timedelta(seconds=PERIOD * k) for k in range(10, 0, -1)]
    had = len([r for r in bb.runs("fill") if start <= r.scheduled_for <= end])
    out = cli(bb, "backfill", "fill", "--start", start.isoformat(), "--end", end.isoformat())
    asked = now()
    assert out.stdout.startswith(f"backfill fill: 10 grid times queued, {had} already had runs"), out.stdout
    bb.wait_until(
        lambda: len([r for r in backfilled(bb, grid) if r.state == "completed"]) == 10,
        timeout=40,
        what="the ten backfilled runs completed",
    )
    runs = backfilled(bb, grid)
    detail = "\n".join(r.short() for r in bb.runs("fill"))
    assert sorted(r.scheduled_for for r in runs) == expected, detail
    first = min(runs, key=lambda r: r.scheduled_for)
    assert first.published_at is not None and (first.published_at - asked).total_seconds() <= PICKUP, detail
    check_emitted_oldest_first_within_the_bound(bb, runs, detail)
    again = cli(bb, "backfill", "fill", "--start", start.isoformat(), "--end", end.isoformat())
    assert again.stdout.startswith(f"backfill fill: 0 grid times queued, {had + 10} already had runs")
    future = cli(
        bb, "backfill", "fill", "--start", start.isoformat(), "--end", "2999-01-01T00:00:00", check=False
    )
    assert future.returncode == 1 and "is in the future" in future.stderr, future.stderr
    cli(bb, "pause", "fill")  # no more emissions: the counters below hold still
    paused = cli(bb, "backfill", "fill", "--start", start.isoformat(), "--end", end.isoformat(), check=False)
    assert paused.returncode == 1 and "cannot backfill 'fill': the schedule is paused" in paused.stderr
    (shown,) = [s for s in json.loads(cli(bb, "status", "--json").stdout) if s["name"] == "fill"]
    live = [r for r in bb.runs("fill") if r.scheduled_for >= grid]
    assert shown["grid_runs"] == len(live), f"backfilled runs counted as grid runs\n{detail}"
    (row,) = bb.sql("SELECT backfill FROM boundedbeat_schedules WHERE name = 'fill'")
    assert row["backfill"] in ([], "[]"), row
    bb.assert_no_errors()


def test_a_backfill_stored_with_no_beat_running_is_emitted_once_a_beat_starts(bb: Harness) -> None:
    """With only a worker up, the request is stored; the beat started later emits the ten times.

    The grid ticks that passed while no beat ran are left to ``missed_ticks`` (skip) and the
    backfill does not touch them: the ten backfilled times are exactly the ones asked for.
    """
    bb.write_app({})
    bb.migrate()
    bb.start_worker(concurrency=4)
    grid = add_fill(bb)
    start, end = grid - timedelta(seconds=10 * PERIOD), grid - timedelta(seconds=0.5)
    out = cli(bb, "backfill", "fill", "--start", start.isoformat(), "--end", end.isoformat())
    assert out.stdout.startswith("backfill fill: 10 grid times queued, 0 already had runs"), out.stdout
    assert bb.runs("fill") == []
    assert bb.schedule("fill")["pending_runs"] == 10
    bb.start_beat()
    started = now()
    bb.wait_until(
        lambda: len([r for r in backfilled(bb, grid) if r.state == "completed"]) == 10,
        timeout=40,
        what="the ten backfilled runs completed",
    )
    runs = backfilled(bb, grid)
    detail = "\n".join(r.short() for r in bb.runs("fill"))
    expected = [grid - timedelta(seconds=PERIOD * k) for k in range(10, 0, -1)]
    assert sorted(r.scheduled_for for r in runs) == expected, detail
    first = min(runs, key=lambda r: r.scheduled_for)
    assert first.published_at is not None and (first.published_at - started).total_seconds() <= PICKUP, detail
    check_emitted_oldest_first_within_the_bound(bb, runs, detail)
    bb.assert_no_errors()
