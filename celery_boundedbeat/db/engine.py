"""One SQLAlchemy engine per (process, URL): SQLite in WAL mode, PostgreSQL via psycopg 3."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DisconnectionError, NoSuchModuleError

from ..config.settings import MAX_PREPARE_AHEAD
from ..core.exceptions import ConfigurationError
from ..core.redact import mask_url, scrub

_engines: dict[tuple[int, str], Engine] = {}
_lock = threading.Lock()

#: Seconds a SQLite statement waits for another process's write lock before it fails.
SQLITE_BUSY_SECONDS = 30

#: Seconds a pooled PostgreSQL connection may have been idle and still be handed out unpinged.
PING_WHEN_IDLE_FOR = 1.0

#: Seconds the server lets a session of ours sit idle inside a transaction before it ends it.
#: The longest we wait on purpose is a prepared tick's (``prepare_ahead``, at most
#: ``MAX_PREPARE_AHEAD``); past twice that the process is gone, frozen or cut off without a
#: word (a NAT that dropped the flow), and the schedule rows it locked must come free for the
#: beat that takes over the lease. At 60 s every schedule of a holder that went silent in a
#: prepared tick stayed locked, and unticked, for a minute after the standby took over.
IDLE_IN_TRANSACTION_SECONDS = 2 * MAX_PREPARE_AHEAD

#: libpq's bounds on a connection whose flow was dropped without a word (a NAT or load
#: balancer forgetting it, a host gone): kernel keepalives find an idle one dead within about
#: 20 s, and a request the server never acknowledges fails after 15 s. Without them a thread
#: waiting for a reply (a COMMIT, a report batch) waited for the kernel's own limits: about
#: 15 minutes of retransmissions, or two hours of silence before the first keepalive.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
}


def normalize_url(url: str) -> URL:
    """Plain ``postgresql://`` URLs use psycopg 3, the driver this package depends on."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _switch_to_wal(cursor: Any) -> None:
    """Put the database in WAL mode, waiting out another process doing the same.

    Two processes that open a new database file at once (a worker and beat started together)
    both switch it to WAL; SQLite answers the loser "database is locked" at once, without its
    busy handler, since waiting there could deadlock. The switch is retried until it wins or
    the busy timeout passes, as any other statement would wait.
    """
    deadline = time.monotonic() + SQLITE_BUSY_SECONDS
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _sqlite_setup(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy drive transactions and take the write lock at BEGIN, so two
        # processes never deadlock upgrading a read lock (SQLite has one writer).
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_SECONDS * 1000}")
        _switch_to_wal(cursor)
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection before handing it out only if it sat idle ``PING_WHEN_IDLE_FOR``.

    SQLAlchemy's ``pool_pre_ping`` pings at every checkout: two round trips (``BEGIN``,
    ``SELECT 1``) before each transaction, a third of a tick's and of a schedule change's. A
    connection used a moment ago is as alive as a ping would find it; one found dead anyway
    fails its transaction as a server lost mid-transaction does, and the pool reconnects.
    The ping here is one round trip outside any transaction.
    """

    @event.listens_for(engine, "connect")
    def _connected(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.get("idle_since", 0.0) < PING_WHEN_IDLE_FOR:
            return
        from psycopg import pq

        try:
            result = dbapi_conn.pgconn.exec_(b"SELECT 1")
        except Exception as exc:  # a closed connection: libpq says so
            raise DisconnectionError(str(exc)) from exc
        if result.status != pq.ExecStatus.TUPLES_OK:
            raise DisconnectionError(f"ping: {pq.ExecStatus(result.status).name}")


def _refused(url: str, what: str, detail: str) -> ConfigurationError:
    """An unusable URL as the configuration error it is (never "unreachable"), password masked."""
    reason = f"{what} ({mask_url(url)}): {scrub(detail, url)}"
    return ConfigurationError([("settings", "boundedbeat_database_url", reason)])


def _create(url: str) -> Engine:
    """A new engine; a URL that cannot be parsed, or names a dialect or driver not installed, is refused.

    SQLAlchemy loads the dialect and imports its driver here, before any connection: a typo in
    the scheme or a driver missing from the environment is a configuration error to fix, not
    an outage to retry (beat exits 78 naming the setting; the CLI says the URL is invalid).
    """
    try:
        parsed = normalize_url(url)
    except Exception as exc:  # SQLAlchemy's parse errors may quote the whole URL
        raise _refused(url, "not a valid SQLAlchemy URL", str(exc)) from None
    try:
        if parsed.get_backend_name() == "sqlite":
            engine = create_engine(
                parsed, connect_args={"timeout": SQLITE_BUSY_SECONDS, "check_same_thread": False}
            )
            _sqlite_setup(engine)
            return engine
        # A database that drops packets must not hang beat or a worker forever, and a
        # frozen leader must not keep schedule rows locked: bound both on the server.
        idle_ping = parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() == "psycopg"
        connect_args: dict[str, Any] = {
            "connect_timeout": 10,
            "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_SECONDS * 1000:.0f}",
        }
        if idle_ping:  # libpq's parameters, through psycopg
            connect_args.update(KEEPALIVES)
        engine = create_engine(
            parsed, pool_pre_ping=not idle_ping, pool_size=5, max_overflow=5, connect_args=connect_args
        )
        if idle_ping:
            _ping_when_idle(engine)
        return engine
    except (NoSuchModuleError, ImportError) as exc:
        detail = f"{type(exc).__name__}: {exc}"
        raise _refused(url, "no SQLAlchemy dialect or driver installed for it", detail) from None


def get_engine(url: str) -> Engine:
    """The engine for ``url`` in this process (a forked child gets its own)."""
    key = (os.getpid(), url)
    engine = _engines.get(key)
    if engine is not None:
        return engine
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _create(url)
            _engines[key] = engine
        return engine


def _forget_inherited() -> None:
    """In a forked child, drop the parent's engines without closing its sockets."""
    for (pid, _url), engine in list(_engines.items()):
        if pid != os.getpid():
            engine.dispose(close=False)
            _engines.pop((pid, _url), None)


os.register_at_fork(after_in_child=_forget_inherited)


def dispose_all() -> None:
    """Forget engines inherited from a parent process (after fork) or at shutdown."""
    with _lock:
        for (pid, _url), engine in list(_engines.items()):
            if pid == os.getpid():
                engine.dispose()
            else:
                engine.dispose(close=False)
        _engines.clear()
