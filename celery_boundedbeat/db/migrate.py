"""Schema management through the Alembic migrations shipped with the package."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError, ProgrammingError

from ..config.settings import django_configured
from ..core.exceptions import DatabaseNotMigratedError
from .tables import VERSION_TABLE

#: Alembic's logger of the two lines it writes whenever it opens a migration context ("Context
#: impl SQLiteImpl.", "Will assume non-transactional DDL."): every beat start and CLI command.
_ALEMBIC_LOGGER = logging.getLogger("alembic.runtime.migration")
_ALEMBIC_NOISE = ("Context impl ", "Will assume ")


def _not_alembic_noise(record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and record.msg.startswith(_ALEMBIC_NOISE))


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Drop Alembic's two context lines while our code reads or migrates; ``Running upgrade`` stays."""
    _ALEMBIC_LOGGER.addFilter(_not_alembic_noise)
    try:
        yield
    finally:
        _ALEMBIC_LOGGER.removeFilter(_not_alembic_noise)


def migrations_path() -> Path:
    """The Alembic environment shipped inside the package (``db/migrations``)."""
    return Path(__file__).resolve().parent / "migrations"


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_path()))
    return config


def head_revision() -> str:
    """The newest migration shipped with this version of the package."""
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (``None`` when never migrated)."""
    with _quiet_alembic(), engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Create or upgrade the schema to ``revision``; safe to run again."""
    config = _config()
    with _quiet_alembic(), engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def migrate_hint(app_name: str | None = None) -> str:
    """The command that creates the tables: ``celery -A <app> boundedbeat migrate``, and Django's.

    ``app_name`` is the Celery app's ``main`` (what ``-A`` names); unknown, a placeholder.
    In a process with configured Django settings, ``manage.py boundedbeat_migrate`` comes first.
    """
    celery = f"`celery -A {app_name or '<your app>'} boundedbeat migrate`"
    if django_configured():
        return f"run `python manage.py boundedbeat_migrate` (or {celery}) first"
    return f"run {celery} first"


def require_current(engine: Engine, url_for_humans: str, app_name: str | None = None) -> None:
    """Fail clearly when the database is not at the head revision."""
    current = current_revision(engine)
    head = head_revision()
    if current != head:
        state = "has no celery_boundedbeat tables" if current is None else f"is at revision {current}"
        raise DatabaseNotMigratedError(
            f"the celery_boundedbeat database {url_for_humans} {state}, but this version needs "
            f"{head}: {migrate_hint(app_name)}"
        )


def missing_schema(exc: BaseException) -> bool:
    """Whether a failed statement may have met a missing table or column (never an outage).

    SQLAlchemy's errors and Django's (``enqueue`` on a Django connection) alike, by their DB-API
    class names: PostgreSQL says undefined table or column with a ProgrammingError (an outage is
    an OperationalError); SQLite with an OperationalError naming the table or column.
    """
    name = type(exc).__name__
    if isinstance(exc, ProgrammingError) or name == "ProgrammingError":
        return True
    text = str(getattr(exc, "orig", exc))
    operational = isinstance(exc, OperationalError) or name == "OperationalError"
    return operational and ("no such table" in text or "no such column" in text)


def not_migrated(
    engine: Engine, url_for_humans: str, app_name: str | None = None
) -> DatabaseNotMigratedError | None:
    """The error to raise instead of a statement's, when the schema is behind; else ``None``.

    Read only after a statement failed (:func:`missing_schema`), so the API pays nothing for
    it when the tables are there. A revision read that fails itself answers ``None``: the
    original error is the one to see.
    """
    try:
        require_current(engine, url_for_humans, app_name)
    except DatabaseNotMigratedError as exc:
        return exc
    except Exception:
        return None
    return None
