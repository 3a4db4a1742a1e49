"""``celery -A proj boundedbeat import ...`` and ``export``: other schedulers' stores and files.

Registered on the ``boundedbeat`` group by :mod:`.cli`; the work is in
:mod:`~celery_boundedbeat.api.importing` and its sources. Every import is a dry run unless
``--apply`` is given, prints one line per schedule, and exits 78 (EX_CONFIG) when a schedule
cannot be mapped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click
from celery import Celery
from celery.utils.imports import symbol_by_name

from .api.importing import Incoming, Plan, Refused, apply_import, plan_import
from .config.settings import Settings
from .core.exceptions import BoundedBeatError
from .core.redact import driver_reason, mask_url, scrub
from .db.engine import get_engine
from .db.migrate import require_current

#: Exit status when a schedule cannot be mapped (EX_CONFIG, as ``check`` and beat).
EX_CONFIG = 78

DCB = "django-celery-beat"
REDBEAT = "redbeat"
#: django-celery-beat's models read through Django's ORM (only contrib imports Django).
ORM_READER = "celery_boundedbeat.contrib.django.dcb:read_models"


def _read_dcb(database_url: str | None) -> list[Incoming | Refused]:
    from .api.dcb_source import map_tasks, read_tables

    if database_url is None:
        if not os.environ.get("DJANGO_SETTINGS_MODULE"):
            raise click.UsageError(f"import {DCB}: give --database-url, or set DJANGO_SETTINGS_MODULE")
        # Loaded by name, as Celery loads a scheduler: this module sits beside contrib, and
        # Django is imported only there, only when the project's settings ask for it.
        read_models = symbol_by_name(ORM_READER)
        return map_tasks(read_models())
    try:
        return map_tasks(read_tables(database_url))
    except Exception as exc:
        raise click.ClickException(
            f"cannot read {DCB}'s tables from {mask_url(database_url)}: {driver_reason(exc, database_url)}"
        ) from None


def _read_redbeat(app: Celery, redis_url: str | None, prefix: str | None) -> list[Incoming | Refused]:
    from .api.redbeat_source import DEFAULT_PREFIX, map_entries, read_entries

    url = redis_url or app.conf.get("redbeat_redis_url") or app.conf.broker_url
    prefix = prefix or app.conf.get("redbeat_key_prefix") or DEFAULT_PREFIX
    try:
        return map_entries(read_entries(url, prefix), prefix)
    except Exception as exc:
        raise click.ClickException(
            f"cannot read RedBeat's keys from {mask_url(url)}: {driver_reason(exc, url)}"
        ) from None


def _read_file(app: Celery, path: str) -> list[Incoming | Refused]:
    from .api.exporting import format_of, load, read_document

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot read {path}: {exc.strerror}") from None
    return read_document(app, load(text, format_of(path)))


def _show(plan: Plan, *, applied: bool) -> None:
    click.echo(plan.table())
    click.echo(plan.summary(applied=applied))


def ready_app(ctx: click.Context) -> Celery:
    """The app of ``celery -A proj``, its database reachable and migrated (else a one-line error)."""
    app = getattr(ctx.find_object(object) if ctx.obj is None else ctx.obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run it as `celery -A proj boundedbeat ...`")
    try:
        url = Settings.from_conf(app.conf, only=("database_url",)).database_url
    except BoundedBeatError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        require_current(get_engine(url), mask_url(url))
    except BoundedBeatError as exc:
        raise click.ClickException(scrub(str(exc), url)) from None
    except Exception as exc:
        raise click.ClickException(
            f"cannot use the database {mask_url(url)}: {driver_reason(exc, url)}"
        ) from None
    return app


def _reject(given: dict[str, Any], source: str) -> None:
    for option, value in given.items():
        if value:
            raise click.UsageError(f"{option} does not apply to `import {source}`")


@click.command("import")
@click.argument("source")
@click.option("--database-url", default=None, help=f"{DCB}'s database (else its Django ORM).")
@click.option(
    "--redis-url", default=None, help="RedBeat's Redis (default: redbeat_redis_url, else broker_url)."
)
@click.option(
    "--key-prefix", default=None, help="RedBeat's key prefix (default: redbeat_key_prefix, else redbeat:)."
)
@click.option("--prune", is_flag=True, help="FILE only: remove the runtime schedules the file lacks.")
@click.option("--apply", "apply_", is_flag=True, help="Change the schedules (without it: a dry run).")
@click.pass_context
def import_cmd(
    ctx: click.Context,
    source: str,
    database_url: str | None,
    redis_url: str | None,
    key_prefix: str | None,
    prune: bool,
    apply_: bool,
) -> None:
    """Import SOURCE's schedules as runtime schedules: django-celery-beat, redbeat, or an exported FILE.

    A dry run unless --apply: one line per schedule with what would happen to it.
    """
    app = ready_app(ctx)
    is_file = source not in (DCB, REDBEAT)
    try:
        if source == DCB:
            _reject({"--redis-url": redis_url, "--key-prefix": key_prefix, "--prune": prune}, source)
            items = _read_dcb(database_url)
        elif source == REDBEAT:
            _reject({"--database-url": database_url, "--prune": prune}, source)
            items = _read_redbeat(app, redis_url, key_prefix)
        else:
            _reject(
                {"--database-url": database_url, "--redis-url": redis_url, "--key-prefix": key_prefix}, "FILE"
            )
            items = _read_file(app, source)
        plan = plan_import(app, items, prune=prune, with_state=is_file, leave_config=not is_file)
        if apply_:
            plan = apply_import(app, plan, with_state=is_file)
    except BoundedBeatError as exc:
        raise click.ClickException(str(exc)) from None
    _show(plan, applied=apply_)
    if plan.refused:
        ctx.exit(EX_CONFIG)


@click.command("export")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["json", "yaml"]),
    default=None,
    help="Default: by --output's extension, else json.",
)
@click.option("--output", default=None, help="Write to this file (default: standard output).")
@click.pass_context
def export_cmd(ctx: click.Context, fmt: str | None, output: str | None) -> None:
    """Write every runtime schedule (timing, task, arguments, options, policy, state) as JSON or YAML."""
    from .api.exporting import dump, export_document, format_of

    app = ready_app(ctx)
    fmt = fmt or (format_of(output) if output else "json")
    try:
        document = export_document(app)
        text = dump(document, fmt)
    except BoundedBeatError as exc:
        raise click.ClickException(str(exc)) from None
    if output is None:
        sys.stdout.write(text)
        return
    Path(output).write_text(text, encoding="utf-8")
    click.echo(f"exported {len(document['schedules'])} schedule(s) to {output}", err=True)
