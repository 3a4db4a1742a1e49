"""Prometheus metrics: one snapshot of the tables, turned into metric families.

:func:`read_snapshot` reads everything a scrape shows in one transaction of five cheap
queries (the schedule rows, the failure states grouped by schedule on the ``state`` index,
the queue's size and oldest due time, the lease row, and the runs finished within
:data:`HISTOGRAM_WINDOW` on the ``finished_at`` index). :class:`SnapshotCollector` serves the
latest snapshot without touching the database, so a scrape never slows the tick and costs the
same however often Prometheus comes (beat refreshes the snapshot in the background, see
:mod:`.exporter`; ``status --format prometheus`` reads one and prints it).

Where each number comes from:

- ``boundedbeat_schedule_runs_total{state="completed"}`` is the schedule's ``runs`` counter
  and ``boundedbeat_schedule_failures_total`` its ``failures`` counter: kept on the schedule
  row, monotonic, and untouched by retention. The other terminal states are counted from
  ``boundedbeat_runs`` (grouped on the ``state`` index, cheap while failures are rare), so a
  retention purge of old failed runs shows as a counter reset of those series.
- The duration and drift histograms are *gauge histograms* of the runs finished in the last
  :data:`HISTOGRAM_WINDOW` seconds (at most :data:`HISTOGRAM_MAX_RUNS`, the newest): read
  them with ``histogram_quantile`` directly, without ``rate()``.
- ``boundedbeat_last_tick_timestamp_seconds`` is the lease row's ``renewed_at``: the holder
  renews it from its tick loop (see :mod:`.health`).
- ``boundedbeat_schedule_unstarted_runs`` counts the published runs no worker started within
  ``boundedbeat_unstarted_warning`` (:mod:`celery_boundedbeat.core.unstarted`): a seventh query,
  on the ``(state, started_at)`` index.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import Connection, Engine, func, select

from ..core.enums import RunState
from ..core.unstarted import DEFAULT_UNSTARTED_WARNING, Unstarted
from ..db.lease import LEASE_NAME
from ..db.partitions import PARTITION_PREFIX
from ..db.tables import LeaseRow, OutboxExpiredRow, QueueRow, RunRow, ScheduleRow
from ..db.unstarted import read_unstarted

#: Runs finished this many seconds before the snapshot feed the histograms.
HISTOGRAM_WINDOW = 3600.0
#: The newest this-many of those runs at most (one bounded index range read).
HISTOGRAM_MAX_RUNS = 10_000
#: Upper bounds (seconds) of the run duration buckets: from sub-second tasks to an hour.
DURATION_BUCKETS: tuple[float, ...] = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 1800, 3600)
#: Upper bounds (seconds) of the drift buckets: how late a run was emitted after its grid time.
DRIFT_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: Terminal states counted from the runs table (``completed`` comes from the schedule counter).
FAILURE_STATES: tuple[str, ...] = tuple(s.value for s in RunState if s.counts_as_failure)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleFigures:
    """One schedule row's numbers."""

    name: str
    runs: int
    failures: int
    skips: int
    overlaps: int
    active_runs: int
    pending_runs: int
    last_drift_ms: int | None
    paused: bool
    stopped: bool
    #: What dropped the ``skips``, and the runs ``replace`` revoked (migration 0006).
    busy_skips: int = 0
    window_drops: int = 0
    buffer_drops: int = 0
    replaced: int = 0
    #: Runs emitted again by the ``retry`` policy key (migration 0010).
    retried: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Distribution:
    """Observations sorted into buckets: cumulative counts per upper bound, ``+Inf`` last."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return self.cumulative[-1] if self.cumulative else 0


def distribution(values: Iterable[float], bounds: Sequence[float]) -> Distribution:
    """Bucket ``values`` (a value equal to a bound falls in that bound's bucket, as Prometheus)."""
    per_bucket = [0] * (len(bounds) + 1)
    total = 0.0
    for value in values:
        per_bucket[bisect.bisect_left(bounds, value)] += 1
        total += value
    cumulative: list[int] = []
    running = 0
    for n in per_bucket:
        running += n
        cumulative.append(running)
    return Distribution(bounds=tuple(bounds), cumulative=tuple(cumulative), total=total)


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricsSnapshot:
    """Everything a scrape shows, read at ``taken_at``."""

    taken_at: datetime
    schedules: tuple[ScheduleFigures, ...] = ()
    #: ``(schedule, failure state) -> runs`` in ``boundedbeat_runs``.
    settled: Mapping[tuple[str, str], int] = field(default_factory=dict)
    queue_depth: int = 0
    queue_oldest_due_at: datetime | None = None
    #: Rows in ``boundedbeat_outbox_expired``: ``enqueue()`` messages never published.
    outbox_expired: int = 0
    lease_holder: str | None = None
    lease_renewed_at: datetime | None = None
    lease_expires_at: datetime | None = None
    #: Per schedule, over the runs finished in the window.
    durations: Mapping[str, Distribution] = field(default_factory=dict)
    drifts: Mapping[str, Distribution] = field(default_factory=dict)
    #: Per schedule, the published runs no worker started within ``boundedbeat_unstarted_warning``.
    unstarted: tuple[Unstarted, ...] = ()
    #: Partitioned beats: how many partitions each live beat holds (empty with one partition).
    partitions_by_beat: Mapping[str, int] = field(default_factory=dict)

    @property
    def lease_live(self) -> bool:
        """Whether some beat held the lease when the snapshot was taken."""
        return self.lease_expires_at is not None and self.lease_expires_at > self.taken_at

    @property
    def queue_oldest_age(self) -> float:
        """Seconds the oldest queued message was overdue (0: empty, or nothing due yet)."""
        if self.queue_oldest_due_at is None:
            return 0.0
        return max((self.taken_at - self.queue_oldest_due_at).total_seconds(), 0.0)


# -- the read --------------------------------------------------------------------------------


def read_snapshot(
    engine: Engine, now: datetime, unstarted_after: float | None = DEFAULT_UNSTARTED_WARNING
) -> MetricsSnapshot:
    """One consistent-enough look at the tables: seven indexed or bounded queries, one transaction.

    ``unstarted_after``: ``boundedbeat_unstarted_warning`` (``None`` or 0: not read).
    """
    with engine.connect() as conn:
        schedules = _schedules(conn)
        settled = {
            (row[0], row[1]): int(row[2])
            for row in conn.execute(
                select(RunRow.schedule, RunRow.state, func.count())
                .where(RunRow.state.in_(FAILURE_STATES))
                .group_by(RunRow.schedule, RunRow.state)
            )
        }
        depth, oldest = conn.execute(select(func.count(), func.min(QueueRow.due_at))).one()
        expired = conn.scalar(select(func.count()).select_from(OutboxExpiredRow))
        lease = conn.execute(
            select(LeaseRow.holder, LeaseRow.renewed_at, LeaseRow.expires_at).where(
                LeaseRow.name == LEASE_NAME
            )
        ).first()
        durations, drifts = _recent(conn, now)
        unstarted = read_unstarted(conn, now, unstarted_after)
        by_beat = conn.execute(
            select(LeaseRow.holder, func.count())
            .where(LeaseRow.name.startswith(PARTITION_PREFIX), LeaseRow.expires_at > now)
            .group_by(LeaseRow.holder)
        )
        partitions_by_beat = {str(holder): int(count) for holder, count in by_beat}
    return MetricsSnapshot(
        taken_at=now,
        schedules=schedules,
        settled=settled,
        queue_depth=int(depth or 0),
        queue_oldest_due_at=oldest,
        outbox_expired=int(expired or 0),
        lease_holder=None if lease is None else lease[0],
        lease_renewed_at=None if lease is None else lease[1],
        lease_expires_at=None if lease is None else lease[2],
        durations=durations,
        drifts=drifts,
        unstarted=unstarted,
        partitions_by_beat=partitions_by_beat,
    )


def _schedules(conn: Connection) -> tuple[ScheduleFigures, ...]:
    query = select(
        ScheduleRow.name,
        ScheduleRow.runs,
        ScheduleRow.failures,
        ScheduleRow.skips,
        ScheduleRow.busy_skips,
        ScheduleRow.window_drops,
        ScheduleRow.buffer_drops,
        ScheduleRow.replaced,
        ScheduleRow.retried,
        ScheduleRow.overlaps,
        ScheduleRow.active_runs,
        ScheduleRow.pending_runs,
        ScheduleRow.last_drift_ms,
        ScheduleRow.paused,
        ScheduleRow.stopped,
    ).order_by(ScheduleRow.name)
    return tuple(
        ScheduleFigures(
            name=r.name,
            runs=r.runs,
            failures=r.failures,
            skips=r.skips,
            busy_skips=r.busy_skips,
            window_drops=r.window_drops,
            buffer_drops=r.buffer_drops,
            replaced=r.replaced,
            retried=r.retried,
            overlaps=r.overlaps,
            active_runs=r.active_runs,
            pending_runs=r.pending_runs,
            last_drift_ms=r.last_drift_ms,
            paused=bool(r.paused),
            stopped=bool(r.stopped),
        )
        for r in conn.execute(query)
    )


def _recent(conn: Connection, now: datetime) -> tuple[dict[str, Distribution], dict[str, Distribution]]:
    """Duration and drift distributions per schedule over the runs finished in the window."""
    rows = conn.execute(
        select(RunRow.schedule, RunRow.elapsed_ms, RunRow.drift_ms)
        .where(RunRow.finished_at >= now - timedelta(seconds=HISTOGRAM_WINDOW))
        .order_by(RunRow.finished_at.desc())
        .limit(HISTOGRAM_MAX_RUNS)
    )
    elapsed: dict[str, list[float]] = {}
    drift: dict[str, list[float]] = {}
    for schedule, elapsed_ms, drift_ms in rows:
        if elapsed_ms is not None:
            elapsed.setdefault(schedule, []).append(elapsed_ms / 1000)
        if drift_ms is not None:
            drift.setdefault(schedule, []).append(max(drift_ms, 0) / 1000)
    return (
        {name: distribution(values, DURATION_BUCKETS) for name, values in elapsed.items()},
        {name: distribution(values, DRIFT_BUCKETS) for name, values in drift.items()},
    )


# -- the families ----------------------------------------------------------------------------


class SnapshotCollector(Collector):
    """The metric families of the latest snapshot; a scrape reads memory only.

    ``snapshot`` returns the latest snapshot (``None`` before the first one). ``leader``
    answers ``boundedbeat_leader`` for the beat serving the endpoint (whether *it* holds the
    lease, asked at scrape time); without it the snapshot's lease row answers (any live beat).
    """

    def __init__(
        self,
        snapshot: Callable[[], MetricsSnapshot | None],
        *,
        leader: Callable[[], bool] | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._leader = leader

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        leader = self._leader() if self._leader is not None else bool(snap and snap.lease_live)
        yield _gauge("boundedbeat_leader", "1 when this beat holds the lease (CLI: any beat)", leader)
        if snap is None:
            return
        yield from _schedule_families(snap)
        yield from _histograms(snap)
        yield _gauge("boundedbeat_queue_depth", "Messages waiting in boundedbeat_queue", snap.queue_depth)
        yield _gauge(
            "boundedbeat_queue_oldest_age_seconds",
            "Seconds the oldest queued message is overdue (0 when none is)",
            snap.queue_oldest_age,
        )
        yield CounterMetricFamily(
            "boundedbeat_outbox_expired",
            "enqueue() messages not published within boundedbeat_publish_timeout, kept in "
            "boundedbeat_outbox_expired (never sent)",
            value=snap.outbox_expired,
        )
        if snap.lease_renewed_at is not None:
            yield _gauge(
                "boundedbeat_last_tick_timestamp_seconds",
                "Unix time of the lease holder's last tick (its last lease renewal)",
                snap.lease_renewed_at.timestamp(),
            )
        if snap.partitions_by_beat:
            owned = GaugeMetricFamily(
                "boundedbeat_beat_partitions",
                "Partitions each live beat ticks (partitioned beats)",
                labels=["beat"],
            )
            for beat, count in sorted(snap.partitions_by_beat.items()):
                owned.add_metric([beat], float(count))
            yield owned
        yield _gauge(
            "boundedbeat_metrics_snapshot_timestamp_seconds",
            "Unix time the metrics were read from the database",
            snap.taken_at.timestamp(),
        )


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))


#: The per-schedule counters (``boundedbeat_schedule_<key>_total``): the schedule row's columns.
SCHEDULE_COUNTERS: Mapping[str, str] = {
    "failures": "Runs settled in a failure state",
    "skips": "Ticks dropped, whatever dropped them (busy slots, catchup_window, the pending buffer)",
    "busy_skips": "Ticks dropped because every slot was busy",
    "window_drops": "Ticks dropped because they were found past catchup_window",
    "buffer_drops": "Ticks dropped from the pending buffer (coalesce_latest, catch_up)",
    "replaced": "Active runs revoked for a newer tick (missed_ticks replace)",
    "overlaps": "Runs started while another was active",
    "retried": "Runs emitted again by the retry policy (attempts 2 and later)",
}


def _schedule_families(snap: MetricsSnapshot) -> Iterator[Metric]:
    """The per-schedule counters and gauges (every terminal state present, zeros included)."""
    runs = CounterMetricFamily(
        "boundedbeat_schedule_runs", "Runs settled, by terminal state", labels=["schedule", "state"]
    )
    counters = {
        key: CounterMetricFamily(f"boundedbeat_schedule_{key}", doc, labels=["schedule"])
        for key, doc in SCHEDULE_COUNTERS.items()
    }
    gauges = {
        "active_runs": GaugeMetricFamily(
            "boundedbeat_schedule_active_runs", "Runs queued, published or started", labels=["schedule"]
        ),
        "pending_runs": GaugeMetricFamily(
            "boundedbeat_schedule_pending_runs", "Ticks waiting for a free slot", labels=["schedule"]
        ),
        "paused": GaugeMetricFamily("boundedbeat_schedule_paused", "1 when paused", labels=["schedule"]),
        "stopped": GaugeMetricFamily("boundedbeat_schedule_stopped", "1 when stopped", labels=["schedule"]),
    }
    unstarted = GaugeMetricFamily(
        "boundedbeat_schedule_unstarted_runs",
        "Published runs no worker started within boundedbeat_unstarted_warning (a queue nobody consumes?)",
        labels=["schedule"],
    )
    waiting = {u.schedule: u.runs for u in snap.unstarted}
    drift = GaugeMetricFamily(
        "boundedbeat_schedule_last_drift_seconds",
        "How late the last run was emitted after its grid time",
        labels=["schedule"],
    )
    for s in snap.schedules:
        runs.add_metric([s.name, RunState.COMPLETED.value], s.runs)
        for state in FAILURE_STATES:
            runs.add_metric([s.name, state], snap.settled.get((s.name, state), 0))
        for key, family in counters.items():
            family.add_metric([s.name], getattr(s, key))
        for key, gauge in gauges.items():
            gauge.add_metric([s.name], float(getattr(s, key)))
        unstarted.add_metric([s.name], float(waiting.get(s.name, 0)))
        if s.last_drift_ms is not None:
            drift.add_metric([s.name], max(s.last_drift_ms, 0) / 1000)
    yield runs
    yield from counters.values()
    yield from gauges.values()
    yield unstarted
    yield drift


def _histograms(snap: MetricsSnapshot) -> Iterator[Metric]:
    window = f"runs finished in the last {HISTOGRAM_WINDOW:g} s"
    for name, doc, per_schedule in (
        ("boundedbeat_run_duration_seconds", f"Run duration (elapsed) of {window}", snap.durations),
        ("boundedbeat_run_drift_seconds", f"Drift (emitted after the grid time) of {window}", snap.drifts),
    ):
        family = GaugeHistogramMetricFamily(name, doc, labels=["schedule"])
        for schedule, dist in sorted(per_schedule.items()):
            family.add_metric([schedule], _buckets(dist), dist.total)
        yield family


def _buckets(dist: Distribution) -> list[tuple[str, float]]:
    bounds = [str(float(b)) for b in dist.bounds] + ["+Inf"]  # "0.1", "1.0": as the client writes them
    return [(le, float(n)) for le, n in zip(bounds, dist.cumulative, strict=True)]


def exposition(snapshot: MetricsSnapshot) -> str:
    """The snapshot in the Prometheus text format (what ``status --format prometheus`` prints)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return generate_latest(registry).decode("utf-8")
