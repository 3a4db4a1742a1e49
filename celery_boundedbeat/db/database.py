"""The state database as the store's parts reach it: a session, the driver's own connection, a NOTIFY.

:class:`~.store.Store` and the parts it is made of (:class:`~.runs.RunLife`, the tick
transaction of :mod:`.tick`, the stale-queue sweep of :mod:`.stale`) each hold the one
:class:`Database` of their store; none of them inherits another.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from .driver import Driver, Sql

#: A notification (PostgreSQL).
_NOTIFY = Sql("SELECT pg_notify(%(c)s, %(p)s)")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Database:
    """An engine and the three ways a store method reaches it. Safe to share between threads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.is_postgres = engine.dialect.name == "postgresql"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: commit on success, roll back on any error."""
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def driver(self, *, one_statement: bool = False) -> Iterator[Any]:
        """A psycopg connection in a transaction of its own (PostgreSQL), for the statements
        the ORM made cost more than they do; the driver's errors come out as SQLAlchemy's
        (``sqlalchemy.exc.OperationalError`` and so on), as from every other call.

        ``one_statement``: the caller sends a single statement, a transaction by itself, so
        it goes in autocommit: one round trip where ``BEGIN``, it and ``COMMIT`` were three.
        """
        import psycopg

        try:
            if one_statement:
                with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    yield conn.connection.driver_connection
                return
            with self.engine.begin() as conn:
                yield conn.connection.driver_connection
        except psycopg.Error as exc:
            raise DBAPIError.instance(None, None, exc, psycopg.Error) from exc

    def notify(self, session: Session, channel: str, payload: str = "") -> None:
        """``NOTIFY channel, payload`` in the session's transaction (PostgreSQL; elsewhere nothing)."""
        if self.is_postgres:
            # the ORM's statement path cost more than the call
            Driver.of(session).execute(_NOTIFY, {"c": channel, "p": payload})
