"""The shipped Alembic migrations: head equals the models, and they travel inside the wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, MetaData, Table, insert, inspect, select, text

from celery_boundedbeat.core.exceptions import DatabaseNotMigratedError
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.db.migrate import (
    current_revision,
    head_revision,
    migrations_path,
    require_current,
    upgrade,
)
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import VERSION_TABLE, metadata

REPO = Path(__file__).resolve().parents[2]
TABLES = {
    "boundedbeat_schedules",
    "boundedbeat_runs",
    "boundedbeat_queue",
    "boundedbeat_leases",
    "boundedbeat_workers",
    "boundedbeat_iterations",
}


def test_alembic_head_equals_the_models(engine: Engine) -> None:
    """A database upgraded to head has exactly the tables, columns, types and indexes of the models."""
    upgrade(engine)
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "version_table": VERSION_TABLE}
        )
        diff = compare_metadata(context, metadata)
    assert diff == []


def test_the_queue_table_leaves_room_for_heap_only_claims(engine: Engine) -> None:
    """On PostgreSQL the queue table has fill factor 40 after upgrade, and loses it on downgrade."""
    if engine.dialect.name != "postgresql":
        upgrade(engine)  # SQLite: nothing to set, the migration must simply pass
        assert current_revision(engine) == head_revision()
        return

    def reloptions() -> list[str]:
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = 'boundedbeat_queue'")
            ).scalar_one()
        return list(found or [])

    upgrade(engine)
    assert reloptions() == ["fillfactor=40"]
    config = Config()
    config.set_main_option("script_location", str(migrations_path()))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0001")
    assert reloptions() == []


def test_migrations_use_their_own_version_table(engine: Engine) -> None:
    """The revision is kept in boundedbeat_alembic_version, never in the application's alembic_version."""
    assert current_revision(engine) is None
    upgrade(engine)
    tables = set(inspect(engine).get_table_names())
    assert TABLES | {VERSION_TABLE} <= tables
    assert "alembic_version" not in tables
    assert current_revision(engine) == head_revision()


def test_upgrade_is_idempotent_and_required(engine: Engine) -> None:
    """An unmigrated database is refused with a hint to migrate; upgrading twice is harmless."""
    with pytest.raises(DatabaseNotMigratedError, match="boundedbeat migrate"):
        require_current(engine, "db")
    upgrade(engine)
    upgrade(engine)
    require_current(engine, "db")
    assert current_revision(engine) == head_revision()


def test_downgrade_to_base_removes_every_table(engine: Engine) -> None:
    """The migrations downgrade cleanly (only the version table may remain)."""
    upgrade(engine)
    config = Config()
    config.set_main_option("script_location", str(migrations_path()))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "base")
    assert not TABLES & set(inspect(engine).get_table_names())
    assert current_revision(engine) is None


def test_migrations_path_works_in_the_editable_install() -> None:
    """migrations_path() finds the migrations inside the imported package, editable or wheel."""
    import celery_boundedbeat

    path = migrations_path()
    assert (path / "env.py").is_file()
    assert list((path / "versions").glob("*.py"))
    package = Path(celery_boundedbeat.__file__).resolve().parent
    assert path.resolve() == (package / "db" / "migrations").resolve()


@pytest.mark.timeout(240)
def test_the_wheel_ships_the_migrations_and_upgrades_from_a_clean_venv(tmp_path: Path) -> None:
    """The wheel the install steps build ships the migrations; alone in a fresh venv it migrates SQLite."""
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist), str(REPO)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("celery_boundedbeat-*.whl")
    # The install steps quote the command above and the wheel it writes (the package is not on PyPI).
    for page in ("README.md", "docs/django.md"):
        text = (REPO / page).read_text()
        assert "python -m pip wheel --no-deps -w dist ." in text and wheel.name in text, page
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "celery_boundedbeat/db/migrations/env.py" in names
    versions = "celery_boundedbeat/db/migrations/versions/"
    assert any(n.startswith(versions) and n.endswith(".py") for n in names)
    assert "celery_boundedbeat/py.typed" in names
    assert not any(n.startswith("tests/") for n in names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = env_dir / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]

    work = tmp_path / "work"
    work.mkdir()
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        import celery_boundedbeat
        from celery_boundedbeat.db.engine import get_engine
        from celery_boundedbeat.db.migrate import current_revision, head_revision, migrations_path, upgrade
        from sqlalchemy import inspect

        package = Path(celery_boundedbeat.__file__).resolve().parent
        assert package.is_relative_to(Path({str(env_dir)!r}).resolve()), package
        assert migrations_path() == package / "db" / "migrations", migrations_path()
        engine = get_engine("sqlite:///" + str(Path.cwd() / "wheel.sqlite3"))
        upgrade(engine)
        assert current_revision(engine) == head_revision()
        print(sorted(inspect(engine).get_table_names()))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    ran = subprocess.run(
        [str(python), "-I", "-c", script], cwd=work, capture_output=True, text=True, timeout=60, env=env
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "boundedbeat_runs" in ran.stdout
    assert VERSION_TABLE in ran.stdout

    # The contract's command, `celery -A proj boundedbeat migrate`, works from the wheel too.
    (work / "proj.py").write_text(
        "from celery import Celery\n"
        "app = Celery('proj')\n"
        "app.conf.boundedbeat_database_url = 'sqlite:///cli.sqlite3'\n"
    )
    cli = subprocess.run(
        [str(env_dir / "bin" / "celery"), "-A", "proj", "boundedbeat", "migrate"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONPATH": str(work)},
    )
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    assert (work / "cli.sqlite3").is_file()


def test_the_model_comparison_would_notice_a_drift(engine: Engine) -> None:
    """The head-equals-models check is not vacuous: a column missing from the migrations is reported."""
    from sqlalchemy import Column, Integer, MetaData

    upgrade(engine)
    drifted = MetaData()
    for table in metadata.tables.values():
        table.to_metadata(drifted)
    drifted.tables["boundedbeat_runs"].append_column(Column("priority", Integer, nullable=True))
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "version_table": VERSION_TABLE}
        )
        diff = compare_metadata(context, drifted)
    assert [(d[0], d[3].name) for d in diff] == [("add_column", "priority")]


def _downgrade(engine: Engine, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(migrations_path()))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def test_queued_triggers_survive_the_0003_upgrade_and_downgrade(engine: Engine) -> None:
    """0003 gives old rows an empty trigger queue, keeping pending ticks; its downgrade keeps the triggers."""
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    upgrade(engine, "0002")
    old = Table("boundedbeat_schedules", MetaData(), autoload_with=engine)
    assert "triggers" not in old.c
    counters = dict.fromkeys(("runs", "skips", "overlaps", "failures", "pending_runs"), 0)
    with engine.begin() as conn:
        conn.execute(
            insert(old).values(
                name="old", task="proj.old", mode="fixed_rate_no_overlap", policy=Policy().to_json(),
                schedule="every 10s", period=10.0, args=[], kwargs={}, options={}, origin="config",
                config_hash="", paused=False, stopped=False, active_runs=1, pending=[t0.isoformat()],
                grid_at=t0 + timedelta(seconds=10), next_due_at=t0 + timedelta(seconds=10),
                created_at=t0, updated_at=t0, **{**counters, "pending_runs": 1},
            )
        )  # fmt: skip
    upgrade(engine)
    store = Store(engine)
    (row,) = store.schedules(["old"])
    assert (row.pending, row.triggers, row.pending_runs) == ([t0.isoformat()], [], 1)
    assert store.trigger("old", t0 + timedelta(seconds=5)) == t0 + timedelta(seconds=5)
    (row,) = store.schedules(["old"])
    assert (row.triggers, row.pending_runs) == ([(t0 + timedelta(seconds=5)).isoformat()], 2)
    _downgrade(engine, "0002")
    with engine.connect() as conn:
        pending = conn.execute(select(old.c.pending).where(old.c.name == "old")).scalar_one()
    assert pending == [t0.isoformat(), (t0 + timedelta(seconds=5)).isoformat()]
