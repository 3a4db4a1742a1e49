"""The beat in-process: notices that land while it works are kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_boundedbeat.runlife import SETTLED_CHANNEL
from celery_boundedbeat.scheduler import Scheduler
from celery_boundedbeat.store import SCHEDULES_CHANNEL

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
