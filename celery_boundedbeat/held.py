"""Schedule rows locked by a tick or a settle, held as plain values and written back by column.

Loading a thousand due rows as ORM objects, tracking their changes and flushing one UPDATE
each was most of a tick's CPU; so was decoding each row's definition JSON (args, kwargs,
options, timing) that the tick does not read unless it rebuilds the schedule. Here a row is
a :class:`Held`: its state columns as attributes, the definition fetched only if asked for,
and :func:`write_changed` sends back only the columns that changed, one executemany per
set of changed columns (usually one for the whole tick).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

from sqlalchemy import Select, Table, bindparam, select, update
from sqlalchemy.orm import Session

from .schema import ScheduleRow

SCHEDULES = cast(Table, ScheduleRow.__table__)

_ALL_COLUMNS = frozenset(c.name for c in SCHEDULES.c)
#: The definition: read only when a schedule is (re)built from its row.
DEFINITION = frozenset({"task", "schedule", "args", "kwargs", "options", "timing", "created_at"})


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
    missing = _ALL_COLUMNS - set(fields)
    held = HeldRows()
    for raw in result.all():  # one fetch: row by row, the driver's fetchone was a tenth of a settle
        values = dict(zip(fields, raw, strict=True))
        name = values["name"]
        held.loaded[name] = values
        held.rows[name] = Held(values, _fetcher(s, name, missing))
    return held


def _fetcher(s: Session, name: str, columns: frozenset[str]) -> Callable[[], Mapping[str, Any]] | None:
    if not columns:
        return None

    def fetch() -> Mapping[str, Any]:
        query = select(*(SCHEDULES.c[c] for c in sorted(columns))).where(SCHEDULES.c.name == name)
        return dict(s.execute(query).one()._mapping)

    return fetch


def write_changed(s: Session, held: HeldRows) -> None:
    """Write back the columns each held row changed (compared with what was loaded)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for name, row in held.rows.items():
        before = held.loaded[name]
        changed = tuple(c for c, v in vars(row).items() if c in before and before[c] != v)
        if changed:
            params = {"b_name": name, **{f"b_{c}": getattr(row, c) for c in changed}}
            groups.setdefault(changed, []).append(params)
    for columns, rows in groups.items():
        s.connection().execute(
            update(SCHEDULES)
            .where(SCHEDULES.c.name == bindparam("b_name"))
            .values({c: bindparam(f"b_{c}") for c in columns}),
            rows,
        )
