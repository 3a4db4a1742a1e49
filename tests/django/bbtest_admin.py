"""Helpers of the admin tests: the project's Celery app, run rows, and pages read like a browser."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any

from celery import Celery
from django import forms

from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import RunRow

SCHEDULES = "/admin/celery_boundedbeat/schedule/"
RUNS = "/admin/celery_boundedbeat/run/"


def celery_app() -> Celery:
    """The project's Celery app, configured from the Django settings as a project does."""
    app = Celery("proj", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    return app


def add_run(store: Store, schedule: str, state: str, scheduled_for: datetime, **extra: Any) -> str:
    run_id = str(uuid.uuid4())
    with store.session() as s:
        s.add(
            RunRow(
                id=run_id,
                schedule=schedule,
                task=f"proj.tasks.{schedule.replace('-', '_')}",
                state=state,
                scheduled_for=scheduled_for,
                enqueued_at=scheduled_for,
                **extra,
            )
        )
    return run_id


def page(response: Any) -> str:
    assert response.status_code == 200, response.status_code
    return str(response.content.decode())


def changelist_names(html: str) -> set[str]:
    """Primary keys of the rows shown in a changelist: a schedule's linked name, a run's full id
    (the run list shows a short id and keeps the whole one in its tooltip)."""
    names = re.findall(r'<th class="field-name"><a href="[^"]*">([^<]+)</a>', html)
    ids = re.findall(r'<th class="field-run_id"><a href="[^"]*"><span class="bb-id" title="([^"]+)"', html)
    return {*names, *ids}


def form_data(response: Any) -> dict[str, str]:
    """What a browser would post back from an admin form page, unchanged."""
    form = response.context["adminform"].form
    data: dict[str, str] = {}
    for name, field in form.fields.items():
        value = form[name].value()
        if isinstance(field, forms.SplitDateTimeField):
            day, time = field.widget.decompress(value) if value else (None, None)
            data[f"{name}_0"] = day.isoformat() if day else ""
            data[f"{name}_1"] = time.strftime("%H:%M:%S") if time else ""
        else:
            data[name] = "" if value is None else str(value)
    return data


def field_errors(response: Any) -> dict[str, list[str]]:
    """The errors a re-shown admin form carries, by field (``__all__`` for the whole form)."""
    assert response.status_code == 200, response.status_code
    return {k: list(v) for k, v in response.context["adminform"].form.errors.items()}


#: A traceback as a worker records it for a failed run (the first line is the summary).
TRACEBACK = (
    "ValueError: partner answered 503\n\n"
    "Traceback (most recent call last):\n"
    '  File "/app/proj/tasks.py", line 42, in poll_partner\n'
    "    response.raise_for_status()\n"
    "ValueError: partner answered 503"
)


def add_history(
    store: Store, schedule: str, now: datetime, count: int = 30, period: float = 10.0
) -> list[str]:
    """``count`` settled runs of ``schedule`` on a ``period`` grid ending at ``now``, deterministic.

    Durations vary around the period so some runs overlap; a few fail (with a traceback) or
    time out, and the newest is still running: what a busy fixed_rate schedule looks like.
    """
    import random
    from datetime import timedelta

    rng = random.Random(7)
    ids = []
    for n in range(count):
        due = now - timedelta(seconds=period * (count - n))
        drift = rng.randint(2, 40) if n % 7 else rng.randint(300, 900)
        started = due + timedelta(milliseconds=drift + rng.randint(5, 60))
        elapsed = rng.randint(1500, 9000) if n % 9 else rng.randint(11_000, 16_000)
        state = "failed" if n % 11 == 5 else "timed_out" if n == 17 else "completed"
        extra: dict[str, Any] = {
            "published_at": due + timedelta(milliseconds=drift),
            "started_at": started,
            "drift_ms": drift,
            "worker": "celery@worker-1",
        }
        if n == count - 1:
            extra["published_at"] = due
            state = "started"
        else:
            extra.update(finished_at=started + timedelta(milliseconds=elapsed), elapsed_ms=elapsed)
        if state == "failed":
            extra["error"] = TRACEBACK
        elif state == "timed_out":
            extra["error"] = "SoftTimeLimitExceeded: SoftTimeLimitExceeded()"
        ids.append(add_run(store, schedule, state, due, **extra))
    return ids
