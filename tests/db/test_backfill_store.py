"""Backfill through the Python API, the CLI and ``Store.tick``, on SQLite and on PostgreSQL.

The beat is played by ``Store.tick`` with the resolver a beat uses, so the schedule runs from
its row alone. A schedule added now has its grid anchored now: the backfilled range is the
grid extended back from the row's ``grid_at``.
"""

from __future__ import annotations

import random
import uuid
from datetime import datetime

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from celery.schedules import crontab, solar
from click.testing import CliRunner, Result
from helpers.clock import sec
from sqlalchemy import Engine, select

from celery_boundedbeat import (
    BackfillRefusedError,
    ConfigurationError,
    UnknownScheduleError,
    add_schedule,
    backfill,
)
from celery_boundedbeat.cli import boundedbeat
from celery_boundedbeat.config.definitions import Resolver
from celery_boundedbeat.core.backfill import BACKFILL_CAP
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.store import Store, utcnow
from celery_boundedbeat.db.tables import QueueRow, RunRow

RNG = random.Random(5)


@pytest.fixture
def app(migrated: Engine, db_url: str) -> Celery:
    app = Celery("backfill", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    return app


@pytest.fixture
def store(engine: Engine, app: Celery) -> Store:
    return Store(engine)


def cli(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(
        boundedbeat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), catch_exceptions=False
    )


def anchored(app: Celery, store: Store, name: str, **policy: object) -> datetime:
    """Add a 10 s schedule; returns its grid anchor (the first tick, at the add)."""
    add_schedule(app, name, "proj.poll", 10.0, policy=policy or None)
    (row,) = store.schedules([name])
    assert row.grid_at is not None
    return row.grid_at


def add_run(store: Store, name: str, at: datetime) -> None:
    """A run of ``name`` for ``at`` written by someone else (a tick, another backfill)."""
    with store.session() as s:
        s.add(
            RunRow(
                id=str(uuid.uuid4()),
                schedule=name,
                task="proj.poll",
                state=RunState.COMPLETED.value,
                scheduled_for=at,
                enqueued_at=at,
            )
        )


def run_times(store: Store, name: str) -> list[datetime]:
    with store.session() as s:
        return sorted(s.scalars(select(RunRow.scheduled_for).where(RunRow.schedule == name)))


def test_backfill_queues_the_missing_grid_times_and_a_tick_emits_exactly_those(
    app: Celery, store: Store
) -> None:
    """Six grid times in range, one with a run: five queued, then emitted once each with a queue row."""
    grid = anchored(app, store, "feed", mode="fixed_rate", max_concurrency=10)
    add_run(store, "feed", grid - sec(30))
    result = backfill(app, "feed", grid - sec(60), grid - sec(1))
    assert result.queued == tuple(grid - sec(s) for s in (60, 50, 40, 20, 10))
    assert (result.had_runs, result.waiting) == (0 + 1, 0)
    assert result.describe().startswith("backfill feed: 5 grid times queued, 1 already had runs (first ")
    (row,) = store.schedules(["feed"])
    assert row.pending_runs == 5 and row.next_due_at is not None and row.next_due_at <= utcnow()
    tick = store.tick(Resolver(app, {}), utcnow(), RNG, 100)
    # The live grid tick and every backfilled time (the latter written first, oldest first).
    assert [r.scheduled_for for r in tick.emitted] == [*result.queued, grid]
    assert run_times(store, "feed") == [grid - sec(s) for s in (60, 50, 40, 30, 20, 10, 0)]
    with store.session() as s:
        assert len(s.scalars(select(QueueRow.run_id)).all()) == 6
    (row,) = store.schedules(["feed"])
    assert (row.active_runs, row.pending_runs, row.grid_runs, row.backfill) == (6, 0, 1, [])


def test_a_time_that_got_a_run_after_the_request_is_not_emitted_and_its_slot_is_kept_free(
    app: Celery, store: Store
) -> None:
    """The unique run key decides at the write: a time taken meanwhile is skipped, no error."""
    grid = anchored(app, store, "feed", mode="fixed_rate", max_concurrency=2)
    backfill(app, "feed", grid - sec(30), grid - sec(10))
    add_run(store, "feed", grid - sec(30))  # another writer got there first
    tick = store.tick(Resolver(app, {}), utcnow(), RNG, 100)
    assert [r.scheduled_for for r in tick.emitted] == [grid]  # 30 s back was taken: not emitted
    (row,) = store.schedules(["feed"])
    assert row.active_runs == 1 and row.backfill == [(grid - sec(s)).isoformat() for s in (20, 10)]
    assert row.next_due_at is not None and row.next_due_at <= utcnow()  # its slot goes to the next
    again = store.tick(Resolver(app, {}), utcnow(), RNG, 100)
    assert [r.scheduled_for for r in again.emitted] == [grid - sec(20)]
    assert run_times(store, "feed") == [grid - sec(s) for s in (30, 20, 0)]
    (row,) = store.schedules(["feed"])
    assert (row.active_runs, row.pending_runs) == (2, 1)


def test_backfill_refuses_unknown_paused_and_fixed_delay_schedules_and_bad_ranges(
    app: Celery, store: Store
) -> None:
    """Each refusal is a catchable error naming the schedule and why; a bad range names the key."""
    grid = anchored(app, store, "feed")
    now = utcnow()
    with pytest.raises(UnknownScheduleError, match="no schedule named 'nope'"):
        backfill(app, "nope", now - sec(60), now - sec(1))
    with pytest.raises(ConfigurationError, match=r"entry 'feed', key 'end': .* is before start"):
        backfill(app, "feed", now - sec(10), now - sec(60))
    with pytest.raises(ConfigurationError, match=r"key 'end': .* is in the future"):
        backfill(app, "feed", now - sec(10), now + sec(3600))
    with pytest.raises(ConfigurationError, match="key 'start': must be an ISO 8601 time, got 'soon'"):
        backfill(app, "feed", "soon", now)
    with pytest.raises(ConfigurationError, match=f"one backfill covers at most {BACKFILL_CAP}"):
        backfill(app, "feed", grid - sec(10 * (BACKFILL_CAP + 5)), grid - sec(1))
    store.set_paused("feed", True, utcnow())
    with pytest.raises(BackfillRefusedError, match="cannot backfill 'feed': the schedule is paused"):
        backfill(app, "feed", grid - sec(60), grid - sec(1))
    add_schedule(app, "slow", "proj.poll", 10.0, policy={"mode": "fixed_delay"})
    with pytest.raises(BackfillRefusedError, match="mode 'fixed_delay' has no grid"):
        backfill(app, "slow", now - sec(60), now - sec(1))
    add_schedule(app, "dusk", "proj.poll", solar("sunset", 52.5, 13.4))
    with pytest.raises(BackfillRefusedError, match="a solar schedule's past event times are not computed"):
        backfill(app, "dusk", now - sec(86400), now - sec(1))


def test_the_cli_prints_what_was_queued_and_refusals_on_one_line_with_exit_1(
    app: Celery, store: Store
) -> None:
    """backfill prints the counts; naive ISO times are UTC; errors exit 1, a missing option exits 2."""
    grid = anchored(app, store, "feed", mode="fixed_rate", max_concurrency=3)
    add_run(store, "feed", grid - sec(20))
    naive = (grid - sec(40)).replace(tzinfo=None).isoformat()
    done = cli(app, "backfill", "feed", "--start", naive, "--end", (grid - sec(1)).isoformat())
    assert done.exit_code == 0, done.output
    assert done.output.startswith("backfill feed: 3 grid times queued, 1 already had runs (first ")
    assert (grid - sec(40)).isoformat() in done.output
    again = cli(app, "backfill", "feed", "--start", naive, "--end", (grid - sec(1)).isoformat())
    assert again.output.startswith(
        "backfill feed: 0 grid times queued, 1 already had runs, 3 already waiting"
    )
    unknown = cli(app, "backfill", "nope", "--start", naive, "--end", naive)
    assert (unknown.exit_code, unknown.output) == (1, "Error: no schedule named 'nope'\n")
    store.set_paused("feed", True, utcnow())
    paused = cli(app, "backfill", "feed", "--start", naive, "--end", naive)
    assert paused.exit_code == 1 and "cannot backfill 'feed': the schedule is paused" in paused.output
    missing = cli(app, "backfill", "feed", "--start", naive)
    assert missing.exit_code == 2 and "--end" in missing.output


def test_a_crontab_schedule_backfills_its_calendar_times(app: Celery, store: Store) -> None:
    """An every-minute crontab queues the whole minutes in the range, from its stored definition."""
    add_schedule(app, "cron", "proj.poll", crontab(minute="*"))
    now = utcnow()
    start, end = now - sec(5 * 60), now - sec(1)
    first = start.replace(second=0, microsecond=0) + sec(60)
    expected = [first + sec(60 * k) for k in range(6) if first + sec(60 * k) <= end]
    result = backfill(app, "cron", start, end)
    assert result.queued == tuple(expected) and result.had_runs == 0
