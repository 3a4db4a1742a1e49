# mypy: allow-untyped-decorators
"""System checks: a mistyped admin database alias, and tables that ``migrate`` never made.

Django's ``migrate`` does not create the celery_boundedbeat tables (Alembic does), so a
project that skipped ``manage.py boundedbeat_migrate`` would otherwise learn it from a 500
on every admin page. ``manage.py check`` (and ``runserver``, ``migrate``) name what is missing.

An unusable setting (a database URL that cannot be parsed, or whose driver is not installed)
ends the process with the problem named and exit status 78 (EX_CONFIG), as beat does: Celery's
Django fixup runs these checks when ``celery beat`` and ``celery worker`` start, and a check
that raised would end them with a page of traceback instead.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from django.conf import settings as django_settings
from django.core import checks
from sqlalchemy import inspect
from sqlalchemy.exc import SQLAlchemyError

from ...core.exceptions import BoundedBeatError
from ...core.redact import driver_reason, mask_url, scrub
from ...db.engine import get_engine
from ...db.migrate import current_revision, head_revision
from ...db.tables import metadata
from .conf import ADMIN_DATABASE_SETTING, admin_database, boundedbeat_settings

MIGRATE_HINT = "Run `python manage.py boundedbeat_migrate` (or `celery -A proj boundedbeat migrate`)."

#: Exit status when the configuration is invalid (EX_CONFIG, as beat and ``boundedbeat check``).
EX_CONFIG = 78


def _refuse(exc: BoundedBeatError, url: str | None) -> NoReturn:
    """End the process naming the problem (password masked), with EX_CONFIG, no traceback."""
    text = str(exc) if url is None else scrub(str(exc), url)
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()
    raise SystemExit(EX_CONFIG)


@checks.register()
def check_admin_database(**kwargs: Any) -> list[checks.CheckMessage]:
    alias = admin_database()
    if alias in django_settings.DATABASES:
        return []
    return [
        checks.Error(
            f"{ADMIN_DATABASE_SETTING} names the database alias {alias!r}, which is not in DATABASES.",
            hint="Add a DATABASES entry for the celery_boundedbeat tables or fix the alias.",
            id="celery_boundedbeat.E001",
        )
    ]


@checks.register()
def check_tables(**kwargs: Any) -> list[checks.CheckMessage]:
    """W002 when tables are missing or the schema is behind this version; W001 when unreachable.

    Invalid settings or an unusable URL end the process (:func:`_refuse`).

    Warnings, not errors: an error would stop ``manage.py migrate`` (which runs the checks)
    in a new project, before anyone could create the tables.
    """
    try:
        url = boundedbeat_settings().database_url
    except BoundedBeatError as exc:
        _refuse(exc, None)
    try:
        engine = get_engine(url)
    except BoundedBeatError as exc:
        _refuse(exc, url)
    try:
        present = set(inspect(engine).get_table_names())
        current = current_revision(engine)
    except SQLAlchemyError as exc:
        return [
            checks.Warning(
                f"cannot read the celery_boundedbeat database {mask_url(url)}: {driver_reason(exc, url)}",
                hint="The admin pages of celery_boundedbeat need it; check CELERY_BOUNDEDBEAT_DATABASE_URL.",
                id="celery_boundedbeat.W001",
            )
        ]
    missing = sorted(set(metadata.tables) - present)
    head = head_revision()
    if not missing and current == head:
        return []
    problems = []
    if current != head:
        at = "has no schema revision" if current is None else f"is at schema revision {current}"
        problems.append(f"{at}, but this version of celery_boundedbeat needs {head}")
    if missing:
        problems.append(f"is missing the tables {', '.join(missing)}")
    return [
        checks.Warning(
            f"The celery_boundedbeat database {mask_url(url)} {' and '.join(problems)}.",
            hint=MIGRATE_HINT,
            id="celery_boundedbeat.W002",
        )
    ]
