"""The admin's read-only pages and their pause / resume / trigger actions, through Django's test client.

Adding, changing and removing runtime schedules: test_django_admin_edit.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bbtest_admin import RUNS, SCHEDULES, add_run, changelist_names, page
from bbtest_settings import PASSWORD

from celery_boundedbeat.db.store import Store

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("clean_tables")]


def test_anonymous_users_are_sent_to_the_login_page() -> None:
    """Without a session, both changelists redirect to the admin login."""
    from django.test import Client

    for url in (SCHEDULES, RUNS):
        response = Client().get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/?next=")


def test_non_staff_users_are_sent_to_the_login_page(client_as: Any) -> None:
    """A logged-in user who is not staff never reaches the pages."""
    response = client_as("plain").get(SCHEDULES)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_staff_without_view_permission_is_forbidden(client_as: Any) -> None:
    """Staff status alone is not enough: the view permission of each model is required."""
    client = client_as("nobody")
    assert client.get(SCHEDULES).status_code == 403
    assert client.get(RUNS).status_code == 403


def test_schedule_changelist_filters_and_searches(store: Store, client_as: Any) -> None:
    """A viewer sees every schedule; mode, paused and stopped filters and name/task search narrow it."""
    store.set_paused("export-report", True, datetime.now(UTC))
    client = client_as("viewer")
    html = page(client.get(SCHEDULES))
    assert changelist_names(html) == {"refresh-cache", "export-report", "poll-partner"}
    assert "fixed_rate_no_overlap" in html
    assert changelist_names(page(client.get(SCHEDULES, {"mode__exact": "fixed_delay"}))) == {"refresh-cache"}
    assert changelist_names(page(client.get(SCHEDULES, {"paused__exact": "1"}))) == {"export-report"}
    assert changelist_names(page(client.get(SCHEDULES, {"stopped__exact": "1"}))) == set()
    assert changelist_names(page(client.get(SCHEDULES, {"q": "poll"}))) == {"poll-partner"}
    assert changelist_names(page(client.get(SCHEDULES, {"q": "export_report"}))) == {"export-report"}


def test_run_changelist_filters_searches_and_drills_down_by_date(store: Store, client_as: Any) -> None:
    """Runs filter by state and schedule, search id/schedule/task/error, and drill down by scheduled_for."""
    march = datetime(2024, 3, 5, 12, 0, tzinfo=UTC)
    ok = add_run(store, "refresh-cache", "completed", march, finished_at=march + timedelta(seconds=2))
    failed = add_run(
        store, "export-report", "failed", march + timedelta(days=1), error="ValueError: boom\nat x"
    )
    april = add_run(store, "refresh-cache", "started", datetime(2024, 4, 1, 8, 0, tzinfo=UTC), worker="w1@h")
    client = client_as("viewer")

    html = page(client.get(RUNS))
    assert changelist_names(html) == {ok, failed, april}
    assert (
        ">ValueError: boom</span>" in html and 'title="ValueError: boom\nat x"' in html
    )  # first line; all in the tooltip
    assert changelist_names(page(client.get(RUNS, {"state__exact": "failed"}))) == {failed}
    assert changelist_names(page(client.get(RUNS, {"schedule": "refresh-cache"}))) == {ok, april}
    assert changelist_names(page(client.get(RUNS, {"q": "boom"}))) == {failed}
    assert changelist_names(page(client.get(RUNS, {"q": april}))) == {april}
    assert changelist_names(page(client.get(RUNS, {"q": "export_report"}))) == {failed}

    by_year = page(client.get(RUNS, {"scheduled_for__year": "2024"}))
    assert "scheduled_for__month=3" in by_year.replace("&amp;", "&")
    march_only = {"scheduled_for__year": "2024", "scheduled_for__month": "3"}
    assert changelist_names(page(client.get(RUNS, march_only))) == {ok, failed}
    march_5 = {**march_only, "scheduled_for__day": "5"}
    assert changelist_names(page(client.get(RUNS, march_5))) == {ok}


def test_schedule_list_links_to_its_runs(store: Store, client_as: Any) -> None:
    """Each schedule row links to the run list filtered to that schedule."""
    html = page(client_as("viewer").get(SCHEDULES))
    assert f'href="{RUNS}?schedule=poll-partner"' in html


def test_runs_and_config_schedules_cannot_be_added_changed_or_deleted(store: Store, client_as: Any) -> None:
    """Even a superuser gets 403 on every write to a run or a config schedule, and no bulk delete."""
    run_id = add_run(store, "refresh-cache", "completed", datetime(2024, 3, 5, tzinfo=UTC))
    client = client_as("root")
    assert f'href="{RUNS}add/"' not in page(client.get(RUNS))
    assert client.get(f"{RUNS}add/").status_code == 403
    assert client.post(f"{RUNS}add/", {}).status_code == 403
    for changelist, pk in ((SCHEDULES, "refresh-cache"), (RUNS, run_id)):
        detail = page(client.get(f"{changelist}{pk}/change/"))
        assert 'name="_save"' not in detail and "/delete/" not in detail
        assert client.post(f"{changelist}{pk}/change/", {"task": "x"}).status_code == 403
        assert client.get(f"{changelist}{pk}/delete/").status_code == 403
        assert client.post(f"{changelist}{pk}/delete/", {"post": "yes"}).status_code == 403
    assert 'value="delete_selected"' not in page(client.get(SCHEDULES))
    assert [s.task for s in store.schedules(["refresh-cache"])] == ["proj.tasks.refresh_cache"]
    assert store.run(run_id) is not None


def test_detail_pages_show_policy_and_full_error(store: Store, client_as: Any) -> None:
    """A viewer reads the stored policy of a schedule and the whole error text of a run."""
    run_id = add_run(
        store, "export-report", "failed", datetime(2024, 3, 5, tzinfo=UTC), error="Traceback\nKeyError: 'x'"
    )
    client = client_as("viewer")
    schedule = page(client.get(f"{SCHEDULES}export-report/change/"))
    assert "coalesce_latest" in schedule and "proj.tasks.export_report" in schedule
    run = page(client.get(f"{RUNS}{run_id}/change/"))
    assert "KeyError: &#x27;x&#x27;" in run and "Traceback" in run


def act(client: Any, action: str, *names: str) -> Any:
    return client.post(SCHEDULES, {"action": action, "_selected_action": list(names)}, follow=True)


def test_actions_pause_resume_and_trigger_change_the_rows(store: Store, client_as: Any) -> None:
    """pause, resume and trigger go through the Store, report once per schedule and are logged."""
    from django.contrib.admin.models import LogEntry

    client = client_as("operator")
    assert 'value="pause_schedules"' in page(client.get(SCHEDULES))
    # Django's own tables live for the whole session: earlier tests logged changes too.
    seen = max(LogEntry.objects.values_list("id", flat=True), default=0)

    html = page(act(client, "pause_schedules", "refresh-cache", "poll-partner"))
    assert "Schedule &#x27;refresh-cache&#x27; paused." in html
    assert "Schedule &#x27;poll-partner&#x27; paused." in html
    assert {s.name: s.paused for s in store.schedules()} == {
        "refresh-cache": True,
        "poll-partner": True,
        "export-report": False,
    }

    page(act(client, "resume_schedules", "poll-partner"))
    assert {s.name: s.paused for s in store.schedules()}["poll-partner"] is False

    before = {s.name: s.pending_runs for s in store.schedules()}
    html = page(act(client, "trigger_schedules", "export-report"))
    assert "Schedule &#x27;export-report&#x27; triggered" in html
    after = {s.name: s.pending_runs for s in store.schedules()}
    assert after["export-report"] == before["export-report"] + 1
    assert after["refresh-cache"] == before["refresh-cache"]

    logged = LogEntry.objects.filter(
        content_type__app_label="celery_boundedbeat", object_id="poll-partner", id__gt=seen
    )
    assert [e.change_message for e in logged.order_by("id")] == [
        "Schedule paused from the admin.",
        "Schedule resumed from the admin.",
    ]
    assert PASSWORD not in html


def test_resume_lifts_stop_schedule(store: Store, client_as: Any) -> None:
    """Resuming a schedule stopped by stop_schedule() makes it emit again, as the CLI does."""
    from sqlalchemy import update

    from celery_boundedbeat.db.tables import ScheduleRow

    with store.session() as s:
        s.execute(update(ScheduleRow).where(ScheduleRow.name == "poll-partner").values(stopped=True))
    client = client_as("root")
    assert changelist_names(page(client.get(SCHEDULES, {"stopped__exact": "1"}))) == {"poll-partner"}
    page(act(client, "resume_schedules", "poll-partner"))
    (row,) = store.schedules(["poll-partner"])
    assert row.stopped is False and row.paused is False


def test_page_buttons_need_post_csrf_and_the_operate_permission(
    store: Store, client_as: Any, users: dict[str, Any]
) -> None:
    """A schedule page's buttons post to one URL per action: a viewer, a GET, a post without the
    CSRF token and an unknown action change nothing; an operator's post pauses through the action."""
    from django.test import Client

    url = f"{SCHEDULES}refresh-cache/operate/pause_schedules/"
    viewer = client_as("viewer")
    assert "/operate/" not in page(viewer.get(f"{SCHEDULES}refresh-cache/change/"))
    assert viewer.post(url).status_code == 403
    assert viewer.post(f"{SCHEDULES}refresh-cache/operate/trigger_schedules/").status_code == 403
    operator = client_as("operator")
    assert operator.get(url).status_code == 405
    assert operator.post(f"{SCHEDULES}refresh-cache/operate/delete_selected/").status_code == 403
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(users["operator"])
    assert strict.post(url).status_code == 403
    (row,) = store.schedules(["refresh-cache"])
    assert row.paused is False and row.pending_runs == 0

    response = operator.post(url, follow=True)
    assert response.redirect_chain[-1][0] == f"{SCHEDULES}refresh-cache/change/"
    assert "Schedule &#x27;refresh-cache&#x27; paused." in page(response)
    assert store.schedules(["refresh-cache"])[0].paused is True
    assert operator.post(f"{SCHEDULES}no-such/operate/pause_schedules/").status_code == 302


def test_viewers_cannot_run_actions(store: Store, client_as: Any) -> None:
    """Without celery_boundedbeat.operate_schedule the actions are neither offered nor run."""
    client = client_as("viewer")
    assert 'value="pause_schedules"' not in page(client.get(SCHEDULES))
    act(client, "pause_schedules", "refresh-cache")
    act(client, "trigger_schedules", "refresh-cache")
    (row,) = store.schedules(["refresh-cache"])
    assert row.paused is False and row.pending_runs == 0


def test_admin_reads_through_the_configured_alias(store: Store, client_as: Any) -> None:
    """BOUNDEDBEAT_ADMIN_DATABASE sends the admin's queries to that DATABASES alias."""
    from django.db import connections
    from django.test import override_settings
    from django.test.utils import CaptureQueriesContext

    client = client_as("viewer")
    with (
        override_settings(BOUNDEDBEAT_ADMIN_DATABASE="history"),
        CaptureQueriesContext(connections["history"]) as history,
        CaptureQueriesContext(connections["default"]) as default,
    ):
        assert changelist_names(page(client.get(SCHEDULES))) == {
            "refresh-cache",
            "export-report",
            "poll-partner",
        }
    assert any("boundedbeat_schedules" in q["sql"] for q in history.captured_queries)
    assert not any("boundedbeat_schedules" in q["sql"] for q in default.captured_queries)


def test_system_check_reports_an_unknown_admin_alias() -> None:
    """A BOUNDEDBEAT_ADMIN_DATABASE missing from DATABASES fails `manage.py check`."""
    from django.test import override_settings

    from celery_boundedbeat.contrib.django.checks import check_admin_database

    assert check_admin_database() == []
    with override_settings(BOUNDEDBEAT_ADMIN_DATABASE="nope"):
        (error,) = check_admin_database()
    assert error.id == "celery_boundedbeat.E001" and "'nope'" in error.msg


def test_django_migrations_leave_the_tables_to_alembic() -> None:
    """migrate, makemigrations --check and check pass: the app ships no Django migrations."""
    from django.core.management import call_command
    from django.db.migrations.loader import MigrationLoader

    call_command("migrate", interactive=False, verbosity=0)
    call_command("makemigrations", check=True, dry_run=True, verbosity=0)
    call_command("migrate", check=True, verbosity=0)
    call_command("check", fail_level="WARNING")
    assert "celery_boundedbeat" in MigrationLoader(None).unmigrated_apps


def test_a_schedule_whose_run_no_worker_started_says_which_queue_it_waits_on(
    store: Store, client_as: Any
) -> None:
    """A run published past boundedbeat_unstarted_warning: the list and the page name its queue."""
    from sqlalchemy import update

    from celery_boundedbeat.db.tables import ScheduleRow

    now = datetime.now(UTC)
    with store.engine.begin() as conn:
        conn.execute(
            update(ScheduleRow)
            .where(ScheduleRow.name == "poll-partner")
            .values(options={"queue": "nowhere"}, active_runs=1)
        )
        conn.execute(update(ScheduleRow).where(ScheduleRow.name == "export-report").values(active_runs=1))
    add_run(
        store,
        "poll-partner",
        "published",
        now - timedelta(seconds=900),
        published_at=now - timedelta(seconds=900),
    )
    add_run(
        store,
        "export-report",
        "published",
        now - timedelta(seconds=5),
        published_at=now - timedelta(seconds=5),
    )
    client = client_as("viewer")
    html = page(client.get(SCHEDULES))
    assert html.count("waiting for a worker on queue nowhere") == 1, html
    detail = page(client.get(f"{SCHEDULES}poll-partner/change/"))
    assert "waiting for a worker on queue nowhere" in detail
    assert "waiting for a worker" not in page(client.get(f"{SCHEDULES}export-report/change/"))


def test_a_schedule_page_says_which_beat_ticks_it(store: Store, client_as: Any) -> None:
    """The lease holder with one partition; nobody while no beat holds the lease."""
    client = client_as("viewer")
    assert "no live beat" in page(client.get(f"{SCHEDULES}export-report/change/"))
    assert store.acquire_lease("beat", "web-1:812:5f0c1a2", datetime.now(UTC), 15)
    assert "web-1:812:5f0c1a2" in page(client.get(f"{SCHEDULES}export-report/change/"))
