"""Every stored text is checked against its column where input enters: config, API, CLI, enqueue.

SQLite keeps any length and NUL characters; PostgreSQL refuses both. Input that only one of them
accepts is refused up front on both, naming the key, instead of failing later inside a
transaction that holds other schedules' work.
"""

from __future__ import annotations

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from celery.schedules import crontab
from click.testing import CliRunner, Result
from sqlalchemy import Engine, func, select

from celery_boundedbeat import ConfigurationError, add_schedule, enqueue, update_schedule
from celery_boundedbeat.cli import boundedbeat
from celery_boundedbeat.core.limits import MAX_SCHEDULE_NAME, MAX_TASK_ID, MAX_TASK_NAME
from celery_boundedbeat.db.tables import QueueRow, ScheduleRow

LONG_NAME = "n" * (MAX_SCHEDULE_NAME + 1)


def test_the_limits_are_the_columns_own() -> None:
    """The limits come from the tables (one owner): a schedule name 200, a task name 255, a task id 36."""
    assert (MAX_SCHEDULE_NAME, MAX_TASK_NAME, MAX_TASK_ID) == (200, 255, 36)


def run_cli(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(boundedbeat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None))


@pytest.fixture
def offline_app(tmp_path: object) -> Celery:
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = f"sqlite:///{tmp_path}/missing-dir/never.sqlite3"
    return app


@pytest.mark.parametrize(
    ("name", "raw", "key", "reason"),
    [
        (LONG_NAME, {"task": "proj.a", "schedule": 5}, "name", "must be at most 200 characters, got 201"),
        ("nul\x00name", {"task": "proj.a", "schedule": 5}, "name", "must not contain NUL characters"),
        ("nul-task", {"task": "proj.\x00a", "schedule": 5}, "task", "must not contain NUL characters"),
        (
            "long-cron",
            {"task": "proj.a", "schedule": crontab(minute=",".join(["0"] * 300))},
            "schedule",
            "its text must be at most 500 characters",
        ),
    ],
)
def test_check_refuses_a_text_the_tables_cannot_keep_with_exit_78(
    offline_app: Celery, name: str, raw: dict[str, object], key: str, reason: str
) -> None:
    """`boundedbeat check` exits 78 naming the entry and the key; the good entry beside it is no excuse."""
    offline_app.conf.beat_schedule = {"fine": {"task": "proj.ok", "schedule": 5}, name: raw}
    result = run_cli(offline_app, "check")
    assert result.exit_code == 78, result.output
    label = name if len(name) <= MAX_SCHEDULE_NAME else name[:40] + "..."
    assert f"entry {label!r}, key {key!r}: {reason}" in result.output, result.output


@pytest.fixture
def app(migrated: Engine, db_url: str) -> Celery:
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    return app


def schedule_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(ScheduleRow)) or 0)


@pytest.mark.parametrize(
    ("name", "task", "key"),
    [(LONG_NAME, "proj.a", "name"), ("nul\x00name", "proj.a", "name"), ("x", "proj.\x00a", "task")],
)
def test_add_schedule_refuses_what_a_column_cannot_keep(
    app: Celery, engine: Engine, name: str, task: str, key: str
) -> None:
    """add_schedule raises ConfigurationError naming the key (not a driver error) and writes nothing."""
    with pytest.raises(ConfigurationError) as raised:
        add_schedule(app, name, task, 5)
    assert [k for _, k, _ in raised.value.problems] == [key]
    assert schedule_rows(engine) == 0


def test_update_schedule_refuses_a_task_a_column_cannot_keep(app: Celery, engine: Engine) -> None:
    """update_schedule validates the new task like add does; the stored one is kept."""
    assert add_schedule(app, "x", "proj.a", 5) == "scheduled"
    with pytest.raises(ConfigurationError) as raised:
        update_schedule(app, "x", task="t" * (MAX_TASK_NAME + 1))
    assert [k for _, k, _ in raised.value.problems] == ["task"]


def test_cli_add_refuses_a_nul_in_the_name_naming_the_key(app: Celery, engine: Engine) -> None:
    """`boundedbeat add` exits 1 with the configuration error's line, as for other bad input."""
    result = run_cli(app, "add", "bad\x00name", "proj.a", "--every", "5")
    assert result.exit_code == 1, result.output
    assert "key 'name': must not contain NUL characters" in result.output
    assert schedule_rows(engine) == 0


@pytest.mark.parametrize(
    ("task", "options", "message"),
    [
        ("t" * (MAX_TASK_NAME + 1), {}, "task_name must be at most 255 characters"),
        ("proj.a", {"task_id": "i" * (MAX_TASK_ID + 1)}, "task_id must be at most 36 characters"),
        ("proj.\x00a", {}, "task_name must not contain NUL characters"),
    ],
)
def test_enqueue_refuses_what_the_queue_cannot_keep(
    app: Celery, engine: Engine, task: str, options: dict[str, str], message: str
) -> None:
    """enqueue raises ValueError before writing, on SQLite too (which would keep it)."""
    with engine.begin() as conn, pytest.raises(ValueError, match=message):
        enqueue(conn, task, **options)
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(QueueRow)) == 0
