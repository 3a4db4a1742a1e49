"""What an end-to-end test reads back: the package's tables and the tasks' own records.

``Reads`` queries ``boundedbeat_runs`` and ``boundedbeat_schedules`` of a test's database as
plain values (``Run`` rows, schedule dicts with aware UTC timestamps, a consistent
schedule-and-runs picture); ``intervals`` reads the JSON-lines file the generated ``work``
task writes, so overlap can be checked independently of the package's bookkeeping, and
``max_concurrent`` measures it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.pool import NullPool

from .backends import Backend

ACTIVE_STATES = ("queued", "published", "started")

RUN_COLUMNS = (
    "id",
    "schedule",
    "task",
    "state",
    "scheduled_for",
    "enqueued_at",
    "published_at",
    "started_at",
    "finished_at",
    "elapsed_ms",
    "drift_ms",
    "worker",
    "error",
    "attempt",
    "retry_of",
)
_TIME_COLUMNS = {
    "scheduled_for",
    "enqueued_at",
    "published_at",
    "started_at",
    "finished_at",
    "next_due_at",
    "grid_at",
    "updated_at",
    "created_at",
    "last_finished_at",
}


def as_utc(value: Any) -> datetime | None:
    """A timestamp column as an aware UTC datetime (SQLite gives naive UTC text)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def epoch(value: datetime) -> float:
    return value.timestamp()


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One row of ``boundedbeat_runs``."""

    id: str
    schedule: str
    task: str
    state: str
    scheduled_for: datetime
    enqueued_at: datetime
    published_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    elapsed_ms: int | None
    drift_ms: int | None
    worker: str | None
    error: str | None
    attempt: int = 1
    retry_of: str | None = None

    def short(self) -> str:
        def t(v: datetime | None) -> str:
            return "-" if v is None else v.strftime("%H:%M:%S.%f")[:-3]

        return (
            f"{self.schedule} {self.state:<9} sched={t(self.scheduled_for)} enq={t(self.enqueued_at)} "
            f"start={t(self.started_at)} fin={t(self.finished_at)} err={(self.error or '')[:60]!r}"
            + (f" attempt={self.attempt} of={self.retry_of}" if self.attempt > 1 else "")
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskInterval:
    """A run as the task itself saw it (wall-clock seconds since the epoch)."""

    id: str
    name: str
    n: int
    start: float
    end: float | None
    pid: int


def max_concurrent(intervals: Iterable[tuple[float, float]]) -> int:
    """The largest number of intervals open at one instant (an end at t closes before a start at t)."""
    points: list[tuple[float, int]] = []
    for start, end in intervals:
        points.append((start, 1))
        points.append((end, -1))
    points.sort()
    best = current = 0
    for _, delta in points:
        current += delta
        best = max(best, current)
    return best


def intervals(events_path: Path, name: str | None = None) -> list[TaskInterval]:
    """Task-recorded runs (paired start/end lines), by start time."""
    try:
        lines = events_path.read_text().splitlines()
    except FileNotFoundError:
        return []
    starts: dict[str, dict[str, Any]] = {}
    ends: dict[str, float] = {}
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if name is not None and event["name"] != name:
            continue
        if event["event"] == "start":
            starts[event["id"]] = event
        else:
            ends[event["id"]] = event["t"]
    return sorted(
        (
            TaskInterval(id=i, name=e["name"], n=e["n"], start=e["t"], end=ends.get(i), pid=e["pid"])
            for i, e in starts.items()
        ),
        key=lambda iv: iv.start,
    )


class Reads:
    """Queries on one test's database; ``describe`` adds context to a failed read."""

    def __init__(self, backend: Backend, tmp: Path, describe: Callable[[], str] = lambda: "") -> None:
        self.backend = backend
        self.tmp = tmp
        self.describe = describe
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = create_engine(self.backend.database_url, poolclass=NullPool)
        return self._engine

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def sql(self, query: str, **params: Any) -> list[dict[str, Any]]:
        """Rows as dicts (timestamps as aware UTC); empty when the tables do not exist yet."""
        if not self.backend.is_postgres and not (self.tmp / "state.sqlite3").exists():
            return []
        try:
            with self.engine.connect() as conn:
                rows = [dict(r._mapping) for r in conn.execute(text(query), params)]
        except (OperationalError, ProgrammingError) as exc:
            message = str(exc).lower()
            if "no such table" in message or "does not exist" in message:
                return []
            raise
        for row in rows:
            for key in row.keys() & _TIME_COLUMNS:
                row[key] = as_utc(row[key])
        return rows

    def runs(self, schedule: str | None = None) -> list[Run]:
        """Runs (of one schedule), oldest ``scheduled_for`` first."""
        where = "WHERE schedule = :schedule" if schedule is not None else ""
        rows = self.sql(
            f"SELECT {', '.join(RUN_COLUMNS)} FROM boundedbeat_runs {where} "
            "ORDER BY scheduled_for, enqueued_at",
            schedule=schedule,
        )
        return [Run(**row) for row in rows]

    def finished(self, schedule: str, state: str = "completed") -> list[Run]:
        return [r for r in self.runs(schedule) if r.state == state]

    def schedules(self) -> dict[str, dict[str, Any]]:
        rows = self.sql(
            "SELECT name, active_runs, pending_runs, runs, skips, "
            '"overlaps" AS overlaps, failures, paused, stopped, grid_at, next_due_at '
            "FROM boundedbeat_schedules ORDER BY name"
        )
        return {row.pop("name"): row for row in rows}

    def schedule(self, name: str) -> dict[str, Any]:
        row = self.schedules().get(name)
        assert row is not None, f"no schedule row {name!r}\n{self.describe()}"
        return row

    def books(self, name: str) -> tuple[dict[str, Any], list[Run]]:
        """The schedule row and its runs as one consistent picture.

        Two separate reads race with a run settling between them, so read the schedule row
        before and after the runs and retry until nothing moved in between.
        """
        for _ in range(100):
            before = self.schedule(name)
            rows = self.runs(name)
            if self.schedule(name) == before:
                return before, rows
            time.sleep(0.05)
        raise AssertionError(f"schedule {name!r} never held still long enough to read\n{self.describe()}")
