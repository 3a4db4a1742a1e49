"""`boundedbeat import` and `export` through click's runner: usage errors, bad files, refusals.

The end-to-end paths (real django-celery-beat and RedBeat stores, a real beat, the round trip)
are in tests/integration/test_importers.py and test_export_import.py; these pin the command
line's own answers on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from sqlalchemy import Engine

from celery_boundedbeat import add_schedule
from celery_boundedbeat.cli import boundedbeat
from celery_boundedbeat.config.definitions import define
from celery_boundedbeat.db.store import Store, utcnow

EX_CONFIG = 78


@pytest.fixture
def app(migrated: Engine, db_url: str) -> Celery:
    app = Celery("impcli", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    return app


def run(app: Celery, *args: str, env: dict[str, Any] | None = None) -> Result:
    return CliRunner().invoke(
        boundedbeat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), env=env
    )


def exported(app: Celery, tmp_path: Path, name: str = "out.json") -> Path:
    path = tmp_path / name
    result = run(app, "export", "--output", str(path))
    assert result.exit_code == 0, result.output
    return path


def test_options_of_another_source_are_usage_errors(app: Celery) -> None:
    """--prune with django-celery-beat, or a source with nothing to read it from: exit 2, saying why."""
    pruned = run(app, "import", "django-celery-beat", "--database-url", "sqlite://", "--prune")
    assert pruned.exit_code == 2 and "--prune does not apply to `import django-celery-beat`" in pruned.output
    nowhere = run(app, "import", "django-celery-beat", env={"DJANGO_SETTINGS_MODULE": ""})
    assert nowhere.exit_code == 2 and "give --database-url, or set DJANGO_SETTINGS_MODULE" in nowhere.output


def test_a_database_without_django_celery_beat_tables_is_one_line_exit_1(app: Celery, tmp_path: Path) -> None:
    """A URL without the tables fails with one line naming it, and nothing is stored."""
    result = run(app, "import", "django-celery-beat", "--database-url", f"sqlite:///{tmp_path / 'none.db'}")
    assert result.exit_code == 1
    assert "cannot read django-celery-beat's tables from sqlite:///" in result.output
    assert "Traceback" not in result.output


def test_a_file_not_written_by_export_is_refused_whole(app: Celery, tmp_path: Path) -> None:
    """JSON that is not an export, or not JSON at all: exit 1 naming the problem."""
    (tmp_path / "other.json").write_text('{"schedules": []}')
    (tmp_path / "broken.json").write_text("{")
    other = run(app, "import", str(tmp_path / "other.json"))
    broken = run(app, "import", str(tmp_path / "broken.json"))
    assert other.exit_code == 1 and "is not a file written by boundedbeat export" in other.output
    assert broken.exit_code == 1 and "cannot be read" in broken.output


def test_bad_schedules_of_a_file_are_refused_one_line_each_and_the_rest_imported(
    app: Celery, tmp_path: Path
) -> None:
    """An unknown key, a bad timing or a bad policy: refused with the reason, exit 78; the good one added."""
    add_schedule(app, "good", "proj.good", 30)
    path = exported(app, tmp_path)
    document = json.loads(path.read_text())
    good = document["schedules"][0]
    document["schedules"] += [
        {**good, "name": "extra-key", "color": "red"},
        {**good, "name": "bad-timing", "timing": {"kind": "hourly"}},
        {**good, "name": "bad-policy", "policy": {**good["policy"], "max_runs": 0}},
    ]
    path.write_text(json.dumps(document))
    Store(_engine(app)).remove_schedule("good", utcnow(), revoke_active=False)
    result = run(app, "import", str(path), "--apply")
    assert result.exit_code == EX_CONFIG, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines()[2:-1]}
    assert lines["good"].endswith("added")
    assert "refused: unknown keys color" in lines["extra-key"]
    assert "refused: timing: unknown kind 'hourly'" in lines["bad-timing"]
    assert "refused: policy.max_runs: must be >= 1, got 0" in lines["bad-policy"]


def test_a_config_schedule_of_the_same_name_is_never_overwritten(app: Celery, tmp_path: Path) -> None:
    """A file's schedule whose name a beat_schedule entry holds is refused; the config row stays."""
    add_schedule(app, "clash", "proj.runtime", 30)
    path = exported(app, tmp_path)
    store = Store(_engine(app))
    store.remove_schedule("clash", utcnow(), revoke_active=False)
    store.sync_config([define("clash", {"task": "proj.config", "schedule": 60}, app, {})], utcnow(), _rng())
    result = run(app, "import", str(path), "--apply")
    assert result.exit_code == EX_CONFIG
    assert "refused: a beat_schedule entry of this name is stored" in result.output
    (row,) = store.schedules(["clash"])
    assert (row.task, row.origin) == ("proj.config", "config")


def test_yaml_export_imports_back_and_changes_nothing(app: Celery, tmp_path: Path) -> None:
    """A YAML export of the same database is already_present everywhere (exit 0)."""
    add_schedule(app, "y1", "proj.y", 30, kwargs={"k": "v"}, policy={"start_at": "2031-01-01T00:00:00+00:00"})
    yaml_out = run(app, "export", "--format", "yaml")
    assert yaml_out.exit_code == 0 and "start_at: '2031-01-01T00:00:00+00:00'" in yaml_out.output
    (tmp_path / "s.yml").write_text(yaml_out.output)
    result = run(app, "import", str(tmp_path / "s.yml"), "--apply")
    assert result.exit_code == 0, result.output
    assert "already_present" in result.output and result.output.rstrip().endswith("nothing to change")


def _engine(app: Celery) -> Engine:
    from celery_boundedbeat.db.engine import get_engine

    return get_engine(app.conf.boundedbeat_database_url)


def _rng() -> Any:
    import random

    return random.Random(0)


def test_an_ended_schedule_is_not_revived_by_a_file_that_says_running(app: Celery, tmp_path: Path) -> None:
    """Ended (max_runs) here, running in the file: refused with resume's reason, exit 78, still ended."""
    from celery_boundedbeat.core.enums import StopReason

    add_schedule(app, "once", "proj.once", 30, policy={"max_runs": 1})
    path = exported(app, tmp_path)
    store = Store(_engine(app))
    store.set_stopped("once", StopReason.MAX_RUNS, utcnow())
    dry = run(app, "import", str(path))
    assert dry.exit_code == 0 and "update" in dry.output
    result = run(app, "import", str(path), "--apply")
    assert result.exit_code == EX_CONFIG, result.output
    assert "refused: cannot resume 'once': the schedule has ended (max_runs)" in result.output
    (row,) = store.schedules(["once"])
    assert (row.stopped, row.stop_reason) == (True, "max_runs")


def test_a_stopped_and_paused_schedule_comes_back_paused_when_the_file_says_so(
    app: Celery, tmp_path: Path
) -> None:
    """Paused in the file, paused and stopped here: the stop is lifted and the pause kept."""
    from celery_boundedbeat.core.enums import StopReason

    add_schedule(app, "held", "proj.held", 30)
    store = Store(_engine(app))
    store.set_paused("held", True, utcnow())
    path = exported(app, tmp_path)
    store.set_stopped("held", StopReason.STOP_SCHEDULE, utcnow())
    result = run(app, "import", str(path), "--apply")
    assert result.exit_code == 0, result.output
    (row,) = store.schedules(["held"])
    assert (row.paused, row.stopped, row.stop_reason) == (True, False, None)
