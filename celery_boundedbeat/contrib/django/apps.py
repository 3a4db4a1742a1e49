# mypy: allow-subclassing-any
"""The Django application config."""

from __future__ import annotations

from django.apps import AppConfig


class BoundedBeatConfig(AppConfig):
    """Registers the admin pages and the system check of the settings they rely on."""

    name = "celery_boundedbeat.contrib.django"
    label = "celery_boundedbeat"
    verbose_name = "Celery bounded beat"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the checks)
