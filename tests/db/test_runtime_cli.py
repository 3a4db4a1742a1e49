"""`celery boundedbeat add | update | remove` through click's runner, on SQLite and on PostgreSQL.

The commands wrap the Python API (``test_runtime_api.py``); these tests pin what the command
line adds: the options and their parsing, what is printed, and the exit status (0 for
``scheduled`` and ``already_present``, 1 for a refused change, 2 for a usage error).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from sqlalchemy import Engine

from celery_boundedbeat.cli import boundedbeat
from celery_boundedbeat.config.definitions import Resolver, define
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.store import Store, utcnow

RNG = random.Random(0)


@pytest.fixture
def app(migrated: Engine, db_url: str) -> Celery:
    app = Celery("rtcli", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    return app


@pytest.fixture
def store(engine: Engine, app: Celery) -> Store:
    return Store(engine)


def run(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(
        boundedbeat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), catch_exceptions=False
    )


def status(app: Celery) -> dict[str, dict[str, Any]]:
    result = run(app, "status", "--json")
    assert result.exit_code == 0, result.output
    return {row["name"]: row for row in json.loads(result.output)}


def test_add_prints_scheduled_then_already_present_both_with_exit_0(app: Celery, store: Store) -> None:
    """add prints scheduled; the same name again prints already_present and changes nothing; both exit 0."""
    first = run(app, "add", "feed", "proj.poll", "--every", "30", "--args", "[1]", "--kwargs", '{"k": "v"}')
    assert (first.exit_code, first.output) == (0, "scheduled\n")
    again = run(app, "add", "feed", "proj.other", "--every", "5")
    assert (again.exit_code, again.output) == (0, "already_present\n")
    (row,) = store.schedules(["feed"])
    assert (row.task, row.period, row.args, row.kwargs, row.origin) == (
        "proj.poll",
        30.0,
        [1],
        {"k": "v"},
        "runtime",
    )


def test_add_with_a_crontab_reads_the_five_fields_in_cron_order(app: Celery, store: Store) -> None:
    """--crontab 'm h dom mon dow' becomes a crontab with those fields in the app's time zone."""
    app.conf.timezone = "Europe/Berlin"
    result = run(app, "add", "report", "proj.r", "--crontab", "*/15 9-17 1,15 3-10 mon-fri")
    assert result.exit_code == 0, result.output
    (row,) = store.schedules(["report"])
    assert row.timing == {
        "kind": "crontab",
        "minute": "*/15",
        "hour": "9-17",
        "day_of_month": "1,15",
        "month_of_year": "3-10",
        "day_of_week": "mon-fri",
        "timezone": "Europe/Berlin",
    }


def test_add_with_options_and_a_policy_stores_them(app: Celery, store: Store) -> None:
    """--options and --policy JSON are stored; the policy is validated and merged with its defaults."""
    policy = {
        "mode": "fixed_rate",
        "max_concurrency": 2,
        "end_at": "2031-01-01T00:00:00+00:00",
        "max_runs": 9,
    }
    result = run(
        app,
        "add",
        "x",
        "proj.t",
        "--every",
        "10",
        "--options",
        '{"queue": "q"}',
        "--policy",
        json.dumps(policy),
    )
    assert result.exit_code == 0, result.output
    (row,) = store.schedules(["x"])
    assert row.options == {"queue": "q"}
    assert {k: row.policy[k] for k in policy} == policy
    assert row.policy["missed_ticks"] == "skip"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--every", "5", "--crontab", "* * * * *"], "not both"),
        ([], "--every SECONDS or --crontab"),
        (["--crontab", "* * * *"], "needs 5 fields"),
        (["--crontab", "61 * * * *"], "minute must be 0-59"),
        (["--crontab", "abc * * * *"], "minute must be 0-59"),
        (["--crontab", "0 9 1,,2 * *"], "day_of_month must be 1-31"),
        (["--crontab", "0 9 * * 8"], "day_of_week must be 0-6 with Sunday 0"),
        (["--every", "5", "--args", "[1,"], "--args"),
        (["--every", "5", "--policy", "{mode: x}"], "--policy"),
        (["--every", "soon"], "--every"),
    ],
)
def test_add_usage_errors_exit_2_naming_the_option(
    app: Celery, store: Store, args: list[str], needle: str
) -> None:
    """Contradictory, missing or malformed options are usage errors (exit 2) and write nothing."""
    result = run(app, "add", "x", "proj.t", *args)
    assert result.exit_code == 2, result.output
    assert needle in result.output and "weekday" not in result.output, result.output
    assert store.schedules() == []


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--every", "0"], "schedule"),
        (["--crontab", "0 3 * * *", "--policy", '{"mode": "fixed_delay"}'], "schedule"),
        (["--every", "5", "--policy", '{"max_runs": 0}'], "policy.max_runs"),
        (["--every", "5", "--policy", '{"end_at": "later"}'], "policy.end_at"),
        (["--every", "5", "--kwargs", "[1]"], "kwargs"),
        (["--every", "5", "--policy", '{"surprise": true}'], "policy.surprise"),
    ],
)
def test_add_of_an_invalid_schedule_exits_1_naming_the_key(
    app: Celery, store: Store, args: list[str], key: str
) -> None:
    """An invalid definition exits 1 with the configuration error naming entry and key; nothing written."""
    result = run(app, "add", "x", "proj.t", *args)
    assert result.exit_code == 1, result.output
    assert f"entry 'x', key '{key}'" in result.output, result.output
    assert store.schedules() == []


def test_update_changes_the_given_fields_and_refuses_unknown_names_and_config_schedules(
    app: Celery, store: Store
) -> None:
    """update prints NAME: updated; an unknown name or a config schedule exits 1; no option exits 2."""
    assert run(app, "add", "x", "proj.t", "--every", "10", "--kwargs", '{"a": 1}').exit_code == 0
    result = run(app, "update", "x", "--every", "30", "--policy", '{"max_runs": 4}', "--task", "proj.u")
    assert (result.exit_code, result.output) == (0, "x: updated\n")
    (row,) = store.schedules(["x"])
    assert (row.task, row.period, row.kwargs, row.policy["max_runs"], row.version) == (
        "proj.u",
        30.0,
        {"a": 1},
        4,
        2,
    )
    unknown = run(app, "update", "ghost", "--every", "5")
    assert unknown.exit_code == 1 and "no schedule named 'ghost'" in unknown.output
    nothing = run(app, "update", "x")
    assert nothing.exit_code == 2 and "nothing to change" in nothing.output
    store.sync_config([define("cfg", {"task": "proj.c", "schedule": 5}, app, {})], utcnow(), RNG)
    config = run(app, "update", "cfg", "--every", "6")
    assert config.exit_code == 1 and "config schedule" in config.output, config.output
    assert store.schedules(["cfg"])[0].period == 5.0


def test_remove_prints_removed_keeps_history_and_revokes_active_runs(
    app: Celery, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """remove --revoke-active settles the active run revoked, revoking it at the workers; unknown exits 1."""
    calls: list[tuple[list[str], dict[str, Any]]] = []
    monkeypatch.setattr(app.control, "revoke", lambda ids, **kw: calls.append((list(ids), kw)))
    assert run(app, "add", "x", "proj.t", "--every", "10").exit_code == 0
    (row,) = store.schedules(["x"])
    assert row.next_due_at is not None
    (emitted,) = store.tick(Resolver(app, {}), row.next_due_at, RNG, 10).emitted
    result = run(app, "remove", "x", "--revoke-active")
    assert (result.exit_code, result.output) == (0, "x: removed, 1 run revoked\n")
    assert calls == [([emitted.id], {"terminate": True})]
    history = json.loads(run(app, "history", "x", "--json").output)
    assert [(h["id"], h["state"]) for h in history] == [(emitted.id, "revoked")]
    again = run(app, "remove", "x")
    assert again.exit_code == 1 and "no schedule named 'x'" in again.output


def test_status_shows_origin_and_why_an_ended_schedule_stopped_and_resume_refuses_it(
    app: Celery, store: Store
) -> None:
    """status --json shows origin, version, grid_runs and stop_reason; resume of an ended schedule exits 1."""
    assert run(app, "add", "once", "proj.t", "--every", "10", "--policy", '{"max_runs": 1}').exit_code == 0
    (row,) = store.schedules(["once"])
    assert row.next_due_at is not None
    (emitted,) = store.tick(Resolver(app, {}), row.next_due_at, RNG, 10).emitted
    store.run_life.settle_run(emitted.id, RunState.COMPLETED, now=utcnow())
    shown = status(app)["once"]
    assert {
        k: shown[k] for k in ("origin", "version", "grid_runs", "stopped", "stop_reason", "pause_reason")
    } == {
        "origin": "runtime",
        "version": 1,
        "grid_runs": 1,
        "stopped": True,
        "stop_reason": "max_runs",
        "pause_reason": None,
    }
    refused = run(app, "resume", "once")
    assert refused.exit_code == 1 and "max_runs" in refused.output, refused.output
    assert "ended" in run(app, "trigger", "once").output
    table = run(app, "status", "--wide").output
    assert "runtime" in table and "stopped (max_runs)" in table, table
