"""The Celery app module the scale benchmark's beat processes run (``bench/scale_bench.py``).

Configured by ``BENCH_*`` environment variables set by the benchmark. Both scheduler classes
here only add timestamps to a marks file (one line per event: ``<event> <unix time> ...``);
they change nothing in how beat runs:

- ``Marked`` is ``celery_boundedbeat.Scheduler`` with each tick transaction (``Store.tick``)
  timed: its first line is the moment beat is ticking (it holds the lease, has reconciled
  ``beat_schedule`` and has run its first tick transaction).
- ``MarkedStock`` is Celery's ``PersistentScheduler``; its first ``tick()`` return is the
  moment it is ticking (its heap of entries is built; Celery sleeps between ticks outside it).

``BENCH_PUBLISH_DELAY_MS`` (``bench/partition_scaling_bench.py``) makes every task message wait
that long before it is handed to the broker, as a slow or distant broker would: a
``before_task_publish`` receiver, which runs in the publishing thread once per message.
"""

from __future__ import annotations

import gc
import os
import time

IMPORTED_AT = time.time()

from typing import Any  # noqa: E402

from celery import Celery, signals  # noqa: E402
from celery.beat import PersistentScheduler  # noqa: E402

import celery_boundedbeat  # noqa: E402
from celery_boundedbeat.beat.scheduler import Scheduler  # noqa: E402

_marks = open(os.environ["BENCH_MARKS"], "a", buffering=1)  # noqa: SIM115 (the process's lifetime)


def mark(event: str, *fields: Any) -> None:
    _marks.write(" ".join([event, *(str(f) for f in fields)]) + "\n")


def config_entries(n: int, kind: str, lead: float, spread: float = 3600.0) -> dict[str, dict[str, Any]]:
    """``n`` entries of one hour; ours have their first runs staggered over ``spread`` seconds
    (an hour unless set) after ``lead``."""
    if kind == "stock":
        return {f"c{i:06d}": {"task": "bench.noop", "schedule": 3600.0, "args": (i,)} for i in range(n)}
    return {
        f"c{i:06d}": {
            "task": "bench.noop",
            "schedule": 3600.0,
            "args": (i,),
            "policy": {"initial_delay": lead + i * spread / n},
        }
        for i in range(n)
    }


_gc_started = 0.0


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    """A collection of the oldest generation: ``gc <unix time> <seconds>`` (a pause of every thread)."""
    global _gc_started
    if info["generation"] != 2:
        return
    if phase == "start":
        _gc_started = time.time()
    else:
        mark("gc", f"{_gc_started:.6f}", f"{time.time() - _gc_started:.6f}")


gc.callbacks.append(_on_gc)
mark("imported", f"{IMPORTED_AT:.6f}")
app = Celery("scale_app", broker=os.environ["BENCH_BROKER"])
app.conf.update(
    task_default_queue=os.environ["BENCH_QUEUE"],
    boundedbeat_database_url=os.environ["BENCH_DB_URL"],
    boundedbeat_dispatch_enabled=os.environ.get("BENCH_DISPATCH", "1") == "1",
    boundedbeat_partitions=int(os.environ.get("BENCH_PARTITIONS", "1")),
    beat_schedule=config_entries(
        int(os.environ.get("BENCH_CONFIG_ENTRIES", "0")),
        os.environ.get("BENCH_CONFIG_KIND", "ours"),
        float(os.environ.get("BENCH_CONFIG_LEAD", "0")),
        float(os.environ.get("BENCH_CONFIG_SPREAD", "3600")),
    ),
)
celery_boundedbeat.install(app)
_PUBLISH_DELAY = float(os.environ.get("BENCH_PUBLISH_DELAY_MS", "0")) / 1000


def _slow_broker(**_: Any) -> None:
    """A broker that takes a fixed time per message (a latency, not CPU: the thread sleeps)."""
    time.sleep(_PUBLISH_DELAY)


if _PUBLISH_DELAY > 0:  # connected only then: a receiver also turns off the framed publish path
    signals.before_task_publish.connect(_slow_broker, weak=False)


mark("app", f"{time.time():.6f}")


class Marked(Scheduler):
    """``celery_boundedbeat.Scheduler``, with setup and every tick transaction timestamped."""

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


class MarkedStock(PersistentScheduler):  # type: ignore[misc]
    """Celery's stock scheduler, with setup and its first tick timestamped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ticked = False
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
