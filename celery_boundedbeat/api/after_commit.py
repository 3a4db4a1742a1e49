"""``enqueue()``'s wake-up of the dispatchers, asked for once the caller's transaction commits.

No ``NOTIFY`` runs in the caller's transaction (:mod:`..db.wake` says why): each way in
registers a hook that asks this process's waker after the commit, and a rollback asks nothing.
A SQLAlchemy ``Session`` has ``after_commit``; Django has ``transaction.on_commit``; a
SQLAlchemy ``Connection``'s only hook runs just before its commit, so its request names the
transaction and the waker sends once it has committed. On a connection in autocommit the row
is committed already: the waker is asked at once.
"""

from __future__ import annotations

import weakref
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session

from ..db.store import QUEUE_CHANNEL
from ..db.wake import Waker, waker_for

#: ``Session.info`` key: the engine whose waker the session's next commit asks.
_DUE = "celery_boundedbeat.wake"
#: ``Session.info`` key: the session's commit and rollback hooks are registered.
_HOOKED = "celery_boundedbeat.wake_hooked"
#: A ``Connection``'s transaction that enqueued: its ``pg_current_xact_id()`` (``None``: unknown yet).
_pending: weakref.WeakKeyDictionary[Connection, list[str | None]] = weakref.WeakKeyDictionary()


def engine_waker(engine: Engine) -> Waker:
    """The waker of ``engine``'s database: its connection comes from the engine, detached from its pool."""

    def connect() -> Any:
        fairy = engine.raw_connection()
        conn = fairy.driver_connection
        fairy.detach()  # ours alone now: the pool neither counts nor reuses it
        return conn

    return waker_for(("sqlalchemy", engine.url), connect, QUEUE_CHANNEL)


def _autocommit(connection: Connection) -> bool:
    return bool(getattr(connection.connection.driver_connection, "autocommit", False))


def session_wakes(session: Session, engine: Engine) -> None:
    """Ask ``engine``'s waker when ``session`` commits (at once if it does not hold a transaction)."""
    if _autocommit(session.connection()):
        engine_waker(engine).wake()
        return
    if not session.info.get(_HOOKED):
        event.listen(session, "after_commit", _session_committed)
        event.listen(session, "after_rollback", _session_rolled_back)
        session.info[_HOOKED] = True
    session.info[_DUE] = engine


def _session_committed(session: Session) -> None:
    engine = session.info.pop(_DUE, None)
    if engine is not None:
        engine_waker(engine).wake()


def _session_rolled_back(session: Session) -> None:
    session.info.pop(_DUE, None)


def connection_xid_wanted(connection: Connection) -> bool:
    """Whether ``enqueue`` must read its transaction's id: the first enqueue of a transaction.

    Registers the connection's commit and rollback hooks on its first enqueue.
    """
    if _autocommit(connection):
        return False
    pending = _pending.get(connection)
    if pending is None:
        pending = _pending[connection] = [None]
        event.listen(connection, "commit", _connection_commits)
        event.listen(connection, "rollback", _connection_rolled_back)
    return pending[0] is None


def connection_wakes(connection: Connection, xid: str | None) -> None:
    """After an enqueue on ``connection``: ask now (autocommit), or note the transaction's id."""
    if _autocommit(connection):
        engine_waker(connection.engine).wake()
    elif xid is not None:
        _pending[connection][0] = xid


def _connection_commits(connection: Connection) -> None:
    """Just before the commit: the waker sends once ``pg_xact_status`` says it committed."""
    pending = _pending.get(connection)
    if pending is not None and pending[0] is not None:
        xid, pending[0] = pending[0], None
        engine_waker(connection.engine).wake(after_xid=xid)


def _connection_rolled_back(connection: Connection) -> None:
    pending = _pending.get(connection)
    if pending is not None:
        pending[0] = None


def django_wakes(connection: Any) -> bool:
    """Ask the waker of Django's ``connection`` once its transaction commits (its ``on_commit``).

    Returns False under manual transaction management (``set_autocommit(False)`` outside
    ``atomic``), where Django has no ``on_commit``: the caller notifies in the transaction.
    """
    if not connection.get_autocommit() and not connection.in_atomic_block:
        return False
    module, params = connection.Database, connection.get_connection_params()
    db = connection.settings_dict
    key = ("django", connection.alias, db.get("HOST"), db.get("PORT"), db.get("NAME"), db.get("USER"))
    waker = waker_for(key, lambda: module.connect(**params), QUEUE_CHANNEL)
    connection.on_commit(waker.wake)  # in autocommit: at once
    return True
