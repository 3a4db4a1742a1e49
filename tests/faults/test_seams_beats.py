"""Two beats on one database: only the lease holder writes schedule rows, and starting together is safe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from integration.harness import Harness, running_harness
from integration.processes import Proc

from .support import holder_pid, tracebacks

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq, pytest.mark.integration, pytest.mark.timeout(120)]

LEASE = {"boundedbeat_lease_ttl": 6.0, "boundedbeat_lease_renew_interval": 2.0}

#: A second task name in the generated module (beat B configures ``x`` with it).
OTHER_TASK = '''

@app.task
def other(name):
    """Beat B's task for ``x``: another name than A's ``work``."""
    return name
'''

#: Holds a beat at its first lease acquisition until the file ``BB_GO_FILE`` names exists
#: (after putting a file for it in ``BB_READY_DIR``), so several beats, all set up, try to take
#: the lease of an empty lease table at the same instant. Test instrumentation in the generated
#: module; the package runs unchanged.
START_GATE = """

_READY, _GO = os.environ.get("BB_READY_DIR"), os.environ.get("BB_GO_FILE")
if _READY and _GO:
    import celery_boundedbeat.db.store as _store

    _acquire = _store.Store.acquire_lease

    def _gated_acquire(self, *args, **kwargs):
        if not os.path.exists(_GO):
            open(os.path.join(_READY, str(os.getpid())), "w").close()
            while not os.path.exists(_GO):
                time.sleep(0.001)
        return _acquire(self, *args, **kwargs)

    _store.Store.acquire_lease = _gated_acquire
"""

#: What a schedule row is, apart from the counters and times its holder's ticks move.
IDENTITY = ("task", "config_hash", "kwargs", "schedule", "origin", "paused", "stopped", "created_at")
ROWS = (
    "SELECT name, task, config_hash, CAST(kwargs AS TEXT) AS kwargs, schedule, origin, paused, stopped, "
    "created_at, runs, skips, failures, active_runs, next_due_at, updated_at FROM boundedbeat_schedules"
)


def write_app(h: Harness, schedule: dict[str, Any], extra: str = OTHER_TASK, **conf: Any) -> None:
    module = h.write_app(schedule, **conf)
    path = h.tmp / f"{module}.py"
    path.write_text(path.read_text() + extra)


def rows(bb: Harness) -> dict[str, dict[str, Any]]:
    return {row.pop("name"): row for row in bb.sql(ROWS)}


def test_a_standby_with_another_config_writes_no_schedule_row_until_it_holds_the_lease(
    bb: Harness, tmp_path: Path
) -> None:
    """A standby beat started with another beat_schedule leaves the holder's schedule rows alone
    and reconciles them to its own config only once it holds the lease."""
    work, other = f"{bb.module}.work", f"{bb.module}.other"
    write_app(bb, {"x": bb.entry("x", 1.0), "y": bb.entry("y", 1.0)}, **LEASE)
    _worker, beat_a = bb.start(pool="threads", concurrency=2)
    bb.wait_until(
        lambda: len(bb.finished("x")) >= 2 and len(bb.finished("y")) >= 1,
        timeout=20,
        what="beat A's runs of 'x' and 'y' to complete",
    )
    paused = bb.celery("boundedbeat", "pause", "y", check=True)
    assert "paused" in paused.stdout, paused.stdout
    bb.wait_until(lambda: bb.schedule("y")["active_runs"] == 0, timeout=10, what="'y' to have no active run")
    before = rows(bb)
    assert set(before) == {"x", "y"}, before
    assert before["y"]["paused"] and not before["x"]["paused"], before
    assert before["x"]["task"] == work and before["y"]["task"] == work, before

    standby_dir = tmp_path / "standby"
    standby_dir.mkdir()
    with running_harness(bb.backend, standby_dir) as b:
        assert b.module == bb.module and b.queue == bb.queue  # same names, another module file
        write_app(
            b,
            {"x": {"task": other, "schedule": 1.0, "kwargs": {"name": "x"}}, "z": b.entry("z", 1.0)},
            **LEASE,
        )
        beat_b = b.start_beat(migrate=False, wait_lease=False)
        b.wait_for_log(beat_b, "is standing by", timeout=40)

        def only_a_writes() -> None:
            assert beat_b.alive, beat_b.tail()
            assert holder_pid(bb) == beat_a.popen.pid, b.diagnostics()
            now = rows(bb)
            assert set(now) == {"x", "y"}, now
            for name, row in now.items():
                for column in IDENTITY:
                    assert row[column] == before[name][column], (name, column, row, before[name])
            assert now["y"] == before["y"], (now["y"], before["y"])  # paused: A's ticks leave it alone
            for counter in ("runs", "skips", "failures"):
                assert now["x"][counter] >= before["x"][counter], (now["x"], before["x"])
            log = beat_b.output()
            assert "reconciled" not in log and "emitted" not in log, beat_b.tail()

        bb.watch(5.0, only_a_writes)
        assert rows(bb)["x"]["runs"] > before["x"]["runs"], "beat A kept running 'x' meanwhile"

        status = bb.stop(beat_a)
        assert status == 0, f"beat A exited {status} on SIGTERM\n{beat_a.tail()}"
        b.wait_until(
            lambda: set(now := rows(b)) == {"x", "z"} and now["x"]["task"] == other,
            timeout=10,
            what="beat B to reconcile the rows to its config",
        )
        after = rows(b)
        assert not after["x"]["paused"] and not after["z"]["paused"], after
        assert after["z"]["task"] == work and after["x"]["created_at"] == before["x"]["created_at"], after
        assert holder_pid(b) == beat_b.popen.pid
        assert "reconciled 2 schedule(s)" in beat_b.output(), beat_b.tail()
        b.wait_until(
            lambda: [r for r in b.finished("x") if r.task == other] and b.finished("z"),
            timeout=15,
            what="runs of beat B's 'x' (task other) and 'z' to complete",
        )
        assert not [r for r in b.runs() if r.schedule == "y" and r.enqueued_at > after["x"]["updated_at"]]
        b.assert_no_errors()
    bb.assert_no_errors()


def test_two_beats_starting_together_on_a_fresh_database_take_one_lease_and_one_row_each(
    bb: Harness, tmp_path: Path
) -> None:
    """Two beats taking the lease at the same instant on a just-migrated database both keep running
    without an error, exactly one holds the lease, and each configured schedule has one row."""
    names = [f"s{i:02d}" for i in range(12)]
    write_app(bb, {n: bb.entry(n, 1.0) for n in names}, extra=START_GATE, **LEASE)
    bb.migrate()
    worker = bb.start_worker(pool="threads", concurrency=4)
    assert bb.sql("SELECT name FROM boundedbeat_schedules") == []
    assert bb.sql("SELECT name FROM boundedbeat_leases") == []
    ready, go = tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    bb.env.update(BB_READY_DIR=str(ready), BB_GO_FILE=str(go))
    try:
        beats = [bb.start_beat(migrate=False, wait_lease=False) for _ in range(2)]
    finally:
        del bb.env["BB_READY_DIR"], bb.env["BB_GO_FILE"]
    bb.wait_until(
        lambda: len(list(ready.iterdir())) == 2,
        timeout=30,
        what="both beats at their first lease acquisition",
    )
    go.touch()

    def holder_and_standby() -> tuple[Proc, Proc] | None:
        held = [p for p in beats if "holds the beat lease" in p.output()]
        waiting = [p for p in beats if "is standing by" in p.output()]
        return (held[0], waiting[0]) if len(held) == 1 and len(waiting) == 1 else None

    holder, standby = bb.wait_until(holder_and_standby, timeout=30, what="one holder and one standby")
    bb.wait_until(lambda: len(bb.finished("s00")) >= 2, timeout=15, what="2 completed runs of 's00'")

    def one_of_each() -> None:
        assert holder_pid(bb) == holder.popen.pid, bb.diagnostics()
        counted = bb.sql("SELECT name, COUNT(*) AS n FROM boundedbeat_schedules GROUP BY name")
        assert sorted((r["name"], r["n"]) for r in counted) == [(n, 1) for n in names], counted
        assert "holds the beat lease" not in standby.output(), standby.tail()

    bb.watch(3.0, one_of_each)
    status = bb.celery("boundedbeat", "status", check=True).stdout
    assert f":{holder.popen.pid}:" in status and f":{standby.popen.pid}:" not in status, status
    assert worker.alive, worker.tail()
    for proc in beats:
        assert proc.alive, proc.tail()
        log = proc.output()
        for bad in ("Traceback", "UniqueViolation", "IntegrityError", "ERROR/", "CRITICAL/"):
            assert bad not in log, f"{proc.name} logged {bad!r}\n{proc.tail(80)}"
        assert tracebacks(proc) == 0
    assert holder.output().count("reconciled 12 schedule(s)") == 1, holder.tail()
    assert "reconciled" not in standby.output() and "emitted" not in standby.output(), standby.tail()
