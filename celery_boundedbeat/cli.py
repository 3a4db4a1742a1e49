"""``celery -A proj boundedbeat ...``: migrate, status, history, pause, resume, trigger, backfill, ..."""

from __future__ import annotations

import json
import logging
import signal
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from typing import Any

import click
from celery import Celery

from .api.queries import ScheduleSnapshot, history, snapshot, store_for
from .config.settings import Settings, app_name, warn_unknown_settings
from .core.enums import RunState
from .core.exceptions import BoundedBeatError, ConfigurationError, ScheduleEndedError
from .core.redact import driver_reason, mask_url, scrub
from .core.ticks import TriggerRefused
from .core.unstarted import Unstarted
from .core.words import describe_timing
from .db.engine import get_engine
from .db.lease import LEASE_NAME
from .db.migrate import current_revision, head_revision, require_current, upgrade
from .db.store import utcnow
from .db.unstarted import read_unstarted
from .ops.health import DEFAULT_MAX_QUEUE_AGE, DEFAULT_MAX_TICK_AGE, Bounds, bound_refusal, probe
from .ops.metrics import exposition, read_snapshot
from .ops.tables import STATUS_WIDTH, fmt_time, history_table, status_table, table


def _app(ctx: click.Context) -> Celery:
    obj = ctx.find_object(object) if ctx.obj is None else ctx.obj
    app = getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run it as `celery -A proj boundedbeat ...`")
    return app


logger = logging.getLogger("celery_boundedbeat.cli")


def _settings(app: Celery) -> Settings:
    warn_unknown_settings(app.conf, logger)
    try:
        return Settings.from_conf(app.conf)
    except BoundedBeatError as exc:
        raise click.ClickException(str(exc)) from None


def _database_error(action: str, url: str, exc: BaseException) -> click.ClickException:
    """A one-line error naming the database (masked) and the driver's reason, never a password."""
    if isinstance(exc, BoundedBeatError):
        return click.ClickException(scrub(str(exc), url))
    return click.ClickException(f"{action} {mask_url(url)}: {driver_reason(exc, url)}")


def _ready(app: Celery) -> None:
    settings = _settings(app)
    url = settings.database_url
    try:
        require_current(get_engine(url), mask_url(url), app_name(app))
    except Exception as exc:
        raise _database_error("cannot use the database", url, exc) from None


@click.group(name="boundedbeat")
@click.pass_context
def boundedbeat(ctx: click.Context) -> None:
    """celery_boundedbeat: schedules, run history and the DB-backed queue."""


@boundedbeat.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the celery_boundedbeat tables (Alembic)."""
    app = _app(ctx)
    settings = _settings(app)
    url = settings.database_url
    try:
        engine = get_engine(url)
        before = current_revision(engine)
        upgrade(engine)
    except Exception as exc:
        raise _database_error("migration failed for", url, exc) from None
    head = head_revision()
    if before == head:
        click.echo(f"{mask_url(url)} is up to date (revision {head})")
    else:
        click.echo(f"migrated {mask_url(url)} from {before or 'empty'} to {head}")


@boundedbeat.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array (same as --format json).")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "prometheus"]),
    default="table",
    show_default=True,
    help="prometheus: the metrics beat serves at /metrics, in the Prometheus text format.",
)
@click.option("--wide", is_flag=True, help="Every column, whatever the width (default: fit 100 columns).")
@click.pass_context
def status(ctx: click.Context, as_json: bool, fmt: str, wide: bool) -> None:
    """One row per schedule: its schedule, state, next due time, counters (or the Prometheus metrics)."""
    app = _app(ctx)
    _ready(app)
    if fmt == "prometheus":
        _print_metrics(app, as_json)
        return
    if as_json or fmt == "json":
        click.echo(json.dumps([s.to_json() for s in snapshot(app)], indent=2))
        return
    store = store_for(app)
    rows = store.schedules()
    if not rows:
        click.echo("no schedules yet (start beat with -S celery_boundedbeat.Scheduler)")
        return
    now = utcnow()
    bound = _settings(app).unstarted_warning
    with store.engine.connect() as conn:
        unstarted = read_unstarted(conn, now, bound)
    words = {r.name: describe_timing(r.timing, r.period, r.schedule) for r in rows}
    waiting = {u.schedule: u.text for u in unstarted}
    click.echo(status_table([ScheduleSnapshot.from_row(r) for r in rows], words, waiting, wide=wide))
    for line in _unstarted_notes(unstarted, now, bound, wide):
        click.echo(line)
    holder = store.lease_holder(LEASE_NAME, now)
    click.echo(f"\nbeat lease: {holder[0] + ' until ' + fmt_time(holder[1]) if holder else 'not held'}")


def _unstarted_notes(unstarted: tuple[Unstarted, ...], now: datetime, bound: float, wide: bool) -> list[str]:
    """One line per schedule whose published runs no worker started (below the table)."""
    lines = [
        f"{u.schedule}: {u.text} ({u.runs} run(s) published, the oldest {u.waited(now):.0f} s ago, "
        f"none started within boundedbeat_unstarted_warning, {bound:g} s)"
        for u in unstarted
    ]
    if not wide:
        lines = [textwrap.fill(line, STATUS_WIDTH, subsequent_indent="  ") for line in lines]
    return ["", *lines] if lines else []


def _parse_since(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        if value[-1:] in "smhd" and value[:-1].replace(".", "", 1).isdigit():
            unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[value[-1]]
            return utcnow() - timedelta(**{unit: float(value[:-1])})
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither an ISO 8601 time nor a duration like 30m, 2h, 7d", param_hint="--since"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@boundedbeat.command("history")
@click.argument("name", required=False)
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--state", type=click.Choice([s.value for s in RunState]), default=None)
@click.option("--since", default=None, help="ISO 8601 time or a duration such as 30m, 2h, 7d.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_context
def history_cmd(
    ctx: click.Context, name: str | None, limit: int, state: str | None, since: str | None, as_json: bool
) -> None:
    """Runs, newest first."""
    app = _app(ctx)
    _ready(app)
    since_at = _parse_since(since)
    if name is not None and not snapshot(app, [name]) and not history(app, name=name, limit=1):
        raise click.ClickException(f"no schedule named {name!r}")
    runs = history(app, name=name, limit=limit, state=state, since=since_at)
    if as_json:
        click.echo(json.dumps([r.to_json() for r in runs], indent=2))
        return
    click.echo(history_table(runs))


def _named(ctx: click.Context, name: str, action: str, op: Any) -> None:
    app = _app(ctx)
    _ready(app)
    if not op(store_for(app), name, utcnow()):
        raise click.ClickException(f"no schedule named {name!r}")
    click.echo(f"{name}: {action}")


@boundedbeat.command()
@click.argument("name")
@click.pass_context
def pause(ctx: click.Context, name: str) -> None:
    """Stop emitting runs of NAME (active runs finish normally)."""
    _named(ctx, name, "paused", lambda st, n, now: st.set_paused(n, True, now))


@boundedbeat.command()
@click.argument("name")
@click.option(
    "--replay",
    is_flag=True,
    help="Hand the ticks passed while paused to missed_ticks (bounded by catchup_window) "
    "instead of rejoining the grid at the next tick.",
)
@click.pass_context
def resume(ctx: click.Context, name: str, replay: bool) -> None:
    """Emit runs of NAME again (also lifts stop_schedule())."""
    action = "resumed, replaying the ticks passed while paused" if replay else "resumed"
    try:
        _named(ctx, name, action, lambda st, n, now: st.set_paused(n, False, now, replay=replay))
    except ScheduleEndedError as exc:
        raise click.ClickException(str(exc)) from None


@boundedbeat.command()
@click.argument("name")
@click.pass_context
def trigger(ctx: click.Context, name: str) -> None:
    """Queue one run of NAME now, under its concurrency bound (refused when paused or stopped)."""
    app = _app(ctx)
    _ready(app)
    result = store_for(app).trigger(name, utcnow())
    if result is None:
        raise click.ClickException(f"no schedule named {name!r}")
    if isinstance(result, TriggerRefused):
        raise click.ClickException(f"{name}: not triggered: {result.reason}")
    click.echo(f"{name}: triggered for {result.isoformat()} (runs as soon as a slot is free)")


@boundedbeat.command()
@click.option("--older-than", "days", type=click.FloatRange(min=0), required=True, help="Age in days.")
@click.pass_context
def purge(ctx: click.Context, days: float) -> None:
    """Delete settled runs that finished more than DAYS days ago."""
    app = _app(ctx)
    _ready(app)
    deleted = store_for(app).purge(utcnow() - timedelta(days=days))
    click.echo(f"deleted {deleted} run(s) finished more than {days:g} day(s) ago")


@boundedbeat.command()
@click.pass_context
def dispatch(ctx: click.Context) -> None:
    """Run a standalone dispatch worker for the DB-backed queue (scale-out)."""
    from .core.loops import BackgroundLoop
    from .db.notify import Listener
    from .db.store import QUEUE_CHANNEL, Store
    from .dispatch.dispatcher import Dispatcher

    app = _app(ctx)
    _ready(app)
    settings = _settings(app)
    store = Store(get_engine(settings.database_url))
    listener = None
    if store.is_postgres:
        # Every state change of the listener wakes the loop too: it polls while not listening.
        listener = Listener(settings.database_url, [QUEUE_CHANNEL], lambda _c, _p: loop.wake())
    dispatcher = Dispatcher(
        app, store, settings, notified=None if listener is None else lambda: listener.listening
    )
    loop = BackgroundLoop("boundedbeat-dispatch", dispatcher.run)
    if listener is not None:
        listener.start()
    stopping = {"flag": False}

    def _stop(signum: int, _frame: Any) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    click.echo(
        f"boundedbeat dispatch {dispatcher.name}: draining {mask_url(settings.database_url)}", err=True
    )
    loop.start()
    while not stopping["flag"] and loop.alive:
        loop.shutdown.wait(0.5)
    ok = loop.stop(settings.shutdown_grace)
    if listener is not None:
        listener.stop()
    click.echo(f"boundedbeat dispatch stopped; published {dispatcher.published_total} message(s)", err=True)
    sys.exit(0 if ok else 1)


# -- health probe and metrics (issue #12): the decisions live in health.py, metrics.py ----


def _print_metrics(app: Celery, as_json: bool) -> None:
    """The Prometheus text format, for node_exporter's textfile collector or a look by hand."""
    if as_json:
        raise click.UsageError("--json and --format prometheus exclude each other")
    url = _settings(app).database_url
    try:
        text = exposition(read_snapshot(get_engine(url), utcnow(), _settings(app).unstarted_warning))
    except Exception as exc:
        raise _database_error("cannot read the metrics from", url, exc) from None
    click.echo(text, nl=False)


@boundedbeat.command()
@click.option(
    "--max-tick-age",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_MAX_TICK_AGE,
    show_default=True,
    help="Seconds since the lease holder's last tick before the probe fails.",
)
@click.option(
    "--max-queue-age",
    type=click.FloatRange(min=0),
    default=DEFAULT_MAX_QUEUE_AGE,
    show_default=True,
    help="Seconds the oldest queued message may be overdue (0: do not check the queue).",
)
@click.option(
    "--max-unstarted-age",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds a published run may wait for a worker to start it (default: "
    "boundedbeat_unstarted_warning, 300; 0: do not check).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of one line.")
@click.pass_context
def health(
    ctx: click.Context,
    max_tick_age: float,
    max_queue_age: float,
    max_unstarted_age: float | None,
    as_json: bool,
) -> None:
    """Exit 0 when a beat holds the lease and ticks; else exit 1 with one line saying why.

    A --max-tick-age not above boundedbeat_lease_renew_interval is a usage error (exit 2):
    it would fail a healthy beat between two renewals.
    """
    app = _app(ctx)
    warn_unknown_settings(app.conf, logger)
    try:
        settings = Settings.from_conf(app.conf)
    except BoundedBeatError as exc:
        click.echo(f"unhealthy: {' '.join(str(exc).split())}")
        ctx.exit(1)
    unstarted = settings.unstarted_warning if max_unstarted_age is None else max_unstarted_age
    bounds = Bounds(
        max_tick_age=max_tick_age,
        max_queue_age=max_queue_age or None,
        max_unstarted_age=unstarted or None,
        partitions=settings.partitions,
    )
    refusal = bound_refusal(bounds, settings.lease_renew_interval)
    if refusal is not None:  # the probe's own arguments are wrong, not the beat: exit 2
        raise click.UsageError(refusal)
    verdict = probe(settings.database_url, utcnow(), bounds)
    click.echo(json.dumps(verdict.to_json()) if as_json else verdict.message)
    ctx.exit(0 if verdict.healthy else 1)


# -- runtime schedules (celery_boundedbeat.add_schedule / update_schedule / remove_schedule) ----


def _json_option(value: str | None, option: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"is not valid JSON: {exc}", param_hint=option) from None


def _crontab_option(value: str) -> Any:
    from .config.cron import build_crontab

    fields = value.split()
    if len(fields) != 5:
        raise click.BadParameter(
            f"needs 5 fields 'minute hour day-of-month month day-of-week', got {len(fields)}",
            param_hint="--crontab",
        )
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    named = {
        "minute": minute,
        "hour": hour,
        "day_of_month": day_of_month,
        "month_of_year": month_of_year,
        "day_of_week": day_of_week,
    }
    try:
        return build_crontab("--crontab", named)
    except ConfigurationError as exc:
        reasons = "; ".join(reason for _, _, reason in exc.problems)
        raise click.BadParameter(f"{value!r} is not a crontab: {reasons}", param_hint="--crontab") from None


def _timing_option(every: float | None, cron: str | None, *, required: bool) -> Any:
    if every is not None and cron is not None:
        raise click.UsageError("give --every or --crontab, not both")
    if every is None and cron is None:
        if required:
            raise click.UsageError("give the timing: --every SECONDS or --crontab 'm h dom mon dow'")
        return None
    return every if every is not None else _crontab_option(cron or "")


def _definition_options(fn: Any) -> Any:
    """The options ``add`` and ``update`` share (docs/cli.md)."""
    for decorator in reversed(
        [
            click.option("--every", type=float, default=None, help="Period in seconds."),
            click.option("--crontab", "cron", default=None, help="'m h dom mon dow'"),
            click.option("--args", "args_json", default=None, help="Positional arguments, a JSON array."),
            click.option("--kwargs", "kwargs_json", default=None, help="Keyword arguments, a JSON object."),
            click.option("--options", "options_json", default=None, help="Celery message options, JSON."),
            click.option("--policy", "policy_json", default=None, help="The policy, a JSON object."),
        ]
    ):
        fn = decorator(fn)
    return fn


def _changing(action: str, app: Celery, call: Any) -> Any:
    """Run one runtime-schedule call; its errors become one clear line and exit status 1."""
    _ready(app)
    try:
        return call()
    except BoundedBeatError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:
        raise _database_error(f"could not {action} in", _settings(app).database_url, exc) from None


@boundedbeat.command()
@click.argument("name")
@click.argument("task")
@_definition_options
@click.pass_context
def add(
    ctx: click.Context,
    name: str,
    task: str,
    every: float | None,
    cron: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    options_json: str | None,
    policy_json: str | None,
) -> None:
    """Add a runtime schedule NAME running TASK; prints scheduled or already_present."""
    from .api.schedules import add_schedule

    app = _app(ctx)
    timing = _timing_option(every, cron, required=True)
    args = _json_option(args_json, "--args")
    kwargs = _json_option(kwargs_json, "--kwargs")
    options = _json_option(options_json, "--options")
    policy = _json_option(policy_json, "--policy")
    outcome = _changing(
        "add a schedule",
        app,
        lambda: add_schedule(
            app, name, task, timing, args=args or (), kwargs=kwargs, options=options, policy=policy
        ),
    )
    click.echo(outcome)


@boundedbeat.command()
@click.argument("name")
@click.option("--task", default=None, help="The task name.")
@_definition_options
@click.pass_context
def update(
    ctx: click.Context,
    name: str,
    task: str | None,
    every: float | None,
    cron: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    options_json: str | None,
    policy_json: str | None,
) -> None:
    """Change the given fields of runtime schedule NAME (policy keys merge over its policy)."""
    from .api.schedules import update_schedule

    app = _app(ctx)
    given: dict[str, Any] = {}
    if task is not None:
        given["task"] = task
    timing = _timing_option(every, cron, required=False)
    if timing is not None:
        given["schedule"] = timing
    for key, raw, option in (
        ("args", args_json, "--args"),
        ("kwargs", kwargs_json, "--kwargs"),
        ("options", options_json, "--options"),
        ("policy", policy_json, "--policy"),
    ):
        if raw is not None:
            given[key] = _json_option(raw, option)
    if not given:
        raise click.UsageError("nothing to change: give at least one of --task, --every, --crontab, ...")
    _changing("update a schedule", app, lambda: update_schedule(app, name, **given))
    click.echo(f"{name}: updated")


@boundedbeat.command()
@click.argument("name")
@click.option("--revoke-active", is_flag=True, help="Terminate its active runs (settled revoked).")
@click.pass_context
def remove(ctx: click.Context, name: str, revoke_active: bool) -> None:
    """Remove runtime schedule NAME (its run history stays)."""
    from .api.schedules import plural_runs, remove_schedule_revoking

    app = _app(ctx)
    revoked = _changing(
        "remove a schedule", app, lambda: remove_schedule_revoking(app, name, revoke_active=revoke_active)
    )
    if revoked is None:
        raise click.ClickException(f"no schedule named {name!r}")
    said = f", {plural_runs(len(revoked))} revoked" if revoke_active else ""
    click.echo(f"{name}: removed{said}")


@boundedbeat.command("backfill")
@click.argument("name")
@click.option("--start", required=True, help="ISO 8601 time; without an offset it is UTC.")
@click.option("--end", required=True, help="ISO 8601 time, not in the future; without an offset it is UTC.")
@click.pass_context
def backfill_cmd(ctx: click.Context, name: str, start: str, end: str) -> None:
    """Queue NAME's grid times in [START, END] that have no run yet, under its concurrency bound."""
    from .api.schedules import backfill

    app = _app(ctx)
    result = _changing("backfill", app, lambda: backfill(app, name, start, end))
    click.echo(result.describe())


# -- check: validate beat_schedule as beat would, without a database ----------------------------

#: Exit status of ``check`` when an entry or setting is invalid (EX_CONFIG, as beat).
EX_CONFIG = 78


def _next_due_times(spec: Any, now: datetime, count: int) -> list[datetime]:
    """The first ``count`` due times of a schedule first seen at ``now`` (grid times, no jitter):
    as beat starts it, so a past ``start_at`` shows the grid time in progress, due at once."""
    import random

    from .core.ticks import first_state

    first = first_state(spec, now, random.Random(0))
    if first.grid_at is None:  # fixed delay: later ones depend on when each run finishes
        return [first.next_due_at] if first.next_due_at is not None else []
    times = [first.grid_at]
    while len(times) < count:
        _, _, after = spec.timing.passed(times[-1], times[-1])
        if spec.policy.end_at is not None and after > spec.policy.end_at:
            break
        times.append(after)
    return times[: spec.policy.max_runs or count]


@boundedbeat.command()
@click.option("--count", type=click.IntRange(1, 100), default=3, show_default=True, help="Due times shown.")
@click.pass_context
def check(ctx: click.Context, count: int) -> None:
    """Validate beat_schedule as beat would (exit 78 on a bad entry) and show next due times.

    Touches no database: meant for a project's own CI, before a deploy.
    """
    from .config.definitions import config_definitions
    from .core.exceptions import ConfigurationError

    app = _app(ctx)
    warn_unknown_settings(app.conf, logger)
    try:
        settings = Settings.from_conf(app.conf)
        definitions = config_definitions(app, settings.default_policy)
    except ConfigurationError as exc:
        click.echo(str(exc), err=True)
        ctx.exit(EX_CONFIG)
    now = utcnow()
    rows = []
    for name, d in sorted(definitions.items()):
        due = ", ".join(fmt_time(t) for t in _next_due_times(d.spec, now, count))
        if d.spec.policy.mode.value == "fixed_delay":
            due += f" (then {d.spec.period:g} s after each run finishes)"
        shown = d.spec.schedule_repr + (f" in {d.spec.timezone}" if d.spec.timezone else "")
        rows.append([name, d.spec.task, d.spec.policy.mode.value, shown, due])
    click.echo(table(["NAME", "TASK", "MODE", "SCHEDULE", "NEXT DUE (UTC, if first seen now)"], rows))
    click.echo(f"\n{len(rows)} schedule(s) valid")


from .cli_import import export_cmd, import_cmd  # noqa: E402 (the group above is theirs)

boundedbeat.add_command(import_cmd)
boundedbeat.add_command(export_cmd)

from .cli_beats import beats_cmd  # noqa: E402

boundedbeat.add_command(beats_cmd)
