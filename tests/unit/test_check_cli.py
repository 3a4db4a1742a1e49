"""`boundedbeat check`: beat's validation for a project's own CI, without a database."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from celery.schedules import crontab
from click.testing import CliRunner, Result

from celery_boundedbeat.cli import boundedbeat


def run_check(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(
        boundedbeat, ["check", *args], obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    )


@pytest.fixture
def app(tmp_path: Path) -> Celery:
    app = Celery("checktest", broker="memory://", set_as_current=False)
    # A database that does not exist and cannot be created: check must never open it.
    app.conf.boundedbeat_database_url = f"sqlite:///{tmp_path}/missing-dir/never.sqlite3"
    return app


def test_valid_entries_print_their_next_due_times_and_exit_0(app: Celery, tmp_path: Path) -> None:
    """Each schedule is listed with its next due times; max_runs bounds how many are shown."""
    app.conf.beat_schedule = {
        "every-10": {"task": "proj.a", "schedule": 10.0},
        "quarterly": {"task": "proj.b", "schedule": crontab(minute="*/15"), "policy": {"max_runs": 2}},
        "after-finish": {"task": "proj.c", "schedule": 30, "policy": {"mode": "fixed_delay"}},
    }
    result = run_check(app, "--count", "4")
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.split()}
    assert lines["every-10"].count(", ") == 3  # four due times
    assert lines["quarterly"].count(", ") == 1  # two due times: max_runs=2
    assert "30 s after each run finishes" in lines["after-finish"]
    assert "3 schedule(s) valid" in result.output
    assert not (tmp_path / "missing-dir").exists()


def test_a_bad_entry_exits_78_naming_entry_key_and_reason(app: Celery) -> None:
    """The same problems beat would refuse, with EX_CONFIG, and no table."""
    app.conf.beat_schedule = {
        "zero": {"task": "proj.a", "schedule": 0},
        "cron-delay": {"task": "proj.b", "schedule": crontab(), "policy": {"mode": "fixed_delay"}},
    }
    result = run_check(app)
    assert result.exit_code == 78, result.output
    assert "entry 'zero', key 'schedule': period must be > 0 seconds, got 0" in result.output
    assert "entry 'cron-delay', key 'schedule': mode 'fixed_delay' needs a number" in result.output
    assert "NEXT DUE" not in result.output


def test_an_invalid_setting_exits_78(app: Celery) -> None:
    """A bad boundedbeat_* setting is a configuration error too."""
    app.conf.boundedbeat_default_policy = {"mode": "sometimes"}
    app.conf.beat_schedule = {"a": {"task": "proj.a", "schedule": 5}}
    result = run_check(app)
    assert result.exit_code == 78, result.output
    assert "boundedbeat_default_policy" in result.output


def test_a_crontab_is_shown_with_its_zone_and_its_due_times_follow_it(app: Celery) -> None:
    """A crontab's zone (the policy key) is named next to it; its due times are that zone's 02:30 in UTC."""
    app.conf.beat_schedule = {
        "nightly": {
            "task": "proj.a",
            "schedule": crontab(minute=30, hour=2, app=app),
            "policy": {"timezone": "Asia/Kolkata"},
        },
        "often": {"task": "proj.b", "schedule": 10.0},
    }
    result = run_check(app, "--count", "2")
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.split()}
    assert " in Asia/Kolkata" in lines["nightly"] and " in " not in lines["often"].split("proj.b")[1]
    assert lines["nightly"].count("21:00:00") == 2  # 02:30 at UTC+05:30


def test_a_past_start_at_shows_the_grid_time_in_progress_first(app: Celery) -> None:
    """As beat starts it: the interval's grid time in progress since ``start_at`` is due at once."""
    from datetime import UTC, datetime, timedelta

    start = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=25)
    app.conf.beat_schedule = {"late": {"task": "proj.a", "schedule": 10.0, "policy": {"start_at": start}}}
    result = run_check(app, "--count", "2")
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("late ")]
    in_progress, following = start + timedelta(seconds=20), start + timedelta(seconds=30)
    assert f"{in_progress:%Y-%m-%d %H:%M:%S}, {following:%Y-%m-%d %H:%M:%S}" in line, line
