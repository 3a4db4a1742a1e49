"""A Django project in this process, on a PostgreSQL database that exists for one session.

Django settings are configured only while a module of this folder runs: other test folders
must keep seeing a process without Django settings (and so the SQLite default URL). Tests that
take the ``backend`` fixture run the celery_boundedbeat tables on PostgreSQL (Django's default
database) or, parametrized ``indirect`` with ``"sqlite"``, on a SQLite file.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pgtools import throwaway_database
from sqlalchemy import create_engine, delete

from celery_boundedbeat.config.definitions import config_definitions
from celery_boundedbeat.config.settings import Settings
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.migrate import upgrade
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow, RunRow, ScheduleRow

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # bbtest_settings / bbtest_urls, whatever the import mode

from bbtest_settings import PASSWORD, SQLITE_ALIAS, django_settings  # noqa: E402

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


@pytest.fixture(scope="session")
def bb_sqlite(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SQLAlchemy URL of a SQLite file with the celery_boundedbeat schema."""
    path = tmp_path_factory.mktemp("bb_django") / "boundedbeat.sqlite3"
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


def _close_django_connections() -> None:
    if "django.db" in sys.modules:
        from django.db import connections

        connections.close_all()


@pytest.fixture(scope="module", autouse=True)
def django_project(bb_database: str, bb_sqlite: str) -> Iterator[None]:
    """Django settings configured (and ``migrate`` run once) for the duration of one module."""
    import django
    from django.conf import settings
    from django.utils.functional import empty

    if "wrapped" in _configured:
        settings._wrapped = _configured["wrapped"]
    else:
        assert not settings.configured, "Django settings were configured outside tests/django"
        settings.configure(**django_settings(bb_database, bb_sqlite.removeprefix("sqlite:///")))
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
def backend(request: pytest.FixtureRequest, bb_sqlite: str) -> Iterator[str]:
    """The SQLAlchemy URL of the tables under test: Django's default database (PostgreSQL).

    Parametrized ``indirect`` with ``"sqlite"``, ``CELERY_BOUNDEDBEAT_DATABASE_URL`` and
    ``BOUNDEDBEAT_ADMIN_DATABASE`` point the API, the actions and the admin's reads at the
    SQLite file instead, as a project keeping the tables apart from Django's would.
    """
    from django.test import override_settings

    from celery_boundedbeat.config.settings import django_default_database_url

    if getattr(request, "param", "postgresql") == "postgresql":
        url = django_default_database_url()
        assert url is not None
        yield url
        return
    with override_settings(
        CELERY_BOUNDEDBEAT_DATABASE_URL=bb_sqlite, BOUNDEDBEAT_ADMIN_DATABASE=SQLITE_ALIAS
    ):
        yield bb_sqlite


@pytest.fixture
def clean_tables(backend: str) -> Iterator[None]:
    """Each test starts with no schedules, runs or queued messages."""
    with get_engine(backend).begin() as conn:
        for table in (QueueRow, RunRow, ScheduleRow):
            conn.execute(delete(table))
    yield


@pytest.fixture
def store(clean_tables: None, backend: str) -> Store:
    """Schedules from CELERY_BEAT_SCHEDULE, reconciled the way beat does when it takes the lease."""
    from bbtest_admin import celery_app

    app = celery_app()
    settings = Settings.from_conf(app.conf)
    assert settings.database_url == backend
    store = Store(get_engine(settings.database_url))
    definitions = config_definitions(app, settings.default_policy)
    store.sync_config(definitions.values(), datetime.now(UTC), random.Random(0))
    return store


#: Staff users of the admin tests and their celery_boundedbeat permissions; ``root`` is a
#: superuser and ``plain`` is not staff.
USERS: dict[str, tuple[str, ...]] = {
    "root": (),
    "operator": ("view_schedule", "view_run", "operate_schedule"),
    "viewer": ("view_schedule", "view_run"),
    "nobody": (),
    "plain": (),
    "editor": ("view_schedule", "view_run", "add_schedule", "change_schedule", "delete_schedule"),
    "adder": ("view_schedule", "add_schedule"),
    "changer": ("view_schedule", "change_schedule"),
    "deleter": ("view_schedule", "delete_schedule"),
}


@pytest.fixture(scope="module")
def users() -> dict[str, Any]:
    """The :data:`USERS`, made once per module."""
    from django.contrib.auth.models import Permission, User

    made: dict[str, Any] = {}
    for name, codenames in USERS.items():
        found = list(
            Permission.objects.filter(content_type__app_label="celery_boundedbeat", codename__in=codenames)
        )
        assert len(found) == len(codenames), codenames
        user, _ = User.objects.get_or_create(
            username=name, defaults={"is_staff": name != "plain", "is_superuser": name == "root"}
        )
        user.user_permissions.set(found)
        made[name] = user
    return made


@pytest.fixture
def client_as(users: dict[str, Any]) -> Callable[[str], Any]:
    """A test client logged in as one of the :data:`USERS`."""
    from django.test import Client

    def login(name: str) -> Client:
        client = Client()
        client.force_login(users[name])
        return client

    return login
