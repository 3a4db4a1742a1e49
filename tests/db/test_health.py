"""The health probe: its verdicts over fixed times, its one read, and the command's exit status."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from sqlalchemy import Engine, insert

from celery_boundedbeat.cli import boundedbeat
from celery_boundedbeat.core.unstarted import Unstarted
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.lease import LEASE_NAME
from celery_boundedbeat.db.migrate import upgrade
from celery_boundedbeat.db.tables import LeaseRow, QueueRow, RunRow, ScheduleRow
from celery_boundedbeat.ops.health import (
    BeatState,
    Bounds,
    Problem,
    bound_refusal,
    database_failure,
    judge,
    read_beat_state,
)

NOW = datetime(2026, 12, 1, 6, 0, 0, tzinfo=UTC)
BOUNDS = Bounds(max_tick_age=20.0, max_queue_age=300.0)


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def held(ticked_ago: float, expires_in: float = 10.0, oldest_due_ago: float | None = None) -> BeatState:
    """A lease held by ``h:1:a`` that was renewed ``ticked_ago`` s before NOW."""
    return BeatState(
        holder="h:1:a",
        renewed_at=NOW - _s(ticked_ago),
        expires_at=NOW + _s(expires_in),
        oldest_queued_due_at=None if oldest_due_ago is None else NOW - _s(oldest_due_ago),
    )


def test_a_holder_that_ticked_within_the_bound_is_healthy() -> None:
    """A live lease renewed 3 s ago with an empty queue passes, and the line says so."""
    verdict = judge(held(3.0), NOW, BOUNDS)
    assert verdict.healthy and verdict.problem is None
    assert verdict.message == "healthy: beat h:1:a holds the lease; last tick 3.0 s ago; queue empty"


def test_no_lease_row_means_no_beat() -> None:
    """Without a lease row (never started, or released on a clean stop) the probe fails."""
    verdict = judge(BeatState(), NOW, BOUNDS)
    assert verdict.problem is Problem.NO_BEAT
    assert verdict.message.startswith("unhealthy: no beat holds the lease (no lease row")


def test_an_expired_lease_means_no_beat_and_names_the_last_holder() -> None:
    """A lease that expired 2 s ago fails as no beat, with the holder and its last tick's age."""
    state = held(ticked_ago=17.0, expires_in=-2.0)
    verdict = judge(state, NOW, BOUNDS)
    assert verdict.problem is Problem.NO_BEAT
    assert verdict.message == (
        "unhealthy: no beat holds the lease: the lease of h:1:a expired 2.0 s ago; "
        "its last tick was 17.0 s ago"
    )


def test_a_lease_expiring_exactly_now_is_not_held() -> None:
    """The lease is free at ``expires_at`` itself, as ``Store.acquire_lease`` sees it."""
    assert judge(held(1.0, expires_in=0.0), NOW, BOUNDS).problem is Problem.NO_BEAT


def test_a_holder_past_the_tick_bound_stopped_ticking() -> None:
    """A lease still valid but renewed longer ago than the bound fails as stalled."""
    verdict = judge(held(ticked_ago=20.5, expires_in=30.0), NOW, BOUNDS)
    assert verdict.problem is Problem.STALLED
    assert verdict.message == (
        "unhealthy: beat h:1:a holds the lease but stopped ticking: last tick 20.5 s ago (bound 20 s)"
    )


def test_the_tick_bound_itself_still_passes() -> None:
    """A tick exactly ``max_tick_age`` old is within the bound."""
    assert judge(held(ticked_ago=20.0), NOW, BOUNDS).healthy


def test_an_overdue_queue_means_the_dispatcher_is_behind() -> None:
    """The oldest queued message due 301 s ago fails with a bound of 300 s; 299 s passes."""
    behind = judge(held(1.0, oldest_due_ago=301.0), NOW, BOUNDS)
    assert behind.problem is Problem.BEHIND
    assert behind.message == (
        "unhealthy: the dispatcher is behind: the oldest queued message was due 301.0 s ago (bound 300 s)"
    )
    fine = judge(held(1.0, oldest_due_ago=299.0), NOW, BOUNDS)
    assert fine.healthy and "oldest queued message due 299.0 s ago" in fine.message


def test_the_queue_check_can_be_turned_off() -> None:
    """With no queue bound an hour-old queued message does not fail the probe."""
    assert judge(held(1.0, oldest_due_ago=3600.0), NOW, Bounds(max_queue_age=None)).healthy


def test_a_message_due_in_the_future_is_not_late() -> None:
    """A countdown message due later has age 0, never a negative one."""
    verdict = judge(held(1.0, oldest_due_ago=-50.0), NOW, BOUNDS)
    assert verdict.healthy and verdict.to_json()["queue_oldest_age_seconds"] == 0.0


def test_no_beat_comes_before_stalled_and_behind() -> None:
    """An expired lease with an old tick and an overdue queue reports the missing beat first."""
    state = held(ticked_ago=100.0, expires_in=-1.0, oldest_due_ago=1000.0)
    assert judge(state, NOW, BOUNDS).problem is Problem.NO_BEAT


def test_the_json_form_carries_the_values_read() -> None:
    """``--json`` gives the verdict with times, ages and bounds."""
    out = judge(held(4.0, oldest_due_ago=2.5), NOW, BOUNDS).to_json()
    assert out == {
        "healthy": True,
        "problem": None,
        "message": out["message"],
        "checked_at": NOW.isoformat(),
        "holder": "h:1:a",
        "last_tick_at": (NOW - _s(4.0)).isoformat(),
        "last_tick_age_seconds": 4.0,
        "lease_expires_at": (NOW + _s(10.0)).isoformat(),
        "queue_oldest_due_at": (NOW - _s(2.5)).isoformat(),
        "queue_oldest_age_seconds": 2.5,
        "max_tick_age": 20.0,
        "max_queue_age": 300.0,
        "unstarted_runs": 0,
        "unstarted": [],
        "max_unstarted_age": 300.0,
        "unowned_partitions": [],
    }


def test_a_tick_bound_not_above_the_renew_interval_is_refused() -> None:
    """Beat records a tick per renewal: a bound of 5 s with a 5 s renewal would flap."""
    assert bound_refusal(Bounds(max_tick_age=5.0), 5.0) is not None
    assert bound_refusal(Bounds(max_tick_age=5.5), 5.0) is None


def test_a_database_failure_names_the_masked_url_and_the_reason() -> None:
    """The password never shows; the driver's first line does."""
    from sqlalchemy.exc import OperationalError

    url = "postgresql+psycopg://bb:s3cret@db.example:5432/app"
    exc = OperationalError("SELECT 1", {}, Exception("connection refused\nIs the server running?"))
    verdict = database_failure(url, exc, NOW, BOUNDS)
    assert verdict.problem is Problem.DATABASE
    assert verdict.message == (
        "unhealthy: cannot reach the database postgresql+psycopg://bb:***@db.example:5432/app: "
        "OperationalError: connection refused"
    )


def test_published_runs_no_worker_started_fail_the_probe_naming_their_queue() -> None:
    """Runs published past ``max_unstarted_age`` and not started: exit 1, schedule and queue named."""
    waiting = Unstarted(schedule="report", queue="nowhere", runs=2, oldest_published_at=NOW - _s(412))
    state = BeatState(**{**_fields(held(1.0)), "unstarted": (waiting,)})
    verdict = judge(state, NOW, BOUNDS)
    assert verdict.problem is Problem.UNSTARTED
    assert verdict.message == (
        "unhealthy: 2 published run(s) not started by any worker within 300 s (the oldest published "
        "412.0 s ago): report (2): waiting for a worker on queue nowhere (does a worker consume that "
        "queue, with celery_boundedbeat.install(app)?)"
    )
    out = verdict.to_json()
    assert out["unstarted_runs"] == 2 and out["unstarted"][0]["queue"] == "nowhere", out
    assert judge(state, NOW, Bounds(max_tick_age=20.0, max_unstarted_age=None)).healthy


def test_a_stalled_beat_is_reported_before_unstarted_runs() -> None:
    """The order an operator fixes things in: no ticking beat first, then the workers."""
    waiting = Unstarted(schedule="report", queue=None, runs=1, oldest_published_at=NOW - _s(900))
    state = BeatState(**{**_fields(held(60.0)), "unstarted": (waiting,)})
    assert judge(state, NOW, BOUNDS).problem is Problem.STALLED
    assert waiting.text == "waiting for a worker on its default queue"


def _fields(state: BeatState) -> dict[str, Any]:
    return {name: getattr(state, name) for name in BeatState.__dataclass_fields__}


# -- the one read, on SQLite and PostgreSQL ------------------------------------------------


def test_the_read_finds_nothing_on_an_empty_database(migrated: Engine) -> None:
    """No lease row and an empty queue read as all ``None`` (one row comes back regardless)."""
    assert read_beat_state(migrated) == BeatState()


def test_the_read_finds_the_lease_and_the_oldest_queued_due_time(migrated: Engine) -> None:
    """The lease's holder and times and the earliest ``due_at`` of the queue, claimed or not."""
    with migrated.begin() as conn:
        conn.execute(
            insert(LeaseRow).values(
                name=LEASE_NAME, holder="h:1:a", acquired_at=NOW - _s(60), renewed_at=NOW - _s(2),
                expires_at=NOW + _s(13),
            )
        )  # fmt: skip
        for i, (due, claimed) in enumerate(((NOW - _s(5), NOW + _s(30)), (NOW - _s(1), None))):
            conn.execute(
                insert(QueueRow).values(
                    task_id=f"t{i}", task="x", args=[], kwargs={}, options={}, due_at=due,
                    enqueued_at=due, claimed_by="d" if claimed else None, claimed_until=claimed, attempts=0,
                )
            )  # fmt: skip
    assert read_beat_state(migrated) == BeatState(
        holder="h:1:a", renewed_at=NOW - _s(2), expires_at=NOW + _s(13), oldest_queued_due_at=NOW - _s(5)
    )


def test_the_read_finds_published_runs_not_started_within_the_bound(migrated: Engine) -> None:
    """Only ``published`` runs older than the bound count, per schedule, with the options' queue."""
    with migrated.begin() as conn:
        for name, options in (("report", {"queue": "nowhere"}), ("other", {})):
            conn.execute(
                insert(ScheduleRow).values(
                    name=name, task="proj.t", mode="fixed_rate", policy={}, schedule="every 60s",
                    options=options, created_at=NOW, updated_at=NOW,
                )
            )  # fmt: skip
        for n, (name, state, published_ago) in enumerate(
            (
                ("report", "published", 400),
                ("report", "published", 301),
                ("report", "published", 299),  # within the bound
                ("report", "started", 900),
                ("other", "queued", None),
            )
        ):
            published = None if published_ago is None else NOW - _s(published_ago)
            conn.execute(
                insert(RunRow).values(
                    id=f"00000000-0000-0000-0000-{n:012d}", schedule=name, task="proj.t", state=state,
                    scheduled_for=NOW - _s(1000 - n), enqueued_at=NOW - _s(1000), published_at=published,
                )
            )  # fmt: skip
    found = read_beat_state(migrated, NOW, 300.0).unstarted
    assert found == (
        Unstarted(schedule="report", queue="nowhere", runs=2, oldest_published_at=NOW - _s(400)),
    )
    assert read_beat_state(migrated, NOW, None).unstarted == ()
    assert read_beat_state(migrated, NOW, 1000.0).unstarted == ()


# -- the command ---------------------------------------------------------------------------


def run(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(
        boundedbeat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), catch_exceptions=False
    )


def app_for(url: str) -> Celery:
    app = Celery("healthtest", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = url
    return app


def test_health_exits_1_naming_the_missing_beat(sqlite_url: str) -> None:
    """A migrated database no beat ever used: exit 1, one line."""
    upgrade(get_engine(sqlite_url))
    result = run(app_for(sqlite_url), "health")
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "no beat holds the lease" in result.output


def test_health_on_a_database_never_migrated_says_so(sqlite_url: str) -> None:
    """A missing table is not an unreachable database: the line asks whether it is migrated."""
    result = run(app_for(sqlite_url), "health")
    assert result.exit_code == 1
    assert "cannot read the beat lease from the database" in result.output
    assert "(is it migrated?)" in result.output and "no such table" in result.output


def test_health_exits_1_with_a_masked_password_when_the_database_is_unreachable() -> None:
    """Nothing listens on port 1: the line names the masked URL and the reason, never the password."""
    result = run(app_for("postgresql+psycopg://bb:s3cret@127.0.0.1:1/nodb"), "health", "--json")
    assert result.exit_code == 1
    assert "s3cret" not in result.output
    out = json.loads(result.output)
    assert out["problem"] == "database" and out["healthy"] is False
    assert (
        "cannot reach the database postgresql+psycopg://bb:***@127.0.0.1:1/nodb: OperationalError"
        in (out["message"])
    )


def test_health_refuses_a_tick_bound_within_the_renew_interval(sqlite_url: str) -> None:
    """``--max-tick-age 5`` with the default 5 s renewal is a usage error (exit 2), not "unhealthy"."""
    result = run(app_for(sqlite_url), "health", "--max-tick-age", "5")
    assert result.exit_code == 2
    assert "must be longer than boundedbeat_lease_renew_interval (5 s)" in result.output
    assert "unhealthy" not in result.output


def test_partitions_without_a_live_beat_are_unhealthy_and_named() -> None:
    """Partitioned beats: a partition nobody holds is not ticked, and the line says which."""
    bounds = Bounds(max_tick_age=20.0, max_queue_age=300.0, partitions=4)
    state = BeatState(holder="h:1:a", renewed_at=NOW - _s(1), expires_at=NOW + _s(10), unowned=(1, 3))
    verdict = judge(state, NOW, bounds)
    assert verdict.problem is Problem.UNOWNED
    assert verdict.message.startswith("unhealthy: partition(s) 1, 3 of 4 have no live beat")
    assert verdict.to_json()["unowned_partitions"] == [1, 3]
    assert judge(held(1.0), NOW, bounds).healthy


def test_the_read_finds_the_partitions_without_a_live_claim(migrated: Engine) -> None:
    with migrated.begin() as conn:
        for n, expires in ((0, NOW + _s(5)), (2, NOW - _s(1)), (3, NOW + _s(5))):
            conn.execute(
                insert(LeaseRow).values(
                    name=f"partition:{n}", holder="b", acquired_at=NOW, renewed_at=NOW, expires_at=expires
                )
            )
    assert read_beat_state(migrated, NOW, None, partitions=4).unowned == (1, 2)
    assert read_beat_state(migrated, NOW, None).unowned == (), "one partition: the lease says it all"
