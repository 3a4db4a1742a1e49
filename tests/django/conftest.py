"""A Django project in this process, on a PostgreSQL database that exists for one session.

Django settings are configured only while a module of this folder runs: other test folders
must keep seeing a process without Django settings (and so the SQLite default URL).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pgtools import throwaway_database
from sqlalchemy import create_engine, delete

from celery_boundedbeat.migrate import upgrade
from celery_boundedbeat.schema import QueueRow, RunRow, ScheduleRow

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # bbtest_settings / bbtest_urls, whatever the import mode

from bbtest_settings import PASSWORD, django_settings  # noqa: E402

#: Saved between modules so every module sees the same configured settings object.
_configured: dict[str, Any] = {}


@pytest.fixture(scope="session")
def bb_database() -> Iterator[str]:
    """A fresh database with Django's tables and the celery_boundedbeat schema."""
    with throwaway_database("bb_django") as database:
        try:
            engine = create_engine(database.url)
            upgrade(engine)
            engine.dispose()
            yield database.name
        finally:
            _close_django_connections()


def _close_django_connections() -> None:
    if "django.db" in sys.modules:
        from django.db import connections

        connections.close_all()


@pytest.fixture(scope="module", autouse=True)
def django_project(bb_database: str) -> Iterator[None]:
    """Django settings configured (and ``migrate`` run once) for the duration of one module."""
    import django
    from django.conf import settings
    from django.utils.functional import empty

    if "wrapped" in _configured:
        settings._wrapped = _configured["wrapped"]
    else:
        assert not settings.configured, "Django settings were configured outside tests/django"
        settings.configure(**django_settings(bb_database))
        django.setup()
        from django.core.management import call_command

        call_command("migrate", interactive=False, verbosity=0)
        _configured["wrapped"] = settings._wrapped
    try:
        yield
    finally:
        _close_django_connections()
        settings._wrapped = empty


@pytest.fixture
def bb_url(bb_database: str) -> str:
    """The SQLAlchemy URL the Django default database translates to."""
    from urllib.parse import quote

    return f"postgresql+psycopg://postgres:{quote(PASSWORD, safe='')}@127.0.0.1:5432/{bb_database}"


@pytest.fixture
def clean_tables(bb_database: str) -> Iterator[None]:
    """Each test starts with no schedules, runs or queued messages."""
    from celery_boundedbeat.engine import get_engine
    from celery_boundedbeat.settings import django_default_database_url

    url = django_default_database_url()
    assert url is not None
    with get_engine(url).begin() as conn:
        for table in (QueueRow, RunRow, ScheduleRow):
            conn.execute(delete(table))
    yield
