"""``boundedbeat health`` against a real beat: healthy, killed, frozen, behind, unreachable."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from datetime import datetime
from typing import Any

import pytest

from .harness import Harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

#: A short lease so a killed holder's lease expires within seconds.
SHORT_LEASE = {"boundedbeat_lease_ttl": 4.0, "boundedbeat_lease_renew_interval": 1.0}
postgres_only = pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
sqlite_only = pytest.mark.parametrize("backend", ["sqlite-filesystem"], indirect=True)


def health(bb: Harness, *args: str) -> tuple[int, dict[str, Any], str]:
    """Run the probe with ``--json``: its exit status, its JSON object and its raw stdout."""
    result = bb.celery("boundedbeat", "health", "--json", *args, timeout=60)
    lines = result.stdout.splitlines()
    assert len(lines) == 1, f"not one line:\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.returncode, json.loads(lines[0]), result.stdout


def until_unhealthy(bb: Harness, *args: str, timeout: float) -> dict[str, Any]:
    """Probe until the probe fails; every probe before that must have said healthy."""
    seen: list[dict[str, Any]] = []

    def failed() -> dict[str, Any] | None:
        status, out, _ = health(bb, *args)
        assert (status == 0) == out["healthy"], out
        seen.append(out)
        return None if status == 0 else out

    verdict: dict[str, Any] = bb.wait_until(failed, timeout, "the probe to fail", interval=0.3)
    return verdict


def when(value: str) -> datetime:
    return datetime.fromisoformat(value)


@postgres_only
def test_a_live_beat_is_healthy_and_a_killed_one_is_not_once_its_lease_expires(bb: Harness) -> None:
    """Exit 0 while beat runs; after SIGKILL, exit 1 "no beat holds the lease", not before expiry."""
    bb.write_app({"tick": bb.entry("tick", 1.0)}, **SHORT_LEASE)
    beat = bb.start_beat()
    status, out, line = health(bb)
    assert status == 0, line
    assert out["holder"] and out["last_tick_age_seconds"] <= 4.0, out
    plain = bb.celery("boundedbeat", "health")
    assert plain.returncode == 0 and plain.stdout.startswith(f"healthy: beat {out['holder']} holds the lease")

    bb.stop(beat, signal.SIGKILL)
    verdict = until_unhealthy(bb, timeout=40)
    assert verdict["problem"] == "no_beat", verdict
    assert verdict["message"].startswith(
        f"unhealthy: no beat holds the lease: the lease of {out['holder']} expired"
    ), verdict
    # It failed because the lease expired, not earlier: the probe that failed ran after expiry.
    assert when(verdict["checked_at"]) >= when(verdict["lease_expires_at"]), verdict


@postgres_only
def test_a_frozen_beat_stopped_ticking_once_the_bound_passes_and_recovers(bb: Harness) -> None:
    """SIGSTOP: exit 1 "stopped ticking" while its long lease is still valid; SIGCONT: exit 0 again."""
    bb.write_app(
        {"tick": bb.entry("tick", 1.0)},
        boundedbeat_lease_ttl=120.0,
        boundedbeat_lease_renew_interval=1.0,
    )
    beat = bb.start_beat()
    assert health(bb, "--max-tick-age", "4")[0] == 0
    os.kill(beat.popen.pid, signal.SIGSTOP)
    try:
        verdict = until_unhealthy(bb, "--max-tick-age", "4", timeout=40)
    finally:
        os.kill(beat.popen.pid, signal.SIGCONT)
    assert verdict["problem"] == "stalled", verdict
    assert " holds the lease but stopped ticking: last tick " in verdict["message"], verdict
    assert verdict["last_tick_age_seconds"] > 4.0, verdict
    assert when(verdict["lease_expires_at"]) > when(verdict["checked_at"]), verdict
    bb.wait_until(lambda: health(bb, "--max-tick-age", "4")[0] == 0, 30, "the probe to pass after SIGCONT")


@sqlite_only
def test_a_queue_nobody_drains_means_the_dispatcher_is_behind(bb: Harness) -> None:
    """With the dispatcher off, emitted runs wait in the queue: exit 1 once the oldest passes the bound."""
    bb.write_app({"tick": bb.entry("tick", 1.0)}, boundedbeat_dispatch_enabled=False)
    bb.start_beat()
    verdict = until_unhealthy(bb, "--max-queue-age", "3", timeout=40)
    assert verdict["problem"] == "behind", verdict
    assert verdict["message"].startswith("unhealthy: the dispatcher is behind: the oldest queued"), verdict
    assert verdict["queue_oldest_age_seconds"] > 3.0, verdict


@sqlite_only
def test_an_unreachable_database_fails_with_a_masked_password(bb: Harness) -> None:
    """Nothing listens on the URL's port: exit 1, one line naming the masked URL, never the password."""
    bb.write_app({}, boundedbeat_database_url="postgresql+psycopg://bb:hunter2pw@127.0.0.1:1/nodb")
    result = bb.celery("boundedbeat", "health")
    assert result.returncode == 1, result
    assert result.stdout.startswith(
        "unhealthy: cannot reach the database postgresql+psycopg://bb:***@127.0.0.1:1/nodb: OperationalError"
    ), result.stdout
    assert len(result.stdout.splitlines()) == 1, result.stdout
    assert "hunter2pw" not in result.stdout + result.stderr


@postgres_only
def test_runs_routed_to_a_queue_no_worker_consumes_are_reported_everywhere(bb: Harness) -> None:
    """A queue typo: health fails naming the queue, status says "waiting", metrics count the run.

    A real worker consumes the test's queue (the ``ok`` entry completes there); the ``typo``
    entry's options route it to a queue nobody reads, so its run stays ``published``.
    """
    nowhere = f"nowhere_{bb.uid}"
    typo = {**bb.entry("typo", 1.0), "options": {"queue": nowhere}}
    bb.write_app(
        {"ok": bb.entry("ok", 1.0), "typo": typo},
        boundedbeat_unstarted_warning=2.0,
        boundedbeat_metrics_port=0,
        boundedbeat_metrics_refresh_interval=0.5,
    )
    bb.start_worker()
    beat = bb.start_beat()
    bb.wait_until(lambda: len(bb.finished("ok")) >= 2, 60, "two completed runs of ok")
    verdict = until_unhealthy(bb, timeout=40)
    assert verdict["problem"] == "unstarted", verdict
    assert f"typo (1): waiting for a worker on queue {nowhere}" in verdict["message"], verdict
    assert verdict["unstarted"] == [
        {
            "schedule": "typo",
            "queue": nowhere,
            "runs": 1,
            "oldest_published_at": verdict["unstarted"][0]["oldest_published_at"],
        }
    ], verdict
    assert health(bb, "--max-unstarted-age", "0")[0] == 0  # the liveness form ignores it

    status = bb.celery("boundedbeat", "status", check=True).stdout
    typo_line = next(line for line in status.splitlines() if line.startswith("typo "))
    assert f"waiting: queue {nowhere}" in typo_line, status
    assert f"typo: waiting for a worker on queue {nowhere} (1 run(s) published" in status, status
    ok_line = next(line for line in status.splitlines() if line.startswith("ok "))
    assert "waiting" not in ok_line, status

    text = bb.celery("boundedbeat", "status", "--format", "prometheus", check=True).stdout
    assert 'boundedbeat_schedule_unstarted_runs{schedule="typo"} 1.0' in text, text
    assert 'boundedbeat_schedule_unstarted_runs{schedule="ok"} 0.0' in text, text
    url = re.search(r"serving Prometheus metrics on (http://\S+/metrics)", beat.output())
    assert url, beat.tail()

    def scraped() -> bool:
        with urllib.request.urlopen(url.group(1), timeout=10) as response:
            return 'boundedbeat_schedule_unstarted_runs{schedule="typo"} 1.0' in response.read().decode()

    bb.wait_until(scraped, 30, "beat's /metrics to count the unstarted run")


@sqlite_only
def test_a_tick_bound_below_the_renew_interval_is_a_usage_error_not_unhealthy(bb: Harness) -> None:
    """`health --max-tick-age 3` under a 5 s renewal exits 2 with Click's usage error, beat running or not:
    a probe that read it as "unhealthy" would restart a healthy beat forever."""
    bb.write_app({"ok": bb.entry("ok", 1.0)})
    result = bb.celery("boundedbeat", "health", "--max-tick-age", "3", timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    refusal = "Error: --max-tick-age 3 s must be longer than boundedbeat_lease_renew_interval (5 s)"
    assert refusal in result.stderr
    assert "unhealthy" not in result.stdout + result.stderr
