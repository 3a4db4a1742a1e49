"""No database or broker password is ever printed: beat banner and logs, every CLI command, every error.

Real processes on PostgreSQL (trust authentication ignores the password in the URL, so a URL
with one works) and RabbitMQ, with a failover broker list whose second URL carries its own
password (kombu masks only the first one of a list).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq, pytest.mark.integration]

VENV_BIN = Path(sys.executable).parent
DB_SECRET = "Pg-S3cret-db-pw"
BROKER_SECRET = "Amqp-S3cret-second"
QUERY_SECRET = "Q-S3cret-param"
SECRETS = (DB_SECRET, BROKER_SECRET, QUERY_SECRET)


def _with_password(url: str) -> str:
    return url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://postgres:{DB_SECRET}@")


def _write_app(tmp_path: Path, db_url: str, broker: str, queue: str) -> None:
    (tmp_path / "secapp.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            import celery_boundedbeat

            app = Celery("secapp", broker={broker!r})
            app.conf.task_default_queue = {queue!r}
            app.conf.boundedbeat_database_url = {db_url!r}
            app.conf.beat_schedule = {{"tick": {{"task": "secapp.noop", "schedule": 1.0}}}}
            celery_boundedbeat.install(app)
            """
        )
    )


def _celery(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [str(VENV_BIN / "celery"), "-A", "secapp", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _run_for(tmp_path: Path, seconds: float, *args: str) -> str:
    """Start a long-running command, let it work, stop it with SIGTERM; its whole output."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    log = tmp_path / f"{args[0]}-{uuid.uuid4().hex[:6]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(VENV_BIN / "celery"), "-A", "secapp", *args],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        time.sleep(seconds)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
    return log.read_text(errors="replace")


def _assert_clean(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{where} printed a password:\n{text[-3000:]}"


@pytest.mark.timeout(240)
def test_beat_banner_logs_and_every_cli_command_mask_every_password(
    tmp_path: Path, postgres_url: str
) -> None:
    """Beat (banner, INFO and DEBUG logs), the dispatcher and every CLI command print no password."""
    db_url = _with_password(postgres_url) + f"?application_name=bb&password={QUERY_SECRET}"
    broker = f"amqp://guest:guest@127.0.0.1:5672//;amqp://guest:{BROKER_SECRET}@127.0.0.1:5673//"
    _write_app(tmp_path, db_url, broker, f"bbsec_{uuid.uuid4().hex[:8]}")
    outputs: dict[str, str] = {}
    migrated = _celery(tmp_path, "boundedbeat", "migrate")
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    outputs["migrate"] = migrated.stdout + migrated.stderr
    outputs["beat"] = _run_for(
        tmp_path, 6, "beat", "-S", "celery_boundedbeat.Scheduler", "--loglevel", "DEBUG"
    )
    assert "emitted tick run" in outputs["beat"], outputs["beat"][-3000:]
    assert "postgres:***@127.0.0.1" in outputs["beat"], "the banner names the database, masked"
    for command in (
        ("status",),
        ("status", "--json"),
        ("status", "--format", "prometheus"),
        ("history", "--limit", "5"),
        ("history", "tick", "--json"),
        ("pause", "tick"),
        ("resume", "tick"),
        ("trigger", "tick"),
        ("purge", "--older-than", "30"),
    ):
        done = _celery(tmp_path, "boundedbeat", *command)
        outputs[" ".join(command)] = done.stdout + done.stderr
        assert done.returncode == 0, outputs[" ".join(command)]
    for command in (("health",), ("health", "--json")):  # exit 1 here: the beat is gone
        done = _celery(tmp_path, "boundedbeat", *command)
        outputs[" ".join(command)] = done.stdout + done.stderr
    outputs["dispatch"] = _run_for(tmp_path, 4, "boundedbeat", "dispatch")
    assert "draining postgresql+psycopg://postgres:***@" in outputs["dispatch"]
    for where, text in outputs.items():
        _assert_clean(text, where)


@pytest.mark.timeout(180)
def test_error_paths_name_the_database_and_the_reason_without_a_password(tmp_path: Path) -> None:
    """An unreachable database, an invalid URL and an unreachable failover broker are reported masked."""
    queue = f"bbsec_{uuid.uuid4().hex[:8]}"
    unreachable = f"postgresql+psycopg://postgres:{DB_SECRET}@127.0.0.1:1/nowhere"
    _write_app(tmp_path, unreachable, "amqp://guest:guest@127.0.0.1:5672//", queue)
    for command in (
        ("migrate",),
        ("status",),
        ("status", "--format", "prometheus"),
        ("history",),
        ("pause", "tick"),
        ("health",),
    ):
        done = _celery(tmp_path, "boundedbeat", *command)
        text = done.stdout + done.stderr
        assert done.returncode != 0, text
        assert "postgres:***@127.0.0.1:1/nowhere" in text and "OperationalError" in text, text
        assert "Traceback" not in text, text
        _assert_clean(text, " ".join(command))
    beat = _run_for(tmp_path, 8, "beat", "-S", "celery_boundedbeat.Scheduler")
    _assert_clean(beat, "beat against an unreachable database")

    invalid = f"postgresql+psycopg://postgres:{DB_SECRET}@127.0.0.1:notaport/db"
    _write_app(tmp_path, invalid, "amqp://guest:guest@127.0.0.1:5672//", queue)
    for command in (("migrate",), ("status",), ("health",)):
        done = _celery(tmp_path, "boundedbeat", *command)
        text = done.stdout + done.stderr
        assert done.returncode != 0 and "Traceback" not in text, text
        assert "boundedbeat_database_url" in text and "postgres:***@127.0.0.1:notaport" in text, text
        _assert_clean(text, f"{command} with an invalid URL")
    beat = _run_for(tmp_path, 6, "beat", "-S", "celery_boundedbeat.Scheduler")
    _assert_clean(beat, "beat with an invalid URL")
