"""Partitioned beats tick in fewer, larger ticks: no dispatcher woken but their own, a gathering wait.

A beat holding ``1/k`` of the partitions waits after a tick that emitted so that ``k`` beats
tick about as often together as one (:func:`~celery_boundedbeat.beat.sharing.gather_for`),
and its tick wakes its own dispatcher directly rather than every beat's through ``NOTIFY``.
"""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery

from celery_boundedbeat import add_schedule
from celery_boundedbeat.beat.scheduler import Scheduler
from celery_boundedbeat.beat.sharing import MAX_GATHER, MIN_TICK, gather_for
from celery_boundedbeat.config.definitions import Resolver
from celery_boundedbeat.core.partitions import slot_of
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.store import QUEUE_CHANNEL, Store, TickResult, utcnow
from celery_boundedbeat.db.tick import EmittedRun, Share


def test_a_beat_with_a_quarter_of_the_partitions_waits_three_ticks_time_at_most_max_gather() -> None:
    assert gather_for(Share(16, (1, 5, 9, 13)), 0.03) == pytest.approx(0.09)
    assert gather_for(Share(16, (1, 5, 9, 13)), 1.0) == MAX_GATHER
    # A tick of a few runs on an idle machine counts as MIN_TICK: two beats do not tick back to back.
    assert gather_for(Share(16, tuple(range(8))), 0.002) == pytest.approx(MIN_TICK)
    assert gather_for(Share(16, (3, 7)), 0.002) == MAX_GATHER


def test_one_beat_with_every_partition_or_none_ticks_as_soon_as_a_row_is_due() -> None:
    assert gather_for(Share(16, tuple(range(16))), 0.05) == 0.0
    assert gather_for(Share(16, ()), 0.05) == 0.0
    assert gather_for(None, 0.05) == 0.0


def _scheduler(url: str) -> Scheduler:
    app = Celery("gather", broker="memory://", set_as_current=False)
    app.conf.update(
        boundedbeat_database_url=url,
        boundedbeat_partitions=16,
        boundedbeat_dispatch_enabled=False,
        boundedbeat_poll_interval=1.0,
    )
    return Scheduler(app)


def _emitting(scheduler: Scheduler, share: Share, took: float) -> list[float]:
    """One pass of the beat with ``share``, whose tick takes ``took`` s, emits and finds the next row
    due at once; returns the waits the pass ended with."""
    waits: list[float] = []
    scheduler._share.keep = lambda *_: (share, False)  # type: ignore[union-attr,method-assign]
    scheduler._share.seconds_to_next_look = lambda: float("inf")  # type: ignore[union-attr,method-assign]
    scheduler._wait = waits.append  # type: ignore[method-assign]
    scheduler._next_reap_at = float("inf")

    def tick(now: datetime, _share: Share | None = None) -> TickResult:
        time.sleep(took)
        run = EmittedRun(id="r1", schedule="s", scheduled_for=now, drift_ms=0, overlap=False)
        return TickResult(now=now, emitted=[run], next_due_at=utcnow())

    scheduler._emit_due = tick  # type: ignore[method-assign]
    scheduler._stale = True
    scheduler._tick()
    return waits


def test_a_beat_with_a_quarter_of_the_partitions_gathers_before_its_next_tick(sqlite_url: str) -> None:
    """Its next row is due at once, yet it waits: the rows falling due meanwhile join that tick.

    Before, it ticked again at once (a wait of 0), four beats ticking twice as often as one.
    """
    scheduler = _scheduler(sqlite_url)
    try:
        waits = _emitting(scheduler, Share(16, (0, 4, 8, 12)), took=0.03)
        assert len(waits) == 1
        # Three ticks' time (0.09 s, of which some passed before the wait was worked out).
        assert 0.05 <= waits[0] <= MAX_GATHER
        assert scheduler._known_due is not None and scheduler._known_due > utcnow() - timedelta(seconds=0.05)
    finally:
        scheduler.close()


def test_a_beat_with_every_partition_ticks_its_next_due_row_at_once(sqlite_url: str) -> None:
    scheduler = _scheduler(sqlite_url)
    try:
        assert _emitting(scheduler, Share(16, tuple(range(16))), took=0.03) == [0.0]
    finally:
        scheduler.close()


@pytest.fixture
def pg_app(migrated_postgres_url: str) -> Celery:
    app = Celery("gather", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = migrated_postgres_url
    return app


def _queue_notices(url: str, tick: Any) -> list[str]:
    """The queue notifications a LISTEN connection hears while ``tick()`` runs and commits."""
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f"LISTEN {QUEUE_CHANNEL}")
        tick()
        return [n.channel for n in conn.notifies(timeout=0.5, stop_after=1)]


@pytest.mark.postgres
def test_a_tick_for_a_beats_own_dispatcher_wakes_no_other_dispatcher(
    pg_app: Celery, migrated_postgres_url: str
) -> None:
    """Each beat's tick woke every beat's dispatcher; with its own dispatcher it needs none."""
    names = [f"tenant-{n}" for n in range(24)]
    for name in names:
        assert add_schedule(pg_app, name, "proj.poll", 3600.0) == "scheduled"
    store = Store(get_engine(migrated_postgres_url))
    mine = sorted({slot_of(n) % 4 for n in names})
    assert len(mine) >= 2, "the names fall in several partitions"
    at = datetime.now(UTC) + timedelta(seconds=1)

    def tick(share: Share) -> None:
        assert store.tick(Resolver(pg_app, {}), at, random.Random(1), 1000, share=share).emitted

    quiet = Share(4, (mine[0],), wake_dispatchers=False)
    assert _queue_notices(migrated_postgres_url, lambda: tick(quiet)) == []
    loud = Share(4, (mine[1],))
    assert _queue_notices(migrated_postgres_url, lambda: tick(loud)) == [QUEUE_CHANNEL]


def test_a_partitioned_beat_that_does_not_lead_sleeps_until_its_next_due_row(sqlite_url: str) -> None:
    """Not the lease holder, it has no reaper to run: it waits for its own next due row.

    Before, the reaper's and the lease's next look (always due for a beat that does not lead)
    made every wait 0: such a beat spun a core between its ticks.
    """
    other = _scheduler(sqlite_url)
    scheduler = _scheduler(sqlite_url)
    try:
        assert other._keep_lease(), "another beat holds the lease"
        waits: list[float] = []
        scheduler._share.keep = lambda *_: (Share(16, (0, 4, 8, 12)), False)  # type: ignore[union-attr,method-assign]
        scheduler._share.seconds_to_next_look = lambda: float("inf")  # type: ignore[union-attr,method-assign]
        scheduler._wait = waits.append  # type: ignore[method-assign]
        scheduler._emit_due = lambda now, _share=None: TickResult(  # type: ignore[method-assign]
            now=now, next_due_at=now + timedelta(seconds=0.5)
        )
        scheduler._stale = True
        scheduler._tick()
        assert not scheduler.lease.acting()
        assert len(waits) == 1 and 0.3 < waits[0] <= 0.5
    finally:
        scheduler.close()
        other.close()
