"""celery_boundedbeat settings as the Django web process sees them.

The Celery app of a Django project reads ``CELERY_``-prefixed Django settings
(``app.config_from_object("django.conf:settings", namespace="CELERY")``); the admin reads the
same keys, so its actions reach the database beat and the CLI use.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from django.conf import settings as django_settings

from ...config.settings import Settings
from ...db.engine import get_engine
from ...db.store import Store

#: The Celery namespace of Django settings (docs/settings.md).
NAMESPACE = "CELERY"
#: Django setting naming the ``DATABASES`` alias where the admin reads the tables.
ADMIN_DATABASE_SETTING = "BOUNDEDBEAT_ADMIN_DATABASE"


class DjangoConf:
    """Django settings seen as a Celery conf: ``boundedbeat_x`` is ``CELERY_BOUNDEDBEAT_X``."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(django_settings, f"{NAMESPACE}_{key.upper()}", default)


def boundedbeat_settings() -> Settings:
    """Validated settings; without a database URL, Django's default database is used."""
    return Settings.from_conf(DjangoConf())


def admin_database() -> str:
    """The ``DATABASES`` alias whose connection reads the tables for the admin."""
    alias = getattr(django_settings, ADMIN_DATABASE_SETTING, None) or "default"
    return str(alias)


def celery_app() -> Celery:
    """A Celery app over the Django settings, for the schedule API the admin forms call.

    Made per use, not cached: it reads the settings as they are at that moment and costs
    nothing until asked. Use it as ``with celery_app() as app:`` so a broker connection that
    a revoke opened is released.
    """
    app = Celery("celery_boundedbeat.contrib.django", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace=NAMESPACE)
    return app


def store() -> Store:
    """The store the admin actions write through (the same code path as the CLI)."""
    return Store(get_engine(boundedbeat_settings().database_url))
