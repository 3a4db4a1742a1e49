"""Every setting works from Django settings (CELERY_ namespace); the URL defaults to Django's database."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bbtest_settings import PASSWORD
from celery import Celery
from sqlalchemy import text
from sqlalchemy.engine import make_url

from celery_boundedbeat.config.entries import build_specs
from celery_boundedbeat.config.settings import DEFAULT_DATABASE_URL, Settings, database_url_from_django
from celery_boundedbeat.core.enums import Mode
from celery_boundedbeat.core.exceptions import ConfigurationError
from celery_boundedbeat.core.redact import mask_url
from celery_boundedbeat.db.engine import get_engine

pytestmark = pytest.mark.postgres


def django_celery_settings() -> Settings:
    app = Celery("proj", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    return Settings.from_conf(app.conf)


@pytest.fixture
def default_db(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Replace DATABASES["default"] for one test (the open connection keeps its own copy)."""
    from django.conf import settings

    def use(**entry: Any) -> None:
        monkeypatch.setitem(settings.DATABASES, "default", entry)

    yield use


def test_boundedbeat_settings_come_from_celery_namespaced_django_settings() -> None:
    """CELERY_BOUNDEDBEAT_* Django settings reach Settings through config_from_object(namespace=CELERY)."""
    from django.test import override_settings

    with override_settings(
        CELERY_BOUNDEDBEAT_DATABASE_URL="postgresql+psycopg://u@elsewhere/beat",
        CELERY_BOUNDEDBEAT_DEFAULT_POLICY={"mode": "fixed_delay"},
        CELERY_BOUNDEDBEAT_POLL_INTERVAL=2,
        CELERY_BOUNDEDBEAT_DISPATCH_ENABLED=False,
    ):
        settings = django_celery_settings()
    assert settings.database_url == "postgresql+psycopg://u@elsewhere/beat"
    assert dict(settings.default_policy) == {"mode": "fixed_delay"}
    assert settings.poll_interval == 2.0
    assert settings.dispatch_enabled is False


def test_invalid_django_settings_are_reported_under_their_key() -> None:
    """A bad CELERY_BOUNDEDBEAT_* value is a ConfigurationError naming the key, not a silent default."""
    from django.test import override_settings

    with (
        override_settings(CELERY_BOUNDEDBEAT_DATABASE_URL="", CELERY_BOUNDEDBEAT_LEASE_TTL=-1),
        pytest.raises(ConfigurationError) as info,
    ):
        django_celery_settings()
    assert {key for _e, key, _r in info.value.problems} == {
        "boundedbeat_database_url",
        "boundedbeat_lease_ttl",
    }


def test_celery_beat_schedule_with_policy_is_read_from_django_settings() -> None:
    """CELERY_BEAT_SCHEDULE entries keep their policy key and validate like beat_schedule."""
    app = Celery("proj", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    specs = build_specs(app, Settings.from_conf(app.conf).default_policy)
    assert {name: spec.policy.mode for name, spec in specs.items()} == {
        "refresh-cache": Mode.FIXED_DELAY,
        "export-report": Mode.FIXED_RATE_NO_OVERLAP,
        "poll-partner": Mode.FIXED_RATE,
    }
    assert specs["poll-partner"].policy.max_concurrency == 2


def test_without_a_url_the_django_default_database_is_used(bb_url: str, bb_database: str) -> None:
    """No CELERY_BOUNDEDBEAT_DATABASE_URL: the URL is Django's default database, and it connects."""
    settings = django_celery_settings()
    assert settings.database_url == bb_url
    parsed = make_url(settings.database_url)
    assert (parsed.drivername, parsed.username, parsed.password) == (
        "postgresql+psycopg",
        "postgres",
        PASSWORD,
    )
    assert (parsed.host, parsed.port, parsed.database) == ("127.0.0.1", 5432, bb_database)
    with get_engine(settings.database_url).connect() as conn:
        assert conn.execute(text("SELECT current_database()")).scalar() == bb_database
    assert not settings.is_sqlite


def test_the_derived_password_is_never_shown() -> None:
    """The password stays out of mask_url, repr(Settings) and the Settings' str."""
    settings = django_celery_settings()
    assert PASSWORD in make_url(settings.database_url).password
    for shown in (mask_url(settings.database_url), repr(settings), str(settings)):
        assert PASSWORD not in shown
        assert "p%40ss" not in shown  # nor its escaped form
    assert "***" in mask_url(settings.database_url)


def test_sqlite_django_database_gives_an_absolute_sqlite_url(default_db: Any) -> None:
    """A relative SQLite NAME becomes an absolute sqlite:/// URL (the same file Django opens)."""
    default_db(ENGINE="django.db.backends.sqlite3", NAME="proj.sqlite3")
    settings = django_celery_settings()
    assert settings.database_url == "sqlite:///" + os.path.abspath("proj.sqlite3")
    assert settings.is_sqlite and settings.should_auto_migrate


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ({"ENGINE": "django.db.backends.mysql", "NAME": "app", "PASSWORD": PASSWORD}, "neither PostgreSQL"),
        ({"ENGINE": "django.db.backends.oracle", "NAME": "app", "PASSWORD": PASSWORD}, "neither PostgreSQL"),
        ({"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}, "in-memory"),
        ({"ENGINE": "django.db.backends.postgresql", "PORT": "x", "PASSWORD": PASSWORD}, "PORT"),
    ],
)
def test_unusable_django_databases_are_a_clear_error(
    default_db: Any, entry: dict[str, Any], reason: str
) -> None:
    """Other engines are a ConfigurationError naming the setting, never quoting the password."""
    default_db(**entry)
    with pytest.raises(ConfigurationError) as info:
        django_celery_settings()
    ((entry_name, key, why),) = info.value.problems
    assert (entry_name, key) == ("settings", "boundedbeat_database_url")
    assert reason in why and "CELERY_BOUNDEDBEAT_DATABASE_URL" in why
    for shown in (str(info.value), repr(info.value), why):
        assert PASSWORD not in shown


def test_an_explicit_url_wins_over_the_django_database(default_db: Any) -> None:
    """With CELERY_BOUNDEDBEAT_DATABASE_URL set, Django's DATABASES is not even looked at."""
    from django.test import override_settings

    default_db(ENGINE="django.db.backends.mysql", NAME="app")
    with override_settings(CELERY_BOUNDEDBEAT_DATABASE_URL="sqlite:///beat.sqlite3"):
        assert django_celery_settings().database_url == "sqlite:///beat.sqlite3"


def test_plain_celery_keeps_the_sqlite_default_without_configured_django(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Django imported but not configured (a plain Celery app): the SQLite default stays."""
    from django.conf import settings
    from django.utils.functional import empty

    monkeypatch.setattr(settings, "_wrapped", empty)
    assert not settings.configured
    app = Celery("plain", set_as_current=False)
    assert Settings.from_conf(app.conf).database_url == DEFAULT_DATABASE_URL


def test_settings_work_where_django_cannot_be_imported() -> None:
    """With Django unimportable, settings load and a plain Celery app gets the SQLite default."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'django':\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import celery, celery_boundedbeat.config.settings as s\n"
        "conf = celery.Celery('plain', set_as_current=False).conf\n"
        "assert s.Settings.from_conf(conf).database_url == s.DEFAULT_DATABASE_URL\n"
        "assert 'django.conf' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_settings_module_never_imports_django_or_sqlalchemy() -> None:
    """settings.py stays in the pure layer: not even a function-level Django or SQLAlchemy import."""
    import celery_boundedbeat.config.settings as module

    tree = ast.parse(Path(module.__file__ or "").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] in ("django", "sqlalchemy")}


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            {"NAME": "app", "USER": "u@x", "PASSWORD": "a%7db/:@", "HOST": "db.example", "PORT": 5433},
            {
                "username": "u@x",
                "password": "a%7db/:@",
                "host": "db.example",
                "port": 5433,
                "database": "app",
            },
        ),
        (
            {"NAME": "app", "HOST": "/var/run/postgresql", "PORT": "5432"},
            {"host": None, "database": "app", "query": {"host": "/var/run/postgresql", "port": "5432"}},
        ),
        ({"NAME": "app", "HOST": "::1"}, {"host": "::1", "database": "app"}),
        ({"NAME": "odd name/?#", "HOST": "h"}, {"database": None, "query": {"dbname": "odd name/?#"}}),
        (
            {"NAME": "app", "OPTIONS": {"sslmode": "require", "pool": True, "isolation_level": 2}},
            {"database": "app", "query": {"sslmode": "require"}},
        ),
    ],
)
def test_postgresql_entries_translate_faithfully(entry: dict[str, Any], expected: dict[str, Any]) -> None:
    """Each Django connection field lands where SQLAlchemy and psycopg read it back unchanged."""
    url = make_url(database_url_from_django({"ENGINE": "django.db.backends.postgresql", **entry}))
    assert url.drivername == "postgresql+psycopg"
    for field, value in expected.items():
        actual = dict(url.query) if field == "query" else getattr(url, field)
        assert actual == value or (field == "database" and value is None and not actual), field
