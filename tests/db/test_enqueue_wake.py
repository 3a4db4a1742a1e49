"""enqueue() wakes the dispatchers after the caller's commit, from a connection of its own, coalesced.

A ``NOTIFY`` in the caller's transaction would make its commit queue behind every other
notifying commit of the cluster. These tests check that the caller's transaction sends no
notification at all (the one the dispatchers get comes from another backend), that it comes
after the commit on every way in, that a rollback asks for none, and that a burst of commits
costs few.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session, scoped_session, sessionmaker

import celery_boundedbeat
from celery_boundedbeat.db.engine import dispose_all, get_engine, normalize_url
from celery_boundedbeat.db.migrate import upgrade
from celery_boundedbeat.db.store import QUEUE_CHANNEL
from celery_boundedbeat.db.wake import WINDOW, Waker

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(60)]


@pytest.fixture
def pg(postgres_url: str) -> Iterator[Engine]:
    engine = get_engine(postgres_url)
    upgrade(engine)
    try:
        yield engine
    finally:
        dispose_all()


@pytest.fixture
def listening(postgres_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection listening on the dispatchers' channel, as the dispatcher's listener does."""
    with psycopg.connect(_plain(postgres_url), autocommit=True) as conn:
        conn.execute(f'LISTEN "{QUEUE_CHANNEL}"')
        yield conn


def _plain(url: str) -> str:
    return normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _next_notification(conn: psycopg.Connection[Any], timeout: float = 10.0) -> psycopg.Notify:
    for note in conn.notifies(timeout=timeout, stop_after=1):
        return note
    raise AssertionError(f"no notification on {QUEUE_CHANNEL} within {timeout} s")


def _statements(engine: Engine) -> list[str]:
    """Every statement the engine's connections send from now on (the waker's is not one)."""
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    return sent


def _backend_pid(conn: Connection) -> int:
    return int(conn.connection.driver_connection.info.backend_pid)


def test_a_connection_transaction_sends_no_notify_and_the_dispatchers_hear_after_its_commit(
    pg: Engine, listening: psycopg.Connection[Any]
) -> None:
    """SQLAlchemy Connection: no NOTIFY in the transaction; one from another backend once it commits."""
    sent = _statements(pg)
    with pg.connect() as conn:  # held to the end: the waker cannot be handed its backend
        with conn.begin():
            celery_boundedbeat.enqueue(conn, "tests.noop", args=(1,))
            celery_boundedbeat.enqueue(conn, "tests.noop", args=(2,))
        assert sent and not [s for s in sent if "notify" in s.lower()], sent
        note = _next_notification(listening)
        assert note.pid != _backend_pid(conn), "the notification came from the caller's own backend"


def test_a_session_transaction_sends_no_notify_and_the_dispatchers_hear_after_its_commit(
    pg: Engine, listening: psycopg.Connection[Any]
) -> None:
    """SQLAlchemy Session (and a scoped_session): the same."""
    sent = _statements(pg)
    with pg.connect() as held, Session(bind=held) as session:
        with session.begin():
            celery_boundedbeat.enqueue(session, "tests.noop")
        assert not [s for s in sent if "notify" in s.lower()], sent
        assert _next_notification(listening).pid != _backend_pid(held)
        scoped = scoped_session(sessionmaker(bind=held))
        celery_boundedbeat.enqueue(scoped, "tests.noop")
        scoped.commit()
        assert _next_notification(listening).pid != _backend_pid(held)
        scoped.remove()
    assert not [s for s in sent if "notify" in s.lower()], sent


def test_an_autocommit_connection_wakes_the_dispatchers_at_once(
    pg: Engine, listening: psycopg.Connection[Any]
) -> None:
    """In autocommit the row is committed by its own statement: the wake-up follows it."""
    with pg.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        celery_boundedbeat.enqueue(conn, "tests.noop")
        assert _next_notification(listening).pid != _backend_pid(conn)


def test_a_rolled_back_transaction_asks_for_no_wake_up(pg: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rollback of a Connection's or a Session's transaction: nothing asked; a later commit asks once."""
    asked: list[str | None] = []
    monkeypatch.setattr(Waker, "wake", lambda self, after_xid=None: asked.append(after_xid))
    with pg.connect() as conn:
        conn.begin()
        celery_boundedbeat.enqueue(conn, "tests.noop")
        conn.rollback()
        assert asked == []
        with conn.begin():  # the next transaction on that connection has its own id
            celery_boundedbeat.enqueue(conn, "tests.noop")
        assert len(asked) == 1 and asked[0] is not None
    with Session(pg) as session:
        celery_boundedbeat.enqueue(session, "tests.noop")
        session.rollback()
        session.commit()
        assert len(asked) == 1
        celery_boundedbeat.enqueue(session, "tests.noop")
        session.commit()
        assert asked[1:] == [None]


def test_a_transaction_that_fails_at_commit_sends_nothing(pg: Engine, postgres_url: str) -> None:
    """A Connection's hook runs before its commit: the waker sends only once the commit succeeded."""
    with pg.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE boom (x int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    waker = Waker(lambda: psycopg.connect(_plain(postgres_url)), QUEUE_CHANNEL, idle=0.2)
    with pg.connect() as conn:
        conn.begin()
        xid = conn.exec_driver_sql("SELECT pg_current_xact_id()::text").scalar_one()
        conn.exec_driver_sql("INSERT INTO boom VALUES (1), (1)")
        waker.wake(after_xid=xid)
        with pytest.raises(Exception, match="unique"):
            conn.commit()
    _wait_idle(waker)
    assert waker.sent == 0
    with pg.connect() as conn:
        conn.begin()
        xid = conn.exec_driver_sql("SELECT pg_current_xact_id()::text").scalar_one()
        waker.wake(after_xid=xid)  # asked while still in progress: sent once it commits
        conn.commit()
    _wait_idle(waker)
    assert waker.sent == 1


def _wait_idle(waker: Waker, timeout: float = 10.0) -> None:
    """Until the waker's thread ended (it had nothing left to send for ``idle`` seconds)."""
    deadline = time.monotonic() + timeout
    while waker._thread is not None:
        assert time.monotonic() < deadline, "the waker's thread did not end"
        time.sleep(0.01)


def test_a_burst_of_commits_costs_at_most_one_notification_a_window(
    pg: Engine, listening: psycopg.Connection[Any]
) -> None:
    """Eight threads committing 400 enqueues: at most one notification per window (plus the first)."""
    started = time.monotonic()

    def commits(n: int) -> None:
        for i in range(n):
            with pg.begin() as conn:
                celery_boundedbeat.enqueue(conn, "tests.noop", args=(i,))

    threads = [threading.Thread(target=commits, args=(50,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    heard = 0
    for _ in listening.notifies(timeout=1.0):  # the last window's, then a second of quiet
        heard += 1
    assert 1 <= heard <= elapsed / WINDOW + 2, (heard, elapsed)
    assert heard < 400
