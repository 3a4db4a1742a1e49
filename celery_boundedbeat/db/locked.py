"""Schedule rows locked by a tick or a settle, held as plain values and written back by column.

Loading a thousand due rows as ORM objects, tracking their changes and flushing one UPDATE
each was most of a tick's CPU; so was decoding each row's definition JSON (args, kwargs,
options, timing) that the tick does not read unless it rebuilds the schedule. Here a row is
a :class:`Held`: its state columns as attributes, the definition fetched only if asked for,
and :func:`write_changed` sends back only the columns that changed, one statement per set
of changed columns (usually one for the whole tick).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import JSON, Select, Table, bindparam, select, update
from sqlalchemy.orm import Session

from .tables import ScheduleRow, UTCDateTime, as_utc

SCHEDULES = cast(Table, ScheduleRow.__table__)

_ALL_COLUMNS = frozenset(c.name for c in SCHEDULES.c)
#: The definition: read only when a schedule is (re)built from its row.
DEFINITION = frozenset({"task", "schedule", "args", "kwargs", "options", "timing", "created_at"})
#: What a tick leaves out: the policy too, which it reads from the schedule it resolves (the
#: row's policy is read back only to rebuild one); decoding it was a twentieth of a tick.
TICK_LEAVES_OUT = DEFINITION | {"policy"}
#: Columns whose values need converting when sent to or read from psycopg directly.
_JSON_COLUMNS = frozenset(c.name for c in SCHEDULES.c if isinstance(c.type, JSON))
_UTC_COLUMNS = frozenset(c.name for c in SCHEDULES.c if isinstance(c.type, UTCDateTime))


class Held:
    """A schedule row's columns as attributes; what a transaction sets on it is written back.

    Columns left out when loading (``DEFINITION``) are fetched together, in the same
    transaction, the first time one of them is read.
    """

    def __init__(
        self, values: Mapping[str, Any], fetch: Callable[[], Mapping[str, Any]] | None = None
    ) -> None:
        self.__dict__.update(values)
        self.__dict__["_fetch"] = fetch

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not set: the columns left out, or a typo.
        fetch = self.__dict__.get("_fetch")
        if fetch is None or name.startswith("_"):
            raise AttributeError(name)
        self.__dict__["_fetch"] = None
        for key, value in fetch().items():
            self.__dict__.setdefault(key, value)
        return getattr(self, name)


class HeldRows:
    """The rows one query locked: as loaded (to compare) and as changed since."""

    def __init__(self) -> None:
        self.loaded: dict[str, dict[str, Any]] = {}
        self.rows: dict[str, Held] = {}

    def __iter__(self) -> Any:
        return iter(self.rows.values())

    def get(self, name: str) -> Held | None:
        return self.rows.get(name)


def light_select(*, leave_out: frozenset[str] = DEFINITION) -> Select[Any]:
    """``SELECT`` of the schedule columns but ``leave_out``; add criteria and locking to it."""
    return select(*(c for c in SCHEDULES.c if c.name not in leave_out))


def hold(s: Session, query: Select[Any]) -> HeldRows:
    """Run ``query`` (a :func:`light_select`) and hold its rows, in its order."""
    result = s.execute(query)
    fields = list(result.keys())
    # one fetch: row by row, the driver's fetchone was a tenth of a settle
    return _held(s, fields, result.all())


def hold_pg(
    s: Session, where: str, params: Mapping[str, Any], *, leave_out: frozenset[str] = DEFINITION
) -> HeldRows:
    """:func:`hold` of ``SELECT <light columns> ... WHERE <where>`` sent to psycopg directly.

    A worker's batch of outcomes spent more CPU in the ORM's statement building and result
    processing than in the settle itself; this path has neither. ``where`` is SQL with
    ``%(name)s`` placeholders (never values) and may end in ``ORDER BY`` / ``FOR UPDATE``.
    """
    return hold_driver(driver_connection(s), where, params, session=s, leave_out=leave_out)


def hold_driver(
    conn: Any,
    where: str,
    params: Mapping[str, Any],
    *,
    session: Session | None = None,
    leave_out: frozenset[str] = DEFINITION,
) -> HeldRows:
    """:func:`hold_pg` on a psycopg connection; without ``session`` nothing may be left out
    (the columns left out are fetched through the session when first read)."""
    if session is None and leave_out:
        raise ValueError("hold_driver without a session holds whole rows (leave_out=frozenset())")
    fields, listed, at = _columns_but(leave_out)
    with conn.cursor() as cur:
        cur.execute(f"SELECT {listed} FROM {SCHEDULES.name} WHERE {where}", params)
        rows = cur.fetchall()
    if at:
        rows = [_utc_row(row, at) for row in rows]
    return _held(session, fields, rows)


def _utc_row(row: tuple[Any, ...], at: list[int]) -> tuple[Any, ...]:
    """The row with its ``UTCDateTime`` columns as aware UTC, as SQLAlchemy returns them."""
    out = list(row)
    for i in at:
        if out[i] is not None:
            out[i] = out[i].astimezone(UTC)
    return tuple(out)


@cache
def _columns_but(leave_out: frozenset[str]) -> tuple[list[str], str, list[int]]:
    """The columns selected, as SQL, and the positions of the ``UTCDateTime`` ones among them."""
    fields = [c.name for c in SCHEDULES.c if c.name not in leave_out]
    listed = ", ".join(f'"{f}"' for f in fields)
    return fields, listed, [i for i, f in enumerate(fields) if f in _UTC_COLUMNS]


def driver_connection(s: Session) -> Any:
    """The session's psycopg connection: statements on it share the session's transaction."""
    return s.connection().connection.driver_connection


def driver_cursor(s: Session) -> Any:
    """A psycopg cursor on the session's connection: same transaction, no ORM in between."""
    return driver_connection(s).cursor()


def pipeline(conn: Any) -> AbstractContextManager[Any]:
    """psycopg's pipeline mode where libpq has it: the statements inside go in one round trip
    (a ``fetchall`` inside waits for what was sent before it)."""
    from psycopg import Pipeline  # psycopg is the PostgreSQL extra's

    return conn.pipeline() if Pipeline.is_supported() else nullcontext()


def _held(s: Session | None, fields: list[str], raws: Any) -> HeldRows:
    missing = _ALL_COLUMNS - set(fields)
    held = HeldRows()
    for raw in raws:
        values = dict(zip(fields, raw, strict=True))
        name = values["name"]
        held.loaded[name] = values
        held.rows[name] = Held(values, None if s is None else _fetcher(s, name, missing))
    return held


def prefetch_definitions(s: Session, held: HeldRows, resolve: Any) -> int:
    """:func:`fill_definitions` of the rows ``resolve`` will rebuild (when it can say which:
    the beat's :class:`~.definitions.Resolver`)."""
    needs = getattr(resolve, "needs_definition", None)
    return 0 if needs is None else fill_definitions(s, held, needs)


def fill_definitions(s: Session, held: HeldRows, wanted: Callable[[Any], bool]) -> int:
    """Load the left-out columns of the held rows ``wanted`` picks, in one query per chunk.

    A row's definition is fetched on first read otherwise, one query each: when a thousand
    runtime schedules changed in a second, a tick rebuilt hundreds of them, and those queries
    were the beat's largest cost. Returns how many rows were filled.
    """
    names = [row.name for row in held if row.__dict__.get("_fetch") is not None and wanted(row)]
    postgres = s.get_bind().dialect.name == "postgresql"
    for start in range(0, len(names), 500):
        part = names[start : start + 500]
        columns = sorted(_ALL_COLUMNS - set(held.loaded[part[0]]))
        found_rows: Sequence[Any]
        if postgres:
            found_rows = _definitions_pg(s, columns, part)
        else:
            query = select(SCHEDULES.c.name, *(SCHEDULES.c[c] for c in columns))
            found_rows = s.execute(query.where(SCHEDULES.c.name.in_(part))).all()
        for found in found_rows:
            row = held.rows[found[0]]
            row.__dict__["_fetch"] = None
            for column, value in zip(columns, found[1:], strict=True):
                row.__dict__.setdefault(column, value)
    return len(names)


def _definitions_pg(s: Session, columns: list[str], names: list[str]) -> list[tuple[Any, ...]]:
    """``(name, *columns)`` of the rows ``names``, through psycopg (types as the ORM reads them)."""
    listed = ", ".join(f'"{c}"' for c in columns)
    at = [i + 1 for i, c in enumerate(columns) if c in _UTC_COLUMNS]
    with driver_cursor(s) as cur:
        where = "name = ANY(CAST(%(n)s AS text[]))"
        cur.execute(f"SELECT name, {listed} FROM {SCHEDULES.name} WHERE {where}", {"n": names})
        rows = cur.fetchall()
    return [_utc_row(row, at) for row in rows] if at else rows


def _fetcher(s: Session, name: str, columns: frozenset[str]) -> Callable[[], Mapping[str, Any]] | None:
    if not columns:
        return None

    def fetch() -> Mapping[str, Any]:
        query = select(*(SCHEDULES.c[c] for c in sorted(columns))).where(SCHEDULES.c.name == name)
        return dict(s.execute(query).one()._mapping)

    return fetch


def write_changed(s: Session, held: HeldRows) -> None:
    """Write back the columns each held row changed (compared with what was loaded)."""
    if s.get_bind().dialect.name == "postgresql":
        write_changed_driver(driver_connection(s), held)
        return
    for columns, rows in _changes(held).items():
        s.connection().execute(
            update(SCHEDULES)
            .where(SCHEDULES.c.name == bindparam("b_name"))
            .values({c: bindparam(f"b_{c}") for c in columns}),
            rows,
        )


def _changes(held: HeldRows) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """The held rows' changed values, grouped by the set of columns each row changed."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for name, row in held.rows.items():
        before = held.loaded[name]
        changed = tuple(c for c, v in vars(row).items() if c in before and before[c] != v)
        if changed:
            params = {"b_name": name, **{f"b_{c}": getattr(row, c) for c in changed}}
            groups.setdefault(changed, []).append(params)
    return groups


def write_changed_driver(conn: Any, held: HeldRows) -> None:
    """:func:`write_changed` on a psycopg connection: one ``UPDATE`` per set of changed columns."""
    for columns, rows in _changes(held).items():
        with conn.cursor() as cur:
            cur.execute(_pg_update(columns), {"rows": _pg_document(columns, rows)})


@cache
def _pg_update(columns: tuple[str, ...]) -> str:
    """One ``UPDATE ... FROM json_to_recordset(...)`` for every row changing ``columns``.

    The rows travel as one JSON document: psycopg dumped array parameters element by element
    in Python, a twentieth of a tick. JSON columns travel as their JSON text and are cast per
    row, so a JSON ``null`` stays JSON ``null`` where the ORM writes it (not SQL ``NULL``).
    """
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    fields = ['"b_name" text']
    sets = []
    for c in columns:
        kind = "text" if c in _JSON_COLUMNS else SCHEDULES.c[c].type.compile(dialect=dialect)
        fields.append(f'"b_{c}" {kind}')
        sets.append(f'"{c}" = CAST(v."b_{c}" AS json)' if c in _JSON_COLUMNS else f'"{c}" = v."b_{c}"')
    return (
        f"UPDATE {SCHEDULES.name} AS t SET {', '.join(sets)} "
        f"FROM json_to_recordset(CAST(%(rows)s AS json)) AS v({', '.join(fields)}) WHERE t.name = v.b_name"
    )


def _pg_document(columns: tuple[str, ...], rows: list[dict[str, Any]]) -> str:
    """The changed rows as one JSON array of objects keyed as :func:`_pg_update` reads them."""
    encoded = [c for c in columns if c in _JSON_COLUMNS]
    if encoded:
        for r in rows:
            for c in encoded:
                r[f"b_{c}"] = json.dumps(r[f"b_{c}"])
    return json.dumps(rows, default=_iso, allow_nan=False)


def _iso(value: Any) -> str:
    """A datetime as ISO text for :func:`_pg_document` (aware, in UTC)."""
    if isinstance(value, datetime):
        return cast(datetime, as_utc(value)).isoformat()
    raise TypeError(f"cannot store {type(value).__name__} {value!r} in a schedule row")
