"""Rows inserted in bulk: one ``COPY`` on PostgreSQL, a Core executemany elsewhere.

A tick of a thousand runs writes two thousand rows (the runs and their queue rows). Through
an executemany, SQLAlchemy compiles, binds and processes every row and psycopg sends each as
a statement of its pipeline: about a third of a prepared tick's CPU. ``COPY`` streams the
values as they are and the server parses them while the rest are still being sent.

``COPY`` bypasses SQLAlchemy's type processing, so the two bindings the ORM would do are
done here: JSON columns travel as JSON text, and a naive datetime is refused instead of
being read in the session's time zone.

Where the insert must share a pipeline with other statements (a tick's writes, sent in one
round trip), :func:`insert_document` sends the rows as one JSON document instead (``COPY``
cannot run in pipeline mode); SQLite runs the same, its document read with ``json_each``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cache
from itertools import chain, islice
from typing import Any

from sqlalchemy import JSON, Table, insert
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from .driver import Driver, Sql, stored_utc
from .tables import UTCDateTime

#: Rows per executemany where there is no ``COPY``: far below SQLite's 32,766 bound parameters.
CHUNK = 500


def insert_many(s: Session, table: Table, rows: Iterable[dict[str, Any]]) -> None:
    """Insert ``rows`` (plain dicts, all with the same keys) into ``table`` in the session's transaction.

    ``rows`` may be a generator: they are sent while it yields (100,000 schedule rows at a
    cold start are never all built first).
    """
    it = iter(rows)
    first = next(it, None)
    if first is None:
        return
    rows = chain((first,), it)
    connection = s.connection()
    if connection.dialect.name != "postgresql":
        while batch := list(islice(rows, CHUNK)):
            s.execute(insert(table), batch)
        return
    columns = tuple(first)
    json_at, utc_at = _kinds(table, columns)
    sql = "COPY {} ({}) FROM STDIN".format(table.name, ", ".join(f'"{c}"' for c in columns))
    import psycopg  # the PostgreSQL extra's driver

    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        with cursor.copy(sql) as copy:
            for row in rows:
                if len(row) != len(columns):
                    raise ValueError(f"{table.name}: every row of one insert needs the columns {columns}")
                values = [row[c] for c in columns]
                for i in json_at:
                    values[i] = json.dumps(values[i])
                for i in utc_at:
                    _check_aware(values[i], table.name, columns[i])
                copy.write_row(values)
    except psycopg.Error as exc:  # as SQLAlchemy's (IntegrityError, OperationalError), as an executemany
        raise DBAPIError.instance(sql, None, exc, psycopg.Error) from exc


def insert_document(driver: Driver, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """Send an ``INSERT ... SELECT`` of ``rows`` from one JSON document (one statement whatever
    the number of rows), so it can go in a pipeline with the tick's other writes: each round
    trip of a tick was a wait for a CPU on a saturated machine.

    PostgreSQL reads the document with ``json_array_elements``, SQLite with ``json_each``
    (its values already as the columns store them).
    """
    if not rows:
        return
    columns = tuple(rows[0])
    json_at, utc_at = _kinds(table, columns)
    listed = []
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"{table.name}: every row of one insert needs the columns {columns}")
        values = [row[c] for c in columns]
        for i in json_at:  # as JSON text, cast per row: a JSON null stays JSON null
            values[i] = json.dumps(values[i])
        for i in utc_at:
            _check_aware(values[i], table.name, columns[i])
        listed.append(values)
    dated = _iso if driver.postgres else _stored
    document = json.dumps(listed, default=dated, allow_nan=False)
    driver.execute(_document_insert(table, columns), {"rows": document})


@cache
def _document_insert(table: Table, columns: tuple[str, ...]) -> Sql:
    """The ``INSERT`` of :func:`insert_document`: rows travel as arrays, read by position."""
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    json_at, _ = _kinds(table, columns)
    picks = []
    for i, c in enumerate(columns):
        kind = "json" if i in json_at else table.c[c].type.compile(dialect=dialect)
        picks.append(f"CAST(v ->> {i} AS {kind})")
    listed = ", ".join(f'"{c}"' for c in columns)
    head = f"INSERT INTO {table.name} ({listed}) SELECT "
    sqlite_picks = ", ".join(f"json_extract(v.value, '$[{i}]')" for i in range(len(columns)))
    return Sql(
        f"{head}{', '.join(picks)} FROM json_array_elements(CAST(%(rows)s AS json)) AS v",
        sqlite=f"{head}{sqlite_picks} FROM json_each(%(rows)s) AS v",
    )


def _iso(value: Any) -> str:
    """A datetime as ISO text in :func:`insert_document`'s document (PostgreSQL)."""
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot store {type(value).__name__} {value!r} in a row")


def _stored(value: Any) -> str:
    """A datetime as SQLite stores it, in :func:`insert_document`'s document."""
    if isinstance(value, datetime):
        return stored_utc(value)
    raise TypeError(f"cannot store {type(value).__name__} {value!r} in a row")


@cache
def _kinds(table: Table, columns: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Positions of the JSON columns and of the ``UTCDateTime`` ones among ``columns``."""
    json_at = tuple(i for i, c in enumerate(columns) if isinstance(table.c[c].type, JSON))
    utc_at = tuple(i for i, c in enumerate(columns) if isinstance(table.c[c].type, UTCDateTime))
    return json_at, utc_at


def _check_aware(value: datetime | None, table: str, column: str) -> None:
    if value is not None and value.tzinfo is None:
        raise ValueError(f"{table}.{column}: celery_boundedbeat stores only timezone-aware datetimes")
