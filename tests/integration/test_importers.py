"""``boundedbeat import`` from a real django-celery-beat database and RedBeat store, then a real beat.

django-celery-beat's tables are made and filled by its own models in a separate process (a
small Django project, ``dcb_project``), on SQLite or PostgreSQL like the backend; RedBeat's
keys are written by RedBeat itself. Each import goes through ``celery -A <app> boundedbeat
import`` in a subprocess: a dry run changes nothing, ``--apply`` adds, a second ``--apply``
finds everything ``already_present``, and a schedule that cannot be mapped exits 78 with its
reason. Then ``celery beat`` runs the imported schedules: each continues django-celery-beat's
grid (no run at or before its ``last_run_at``), and a clocked or start-time one-off runs at its
time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pgtools
import pytest

from .harness import Harness
from .reads import epoch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROJECT = Path(__file__).resolve().parent / "dcb_project"
EX_CONFIG = 78


def now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture
def dcb(bb: Harness) -> Iterator[tuple[str, str]]:
    """django-celery-beat's database as ``(DCB_DATABASE for dcb_settings, SQLAlchemy URL)``."""
    if bb.backend.is_postgres:
        with pgtools.throwaway_database("bbdcb") as database:
            yield f"postgresql:{database.name}", database.url
    else:
        path = bb.tmp / "dcb.sqlite3"
        yield f"sqlite:{path}", f"sqlite:///{path}"


def write_dcb(bb: Harness, database: str, specs: list[dict[str, Any]]) -> dict[str, Any]:
    """Create the tasks through django-celery-beat's models; what its beat would send each with."""
    env = {
        **bb.env,
        "DCB_DATABASE": database,
        "DJANGO_SETTINGS_MODULE": "dcb_settings",
        "PYTHONPATH": str(PROJECT),
    }
    done = subprocess.run(
        [sys.executable, str(PROJECT / "dcb_write.py"), json.dumps(specs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    sent: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return sent


def import_dcb(bb: Harness, *args: str, orm_database: str | None = None) -> subprocess.CompletedProcess[str]:
    """``boundedbeat import django-celery-beat``: with ``orm_database``, through Django's ORM."""
    saved = dict(bb.env)
    if orm_database is not None:
        bb.env.update(
            DCB_DATABASE=orm_database,
            DJANGO_SETTINGS_MODULE="dcb_settings",
            PYTHONPATH=f"{bb.tmp}:{PROJECT}",
        )
    try:
        return bb.celery("boundedbeat", "import", "django-celery-beat", *args)
    finally:
        bb.env.clear()
        bb.env.update(saved)


def actions(output: str) -> dict[str, str]:
    """The ACTION column of an import's table, by schedule name."""
    lines = output.splitlines()
    start = lines[0].index("ACTION")
    return {line.split()[0]: line[start:].strip() for line in lines[2:] if line and not line[0].isdigit()}


def stored(bb: Harness, name: str) -> dict[str, Any]:
    rows = bb.sql(
        "SELECT args, kwargs, options, policy, paused, next_due_at FROM boundedbeat_schedules "
        "WHERE name = :n",
        n=name,
    )
    assert len(rows) == 1, rows
    row = rows[0]
    for key in ("args", "kwargs", "options", "policy"):
        if isinstance(row[key], str):
            row[key] = json.loads(row[key])
    return row


def iso(t: datetime) -> str:
    return t.isoformat()


def test_django_celery_beat_schedules_imported_then_run_by_beat_where_it_left_them(
    bb: Harness, dcb: tuple[str, str]
) -> None:
    """Every kind and flag maps; a dry run changes nothing; beat continues each grid with no double run."""
    database, url = dcb
    bb.write_app({})
    bb.migrate()
    t0 = now()
    work = f"{bb.module}.work"
    last = t0 - timedelta(seconds=1, microseconds=250_000)

    def kw(name: str) -> str:
        return json.dumps({"name": name, "durations": [0.05]})

    cron = {"minute": "*/5", "hour": "*", "day_of_week": "*", "day_of_month": "*", "month_of_year": "*"}
    specs = [
        {
            "name": "dcb-interval",
            "task": work,
            "kind": "interval",
            "every": [2, "seconds"],
            "kwargs": kw("dcb-interval"),
            "queue": bb.queue,
            "priority": 3,
            "headers": '{"tenant": "t1"}',
            "expire_seconds": 60,
            "last_run_at": iso(last),
        },
        {
            "name": "dcb-clocked",
            "task": work,
            "kind": "clocked",
            "clocked": iso(t0 - timedelta(seconds=2)),
            "one_off": True,
            "kwargs": kw("dcb-clocked"),
            "queue": bb.queue,
        },
        {
            "name": "dcb-start",
            "task": work,
            "kind": "interval",
            "every": [1, "hours"],
            "one_off": True,
            "start_time": iso(t0 - timedelta(seconds=3)),
            "kwargs": kw("dcb-start"),
            "queue": bb.queue,
        },
        {
            "name": "dcb-later",
            "task": work,
            "kind": "interval",
            "every": [1, "seconds"],
            "start_time": iso(t0 + timedelta(hours=1)),
            "expires": iso(t0 + timedelta(hours=2)),
            "kwargs": kw("dcb-later"),
            "queue": bb.queue,
        },
        {
            "name": "dcb-off",
            "task": work,
            "kind": "interval",
            "every": [1, "seconds"],
            "enabled": False,
            "kwargs": kw("dcb-off"),
            "queue": bb.queue,
        },
        {
            "name": "dcb-cron",
            "task": work,
            "kind": "crontab",
            "crontab": {**cron, "timezone": "Europe/Berlin"},
            "last_run_at": iso(t0),
            "kwargs": kw("dcb-cron"),
            "queue": bb.queue,
        },
        {
            "name": "dcb-solar",
            "task": work,
            "kind": "solar",
            "solar": ["sunset", 52.5, 13.4],
            "last_run_at": iso(t0),
            "kwargs": kw("dcb-solar"),
            "queue": bb.queue,
        },
    ]
    sent = write_dcb(bb, database, specs)
    names = sorted(s["name"] for s in specs)

    dry = import_dcb(bb, "--database-url", url)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert actions(dry.stdout) == dict.fromkeys(names, "add"), dry.stdout
    assert "dry run, nothing changed" in dry.stdout
    assert bb.schedules() == {}

    applied = import_dcb(bb, "--apply", orm_database=database)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert actions(applied.stdout) == dict.fromkeys(names, "added"), applied.stdout
    again = import_dcb(bb, "--database-url", url, "--apply")
    assert again.returncode == 0, again.stdout + again.stderr
    assert actions(again.stdout) == dict.fromkeys(names, "already_present"), again.stdout
    assert again.stdout.rstrip().endswith("nothing to change")

    for name in names:  # arguments and message options exactly as django-celery-beat sends them
        row = stored(bb, name)
        mine, theirs = dict(row["options"]), dict(sent[name]["options"])
        if isinstance(theirs.get("expires"), str):  # a datetime there, ISO 8601 text here
            assert datetime.fromisoformat(mine.pop("expires")) == datetime.fromisoformat(
                theirs.pop("expires")
            )
        assert (row["args"], row["kwargs"], mine) == (sent[name]["args"], sent[name]["kwargs"], theirs), name
    assert stored(bb, "dcb-off")["paused"]
    later = stored(bb, "dcb-later")
    assert later["policy"]["start_at"] == iso(t0 + timedelta(hours=1))
    assert later["policy"]["end_at"] == iso(t0 + timedelta(hours=2))
    assert stored(bb, "dcb-cron")["policy"]["timezone"] == "Europe/Berlin"

    bb.start_worker()
    bb.start_beat()
    bb.wait_until(
        lambda: (
            len(bb.finished("dcb-interval")) >= 2 and bb.finished("dcb-clocked") and bb.finished("dcb-start")
        ),
        timeout=60,
        what="the imported schedules to run",
    )
    interval = bb.runs("dcb-interval")
    assert all(r.scheduled_for > last for r in interval), "a run repeats django-celery-beat's last run"
    offsets = [(epoch(r.scheduled_for) - epoch(last)) / 2.0 for r in interval]
    assert all(abs(o - round(o)) < 0.005 for o in offsets), offsets  # django-celery-beat's grid, continued
    assert [r.scheduled_for for r in bb.runs("dcb-clocked")] == [t0 - timedelta(seconds=2)]
    assert [r.scheduled_for for r in bb.runs("dcb-start")] == [t0 - timedelta(seconds=3)]
    bb.watch(1.5, lambda: None)
    assert len(bb.runs("dcb-clocked")) == len(bb.runs("dcb-start")) == 1  # one-offs run once
    assert bb.runs("dcb-later") == bb.runs("dcb-off") == []
    assert stored(bb, "dcb-later")["next_due_at"].replace(tzinfo=UTC) == t0 + timedelta(hours=1)
    bb.assert_no_errors()


def test_a_schedule_that_cannot_be_mapped_is_refused_with_exit_78_and_the_rest_still_import(
    bb: Harness, dcb: tuple[str, str]
) -> None:
    """Bad args JSON is refused on its own line with the reason; exit 78 in the dry run and the applies."""
    database, url = dcb
    bb.write_app({})
    bb.migrate()
    work = f"{bb.module}.work"
    write_dcb(
        bb,
        database,
        [
            {"name": "good", "task": work, "kind": "interval", "every": [5, "minutes"]},
            {"name": "bad", "task": work, "kind": "interval", "every": [5, "minutes"], "kwargs": "{not json"},
        ],
    )
    dry = import_dcb(bb, "--database-url", url)
    assert dry.returncode == EX_CONFIG, dry.stdout + dry.stderr
    table = actions(dry.stdout)
    assert table["good"] == "add"
    assert table["bad"].startswith("refused: kwargs is not JSON"), dry.stdout
    assert bb.schedules() == {}
    first = import_dcb(bb, "--database-url", url, "--apply")
    second = import_dcb(bb, "--database-url", url, "--apply")
    assert (first.returncode, second.returncode) == (EX_CONFIG, EX_CONFIG)
    assert actions(first.stdout)["good"] == "added"
    assert actions(second.stdout)["good"] == "already_present"
    assert set(bb.schedules()) == {"good"}


REDBEAT_WRITER = """
import sys
from datetime import datetime, timedelta, timezone
from celery import Celery
from celery.schedules import crontab, schedule
from redbeat import RedBeatSchedulerEntry
from redbeat.schedules import rrule

app = Celery("rbw", broker="redis://127.0.0.1:6379/0")
app.conf.redbeat_redis_url = "redis://127.0.0.1:6379/0"
app.conf.redbeat_key_prefix = sys.argv[1]
last = datetime.fromisoformat(sys.argv[2])
e = RedBeatSchedulerEntry("rb-interval", sys.argv[3], schedule(timedelta(seconds=30)), args=[1, 2],
                          kwargs={"k": "v"}, options={"queue": "q1", "priority": 4}, app=app)
e.save()
e.reschedule(last)
RedBeatSchedulerEntry("rb-cron", sys.argv[3], crontab(minute="*/10"), app=app).save()
RedBeatSchedulerEntry("rb-off", sys.argv[3], schedule(timedelta(minutes=1)), enabled=False, app=app).save()
RedBeatSchedulerEntry("rb-rrule", sys.argv[3], rrule("MINUTELY", interval=5), app=app).save()
"""


@pytest.mark.parametrize("backend", ["sqlite-filesystem"], indirect=True)
def test_a_redbeat_store_written_by_redbeat_imports_once(bb: Harness) -> None:
    """RedBeat's own entries map (interval after last_run_at, crontab, disabled); an rrule is refused."""
    import redis

    bb.write_app({})
    bb.migrate()
    prefix = f"bbrb_{bb.uid}:"
    last = now().replace(microsecond=0) - timedelta(seconds=5)
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        done = subprocess.run(
            [sys.executable, "-c", REDBEAT_WRITER, prefix, iso(last), "proj.tasks.rb"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        url = ("--redis-url", "redis://127.0.0.1:6379/0", "--key-prefix", prefix)
        dry = bb.celery("boundedbeat", "import", "redbeat", *url)
        assert dry.returncode == EX_CONFIG, dry.stdout + dry.stderr
        table = actions(dry.stdout)
        assert {k: v for k, v in table.items() if k != "rb-rrule"} == dict.fromkeys(
            ["rb-cron", "rb-interval", "rb-off"], "add"
        )
        assert table["rb-rrule"].startswith("refused: an rrule schedule has no equivalent here")
        assert bb.schedules() == {}
        bb.celery("boundedbeat", "import", "redbeat", *url, "--apply")
        again = bb.celery("boundedbeat", "import", "redbeat", *url, "--apply")
        assert actions(again.stdout)["rb-interval"] == "already_present"
        row = stored(bb, "rb-interval")
        assert (row["args"], row["kwargs"], row["options"]) == (
            [1, 2],
            {"k": "v"},
            {"queue": "q1", "priority": 4},
        )
        assert row["policy"]["start_at"] == iso(last + timedelta(seconds=30))
        assert stored(bb, "rb-off")["paused"]
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()
