"""``boundedbeat_report_writer = "auto"``: the writer process for the threads pool, the thread elsewhere."""

from __future__ import annotations

import pytest
from celery import Celery, signals
from celery.concurrency.thread import TaskPool as ThreadsPool

from celery_boundedbeat import install
from celery_boundedbeat.worker.receivers import _trackers
from celery_boundedbeat.worker.tracking import Tracker

FILE_DB = "sqlite:////tmp/bb-writer-choice.db"


def tracker(url: str = FILE_DB, **conf: object) -> Tracker:
    app = Celery("choice", set_as_current=False)
    app.conf.update(boundedbeat_database_url=url, **conf)
    return Tracker(app)


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        ("threads", "process"),
        (ThreadsPool, "process"),
        ("prefork", "thread"),
        ("solo", "thread"),
        ("celery.concurrency.thread:TaskPool", "process"),
    ],
)
def test_auto_follows_the_pool(pool: object, expected: str) -> None:
    t = tracker()
    t.note_pool(pool)
    assert t.writer == expected


def test_auto_without_a_worker_pool_is_the_thread() -> None:
    """Not a worker (a script settling runs), or ``install(app)`` after ``worker_init``."""
    assert tracker().writer == "thread"


def test_an_unknown_pool_leaves_the_thread() -> None:
    t = tracker()
    t.note_pool("no.such.module:Pool")
    assert t.writer == "thread"


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file:x?mode=memory&uri=true"])
def test_auto_keeps_an_in_memory_database_in_the_process(url: str) -> None:
    """A child process would write into a database of its own."""
    t = tracker(url)
    t.note_pool("threads")
    assert t.writer == "thread"


@pytest.mark.parametrize("chosen", ["thread", "process"])
def test_an_explicit_writer_is_kept_whatever_the_pool(chosen: str) -> None:
    for pool in ("threads", "prefork"):
        t = tracker(boundedbeat_report_writer=chosen)
        t.note_pool(pool)
        assert t.writer == chosen


class Controller:
    """What ``worker_init`` sends: the worker controller, its app and its pool (unresolved)."""

    def __init__(self, app: Celery, pool_cls: str) -> None:
        self.app = app
        self.pool_cls = pool_cls


def test_worker_init_tells_the_installed_tracker_its_pool() -> None:
    app = Celery("choice-signal", set_as_current=False)
    app.conf.boundedbeat_database_url = FILE_DB
    install(app)
    assert _trackers[app].writer == "thread"
    signals.worker_init.send(sender=Controller(app, "threads"))
    assert _trackers[app].writer == "process"
