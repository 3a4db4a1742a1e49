"""The beat in-process: notices that land while it works are kept; its definition cache stays bounded."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import pytest
from celery import Celery

from celery_boundedbeat import add_schedule, remove_schedule
from celery_boundedbeat.beat import scheduler as scheduler_module
from celery_boundedbeat.beat.scheduler import Scheduler
from celery_boundedbeat.config.definitions import sweep_slack
from celery_boundedbeat.db.runs import SETTLED_CHANNEL
from celery_boundedbeat.db.store import SCHEDULES_CHANNEL

pytestmark = pytest.mark.timeout(180)


def _app(url: str, **conf: object) -> Celery:
    app = Celery("noticetest", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = url
    app.conf.boundedbeat_dispatch_enabled = False
    app.conf.boundedbeat_poll_interval = 0.05
    app.conf.boundedbeat_auto_migrate = True
    app.conf.beat_schedule = {"keep": {"task": "proj.keep", "schedule": 3600.0}}
    app.conf.update(conf)
    return app


def _counting(scheduler: Scheduler, method: str, during: Callable[[], None] | None = None) -> list[int]:
    """Count the calls of the store's ``method``; ``during`` runs inside the next call, once."""
    calls = [0]
    real = getattr(scheduler.store, method)
    pending = [during]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        result = real(*args, **kwargs)
        hook, pending[0] = pending[0], None
        if hook is not None:
            hook()  # after the read, before the caller looks at the result: the worst moment
        return result

    setattr(scheduler.store, method, counted)
    return calls


@pytest.fixture
def hearing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The beat behaves as on PostgreSQL with a working LISTEN: it looks only when told to."""
    monkeypatch.setattr(Scheduler, "_polling", property(lambda self: False))


@pytest.mark.usefixtures("hearing")
def test_a_schedule_notice_landing_during_a_tick_is_acted_on_at_the_next_look(sqlite_url: str) -> None:
    """A change notified while a tick runs is looked at by the next tick, not at the minute's backstop.

    The tick used to set ``stale`` from its own result after it ended, erasing the flag the
    listener thread had just set: the change then waited up to 60 s.
    """
    scheduler = Scheduler(_app(sqlite_url), max_interval=0.01)
    try:
        scheduler.tick()  # lease, reconcile, the first look
        ticks = _counting(scheduler, "tick")
        scheduler.tick()
        assert ticks[0] == 0, "nothing notified, nothing due: an idle beat stays off the database"

        ticks = _counting(scheduler, "tick", during=lambda: scheduler._on_notify(SCHEDULES_CHANNEL, "x"))
        scheduler._on_notify(SCHEDULES_CHANNEL, "")
        scheduler.tick()
        assert ticks[0] == 1
        scheduler.tick()
        assert ticks[0] == 2, "the notice that landed during the tick was lost"
        scheduler.tick()
        assert ticks[0] == 2, "acted on once, then idle again"
    finally:
        scheduler.close()


@pytest.mark.usefixtures("hearing")
def test_a_settle_notice_landing_during_the_alert_pass_is_acted_on_at_the_next_pass(sqlite_url: str) -> None:
    """Alerts a settle left while the beat was taking alerts are sent at the next pass.

    The pass used to set ``alerts may wait`` from its own batch after it read, erasing a
    settle notice that arrived meanwhile: those alerts waited for the minute's backstop.
    """
    scheduler = Scheduler(_app(sqlite_url), max_interval=0.01)
    try:
        scheduler.tick()
        takes = _counting(scheduler, "take_alerts", during=lambda: scheduler._on_notify(SETTLED_CHANNEL, ""))
        scheduler._alerts_may_wait = True
        scheduler._next_reap_at = 0.0
        scheduler.tick()
        assert takes[0] == 1
        scheduler._next_reap_at = 0.0
        scheduler.tick()
        assert takes[0] == 2, "the settle notice that landed during the alert pass was lost"
        scheduler._next_reap_at = 0.0
        scheduler.tick()
        assert takes[0] == 2, "acted on once, then idle again"
    finally:
        scheduler.close()


class DeafListener:
    """A LISTEN connection that delivers nothing: every removal's notification is lost."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.listening = False

    def start(self) -> None:
        pass

    def stop(self, grace: float = 2.0) -> bool:
        return True


def test_the_definition_cache_stays_bounded_while_schedules_come_and_go(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,500 runtime schedules added, run and removed, notices lost: the cache keeps only live ones.

    The bound (docs/runtime-schedules.md): the schedules present at the last sweep plus
    ``sweep_slack`` of them, checked after every tick. Without the sweep every removed
    schedule kept its entry (1,500 here) on SQLite always, on PostgreSQL when a removal's
    notification was missed.
    """
    monkeypatch.setattr(scheduler_module, "Listener", DeafListener)
    app = _app(db_url)
    scheduler = Scheduler(app, max_interval=0.01)
    rounds, per_round = 15, 100
    swept: list[int] = []  # the size of each sweep's read
    read_names = scheduler.store.schedule_names

    def sweep_read(among: Collection[str] | None = None) -> set[str]:
        # A sweep reads the names the beat holds, never the whole table: with a million
        # schedules, that read alone would cost more memory than the cache it trims.
        assert among is not None, "the sweep read every schedule name"
        assert set(among) <= scheduler.resolver.names() | scheduler._failing_rows
        swept.append(len(among))
        return read_names(among=among)

    monkeypatch.setattr(scheduler.store, "schedule_names", sweep_read)
    try:
        scheduler.tick()
        largest = 0
        for r in range(rounds):
            names = [f"tenant{r}-{i}" for i in range(per_round)]
            for name in names:
                # Due again within the beat's horizon (Resolver.KEEP_DUE_WITHIN): kept cached.
                assert add_schedule(app, name, "proj.tenant", 60.0) == "scheduled"
            scheduler.tick()  # each is due at its add: the tick resolves (caches) every one
            assert all(name in scheduler.resolver._cache for name in names)
            for name in names:
                assert remove_schedule(app, name)
            scheduler.tick()
            live = len(read_names())
            largest = max(largest, len(scheduler.resolver))
            bound = live + per_round + sweep_slack(live + per_round)
            assert len(scheduler.resolver) <= bound, (
                f"round {r}: {len(scheduler.resolver)} cached definitions for {live} schedules"
            )
        assert largest > sweep_slack(0) // 2, "the churn is large enough to reach the sweep"
        assert swept, "the cache was swept"
    finally:
        scheduler.close()


def test_a_tick_that_fails_once_is_tried_again_at_once_and_a_second_failure_waits(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One failed tick (a cut connection, replaced by the pool) is followed by another at once.

    The beat used to wait its poll interval first, and every run due meanwhile was emitted that
    much late (870 ms under ``pg_terminate_backend`` in tests/faults/test_terminated_connections.py).
    A second failure in a row is an outage: the beat waits as before.
    """
    from sqlalchemy.exc import OperationalError

    scheduler = Scheduler(_app(sqlite_url, boundedbeat_poll_interval=5.0), max_interval=5.0)
    try:
        scheduler.tick()  # lease, reconcile, the first look
        waits: list[float] = []
        monkeypatch.setattr(scheduler, "_wait", waits.append)
        failing = [2]
        real = scheduler.store.tick

        def cut(*args: Any, **kwargs: Any) -> Any:
            if failing[0]:
                failing[0] -= 1
                raise OperationalError("SELECT", {}, ConnectionResetError("terminating connection"))
            return real(*args, **kwargs)

        monkeypatch.setattr(scheduler.store, "tick", cut)
        scheduler._on_notify(SCHEDULES_CHANNEL, "")
        assert scheduler.tick() == 0 and waits == [], "the first failure waited"
        scheduler.tick()
        assert len(waits) == 1 and waits[0] > 0.5, "a second failure in a row is an outage: wait"
        scheduler.tick()
        assert failing == [0] and scheduler._tick_failures == 0
        failing[0] = 1
        scheduler._on_notify(SCHEDULES_CHANNEL, "")
        waits.clear()
        scheduler.tick()
        assert waits == [], "after a success, a failure is again tried at once"
    finally:
        scheduler.close()
