"""Bad configuration is refused; the ``celery boundedbeat`` commands work against a live system."""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from .apps import Raw
from .harness import Harness
from .reads import ACTIVE_STATES
from .waiting import wait_for_log

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STATUS_FIELDS = {
    "name",
    "task",
    "mode",
    "paused",
    "stopped",
    "running",
    "active_runs",
    "pending_runs",
    "runs",
    "skips",
    "overlaps",
    "failures",
    "last_drift_ms",
    "last_elapsed_ms",
    "max_elapsed_ms",
    "next_due_at",
}
HISTORY_FIELDS = {
    "id",
    "schedule",
    "task",
    "state",
    "scheduled_for",
    "published_at",
    "started_at",
    "finished_at",
    "elapsed_ms",
    "drift_ms",
    "worker",
    "error",
}


def test_bad_config_is_refused_before_anything_is_emitted(bb: Harness) -> None:
    """Beat exits non-zero within seconds, naming every bad entry and key, and writes no run."""
    bb.write_app(
        {
            "fine": bb.entry("fine", 1.0),
            "zero-period": bb.entry("zero-period", 0),
            "odd-mode": bb.entry("odd-mode", 1.0, policy={"mode": "sometimes"}),
            "delay-cron": bb.entry("delay-cron", Raw("crontab(minute='*')"), policy={"mode": "fixed_delay"}),
        }
    )
    if bb.backend.is_postgres:
        bb.migrate()
    started = time.monotonic()
    beat = bb.start_beat(migrate=False, wait_lease=False)
    beat.expect_alive = False
    try:
        status = beat.popen.wait(timeout=30)
    except Exception:
        raise AssertionError(f"beat kept running with a bad configuration\n{beat.tail()}") from None
    took = time.monotonic() - started
    output = beat.output()
    assert status != 0, output
    assert took < 25, f"beat took {took:.1f} s to refuse the configuration"
    lines = output.splitlines()
    for entry, key in (("zero-period", "schedule"), ("odd-mode", "mode"), ("delay-cron", "schedule")):
        assert any(entry in line and key in line for line in lines), (
            f"no line names entry {entry!r} and key {key!r}:\n{output}"
        )
    assert "sometimes" in output, output
    assert "holds the beat lease" not in output
    assert bb.runs() == [], "runs were written despite the bad configuration"
    assert bb.schedules() == {}, "schedules were written despite the bad configuration"


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_status_and_history_commands_report_the_live_schedules(bb: Harness) -> None:
    """`status --json` has the contract fields; `history NAME --json --limit 3 --state completed` filters."""
    bb.write_app(
        {
            "ok": bb.entry("ok", 0.5, durations=[0.05]),
            "bad": bb.entry("bad", 1.0, durations=[0.05], fail=f"broken-{bb.uid}"),
        }
    )
    _worker, beat = bb.start(concurrency=2)
    bb.wait_until(
        lambda: len(bb.finished("ok")) >= 5 and bb.finished("bad", "failed"),
        timeout=30,
        what="5 completed 'ok' runs and a failed 'bad' run",
    )
    result = bb.celery("boundedbeat", "status", "--json", check=True)
    status = {row["name"]: row for row in json.loads(result.stdout)}
    assert set(status) == {"ok", "bad"}, result.stdout
    for row in status.values():
        assert row.keys() >= STATUS_FIELDS, f"missing {STATUS_FIELDS - row.keys()}"
        assert row["mode"] == "fixed_rate_no_overlap" and row["paused"] is False and row["stopped"] is False
    assert status["ok"]["task"] == f"{bb.module}.work"
    assert status["ok"]["runs"] >= 5 and status["ok"]["failures"] == 0, status["ok"]
    assert status["bad"]["failures"] >= 1 and status["bad"]["runs"] == 0, status["bad"]
    assert datetime.fromisoformat(status["ok"]["next_due_at"]).utcoffset() is not None

    newest = max(r.scheduled_for for r in bb.finished("ok"))
    result = bb.celery(
        "boundedbeat", "history", "ok", "--json", "--limit", "3", "--state", "completed", check=True
    )
    history = json.loads(result.stdout)
    assert len(history) == 3, result.stdout
    known = {r.id: r for r in bb.runs("ok")}
    for item in history:
        assert item.keys() >= HISTORY_FIELDS, f"missing {HISTORY_FIELDS - item.keys()}"
        assert item["schedule"] == "ok" and item["state"] == "completed", item
        assert item["id"] in known, item
        for key in ("scheduled_for", "published_at", "started_at", "finished_at"):
            assert datetime.fromisoformat(item[key]).utcoffset() is not None, (key, item[key])
    scheduled = [datetime.fromisoformat(item["scheduled_for"]) for item in history]
    assert scheduled == sorted(scheduled, reverse=True), "history is not newest first"
    assert scheduled[0] >= newest, "history skipped the newest completed run"

    failed = json.loads(
        bb.celery("boundedbeat", "history", "bad", "--json", "--state", "failed", check=True).stdout
    )
    assert failed and all(f"broken-{bb.uid}" in item["error"] for item in failed), failed

    # Once everything is quiet, the counters agree with the history table.
    bb.stop(beat)
    bb.wait_until(lambda: not any(r.state in ACTIVE_STATES for r in bb.runs()), timeout=15, what="quiet")
    final = {
        row["name"]: row
        for row in json.loads(bb.celery("boundedbeat", "status", "--json", check=True).stdout)
    }
    assert final["ok"]["runs"] == len(bb.finished("ok")), final["ok"]
    assert final["bad"]["failures"] == len(bb.finished("bad", "failed")), final["bad"]
    assert final["ok"]["active_runs"] == 0 and final["ok"]["running"] is False, final["ok"]


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_migrate_is_required_on_postgresql(bb: Harness) -> None:
    """Beat refuses an un-migrated PostgreSQL database, naming migrate for its app; after migrate it runs."""
    bb.write_app({"ok": bb.entry("ok", 0.5, durations=[0.05])})
    beat = bb.start_beat(migrate=False, wait_lease=False)
    beat.expect_alive = False
    try:
        status = beat.popen.wait(timeout=30)
    except Exception:
        raise AssertionError(f"beat kept running on an un-migrated database\n{beat.tail()}") from None
    assert status != 0, beat.output()
    # The command to run names this app, as `-A` does, not a placeholder.
    assert f"celery -A {bb.module} boundedbeat migrate" in beat.output(), beat.output()
    assert bb.sql("SELECT to_regclass('boundedbeat_runs') AS t") == [{"t": None}], (
        "beat created tables itself"
    )

    first = bb.celery("boundedbeat", "migrate", check=True)
    assert "migrated" in first.stdout, first.stdout
    again = bb.celery("boundedbeat", "migrate", check=True)
    assert "up to date" in again.stdout, again.stdout

    bb.start(concurrency=1)
    bb.wait_until(lambda: bb.finished("ok"), timeout=20, what="a completed run after migrating")
    bb.assert_no_errors("boundedbeat migrate")


@pytest.mark.parametrize("backend", ["sqlite-filesystem"], indirect=True)
def test_what_beat_says_from_a_first_start_to_a_clean_stop(bb: Harness) -> None:
    """A mistyped setting is warned about once per process with the name it meant (beat, worker,
    CLI); the banner lines align with Celery's and count runtime schedules; Alembic says only the
    migrations it runs; a SIGTERM ends with one line saying the lease was released."""
    bb.write_app({"ok": bb.entry("ok", 60.0)}, boundedbeat_pol_interval=2.0)
    typo = "unknown setting boundedbeat_pol_interval is ignored; did you mean boundedbeat_poll_interval?"

    first = bb.start_beat()  # a fresh SQLite file: this beat migrates it
    assert bb.stop(first) == 0, first.tail()
    output = first.output()
    assert "Running upgrade" in output, output
    assert "Context impl" not in output and "Will assume" not in output, output
    assert output.count(typo) == 1, output
    assert output.rstrip().endswith("celery_boundedbeat: beat stopped (lease released)"), first.tail()

    check = bb.celery("boundedbeat", "check", check=True)
    assert typo in check.stderr, check.stderr
    bb.celery("boundedbeat", "add", "tenant-1", f"{bb.module}.work", "--every", "60", check=True)

    second = bb.start_beat()
    lines = second.output().splitlines()
    start = lines.index("Configuration ->") + 1
    banner = lines[start : lines.index("", start)]  # Celery's lines and ours, up to the blank line
    assert len(banner) >= 6 and all(line.startswith("    . ") for line in banner), banner
    assert "    . schedules -> 1 from beat_schedule, 1 at runtime" in banner, banner
    assert "    . dispatcher -> in beat" in banner, banner
    assert "Running upgrade" not in second.output() and "Context impl" not in second.output()
    assert "schedules: 1 from beat_schedule, 1 at runtime; database sqlite:" in second.output()

    worker = bb.start_worker()
    wait_for_log(worker, typo, timeout=20)
