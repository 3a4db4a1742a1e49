"""Statements sent to the database driver directly: one text per dialect, executed one way.

A tick, a worker's batch of reports and a schedule change spent more CPU in the ORM's
statement building and result processing than the database spent running them; their
statements go to the driver of the session's own connection (psycopg on PostgreSQL,
``sqlite3`` on SQLite), in the session's transaction. There is one way to send them
(:class:`Driver`), whatever the dialect: SQLite shares the logic and the path, only the
text differs where the dialects do (locking, arrays, ``RETURNING`` into a document).

A statement (:class:`Sql`) is written with ``%(name)s`` parameters; SQLite's text is the same
with ``:name`` unless it is given apart. Values are bound and read back as SQLAlchemy binds
and reads them: on PostgreSQL datetimes come back aware in UTC (psycopg decodes JSON itself);
on SQLite a datetime parameter is bound as the naive UTC text the columns store, a list as a
JSON array (read with ``json_each``), and each result column is read with its column type's
own result processor. The driver's errors come out as SQLAlchemy's (``IntegrityError``,
``OperationalError`` ...), as from the ORM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import Column, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from .tables import UTCDateTime


@dataclass(frozen=True, slots=True)
class Sql:
    """A statement (or a clause of one) per dialect, with ``%(name)s`` parameters.

    ``sqlite`` is given only where the dialects truly differ; otherwise SQLite runs the
    PostgreSQL text with its parameters written ``:name``.
    """

    postgresql: str
    sqlite: str | None = None

    def text(self, dialect: str) -> str:
        return _text(self, dialect)

    def prefixed(self, clause: str) -> Sql:
        """This statement with ``clause`` in front (both dialects)."""
        return Sql(clause + self.postgresql, None if self.sqlite is None else clause + self.sqlite)

    def after(self, clause: Sql) -> Sql:
        """This statement with ``clause`` in front, each dialect's text with its own."""
        sqlite = (clause.sqlite or clause.postgresql) + (self.sqlite or self.postgresql)
        return Sql(clause.postgresql + self.postgresql, sqlite)


@cache
def _text(sql: Sql, dialect: str) -> str:
    if dialect == "postgresql":
        return sql.postgresql
    return re.sub(r"%\((\w+)\)s", r":\1", sql.postgresql if sql.sqlite is None else sql.sqlite)


#: A result column's type, to read it as SQLAlchemy would (``None``: as the driver gives it).
Kind = Column[Any] | None


class Driver:
    """The driver connection under a session (or given), and its dialect's name."""

    __slots__ = ("conn", "dialect", "postgres")

    def __init__(self, conn: Any, dialect: str) -> None:
        self.conn = conn
        self.dialect = dialect
        self.postgres = dialect == "postgresql"

    @classmethod
    def of(cls, s: Session) -> Driver:
        """The session's connection: statements on it share the session's transaction."""
        connection = s.connection()
        return cls(connection.connection.driver_connection, connection.dialect.name)

    @classmethod
    def psycopg(cls, conn: Any) -> Driver:
        """A psycopg connection outside any session (a transaction of its own)."""
        return cls(conn, "postgresql")

    @contextmanager
    def pipeline(self) -> Iterator[None]:
        """psycopg's pipeline mode where libpq has it: the statements inside go in one round trip
        (a fetch inside waits for what was sent before it). An error the server sends back for
        any of them comes out as SQLAlchemy's. On SQLite (local, no round trips) nothing."""
        if not self.postgres:
            yield
            return
        import psycopg  # the PostgreSQL extra's driver

        try:
            with self.conn.pipeline() if psycopg.Pipeline.is_supported() else nullcontext():
                yield
        except psycopg.Error as exc:
            raise DBAPIError.instance(None, None, exc, psycopg.Error) from exc

    def execute(self, sql: Sql, params: Mapping[str, Any] | None = None) -> None:
        """Send ``sql``; in a pipeline it is queued with the others."""
        with self._cursor(sql, params) as cur:
            cur.execute(sql.text(self.dialect), self._bind(params))

    def rowcount(self, sql: Sql, params: Mapping[str, Any] | None = None) -> int:
        """Send ``sql`` and return how many rows it changed (waits for it in a pipeline)."""
        with self._cursor(sql, params) as cur:
            cur.execute(sql.text(self.dialect), self._bind(params))
            return int(cur.rowcount)

    def execute_many(self, sql: Sql, rows: Sequence[Mapping[str, Any]], kinds: Mapping[str, Kind]) -> None:
        """Send ``sql`` once per row of ``rows``, each value bound as its column ``kinds[key]``."""
        if not rows:
            return
        binders = _binders(self.dialect, tuple(kinds.items()))
        bound = [{k: (binders[k](v) if k in binders else v) for k, v in row.items()} for row in rows]
        with self._cursor(sql, None) as cur:
            cur.executemany(sql.text(self.dialect), bound)

    def rows(
        self, sql: Sql, params: Mapping[str, Any] | None = None, kinds: Sequence[Kind] = ()
    ) -> list[tuple[Any, ...]]:
        """Send ``sql`` and fetch its rows, column ``i`` read as ``kinds[i]`` (waits in a pipeline)."""
        with self._cursor(sql, params) as cur:
            cur.execute(sql.text(self.dialect), self._bind(params))
            found = cur.fetchall()
        readers = _readers(self.dialect, tuple(kinds))
        if not readers:
            return list(found)
        out = []
        for row in found:
            values = list(row)
            for i, read in readers:
                values[i] = read(values[i])
            out.append(tuple(values))
        return out

    def one(self, sql: Sql, params: Mapping[str, Any] | None = None, kinds: Sequence[Kind] = ()) -> Any:
        """The first row of ``sql`` (``None``: no row)."""
        found = self.rows(sql, params, kinds)
        return found[0] if found else None

    def columns(self, **columns: Sequence[Any]) -> dict[str, Any]:
        """Parameters for a statement reading a table of values column by column: on PostgreSQL
        each column is an array (``unnest``), on SQLite the rows are one JSON document
        ``rows`` of arrays, in the order the columns are given (``json_each``)."""
        if self.postgres:
            return dict(columns)
        rows = [list(row) for row in zip(*columns.values(), strict=True)]
        return {"rows": json.dumps(rows, default=_stored_default, allow_nan=False)}

    def _bind(self, params: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if self.postgres:
            return params
        return {} if params is None else {k: _sqlite_value(v) for k, v in params.items()}

    @contextmanager
    def _cursor(self, sql: Sql, params: Any) -> Iterator[Any]:
        cur = self.conn.cursor()
        try:
            yield cur
        except Exception as exc:
            base = _driver_error(self.dialect)
            if isinstance(exc, base):  # as SQLAlchemy's (IntegrityError and so on), as elsewhere
                raise DBAPIError.instance(sql.text(self.dialect), params, exc, base) from exc
            raise
        finally:
            cur.close()


def _driver_error(dialect: str) -> type[Exception]:
    if dialect == "postgresql":
        import psycopg

        return psycopg.Error
    import sqlite3

    return sqlite3.Error


@cache
def _dialect(name: str) -> Dialect:
    if name == "postgresql":
        from sqlalchemy.dialects.postgresql import psycopg

        return psycopg.dialect()  # type: ignore[no-untyped-call]
    from sqlalchemy.dialects.sqlite import pysqlite

    return pysqlite.dialect()


def _sqlite_value(value: Any) -> Any:
    """A parameter as SQLite compares it with stored values: a datetime as the stored text, a
    list as a JSON array (``json_each``)."""
    if isinstance(value, datetime):
        return _utc_binder()(value)
    if isinstance(value, list | tuple):
        return json.dumps(list(value))
    return value


def stored_utc(value: datetime) -> str:
    """A datetime as SQLite stores it: the naive UTC text the ORM writes."""
    return cast(str, _utc_binder()(value))


def _stored_default(value: Any) -> str:
    if isinstance(value, datetime):
        return stored_utc(value)
    raise TypeError(f"cannot store {type(value).__name__} {value!r}")


@cache
def _utc_binder() -> Callable[[Any], Any]:
    dialect = _dialect("sqlite")
    process = UTCDateTime().dialect_impl(dialect).bind_processor(dialect)
    assert process is not None
    return process


@cache
def _readers(dialect: str, kinds: tuple[Kind, ...]) -> list[tuple[int, Callable[[Any], Any]]]:
    """Per result column that needs one, how to read it as its column type does."""
    readers: list[tuple[int, Callable[[Any], Any]]] = []
    for i, kind in enumerate(kinds):
        if kind is None:
            continue
        if dialect == "postgresql":
            if isinstance(kind.type, UTCDateTime):
                readers.append((i, _aware_utc))
            continue
        d = _dialect(dialect)
        process = kind.type.dialect_impl(d).result_processor(d, None)
        if process is not None:
            readers.append((i, process))
    return readers


def _aware_utc(value: datetime | None) -> datetime | None:
    return None if value is None else value.astimezone(UTC)


@cache
def _binders(dialect: str, kinds: tuple[tuple[str, Kind], ...]) -> dict[str, Callable[[Any], Any]]:
    """Per parameter that needs one, how SQLAlchemy binds it for its column type."""
    d = _dialect(dialect)
    binders: dict[str, Callable[[Any], Any]] = {}
    for key, kind in kinds:
        if kind is None:
            continue
        process = kind.type.dialect_impl(d).bind_processor(d)
        if process is not None:
            binders[key] = process
    return binders


def kinds_of(columns: Iterable[Column[Any]]) -> tuple[Kind, ...]:
    """The kinds of ``columns``, in order (for :meth:`Driver.rows`)."""
    return tuple(columns)
