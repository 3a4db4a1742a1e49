"""Drive real ``celery beat`` and ``celery worker`` processes against a real broker and database.

``Harness`` is the one object an end-to-end test holds (the ``bb`` fixture): a thin facade
over one test's generated app module (``apps``), its processes (``processes``), the reads of
its database and task records (``reads``) and the polling that waits for them (``waiting``),
on a backend from ``backends``. It only wires those parts together and adds what needs more
than one of them: failure diagnostics (runs and process logs) and polling that fails fast
when a process died. ``running_harness`` gives a test a harness whose processes are all
killed when the test ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import waiting
from .apps import AppModule
from .backends import Backend
from .processes import Processes
from .reads import Reads, TaskInterval, intervals


class Harness:
    """One test's app module, processes and database."""

    def __init__(self, backend: Backend, tmp: Path) -> None:
        self.backend = backend
        self.tmp = tmp
        self.uid = backend.uid
        self.module = f"bbapp_{self.uid}"
        self.queue = f"bbq_{self.uid}"
        self.events_path = tmp / "events.jsonl"
        names = {"tmp": tmp, "module": self.module, "queue": self.queue}
        self.app = AppModule(backend=backend, events_path=self.events_path, **names)
        self.processes = Processes(
            uid=self.uid, migrates=backend.is_postgres, known_url=self._own_database_url, **names
        )
        self.db = Reads(backend, tmp, describe=self.diagnostics)
        # The parts' own methods, under the names the tests use.
        self.write_app = self.app.write
        self.entry = self.app.entry
        self.env = self.processes.env
        self.procs = self.processes.procs
        self.celery = self.processes.celery
        self.migrate = self.processes.migrate
        self.start_beat = self.processes.start_beat
        self.start_worker = self.processes.start_worker
        self.start = self.processes.start
        self.stop = self.processes.stop
        self.assert_no_errors = self.processes.assert_no_errors
        self.wait_for_log = waiting.wait_for_log
        self.sql = self.db.sql
        self.runs = self.db.runs
        self.finished = self.db.finished
        self.schedules = self.db.schedules
        self.schedule = self.db.schedule
        self.books = self.db.books

    def _own_database_url(self) -> str | None:
        """The backend's database URL when the app module uses exactly that one (no proxy)."""
        url = self.app.database_url()
        return url if url == self.backend.database_url else None

    def intervals(self, name: str | None = None) -> list[TaskInterval]:
        """Task-recorded runs (paired start/end lines), by start time."""
        return intervals(self.events_path, name)

    def diagnostics(self, lines: int = 40) -> str:
        parts = []
        try:
            runs = self.runs()
            parts.append(f"-- last runs ({len(runs)} total):")
            parts.extend("   " + r.short() for r in runs[-20:])
            parts.append(f"-- schedules: {self.schedules()}")
        except Exception as exc:
            parts.append(f"-- could not read runs: {exc!r}")
        parts.extend(self.processes.report(lines))
        return "\n".join(parts)

    def _check_alive(self) -> None:
        self.processes.check_alive(self.diagnostics)

    def wait_until(
        self,
        predicate: Callable[[], Any],
        timeout: float,
        what: str,
        *,
        interval: float = 0.2,
        each: Callable[[], None] | None = None,
    ) -> Any:
        """Poll ``predicate`` until it returns something truthy; fail with logs on timeout.

        ``each`` runs on every poll (invariant checks); processes expected to be alive are
        checked too, so a crashed beat fails fast with its log instead of a bare timeout.
        """
        return waiting.wait_until(
            predicate,
            timeout,
            what,
            interval=interval,
            each=each,
            check=self._check_alive,
            describe=self.diagnostics,
        )

    def watch(self, seconds: float, each: Callable[[], None], interval: float = 0.2) -> None:
        """Keep checking an invariant for a while."""
        waiting.watch(seconds, each, interval, check=self._check_alive)

    def close(self) -> None:
        self.processes.close()
        self.db.dispose()


@contextlib.contextmanager
def running_harness(backend: Backend, tmp: Path) -> Iterator[Harness]:
    """A harness whose processes are all killed when the test ends."""
    harness = Harness(backend, tmp)
    try:
        yield harness
    finally:
        harness.close()
