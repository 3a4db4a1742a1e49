"""The dispatcher's idle backoff on a database that cannot wake it across processes."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_boundedbeat.config.settings import Settings
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.dispatch.dispatcher import Dispatcher


def test_on_sqlite_the_idle_dispatcher_looks_at_least_every_poll_interval(sqlite_url: str) -> None:
    """Without NOTIFY, rows another process queues wait at most poll_interval, not dispatch_max_interval."""
    app = Celery("idle", broker="memory://", set_as_current=False)
    settings = Settings.from_conf(
        {"boundedbeat_dispatch_max_interval": 30.0, "boundedbeat_poll_interval": 1.0}
    )
    store = Store(get_engine(sqlite_url))
    assert not store.is_postgres
    assert Dispatcher(app, store, settings)._max_idle_sleep() == 1.0


@pytest.mark.postgres
def test_on_postgresql_the_idle_dispatcher_polls_while_its_listener_is_not_listening(
    postgres_url: str,
) -> None:
    """NOTIFY wakes it only while its LISTEN works: while that is down or half-open it polls.

    A standalone dispatcher used to back off to ``dispatch_max_interval`` (30 s) on PostgreSQL
    whatever its listener's state, so rows queued while LISTEN was down waited that long.
    """
    app = Celery("idle", broker="memory://", set_as_current=False)
    settings = Settings.from_conf(
        {"boundedbeat_dispatch_max_interval": 30.0, "boundedbeat_poll_interval": 1.0}
    )
    store = Store(get_engine(postgres_url))
    assert store.is_postgres
    listening = [False]
    dispatcher = Dispatcher(app, store, settings, notified=lambda: listening[0])
    assert dispatcher._max_idle_sleep() == 1.0
    listening[0] = True
    assert dispatcher._max_idle_sleep() == 30.0
    assert Dispatcher(app, store, settings)._max_idle_sleep() == 1.0, "no listener at all: it polls"
