"""One bad schedule stops nothing else: refused at the door, or set aside while the others run."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from .harness import Harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LONG = "x" * 201


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_an_over_long_name_is_refused_by_check_and_by_beat_with_exit_78(bb: Harness) -> None:
    """A beat_schedule name longer than the table's column fails `check` and beat's start with
    EX_CONFIG naming the entry and the key, and nothing is written."""
    bb.write_app({"fine": bb.entry("fine", 1.0), LONG: bb.entry("long", 1.0)})
    named = f"entry '{LONG[:40]}...', key 'name': must be at most 200 characters, got 201"
    check = bb.celery("boundedbeat", "check")
    assert check.returncode == 78, check.stdout + check.stderr
    assert named in check.stdout + check.stderr
    bb.migrate()
    beat = bb.start_beat(migrate=False, wait_lease=False)
    beat.expect_alive = False
    try:
        status = beat.popen.wait(timeout=30)
    except Exception:
        raise AssertionError(f"beat kept running with an over-long name\n{beat.tail()}") from None
    assert status == 78, beat.output()
    assert named in beat.output()
    assert bb.schedules() == {}, "schedules were written despite the bad configuration"


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_a_row_made_bad_in_the_database_does_not_stop_the_other_schedules(bb: Harness) -> None:
    """A schedule row whose state cannot be read is set aside (logged once, by name); the other
    schedule keeps its runs coming at its rate."""
    bb.write_app({"good": bb.entry("good", 1.0), "broken": bb.entry("broken", 1.0)})
    _, beat = bb.start(concurrency=4)
    bb.wait_until(lambda: len(bb.finished("broken")) >= 1, timeout=30, what="a run of 'broken'")
    with bb.db.engine.begin() as conn:
        conn.execute(
            text("UPDATE boundedbeat_schedules SET pending = '[\"not a time\"]' WHERE name = 'broken'")
        )
    before = len(bb.runs("good"))
    bb.wait_until(lambda: len(bb.runs("good")) >= before + 5, timeout=30, what="5 more runs of 'good'")
    failed = [line for line in beat.output().splitlines() if "schedule 'broken' is not run" in line]
    assert len(failed) == 1, beat.tail(60)
    assert "not a time" in failed[0]
