"""Crontab fire times across DST changes, by Vixie cron's rule (docs/policies.md), on a fake clock.

Each case walks a schedule's grid through one spring-forward or fall-back night of
Europe/Berlin, America/New_York or Australia/Lord_Howe (a 30-minute shift) and asserts the
exact UTC fire times: a fixed-hour job whose time does not exist runs once at the end of the
gap, one whose time happens twice runs at the first occurrence, and hourly and 15-minute jobs
keep elapsed time. The grid is built the way beat builds it, from a ``beat_schedule`` entry
with a ``timezone`` policy key, and the same night is also counted in one look (a beat that was
down across it). A Hypothesis property checks any crontab and span against a minute-by-minute
brute force over the zone's own offsets.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import celery
import pytest
from celery.schedules import crontab
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_boundedbeat.config.definitions import define
from celery_boundedbeat.core.timing import Timing
from celery_boundedbeat.core.wallclock import CronFields, next_fire, next_match

APP = celery.Celery("wallclock", set_as_current=False)  # app timezone UTC: the policy key decides

HOURLY = dict(minute=0)
DAILY_0230 = dict(minute=30, hour=2)
EVERY_15 = dict(minute="*/15")


def grid(fields: dict[str, Any], zone: str) -> Timing:
    entry = {"task": "proj.job", "schedule": crontab(app=APP, **fields), "policy": {"timezone": zone}}
    return define("job", entry, APP, {}).spec.timing


def fires_between(timing: Timing, start: datetime, end: datetime) -> list[datetime]:
    """Every grid time in ``[start, end)``, one ``next_after`` at a time."""
    out = [timing.first_at_or_after(start)]
    while True:
        _count, _tick_at, following = timing.passed(out[-1], out[-1])
        if following >= end:
            return [t for t in out if t < end]
        out.append(following)


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def hours(day: str, *times: str) -> list[datetime]:
    return [utc(f"{day}T{t}") for t in times]


def quarter_hours(start: str, end: str) -> list[datetime]:
    first, last = utc(start), utc(end)
    return [first + timedelta(minutes=15 * i) for i in range(int((last - first) / timedelta(minutes=15)) + 1)]


# (zone, crontab, UTC span, expected UTC fire times in the span)
NIGHTS = [
    # Europe/Berlin, spring forward 2026-03-29: 02:00 CET -> 03:00 CEST (01:00 UTC).
    pytest.param(
        "Europe/Berlin",
        HOURLY,
        ("2026-03-28T22:30", "2026-03-29T03:30"),
        hours("2026-03-28", "23:00") + hours("2026-03-29", "00:00", "01:00", "02:00", "03:00"),
        id="berlin-spring-hourly",
    ),
    pytest.param(
        "Europe/Berlin",
        DAILY_0230,
        ("2026-03-28T00:00", "2026-03-31T00:00"),
        # 01:30 UTC the days around; on the night 02:30 does not exist: once at 03:00 CEST.
        [utc("2026-03-28T01:30"), utc("2026-03-29T01:00"), utc("2026-03-30T00:30")],
        id="berlin-spring-0230",
    ),
    pytest.param(
        "Europe/Berlin",
        EVERY_15,
        ("2026-03-29T00:00", "2026-03-29T02:00"),
        quarter_hours("2026-03-29T00:00", "2026-03-29T01:45"),
        id="berlin-spring-15min",
    ),
    # Europe/Berlin, fall back 2026-10-25: 03:00 CEST -> 02:00 CET (01:00 UTC).
    pytest.param(
        "Europe/Berlin",
        HOURLY,
        ("2026-10-24T22:30", "2026-10-25T03:30"),
        hours("2026-10-24", "23:00") + hours("2026-10-25", "00:00", "01:00", "02:00", "03:00"),
        id="berlin-fall-hourly",
    ),
    pytest.param(
        "Europe/Berlin",
        DAILY_0230,
        ("2026-10-24T00:00", "2026-10-27T00:00"),
        # 02:30 happens at 00:30 UTC (CEST) and 01:30 UTC (CET): only the first.
        [utc("2026-10-24T00:30"), utc("2026-10-25T00:30"), utc("2026-10-26T01:30")],
        id="berlin-fall-0230",
    ),
    pytest.param(
        "Europe/Berlin",
        EVERY_15,
        ("2026-10-24T23:30", "2026-10-25T02:30"),
        quarter_hours("2026-10-24T23:30", "2026-10-25T02:15"),
        id="berlin-fall-15min",
    ),
    # America/New_York, spring forward 2026-03-08: 02:00 EST -> 03:00 EDT (07:00 UTC).
    pytest.param(
        "America/New_York",
        HOURLY,
        ("2026-03-08T04:30", "2026-03-08T09:30"),
        hours("2026-03-08", "05:00", "06:00", "07:00", "08:00", "09:00"),
        id="new-york-spring-hourly",
    ),
    pytest.param(
        "America/New_York",
        DAILY_0230,
        ("2026-03-07T00:00", "2026-03-10T00:00"),
        [utc("2026-03-07T07:30"), utc("2026-03-08T07:00"), utc("2026-03-09T06:30")],
        id="new-york-spring-0230",
    ),
    pytest.param(
        "America/New_York",
        EVERY_15,
        ("2026-03-08T06:00", "2026-03-08T08:00"),
        quarter_hours("2026-03-08T06:00", "2026-03-08T07:45"),
        id="new-york-spring-15min",
    ),
    # America/New_York, fall back 2026-11-01: 02:00 EDT -> 01:00 EST (06:00 UTC).
    pytest.param(
        "America/New_York",
        HOURLY,
        ("2026-11-01T03:30", "2026-11-01T08:30"),
        # 01:00 happens twice (EDT 05:00 UTC, EST 06:00 UTC): an hourly job keeps elapsed time.
        hours("2026-11-01", "04:00", "05:00", "06:00", "07:00", "08:00"),
        id="new-york-fall-hourly",
    ),
    pytest.param(
        "America/New_York",
        DAILY_0230,
        ("2026-10-31T00:00", "2026-11-03T00:00"),
        [utc("2026-10-31T06:30"), utc("2026-11-01T07:30"), utc("2026-11-02T07:30")],
        id="new-york-fall-0230",
    ),
    pytest.param(
        "America/New_York",
        EVERY_15,
        ("2026-11-01T04:30", "2026-11-01T07:30"),
        quarter_hours("2026-11-01T04:30", "2026-11-01T07:15"),
        id="new-york-fall-15min",
    ),
    # Australia/Lord_Howe, spring forward 2026-10-04: 02:00 +10:30 -> 02:30 +11:00 (15:30 UTC on 10-03).
    pytest.param(
        "Australia/Lord_Howe",
        HOURLY,
        ("2026-10-03T13:00", "2026-10-03T18:30"),
        # 02:00 does not exist: once at 02:30 (the gap's end), then 03:00 half an hour later.
        hours("2026-10-03", "13:30", "14:30", "15:30", "16:00", "17:00", "18:00"),
        id="lord-howe-spring-hourly",
    ),
    pytest.param(
        "Australia/Lord_Howe",
        DAILY_0230,
        ("2026-10-02T00:00", "2026-10-05T00:00"),
        # 02:30 is the first instant after the gap itself: it exists and runs as usual.
        [utc("2026-10-02T16:00"), utc("2026-10-03T15:30"), utc("2026-10-04T15:30")],
        id="lord-howe-spring-0230",
    ),
    pytest.param(
        "Australia/Lord_Howe",
        EVERY_15,
        ("2026-10-03T14:30", "2026-10-03T16:30"),
        quarter_hours("2026-10-03T14:30", "2026-10-03T16:15"),
        id="lord-howe-spring-15min",
    ),
    # Australia/Lord_Howe, fall back 2026-04-05: 02:00 +11:00 -> 01:30 +10:30 (15:00 UTC on 04-04).
    pytest.param(
        "Australia/Lord_Howe",
        HOURLY,
        ("2026-04-04T12:30", "2026-04-04T18:45"),
        # Each wall-clock hour once: 01:00 is before the repeated half hour, 02:00 after it.
        hours("2026-04-04", "13:00", "14:00", "15:30", "16:30", "17:30", "18:30"),
        id="lord-howe-fall-hourly",
    ),
    pytest.param(
        "Australia/Lord_Howe",
        DAILY_0230,
        ("2026-04-03T00:00", "2026-04-06T00:00"),
        [utc("2026-04-03T15:30"), utc("2026-04-04T16:00"), utc("2026-04-05T16:00")],
        id="lord-howe-fall-0230",
    ),
    pytest.param(
        "Australia/Lord_Howe",
        EVERY_15,
        ("2026-04-04T14:00", "2026-04-04T16:00"),
        # 01:30 and 01:45 happen twice and run twice: every 15 minutes of elapsed time.
        quarter_hours("2026-04-04T14:00", "2026-04-04T15:45"),
        id="lord-howe-fall-15min",
    ),
]


@pytest.mark.parametrize(("zone", "fields", "span", "expected"), NIGHTS)
def test_a_dst_night_fires_at_the_exact_utc_times(
    zone: str, fields: dict[str, Any], span: tuple[str, str], expected: list[datetime]
) -> None:
    """Walked tick by tick through the night, the grid fires exactly at the expected UTC times."""
    start, end = utc(span[0]), utc(span[1])
    fired = fires_between(grid(fields, zone), start, end)
    assert fired == expected, [f"{t:%m-%d %H:%M}" for t in fired]


@pytest.mark.parametrize(("zone", "fields", "span", "expected"), NIGHTS)
def test_a_beat_down_across_the_night_counts_the_same_ticks(
    zone: str, fields: dict[str, Any], span: tuple[str, str], expected: list[datetime]
) -> None:
    """One late look at the end of the night counts every fire time of it once, in order."""
    timing = grid(fields, zone)
    end = utc(span[1])
    count, tick_at, following = timing.passed(expected[0], end - timedelta(microseconds=1))
    assert [tick_at(i) for i in range(count)] == expected
    assert following >= end and following > expected[-1]


def test_the_policy_zone_decides_not_the_app_zone() -> None:
    """A daily 02:30 crontab in a Tokyo app with ``timezone: Europe/Berlin`` fires at 02:30 Berlin time."""
    tokyo = celery.Celery("tokyo", set_as_current=False)
    tokyo.conf.timezone = "Asia/Tokyo"
    entry = {
        "task": "t",
        "schedule": crontab(minute=30, hour=2, app=tokyo),
        "policy": {"timezone": "Europe/Berlin"},
    }
    timing = define("job", entry, tokyo, {}).spec.timing
    ticks = fires_between(timing, utc("2026-06-01T00:00"), utc("2026-06-04T00:00"))
    assert [t.astimezone(ZoneInfo("Europe/Berlin")).strftime("%H:%M") for t in ticks] == ["02:30"] * 3


def test_a_crontab_celery_accepts_but_rarely_matches_is_found() -> None:
    """29 February on a Monday (every 28 years or so) is found, not looped over forever."""
    fields = CronFields.of(
        minutes=[0], hours=[0], days_of_month=[29], months=[2], days_of_week=[1], hour_field=0
    )
    assert next_fire(fields, ZoneInfo("UTC"), utc("2017-01-01T00:00")) == utc("2044-02-29T00:00")


# -- the property: any crontab, any span, against a brute force over the zone's offsets ----------

ZONES = [
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "America/Havana",  # changes at midnight: the gap and the fold cross a date
    "Antarctica/Troll",  # a two-hour shift
    "UTC",
]
#: Days with a DST change in at least one of the zones (and one without), to start spans near.
CHANGE_DAYS = [
    datetime(2026, 3, 8, tzinfo=UTC),
    datetime(2026, 3, 29, tzinfo=UTC),
    datetime(2026, 4, 4, tzinfo=UTC),
    datetime(2026, 9, 26, tzinfo=UTC),
    datetime(2026, 10, 3, tzinfo=UTC),
    datetime(2026, 10, 25, tzinfo=UTC),
    datetime(2026, 11, 1, tzinfo=UTC),
    datetime(2026, 6, 15, tzinfo=UTC),
]


def matches(fields: CronFields, wall: datetime) -> bool:
    return (
        wall.minute in fields.minutes
        and wall.hour in fields.hours
        and wall.month in fields.months
        and fields.day_matches(wall)
    )


def brute_force(fields: CronFields, zone: ZoneInfo, start: datetime, end: datetime) -> list[datetime]:
    """The rule, minute by minute in UTC: matching wall times as lived, plus each gap's substitute."""
    out: set[datetime] = set()
    t = start
    while t < end:
        local = t.astimezone(zone)
        if matches(fields, local.replace(tzinfo=None)) and (fields.elapsed or local.fold == 0):
            out.add(t)
        before = (t - timedelta(minutes=1)).astimezone(zone).utcoffset()
        after = local.utcoffset()
        if before is not None and after is not None and after > before:  # a gap ends at t
            skipped = local.replace(tzinfo=None) - (after - before)
            while skipped < local.replace(tzinfo=None):
                if matches(fields, skipped):
                    out.add(t)
                skipped += timedelta(minutes=1)
        t += timedelta(minutes=1)
    return sorted(out)


@st.composite
def crontabs(draw: st.DrawFn) -> CronFields:
    elapsed = draw(st.booleans())
    minutes = draw(st.sets(st.integers(0, 59), min_size=1, max_size=6))
    hours = (
        range(0, 24, draw(st.sampled_from([1, 2, 3])))
        if elapsed
        else draw(st.sets(st.integers(0, 23), min_size=1, max_size=4))
    )
    return CronFields.of(
        minutes=minutes,
        hours=hours,
        days_of_month=range(1, 32),
        months=range(1, 13),
        days_of_week=draw(st.sets(st.integers(0, 6), min_size=5, max_size=7)),
        hour_field="*/1" if elapsed else sorted(hours)[0],
    )


@settings(max_examples=100, deadline=None)
@given(
    fields=crontabs(),
    zone=st.sampled_from(ZONES),
    day=st.sampled_from(CHANGE_DAYS),
    offset_minutes=st.integers(-24 * 60, 24 * 60),
    seconds=st.integers(0, 59),
)
def test_fire_times_increase_and_are_the_rules_times(
    fields: CronFields, zone: str, day: datetime, offset_minutes: int, seconds: int
) -> None:
    """Over any span, fire times strictly increase and are exactly the matching wall times (or a
    gap's substitute), none twice, none lost."""
    tz = ZoneInfo(zone)
    start = day + timedelta(minutes=offset_minutes, seconds=seconds)
    end = start + timedelta(hours=30)
    fired: list[datetime] = []
    t = next_fire(fields, tz, start)
    while t < end:
        fired.append(t)
        t = next_fire(fields, tz, t)
    assert all(a < b for a, b in itertools.pairwise(fired))
    first_minute = start.replace(second=0) + timedelta(minutes=1)
    assert fired == brute_force(fields, tz, first_minute, end)


def test_next_match_walks_wall_clock_minutes_not_instants() -> None:
    """The wall-clock walk knows no zone: 02:30 on a spring-forward day is a match like any other."""
    fields = CronFields.of(
        minutes=[30],
        hours=[2],
        days_of_month=range(1, 32),
        months=range(1, 13),
        days_of_week=range(7),
        hour_field=2,
    )
    assert next_match(fields, datetime(2026, 3, 29, 0, 0)) == datetime(2026, 3, 29, 2, 30)
