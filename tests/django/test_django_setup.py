"""Setting the tables up from Django: ``manage.py boundedbeat_migrate`` and the system check of the tables."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_the_api_in_a_django_project_names_manage_py(empty_sqlite: str) -> None:
    """From a Django view, an unmigrated database is DatabaseNotMigratedError naming both commands."""
    from celery import Celery

    import celery_boundedbeat as bb

    app = Celery("proj", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    with pytest.raises(bb.DatabaseNotMigratedError) as info:
        bb.add_schedule(app, "tenant-1", "proj.tasks.refresh_cache", 30.0)
    message = str(info.value)
    assert "`python manage.py boundedbeat_migrate`" in message, message
    assert "`celery -A proj boundedbeat migrate`" in message, message


def test_enqueue_on_a_django_connection_without_the_tables_says_what_to_run(tmp_path: Path) -> None:
    """enqueue() through a Django connection to a database nobody migrated: DatabaseNotMigratedError."""
    from django.db.utils import ConnectionHandler

    import celery_boundedbeat as bb

    handler = ConnectionHandler(
        {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "fresh.sqlite3")}}
    )
    connection = handler["default"]  # a connection of its own, to a file nobody migrated
    try:
        with pytest.raises(bb.DatabaseNotMigratedError, match=r"manage\.py boundedbeat_migrate"):
            bb.enqueue(connection, "proj.tasks.refresh_cache")
    finally:
        connection.close()


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


#: A Django project as a user starts one: its settings and Celery app, ``manage.py``.
_PROJECT_FILES = {
    "manage.py": (
        "import os, sys\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'badurl.settings')\n"
        "from django.core.management import execute_from_command_line\n"
        "execute_from_command_line(sys.argv)\n"
    ),
    "badurl/__init__.py": "",
    "badurl/settings.py": (
        "import os\n"
        "SECRET_KEY = 'tests-only'\n"
        "DEBUG = True\n"
        "ALLOWED_HOSTS = ['127.0.0.1']\n"
        "ROOT_URLCONF = 'badurl.urls'\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'django.contrib.auth',\n"
        "                  'celery_boundedbeat.contrib.django']\n"
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3',\n"
        "                         'NAME': os.path.join(os.path.dirname(__file__), 'django.sqlite3')}}\n"
        "USE_TZ = True\n"
        "CELERY_BROKER_URL = 'memory://'\n"
        "CELERY_BOUNDEDBEAT_DATABASE_URL = os.environ['BADURL_DATABASE_URL']\n"
    ),
    "badurl/urls.py": "urlpatterns = []\n",
    "badurl/celery.py": (
        "import os\n"
        "from celery import Celery\n"
        "import celery_boundedbeat\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'badurl.settings')\n"
        "app = Celery('badurl')\n"
        "app.config_from_object('django.conf:settings', namespace='CELERY')\n"
        "celery_boundedbeat.install(app)\n"
    ),
}

#: A driver this environment lacks, and a URL SQLAlchemy cannot parse (each with a password).
_BAD_URLS = {
    "missing driver": "mysql+mysqldb://app:s3cr3t-pw@db.example/app",
    "unparsable": "postgresql+psycopg://app:s3cr3t-pw@db.example:notaport/app",
}

_VENV_BIN = Path(sys.executable).parent
_COMMANDS = {
    "manage.py check": [sys.executable, "manage.py", "check"],
    "manage.py migrate": [sys.executable, "manage.py", "migrate", "--noinput"],
    "manage.py runserver": [sys.executable, "manage.py", "runserver", "--noreload", "127.0.0.1:0"],
    "celery worker": [str(_VENV_BIN / "celery"), "-A", "badurl", "worker", "-P", "solo"],
    "celery beat": [str(_VENV_BIN / "celery"), "-A", "badurl", "beat", "-S", "celery_boundedbeat.Scheduler"],
}


@pytest.fixture(scope="module")
def badurl_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's files in a fresh folder."""
    root = tmp_path_factory.mktemp("badurl_project")
    for name, content in _PROJECT_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return root


@pytest.mark.parametrize("kind", sorted(_BAD_URLS))
@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_an_unusable_database_url_ends_django_processes_with_one_message(
    badurl_project: Path, command: str, kind: str
) -> None:
    """A URL with a missing driver or that cannot be parsed ends every Django process with exit 78,
    the setting named and no traceback (the system check ran ``get_engine`` outside its except)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "CELERY_"))}
    env["BADURL_DATABASE_URL"] = _BAD_URLS[kind]
    done = subprocess.run(
        _COMMANDS[command], cwd=badurl_project, env=env, capture_output=True, text=True, timeout=60
    )
    output = done.stdout + done.stderr
    assert done.returncode == 78, output
    assert "Traceback" not in output, output
    assert "boundedbeat_database_url" in output and "app:***@db.example" in output, output
    assert "s3cr3t-pw" not in output
    assert len(done.stderr.strip().splitlines()) <= 3, output


def test_the_cli_in_a_django_project_names_manage_py_for_an_unmigrated_database(
    badurl_project: Path, tmp_path: Path
) -> None:
    """`celery -A badurl boundedbeat status` on a fresh database names both migrate commands."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "CELERY_"))}
    env["BADURL_DATABASE_URL"] = f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
    done = subprocess.run(
        [str(_VENV_BIN / "celery"), "-A", "badurl", "boundedbeat", "status"],
        cwd=badurl_project,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    expected = "run `python manage.py boundedbeat_migrate` (or `celery -A badurl boundedbeat migrate`) first"
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr
