"""docs/grafana-dashboard.json queries only metrics the package exposes, and imports cleanly."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from celery_boundedbeat.ops.metrics import (
    DRIFT_BUCKETS,
    DURATION_BUCKETS,
    MetricsSnapshot,
    ScheduleFigures,
    distribution,
    exposition,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
NOW = datetime(2026, 12, 1, 6, 0, 0, tzinfo=UTC)
METRIC = re.compile(r"\bboundedbeat_[a-z_]+\b")


def exposed() -> set[str]:
    """Every sample name of an exposition with each kind of value present."""
    snapshot = MetricsSnapshot(
        taken_at=NOW,
        schedules=(
            ScheduleFigures(
                name="s",
                runs=1,
                failures=1,
                skips=1,
                overlaps=1,
                active_runs=1,
                pending_runs=1,
                last_drift_ms=5,
                paused=False,
                stopped=False,
            ),
        ),
        lease_holder="h",
        lease_renewed_at=NOW,
        lease_expires_at=NOW + timedelta(seconds=10),
        durations={"s": distribution([1.0], DURATION_BUCKETS)},
        drifts={"s": distribution([0.1], DRIFT_BUCKETS)},
    )
    families = text_string_to_metric_families(exposition(snapshot))
    return {sample.name for family in families for sample in family.samples}


def strings(node: Any) -> Iterator[tuple[str, str]]:
    """Every (key, string value) pair anywhere in the JSON document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str):
                yield key, value
            else:
                yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def test_every_metric_the_dashboard_queries_is_exposed() -> None:
    """A renamed or dropped metric cannot leave a panel querying nothing."""
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for key, text in strings(dashboard)
        if key in ("expr", "definition")
        for name in METRIC.findall(text)
    }
    assert queried, "the dashboard queries no boundedbeat metric"
    assert queried - exposed() == set()


def test_the_dashboard_covers_the_contract_metrics() -> None:
    """Each metric docs/operating.md names, and the tick and queue age, appears in some panel."""
    text = DASHBOARD.read_text()
    for name in (
        "boundedbeat_schedule_runs_total",
        "boundedbeat_schedule_skips_total",
        "boundedbeat_schedule_active_runs",
        "boundedbeat_schedule_pending_runs",
        "boundedbeat_schedule_last_drift_seconds",
        "boundedbeat_queue_depth",
        "boundedbeat_leader",
        "boundedbeat_queue_oldest_age_seconds",
        "boundedbeat_last_tick_timestamp_seconds",
        "boundedbeat_run_duration_seconds_bucket",
        "boundedbeat_run_drift_seconds_bucket",
    ):
        assert name in text, name


def test_panels_have_unique_ids_and_use_the_datasource_variable() -> None:
    """Grafana imports it as is: unique ids, a grid position, and no hard-wired datasource."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["datasource"]["uid"] == "${datasource}"
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "schedule"}
