"""Setting the tables up from Django: ``manage.py boundedbeat_migrate`` and the system check of the tables."""

from __future__ import annotations

from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from bbtest_admin import RUNS
from sqlalchemy import create_engine, text

from celery_boundedbeat.db.migrate import head_revision, upgrade

pytestmark = [pytest.mark.postgres]


@pytest.fixture
def empty_sqlite(tmp_path: Path) -> Iterator[str]:
    """CELERY_BOUNDEDBEAT_DATABASE_URL pointing at a SQLite file nobody migrated."""
    from django.test import override_settings

    url = f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
    with override_settings(CELERY_BOUNDEDBEAT_DATABASE_URL=url):
        yield url


def test_the_check_is_silent_on_a_migrated_database() -> None:
    """On the test database, at the head revision, the tables check reports nothing."""
    from celery_boundedbeat.contrib.django.checks import check_tables

    assert check_tables() == []


def test_the_check_names_the_missing_tables(empty_sqlite: str) -> None:
    """`manage.py check` on an unmigrated database warns naming every missing table and the command to run."""
    from django.core.management import call_command

    from celery_boundedbeat.contrib.django.checks import check_tables

    (warning,) = check_tables()
    assert warning.id == "celery_boundedbeat.W002"
    assert "has no schema revision" in warning.msg
    assert "boundedbeat_runs" in warning.msg and "boundedbeat_schedules" in warning.msg
    assert "manage.py boundedbeat_migrate" in str(warning.hint)
    err = StringIO()
    call_command("check", stderr=err, stdout=StringIO())
    assert "celery_boundedbeat.W002" in err.getvalue() and "boundedbeat_runs" in err.getvalue()


def test_the_check_names_an_outdated_schema(empty_sqlite: str) -> None:
    """A database at an older revision is reported with its revision and the one this version needs."""
    from celery_boundedbeat.contrib.django.checks import check_tables

    engine = create_engine(empty_sqlite)
    upgrade(engine, "0001")
    engine.dispose()
    (warning,) = check_tables()
    assert "revision 0001" in warning.msg and f"needs {head_revision()}" in warning.msg, warning.msg


def test_boundedbeat_migrate_creates_and_then_keeps_the_tables(empty_sqlite: str) -> None:
    """The management command creates the tables on a fresh database and is a no-op the second time."""
    from django.core.management import call_command

    from celery_boundedbeat.contrib.django.checks import check_tables

    first, second = StringIO(), StringIO()
    call_command("boundedbeat_migrate", stdout=first)
    assert f"upgraded from nothing to revision {head_revision()}" in first.getvalue()
    assert check_tables() == []
    call_command("boundedbeat_migrate", stdout=second)
    assert f"already at revision {head_revision()}" in second.getvalue()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_admin_pages_without_the_tables_say_what_to_run(backend: str, client_as: Any) -> None:
    """A change list whose table is missing redirects to the admin index naming it, instead of a 500."""
    engine = create_engine(backend)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE boundedbeat_runs RENAME TO boundedbeat_runs_away"))
    try:
        response = client_as("viewer").get(RUNS, follow=True)
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE boundedbeat_runs_away RENAME TO boundedbeat_runs"))
        engine.dispose()
    assert response.redirect_chain == [("/admin/", 302)]
    html = response.content.decode()
    assert "missing the tables boundedbeat_runs" in html and "boundedbeat_migrate" in html
