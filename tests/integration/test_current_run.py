"""``current_run()`` in a real worker: the run's id, schedule and grid time; ``None`` outside a run."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest

from .harness import Harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def reports(bb: Harness) -> list[dict[str, Any]]:
    """What the generated ``report_run`` task recorded, in order."""
    try:
        lines = bb.events_path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [e for e in map(json.loads, lines) if e["event"] == "current_run"]


@pytest.mark.parametrize("pool", ["threads", "prefork"])
@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_a_task_learns_its_run_and_grid_time_and_other_tasks_learn_nothing(bb: Harness, pool: str) -> None:
    """Each scheduled run sees its own id, schedule and aware UTC ``scheduled_for``; a task sent
    by other code on the same (single) worker thread or process afterwards sees ``None``."""
    bb.write_app({"who": {"task": f"{bb.module}.report_run", "schedule": 1.0, "kwargs": {"name": "who"}}})
    bb.start(pool=pool, concurrency=1)
    bb.wait_until(lambda: len(reports(bb)) >= 3, 60, "three runs reporting current_run()")
    bb.celery("boundedbeat", "pause", "who", check=True)
    bb.celery("call", f"{bb.module}.report_run", "--kwargs", json.dumps({"name": "outside"}), check=True)
    seen = bb.wait_until(
        lambda: (r := reports(bb)) and r[-1]["name"] == "outside" and r, 60, "the unscheduled task's report"
    )

    runs = {r.id: r for r in bb.runs("who")}
    scheduled = [e for e in seen if e["name"] == "who"]
    assert len(scheduled) >= 3
    for event in scheduled:
        run = runs[event["id"]]  # the task id is the run id
        assert event["run"] == {
            "id": run.id,
            "schedule": "who",
            "scheduled_for": run.scheduled_for.isoformat(),
            "utc": True,
        }, event
        assert datetime.fromisoformat(event["run"]["scheduled_for"]) == run.scheduled_for
    assert len({e["run"]["scheduled_for"] for e in scheduled}) == len(scheduled)  # one grid time each
    outside = seen[-1]
    assert outside["run"] is None, outside
    assert outside["pid"] in {e["pid"] for e in scheduled}  # the same process that ran the schedule
