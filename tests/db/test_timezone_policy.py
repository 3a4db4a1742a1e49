"""The ``timezone`` policy key: validated like every key, stored with the grid, shown in status.

Validation is pure (``validate_entries``, what beat, ``check`` and ``simulate`` use); the API and
the command line are checked to refuse with the same text, and the stored zone to follow the
key through ``add``, ``update``, a rebuild from the row and config reconciling, on SQLite and
on PostgreSQL.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from celery.schedules import crontab, solar
from click.testing import CliRunner, Result
from sqlalchemy import Engine

from celery_boundedbeat import ConfigurationError, add_schedule, snapshot, update_schedule
from celery_boundedbeat.cli import boundedbeat
from celery_boundedbeat.config.definitions import config_definitions, define, from_row
from celery_boundedbeat.config.entries import validate_entries
from celery_boundedbeat.db.store import Store, utcnow
from celery_boundedbeat.db.tables import ScheduleRow

RNG = random.Random(3)
BERLIN = ZoneInfo("Europe/Berlin")


def cron_entry(**policy: Any) -> dict[str, Any]:
    return {"task": "proj.t", "schedule": crontab(minute=30, hour=2), "policy": policy}


def problems_of(entries: dict[str, Any], default: dict[str, Any] | None = None) -> str:
    with pytest.raises(ConfigurationError) as info:
        validate_entries(entries, default or {})
    return str(info.value)


# -- validation -------------------------------------------------------------------------------


def test_an_unknown_zone_names_the_entry_the_key_and_the_value() -> None:
    """A misspelt IANA name is refused naming entry, key and the name given."""
    text = problems_of({"nightly": cron_entry(timezone="Europe/Berln")})
    assert "entry 'nightly', key 'policy.timezone': unknown time zone 'Europe/Berln'" in text


@pytest.mark.parametrize("value", [1, "", "../etc/passwd", ["Europe/Berlin"], UTC])
def test_a_zone_that_is_not_a_name_is_refused(value: Any) -> None:
    """Numbers, lists, empty strings, paths and a fixed offset without an IANA name are not zone names."""
    text = problems_of({"nightly": cron_entry(timezone=value)})
    assert "key 'policy.timezone'" in text


def test_a_zone_on_an_interval_entry_is_refused() -> None:
    """An interval has no wall clock: its own ``timezone`` key is an error saying so."""
    text = problems_of({"often": {"task": "t", "schedule": 30, "policy": {"timezone": "Europe/Berlin"}}})
    assert "entry 'often', key 'policy.timezone': is only for crontab and solar schedules" in text


def test_a_default_zone_applies_to_calendar_entries_and_skips_intervals() -> None:
    """``boundedbeat_default_policy`` may carry a zone: crontabs get it, intervals are not refused."""
    specs = validate_entries(
        {"often": {"task": "t", "schedule": 30}, "nightly": cron_entry()}, {"timezone": "Europe/Berlin"}
    )
    assert specs["often"].timezone is None and specs["often"].policy.timezone is None
    assert specs["nightly"].timezone == "Europe/Berlin" == specs["nightly"].policy.timezone


def test_a_bad_default_zone_is_reported_once_against_the_setting() -> None:
    """A broken default zone is blamed on the setting, not on every entry."""
    text = problems_of({"often": {"task": "t", "schedule": 30}}, {"timezone": "Mars/Olympus"})
    assert "entry 'boundedbeat_default_policy', key 'policy.timezone': unknown time zone" in text
    assert "'often'" not in text


def test_a_zoneinfo_object_is_accepted_and_kept_as_its_name() -> None:
    """``ZoneInfo("Europe/Berlin")`` is as good as the name, and stored as the name."""
    spec = validate_entries({"nightly": cron_entry(timezone=BERLIN)}, {})["nightly"]
    assert spec.policy.timezone == "Europe/Berlin"
    assert spec.policy.to_json()["timezone"] == "Europe/Berlin"


def test_a_policy_without_the_key_keeps_its_json_and_digest() -> None:
    """The key is stored only when set: interval schedules keep the digest they had before it existed."""
    app = Celery("tz", set_as_current=False)
    d = define("often", {"task": "t", "schedule": 30}, app, {})
    assert "timezone" not in d.spec.policy.to_json()
    assert d.digest == define("often", {"task": "t", "schedule": 30.0}, app, {}).digest


# -- the key and the stored zone agree ---------------------------------------------------------


def test_the_key_wins_over_the_app_zone_and_is_the_stored_zone() -> None:
    """In a Tokyo app a Berlin key decides the grid; timing JSON and spec say Berlin."""
    app = Celery("tz", set_as_current=False)
    app.conf.timezone = "Asia/Tokyo"
    d = define("nightly", cron_entry(timezone="Europe/Berlin"), app, {})
    assert d.timing is not None and d.timing["timezone"] == "Europe/Berlin" == d.spec.timezone
    first = d.spec.timing.first_at_or_after(datetime(2026, 6, 1, tzinfo=UTC))
    assert first.astimezone(BERLIN).strftime("%H:%M") == "02:30"
    plain = define("nightly", cron_entry(), app, {})
    assert plain.spec.timezone == "Asia/Tokyo" and plain.digest != d.digest


def test_a_solar_schedule_takes_the_key_and_shows_it() -> None:
    """A solar event is an instant wherever it is seen: the zone is stored and shown, the grid unchanged."""
    pytest.importorskip("ephem", reason="celery's solar schedules need the ephem package")
    app = Celery("tz", set_as_current=False)
    entry = {"task": "t", "schedule": solar("sunset", 52.52, 13.405, app=app)}
    plain = define("dusk", entry, app, {})
    zoned = define("dusk", {**entry, "policy": {"timezone": "Europe/Berlin"}}, app, {})
    assert (plain.spec.timezone, zoned.spec.timezone) == ("UTC", "Europe/Berlin")
    assert zoned.timing is not None and zoned.timing["timezone"] == "Europe/Berlin"
    start = datetime(2026, 6, 1, 12, tzinfo=UTC)
    assert plain.spec.timing.first_at_or_after(start) == zoned.spec.timing.first_at_or_after(start)


# -- through the API, the command line and a database ---------------------------------------


@pytest.fixture
def app(migrated: Engine, db_url: str) -> Celery:
    app = Celery("tzapi", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    app.conf.timezone = "America/New_York"
    return app


@pytest.fixture
def store(engine: Engine, app: Celery) -> Store:
    return Store(engine)


def run(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(boundedbeat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None))


def shown(app: Celery) -> dict[str, dict[str, Any]]:
    result = run(app, "status", "--json")
    assert result.exit_code == 0, result.output
    return {row["name"]: row for row in json.loads(result.output)}


def test_beat_the_api_and_the_cli_refuse_a_bad_zone_with_the_same_text(app: Celery, store: Store) -> None:
    """One message from every door, and nothing written."""
    beat_text = problems_of({"nightly": cron_entry(timezone="Europe/Berln")})
    with pytest.raises(ConfigurationError) as api:
        add_schedule(
            app, "nightly", "proj.t", crontab(minute=30, hour=2), policy={"timezone": "Europe/Berln"}
        )
    cli = run(
        app, "add", "nightly", "proj.t", "--crontab", "30 2 * * *", "--policy", '{"timezone": "Europe/Berln"}'
    )
    assert str(api.value) == beat_text
    assert cli.exit_code == 1 and beat_text in cli.output, cli.output
    assert store.schedules() == []


def test_status_shows_the_zone_of_each_schedule(app: Celery, store: Store) -> None:
    """status --json has ``timezone`` (the key, else the app's; null for an interval); the table too."""
    add_schedule(app, "berlin", "proj.t", crontab(minute=30, hour=2), policy={"timezone": "Europe/Berlin"})
    add_schedule(app, "local", "proj.t", crontab(minute=30, hour=2))
    add_schedule(app, "often", "proj.t", 30)
    rows = shown(app)
    assert {name: row["timezone"] for name, row in rows.items()} == {
        "berlin": "Europe/Berlin",
        "local": "America/New_York",
        "often": None,
    }
    table = run(app, "status", "--wide").output.splitlines()
    assert "TIMEZONE" in table[0]
    assert "Europe/Berlin" in next(line for line in table if line.startswith("berlin"))
    assert {s.name: s.timezone for s in snapshot(app)} == {k: v["timezone"] for k, v in rows.items()}


def test_the_zone_survives_a_rebuild_from_the_row_in_another_zones_beat(app: Celery, store: Store) -> None:
    """A beat whose app has another time zone runs the stored schedule in the key's zone."""
    add_schedule(app, "berlin", "proj.t", crontab(minute=30, hour=2), policy={"timezone": "Europe/Berlin"})
    (row,) = store.schedules(["berlin"])
    tokyo = Celery("tokyo", set_as_current=False)
    tokyo.conf.timezone = "Asia/Tokyo"
    spec = from_row(row, tokyo).spec
    assert spec.timezone == "Europe/Berlin"
    assert row.next_due_at is not None and row.next_due_at.astimezone(BERLIN).strftime("%H:%M") == "02:30"
    assert spec.timing.first_at_or_after(row.next_due_at) == row.next_due_at


def test_update_moves_the_grid_to_a_new_zone_and_back_to_the_apps(app: Celery, store: Store) -> None:
    """A new ``timezone`` restarts the grid at the new zone's 02:30; dropping it returns to the app's zone;
    changing only the args keeps the zone and the due time."""
    add_schedule(app, "nightly", "proj.t", crontab(minute=30, hour=2), policy={"timezone": "Europe/Berlin"})
    update_schedule(app, "nightly", policy={"timezone": "Asia/Tokyo"})
    (row,) = store.schedules(["nightly"])
    assert row.timing is not None and row.timing["timezone"] == "Asia/Tokyo"
    assert row.next_due_at is not None and row.next_due_at.astimezone(ZoneInfo("Asia/Tokyo")).hour == 2
    assert row.next_due_at - utcnow() <= timedelta(days=1)
    update_schedule(app, "nightly", args=[1])
    (same,) = store.schedules(["nightly"])
    assert same.timing == row.timing and same.next_due_at == row.next_due_at
    update_schedule(app, "nightly", policy={"timezone": None})
    (back,) = store.schedules(["nightly"])
    assert back.timing is not None and back.timing["timezone"] == "America/New_York"
    assert back.next_due_at is not None
    assert back.next_due_at.astimezone(ZoneInfo("America/New_York")).strftime("%H:%M") == "02:30"
    assert "timezone" not in back.policy


def test_a_config_crontab_follows_a_changed_app_zone_at_the_next_beat_start(
    app: Celery, store: Store
) -> None:
    """Reconciling sees a new app time zone as a change: the stored zone and the grid move with it."""

    def beat_app(zone: str) -> Celery:  # a beat process of its own: the app's zone is read once
        new = Celery("tzbeat", broker="memory://", set_as_current=False)
        new.conf.update(app.conf)
        new.conf.timezone = zone
        new.conf.beat_schedule = {
            "nightly": {"task": "proj.t", "schedule": crontab(minute=30, hour=2, app=new)}
        }
        return new

    now = utcnow()
    store.sync_config(config_definitions(beat_app("America/New_York"), {}).values(), now, RNG)
    berlin = beat_app("Europe/Berlin")
    report = store.sync_config(config_definitions(berlin, {}).values(), now, RNG)
    assert report.changed == ["nightly"]
    (row,) = store.schedules(["nightly"])
    assert row.timing is not None and row.timing["timezone"] == "Europe/Berlin"
    assert row.next_due_at is not None and row.next_due_at.astimezone(BERLIN).strftime("%H:%M") == "02:30"
    assert shown(berlin)["nightly"]["timezone"] == "Europe/Berlin"


def test_a_zoned_crontab_becomes_an_interval_only_with_the_zone_dropped(app: Celery, store: Store) -> None:
    """The stored key would be a zone on an interval: refused, unless the same update drops it."""
    add_schedule(app, "nightly", "proj.t", crontab(minute=30, hour=2), policy={"timezone": "Europe/Berlin"})
    with pytest.raises(ConfigurationError, match=r"policy\.timezone'?: is only for crontab and solar"):
        update_schedule(app, "nightly", schedule=30)
    update_schedule(app, "nightly", schedule=30, policy={"timezone": None})
    (row,) = store.schedules(["nightly"])
    assert row.timing == {"kind": "interval", "every": 30.0} and "timezone" not in row.policy
    assert shown(app)["nightly"]["timezone"] is None


def test_a_config_crontab_stored_before_the_zone_counted_keeps_its_grid_and_counters(
    app: Celery, store: Store
) -> None:
    """A row whose digest left the zone out (an older release) is reconciled as changed once: the
    version goes up, the due time, grid and counters stay."""
    app.conf.beat_schedule = {"nightly": {"task": "proj.t", "schedule": crontab(minute=30, hour=2, app=app)}}
    now = utcnow()
    store.sync_config(config_definitions(app, {}).values(), now, RNG)
    with store.session() as s:
        stored = s.get(ScheduleRow, "nightly")
        assert stored is not None
        stored.config_hash, stored.runs, stored.skips = "digest-of-an-older-release", 7, 2
    (before,) = store.schedules(["nightly"])
    report = store.sync_config(config_definitions(app, {}).values(), now + timedelta(minutes=5), RNG)
    (after,) = store.schedules(["nightly"])
    assert report.changed == ["nightly"] and after.version == before.version + 1
    assert (after.grid_at, after.next_due_at, after.runs, after.skips) == (
        before.grid_at,
        before.next_due_at,
        7,
        2,
    )
