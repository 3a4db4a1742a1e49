# mypy: allow-untyped-decorators
"""System checks: catch a mistyped admin database alias at startup, not on the first page."""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
from django.core import checks

from .conf import ADMIN_DATABASE_SETTING, admin_database


@checks.register()
def check_admin_database(**kwargs: Any) -> list[checks.CheckMessage]:
    alias = admin_database()
    if alias in django_settings.DATABASES:
        return []
    return [
        checks.Error(
            f"{ADMIN_DATABASE_SETTING} names the database alias {alias!r}, which is not in DATABASES.",
            hint="Add a DATABASES entry for the celery_boundedbeat tables or fix the alias.",
            id="celery_boundedbeat.E001",
        )
    ]
