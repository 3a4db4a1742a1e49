"""A public API call on a database nobody migrated raises :class:`DatabaseNotMigratedError`.

Without it the caller saw the driver's error with SQL in it (``relation
"boundedbeat_schedules" does not exist``): a Django view turned it into a 500. The error
names the database (password masked) and the command to run, as the CLI and beat do. The
schema revision is read only after a statement failed on a missing table or column, so a
call on a migrated database costs nothing more.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from celery import Celery
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from ..config.settings import Settings, app_name, database_url_from_django
from ..core.redact import mask_url
from ..db.engine import get_engine
from ..db.migrate import missing_schema, not_migrated

P = ParamSpec("P")
R = TypeVar("R")


AppCall = Callable[Concatenate[Celery, P], R]


def explains_missing_tables(function: AppCall[P, R]) -> AppCall[P, R]:
    """Wrap a public function taking the app first: a missing table is DatabaseNotMigratedError."""

    @functools.wraps(function)
    def call(app: Celery, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(app, *args, **kwargs)
        except DBAPIError as exc:
            if not missing_schema(exc):
                raise
            url = Settings.from_conf(app.conf, only=("database_url",)).database_url
            explained = not_migrated(get_engine(url), mask_url(url), app_name(app))
            if explained is None:
                raise
            raise explained from exc

    return call


def _engine_of(connection: Any) -> tuple[Engine, str] | None:
    """The engine (and its URL) behind an ``enqueue`` connection: SQLAlchemy's or Django's."""
    if hasattr(connection, "engine") and isinstance(connection.engine, Engine):
        return connection.engine, connection.engine.url.render_as_string(hide_password=False)
    if hasattr(connection, "get_bind"):
        bind = connection.get_bind()
        engine = bind if isinstance(bind, Engine) else getattr(bind, "engine", None)
        if isinstance(engine, Engine):
            return engine, engine.url.render_as_string(hide_password=False)
    settings_dict = getattr(connection, "settings_dict", None)
    if isinstance(settings_dict, dict):
        try:
            url = database_url_from_django(settings_dict)
        except ValueError:
            return None
        return get_engine(url), url
    return None


def explain_enqueue_failure(connection: Any, exc: BaseException) -> BaseException | None:
    """For ``enqueue``: the DatabaseNotMigratedError to raise instead of ``exc``, or ``None``."""
    if not missing_schema(exc):
        return None
    found = _engine_of(connection)
    if found is None:
        return None
    engine, url = found
    return not_migrated(engine, mask_url(url), None)
