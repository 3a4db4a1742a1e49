"""How often a dispatcher looks for queued work past ``publish_timeout``: not at every drain.

A dispatcher woken by many small ticks a second (partitioned beats) spent a sixth of its time
on this look, whose answer only changes on the scale of the timeout (an hour by default).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_boundedbeat.config.settings import Settings
from celery_boundedbeat.dispatch.dispatcher import STALE_LOOK_EVERY, Dispatcher


class _Store:
    """Counts the looks; finds nothing stale."""

    def __init__(self) -> None:
        self.looks = 0

    def drop_stale(self, now: Any, timeout: float, rng: Any) -> tuple[list[Any], list[Any]]:
        self.looks += 1
        return [], []


def _dispatcher(publish_timeout: float, clock: list[float], monkeypatch: Any) -> tuple[Dispatcher, _Store]:
    monkeypatch.setattr("celery_boundedbeat.dispatch.dispatcher.time.monotonic", lambda: clock[0])
    store = _Store()
    app = Celery("stale", broker="memory://", set_as_current=False)
    settings = Settings(database_url="sqlite://", publish_timeout=publish_timeout)
    return Dispatcher(app, store, settings), store  # type: ignore[arg-type]


def test_drains_within_a_second_look_for_stale_work_once(monkeypatch: Any) -> None:
    clock = [100.0]
    dispatcher, store = _dispatcher(3600.0, clock, monkeypatch)
    for _ in range(20):
        dispatcher._reject_stale()
        clock[0] += STALE_LOOK_EVERY / 40
    assert store.looks == 1, "one look in the first half second"
    clock[0] += STALE_LOOK_EVERY
    dispatcher._reject_stale()
    assert store.looks == 2, "and the next a second later"


def test_a_short_publish_timeout_is_looked_at_ten_times_per_timeout(monkeypatch: Any) -> None:
    clock = [100.0]
    dispatcher, store = _dispatcher(2.0, clock, monkeypatch)
    dispatcher._reject_stale()
    clock[0] += 0.21
    dispatcher._reject_stale()
    assert store.looks == 2
