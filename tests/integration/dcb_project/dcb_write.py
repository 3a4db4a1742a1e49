"""Create django-celery-beat's tables and schedules through its own models.

``python dcb_write.py SPEC_JSON``: SPEC_JSON is a list of tasks, each ``{"name", "task",
"kind": interval|crontab|solar|clocked, ...}``; times are ISO 8601 text. Prints, as JSON by
name, the args, kwargs and options django-celery-beat's own ``ModelEntry`` would send each
task with. Run with ``DJANGO_SETTINGS_MODULE=dcb_settings``.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django_celery_beat import models  # noqa: E402
from django_celery_beat.schedulers import ModelEntry  # noqa: E402


def _time(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


def _schedule(spec: dict[str, Any]) -> dict[str, Any]:
    kind = spec["kind"]
    if kind == "interval":
        every, period = spec["every"]
        return {"interval": models.IntervalSchedule.objects.create(every=every, period=period)}
    if kind == "crontab":
        fields = dict(spec["crontab"])
        return {"crontab": models.CrontabSchedule.objects.create(**fields)}
    if kind == "solar":
        event, lat, lon = spec["solar"]
        return {"solar": models.SolarSchedule.objects.create(event=event, latitude=lat, longitude=lon)}
    return {"clocked": models.ClockedSchedule.objects.create(clocked_time=_time(spec["clocked"]))}


def main(specs: list[dict[str, Any]]) -> None:
    call_command("migrate", verbosity=0)
    for spec in specs:
        fields = {
            key: spec[key]
            for key in (
                "queue",
                "exchange",
                "routing_key",
                "priority",
                "one_off",
                "enabled",
                "expire_seconds",
            )
            if key in spec
        }
        for key in ("start_time", "expires", "last_run_at"):
            if key in spec:
                fields[key] = _time(spec[key])
        task = models.PeriodicTask.objects.create(
            name=spec["name"],
            task=spec["task"],
            args=spec.get("args", "[]"),
            kwargs=spec.get("kwargs", "{}"),
            headers=spec.get("headers", "{}"),
            **_schedule(spec),
            **fields,
        )
        if "last_run_at" in spec or "total_run_count" in spec:
            # As its beat writes them (save() would stamp date_changed and reset last_run_at).
            models.PeriodicTask.objects.filter(pk=task.pk).update(
                last_run_at=_time(spec.get("last_run_at")), total_run_count=spec.get("total_run_count", 0)
            )


def sent() -> dict[str, Any]:
    """What django-celery-beat's scheduler would send each task with."""
    out = {}
    for task in models.PeriodicTask.objects.all():
        try:
            entry = ModelEntry(task)
        except Exception as exc:  # a row its beat cannot read either
            out[task.name] = {"error": repr(exc)}
            continue
        out[task.name] = {"args": entry.args, "kwargs": entry.kwargs, "options": entry.options}
    return out


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    print(json.dumps(sent(), default=str))
