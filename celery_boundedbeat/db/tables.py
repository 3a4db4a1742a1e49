"""The SQL tables (docs/sql.md). Column names here are a public, stable contract."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from ..core.limits import MAX_SCHEDULE_NAME, MAX_SCHEDULE_TEXT, MAX_TASK_ID, MAX_TASK_NAME

#: Alembic keeps its own version table so ours never collides with the application's.
VERSION_TABLE = "boundedbeat_alembic_version"

BigId = BigInteger().with_variant(Integer(), "sqlite")


def as_utc(value: datetime | None) -> datetime | None:
    """``value`` in UTC, as every datetime column stores it; a naive one is refused, since its
    zone could only be guessed (writers that bypass :class:`UTCDateTime` call this too)."""
    if value is None:
        return None
    if value.tzinfo is None:
        raise ValueError("celery_boundedbeat stores only timezone-aware datetimes")
    return value.astimezone(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive UTC text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        value = as_utc(value)
        return value.replace(tzinfo=None) if value is not None and dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)  # type: ignore[no-any-return]
        return value.astimezone(UTC)  # type: ignore[no-any-return]


class Base(DeclarativeBase):
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


def new_incarnation() -> str:
    """A fresh incarnation reference: a random UUID, so no later schedule of a name can reuse it
    (an integer key could come back on SQLite after a delete of the highest row)."""
    return str(uuid.uuid4())


class ScheduleRow(Base):
    """One schedule: its policy, counters, and the times the beat must look at it."""

    __tablename__ = "boundedbeat_schedules"
    __table_args__ = (
        # beat_schedule's rows alone, for the lease holder's reconcile: among a million runtime
        # schedules it reads the few config rows, not the table.
        Index(
            "ix_boundedbeat_schedules_config",
            "name",
            postgresql_where=text("origin = 'config'"),
            sqlite_where=text("origin = 'config'"),
        ),
    )

    name: Mapped[str] = mapped_column(String(MAX_SCHEDULE_NAME), primary_key=True)
    #: This incarnation of the name: set when the row is created (an add, or a config entry's
    #: first reconcile) and never changed or reused. Its runs carry it and settle only onto it.
    incarnation: Mapped[str] = mapped_column(String(36), unique=True, default=new_incarnation)
    #: The schedule's hash slot (``core.partitions.slot_of(name)``, 0-1023): with
    #: ``boundedbeat_partitions = P`` it is ticked by the owner of partition ``slot % P``.
    slot: Mapped[int] = mapped_column(Integer, default=0)
    task: Mapped[str] = mapped_column(String(MAX_TASK_NAME))
    mode: Mapped[str] = mapped_column(String(32))
    policy: Mapped[dict[str, Any]] = mapped_column(JSON)
    schedule: Mapped[str] = mapped_column(String(MAX_SCHEDULE_TEXT))
    period: Mapped[float | None] = mapped_column(Float, nullable=True)
    args: Mapped[list[Any]] = mapped_column(JSON, default=list)
    kwargs: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: ``"config"`` (``beat_schedule``, reconciled by the lease holder) or ``"runtime"`` (the API).
    origin: Mapped[str] = mapped_column(String(16), default="config")
    #: Digest of the whole definition (task, timing, args, kwargs, options, policy).
    config_hash: Mapped[str] = mapped_column(String(64), default="")
    #: The grid as data: ``{"kind": "interval", "every": s}``, crontab fields, or a solar event
    #: (see :mod:`~celery_boundedbeat.config.definitions`); beat rebuilds the schedule from it.
    timing: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: Bumped by every change of the definition: beat's cached copy is current while equal.
    version: Mapped[int] = mapped_column(BigInteger, default=1)
    #: Runs emitted from the grid (what ``max_runs`` bounds; triggers do not count).
    grid_runs: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Why the schedule is stopped: ``stop_schedule``, ``end_at`` or ``max_runs``.
    stop_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    #: Why the schedule paused itself (``pause_on_failure``); ``None`` when paused by hand.
    pause_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Failed, timed-out or lost runs since the last completed one (``pause_on_failure``).
    consecutive_failures: Mapped[int] = mapped_column(Integer, default=0)
    #: When ``schedule_failing`` was announced; ``None`` while not failing (``schedule_recovered``
    #: clears it). Kept apart from the streak, which ``resume`` resets.
    failing_since: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    stopped: Mapped[bool] = mapped_column(Boolean, default=False)
    active_runs: Mapped[int] = mapped_column(Integer, default=0)
    pending_runs: Mapped[int] = mapped_column(Integer, default=0)
    pending: Mapped[list[str]] = mapped_column(JSON, default=list)
    #: Triggered runs waiting for a slot (ISO 8601 times), apart from the grid ticks in ``pending``.
    triggers: Mapped[list[str]] = mapped_column(JSON, default=list)
    #: Backfilled grid times waiting for a slot (ISO 8601, oldest first): ``backfill`` queued them.
    backfill: Mapped[list[str]] = mapped_column(JSON, default=list)
    #: Runs to attempt again (``retry``): objects with ``scheduled_for``, ``attempt``,
    #: ``retry_of`` and ``due_at`` (ISO 8601), each waiting for its backoff and a slot.
    retries: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    #: Runs emitted again by ``retry`` (attempts 2..N): apart from ``grid_runs`` and ``max_runs``.
    retried: Mapped[int] = mapped_column(BigInteger, default=0)
    runs: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Every tick dropped: ``busy_skips + window_drops + buffer_drops`` (counted apart since
    #: migration 0006; drops from before it are in ``skips`` alone).
    skips: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Ticks dropped because every slot was busy (``missed_ticks: "skip"``).
    busy_skips: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Ticks found more than ``catchup_window`` after their time, dropped.
    window_drops: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Ticks dropped from the pending buffer (``coalesce_latest``/``catch_up`` overflow, ...).
    buffer_drops: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Active runs revoked for a newer tick (``missed_ticks: "replace"``).
    replaced: Mapped[int] = mapped_column(BigInteger, default=0)
    overlaps: Mapped[int] = mapped_column(BigInteger, default=0)
    failures: Mapped[int] = mapped_column(BigInteger, default=0)
    last_drift_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    last_elapsed_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_elapsed_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    grid_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    next_due_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, index=True)
    last_finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class RunRow(Base):
    """One emitted run and its whole life; ``(schedule, scheduled_for, attempt)`` is emitted once."""

    __tablename__ = "boundedbeat_runs"
    __table_args__ = (
        UniqueConstraint("schedule", "scheduled_for", "attempt"),
        Index("ix_boundedbeat_runs_state_started_at", "state", "started_at"),
        Index("ix_boundedbeat_runs_finished_at", "finished_at"),
        Index("ix_boundedbeat_runs_enqueued_at", "enqueued_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    schedule: Mapped[str] = mapped_column(String(MAX_SCHEDULE_NAME))
    #: The incarnation of ``schedule`` that emitted the run (``boundedbeat_schedules.incarnation``);
    #: ``None`` for runs from before migration 0009 that could not be attributed (they settle
    #: onto the schedule of their name, as before).
    incarnation: Mapped[str | None] = mapped_column(String(36), nullable=True)
    task: Mapped[str] = mapped_column(String(MAX_TASK_NAME))
    state: Mapped[str] = mapped_column(String(16))
    scheduled_for: Mapped[datetime] = mapped_column(UTCDateTime)
    enqueued_at: Mapped[datetime] = mapped_column(UTCDateTime)
    published_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    elapsed_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    drift_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Internal: the worker process (``host:pid``) whose heartbeat vouches for this run.
    process: Mapped[str | None] = mapped_column(String(255), nullable=True)
    #: Internal: when the run passes ``max_run_time`` (set when it starts).
    deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    #: 1 for the first run of a grid time; 2.. for the attempts of the ``retry`` policy key.
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    #: The run this one attempts again (``retry``); ``None`` for a first attempt.
    retry_of: Mapped[str | None] = mapped_column(String(36), nullable=True)


class QueueRow(Base):
    """A message waiting to be published (the DB-backed queue / transactional outbox)."""

    __tablename__ = "boundedbeat_queue"
    # Free space on each page keeps claims heap-only updates (migration 0002).
    __table_args__ = (
        Index("ix_boundedbeat_queue_due_at_id", "due_at", "id"),
        {"postgresql_with": {"fillfactor": 40}},
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str | None] = mapped_column(String(36), nullable=True, unique=True)
    task_id: Mapped[str] = mapped_column(String(MAX_TASK_ID))
    task: Mapped[str] = mapped_column(String(MAX_TASK_NAME))
    args: Mapped[list[Any]] = mapped_column(JSON, default=list)
    kwargs: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    due_at: Mapped[datetime] = mapped_column(UTCDateTime)
    enqueued_at: Mapped[datetime] = mapped_column(UTCDateTime)
    claimed_by: Mapped[str | None] = mapped_column(String(255), nullable=True)
    claimed_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)


class OutboxExpiredRow(Base):
    """An ``enqueue()`` message not published within ``boundedbeat_publish_timeout``.

    An application's message is data: past the timeout it leaves the queue (so it stops
    holding the dispatcher, whatever kept it from the broker) and is kept here, whole, for
    an operator to look at and queue again. Nothing deletes these rows but the user.
    """

    __tablename__ = "boundedbeat_outbox_expired"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(String(36), index=True)
    task: Mapped[str] = mapped_column(String(MAX_TASK_NAME))
    args: Mapped[list[Any]] = mapped_column(JSON, default=list)
    kwargs: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    enqueued_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    #: Publish attempts (claims) it had, and the broker's last refusal, as the queue row had them.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)


class LeaseRow(Base):
    """The beat leader lease: only its holder ticks, dispatches and reaps."""

    __tablename__ = "boundedbeat_leases"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    renewed_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class WorkerRow(Base):
    """A worker process's heartbeat: one row per process, refreshed while it runs tasks."""

    __tablename__ = "boundedbeat_workers"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class IterationRow(Base):
    """A failed background-loop iteration, kept for operators (``run_recorded_task_iteration``)."""

    __tablename__ = "boundedbeat_iterations"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    loop: Mapped[str] = mapped_column(String(64))
    holder: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class AlertRow(Base):
    """An alert signal to send, written with the change it announces (internal).

    The settle or tick that makes a transition writes its row in the same transaction, in
    whichever process that is (a worker, the reaper); the beat holding the lease takes the
    rows out and sends the signals after that commit (:mod:`~celery_boundedbeat.signals`).
    """

    __tablename__ = "boundedbeat_alerts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(32))
    schedule: Mapped[str] = mapped_column(String(MAX_SCHEDULE_NAME))
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    run_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    count: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    since: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


metadata = Base.metadata
