"""Helpers of the admin tests: the project's Celery app, run rows, and pages read like a browser."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any

from celery import Celery
from django import forms

from celery_boundedbeat.schema import RunRow
from celery_boundedbeat.store import Store

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
    """Primary keys of the rows shown in a changelist (their ``action-select`` checkboxes or links)."""
    return set(re.findall(r'<th class="field-(?:name|id)"><a href="[^"]*">([^<]+)</a>', html))


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
