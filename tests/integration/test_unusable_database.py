"""A database that cannot be used, as an operator meets it: real ``celery`` processes, one clear line.

Beat against an unreachable database writes one line naming it (password masked) and the
driver's reason, then exits 69, instead of a traceback per retry; a URL whose dialect or driver
is not installed is an invalid setting (exit 78), not an outage. Every CLI command prints the
masked reason; a worker says once at start that it cannot record runs. No password appears.
No server is needed: port 1 on the loopback refuses every connection.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

CELERY = str(Path(sys.executable).parent / "celery")
SECRET = "secret-Pw-4711"
UNREACHABLE = f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:1/x"
NO_DIALECT = f"nosuchdb://postgres:{SECRET}@127.0.0.1/x"
NO_DRIVER = f"mysql+mysqldb://root:{SECRET}@127.0.0.1/x"

#: Every command that opens the database, with arguments (the schedule needs no row: the
#: database is refused before any is looked up).
COMMANDS = [
    ("migrate",),
    ("status",),
    ("status", "--json"),
    ("status", "--format", "prometheus"),
    ("health",),
    ("history",),
    ("pause", "tick"),
    ("resume", "tick"),
    ("trigger", "tick"),
    ("add", "new", "proj.noop", "--every", "5"),
    ("update", "new", "--every", "5"),
    ("remove", "new"),
    ("purge", "--older-than", "1"),
    ("dispatch",),
]


def write_app(where: Path, url: str) -> None:
    (where / "dbapp.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            import celery_boundedbeat

            app = Celery("dbapp", broker="memory://")
            app.conf.boundedbeat_database_url = {url!r}
            app.conf.beat_schedule = {{"tick": {{"task": "dbapp.noop", "schedule": 1.0}}}}
            celery_boundedbeat.install(app)


            @app.task
            def noop():
                return None
            """
        )
    )


def env_for(where: Path) -> dict[str, str]:
    """The app module's directory first, then whatever the test run itself imports from."""
    paths = [str(where), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def celery(where: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = env_for(where)
    return subprocess.run(
        [CELERY, "-A", "dbapp", *args],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def lines_of(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


@pytest.mark.timeout(120)
def test_beat_against_an_unreachable_database_writes_one_line_and_exits_69(tmp_path: Path) -> None:
    """One CRITICAL line with the masked URL and the refusal, exit 69 (EX_UNAVAILABLE), no traceback."""
    write_app(tmp_path, UNREACHABLE)
    done = celery(tmp_path, "beat", "-S", "celery_boundedbeat.Scheduler", timeout=90)
    text = done.stdout + done.stderr
    assert done.returncode == 69, text
    ours = [line for line in lines_of(done) if "celery_boundedbeat" in line and "CRITICAL" in line]
    assert len(ours) == 1, text
    assert (
        "cannot reach the database postgresql+psycopg://postgres:***@127.0.0.1:1/x: OperationalError"
        in ours[0]
    )
    assert "Connection refused" in ours[0]
    assert "Traceback" not in text and SECRET not in text, text
    assert len(lines_of(done)) < 40, text  # Celery's banner and our line, nothing repeated


@pytest.mark.timeout(120)
@pytest.mark.parametrize("url", [NO_DIALECT, NO_DRIVER], ids=["unknown-dialect", "driver-not-installed"])
def test_beat_with_a_url_it_cannot_load_exits_78_naming_the_setting(tmp_path: Path, url: str) -> None:
    """An unknown dialect or a missing driver is a configuration error (78), not a traceback and exit 1."""
    write_app(tmp_path, url)
    done = celery(tmp_path, "beat", "-S", "celery_boundedbeat.Scheduler", timeout=90)
    text = done.stdout + done.stderr
    assert done.returncode == 78, text
    assert "key 'boundedbeat_database_url': no SQLAlchemy dialect or driver installed for it" in text
    assert "Traceback" not in text and SECRET not in text, text
    assert len(lines_of(done)) < 40, text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_prints_the_masked_reason_for_an_unreachable_database(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    """One line: the database (password masked) and the driver's reason, exit non-zero."""
    write_app(tmp_path, UNREACHABLE)
    done = celery(tmp_path, "boundedbeat", *command)
    text = done.stdout + done.stderr
    assert done.returncode != 0, text
    assert lines_of(done) == [lines_of(done)[0]], text
    line = lines_of(done)[0]
    assert "postgresql+psycopg://postgres:***@127.0.0.1:1/x" in line, text
    assert "OperationalError: connection failed" in line and "Connection refused" in line, text
    assert "Traceback" not in text and SECRET not in text, text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("url", [NO_DIALECT, NO_DRIVER], ids=["unknown-dialect", "driver-not-installed"])
@pytest.mark.parametrize(
    "command", [("migrate",), ("status",), ("health",), ("add", "n", "t", "--every", "5")]
)
def test_a_url_that_cannot_be_loaded_is_reported_invalid_not_unreachable(
    tmp_path: Path, url: str, command: tuple[str, ...]
) -> None:
    """The error names the setting and says what is missing; it never says the database is down."""
    write_app(tmp_path, url)
    done = celery(tmp_path, "boundedbeat", *command)
    text = done.stdout + done.stderr
    assert done.returncode != 0, text
    assert "invalid celery_boundedbeat configuration" in text, text
    assert "key 'boundedbeat_database_url': no SQLAlchemy dialect or driver installed for it" in text, text
    assert "cannot reach" not in text and "cannot use" not in text and "migrated" not in text, text
    assert "Traceback" not in text and SECRET not in text, text
    if command == ("health",):
        assert len(lines_of(done)) == 1, text  # a probe prints one line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_worker_with_an_unreachable_database_warns_once_at_start(tmp_path: Path, pool: str) -> None:
    """The worker starts (tasks may not need the database) and says once why runs cannot be recorded."""
    write_app(tmp_path, UNREACHABLE)
    env = env_for(tmp_path)
    args = [CELERY, "-A", "dbapp", "worker", "-P", pool, "-c", "2", "--without-mingle", "--without-gossip"]
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen([*args, "-l", "INFO"], cwd=tmp_path, env=env, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and "cannot record its runs" not in log.read_text():
                time.sleep(0.2)
            time.sleep(3)  # room for a second warning, were there one
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=30)
    text = log.read_text()
    warnings = [line for line in text.splitlines() if "cannot record its runs" in line]
    assert len(warnings) == 1, text
    assert "WARNING" in warnings[0]
    assert "cannot reach the database postgresql+psycopg://postgres:***@127.0.0.1:1/x" in warnings[0], text
    assert "Connection refused" in warnings[0], text
    assert SECRET not in text and "Traceback" not in text, text
