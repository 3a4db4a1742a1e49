"""Runtime schedules added, changed and removed in the admin, through the schedule API.

Every test runs with the celery_boundedbeat tables on PostgreSQL and on SQLite (Django's own
tables stay on PostgreSQL; see the ``backend`` fixture).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from bbtest_admin import SCHEDULES, add_run, celery_app, changelist_names, field_errors, form_data, page
from sqlalchemy import update

from celery_boundedbeat.api.schedules import add_schedule
from celery_boundedbeat.core.policy import POLICY_KEYS
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import ScheduleRow

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.usefixtures("clean_tables"),
    pytest.mark.parametrize("backend", ["postgresql", "sqlite"], indirect=True),
]

ADD = f"{SCHEDULES}add/"

#: What the add page posts for a plain interval schedule; tests change a few keys.
INTERVAL: dict[str, str] = {
    "name": "tenant-1",
    "task": "proj.tasks.poll_tenant",
    "kind": "interval",
    "every": "15",
    **dict.fromkeys(("minute", "hour", "day_of_week", "day_of_month", "month_of_year"), "*"),
    "event": "",
    "lat": "",
    "lon": "",
    "args": "[]",
    "kwargs": '{"tenant": 1}',
    "options": "{}",
    "mode": "fixed_rate",
    "missed_ticks": "",
    "max_concurrency": "2",
    "max_pending": "",
    "initial_delay": "",
    "max_run_time": "",
    "jitter": "",
    "end_at_0": "",
    "end_at_1": "",
    "max_runs": "",
    "pause_on_failure": "",
}


@pytest.fixture(scope="module", autouse=True)
def template_context(django_project: None) -> Iterator[None]:
    """Let the test client hand back each response's template context (the forms read from it)."""
    from django.test.utils import setup_test_environment, teardown_test_environment

    setup_test_environment()
    try:
        yield
    finally:
        teardown_test_environment()


def row(store: Store, name: str) -> ScheduleRow | None:
    found = store.schedules([name])
    return found[0] if found else None


def add_runtime(name: str = "feed-7", **extra: Any) -> None:
    """A runtime schedule made by application code (the API, not the admin)."""
    policy = {"mode": "fixed_rate", "max_concurrency": 2, **extra}
    assert add_schedule(celery_app(), name, "proj.tasks.feed", 60.0, args=[7], policy=policy) == "scheduled"


def test_every_policy_key_has_its_form_field() -> None:
    """The form offers one field per policy key, and a problem's key finds its field."""
    from celery_boundedbeat.contrib.django.forms import POLICY_FIELDS, field_for

    assert set(POLICY_FIELDS) == POLICY_KEYS
    assert field_for("policy.max_runs", "interval") == "max_runs"
    assert field_for("schedule", "interval") == "every"
    assert field_for("schedule", "crontab") == "kind"
    assert field_for("policy.nope", "interval") is None and field_for("origin", "interval") is None


def test_staff_adds_an_interval_and_a_crontab_schedule(store: Store, client_as: Any) -> None:
    """An editor's add form writes runtime rows through add_schedule, timing and policy as given."""
    from django.contrib.admin.models import ADDITION, LogEntry

    start = datetime.now(UTC)
    client = client_as("editor")
    assert f'href="{ADD}"' in page(client.get(SCHEDULES))
    assert page(client.get(ADD))  # the empty form renders
    response = client.post(ADD, INTERVAL)
    assert response.status_code == 302, field_errors(response)
    crontab = {**INTERVAL, "name": "nightly", "kind": "crontab", "every": "", "minute": "30", "hour": "2"}
    crontab.update(mode="", max_concurrency="", kwargs="")
    response = client.post(ADD, crontab)
    assert response.status_code == 302, field_errors(response)
    solar = {**crontab, "name": "dusk", "kind": "solar", "event": "sunset", "lat": "52.5", "lon": "13.4"}
    response = client.post(ADD, solar)
    assert response.status_code == 302, field_errors(response)

    tenant, nightly = row(store, "tenant-1"), row(store, "nightly")
    assert tenant is not None and nightly is not None
    assert (tenant.origin, tenant.task, tenant.kwargs) == ("runtime", "proj.tasks.poll_tenant", {"tenant": 1})
    assert tenant.timing == {"kind": "interval", "every": 15.0}
    assert (tenant.policy["mode"], tenant.policy["max_concurrency"]) == ("fixed_rate", 2)
    assert nightly.origin == "runtime" and nightly.kwargs == {}
    assert nightly.timing is not None and (nightly.timing["minute"], nightly.timing["hour"]) == ("30", "2")
    assert nightly.timing["kind"] == "crontab" and nightly.policy["mode"] == "fixed_rate_no_overlap"
    dusk = row(store, "dusk")
    assert dusk is not None and dusk.timing is not None
    assert {k: v for k, v in dusk.timing.items() if k != "timezone"} == {
        "kind": "solar",
        "event": "sunset",
        "lat": 52.5,
        "lon": 13.4,
    }
    logged = LogEntry.objects.filter(content_type__app_label="celery_boundedbeat", action_time__gte=start)
    added = logged.filter(action_flag=ADDITION).values_list("object_id", flat=True)
    assert sorted(added) == ["dusk", "nightly", "tenant-1"]

    html = page(client.get(SCHEDULES, {"origin__exact": "runtime"}))
    assert changelist_names(html) == {"tenant-1", "nightly", "dusk"}
    assert re.search(r'<td class="field-task_and_origin">.*?<div class="bb-sub"[^>]*>runtime</div>', html)


@pytest.mark.parametrize(
    ("change", "field", "text"),
    [
        ({"every": "0"}, "every", "period must be > 0 seconds"),
        ({"kind": "crontab", "mode": "fixed_delay", "max_concurrency": ""}, "kind", "needs a number"),
        ({"mode": "fixed_rate_no_overlap"}, "max_concurrency", "only allowed with mode 'fixed_rate'"),
        ({"max_concurrency": ""}, "max_concurrency", "is required"),
        ({"kwargs": '{"tenant": 1'}, "kwargs", "Enter a valid JSON."),
        ({"args": '{"a": 1}'}, "args", "must be a list or tuple"),
        ({"options": "[1]"}, "options", "must be a dict"),
        ({"options": '{"priority": "high"}'}, "options", "'priority' must be an integer from 0 to 255"),
        ({"kind": "crontab", "minute": "61"}, "minute", "Minute must be 0-59"),
        ({"kind": "crontab", "hour": "1,,2"}, "hour", "Hour must be 0-23"),
        ({"every": ""}, "every", "Required for this timing."),
        ({"name": "refresh-cache"}, "name", "exists already"),
        ({"kind": "crontab", "timezone": "Europe/Berln"}, "timezone", "unknown time zone 'Europe/Berln'"),
        ({"timezone": "Europe/Berlin"}, "timezone", "is only for crontab and solar schedules"),
        ({"retry": '{"on": ["completed"]}'}, "retry", "cannot retry on 'completed'"),
    ],
    ids=["period-0", "fixed-delay-crontab", "concurrency-needs-fixed-rate", "fixed-rate-needs-concurrency",
         "bad-json", "args-not-a-list", "options-not-an-object", "bad-priority", "bad-crontab",
         "unparsable-crontab", "no-period", "duplicate",
         "unknown-zone", "zone-on-an-interval", "bad-retry"],
)  # fmt: skip
def test_invalid_input_is_shown_on_its_field_and_writes_nothing(
    store: Store, client_as: Any, change: dict[str, str], field: str, text: str
) -> None:
    """The API's problem appears on the field its key names; no row is added or changed."""
    before = {s.name: s.version for s in store.schedules()}
    errors = field_errors(client_as("editor").post(ADD, {**INTERVAL, **change}))
    assert list(errors) == [field], errors
    assert any(text in message for message in errors[field]), errors
    assert {s.name: s.version for s in store.schedules()} == before
    assert row(store, "tenant-1") is None


def test_a_retry_policy_added_in_the_form_is_stored_and_shown_again(store: Store, client_as: Any) -> None:
    client = client_as("editor")
    retry = {"on": ["lost"], "max_attempts": 4, "backoff": 5, "max_backoff": 60}
    response = client.post(ADD, {**INTERVAL, "retry": json.dumps(retry)})
    assert response.status_code == 302, field_errors(response)
    added = row(store, "tenant-1")
    assert added is not None and added.policy["retry"] == {**retry, "backoff": 5.0, "max_backoff": 60.0}
    assert json.loads(form_data(client.get(f"{SCHEDULES}tenant-1/change/"))["retry"]) == added.policy["retry"]


def test_a_crontab_added_with_a_time_zone_keeps_it_and_a_change_moves_it(
    store: Store, client_as: Any
) -> None:
    """The zone field is the policy's ``timezone``: stored with the timing, shown again, changed alone."""
    client = client_as("editor")
    nightly = {**INTERVAL, "name": "nightly", "kind": "crontab", "every": "", "minute": "30", "hour": "2"}
    nightly.update(mode="", max_concurrency="", timezone="Europe/Berlin")
    response = client.post(ADD, nightly)
    assert response.status_code == 302, field_errors(response)
    added = row(store, "nightly")
    assert added is not None and added.timing is not None
    assert (added.policy["timezone"], added.timing["timezone"]) == ("Europe/Berlin", "Europe/Berlin")
    url = f"{SCHEDULES}nightly/change/"
    shown = form_data(client.get(url))
    assert shown["timezone"] == "Europe/Berlin"
    assert client.post(url, {**shown, "timezone": "Asia/Tokyo"}).status_code == 302
    moved = row(store, "nightly")
    assert moved is not None and moved.timing is not None and moved.timing["timezone"] == "Asia/Tokyo"
    assert moved.version == added.version + 1


def test_editing_changes_only_the_changed_fields_and_keeps_counters(store: Store, client_as: Any) -> None:
    """A change goes through update_schedule with just what changed; counters and the rest stay."""
    add_runtime(jitter=1.5, start_at="2029-06-01T07:15:00+00:00", end_at="2030-01-01T08:30:00+00:00")
    with store.session() as s:
        s.execute(
            update(ScheduleRow).where(ScheduleRow.name == "feed-7").values(runs=5, failures=1, grid_runs=6)
        )
    before = row(store, "feed-7")
    assert before is not None
    client = client_as("editor")
    url = f"{SCHEDULES}feed-7/change/"

    unchanged = form_data(client.get(url))
    assert client.post(url, unchanged).status_code == 302
    same = row(store, "feed-7")
    assert same is not None and same.version == before.version  # nothing changed, nothing written

    response = client.post(url, {**unchanged, "max_concurrency": "4", "kwargs": '{"x": 1}'})
    assert response.status_code == 302, field_errors(response)
    after = row(store, "feed-7")
    assert after is not None
    assert after.policy == {**before.policy, "max_concurrency": 4}
    assert (after.kwargs, after.args, after.task, after.timing) == ({"x": 1}, [7], before.task, before.timing)
    assert (after.runs, after.failures, after.grid_runs) == (5, 1, 6)
    assert after.version == before.version + 1 and after.origin == "runtime"

    errors = field_errors(client.post(url, {**form_data(client.get(url)), "mode": "fixed_delay"}))
    assert list(errors) == ["max_concurrency"]
    again = row(store, "feed-7")
    assert again is not None and again.version == after.version


def test_editing_the_timing_replaces_it(store: Store, client_as: Any) -> None:
    """Switching an interval schedule to a crontab stores the new timing in the app's time zone."""
    add_runtime()
    client = client_as("editor")
    url = f"{SCHEDULES}feed-7/change/"
    data = {**form_data(client.get(url)), "kind": "crontab", "minute": "*/10"}
    response = client.post(url, data)
    assert response.status_code == 302, field_errors(response)
    changed = row(store, "feed-7")
    assert changed is not None and changed.timing is not None
    assert changed.timing == {**changed.timing, "kind": "crontab", "minute": "*/10", "timezone": "UTC"}
    assert changed.period is None and changed.policy["max_concurrency"] == 2


def test_removing_keeps_the_runs_and_can_revoke_the_active_ones(store: Store, client_as: Any) -> None:
    """The delete page offers a revoke choice and says how many runs it revoked; remove_schedule
    deletes the row and keeps its history."""
    from django.test import override_settings

    add_runtime("feed-7")
    add_runtime("feed-8")
    t = datetime(2024, 3, 5, tzinfo=UTC)
    done = add_run(store, "feed-7", "completed", t)
    active = {
        name: add_run(store, name, "started", datetime(2024, 3, 6, tzinfo=UTC))
        for name in ("feed-7", "feed-8")
    }
    client = client_as("editor")
    assert 'name="revoke_active"' in page(client.get(f"{SCHEDULES}feed-7/delete/"))

    with override_settings(CELERY_BROKER_URL="memory://"):
        response = client.post(
            f"{SCHEDULES}feed-7/delete/", {"post": "yes", "revoke_active": "on"}, follow=True
        )
        assert "1 run of &#x27;feed-7&#x27; revoked" in page(response)
        kept = client.post(f"{SCHEDULES}feed-8/delete/", {"post": "yes"}, follow=True)
        assert "revoked" not in page(kept)
    assert row(store, "feed-7") is None and row(store, "feed-8") is None
    states = {run_id: run.state for run_id in (done, *active.values()) if (run := store.run(run_id))}
    assert states == {done: "completed", active["feed-7"]: "revoked", active["feed-8"]: "started"}

    missing = client.post(f"{SCHEDULES}feed-7/delete/", {"post": "yes"}, follow=True)
    assert "Perhaps it was deleted?" in page(missing)


def test_each_change_needs_its_own_permission(store: Store, client_as: Any) -> None:
    """add_schedule, change_schedule and delete_schedule each open one page; the others are 403."""
    add_runtime()
    change, delete = f"{SCHEDULES}feed-7/change/", f"{SCHEDULES}feed-7/delete/"
    editor_data = form_data(client_as("editor").get(change))
    expected = {
        "viewer": (403, 403, 403),
        "adder": (200, 403, 403),
        "changer": (403, 200, 403),
        "deleter": (403, 403, 200),
    }
    for user, (add_status, change_status, delete_status) in expected.items():
        client = client_as(user)
        assert client.get(ADD).status_code == add_status, user
        change_page = page(client.get(change))
        assert ('name="_save"' in change_page) == (change_status == 200), user
        assert client.get(delete).status_code == delete_status, user
        if add_status == 403:
            assert client.post(ADD, {**INTERVAL, "name": f"by-{user}"}).status_code == 403
        if change_status == 403:
            assert client.post(change, {**editor_data, "max_concurrency": "9"}).status_code == 403
        if delete_status == 403:
            assert client.post(delete, {"post": "yes"}).status_code == 403
    assert {s.name for s in store.schedules()} == {"feed-7", "refresh-cache", "export-report", "poll-partner"}
    kept = row(store, "feed-7")
    assert kept is not None and kept.policy["max_concurrency"] == 2


def test_a_config_schedule_is_read_only_and_says_where_it_comes_from(store: Store, client_as: Any) -> None:
    """A superuser sees a config schedule's page without a save button; posting to it is refused."""
    client = client_as("root")
    url = f"{SCHEDULES}poll-partner/change/"
    html = page(client.get(url))
    assert 'name="_save"' not in html and "/delete/" not in html
    assert "beat_schedule in the beat&#x27;s Celery config" in html and "change it there" in html
    before = row(store, "poll-partner")
    data = {**INTERVAL, "name": "poll-partner", "task": "proj.tasks.other"}
    assert client.post(url, data).status_code == 403
    assert client.post(f"{SCHEDULES}poll-partner/delete/", {"post": "yes"}).status_code == 403
    after = row(store, "poll-partner")
    assert before is not None and after is not None
    assert (after.task, after.version) == (before.task, before.version)

    add_runtime()
    assert "Added at runtime" in page(client_as("viewer").get(f"{SCHEDULES}feed-7/change/"))


def test_resuming_an_ended_schedule_is_refused_with_a_warning(store: Store, client_as: Any) -> None:
    """resume of a schedule its max_runs ended warns (ScheduleEndedError) and leaves it stopped."""
    add_runtime(max_runs=1)
    with store.session() as s:
        ended = {"stopped": True, "stop_reason": "max_runs", "grid_runs": 1, "next_due_at": None}
        s.execute(update(ScheduleRow).where(ScheduleRow.name == "feed-7").values(**ended))
    client = client_as("operator")
    data = {"action": "resume_schedules", "_selected_action": ["feed-7", "poll-partner"]}
    html = page(client.post(SCHEDULES, data, follow=True))
    assert "Schedule &#x27;feed-7&#x27; was not resumed: cannot resume" in html
    assert "Schedule &#x27;poll-partner&#x27; resumed." in html
    kept = row(store, "feed-7")
    assert kept is not None and kept.stopped and kept.stop_reason == "max_runs"


def test_an_unknown_option_key_is_saved_with_a_warning(store: Store, client_as: Any) -> None:
    """``{"queu": ...}`` is not refused (a router may read it) but the next page warns about it."""
    options = '{"queu": "reports", "priority": 3}'
    response = client_as("editor").post(ADD, {**INTERVAL, "options": options}, follow=True)
    html = page(response)
    assert "&#x27;queu&#x27; is not a Celery apply_async option (did you mean &#x27;queue&#x27;?)" in html
    saved = row(store, "tenant-1")
    assert saved is not None and saved.options == {"queu": "reports", "priority": 3}
    change = page(client_as("editor").get(f"{SCHEDULES}tenant-1/change/"))
    assert "Warning: options: &#x27;queu&#x27; is not a Celery apply_async option" in change
