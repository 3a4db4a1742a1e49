"""Schema management through the Alembic migrations shipped with the package."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from ..core.exceptions import DatabaseNotMigratedError
from .tables import VERSION_TABLE


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
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Create or upgrade the schema to ``revision``; safe to run again."""
    config = _config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def require_current(engine: Engine, url_for_humans: str) -> None:
    """Fail clearly when the database is not at the head revision."""
    current = current_revision(engine)
    head = head_revision()
    if current != head:
        state = "has no celery_boundedbeat tables" if current is None else f"is at revision {current}"
        raise DatabaseNotMigratedError(
            f"the celery_boundedbeat database {url_for_humans} {state}, but this version needs "
            f"{head}: run `celery -A <your app> boundedbeat migrate` first"
        )
