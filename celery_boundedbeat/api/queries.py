"""Read models for ``status``/``history`` and the Python API (``snapshot``, ``history``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

from celery import Celery

from ..config.settings import Settings
from ..core.enums import RunState
from ..core.partitions import partition_of
from ..db.definition_writes import stored_zone
from ..db.engine import get_engine
from ..db.lease import LEASE_NAME
from ..db.partitions import PartitionRows
from ..db.store import Store, utcnow
from ..db.tables import RunRow, ScheduleRow
from .unmigrated import explains_missing_tables


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSnapshot:
    """One schedule's state and metrics (after ``ScheduledTaskSnapshot``)."""

    name: str
    task: str
    mode: str
    schedule: str
    paused: bool
    stopped: bool
    running: bool
    active_runs: int
    pending_runs: int
    runs: int
    #: Every tick dropped: ``busy_skips + window_drops + buffer_drops`` (for drops counted since
    #: migration 0006; earlier ones are in ``skips`` alone).
    skips: int
    #: Ticks dropped because every slot was busy (Temporal's ``overlap_skipped``).
    busy_skips: int
    #: Ticks found past ``catchup_window`` and dropped (Temporal's ``missed_catchup_window``).
    window_drops: int
    #: Ticks dropped from the pending buffer: ``coalesce_latest``/``catch_up`` overflow, a smaller
    #: bound after a change, an end with ticks still pending (Temporal's ``buffer_dropped``).
    buffer_drops: int
    #: Active runs revoked to make room for a newer tick (``missed_ticks: "replace"``).
    replaced: int
    overlaps: int
    failures: int
    last_drift_ms: int | None
    last_elapsed_ms: int | None
    max_elapsed_ms: int | None
    next_due_at: datetime | None
    last_finished_at: datetime | None
    updated_at: datetime
    #: ``"config"`` (``beat_schedule``) or ``"runtime"`` (added through the API or CLI).
    origin: str
    #: ``stop_schedule``, ``end_at`` or ``max_runs`` while stopped or ending, else ``None``.
    stop_reason: str | None
    #: Why the schedule paused itself (``pause_on_failure``); ``None`` when paused by hand.
    pause_reason: str | None
    #: Grid runs emitted so far (what ``max_runs`` bounds).
    grid_runs: int
    #: The definition's version: bumped by every change.
    version: int
    #: The IANA zone a crontab (or solar) schedule keeps wall-clock time in; ``None`` for an interval.
    timezone: str | None = None
    #: This incarnation of the name (``boundedbeat_schedules.incarnation``): a schedule removed
    #: and added again under the same name has another one, and its runs settle only onto it.
    incarnation: str | None = None
    #: Runs emitted again by the ``retry`` policy key (attempts 2..N), apart from ``grid_runs``.
    retried: int = 0
    #: Attempts waiting for their backoff or a free slot (also counted in ``pending_runs``).
    retries_waiting: int = 0
    #: The partition the schedule belongs to (``slot % boundedbeat_partitions``; 0 with one).
    partition: int = 0
    #: The beat that ticks it now: its partition's owner, or the lease holder with one
    #: partition (``None``: no live beat holds it).
    owner: str | None = None

    @classmethod
    def from_row(cls, row: ScheduleRow) -> ScheduleSnapshot:
        return cls(
            name=row.name,
            task=row.task,
            mode=row.mode,
            schedule=row.schedule,
            paused=row.paused,
            stopped=row.stopped,
            running=row.active_runs > 0,
            active_runs=row.active_runs,
            pending_runs=row.pending_runs,
            runs=row.runs,
            skips=row.skips,
            busy_skips=row.busy_skips or 0,
            window_drops=row.window_drops or 0,
            buffer_drops=row.buffer_drops or 0,
            replaced=row.replaced or 0,
            overlaps=row.overlaps,
            failures=row.failures,
            last_drift_ms=row.last_drift_ms,
            last_elapsed_ms=row.last_elapsed_ms,
            max_elapsed_ms=row.max_elapsed_ms,
            next_due_at=None if (row.paused or row.stopped) else row.next_due_at,
            last_finished_at=row.last_finished_at,
            updated_at=row.updated_at,
            origin=row.origin,
            stop_reason=row.stop_reason,
            pause_reason=row.pause_reason,
            grid_runs=row.grid_runs or 0,
            version=row.version or 1,
            timezone=stored_zone(row),
            incarnation=row.incarnation,
            retried=row.retried or 0,
            retries_waiting=len(row.retries or ()),
        )

    def to_json(self) -> dict[str, Any]:
        return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRecord:
    """One run from the history table."""

    id: str
    schedule: str
    task: str
    state: RunState
    scheduled_for: datetime
    enqueued_at: datetime
    published_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    elapsed_ms: int | None
    drift_ms: int | None
    worker: str | None
    error: str | None
    #: The incarnation of ``schedule`` that emitted the run (``None``: from before migration 0009).
    incarnation: str | None = None
    #: 1 for the first run of its grid time; 2.. for the attempts of the ``retry`` policy key.
    attempt: int = 1
    #: The run this one attempts again (``retry``).
    retry_of: str | None = None

    @classmethod
    def from_row(cls, row: RunRow) -> RunRecord:
        return cls(
            id=row.id,
            schedule=row.schedule,
            task=row.task,
            state=RunState(row.state),
            scheduled_for=row.scheduled_for,
            enqueued_at=row.enqueued_at,
            published_at=row.published_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            elapsed_ms=row.elapsed_ms,
            drift_ms=row.drift_ms,
            worker=row.worker,
            error=row.error,
            incarnation=row.incarnation,
            attempt=row.attempt or 1,
            retry_of=row.retry_of,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, RunState):
                value = value.value
            out[key] = value
        return out


def store_for(app: Celery) -> Store:
    """The store configured for ``app`` (no beat needed)."""
    return Store(get_engine(Settings.from_conf(app.conf).database_url))


@explains_missing_tables
def snapshot(app: Celery, names: list[str] | None = None) -> list[ScheduleSnapshot]:
    """All schedules (or the chosen ``names``), sorted by name, each with its partition and owner."""
    store = store_for(app)
    count = Settings.from_conf(app.conf, only=("partitions",)).partitions
    owners = _owners(store, count)
    return [
        replace(
            ScheduleSnapshot.from_row(r), partition=(p := partition_of(r.slot, count)), owner=owners.get(p)
        )
        for r in store.schedules(names)
    ]


def _owners(store: Store, count: int) -> dict[int, str]:
    """Each partition's live owner; with one partition, the lease holder owns partition 0."""
    now = utcnow()
    if count <= 1:
        holder = store.lease_holder(LEASE_NAME, now)
        return {} if holder is None else {0: holder[0]}
    return PartitionRows(store.db).owners(now)


@dataclass(frozen=True, kw_only=True, slots=True)
class BeatRecord:
    """One live beat (``boundedbeat beats``): its id and the partitions it ticks."""

    id: str
    partitions: list[int] = field(default_factory=list)
    #: Whether it holds the beat lease (it reconciles ``beat_schedule`` and does the housekeeping).
    leader: bool = False
    joined_at: datetime | None = None
    renewed_at: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(self).items()}


@explains_missing_tables
def beats(app: Celery) -> list[BeatRecord]:
    """The live beats with the partitions each owns, the lease holder first.

    With one partition only the lease holder is known (standbys write nothing): it owns
    partition 0. With more, every beat's member row lists it, with no partition between a
    join and its first claim.
    """
    store = store_for(app)
    count = Settings.from_conf(app.conf, only=("partitions",)).partitions
    now = utcnow()
    holder = store.lease_holder(LEASE_NAME, now)
    leader = None if holder is None else holder[0]
    if count <= 1:
        return [] if leader is None else [BeatRecord(id=leader, partitions=[0], leader=True)]
    rows = PartitionRows(store.db)
    owned: dict[str, list[int]] = {}
    for partition, owner in sorted(rows.owners(now).items()):
        owned.setdefault(owner, []).append(partition)
    found = [
        BeatRecord(id=m, partitions=owned.get(m, []), leader=m == leader, joined_at=j, renewed_at=r)
        for m, j, r in rows.members(now)
    ]
    return sorted(found, key=lambda b: not b.leader)


@explains_missing_tables
def history(
    app: Celery,
    name: str | None = None,
    limit: int = 100,
    state: str | RunState | None = None,
    since: datetime | None = None,
) -> list[RunRecord]:
    """Runs, newest first, optionally for one schedule and/or one state."""
    if state is not None:
        state = RunState(state)
    rows = store_for(app).runs(name=name, limit=limit, state=state.value if state else None, since=since)
    return [RunRecord.from_row(r) for r in rows]
