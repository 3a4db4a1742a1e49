"""The dispatcher's idle backoff on a database that cannot wake it across processes."""

from __future__ import annotations

from celery import Celery

from celery_boundedbeat.dispatch import Dispatcher
from celery_boundedbeat.engine import get_engine
from celery_boundedbeat.settings import Settings
from celery_boundedbeat.store import Store


def test_on_sqlite_the_idle_dispatcher_looks_at_least_every_poll_interval(sqlite_url: str) -> None:
    """Without NOTIFY, rows another process queues wait at most poll_interval, not dispatch_max_interval."""
    app = Celery("idle", broker="memory://", set_as_current=False)
    settings = Settings.from_conf(
        {"boundedbeat_dispatch_max_interval": 30.0, "boundedbeat_poll_interval": 1.0}
    )
    store = Store(get_engine(sqlite_url))
    assert not store.is_postgres
    assert Dispatcher(app, store, settings)._max_idle_sleep() == 1.0
