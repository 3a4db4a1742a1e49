"""Beat's /metrics endpoint scraped while it runs: the families, values equal to SQL, loopback only."""

from __future__ import annotations

import re
import signal
import socket
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .harness import Harness
from .processes import Proc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FAMILIES = {
    "boundedbeat_leader",
    "boundedbeat_schedule_runs",
    "boundedbeat_schedule_failures",
    "boundedbeat_schedule_skips",
    "boundedbeat_schedule_overlaps",
    "boundedbeat_schedule_active_runs",
    "boundedbeat_schedule_pending_runs",
    "boundedbeat_schedule_unstarted_runs",
    "boundedbeat_schedule_paused",
    "boundedbeat_schedule_stopped",
    "boundedbeat_schedule_last_drift_seconds",
    "boundedbeat_run_duration_seconds",
    "boundedbeat_run_drift_seconds",
    "boundedbeat_queue_depth",
    "boundedbeat_queue_oldest_age_seconds",
    "boundedbeat_last_tick_timestamp_seconds",
    "boundedbeat_metrics_snapshot_timestamp_seconds",
}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def endpoint(proc: Proc) -> str:
    """The URL the beat logged when its endpoint started (port 0: the system picked it)."""
    found = re.search(r"serving Prometheus metrics on (http://\S+/metrics)", proc.output())
    assert found, proc.tail()
    return found.group(1)


def scrape(url: str) -> tuple[set[str], Samples]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    families = list(text_string_to_metric_families(text))
    parsed = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    return {f.name for f in families}, parsed


def get(parsed: Samples, name: str, **labels: str) -> float | None:
    return parsed.get((name, tuple(sorted(labels.items()))))


def count(bb: Harness, query: str, **params: Any) -> int:
    return int(bb.sql(query, **params)[0]["n"])


def other_address() -> str | None:
    """A non-loopback IPv4 address of this host, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            address = str(probe.getsockname()[0])
    except OSError:
        return None
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_the_endpoint_shows_what_the_tables_hold_and_only_on_loopback(bb: Harness) -> None:
    """Scraped while beat runs: every family; counts equal SQL once quiet; leader 1 vs standby 0."""
    bb.write_app(
        {"ok": bb.entry("ok", 1.0), "boom": bb.entry("boom", 1.0, fail="boom")},
        boundedbeat_metrics_port=0,
        boundedbeat_metrics_refresh_interval=0.5,
    )
    bb.start_worker()
    beat = bb.start_beat()
    url = endpoint(beat)
    assert url.startswith("http://127.0.0.1:"), url
    bb.wait_until(
        lambda: (
            (get(scrape(url)[1], "boundedbeat_schedule_runs_total", schedule="ok", state="completed") or 0)
            >= 3
        ),
        60,
        "three completed runs of ok on /metrics",
    )
    names, parsed = scrape(url)
    assert names >= FAMILIES, FAMILIES - names
    assert get(parsed, "boundedbeat_leader") == 1

    # Quiet the system, then every number must be the one SQL gives.
    for name in ("ok", "boom"):
        bb.celery("boundedbeat", "pause", name, check=True)
    active = "SELECT count(*) AS n FROM boundedbeat_runs WHERE state IN ('queued', 'published', 'started')"
    bb.wait_until(lambda: count(bb, active) == 0, 60, "the active runs to settle")
    settled = bb.sql("SELECT schedule, state, count(*) AS n FROM boundedbeat_runs GROUP BY schedule, state")

    def matches() -> Samples | None:
        parsed = scrape(url)[1]
        for row in settled:
            if (
                get(parsed, "boundedbeat_schedule_runs_total", schedule=row["schedule"], state=row["state"])
                != row["n"]
            ):
                return None
        return parsed if get(parsed, "boundedbeat_schedule_paused", schedule="ok") == 1 else None

    parsed = bb.wait_until(matches, 30, "/metrics to equal the SQL counts")
    rows = bb.sql("SELECT name, skips, failures, pending_runs, last_drift_ms FROM boundedbeat_schedules")
    assert sorted(row["name"] for row in rows) == ["boom", "ok"]
    for row in rows:
        name = row["name"]
        assert get(parsed, "boundedbeat_schedule_skips_total", schedule=name) == row["skips"]
        assert get(parsed, "boundedbeat_schedule_failures_total", schedule=name) == row["failures"]
        assert get(parsed, "boundedbeat_schedule_active_runs", schedule=name) == 0
        assert get(parsed, "boundedbeat_schedule_pending_runs", schedule=name) == row["pending_runs"]
        assert (
            get(parsed, "boundedbeat_schedule_last_drift_seconds", schedule=name)
            == row["last_drift_ms"] / 1000
        )
        finished = count(
            bb,
            "SELECT count(*) AS n FROM boundedbeat_runs WHERE schedule = :s AND elapsed_ms IS NOT NULL",
            s=name,
        )
        assert get(parsed, "boundedbeat_run_duration_seconds_gcount", schedule=name) == finished
    assert get(parsed, "boundedbeat_queue_depth") == count(bb, "SELECT count(*) AS n FROM boundedbeat_queue")
    renewed = bb.sql("SELECT renewed_at FROM boundedbeat_leases")[0]["renewed_at"]
    assert abs(get(parsed, "boundedbeat_last_tick_timestamp_seconds") - renewed.timestamp()) <= 10  # type: ignore[operator]
    assert get(parsed, "boundedbeat_schedule_runs_total", schedule="boom", state="failed") >= 3  # type: ignore[operator]

    # A standby beat serves its own endpoint and says it does not hold the lease.
    standby = bb.start_beat(migrate=False, wait_lease=False)
    bb.wait_for_log(standby, "is standing by", timeout=40)
    standby_url = endpoint(standby)
    bb.wait_until(
        lambda: "boundedbeat_queue_depth" in scrape(standby_url)[0], 30, "the standby's first snapshot"
    )
    assert get(scrape(standby_url)[1], "boundedbeat_leader") == 0

    # Bound to loopback: another address of this host does not answer; close() ends the endpoint.
    address, port = other_address(), int(url.rsplit(":", 1)[1].split("/")[0])
    if address is not None:
        with pytest.raises(OSError):
            socket.create_connection((address, port), timeout=3).close()
    assert bb.stop(beat, signal.SIGTERM) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=3)
