"""The Celery app module the emission benchmark's beats and workers run (``bench/emission_bench.py``).

Configured by ``BENCH_*`` environment variables set by the benchmark. The scheduler classes
here add timestamps to a marks file (one line per event: ``<event> <unix time> ...``) and,
for stock beat, two message headers; neither changes when or what beat publishes:

- ``Marked`` is ``celery_boundedbeat.Scheduler`` with each tick transaction (``Store.tick``)
  timed (its first line is the moment beat is ticking). Its messages already carry their grid
  time (``boundedbeat_scheduled_for``).
- ``StampedStock`` is Celery's ``PersistentScheduler`` with its first ``tick()`` marked, and
  every message stamped with the due time stock beat fired it for (``bench_due``: the entry's
  ``last_run_at`` plus its period, exactly what ``schedule.is_due`` compares with now) and its
  entry's name (``bench_entry``). Stock beat has no header of its own for that; adding two
  items to the headers dict it already builds costs about a microsecond of its ~1 ms per send.

Workers (``BENCH_WORKER=1``) register the tasks (beats do not: they publish by name, as the
floor's ``send_task`` loop does) and call ``celery_boundedbeat.install(app)`` only when
``BENCH_INSTALL=1``, which is the difference the tracking-cost figure measures.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import UTC
from typing import Any

from celery import Celery, signals
from celery.beat import PersistentScheduler

import celery_boundedbeat
from celery_boundedbeat.beat.scheduler import Scheduler

_marks = open(os.environ["BENCH_MARKS"], "a", buffering=1)  # noqa: SIM115 (the process's lifetime)


def mark(event: str, *fields: Any) -> None:
    _marks.write(" ".join([event, *(str(f) for f in fields)]) + "\n")


def entries() -> dict[str, dict[str, Any]]:
    """``BENCH_ENTRIES`` entries of ``BENCH_PERIOD`` seconds; ours carry ``BENCH_POLICY``.

    Stock beat refuses a ``policy`` key, so its entries are the same without it.
    """
    count = int(os.environ.get("BENCH_ENTRIES", "0"))
    period = float(os.environ.get("BENCH_PERIOD", "1"))
    task = os.environ.get("BENCH_TASK", "bench.noop")
    policy = json.loads(os.environ.get("BENCH_POLICY") or "null")
    out: dict[str, dict[str, Any]] = {}
    for i in range(count):
        entry: dict[str, Any] = {"task": task, "schedule": period, "args": (i,)}
        if policy is not None and os.environ.get("BENCH_KIND") != "stock":
            entry["policy"] = policy
        out[f"e{i:06d}"] = entry
    return out


app = Celery("emission_app", broker=os.environ["BENCH_BROKER"])
app.conf.update(
    task_default_queue=os.environ["BENCH_QUEUE"],
    boundedbeat_database_url=os.environ["BENCH_DB_URL"],
    boundedbeat_report_writer=os.environ.get("BENCH_REPORT_WRITER", "auto"),
    beat_schedule=entries(),
)
if os.environ.get("BENCH_INSTALL") == "1":
    celery_boundedbeat.install(app)

if os.environ.get("BENCH_WORKER") == "1":
    _expect = int(os.environ.get("BENCH_EXPECT", "0"))
    _lock = threading.Lock()
    _started: list[float] = []

    def noop(*args: Any) -> None:
        """Records when its body ran; the ``BENCH_EXPECT``-th marks the first and last of them."""
        now = time.time()
        with _lock:
            _started.append(now)
            if len(_started) == _expect:
                mark("done", f"{min(_started):.6f}", f"{max(_started):.6f}", len(_started))

    def sleep(*args: Any) -> None:
        time.sleep(float(os.environ.get("BENCH_TASK_SECONDS", "0.1")))

    def _ready(**_: Any) -> None:
        mark("ready", f"{time.time():.6f}")

    app.task(name="bench.noop")(noop)
    app.task(name="bench.sleep")(sleep)
    signals.worker_ready.connect(_ready, weak=False)


class Marked(Scheduler):
    """``celery_boundedbeat.Scheduler``, with every tick transaction timestamped."""

    def setup_schedule(self) -> None:
        mark("setup_start", f"{time.time():.6f}")
        super().setup_schedule()
        mark("setup_end", f"{time.time():.6f}")
        inner = self.store.tick

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.time()
            t0 = time.perf_counter()
            result = inner(*args, **kwargs)
            took = time.perf_counter() - t0
            mark("tick", f"{started:.6f}", f"{took:.6f}", len(result.emitted), len(result.outcomes))
            return result

        self.store.tick = timed  # type: ignore[method-assign]


class StampedStock(PersistentScheduler):  # type: ignore[misc]
    """Celery's stock scheduler; its first tick is marked and each message names its due time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ticked = False
        self._stamp: dict[str, Any] = {}
        super().__init__(*args, **kwargs)

    def setup_schedule(self) -> None:
        mark("setup_start", f"{time.time():.6f}")
        super().setup_schedule()
        mark("setup_end", f"{time.time():.6f}")

    def tick(self, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        t0 = time.perf_counter()
        result = super().tick(*args, **kwargs)
        if not self._ticked:
            self._ticked = True
            mark("tick", f"{started:.6f}", f"{time.perf_counter() - t0:.6f}", 0, 0)
        return result

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        # Before ``reserve``: the due time is the previous run plus the period (schedule.is_due).
        last = entry.last_run_at
        last = last if last.tzinfo else last.replace(tzinfo=UTC)
        self._stamp = {"bench_due": (last + entry.schedule.run_every).timestamp(), "bench_entry": entry.name}
        return super().apply_async(entry, producer, advance, **kwargs)

    def send_task(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["headers"] = {**(kwargs.get("headers") or {}), **self._stamp}
        return super().send_task(*args, **kwargs)
