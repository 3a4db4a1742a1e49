"""The schedule definitions' transactions: reconcile config, add, update (bodies run in a session).

:class:`~celery_boundedbeat.db.store.Store` opens the transaction and calls these; each decides
nothing itself (the tick state machine does) and touches only the rows that change, so the
cost of a change is proportional to the change, not to the number of schedules:

- config reconciling reads one narrow tuple per schedule and writes only new, changed or
  removed config rows, in chunks that stay far below the drivers' bound-parameter limits;
- a runtime add is one ``INSERT ... ON CONFLICT DO NOTHING``: two processes adding the same
  name at once get one schedule and one ``already_present``;
- an update locks one row;
- on PostgreSQL add, update and remove go to psycopg directly, an add or a remove as one
  statement with its ``NOTIFY``: a runtime change's CPU was mostly the ORM's.

Ownership (docs/runtime-schedules.md): config reconciling never changes, replaces or removes a runtime
schedule; a name in both is left to the row already in the table, and logged.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any, TypeVar, cast

from sqlalchemy import JSON, Row, Table, delete, exists, func, insert, select
from sqlalchemy.orm import Session

from ..core.exceptions import ConfigurationError, UnknownScheduleError
from ..core.policy import Policy
from ..core.spec import Definition
from ..core.ticks import first_state, on_config_change
from .bulk import insert_many
from .driver import Driver, Sql
from .locked import DEFINITION, HeldRows, hold, write_changed
from .row_state import COLUMNS, CONFIG, RUNTIME, apply_state, state_of, write_definition, write_state
from .row_state import fresh_values as row_values
from .tables import RunRow, ScheduleRow

logger = logging.getLogger("celery_boundedbeat")

#: Rows written or named per statement: well below SQLite's 32,766 and psycopg's 65,535
#: bound parameters whatever the number of schedules.
CHUNK = 500
TABLE = cast(Table, ScheduleRow.__table__)
#: Stored as JSON documents (``None`` as JSON ``null``, as SQLAlchemy's JSON type writes it).
JSON_COLUMNS = frozenset(c.key for c in TABLE.columns if isinstance(c.type, JSON))

_T = TypeVar("_T")


def chunks(items: Sequence[_T], size: int = CHUNK) -> Iterable[Sequence[_T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


@dataclass(kw_only=True, slots=True)
class Reconciled:
    """What reconciling ``beat_schedule`` with the table did (for the beat's log)."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    #: Config entries whose name a runtime schedule already has: the table's schedule wins.
    clashes: list[str] = field(default_factory=list)


def fresh_values(
    d: Definition, now: datetime, rng: random.Random, *, origin: str, last_run_at: Any
) -> dict[str, Any]:
    """A new schedule's row as plain values: its first state and its definition."""
    state = first_state(d.spec, now, rng, last_run_at)
    return row_values(d.spec, state, d.digest, d.timing, now, origin=origin)


def insert_rows(s: Session, rows: Iterable[dict[str, Any]]) -> None:
    """Insert new schedule rows given as plain values, in the session's transaction.

    No ORM object per row: building and reading back 100,000 instrumented rows was most of
    a cold start. PostgreSQL gets one ``COPY`` (:func:`~.bulk.insert_many`: a third of the
    time of an executemany, and the server parses while the rows are still being built).
    """
    insert_many(s, TABLE, rows)


def reconcile_config(
    s: Session, definitions: Iterable[Definition], now: datetime, rng: random.Random
) -> Reconciled:
    """Bring the config rows in line with ``beat_schedule``: add new, update changed, drop removed.

    Counters, the grid and pause/stop flags of an unchanged entry survive restarts, so ticks
    missed while beat was down are handled by the entry's policy.
    """
    wanted = {d.name: d for d in definitions}
    seen = _config_rows_and_clashes(s, wanted)
    report = Reconciled()
    touch: list[str] = []
    for name, origin, digest, no_timing, stalled in seen:
        d = wanted.get(name)
        if d is None:
            if origin == CONFIG:
                report.removed.append(name)
        elif origin != CONFIG:
            report.clashes.append(name)
        elif digest != d.digest or (no_timing and d.timing is not None) or stalled:
            touch.append(name)
    known = {name for name, *_ in seen}
    new = [d for name, d in wanted.items() if name not in known]
    insert_rows(s, (fresh_values(d, now, rng, origin=CONFIG, last_run_at=None) for d in new))
    report.added = [d.name for d in new]
    for names in chunks(touch):
        query = select(ScheduleRow).where(ScheduleRow.name.in_(names)).with_for_update()
        for row in s.scalars(query):
            if _reconcile_row(row, wanted[row.name], now, rng):
                report.changed.append(row.name)
    for names in chunks(report.removed):
        s.execute(delete(ScheduleRow).where(ScheduleRow.name.in_(names), ScheduleRow.origin == CONFIG))
    _log(report)
    return report


def _config_rows_and_clashes(
    s: Session, wanted: Mapping[str, Definition]
) -> list[Row[str, str, str, bool, bool]]:
    """The config rows, and the runtime rows named like an entry: what a reconcile compares.

    Read through the config rows' partial index and the names wanted, never the whole table:
    a database of a million runtime schedules reconciles as fast as an empty one.
    """
    columns = (
        ScheduleRow.name,
        ScheduleRow.origin,
        ScheduleRow.config_hash,
        ScheduleRow.timing.is_(None),
        ScheduleRow.next_due_at.is_(None) & ~ScheduleRow.stopped & (ScheduleRow.active_runs == 0),
    )
    seen = list(s.execute(select(*columns).where(ScheduleRow.origin == CONFIG)))
    configured = {row[0] for row in seen}
    for names in chunks([name for name in wanted if name not in configured]):
        seen.extend(
            s.execute(select(*columns).where(ScheduleRow.name.in_(names), ScheduleRow.origin != CONFIG))
        )
    return seen


def _reconcile_row(row: ScheduleRow, d: Definition, now: datetime, rng: random.Random) -> bool:
    """One config row against its entry; whether the definition changed."""
    changed = row.config_hash != d.digest
    new = on_config_change(
        d.spec,
        state_of(row),
        config_changed=changed,
        old_schedule=row.schedule,
        old_mode=Policy.from_json(row.policy).mode,
        now=now,
        rng=rng,
        old_timezone=stored_zone(row),
    )
    write_state(row, new)
    if changed:
        row.updated_at = now
        row.version = (row.version or 0) + 1
    write_definition(row, d.spec, d.digest, d.timing if d.timing is not None else row.timing, origin=CONFIG)
    return changed


def stored_zone(row: ScheduleRow) -> str | None:
    """The zone a stored calendar schedule keeps wall-clock time in (``None`` for an interval)."""
    zone = (row.timing or {}).get("timezone")
    return zone if isinstance(zone, str) else None


def _log(report: Reconciled) -> None:
    if report.removed:
        logger.info("celery_boundedbeat: removed schedules no longer configured: %s", _names(report.removed))
    if report.clashes:
        logger.warning(
            "celery_boundedbeat: beat_schedule entries not applied, a runtime schedule of the same "
            "name exists (the schedule in the table wins; rename the entry or remove the runtime "
            "schedule): %s",
            _names(report.clashes),
        )


def _names(names: list[str], shown: int = 20) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def last_run_at(s: Session, name: str) -> datetime | None:
    """The newest run's grid time: a new grid for ``name`` must not repeat it."""
    value: datetime | None = s.scalar(select(func.max(RunRow.scheduled_for)).where(RunRow.schedule == name))
    return value


def insert_runtime(s: Session, d: Definition, now: datetime, rng: random.Random, dialect: str) -> bool:
    """Add a runtime schedule unless the name exists (config or runtime); whether it was added.

    One probe answers both questions the insert needs (is the name taken, when was its newest
    run), and the insert is one cached statement: building it from forty values per call was
    half of an ``add_schedule``'s CPU.
    """
    taken, newest = s.execute(_probe(d.name)).one()
    if taken:
        return False
    values = fresh_values(d, now, rng, origin=RUNTIME, last_run_at=newest)
    if dialect not in ("postgresql", "sqlite"):
        s.execute(insert(ScheduleRow), values)  # a concurrent add fails on the key
        return True
    # Whether a row came back, not ``rowcount``: SQLAlchemy 2.1 reports -1 for an INSERT unless
    # asked to keep the count, and -1 is truthy, so every add that lost a race said "scheduled".
    return s.execute(_insert_if_new(dialect), values).first() is not None


def add_runtime_pg(conn: Any, d: Definition, now: datetime, rng: random.Random, channel: str) -> bool:
    """The common add on PostgreSQL in one statement: insert and notify, if the name is new.

    Sent to psycopg (``conn``) directly: the ORM's probe, insert and notify cost more CPU
    than the database's work. It only adds a name that is free and has no runs yet (a new
    grid must not repeat an old run's time); False means "not decided here", and the caller
    goes the general way of :func:`insert_runtime`.
    """
    values = fresh_values(d, now, rng, origin=RUNTIME, last_run_at=None)
    params = {c: json.dumps(values[c]) if c in JSON_COLUMNS else values[c] for c in COLUMNS}
    params["channel"] = channel
    with conn.cursor() as cur:
        cur.execute(_pg_add(), params)
        return cur.fetchone() is not None


@cache
def _pg_add() -> str:
    """``INSERT ... SELECT`` of one row with every value cast to its column's base type.

    The casts leave out lengths (``text``, not ``varchar(200)``): a cast would cut a long
    value silently, where the assignment to the column refuses it.
    """
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    columns = ", ".join(f'"{c}"' for c in COLUMNS)
    casts = ", ".join(
        f"CAST(%({c})s AS {re.sub(r'[(][0-9]+[)]', '', TABLE.c[c].type.compile(dialect=dialect))})"
        for c in COLUMNS
    )
    runs = cast(Table, RunRow.__table__).name
    return (
        f"WITH added AS (INSERT INTO {TABLE.name} ({columns}) SELECT {casts} "
        f"WHERE NOT EXISTS (SELECT 1 FROM {runs} WHERE schedule = %(name)s) "
        "ON CONFLICT DO NOTHING RETURNING name) "
        "SELECT pg_notify(%(channel)s, name) FROM added"
    )


def remove_runtime_pg(conn: Any, name: str, channel: str) -> bool:
    """Delete runtime schedule ``name`` and notify, in one statement; False: nothing deleted
    (an unknown name or a config schedule, which the caller tells apart and reports)."""
    with conn.cursor() as cur:
        cur.execute(_PG_REMOVE, {"name": name, "origin": RUNTIME, "channel": channel})
        return cur.fetchone() is not None


_PG_REMOVE = (
    f"WITH gone AS (DELETE FROM {TABLE.name} WHERE name = %(name)s AND origin = %(origin)s "
    "RETURNING name) SELECT pg_notify(%(channel)s, name) FROM gone"
)


def _probe(name: str) -> Any:
    return select(
        exists().where(ScheduleRow.name == name),
        select(func.max(RunRow.scheduled_for)).where(RunRow.schedule == name).scalar_subquery(),
    )


@cache
def _insert_if_new(dialect: str) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING RETURNING name``, its values bound per call."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert  # type: ignore[assignment]
    table = cast(Table, ScheduleRow.__table__)
    return dialect_insert(table).on_conflict_do_nothing().returning(table.c.name)


def runtime_row(s: Session, name: str, *, leave_out: frozenset[str] = DEFINITION) -> HeldRows:
    """The runtime schedule ``name``, locked; config schedules are refused (change the config).

    Held as plain values (:mod:`~.held`): ``write_changed`` sends back what the caller set.
    """
    return _runtime(hold(s, _LOCK_ONE, {"name": name}, leave_out=leave_out), name)


#: One schedule, locked (SQLite has one writer, whose transaction holds every row it reads).
_LOCK_ONE = Sql("name = %(name)s FOR UPDATE", sqlite="name = %(name)s")


def _runtime(held: HeldRows, name: str) -> HeldRows:
    row = held.get(name)
    if row is None:
        raise UnknownScheduleError(name)
    if row.origin != RUNTIME:
        raise ConfigurationError(
            [(name, "origin", "is a config schedule (beat_schedule); change the config instead")]
        )
    return held


def update_runtime(
    s: Session, name: str, revise: Callable[[ScheduleRow], Definition], now: datetime, rng: random.Random
) -> bool:
    """Apply ``revise``'s new definition to a runtime schedule; whether anything changed.

    Counters and history stay; a new timing restarts the grid from ``now`` (no tick before
    the change is emitted for it); a later end revives an ended schedule.
    """
    held = runtime_row(s, name, leave_out=frozenset())
    if not _revised(held, name, revise, now, rng, last_run_at(s, name)):
        return False
    write_changed(s, held)
    return True


def update_runtime_pg(
    conn: Any,
    name: str,
    revise: Callable[[ScheduleRow], Definition],
    now: datetime,
    rng: random.Random,
    channel: str,
) -> bool:
    """:func:`update_runtime` and its notification on a psycopg connection (PostgreSQL).

    The ORM's session and statements cost more CPU than the change itself. (psycopg's
    pipeline mode saved no time here and cost CPU, so the statements go one by one.)
    """
    driver = Driver.psycopg(conn)
    held = hold(driver, _LOCK_ONE, {"name": name}, leave_out=frozenset())
    with conn.cursor() as cur:
        # After the lock: a prepared tick holding the row commits its run before we get here.
        cur.execute(_PG_NEWEST, {"name": name})
        (newest,) = cur.fetchone()
    if not _revised(_runtime(held, name), name, revise, now, rng, newest and newest.astimezone(UTC)):
        return False
    write_changed(driver, held)
    with conn.cursor() as cur:
        cur.execute("SELECT pg_notify(%(c)s, %(p)s)", {"c": channel, "p": name})
    return True


_PG_NEWEST = f"SELECT max(scheduled_for) FROM {cast(Table, RunRow.__table__).name} WHERE schedule = %(name)s"


def _revised(
    held: HeldRows,
    name: str,
    revise: Callable[[ScheduleRow], Definition],
    now: datetime,
    rng: random.Random,
    newest: datetime | None,
) -> bool:
    """Set the held row to ``revise``'s definition and its new state; False if nothing changed."""
    row: Any = held.get(name)
    d = revise(row)
    if d.digest == row.config_hash and d.timing == row.timing:
        return False
    new = on_config_change(
        d.spec,
        state_of(row),
        config_changed=True,
        old_schedule=row.schedule,
        old_mode=Policy.from_json(row.policy).mode,
        now=now,
        rng=rng,
        last_run_at=newest,
        old_timezone=stored_zone(row),
    )
    apply_state(row, new, now)
    write_definition(row, d.spec, d.digest, d.timing, origin=RUNTIME)
    row.version = (row.version or 0) + 1
    return True
