"""The admin's pictures and list cells through the test client and as pure functions.

In a real browser: test_django_browser.py.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bbtest_admin import RUNS, SCHEDULES, TRACEBACK, add_history, add_run, page
from helpers.clock import MORNING_T0 as T0

from celery_boundedbeat.contrib.django.charts import (
    STATE_COLOURS,
    RunPoint,
    lanes,
    overlapping,
    sparkline_svg,
    timeline_svg,
)
from celery_boundedbeat.core.words import describe_timing, format_ms
from celery_boundedbeat.db.store import Store

pytestmark = [pytest.mark.postgres]


def point(n: int, start: float, end: float | None, state: str = "completed") -> RunPoint:
    return RunPoint(
        id=f"run-{n}",
        state=state,
        scheduled_for=T0 + timedelta(seconds=start),
        started_at=T0 + timedelta(seconds=start),
        finished_at=None if end is None else T0 + timedelta(seconds=end),
    )


def test_overlapping_runs_get_lanes_of_their_own_and_are_named() -> None:
    """Runs that ran at the same time sit in different lanes and count as overlaps; others share one."""
    runs = [point(0, 0, 5), point(1, 10, 25), point(2, 20, 22), point(3, 30, None, "started")]
    now = T0 + timedelta(seconds=40)
    assert lanes(runs, now) == [0, 0, 1, 0]
    assert overlapping(runs, now) == {"run-1", "run-2"}


def test_a_run_that_waited_for_the_one_before_stays_in_its_lane() -> None:
    """A no-overlap schedule whose runs each wait for the one before is drawn in one lane, its waiting
    parts behind the bars, and nothing is outlined as an overlap."""
    runs = [
        RunPoint(
            id=f"run-{n}",
            state="completed",
            scheduled_for=T0 + timedelta(seconds=10 * n),
            started_at=T0 + timedelta(seconds=15 * n),
            finished_at=T0 + timedelta(seconds=15 * n + 15),
        )
        for n in range(4)
    ]
    now = T0 + timedelta(seconds=70)
    assert lanes(runs, now) == [0, 0, 0, 0]
    assert overlapping(runs, now) == set()
    svg = timeline_svg(runs, now=now, zone=UTC)
    assert svg.count('class="bb-wait"') == 3 and "bb-overlap" not in svg
    assert set(re.findall(r'class="bb-run[^"]*"[^>]* y="(\d+)"', svg)) == {"8"}
    assert svg.index('class="bb-wait"') < svg.index('class="bb-run ')


@pytest.mark.parametrize(
    ("timing", "text"),
    [
        ({"kind": "interval", "every": 5.0}, "every 5 s"),
        ({"kind": "interval", "every": 900.0}, "every 15 min"),
        ({"kind": "interval", "every": 7200.0}, "every 2 h"),
        ({"kind": "interval", "every": 90.0}, "every 90 s"),
        (
            {"kind": "crontab", "minute": "30", "hour": "2", "day_of_week": "*", "day_of_month": "*"}
            | {"month_of_year": "*", "timezone": "Europe/Berlin"},
            "at 02:30 every day (Europe/Berlin)",
        ),
        (
            {"kind": "crontab", "minute": "*/15", "hour": "*", "day_of_week": "1-5", "day_of_month": "*"}
            | {"month_of_year": "*"},
            "every 15 min on Mon-Fri",
        ),
        (
            {"kind": "crontab", "minute": [0, 30], "hour": "9", "day_of_week": "*", "day_of_month": "1"}
            | {"month_of_year": "*"},
            "at 09:00, 09:30 on day 1 of the month",
        ),
        (
            {"kind": "crontab", "minute": "5", "hour": "*/3", "day_of_week": "0,6", "day_of_month": "*"}
            | {"month_of_year": "1"},
            "every 3 h at :05 on Sun, Sat in Jan",
        ),
        (
            {"kind": "crontab", "minute": "1-59/7", "hour": "*", "day_of_week": "*", "day_of_month": "*"}
            | {"month_of_year": "*"},
            "cron 1-59/7 * * * *",
        ),
        ({"kind": "solar", "event": "sunset", "lat": 52.5, "lon": 13.4}, "at sunset (52.5, 13.4)"),
    ],
)
def test_schedules_read_in_words(timing: dict[str, Any], text: str) -> None:
    """Intervals, crontabs and solar events in words; an irregular crontab as its fields in cron order."""
    assert describe_timing(timing, None, "raw") == text


def test_durations_read_at_a_glance() -> None:
    """Milliseconds, seconds, minutes and hours, one decimal at most."""
    assert [format_ms(v) for v in (None, 850, 12_345, 246_000, 7_200_000)] == [
        "—",
        "850 ms",
        "12.3 s",
        "4.1 min",
        "2.0 h",
    ]


def test_pictures_escape_error_texts_and_ids() -> None:
    """Markup in a run's id or error reaches the SVG only escaped."""
    evil = RunPoint(
        id='"><script>alert(1)</script>',
        state="failed",
        scheduled_for=T0,
        started_at=T0,
        finished_at=T0 + timedelta(seconds=1),
        elapsed_ms=1000,
        error="<img src=x onerror=alert(2)>",
    )
    for svg in (timeline_svg([evil], now=T0, zone=UTC), sparkline_svg([evil])):
        assert "<script" not in svg and "<img" not in svg
        assert "&lt;script&gt;" in svg or "&quot;&gt;" in svg
    assert "&lt;img src=x onerror=alert(2)&gt;" in timeline_svg([evil], now=T0, zone=UTC)


def test_change_list_reads_all_sparklines_and_counts_in_two_queries(store: Store, client_as: Any) -> None:
    """Three schedules with runs cost two queries on the runs table (their recent runs, their
    unsuccessful runs by state), and each row gets its own runs."""
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    now = datetime.now(UTC)
    add_history(store, "poll-partner", now, count=25)
    add_history(store, "export-report", now, count=3, period=60)
    add_run(store, "refresh-cache", "failed", now, elapsed_ms=20, error=TRACEBACK)
    client = client_as("viewer")
    with CaptureQueriesContext(connections["default"]) as queries:
        html = page(client.get(SCHEDULES))
    on_runs = [q["sql"] for q in queries.captured_queries if "boundedbeat_runs" in q["sql"]]
    assert len(on_runs) == 2, on_runs
    rows = dict(re.findall(r'field-name"><a href="[^"]*">([^<]+)</a>(.*?)</tr>', html, re.S))
    assert rows["poll-partner"].count('class="bb-spark ') == 20
    assert rows["export-report"].count('class="bb-spark ') == 3
    assert rows["refresh-cache"].count('class="bb-spark bb-state-failed"') == 1
    assert f'fill="{STATE_COLOURS["failed"]}"' in rows["refresh-cache"]
    assert 'href="/admin/celery_boundedbeat/run/?schedule=poll-partner"' in rows["poll-partner"]


def test_paused_and_stopped_schedules_show_no_next_due_time(store: Store, client_as: Any) -> None:
    """A paused or stopped schedule says so where its next due time would be; 'not paused' is no red ✗."""
    from sqlalchemy import update

    from celery_boundedbeat.db.tables import ScheduleRow

    store.set_paused("export-report", True, datetime.now(UTC))
    with store.session() as s:
        s.execute(
            update(ScheduleRow)
            .where(ScheduleRow.name == "poll-partner")
            .values(stopped=True, stop_reason="max_runs")
        )
    html = page(client_as("viewer").get(SCHEDULES))
    cells = dict(
        re.findall(
            r'field-name"><a href="[^"]*">([^<]+)</a>.*?<td class="field-next_due">(.*?)</td>', html, re.S
        )
    )
    assert ">paused<" in cells["export-report"] and ":" not in re.sub(r"<[^>]+>", "", cells["export-report"])
    assert ">stopped<" in cells["poll-partner"] and "max_runs" in cells["poll-partner"]
    assert re.search(r">\d\d-\d\d \d\d:\d\d:\d\d<", cells["refresh-cache"])
    assert "icon-no" not in html and "icon-yes" not in html
    detail = page(client_as("viewer").get(f"{SCHEDULES}export-report/change/"))
    assert "icon-no" not in detail and ">paused<" in detail


def test_run_list_shows_short_ids_coloured_states_and_links_to_the_schedule(
    store: Store, client_as: Any
) -> None:
    """A run's id is cut to 8 characters with the full id in its tooltip, its state is coloured, its
    schedule links to the schedule's page, and its times carry seconds in the admin's time zone,
    named in the list's headers and tooltips and after each time on the run's page."""
    from django.test import override_settings

    when = datetime(2026, 12, 1, 6, 0, 5, tzinfo=UTC)
    run_id = add_run(
        store, "export-report", "timed_out", when, started_at=when, error="SoftTimeLimitExceeded()"
    )
    with override_settings(TIME_ZONE="Europe/Berlin"):
        html = page(client_as("viewer").get(RUNS))
        detail = page(client_as("viewer").get(f"{RUNS}{run_id}/change/"))
    assert f'<span class="bb-id" title="{run_id}"' in html and f">{run_id[:8]}…<" in html
    assert f"color:{STATE_COLOURS['timed_out']}" in html
    assert f'href="{SCHEDULES}export-report/change/">export-report</a>' in html
    assert 'title="2026-12-01 07:00:05 CET" style="white-space:nowrap">12-01 07:00:05<' in html
    assert ">Scheduled / started (Europe/Berlin)<" in html
    assert ">2026-12-01 07:00:05 CET<" in detail and '<pre class="bb-error"' in detail


def test_schedule_page_draws_its_runs_in_one_query(store: Store, client_as: Any) -> None:
    """The timeline and the duration/drift chart of a schedule's page share one query and show every
    run (a second one counts its unsuccessful runs by state)."""
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    ids = add_history(store, "poll-partner", datetime.now(UTC), count=12)
    with CaptureQueriesContext(connections["default"]) as queries:
        html = page(client_as("viewer").get(f"{SCHEDULES}poll-partner/change/"))
    on_runs = [q["sql"] for q in queries.captured_queries if "boundedbeat_runs" in q["sql"]]
    assert len(on_runs) == 2 and sum("GROUP BY" in sql for sql in on_runs) == 1, on_runs
    assert sorted(re.findall(r'<g data-run="([^"]+)">', html)) == sorted(ids)
    assert html.count('class="bb-point bb-drift') == 12 and html.count('class="bb-point bb-duration') == 11
    assert "every 10 s" in html


def test_counts_call_only_failed_runs_failed(store: Store, client_as: Any) -> None:
    """A schedule's counts say "failed" (in red) only for failed runs; time-outs, runs replace
    revoked and other revoked runs have their own words, and one overlap is "1 overlap"."""
    from sqlalchemy import update

    from celery_boundedbeat.db.tables import ScheduleRow
    from celery_boundedbeat.db.tick import REPLACED

    now = datetime.now(UTC)
    for n, (state, error) in enumerate(
        [("failed", TRACEBACK), ("failed", TRACEBACK), ("timed_out", "SoftTimeLimitExceeded()")]
        + [("revoked", REPLACED)] * 3
        + [("revoked", None), ("completed", None)]
    ):
        add_run(store, "poll-partner", state, now - timedelta(seconds=n), error=error)
    with store.session() as s:
        s.execute(
            update(ScheduleRow)
            .where(ScheduleRow.name == "poll-partner")
            .values(runs=1, failures=7, replaced=3, overlaps=1)
        )
    html = page(client_as("viewer").get(SCHEDULES))
    row = dict(re.findall(r'field-name"><a href="[^"]*">([^<]+)</a>(.*?)</tr>', html, re.S))["poll-partner"]
    cell = re.search(r'<td class="field-run_history">(.*?)</td>', row, re.S)
    assert cell is not None
    counts = re.sub(r"<[^>]+>", "", cell[1].split("</svg>")[-1])
    assert counts == "1 completed, 2 failed, 1 timed out, 1 revoked, 3 replaced, 1 overlap", counts
    assert f'bb-count-failed" style="color:{STATE_COLOURS["failed"]}' in row
    assert f'bb-count-timed_out" style="color:{STATE_COLOURS["failed"]}' not in row
    detail = page(client_as("viewer").get(f"{SCHEDULES}poll-partner/change/"))
    assert ">2 failed</span>" in detail and ">3 replaced</span>" in detail
