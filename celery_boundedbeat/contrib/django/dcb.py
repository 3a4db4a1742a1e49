"""django-celery-beat's ``PeriodicTask`` rows read through Django's ORM (``import django-celery-beat``).

Used when ``DJANGO_SETTINGS_MODULE`` is set: the rows come from the database and models the
project configures, as plain dicts by column name, and are mapped exactly like rows read with
SQL (:func:`celery_boundedbeat.api.dcb_source.map_tasks`).
"""

from __future__ import annotations

from typing import Any

from ...api.dcb_source import Rows


def read_models() -> Rows:
    """Every row of the five models, by kind and primary key (``django.setup()`` first)."""
    import django

    django.setup()
    from django_celery_beat import models

    kinds: dict[str, Any] = {
        "task": models.PeriodicTask,
        "interval": models.IntervalSchedule,
        "crontab": models.CrontabSchedule,
        "solar": models.SolarSchedule,
        "clocked": models.ClockedSchedule,
    }
    rows: dict[str, dict[Any, dict[str, Any]]] = {}
    for kind, model in kinds.items():
        fields = [f.attname for f in model._meta.concrete_fields]
        rows[kind] = {obj.pk: {f: getattr(obj, f) for f in fields} for obj in model.objects.all()}
    return rows
