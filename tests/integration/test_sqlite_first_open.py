"""Processes that write a new SQLite database at the same instant all get through.

A worker and beat started together both switch a new file to WAL; SQLite refuses the loser at
once ("database is locked"), without its busy handler, and beat exited at start-up for it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery_boundedbeat.db.engine import get_engine

FILES = 60
PROCESSES = 2


def _write_at(url: str, start: float, errors: Path) -> None:
    """In a forked child: wait for ``start``, then write as beat's migration or a worker would."""
    while time.time() < start:
        pass
    try:
        with get_engine(url).begin() as conn:
            conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS t (a INTEGER)")
            conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    except Exception as exc:
        errors.write_text(f"{type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)


def test_processes_writing_a_new_sqlite_file_together_all_get_through(tmp_path: Path) -> None:
    failed: list[str] = []
    for n in range(FILES):
        url = f"sqlite:///{tmp_path / f'new{n}.sqlite3'}"
        start = time.time() + 0.05
        children = {}
        for k in range(PROCESSES):
            errors = tmp_path / f"error-{n}-{k}.txt"
            pid = os.fork()
            if pid == 0:
                _write_at(url, start, errors)
            children[pid] = errors
        for pid, errors in children.items():
            _, status = os.waitpid(pid, 0)
            if status != 0:
                failed.append(errors.read_text() if errors.exists() else f"exit status {status}")
    assert failed == [], f"{len(failed)} of {FILES * PROCESSES} writers failed, first: {failed[0]}"
