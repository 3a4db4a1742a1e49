"""Alert signals under a real beat and worker: each transition is received once, in the beat.

The test app imports a receiver module (Celery's ``imports`` setting, loaded by beat and
worker alike) that appends every celery_boundedbeat signal it receives to a JSON-lines file,
with the receiving process's id; a second module holds tasks that fail, hang or die on cue.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .harness import Harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RECEIVER = '''\
"""Records every celery_boundedbeat signal (written by tests/integration/test_alerts.py)."""
import json
import os
import time

from celery_boundedbeat import signals
from {app} import app

SIGNALS = {path!r}
COUNTS = {counts!r}


def _record(signal, sender, **named):
    line = dict(signal=signal.name, sender=sender, pid=os.getpid(), t=time.time())
    line.update((k, v.isoformat() if hasattr(v, "isoformat") else v) for k, v in named.items())
    with open(SIGNALS, "a") as fh:
        fh.write(json.dumps(line) + "\\n")


for _signal in (signals.schedule_failing, signals.schedule_recovered, signals.ticks_dropped,
                signals.run_lost, signals.run_timed_out):
    _signal.connect(_record, weak=False, dispatch_uid="bbtest-" + _signal.name)


def _nth(name):
    """How many times the task ``name`` started before (a file of one line per start)."""
    path = os.path.join(COUNTS, name)
    with open(path, "a+") as fh:
        fh.seek(0)
        n = len(fh.read().splitlines())
        fh.write("x\\n")
    return n


@app.task
def flaky(name, fail_first):
    """Fail the first ``fail_first`` runs, then complete."""
    if _nth(name) < fail_first:
        raise ValueError(f"{{name}} fails on purpose")


@app.task
def hang(name, seconds):
    time.sleep(seconds)


@app.task
def die_once(name):
    """The first run kills its own pool process (the prefork parent settles it lost)."""
    if _nth(name) == 0:
        os._exit(1)
'''


def received(path: Path, name: str | None = None) -> list[dict[str, Any]]:
    """The signals recorded so far (of one signal name)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:  # a line being written right now
            continue
    return [e for e in events if name is None or e["signal"] == name]


@pytest.mark.parametrize("backend", ["pg-rabbitmq", "sqlite-filesystem"], indirect=True)
def test_each_alert_signal_is_received_once_per_transition_in_the_beat(bb: Harness) -> None:
    """failing once at the threshold and recovered once; one ticks_dropped per dropping tick whose
    counts add up to ``skips``; one run_lost and one run_timed_out per such run; all in beat."""
    signals_path = bb.tmp / "signals.jsonl"
    receiver = f"bbsignals_{bb.uid}"
    counts = bb.tmp / "counts"
    counts.mkdir()
    (bb.tmp / f"{receiver}.py").write_text(
        RECEIVER.format(app=bb.module, path=str(signals_path), counts=str(counts))
    )
    bb.write_app(
        {
            "flaky": {"task": f"{receiver}.flaky", "schedule": 1.0, "args": ("flaky", 3)},
            "busy": {"task": f"{receiver}.hang", "schedule": 1.0, "args": ("busy", 2.5)},
            "slow": {
                "task": f"{receiver}.hang",
                "schedule": 1.0,
                "args": ("slow", 5),
                "policy": {"max_run_time": 1, "max_runs": 2},
            },
            "dies": {
                "task": f"{receiver}.die_once",
                "schedule": 1.0,
                "args": ("dies",),
                "policy": {"max_runs": 2},
            },
        },
        imports=(receiver,),
        boundedbeat_failing_threshold=2,
        boundedbeat_heartbeat_interval=1.0,
    )
    _worker, beat = bb.start(pool="prefork", concurrency=6)
    bb.wait_until(
        lambda: (
            len(received(signals_path, "schedule_recovered")) >= 1
            and len([r for r in bb.runs("flaky") if r.state == "completed"]) >= 3
            and bb.schedule("slow")["stopped"]
            and bb.schedule("dies")["stopped"]
        ),
        90,
        "flaky to fail 3 times and recover, slow and dies to end",
    )
    for name in ("flaky", "busy"):
        bb.celery("boundedbeat", "pause", name, check=True)
    bb.wait_until(
        lambda: all(bb.schedule(n)["active_runs"] == 0 for n in ("flaky", "busy", "slow", "dies")),
        30,
        "every run settled",
    )
    # Every alert row the settles wrote has been taken out and sent, and ticks_dropped adds up to skips.
    skips = bb.schedule("busy")["skips"]
    assert skips >= 1
    bb.wait_until(
        lambda: (
            not bb.sql("SELECT id FROM boundedbeat_alerts")
            and sum(e["count"] for e in received(signals_path, "ticks_dropped") if e["schedule"] == "busy")
            >= skips
        ),
        30,
        "the alert rows to be sent",
    )
    events = received(signals_path)
    assert {e["pid"] for e in events} == {beat.popen.pid}, "every signal is sent by the beat"
    assert all(e["sender"] == e["schedule"] for e in events)

    flaky_runs = bb.runs("flaky")
    failing = [e for e in events if e["signal"] == "schedule_failing"]
    flaky_failing = [e for e in failing if e["schedule"] == "flaky"]
    assert len(flaky_failing) == 1, flaky_failing
    assert flaky_failing[0]["failures"] == 2 and flaky_failing[0]["run_id"] == flaky_runs[1].id
    assert flaky_failing[0]["state"] == "failed" and "fails on purpose" in flaky_failing[0]["error"]
    recovered = received(signals_path, "schedule_recovered")
    assert [(e["schedule"], e["run_id"]) for e in recovered] == [("flaky", flaky_runs[3].id)]
    assert recovered[0]["since"] == flaky_failing[0]["at"]

    dropped = [e for e in events if e["signal"] == "ticks_dropped" and e["schedule"] == "busy"]
    assert sum(e["count"] for e in dropped) == skips, (dropped, skips)
    assert all(e["count"] >= 1 for e in dropped)
    assert len({e["at"] for e in dropped}) == len(dropped), "one signal per tick that dropped"

    timed_out = {r.id for r in bb.runs("slow") if r.state == "timed_out"}
    assert len(timed_out) == 2
    assert sorted(e["run_id"] for e in events if e["signal"] == "run_timed_out") == sorted(timed_out)
    lost = {r.id for r in bb.runs("dies") if r.state == "lost"}
    assert len(lost) == 1
    assert [e["run_id"] for e in events if e["signal"] == "run_lost"] == list(lost)
    # slow's two timed-out runs reach the threshold once; dies' one lost run does not.
    assert sorted(e["schedule"] for e in failing) == ["flaky", "slow"]
