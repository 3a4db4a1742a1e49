"""Rows inserted in bulk: one ``COPY`` on PostgreSQL, a Core executemany elsewhere.

A tick of a thousand runs writes two thousand rows (the runs and their queue rows). Through
an executemany, SQLAlchemy compiles, binds and processes every row and psycopg sends each as
a statement of its pipeline: about a third of a prepared tick's CPU. ``COPY`` streams the
values as they are and the server parses them while the rest are still being sent.

``COPY`` bypasses SQLAlchemy's type processing, so the two bindings the ORM would do are
done here: JSON columns travel as JSON text, and a naive datetime is refused instead of
being read in the session's time zone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from functools import cache
from itertools import chain, islice
from typing import Any

from sqlalchemy import JSON, Table, insert
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from .schema import UTCDateTime

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


@cache
def _kinds(table: Table, columns: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Positions of the JSON columns and of the ``UTCDateTime`` ones among ``columns``."""
    json_at = tuple(i for i, c in enumerate(columns) if isinstance(table.c[c].type, JSON))
    utc_at = tuple(i for i, c in enumerate(columns) if isinstance(table.c[c].type, UTCDateTime))
    return json_at, utc_at


def _check_aware(value: datetime | None, table: str, column: str) -> None:
    if value is not None and value.tzinfo is None:
        raise ValueError(f"{table}.{column}: celery_boundedbeat stores only timezone-aware datetimes")
