"""Schedules as code: ``boundedbeat export`` then ``import FILE`` into an empty database, exactly.

Runtime schedules of every timing (interval, crontab in a zone, solar) and state (paused,
stopped) are exported as JSON and YAML by ``celery -A <app> boundedbeat export``; imported
into a second, empty database by another app; exported from there again: the files are
identical. A dry run changes nothing, a second ``--apply`` finds everything
``already_present``, and ``--prune`` removes the runtime schedules the file lacks while an
update brings back what differs. On SQLite and on PostgreSQL.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pgtools
import pytest
from celery import Celery
from celery.schedules import crontab, solar

from celery_boundedbeat import add_schedule, update_schedule
from celery_boundedbeat.core.enums import StopReason
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.store import Store, utcnow

from .harness import Harness
from .processes import CELERY
from .test_importers import actions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@contextlib.contextmanager
def second_database(bb: Harness) -> Iterator[str]:
    """An empty database of the backend's kind, for the app that imports."""
    if bb.backend.is_postgres:
        with pgtools.throwaway_database("bbexp") as database:
            yield database.url
    else:
        yield f"sqlite:///{bb.tmp / 'second.sqlite3'}"


def second_app(bb: Harness, url: str) -> str:
    """A copy of the test's app module on ``url``; its module name."""
    module = f"{bb.module}_b"
    source = (bb.tmp / f"{bb.module}.py").read_text().replace(bb.backend.database_url, url)
    (bb.tmp / f"{module}.py").write_text(source)
    return module


def app_on(url: str) -> Celery:
    app = Celery("exp", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = url
    app.conf.timezone = "UTC"
    return app


def fill(app: Celery, work: str) -> None:
    """Schedules of every timing, with arguments, options and policies, one paused, one stopped."""
    start = datetime(2031, 1, 1, 9, 30, tzinfo=UTC)
    add_schedule(
        app,
        "exp-interval",
        work,
        45.5,
        args=[1, "two"],
        kwargs={"name": "exp-interval", "nested": {"k": [1, 2]}},
        options={"queue": "q1", "priority": 7, "headers": {"tenant": "t1"}},
        policy={
            "missed_ticks": "catch_up",
            "max_pending": 3,
            "jitter": 2,
            "start_at": start,
            "end_at": start + timedelta(days=30),
            "keep_runs": 50,
        },
    )
    add_schedule(
        app,
        "exp-cron",
        work,
        crontab(minute="15", hour="2-5"),
        policy={"timezone": "Europe/Berlin", "max_runs": 4},
    )
    add_schedule(app, "exp-solar", work, solar("sunset", 52.52, 13.405), kwargs={"name": "exp-solar"})
    add_schedule(app, "exp-delay", work, 600, policy={"mode": "fixed_delay", "max_run_time": 30})
    add_schedule(app, "exp-paused", work, 3600)
    add_schedule(app, "exp-stopped", work, 7200)
    store = Store(get_engine(app.conf.boundedbeat_database_url))
    store.set_paused("exp-paused", True, utcnow())
    store.set_stopped("exp-stopped", StopReason.STOP_SCHEDULE, utcnow())


def test_export_then_import_into_an_empty_database_recreates_every_schedule_exactly(bb: Harness) -> None:
    """export, import on an empty database, export again: the same JSON and YAML, and nothing left to do."""
    bb.write_app({})
    bb.migrate()
    fill(app_on(bb.backend.database_url), f"{bb.module}.work")
    first_json = bb.celery("boundedbeat", "export", check=True).stdout
    bb.celery("boundedbeat", "export", "--output", str(bb.tmp / "first.yaml"), check=True)
    (bb.tmp / "first.json").write_text(first_json)
    assert [s["name"] for s in json.loads(first_json)["schedules"]] == [
        "exp-cron",
        "exp-delay",
        "exp-interval",
        "exp-paused",
        "exp-solar",
        "exp-stopped",
    ]

    with second_database(bb) as url:
        module = second_app(bb, url)

        def other(*args: str) -> str:
            """``celery -A <second app> boundedbeat ...``, which must exit 0."""
            result = _celery(bb, module, "boundedbeat", *args)
            assert result.returncode == 0, result.stdout + result.stderr
            return result.stdout

        other("migrate")
        dry = other("import", str(bb.tmp / "first.json"))
        assert set(actions(dry).values()) == {"add"} and len(actions(dry)) == 6, dry
        assert Store(get_engine(url)).schedules() == []
        applied = other("import", str(bb.tmp / "first.json"), "--apply")
        assert set(actions(applied).values()) == {"added"}, applied
        assert other("export") == first_json
        other("export", "--output", str(bb.tmp / "second.yaml"))
        assert (bb.tmp / "second.yaml").read_text() == (bb.tmp / "first.yaml").read_text()
        again = other("import", str(bb.tmp / "first.yaml"), "--apply")
        assert set(actions(again).values()) == {"already_present"}, again
        assert again.rstrip().endswith("nothing to change")

        imported = app_on(url)
        add_schedule(imported, "exp-extra", f"{bb.module}.work", 60)
        update_schedule(imported, "exp-interval", kwargs={"name": "changed"})
        Store(get_engine(url)).set_paused("exp-delay", True, utcnow())
        kept = other("import", str(bb.tmp / "first.json"), "--apply")
        assert set(actions(kept)) == set(actions(dry)), kept  # without --prune: exp-extra is not touched
        assert actions(kept)["exp-interval"] == actions(kept)["exp-delay"] == "updated", kept
        assert "exp-extra" in [s["name"] for s in json.loads(other("export"))["schedules"]]
        pruned = other("import", str(bb.tmp / "first.json"), "--prune", "--apply")
        table = actions(pruned)
        assert table["exp-extra"] == "removed", pruned
        assert other("export") == first_json
        assert Store(get_engine(url)).schedules(["exp-extra"]) == []
        get_engine(url).dispose()


def _celery(bb: Harness, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CELERY, "-A", module, *args],
        cwd=bb.tmp,
        env=bb.env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )
