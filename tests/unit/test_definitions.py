"""A schedule's definition as data: stored as row JSON and rebuilt from the row alone.

``definitions.define`` validates an entry and turns its timing into JSON; ``from_row``
rebuilds a spec from a row (what a beat does for a schedule it has no entry of its own for).
A round trip must give the same grid: the rebuilt spec's next ticks equal the original's, for
every schedule kind Celery has (number, timedelta, ``schedule``, crontab with set, list and
range fields in a non-UTC app time zone, solar).
"""

from __future__ import annotations

import itertools
import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import celery
import pytest
from celery.schedules import crontab, schedule, solar

from celery_boundedbeat.config.definitions import Resolver, define, from_row, schedule_value, timing_json
from celery_boundedbeat.core.exceptions import ConfigurationError
from celery_boundedbeat.core.spec import Definition
from celery_boundedbeat.core.ticks import first_state
from celery_boundedbeat.core.timing import Timing
from celery_boundedbeat.db.row_state import RUNTIME, apply_state, new_row, write_definition
from celery_boundedbeat.db.tables import ScheduleRow

NOW = datetime(2030, 3, 30, 22, 17, 41, 123456, tzinfo=UTC)  # the night before the EU switch to summer time


def make_app(timezone: str = "UTC") -> celery.Celery:
    app = celery.Celery("t", set_as_current=False)
    app.conf.timezone = timezone
    return app


def row_of(d: Definition) -> ScheduleRow:
    """The row ``add_schedule`` writes, as an in-memory object (through JSON, as a database keeps it)."""
    row = new_row(d.name, NOW, origin=RUNTIME)
    apply_state(row, first_state(d.spec, NOW, random.Random(0)), NOW)
    write_definition(row, d.spec, d.digest, d.timing, origin=RUNTIME)
    for column in ("timing", "policy", "args", "kwargs", "options"):
        setattr(row, column, json.loads(json.dumps(getattr(row, column))))
    return row


def next_ticks(timing: Timing, start: datetime, n: int) -> list[datetime]:
    ticks = [timing.first_at_or_after(start)]
    while len(ticks) < n:
        _count, _tick_at, following = timing.passed(ticks[-1], ticks[-1])
        ticks.append(following)
    return ticks


def entry(value: Any, **extra: Any) -> dict[str, Any]:
    return {"task": "proj.job", "schedule": value, **extra}


INTERVALS = [
    pytest.param(30, 30.0, id="int"),
    pytest.param(2.5, 2.5, id="float"),
    pytest.param(timedelta(minutes=2, milliseconds=500), 120.5, id="timedelta"),
    pytest.param(schedule(run_every=timedelta(seconds=45)), 45.0, id="celery-schedule"),
]


@pytest.mark.parametrize(("value", "every"), INTERVALS)
def test_an_interval_round_trips_to_the_same_grid(value: Any, every: float) -> None:
    """Numbers, timedeltas and celery schedules are stored as an interval of seconds and rebuilt equal."""
    app = make_app()
    d = define("job", entry(value), app, {})
    assert d.timing == {"kind": "interval", "every": every}
    rebuilt = from_row(row_of(d), app)
    assert (rebuilt.spec.period, rebuilt.spec.schedule_repr) == (every, d.spec.schedule_repr)
    assert next_ticks(rebuilt.spec.timing, NOW, 5) == next_ticks(d.spec.timing, NOW, 5)
    assert rebuilt.digest == d.digest


CRONTABS = [
    pytest.param(dict(minute=0, hour=3), id="nightly"),
    pytest.param(dict(minute={0, 30}, hour=[1, 2, 3, 9, 17], day_of_week="mon-fri"), id="set-and-list"),
    pytest.param(dict(minute=range(0, 60, 20), hour="*/4"), id="range-and-step"),
    pytest.param(dict(minute=15, hour=2, day_of_month="1,15", month_of_year="3-10"), id="days-and-months"),
]


@pytest.mark.parametrize("fields", CRONTABS)
@pytest.mark.parametrize("zone", ["Europe/Berlin", "America/New_York", "UTC"])
def test_a_crontab_round_trips_to_the_same_grid_in_the_app_time_zone(
    fields: dict[str, Any], zone: str
) -> None:
    """A crontab keeps its fields and time zone; the rebuilt grid ticks at the same instants, DST included."""
    app = make_app(zone)
    d = define("job", entry(crontab(app=app, **fields)), app, {})
    assert d.timing is not None
    assert (d.timing["kind"], d.timing["timezone"]) == ("crontab", zone)
    rebuilt = from_row(row_of(d), app)
    original = next_ticks(d.spec.timing, NOW, 12)
    assert next_ticks(rebuilt.spec.timing, NOW, 12) == original
    assert len(set(original)) == 12 and original == sorted(original)


def test_a_crontab_keeps_the_zone_it_was_made_in_when_the_app_time_zone_changes() -> None:
    """A stored crontab keeps wall-clock time in its stored zone, not in a later app's time zone."""
    berlin = make_app("Europe/Berlin")
    d = define("job", entry(crontab(minute=0, hour=9, app=berlin)), berlin, {})
    rebuilt = from_row(row_of(d), make_app("Asia/Tokyo"))
    ticks = next_ticks(rebuilt.spec.timing, NOW, 3)
    assert [t.astimezone(ZoneInfo("Europe/Berlin")).hour for t in ticks] == [9, 9, 9]
    assert ticks == next_ticks(d.spec.timing, NOW, 3)


def test_a_crontab_round_trip_keeps_the_schedule_text_and_digest() -> None:
    """A crontab with set and range fields rebuilt from its row shows the same schedule and digest.

    The digest and the schedule text are what ``update_schedule`` compares: a rebuilt text that
    differs (``[0, 30]`` for ``{0, 30}``) makes a change of only the args look like a new timing.
    """
    app = make_app("Europe/Berlin")
    d = define("job", entry(crontab(minute={0, 30}, hour=range(8, 10), app=app)), app, {})
    rebuilt = from_row(row_of(d), app)
    assert rebuilt.spec.schedule_repr == d.spec.schedule_repr
    assert rebuilt.digest == d.digest


@pytest.mark.parametrize("event", ["sunset", "dawn_civil", "dusk_nautical"])
def test_a_solar_schedule_round_trips_to_the_same_grid(event: str) -> None:
    """A solar event is stored with its coordinates; the rebuilt grid ticks at the same instants (to 1 s)."""
    pytest.importorskip("ephem", reason="celery's solar schedules need the ephem package")
    app = make_app("Europe/Berlin")
    d = define("job", entry(solar(event, 52.52, 13.405, app=app)), app, {})
    assert d.timing == {
        "kind": "solar",
        "event": event,
        "lat": 52.52,
        "lon": 13.405,
        "timezone": "Europe/Berlin",
    }
    rebuilt = from_row(row_of(d), app)
    start = datetime.now(UTC)
    original = next_ticks(d.spec.timing, start, 4)
    again = next_ticks(rebuilt.spec.timing, start, 4)
    assert all(abs((a - b).total_seconds()) < 1 for a, b in zip(original, again, strict=True)), (
        original,
        again,
    )
    assert all(later - earlier > timedelta(hours=12) for earlier, later in itertools.pairwise(original))


def test_a_solar_noon_grid_has_one_tick_per_noon() -> None:
    """The tick after a solar noon is the next day's noon, so a beat just past noon counts one tick, not two.

    Celery's ``solar_noon`` is ephem's next transit from a start time, which is the same transit
    again when started at it; the grid must still move a day on.
    """
    pytest.importorskip("ephem", reason="celery's solar schedules need the ephem package")
    app = make_app()
    timing = define("job", entry(solar("solar_noon", 52.52, 13.405, app=app)), app, {}).spec.timing
    noon = timing.first_at_or_after(datetime.now(UTC))
    count, _tick_at, following = timing.passed(noon, noon + timedelta(seconds=1))
    assert count == 1 and following - noon > timedelta(hours=23), (noon, following)


def test_the_whole_definition_round_trips() -> None:
    """Task, args, kwargs, options and the merged policy come back from the row as they were given."""
    app = make_app()
    raw = entry(
        7,
        args=[1, "two"],
        kwargs={"k": [1, 2]},
        options={"queue": "q", "priority": 3},
        policy={
            "mode": "fixed_rate",
            "max_concurrency": 2,
            "max_runs": 4,
            "end_at": "2031-01-01T00:00:00+02:00",
        },
    )
    d = define("job", raw, app, {"max_run_time": 30})
    rebuilt = from_row(row_of(d), app)
    spec = rebuilt.spec
    assert (spec.task, spec.args, dict(spec.kwargs), dict(spec.options)) == (
        "proj.job",
        (1, "two"),
        {"k": [1, 2]},
        {"queue": "q", "priority": 3},
    )
    assert spec.policy == d.spec.policy
    assert spec.policy.end_at == datetime(2030, 12, 31, 22, tzinfo=UTC)
    assert spec.policy.max_run_time == 30  # the default policy merged in when it was defined
    assert rebuilt.digest == d.digest and rebuilt.timing == d.timing


@pytest.mark.parametrize(
    ("timing", "reason"),
    [
        (None, "is not stored"),
        ({"kind": "cron"}, "unknown kind 'cron'"),
        ({"kind": "interval"}, "cannot be read back"),
        ({"kind": "crontab", "minute": "61", "timezone": "UTC"}, "minute must be 0-59"),
        ({"kind": "crontab", "minute": "0", "timezone": "Mars/Olympus"}, "cannot be read back"),
        ({"kind": "interval", "every": 0}, "period must be > 0"),
    ],
)
def test_a_row_that_cannot_be_rebuilt_is_refused_naming_the_schedule(timing: Any, reason: str) -> None:
    """A row whose timing is missing or unreadable raises ConfigurationError naming the schedule and key."""
    app = make_app()
    row = row_of(define("broken", entry(10), app, {}))
    row.timing = timing
    with pytest.raises(ConfigurationError) as info:
        from_row(row, app)
    (name, key, text), *_ = info.value.problems
    assert name == "broken" and key in {"timing", "schedule", "minute"}, info.value.problems
    assert reason in text, info.value.problems


def test_the_resolver_rebuilds_a_row_only_when_its_version_changes() -> None:
    """Resolver caches each row's spec by version: same version same object, a new version a new spec."""
    app = make_app()
    row = row_of(define("job", entry(10), app, {}))
    resolve = Resolver(app, {})
    first = resolve(row)
    assert first is not None and first.period == 10
    assert resolve(row) is first
    changed = define("job", entry(20), app, {})
    write_definition(row, changed.spec, changed.digest, changed.timing, origin=RUNTIME)
    row.version += 1
    second = resolve(row)
    assert second is not None and second.period == 20


def test_the_resolver_skips_an_unreadable_row_and_names_it() -> None:
    """A row the resolver cannot rebuild gives None (not run) and is listed in ``unusable``."""
    app = make_app()
    row = row_of(define("job", entry(10), app, {}))
    row.timing = {"kind": "nonsense"}
    resolve = Resolver(app, {})
    assert resolve(row) is None
    assert "nonsense" in resolve.unusable["job"]


def test_timing_json_and_schedule_value_are_inverse_for_a_crontab() -> None:
    """schedule_value(timing_json(c)) is a crontab with the same fields and the stored zone."""
    app = make_app("Europe/Berlin")
    cron = crontab(minute="*/15", hour="9-17", day_of_week="mon,wed", app=app)
    data = timing_json(cron, app)
    value, zone = schedule_value("job", data, app)
    assert isinstance(value, crontab) and zone == ZoneInfo("Europe/Berlin")
    assert (value.minute, value.hour, value.day_of_week) == (cron.minute, cron.hour, cron.day_of_week)


def test_a_solar_grid_is_asked_about_the_time_it_is_given_not_the_wall_clock() -> None:
    """The sunset after a day in June 2020 is that evening's (about 19:33 UTC in Berlin), whenever asked."""
    pytest.importorskip("ephem", reason="celery's solar schedules need the ephem package")
    app = make_app()
    timing = define("job", entry(solar("sunset", 52.52, 13.405, app=app)), app, {}).spec.timing
    sunset = timing.first_at_or_after(datetime(2020, 6, 21, 12, tzinfo=UTC))
    assert datetime(2020, 6, 21, 19, 25, tzinfo=UTC) < sunset < datetime(2020, 6, 21, 19, 45, tzinfo=UTC)
    assert timing.first_at_or_after(datetime(2020, 6, 21, 12, tzinfo=UTC)) == sunset
