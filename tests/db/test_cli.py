"""The `boundedbeat` celery subcommand through click's runner (real SQLite, no beat needed)."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from sqlalchemy import insert, update

from celery_boundedbeat.api.queries import ScheduleSnapshot
from celery_boundedbeat.cli import boundedbeat
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import MAX_QUEUED_TRIGGERS
from celery_boundedbeat.core.timing import IntervalTiming
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import RunRow, ScheduleRow

STATUS_FIELDS = {
    "name", "task", "mode", "paused", "stopped", "running", "active_runs", "pending_runs", "runs",
    "skips", "overlaps", "failures", "last_drift_ms", "last_elapsed_ms", "max_elapsed_ms", "next_due_at",
}  # fmt: skip
HISTORY_FIELDS = {
    "id", "schedule", "task", "state", "scheduled_for", "published_at", "started_at", "finished_at",
    "elapsed_ms", "drift_ms", "worker", "error",
}  # fmt: skip


@pytest.fixture
def app(sqlite_url: str) -> Celery:
    app = Celery("clitest", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = sqlite_url
    return app


def run(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(
        boundedbeat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), catch_exceptions=False
    )


@pytest.fixture
def store(app: Celery) -> Store:
    """A migrated database with one schedule that ran twice (one success, one failure)."""
    assert run(app, "migrate").exit_code == 0
    store = Store(get_engine(app.conf.boundedbeat_database_url))
    spec = EntrySpec(
        name="report", task="proj.report", policy=Policy(), timing=IntervalTiming(60.0),
        schedule_repr="every 60s", period=60.0,
    )  # fmt: skip
    start = datetime.now(UTC) - timedelta(minutes=5)
    rng = random.Random(0)
    store.sync_config([spec], start, rng)
    for i, outcome in enumerate((RunState.COMPLETED, RunState.FAILED)):
        now = start + timedelta(minutes=i)
        emitted = store.tick({"report": spec}, now, rng, 10).emitted
        assert len(emitted) == 1
        store.run_life.start_run(emitted[0].id, worker="w@host", process="host:1", now=now, max_run_time=None)
        error = "ValueError: boom" if outcome is RunState.FAILED else None
        store.run_life.settle_run(emitted[0].id, outcome, now=now + timedelta(seconds=2), error=error)
    return store


def test_migrate_reports_up_to_date_on_the_second_run(app: Celery) -> None:
    """`migrate` creates the schema once and then says it is up to date."""
    first = run(app, "migrate")
    second = run(app, "migrate")
    assert first.exit_code == 0 and "migrated" in first.output
    assert second.exit_code == 0 and "up to date" in second.output


def test_status_json_has_the_contract_fields(app: Celery, store: Store) -> None:
    """`status --json` prints one object per schedule with every contract field."""
    result = run(app, "status", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == ["report"]
    assert rows[0].keys() >= STATUS_FIELDS
    assert (rows[0]["runs"], rows[0]["failures"], rows[0]["mode"]) == (1, 1, "fixed_rate_no_overlap")


def test_status_table_is_aligned_and_names_the_lease(app: Celery, store: Store) -> None:
    """Plain `status` prints an aligned table with one line per schedule and the lease holder."""
    result = run(app, "status")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("NAME") and lines[2].startswith("report")
    assert lines[0].index("STATE") == lines[2].index("idle")
    assert lines[0].index("SCHEDULE") == lines[2].index("every 1 min")
    assert "beat lease: not held" in result.output
    wide = run(app, "status", "--wide").output.splitlines()
    assert wide[0].index("MODE") == wide[2].index("fixed_rate_no_overlap")
    assert wide[0].index("TASK") == wide[2].index("proj.report")


def test_history_filters_by_state_and_limit_newest_first(app: Celery, store: Store) -> None:
    """`history NAME --state S --limit N --json` returns the matching runs, newest first."""
    everything = json.loads(run(app, "history", "report", "--json").output)
    assert [r["state"] for r in everything] == ["failed", "completed"]
    assert everything[0].keys() >= HISTORY_FIELDS
    assert everything[0]["error"] == "ValueError: boom"
    assert datetime.fromisoformat(everything[0]["scheduled_for"]).utcoffset() == timedelta(0)
    failed = json.loads(run(app, "history", "report", "--state", "failed", "--json").output)
    assert [r["id"] for r in failed] == [everything[0]["id"]]
    assert len(json.loads(run(app, "history", "--limit", "1", "--json").output)) == 1


def test_pause_resume_and_trigger_change_the_schedule(app: Celery, store: Store) -> None:
    """pause/resume flip the paused flag; trigger queues one pending run due now."""
    assert run(app, "pause", "report").exit_code == 0
    assert store.schedules(["report"])[0].paused is True
    assert run(app, "resume", "report").exit_code == 0
    row = store.schedules(["report"])[0]
    assert (row.paused, row.stopped) == (False, False)
    assert run(app, "trigger", "report").exit_code == 0
    row = store.schedules(["report"])[0]
    assert row.pending_runs == 1
    assert row.next_due_at is not None and row.next_due_at <= datetime.now(UTC)


def test_trigger_says_when_the_run_is_scheduled_for(app: Celery, store: Store) -> None:
    """`trigger` prints the queued run's scheduled_for and exits 0."""
    result = run(app, "trigger", "report")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("report: triggered for 20")
    assert "runs as soon as a slot is free" in result.output


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (("pause", "report"), "report: not triggered: the schedule is paused; resume it first"),
        (("trigger", "report"), f"report: not triggered: {MAX_QUEUED_TRIGGERS} triggered runs already wait"),
    ],
)
def test_a_refused_trigger_prints_why_and_exits_non_zero(
    app: Celery, store: Store, setup: tuple[str, str], message: str
) -> None:
    """`trigger` on a paused schedule, or past the bound of queued triggers, says why and exits non-zero."""
    repeat = MAX_QUEUED_TRIGGERS if setup[0] == "trigger" else 1
    for _ in range(repeat):
        assert run(app, *setup).exit_code == 0
    waiting = store.schedules(["report"])[0].pending_runs
    result = run(app, "trigger", "report")
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output
    assert store.schedules(["report"])[0].pending_runs == waiting


def test_purge_deletes_only_old_settled_runs(app: Celery, store: Store) -> None:
    """`purge --older-than DAYS` deletes settled runs finished before the cutoff and no others."""
    assert "deleted 0 run(s)" in run(app, "purge", "--older-than", "1").output
    assert "deleted 2 run(s)" in run(app, "purge", "--older-than", "0").output
    assert store.runs(name="report") == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("pause", "nope"), "no schedule named 'nope'"),
        (("resume", "nope"), "no schedule named 'nope'"),
        (("trigger", "nope"), "no schedule named 'nope'"),
        (("history", "nope"), "no schedule named 'nope'"),
        (("history", "--state", "sleeping"), "Invalid value for '--state'"),
        (("history", "--limit", "0"), "Invalid value for '--limit'"),
        (("history", "--since", "yesterday-ish"), "neither an ISO 8601 time nor a duration"),
        (("purge",), "Missing option '--older-than'"),
    ],
)
def test_bad_arguments_get_a_clear_message_and_a_non_zero_exit(
    app: Celery, store: Store, args: tuple[str, ...], message: str
) -> None:
    """Unknown names and bad arguments exit non-zero with a message, never a traceback."""
    result = run(app, *args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_commands_on_an_unmigrated_database_say_to_migrate(app: Celery) -> None:
    """Reading an empty database tells the user to run `migrate` instead of failing obscurely."""
    result = run(app, "status")
    assert result.exit_code != 0
    assert "boundedbeat migrate" in result.output


def test_errors_never_show_the_database_password(tmp_path: object) -> None:
    """A database that cannot be reached is named with its password masked."""
    app = Celery("clipw", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = "postgresql+psycopg://bob:s3cr3t-pw@127.0.0.1:1/nowhere"
    result = run(app, "status")
    assert result.exit_code != 0
    assert "s3cr3t-pw" not in result.output
    assert "***" in result.output


def test_resume_replay_hands_the_paused_ticks_to_the_policy(app: Celery, store: Store) -> None:
    """`resume` rejoins the grid after now; `resume --replay` leaves the passed ticks due now."""
    before = store.schedules(["report"])[0].grid_at
    assert before is not None and before < datetime.now(UTC)
    assert run(app, "pause", "report").exit_code == 0
    result = run(app, "resume", "report", "--replay")
    assert result.exit_code == 0, result.output
    assert result.output == "report: resumed, replaying the ticks passed while paused\n"
    row = store.schedules(["report"])[0]
    assert row.grid_at == before
    assert row.next_due_at is not None and row.next_due_at <= datetime.now(UTC)
    assert run(app, "pause", "report").exit_code == 0
    assert run(app, "resume", "report").output == "report: resumed\n"
    row = store.schedules(["report"])[0]
    assert row.grid_at is not None and row.grid_at > datetime.now(UTC)


def test_status_shows_what_dropped_the_skips_and_the_replaced_runs(app: Celery, store: Store) -> None:
    """`status --json` has the four policy counters; the table shows them next to SKIPS."""
    rows = json.loads(run(app, "status", "--json").output)
    assert {k: rows[0][k] for k in ("busy_skips", "window_drops", "buffer_drops", "replaced")} == {
        "busy_skips": 0,
        "window_drops": 0,
        "buffer_drops": 0,
        "replaced": 0,
    }
    lines = run(app, "status", "--wide").output.splitlines()
    assert lines[0].index("BUSY/WINDOW/BUFFER") == lines[2].index("0/0/0")
    assert "REPLACED" in lines[0]


TRACEBACK_ERROR = (
    "ValueError: boom\n\nTraceback (most recent call last):\n"
    '  File "/app/proj/tasks.py", line 3, in report\n    raise ValueError("boom")\nValueError: boom'
)


def test_history_shows_one_line_per_run_whatever_its_traceback(app: Celery, store: Store) -> None:
    """A failed run's stored traceback stays out of the table: its exception, on the run's line."""
    with store.engine.begin() as conn:
        conn.execute(
            update(RunRow).where(RunRow.state == RunState.FAILED.value).values(error=TRACEBACK_ERROR)
        )
    result = run(app, "history", "report")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2 + 2, result.output
    assert lines[2].endswith("  ValueError: boom") and "Traceback" not in result.output
    assert json.loads(run(app, "history", "--json").output)[0]["error"] == TRACEBACK_ERROR


def test_status_says_which_queue_a_run_no_worker_started_waits_on(app: Celery, store: Store) -> None:
    """A run published past ``boundedbeat_unstarted_warning`` and not started: its schedule waits."""
    now = datetime.now(UTC)
    with store.engine.begin() as conn:
        conn.execute(update(ScheduleRow).values(options={"queue": "nowhere"}, active_runs=1))
        conn.execute(
            insert(RunRow).values(
                id="00000000-0000-0000-0000-00000000abcd", schedule="report", task="proj.report",
                state=RunState.PUBLISHED.value, scheduled_for=now - timedelta(seconds=400),
                enqueued_at=now - timedelta(seconds=400), published_at=now - timedelta(seconds=400),
            )
        )  # fmt: skip
    lines = run(app, "status").output.splitlines()
    assert "waiting: queue nowhere" in lines[2], lines
    assert max(len(line) for line in lines) <= 100, lines
    assert any(
        line.startswith("report: waiting for a worker on queue nowhere (1 run(s) published, the oldest 4")
        for line in lines
    ), lines
    assert "waiting for a worker on queue nowhere" in run(app, "status", "--wide").output
    app.conf.boundedbeat_unstarted_warning = 600
    assert "waiting" not in run(app, "status").output
    assert "unstarted" not in run(app, "status", "--json").output


def test_status_json_keeps_its_fields(app: Celery, store: Store) -> None:
    """The machine-readable form is the snapshot's fields, nothing added for the table."""
    rows = json.loads(run(app, "status", "--json").output)
    assert set(rows[0]) == set(ScheduleSnapshot.__dataclass_fields__)


def test_status_fits_100_columns_unless_wide(app: Celery, store: Store) -> None:
    """Long names are cut with an ellipsis to fit 100 columns; ``--wide`` shows them whole."""
    long = "export-the-monthly-report-for-every-customer-of-the-whole-shop-" + "x" * 40
    with store.engine.begin() as conn:
        conn.execute(update(ScheduleRow).values(name=long))
    narrow = run(app, "status").output.splitlines()
    assert max(len(line) for line in narrow[:3]) <= 100 and "…" in narrow[2], narrow
    wide = run(app, "status", "--wide").output.splitlines()
    assert wide[2].startswith(long + "  ")
