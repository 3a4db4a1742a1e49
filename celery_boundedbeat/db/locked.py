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
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import JSON, Table
from sqlalchemy.orm import Session

from .driver import Driver, Kind, Sql, kinds_of, stored_utc
from .tables import ScheduleRow, as_utc

SCHEDULES = cast(Table, ScheduleRow.__table__)

_ALL_COLUMNS = frozenset(c.name for c in SCHEDULES.c)
#: The definition: read only when a schedule is (re)built from its row.
DEFINITION = frozenset({"task", "schedule", "args", "kwargs", "options", "timing", "created_at"})
#: What a tick leaves out: the policy too, which it reads from the schedule it resolves (the
#: row's policy is read back only to rebuild one); decoding it was a twentieth of a tick.
TICK_LEAVES_OUT = DEFINITION | {"policy"}
#: Columns whose values travel as their JSON text in a document (:func:`write_changed`).
_JSON_COLUMNS = frozenset(c.name for c in SCHEDULES.c if isinstance(c.type, JSON))


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


def hold(
    db: Session | Driver, where: Sql, params: Mapping[str, Any], *, leave_out: frozenset[str] = DEFINITION
) -> HeldRows:
    """Hold the rows of ``SELECT <the columns but leave_out> ... WHERE <where>``, in its order.

    ``where`` may end in ``ORDER BY`` / ``LIMIT`` and, on PostgreSQL, ``FOR UPDATE``: SQLite
    has one writer, whose transaction holds every row it reads. Sent to the driver
    (:mod:`.driver`): a worker's batch of outcomes spent more CPU in the ORM's statement
    building and result processing than in the settle itself. Without a session (a bare
    psycopg connection) nothing may be left out: the columns left out are fetched through
    the session when first read.
    """
    session = db if isinstance(db, Session) else None
    if session is None and leave_out:
        raise ValueError("hold without a session holds whole rows (leave_out=frozenset())")
    driver = Driver.of(db) if isinstance(db, Session) else db
    fields, kinds = _columns_but(leave_out)
    rows = driver.rows(_select(fields, where), params, kinds)  # one fetch: row by row was a tenth of a settle
    return _held(session, fields, rows)


@cache
def _columns_but(leave_out: frozenset[str]) -> tuple[tuple[str, ...], tuple[Kind, ...]]:
    """The columns selected and their kinds (to read them as SQLAlchemy does)."""
    columns = [c for c in SCHEDULES.c if c.name not in leave_out]
    return tuple(c.name for c in columns), kinds_of(columns)


@cache
def _select(fields: tuple[str, ...], where: Sql) -> Sql:
    head = f"SELECT {', '.join(f'{chr(34)}{f}{chr(34)}' for f in fields)} FROM {SCHEDULES.name} WHERE "
    return where.prefixed(head)


def _held(s: Session | None, fields: tuple[str, ...], raws: Any) -> HeldRows:
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
    driver = Driver.of(s) if names else None
    for start in range(0, len(names), 500):
        assert driver is not None
        part = names[start : start + 500]
        columns = tuple(sorted(_ALL_COLUMNS - set(held.loaded[part[0]])))
        for found in driver.rows(_select(("name", *columns), _NAMED), {"n": part}, _kinds(columns)):
            row = held.rows[found[0]]
            row.__dict__["_fetch"] = None
            for column, value in zip(columns, found[1:], strict=True):
                row.__dict__.setdefault(column, value)
    return len(names)


#: The rows named in the list ``n``.
_NAMED = Sql("name = ANY(CAST(%(n)s AS text[]))", sqlite="name IN (SELECT value FROM json_each(:n))")
_ONE = Sql("name = %(name)s")


@cache
def _kinds(columns: tuple[str, ...]) -> tuple[Kind, ...]:
    """The kinds of ``name`` and ``columns``."""
    return kinds_of([SCHEDULES.c.name, *(SCHEDULES.c[c] for c in columns)])


def _fetcher(s: Session, name: str, columns: frozenset[str]) -> Callable[[], Mapping[str, Any]] | None:
    if not columns:
        return None

    def fetch() -> Mapping[str, Any]:
        listed = tuple(sorted(columns))
        found = Driver.of(s).rows(_select(("name", *listed), _ONE), {"name": name}, _kinds(listed))
        return dict(zip(listed, found[0][1:], strict=True))

    return fetch


def write_changed(db: Session | Driver, held: HeldRows) -> None:
    """Write back the columns each held row changed (compared with what was loaded): one
    ``UPDATE`` per set of changed columns (usually one for a whole tick), its rows one JSON
    document (:func:`_update`)."""
    driver = Driver.of(db) if isinstance(db, Session) else db
    for columns, rows in _changes(held).items():
        driver.execute(_update(columns), {"rows": _document(driver.dialect, columns, rows)})


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


@cache
def _update(columns: tuple[str, ...]) -> Sql:
    """One ``UPDATE ... FROM`` the rows of a JSON document, for every row changing ``columns``.

    The rows travel as one JSON document: psycopg dumped array parameters element by element
    in Python, a twentieth of a tick. JSON columns travel as their JSON text and are cast per
    row, so a JSON ``null`` stays JSON ``null`` where the ORM writes it (not SQL ``NULL``).
    PostgreSQL reads the document with ``json_to_recordset``, SQLite with ``json_each`` (its
    values already as the columns store them: :func:`_document`).
    """
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    fields = ['"b_name" text']
    sets = []
    sqlite_sets = []
    picks = ["json_extract(value, '$.b_name') AS b_name"]
    for c in columns:
        kind = "text" if c in _JSON_COLUMNS else SCHEDULES.c[c].type.compile(dialect=dialect)
        fields.append(f'"b_{c}" {kind}')
        sets.append(f'"{c}" = CAST(v."b_{c}" AS json)' if c in _JSON_COLUMNS else f'"{c}" = v."b_{c}"')
        sqlite_sets.append(f'"{c}" = v."b_{c}"')
        picks.append(f"json_extract(value, '$.b_{c}') AS b_{c}")
    return Sql(
        f"UPDATE {SCHEDULES.name} AS t SET {', '.join(sets)} "
        f"FROM json_to_recordset(CAST(%(rows)s AS json)) AS v({', '.join(fields)}) WHERE t.name = v.b_name",
        sqlite=f"UPDATE {SCHEDULES.name} AS t SET {', '.join(sqlite_sets)} "
        f"FROM (SELECT {', '.join(picks)} FROM json_each(:rows)) AS v WHERE t.name = v.b_name",
    )


def _document(dialect: str, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> str:
    """The changed rows as one JSON array of objects keyed as :func:`_update` reads them."""
    encoded = [c for c in columns if c in _JSON_COLUMNS]
    if encoded:
        for r in rows:
            for c in encoded:
                r[f"b_{c}"] = json.dumps(r[f"b_{c}"])
    return json.dumps(rows, default=_iso if dialect == "postgresql" else _stored, allow_nan=False)


def _iso(value: Any) -> str:
    """A datetime as ISO text for :func:`_document` (aware, in UTC)."""
    if isinstance(value, datetime):
        return cast(datetime, as_utc(value)).isoformat()
    raise TypeError(f"cannot store {type(value).__name__} {value!r} in a schedule row")


def _stored(value: Any) -> str:
    """A datetime as SQLite stores it (naive UTC text, as the ORM writes it)."""
    if isinstance(value, datetime):
        return stored_utc(value)
    raise TypeError(f"cannot store {type(value).__name__} {value!r} in a schedule row")
