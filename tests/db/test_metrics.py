"""Prometheus metrics: buckets, the collector's exposition (parsed back), the read, the endpoint."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from celery_boundedbeat.beat.exporter import MetricsExporter, serve_metrics
from celery_boundedbeat.cli import boundedbeat
from celery_boundedbeat.config.settings import Settings
from celery_boundedbeat.core.exceptions import ConfigurationError
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.lease import LEASE_NAME
from celery_boundedbeat.db.tables import LeaseRow, QueueRow, RunRow, ScheduleRow
from celery_boundedbeat.ops.metrics import (
    DRIFT_BUCKETS,
    DURATION_BUCKETS,
    MetricsSnapshot,
    ScheduleFigures,
    SnapshotCollector,
    distribution,
    exposition,
    read_snapshot,
)

NOW = datetime(2026, 12, 1, 6, 0, 0, tzinfo=UTC)
TERMINAL = {"completed", "failed", "timed_out", "revoked", "rejected", "lost"}


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def figures(name: str, **values: int | bool | None) -> ScheduleFigures:
    base: dict[str, int | bool | None] = {
        "runs": 0, "failures": 0, "skips": 0, "overlaps": 0, "active_runs": 0, "pending_runs": 0,
        "last_drift_ms": None, "paused": False, "stopped": False,
    }  # fmt: skip
    base.update(values)
    return ScheduleFigures(name=name, **base)  # type: ignore[arg-type]


SNAPSHOT = MetricsSnapshot(
    taken_at=NOW,
    schedules=(
        figures(
            "report",
            runs=7,
            failures=3,
            skips=4,
            overlaps=1,
            active_runs=1,
            pending_runs=2,
            last_drift_ms=250,
        ),
        figures("quiet", paused=True),
    ),
    settled={("report", "failed"): 2, ("report", "lost"): 1},
    queue_depth=5,
    queue_oldest_due_at=NOW - _s(12.5),
    lease_holder="h:1:a",
    lease_renewed_at=NOW - _s(2),
    lease_expires_at=NOW + _s(13),
    durations={"report": distribution([0.05, 1.0, 2.0, 7200.0], DURATION_BUCKETS)},
    drifts={"report": distribution([0.0, 0.3], DRIFT_BUCKETS)},
)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, parsed back by prometheus_client's own parser."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(parsed: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return parsed[(name, tuple(sorted(labels.items())))]


def test_a_value_on_a_bound_falls_in_that_bucket_and_counts_are_cumulative() -> None:
    """As Prometheus's ``le``: 1.0 is in the 1.0 bucket; the last count is the total."""
    dist = distribution([0.5, 1.0, 1.5, 99.0], (1.0, 2.0))
    assert dist.cumulative == (2, 3, 4) and dist.count == 4 and dist.total == 102.0


def test_the_exposition_carries_every_family_with_the_snapshot_values() -> None:
    """Parsed back: counters per terminal state (zeros too), gauges, queue, lease and tick time."""
    text = exposition(SNAPSHOT)
    parsed = samples(text)
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["boundedbeat_schedule_runs"] == "counter"
    assert types["boundedbeat_run_duration_seconds"] == "histogram"  # a gauge histogram in 0.0.4 text
    runs = {
        state: value(parsed, "boundedbeat_schedule_runs_total", schedule="report", state=state)
        for state in TERMINAL
    }
    assert runs == {"completed": 7, "failed": 2, "lost": 1, "timed_out": 0, "revoked": 0, "rejected": 0}
    assert value(parsed, "boundedbeat_schedule_runs_total", schedule="quiet", state="failed") == 0
    assert value(parsed, "boundedbeat_schedule_failures_total", schedule="report") == 3
    assert value(parsed, "boundedbeat_schedule_skips_total", schedule="report") == 4
    assert value(parsed, "boundedbeat_schedule_overlaps_total", schedule="report") == 1
    assert value(parsed, "boundedbeat_schedule_active_runs", schedule="report") == 1
    assert value(parsed, "boundedbeat_schedule_pending_runs", schedule="report") == 2
    assert value(parsed, "boundedbeat_schedule_last_drift_seconds", schedule="report") == 0.25
    assert ("boundedbeat_schedule_last_drift_seconds", (("schedule", "quiet"),)) not in parsed
    assert value(parsed, "boundedbeat_schedule_paused", schedule="quiet") == 1
    assert value(parsed, "boundedbeat_schedule_stopped", schedule="quiet") == 0
    assert value(parsed, "boundedbeat_queue_depth") == 5
    assert value(parsed, "boundedbeat_queue_oldest_age_seconds") == 12.5
    assert value(parsed, "boundedbeat_last_tick_timestamp_seconds") == (NOW - _s(2)).timestamp()
    assert value(parsed, "boundedbeat_metrics_snapshot_timestamp_seconds") == NOW.timestamp()
    assert value(parsed, "boundedbeat_leader") == 1  # from the CLI: the lease is live


def test_the_histograms_count_recent_runs_per_bucket() -> None:
    """Duration buckets are cumulative up to +Inf; the gauge-histogram count and sum come along."""
    parsed = samples(exposition(SNAPSHOT))
    bucket = "boundedbeat_run_duration_seconds_bucket"
    assert value(parsed, bucket, schedule="report", le="0.1") == 1
    assert value(parsed, bucket, schedule="report", le="1.0") == 2
    assert value(parsed, bucket, schedule="report", le="2.5") == 3
    assert value(parsed, bucket, schedule="report", le="3600.0") == 3
    assert value(parsed, bucket, schedule="report", le="+Inf") == 4
    assert value(parsed, "boundedbeat_run_duration_seconds_gcount", schedule="report") == 4
    assert value(parsed, "boundedbeat_run_duration_seconds_gsum", schedule="report") == 7203.05
    assert value(parsed, "boundedbeat_run_drift_seconds_bucket", schedule="report", le="0.01") == 1
    assert value(parsed, "boundedbeat_run_drift_seconds_bucket", schedule="report", le="0.5") == 2


def test_an_expired_lease_means_no_leader_from_the_cli() -> None:
    """The CLI's leader is 1 only while some beat's lease is live."""
    expired = MetricsSnapshot(taken_at=NOW, lease_holder="h:1:a", lease_expires_at=NOW - _s(1))
    assert value(samples(exposition(expired)), "boundedbeat_leader") == 0


def collect(collector: SnapshotCollector) -> list[Metric]:
    return list(collector.collect())


def test_the_beats_own_endpoint_says_whether_it_holds_the_lease() -> None:
    """On beat's endpoint ``leader`` asks the beat at scrape time, whatever the lease row says."""
    standby = SnapshotCollector(lambda: SNAPSHOT, leader=lambda: False)
    leader = next(m for m in collect(standby) if m.name == "boundedbeat_leader")
    assert leader.samples[0].value == 0


def test_before_the_first_snapshot_only_the_leader_is_shown() -> None:
    """No snapshot yet (first read pending or failing): no invented zeros, only ``leader``."""
    metrics = collect(SnapshotCollector(lambda: None, leader=lambda: True))
    assert [(m.name, m.samples[0].value) for m in metrics] == [("boundedbeat_leader", 1.0)]


def test_a_scrape_reads_no_database() -> None:
    """The collector only calls its snapshot function: a scrape is memory only."""
    calls: list[int] = []

    def latest() -> MetricsSnapshot:
        calls.append(1)
        return SNAPSHOT

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(latest, leader=lambda: True))
    for _ in range(3):
        generate_latest(registry)
    assert len(calls) == 3


# -- the read, on SQLite and PostgreSQL ------------------------------------------------------


def schedule_row(name: str, **values: object) -> ScheduleRow:
    return ScheduleRow(
        name=name, task="proj.t", mode="fixed_rate_no_overlap", policy={}, schedule="every 60s",
        created_at=NOW, updated_at=NOW, **values,
    )  # fmt: skip


def run_row(n: int, schedule: str, state: str, **values: object) -> RunRow:
    return RunRow(
        id=f"00000000-0000-0000-0000-{n:012d}", schedule=schedule, task="proj.t", state=state,
        scheduled_for=NOW - _s(1000 - n), enqueued_at=NOW - _s(1000 - n), **values,
    )  # fmt: skip


def test_the_read_counts_failure_states_from_runs_and_completed_from_the_counter(migrated: Engine) -> None:
    """Counters from the schedule row, failure states grouped from the runs, queue, lease, window."""
    with Session(migrated) as s, s.begin():
        s.add(schedule_row("a", runs=40, failures=3, skips=2, active_runs=1, last_drift_ms=120))
        s.add(schedule_row("b", paused=True))
        s.add_all(
            [
                run_row(1, "a", "failed", finished_at=NOW - _s(10), elapsed_ms=1500, drift_ms=20),
                run_row(2, "a", "failed", finished_at=NOW - _s(7200), elapsed_ms=1, drift_ms=1),
                run_row(3, "a", "lost", finished_at=NOW - _s(5)),
                run_row(4, "a", "completed", finished_at=NOW - _s(3), elapsed_ms=200, drift_ms=5),
                run_row(5, "a", "started"),
            ]
        )
        s.add(LeaseRow(name=LEASE_NAME, holder="h:1:a", acquired_at=NOW, renewed_at=NOW - _s(1),
                       expires_at=NOW + _s(14)))  # fmt: skip
        for i, due in enumerate((NOW - _s(30), NOW + _s(30))):
            s.add(QueueRow(task_id=f"t{i}", task="x", args=[], kwargs={}, options={}, due_at=due,
                           enqueued_at=due, attempts=0))  # fmt: skip
    snap = read_snapshot(migrated, NOW)
    assert [s.name for s in snap.schedules] == ["a", "b"]
    a = snap.schedules[0]
    assert (a.runs, a.failures, a.skips, a.active_runs, a.last_drift_ms) == (40, 3, 2, 1, 120)
    assert snap.schedules[1].paused is True
    assert dict(snap.settled) == {("a", "failed"): 2, ("a", "lost"): 1}
    assert (snap.queue_depth, snap.queue_oldest_age) == (2, 30.0)
    assert (snap.lease_holder, snap.lease_renewed_at, snap.lease_live) == ("h:1:a", NOW - _s(1), True)
    # Only runs finished within the hour: 1500 ms and 200 ms (the 2-hour-old one is out).
    assert snap.durations["a"].count == 2 and snap.durations["a"].total == pytest.approx(1.7)
    assert snap.drifts["a"].count == 2


def test_the_read_of_an_empty_database(migrated: Engine) -> None:
    """Nothing yet: no schedules, an empty queue, no lease."""
    snap = read_snapshot(migrated, NOW)
    assert snap == MetricsSnapshot(taken_at=NOW)


# -- the endpoint and the command --------------------------------------------------------------


@pytest.fixture
def sqlite_engine(migrated_sqlite_url: str) -> Iterator[Engine]:
    engine = get_engine(migrated_sqlite_url)
    yield engine
    engine.dispose()


def test_the_endpoint_serves_the_latest_snapshot_and_closes_on_stop(sqlite_engine: Engine) -> None:
    """Port 0 binds a free port; /metrics answers from the refreshed snapshot; stop closes it."""
    with Session(sqlite_engine) as s, s.begin():
        s.add(schedule_row("a", skips=9))
    exporter = serve_metrics(
        sqlite_engine, host="127.0.0.1", port=0, refresh_interval=60, leader=lambda: True
    )
    assert exporter is not None
    try:
        assert exporter.refresh()
        port = exporter.bound_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
        parsed = samples(body)
        assert value(parsed, "boundedbeat_schedule_skips_total", schedule="a") == 9
        assert value(parsed, "boundedbeat_leader") == 1
    finally:
        exporter.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_taken_port_costs_the_metrics_not_the_beat(sqlite_engine: Engine) -> None:
    """A second endpoint on the same port logs an error and returns None instead of raising."""
    first = serve_metrics(sqlite_engine, host="127.0.0.1", port=0, refresh_interval=60, leader=lambda: True)
    assert first is not None
    try:
        second = serve_metrics(
            sqlite_engine, host="127.0.0.1", port=first.bound_port, refresh_interval=60, leader=lambda: True
        )
        assert second is None
    finally:
        first.stop()


def test_a_failed_refresh_keeps_the_previous_snapshot(sqlite_url: str) -> None:
    """A read that fails (here: no tables) returns False and leaves what a scrape shows alone."""
    exporter = MetricsExporter(get_engine(sqlite_url), refresh_interval=60, leader=lambda: False)
    assert exporter.refresh() is False and exporter.snapshot() is None


def run(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(
        boundedbeat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), catch_exceptions=False
    )


def test_status_format_prometheus_prints_the_exposition(
    migrated_sqlite_url: str, sqlite_engine: Engine
) -> None:
    """``status --format prometheus`` prints what the endpoint serves; --json and the table still work."""
    with Session(sqlite_engine) as s, s.begin():
        s.add(schedule_row("a", runs=3))
    app = Celery("metricstest", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = migrated_sqlite_url
    result = run(app, "status", "--format", "prometheus")
    assert result.exit_code == 0, result.output
    parsed = samples(result.output)
    assert value(parsed, "boundedbeat_schedule_runs_total", schedule="a", state="completed") == 3
    assert value(parsed, "boundedbeat_leader") == 0
    assert run(app, "status", "--json").output.lstrip().startswith("[")
    assert run(app, "status", "--format", "json").output == run(app, "status", "--json").output
    assert run(app, "status").output.startswith("NAME")
    refused = CliRunner().invoke(
        boundedbeat,
        ["status", "--json", "--format", "prometheus"],
        obj=CLIContext(app=app, no_color=True, workdir=None),
    )
    assert refused.exit_code == 2 and "exclude each other" in refused.output


# -- the settings --------------------------------------------------------------------------------


def test_metrics_are_off_by_default_and_bound_to_loopback() -> None:
    """No port, no endpoint; the host defaults to 127.0.0.1; the snapshot refreshes every 10 s."""
    settings = Settings.from_conf({})
    assert (settings.metrics_port, settings.metrics_host, settings.metrics_refresh_interval) == (
        None,
        "127.0.0.1",
        10.0,
    )


@pytest.mark.parametrize("port", [0, 9808, 65535])
def test_a_port_from_0_to_65535_is_accepted(port: int) -> None:
    """Port 0 asks the system for a free port (the bound one is logged)."""
    assert Settings.from_conf({"boundedbeat_metrics_port": port}).metrics_port == port


@pytest.mark.parametrize("port", [-1, 65536, "9808", 9808.0, True])
def test_anything_else_as_a_port_is_refused_naming_the_key(port: object) -> None:
    """A port out of range or of another type is a configuration error naming the key."""
    with pytest.raises(ConfigurationError) as info:
        Settings.from_conf({"boundedbeat_metrics_port": port})
    assert info.value.problems[0][1] == "boundedbeat_metrics_port"
    assert "an integer from 0 to 65535" in info.value.problems[0][2]


@pytest.mark.parametrize(
    ("key", "raw"), [("metrics_host", ""), ("metrics_host", 1), ("metrics_refresh_interval", 0)]
)
def test_an_empty_host_or_a_zero_refresh_interval_is_refused(key: str, raw: object) -> None:
    """The host must name an address; a zero refresh interval would spin the reader."""
    with pytest.raises(ConfigurationError) as info:
        Settings.from_conf({f"boundedbeat_{key}": raw})
    assert info.value.problems[0][1] == f"boundedbeat_{key}"


def lease_row(name: str, holder: str, expires: datetime) -> LeaseRow:
    return LeaseRow(name=name, holder=holder, acquired_at=NOW, renewed_at=NOW, expires_at=expires)


def test_partitioned_beats_show_how_many_partitions_each_beat_ticks(migrated: Engine) -> None:
    """``boundedbeat_beat_partitions{beat}`` from the live claims; expired claims and members do not count."""
    with Session(migrated) as s, s.begin():
        for n, holder in enumerate(["b1", "b1", "b2", "b3"]):
            expires = NOW + _s(10) if holder != "b3" else NOW - _s(1)
            claim = LeaseRow(
                name=f"partition:{n}", holder=holder, acquired_at=NOW, renewed_at=NOW, expires_at=expires
            )
            s.add(claim)
        s.add(
            LeaseRow(name="member:b1", holder="b1", acquired_at=NOW, renewed_at=NOW, expires_at=NOW + _s(10))
        )
    snap = read_snapshot(migrated, NOW)
    assert snap.partitions_by_beat == {"b1": 2, "b2": 1}
    parsed = samples(exposition(snap))
    assert value(parsed, "boundedbeat_beat_partitions", beat="b1") == 2
    assert value(parsed, "boundedbeat_beat_partitions", beat="b2") == 1
    assert not any(name == "boundedbeat_beat_partitions" for name, _ in samples(exposition(SNAPSHOT)))
