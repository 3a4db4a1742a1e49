# mypy: allow-subclassing-any
"""``manage.py boundedbeat_migrate``: create or upgrade the celery_boundedbeat tables.

The same Alembic migrations as ``celery -A proj boundedbeat migrate``, on the database the
Django settings name (``CELERY_BOUNDEDBEAT_DATABASE_URL``, else ``DATABASES["default"]``), so
a Django project needs no Celery command line to set up or upgrade.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from sqlalchemy.exc import SQLAlchemyError

from .....core.exceptions import BoundedBeatError
from .....core.redact import driver_reason, mask_url
from .....db.engine import get_engine
from .....db.migrate import current_revision, upgrade
from ...conf import boundedbeat_settings


class Command(BaseCommand):
    help = "Create or upgrade the celery_boundedbeat tables (Alembic); safe to run again."
    #: The checks would warn about the very tables this command creates.
    requires_system_checks: list[str] = []

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            url = boundedbeat_settings().database_url
            engine = get_engine(url)
            before = current_revision(engine)
            upgrade(engine)
            after = current_revision(engine)
        except BoundedBeatError as exc:
            raise CommandError(str(exc)) from None
        except SQLAlchemyError as exc:
            raise CommandError(f"cannot migrate {mask_url(url)}: {driver_reason(exc, url)}") from None
        change = "already at" if before == after else f"upgraded from {before or 'nothing'} to"
        self.stdout.write(f"celery_boundedbeat tables in {mask_url(url)}: {change} revision {after}")
