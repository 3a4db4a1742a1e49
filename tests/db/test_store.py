"""The SQL store, one suite run on SQLite and on PostgreSQL, with a fake clock."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from helpers.clock import T0, sec
from sqlalchemy import Engine, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError, StatementError

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.core.messages import RUN_HEADER, SCHEDULE_HEADER
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import MAX_QUEUED_TRIGGERS, UNUSABLE_RETRY, TriggerRefused
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow, RunRow, ScheduleRow

RNG = random.Random(5)


def spec(name: str, schedule: Any = 10, **raw: Any) -> EntrySpec:
    built, problems = parse_entry(name, {"task": f"proj.{name}", "schedule": schedule, **raw}, {})
    assert problems == [] and built is not None, problems
    return built


@pytest.fixture
def store(migrated: Engine) -> Iterator[Store]:
    """A migrated, empty store."""
    yield Store(migrated)


def specs(*items: EntrySpec) -> dict[str, EntrySpec]:
    return {s.name: s for s in items}


def setup(store: Store, *items: EntrySpec, now: datetime = T0) -> dict[str, EntrySpec]:
    store.sync_config(items, now, RNG)
    return specs(*items)


def row(store: Store, name: str) -> ScheduleRow:
    rows = store.schedules([name])
    assert len(rows) == 1
    return rows[0]


def count(store: Store, model: Any, *where: Any) -> int:
    with store.session() as s:
        return int(s.scalar(select(func.count()).select_from(model).where(*where)) or 0)


def emit_one(store: Store, entries: dict[str, EntrySpec], now: datetime = T0) -> str:
    result = store.tick(entries, now, RNG, 100)
    assert len(result.emitted) == 1, result.emitted
    return result.emitted[0].id


def start(
    store: Store, run_id: str, now: datetime, *, process: str = "host:1", max_run_time: float | None = None
) -> bool:
    return store.run_life.start_run(
        run_id, worker="celery@host", process=process, now=now, max_run_time=max_run_time
    )


# -- schedules and ticks ---------------------------------------------------------------


def test_sync_config_adds_updates_and_removes_schedules(store: Store) -> None:
    """sync_config inserts new entries due at once, keeps counters of unchanged ones, drops removed ones."""
    setup(store, spec("a"), spec("b", policy={"mode": "fixed_delay", "initial_delay": 5}))
    a, b = row(store, "a"), row(store, "b")
    assert (a.task, a.mode, a.next_due_at, a.grid_at, a.period) == (
        "proj.a",
        "fixed_rate_no_overlap",
        T0,
        T0,
        10,
    )
    assert (b.mode, b.next_due_at) == ("fixed_delay", T0 + sec(5))
    store.tick(specs(spec("a")), T0, RNG, 100)
    store.sync_config([spec("a")], T0 + sec(1), RNG)  # b removed, a unchanged
    assert [r.name for r in store.schedules()] == ["a"]
    assert row(store, "a").next_due_at == T0 + sec(10)
    assert row(store, "a").active_runs == 1


def test_a_changed_schedule_restarts_its_grid_and_keeps_its_counters(store: Store) -> None:
    """Changing an entry's period restarts its grid from now; counters and history survive."""
    entries = setup(store, spec("a", schedule=10))
    run_id = emit_one(store, entries)
    store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(1))
    changed = setup(store, spec("a", schedule=30), now=T0 + sec(5))
    a = row(store, "a")
    assert (a.period, a.grid_at, a.next_due_at, a.runs) == (30, T0 + sec(5), T0 + sec(5), 1)
    assert [e.scheduled_for for e in store.tick(changed, T0 + sec(5), RNG, 100).emitted] == [T0 + sec(5)]
    assert row(store, "a").next_due_at == T0 + sec(35)
    same_again = setup(store, spec("a", schedule=30), now=T0 + sec(6))
    assert row(store, "a").next_due_at == T0 + sec(35)  # an unchanged entry keeps its grid
    assert store.tick(same_again, T0 + sec(6), RNG, 100).emitted == []


def test_tick_emits_runs_and_queue_rows_in_one_transaction(store: Store) -> None:
    """A due schedule gets a queued run and a queue row whose task id is the run id."""
    entries = setup(store, spec("a", args=[1], kwargs={"k": "v"}, options={"queue": "q"}))
    result = store.tick(entries, T0 + sec(0.25), RNG, 100)
    assert [(e.schedule, e.scheduled_for, e.drift_ms) for e in result.emitted] == [("a", T0, 250)]
    run_id = result.emitted[0].id
    run = store.run(run_id)
    assert run is not None
    assert (run.state, run.schedule, run.task, run.scheduled_for, run.enqueued_at, run.drift_ms) == (
        "queued",
        "a",
        "proj.a",
        T0,
        T0 + sec(0.25),
        250,
    )
    with store.session() as s:
        queued = s.scalars(select(QueueRow)).all()
        assert len(queued) == 1
        q = queued[0]
        assert (q.run_id, q.task_id, q.task, q.args, q.kwargs) == (run_id, run_id, "proj.a", [1], {"k": "v"})
        assert q.options["queue"] == "q"
        assert q.options["headers"][RUN_HEADER] == run_id
        assert q.options["headers"][SCHEDULE_HEADER] == "a"
    a = row(store, "a")
    assert (a.active_runs, a.next_due_at, a.grid_at) == (1, T0 + sec(10), T0 + sec(10))
    assert result.next_due_at == T0 + sec(10)


def test_a_tick_at_the_same_time_emits_nothing_twice(store: Store) -> None:
    """Ticking again before the next grid time emits nothing."""
    entries = setup(store, spec("a"))
    emit_one(store, entries)
    assert store.tick(entries, T0, RNG, 100).emitted == []
    assert store.tick(entries, T0 + sec(9.9), RNG, 100).emitted == []
    assert count(store, RunRow) == 1


def test_the_unique_tick_key_refuses_a_second_emission(store: Store) -> None:
    """(schedule, scheduled_for) is unique: a second row for the same tick is refused."""
    entries = setup(store, spec("a"))
    run_id = emit_one(store, entries)
    run = store.run(run_id)
    assert run is not None
    with pytest.raises(IntegrityError), store.session() as s:
        s.execute(
            insert(RunRow).values(
                id="00000000-0000-0000-0000-000000000000",
                schedule="a",
                task="proj.a",
                state="queued",
                scheduled_for=T0,
                enqueued_at=T0,
            )
        )


def test_a_stale_beat_cannot_emit_a_tick_twice_and_its_row_fails_alone(store: Store) -> None:
    """A row that would emit an already emitted grid time writes nothing of its own (its transaction
    rolls back whole) and is set aside; the schedule due beside it in the same batch still emits."""
    entries = setup(store, spec("a"), spec("b", schedule=5))
    emit_one_each = store.tick(entries, T0, RNG, 100)
    assert len(emit_one_each.emitted) == 2
    for run in emit_one_each.emitted:
        store.run_life.settle_run(run.id, RunState.COMPLETED, now=T0 + sec(1))
    # A second beat with a stale view of "a" (its grid rewound) ticks later.
    with store.session() as s:
        s.execute(update(ScheduleRow).where(ScheduleRow.name == "a").values(grid_at=T0, next_due_at=T0))
    before_a = row(store, "a")
    before_b = row(store, "b")
    assert before_b.next_due_at == T0 + sec(5)  # b is due too: its run would be written in the same tick
    result = store.tick(entries, T0 + sec(5), RNG, 100)
    assert list(result.failed) == ["a"] and "IntegrityError" in result.failed["a"]
    assert [e.schedule for e in result.emitted] == ["b"]
    assert count(store, RunRow, RunRow.schedule == "a") == 1  # T0 is never emitted twice
    assert count(store, QueueRow, QueueRow.task == "proj.a") == 0
    after_a = row(store, "a")
    assert (after_a.grid_at, after_a.runs, after_a.active_runs, after_a.updated_at) == (
        before_a.grid_at,
        before_a.runs,
        before_a.active_runs,
        before_a.updated_at,
    )
    assert after_a.next_due_at == T0 + sec(5) + UNUSABLE_RETRY
    after_b = row(store, "b")
    assert after_b.active_runs == before_b.active_runs + 1
    assert after_b.next_due_at == T0 + sec(10)


def test_tick_only_handles_schedules_it_knows(store: Store) -> None:
    """A due schedule without a usable spec emits nothing and is set aside a minute; the rest stays."""
    setup(store, spec("a"))
    before = row(store, "a")
    result = store.tick({}, T0, RNG, 100)
    assert result.emitted == [] and result.unusable == ["a"]
    after = row(store, "a")
    assert after.next_due_at == T0 + UNUSABLE_RETRY
    assert (after.grid_at, after.runs, after.skips, after.updated_at) == (
        before.grid_at,
        before.runs,
        before.skips,
        before.updated_at,
    )


def test_unusable_schedules_never_starve_the_others(store: Store) -> None:
    """Due rows beat cannot rebuild, as many as a whole batch, do not keep a later due row from running."""
    good = spec("good", policy={"initial_delay": 0.001})  # due just after the two others
    setup(store, spec("bad1"), spec("bad2"), good)
    known = {"good": good}
    store.tick(known, T0 + sec(1), RNG, 2)  # the batch holds the two unusable rows only
    emitted = store.tick(known, T0 + sec(1.5), RNG, 2).emitted
    assert [e.schedule for e in emitted] == ["good"]


def test_tick_respects_the_batch_limit(store: Store) -> None:
    """At most `limit` schedules are handled per tick; the rest wait for the next one."""
    entries = setup(store, *(spec(f"s{i}") for i in range(5)))
    assert len(store.tick(entries, T0, RNG, 3).emitted) == 3
    assert len(store.tick(entries, T0, RNG, 3).emitted) == 2


# -- the queue -------------------------------------------------------------------------


def queue_runs(store: Store, n: int) -> dict[str, EntrySpec]:
    entries = setup(store, *(spec(f"s{i}", schedule=10 + i) for i in range(n)))
    assert len(store.tick(entries, T0, RNG, 100).emitted) == n
    return entries


def test_claim_mark_published_and_release(store: Store) -> None:
    """Claimed rows are hidden from others; published ones leave the queue; released ones come back."""
    queue_runs(store, 3)
    first = store.claim_batch("d1", T0, 2, claim_timeout=60)
    assert len(first) == 2
    assert store.claim_batch("d2", T0, 10, claim_timeout=60) != []  # the third row only
    assert store.claim_batch("d3", T0, 10, claim_timeout=60) == []
    store.mark_published("d1", first[:1], T0 + sec(1))
    published = store.run(first[0].run_id or "")
    assert published is not None
    assert (published.state, published.published_at) == ("published", T0 + sec(1))
    assert count(store, QueueRow) == 2
    store.release_claims("d1", first[1:], "broker down")
    again = store.claim_batch("d3", T0 + sec(2), 10, claim_timeout=60)
    assert [c.id for c in again] == [first[1].id]
    with store.session() as s:
        q = s.get(QueueRow, first[1].id)
        assert q is not None
        assert (q.attempts, q.last_error, q.claimed_by) == (2, "broker down", "d3")


def test_mark_and_claim_marks_one_batch_and_claims_the_next(store: Store) -> None:
    """Between two batches the dispatcher marks the last one and claims the next in one call."""
    entries = setup(store, spec("a", args=[1, "x"], kwargs={"k": [2]}, options={"priority": 3}), spec("b"))
    store.tick(entries, T0, RNG, 100)
    first = store.claim_batch("d", T0, 1, claim_timeout=60)
    assert len(first) == 1
    claimed = first[0]
    assert (claimed.task, claimed.args, claimed.kwargs) == ("proj.a", [1, "x"], {"k": [2]})
    assert (
        claimed.options["priority"] == 3 and claimed.options["headers"]["boundedbeat_run"] == claimed.run_id
    )
    assert claimed.due_at == T0 and claimed.due_at.utcoffset() == timedelta(0)

    second = store.mark_and_claim("d", first, T0 + sec(1), 10, claim_timeout=60)
    assert [c.task for c in second] == ["proj.b"]
    run = store.run(claimed.run_id or "")
    assert run is not None and (run.state, run.published_at) == ("published", T0 + sec(1))
    assert count(store, QueueRow) == 1  # only the newly claimed row is left

    assert store.mark_and_claim("d", second, T0 + sec(2), 0, claim_timeout=60) == []
    assert count(store, QueueRow) == 0
    assert store.mark_and_claim("d", [], T0 + sec(3), 0, claim_timeout=60) == []


def test_published_never_follows_started_whichever_process_writes_first(store: Store) -> None:
    """The dispatcher marks a batch after the broker took it, with its own clock reading; a
    worker may start a run of that batch first, or read its clock before the mark and commit
    after it. Either way ``published_at <= started_at``; a later start keeps the mark's time."""
    entries = setup(store, spec("a"), spec("b"), spec("c"))
    store.tick(entries, T0, RNG, 100)
    batch = {c.task: c for c in store.claim_batch("d", T0, 10, claim_timeout=60)}
    a, b, c = (batch[f"proj.{name}"].run_id or "" for name in "abc")
    assert start(store, a, T0 + sec(1))  # committed before the mark
    store.mark_published("d", list(batch.values()), T0 + sec(2))
    assert start(store, b, T0 + sec(1.5))  # clock read before the mark, committed after it
    assert start(store, c, T0 + sec(3))  # an ordinary start after the mark
    expected = {
        a: (T0 + sec(1), T0 + sec(1)),
        b: (T0 + sec(1.5), T0 + sec(1.5)),
        c: (T0 + sec(2), T0 + sec(3)),
    }
    for run_id, (published_at, started_at) in expected.items():
        run = store.run(run_id)
        assert run is not None
        assert (run.state, run.published_at, run.started_at) == ("started", published_at, started_at)
    assert count(store, QueueRow) == 0


def test_claims_come_oldest_due_first(store: Store) -> None:
    """claim_batch hands out rows in due order."""
    entries = setup(store, spec("late"), spec("early"))
    with store.session() as s:
        s.execute(
            update(ScheduleRow)
            .where(ScheduleRow.name == "early")
            .values(grid_at=T0 - sec(5), next_due_at=T0 - sec(5))
        )
    store.tick(entries, T0, RNG, 100)
    claimed = store.claim_batch("d", T0, 10, claim_timeout=60)
    assert [c.due_at for c in claimed] == [T0 - sec(5), T0]
    assert [c.task for c in claimed] == ["proj.early", "proj.late"]


def test_an_expired_claim_is_reclaimed(store: Store) -> None:
    """A dead claimer's row is claimable again once its claim expires; the dead claimer cannot publish it."""
    queue_runs(store, 1)
    (claimed,) = store.claim_batch("dead", T0, 10, claim_timeout=30)
    assert store.claim_batch("live", T0 + sec(29), 10, claim_timeout=30) == []
    (reclaimed,) = store.claim_batch("live", T0 + sec(31), 10, claim_timeout=30)
    assert reclaimed.id == claimed.id
    store.mark_published("dead", [claimed], T0 + sec(32))
    assert count(store, QueueRow) == 1  # the dead claimer's late publish does not remove it
    store.mark_published("live", [reclaimed], T0 + sec(32))
    assert count(store, QueueRow) == 0


def test_concurrent_claimers_never_share_a_row(store: Store) -> None:
    """Many threads claiming at once get disjoint rows that cover the whole queue."""
    queue_runs(store, 40)
    got: list[list[int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def claimer(n: int) -> None:
        try:
            barrier.wait()
            mine: list[int] = []
            while batch := store.claim_batch(f"d{n}", T0, 3, claim_timeout=60):
                mine.extend(c.id for c in batch)
            got.append(mine)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    ids = [i for mine in got for i in mine]
    assert len(ids) == 40
    assert len(set(ids)) == 40


@pytest.mark.postgres
def test_postgres_claims_skip_rows_locked_by_another_claimer(pg_store: Store) -> None:
    """On PostgreSQL a claimer skips rows another transaction holds instead of waiting or sharing them."""
    queue_runs(pg_store, 4)
    with pg_store.engine.connect() as other:
        tx = other.begin()
        locked = [
            r[0]
            for r in other.execute(
                text("SELECT id FROM boundedbeat_queue ORDER BY due_at, id LIMIT 2 FOR UPDATE")
            )
        ]
        claimed = pg_store.claim_batch("d", T0, 10, claim_timeout=60)
        tx.rollback()
    assert len(locked) == 2
    assert len(claimed) == 2
    assert not {c.id for c in claimed} & set(locked)
    assert len(pg_store.claim_batch("d2", T0, 10, claim_timeout=60)) == 2  # the lock is gone


# -- runs: start, settle, reap ----------------------------------------------------------


def test_start_then_settle_settles_exactly_once(store: Store) -> None:
    """A run settles once: a second settle returns None and counts and frees nothing."""
    entries = setup(store, spec("a"))
    run_id = emit_one(store, entries)
    assert start(store, run_id, T0 + sec(1)) is True
    assert count(store, QueueRow) == 0  # a started run is no longer waiting to be published
    run = store.run(run_id)
    assert run is not None
    assert (run.state, run.started_at, run.published_at, run.worker) == (
        "started",
        T0 + sec(1),
        T0 + sec(1),
        "celery@host",
    )
    assert start(store, run_id, T0 + sec(2), process="host:2") is False  # a redelivery
    settled = store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(3.5))
    assert settled is not None
    assert (settled.state, settled.schedule, settled.elapsed_ms) == (RunState.COMPLETED, "a", 2500)
    assert store.run_life.settle_run(run_id, RunState.FAILED, now=T0 + sec(4), error="late") is None
    assert store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(4)) is None
    a = row(store, "a")
    assert (a.active_runs, a.runs, a.failures, a.last_elapsed_ms) == (0, 1, 0, 2500)
    run = store.run(run_id)
    assert run is not None
    assert (run.state, run.finished_at, run.error) == ("completed", T0 + sec(3.5), None)


def test_concurrent_settles_free_the_slot_once(store: Store) -> None:
    """Settles racing from several threads settle the run once and count it once."""
    entries = setup(store, spec("a", policy={"mode": "fixed_rate", "max_concurrency": 2}))
    run_id = emit_one(store, entries)
    emit_one(store, entries, T0 + sec(10))
    start(store, run_id, T0 + sec(11))
    results: list[object] = []
    barrier = threading.Barrier(6)

    def settle(state: RunState) -> None:
        barrier.wait()
        results.append(store.run_life.settle_run(run_id, state, now=T0 + sec(12)))

    threads = [
        threading.Thread(target=settle, args=(s,))
        for s in [RunState.COMPLETED, RunState.LOST, RunState.FAILED] * 2
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 6
    assert sum(r is not None for r in results) == 1
    a = row(store, "a")
    assert a.active_runs == 1
    assert a.runs + a.failures == 1


def test_a_failure_keeps_its_error_and_counts_as_failure(store: Store) -> None:
    """A failed run keeps its error text and increments failures."""
    entries = setup(store, spec("a"))
    run_id = emit_one(store, entries)
    start(store, run_id, T0)
    store.run_life.settle_run(run_id, RunState.FAILED, now=T0 + sec(1), error="ValueError: nope")
    run = store.run(run_id)
    assert run is not None
    assert (run.state, run.error) == ("failed", "ValueError: nope")
    assert (row(store, "a").runs, row(store, "a").failures) == (0, 1)


def test_settling_a_fixed_delay_run_makes_the_next_due_a_period_after_it(store: Store) -> None:
    """A settled fixed-delay run makes the schedule due `period` after the finish."""
    entries = setup(store, spec("d", schedule=30, policy={"mode": "fixed_delay"}))
    run_id = emit_one(store, entries)
    assert row(store, "d").next_due_at is None
    assert store.tick(entries, T0 + sec(100), RNG, 100).emitted == []
    start(store, run_id, T0 + sec(1))
    store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(101))
    assert row(store, "d").next_due_at == T0 + sec(131)
    assert store.tick(entries, T0 + sec(130), RNG, 100).emitted == []
    assert [e.scheduled_for for e in store.tick(entries, T0 + sec(131), RNG, 100).emitted] == [T0 + sec(131)]


def test_a_stop_settle_stops_the_schedule(store: Store) -> None:
    """A run settled with stop=True leaves its schedule stopped; ticks emit nothing more."""
    entries = setup(store, spec("a"))
    run_id = emit_one(store, entries)
    start(store, run_id, T0)
    store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(1), stop=True)
    a = row(store, "a")
    assert (a.stopped, a.runs, a.active_runs) == (True, 1, 0)
    assert store.tick(entries, T0 + sec(100), RNG, 100).emitted == []
    assert store.next_due_at() is None


def test_a_stopped_schedule_stays_stopped_across_a_restart(store: Store) -> None:
    """Re-syncing the same configuration (a beat restart) keeps stop_schedule() in force."""
    entries = setup(store, spec("a"))
    run_id = emit_one(store, entries)
    store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(1), stop=True)
    store.sync_config(entries.values(), T0 + sec(50), RNG)
    assert row(store, "a").stopped is True
    assert store.tick(entries, T0 + sec(100), RNG, 100).emitted == []


def test_reap_marks_runs_of_a_dead_worker_lost(store: Store) -> None:
    """A started run whose worker stopped heartbeating settles lost; one with a live worker does not."""
    entries = setup(store, spec("dead"), spec("alive"))
    runs = {e.schedule: e.id for e in store.tick(entries, T0, RNG, 100).emitted}
    start(store, runs["dead"], T0, process="host:1")
    start(store, runs["alive"], T0, process="host:2")
    store.run_life.heartbeat("host:1", "host", 1, T0)
    store.run_life.heartbeat("host:2", "host", 2, T0)
    assert store.run_life.reap(T0 + sec(9), heartbeat_interval=3, start_timeout=3600, rng=RNG) == []
    store.run_life.heartbeat("host:2", "host", 2, T0 + sec(9))
    settled = store.run_life.reap(T0 + sec(10), heartbeat_interval=3, start_timeout=3600, rng=RNG)
    assert [(s.run_id, s.state) for s in settled] == [(runs["dead"], RunState.LOST)]
    assert store.run(runs["alive"]).state == "started"  # type: ignore[union-attr]
    assert row(store, "dead").failures == 1
    assert row(store, "dead").active_runs == 0


def test_reap_marks_a_run_without_any_worker_row_lost(store: Store) -> None:
    """A started run whose process never heartbeated is lost once the heartbeat window passes."""
    entries = setup(store, spec("a"))
    run_id = emit_one(store, entries)
    start(store, run_id, T0, process="gone:9")
    assert store.run_life.reap(T0 + sec(5), heartbeat_interval=3, start_timeout=3600, rng=RNG) == []
    settled = store.run_life.reap(T0 + sec(10), heartbeat_interval=3, start_timeout=3600, rng=RNG)
    assert [s.state for s in settled] == [RunState.LOST]


def test_reap_times_out_a_run_past_its_deadline(store: Store) -> None:
    """A started run past max_run_time settles timed_out and frees its slot once."""
    entries = setup(store, spec("a", policy={"max_run_time": 5}))
    run_id = emit_one(store, entries)
    start(store, run_id, T0, max_run_time=5)
    store.run_life.heartbeat("host:1", "host", 1, T0 + sec(6))
    assert store.run_life.reap(T0 + sec(4.9), heartbeat_interval=3, start_timeout=3600, rng=RNG) == []
    settled = store.run_life.reap(T0 + sec(6), heartbeat_interval=3, start_timeout=3600, rng=RNG)
    assert [(s.run_id, s.state, s.elapsed_ms) for s in settled] == [(run_id, RunState.TIMED_OUT, 6000)]
    assert store.run_life.reap(T0 + sec(7), heartbeat_interval=3, start_timeout=3600, rng=RNG) == []
    a = row(store, "a")
    assert (a.active_runs, a.failures, a.runs) == (0, 1, 0)
    assert store.run(run_id).error == "passed max_run_time"  # type: ignore[union-attr]
    # A late completion signal from the worker changes nothing.
    assert store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(8)) is None
    assert row(store, "a").runs == 0


def test_reap_rejects_a_published_run_nobody_started(store: Store) -> None:
    """A run published but never started within start_timeout settles rejected."""
    entries = setup(store, spec("a"))
    run_id = emit_one(store, entries)
    batch = store.claim_batch("d", T0, 10, claim_timeout=60)
    store.mark_published("d", batch, T0 + sec(1))
    assert store.run_life.reap(T0 + sec(60), heartbeat_interval=3, start_timeout=60, rng=RNG) == []
    settled = store.run_life.reap(T0 + sec(62), heartbeat_interval=3, start_timeout=60, rng=RNG)
    assert [(s.run_id, s.state) for s in settled] == [(run_id, RunState.REJECTED)]
    assert (row(store, "a").active_runs, row(store, "a").failures) == (0, 1)
    # The worker finally receives it: the run stays rejected.
    assert start(store, run_id, T0 + sec(63)) is False
    assert store.run(run_id).state == "rejected"  # type: ignore[union-attr]


def test_reject_unpublished_settles_runs_stuck_in_the_queue(store: Store) -> None:
    """Queued runs older than publish_timeout are rejected and leave the queue; claimed ones stay."""
    entries = setup(store, spec("a"), spec("b", schedule=11))
    runs = {e.schedule: e.id for e in store.tick(entries, T0, RNG, 100).emitted}
    claimed = {c.run_id: c for c in store.claim_batch("d", T0 + sec(50), 10, claim_timeout=60)}
    store.release_claims("d", [claimed[runs["a"]]], "broker down")  # only b stays claimed
    assert store.reject_unpublished(T0 + sec(59), publish_timeout=60, rng=RNG) == []
    settled = store.reject_unpublished(T0 + sec(61), publish_timeout=60, rng=RNG)
    assert [(s.run_id, s.state) for s in settled] == [(runs["a"], RunState.REJECTED)]
    assert store.run(runs["a"]).state == "rejected"  # type: ignore[union-attr]
    assert store.run(runs["b"]).state == "queued"  # type: ignore[union-attr]
    assert count(store, QueueRow) == 1
    assert (row(store, "a").active_runs, row(store, "a").failures) == (0, 1)


# -- leases ------------------------------------------------------------------------------


def test_the_lease_is_exclusive_until_it_expires(store: Store) -> None:
    """One holder at a time: others are refused until the lease expires, then one takes it over."""
    assert store.acquire_lease("beat", "a", T0, ttl=15) is True
    assert store.acquire_lease("beat", "b", T0 + sec(1), ttl=15) is False
    assert store.acquire_lease("beat", "a", T0 + sec(10), ttl=15) is True  # renewal
    assert store.acquire_lease("beat", "b", T0 + sec(24), ttl=15) is False
    assert store.lease_holder("beat", T0 + sec(24)) == ("a", T0 + sec(25))
    assert store.acquire_lease("beat", "b", T0 + sec(25), ttl=15) is True  # expired: taken over
    assert store.acquire_lease("beat", "a", T0 + sec(26), ttl=15) is False
    assert store.lease_holder("beat", T0 + sec(26)) == ("b", T0 + sec(40))
    store.release_lease("beat", "a")  # not a's to release
    assert store.lease_holder("beat", T0 + sec(26)) == ("b", T0 + sec(40))
    store.release_lease("beat", "b")
    assert store.lease_holder("beat", T0 + sec(26)) is None
    assert store.acquire_lease("beat", "a", T0 + sec(27), ttl=15) is True


def test_racing_beats_get_the_lease_once(store: Store) -> None:
    """Beats racing for a free lease: exactly one wins, none crashes."""
    results: list[bool] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def contend(n: int) -> None:
        try:
            barrier.wait()
            results.append(store.acquire_lease("beat", f"beat-{n}", T0, ttl=15))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert sorted(results) == [False] * 5 + [True]


# -- maintenance and control ------------------------------------------------------------


def test_purge_deletes_only_old_settled_runs(store: Store) -> None:
    """purge removes settled runs finished before the cutoff and keeps recent and active ones."""
    entries = setup(store, spec("a", policy={"mode": "fixed_rate", "max_concurrency": 5}))
    ids = [emit_one(store, entries, T0 + sec(10 * i)) for i in range(4)]
    store.run_life.settle_run(ids[0], RunState.COMPLETED, now=T0 + sec(100))
    store.run_life.settle_run(ids[1], RunState.FAILED, now=T0 + sec(100), error="x")
    store.run_life.settle_run(ids[2], RunState.COMPLETED, now=T0 + sec(300))
    assert store.purge(T0 + sec(200), batch=1) == 2
    assert {r.id for r in store.runs(limit=10)} == {ids[2], ids[3]}
    assert store.purge(T0 + sec(200)) == 0


def test_pause_stops_emission_and_resume_rejoins_the_grid(store: Store) -> None:
    """A paused schedule emits nothing; resumed, it rejoins the grid and paused ticks are not skips."""
    entries = setup(store, spec("a"))
    store.run_life.settle_run(emit_one(store, entries), RunState.COMPLETED, now=T0 + sec(1))
    assert store.set_paused("a", True, T0 + sec(2)) is True
    assert store.tick(entries, T0 + sec(55), RNG, 100).emitted == []
    assert row(store, "a").paused is True
    assert store.set_paused("a", False, T0 + sec(55)) is True
    a = row(store, "a")
    assert (a.paused, a.next_due_at, a.skips) == (False, T0 + sec(60), 0)
    assert store.tick(entries, T0 + sec(59), RNG, 100).emitted == []
    assert [e.scheduled_for for e in store.tick(entries, T0 + sec(60), RNG, 100).emitted] == [T0 + sec(60)]
    assert row(store, "a").skips == 0
    assert store.set_paused("nope", True, T0) is False


def test_resume_lifts_a_stop(store: Store) -> None:
    """resume (set_paused False) clears stop_schedule() and the schedule emits again."""
    entries = setup(store, spec("d", policy={"mode": "fixed_delay"}))
    run_id = emit_one(store, entries)
    store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(1), stop=True)
    assert store.tick(entries, T0 + sec(50), RNG, 100).emitted == []
    store.set_paused("d", False, T0 + sec(50))
    assert row(store, "d").stopped is False
    assert [e.scheduled_for for e in store.tick(entries, T0 + sec(50), RNG, 100).emitted] == [T0 + sec(50)]


def test_trigger_runs_once_under_the_concurrency_bound(store: Store) -> None:
    """A trigger queues one run now; while the only slot is busy it waits, then runs once."""
    entries = setup(store, spec("a", schedule=60))
    first = emit_one(store, entries)
    assert store.trigger("a", T0 + sec(5)) == T0 + sec(5)
    assert store.tick(entries, T0 + sec(5), RNG, 100).emitted == []
    assert row(store, "a").pending_runs == 1
    assert row(store, "a").next_due_at > T0 + sec(5)  # type: ignore[operator]
    store.run_life.settle_run(first, RunState.COMPLETED, now=T0 + sec(6))
    emitted = store.tick(entries, T0 + sec(6), RNG, 100).emitted
    assert [e.scheduled_for for e in emitted] == [T0 + sec(5)]
    assert row(store, "a").pending_runs == 0
    assert row(store, "a").next_due_at == T0 + sec(60)
    assert store.trigger("nope", T0) is None


def test_a_queued_trigger_is_stored_apart_and_outlives_coalesced_ticks(store: Store) -> None:
    """A trigger waits in its own column while missed ticks coalesce, then runs at its trigger time."""
    entries = setup(store, spec("c", schedule=10, policy={"missed_ticks": "coalesce_latest"}))
    first = emit_one(store, entries)
    assert store.trigger("c", T0 + sec(1)) == T0 + sec(1)
    for k in (1, 2, 3):
        assert store.tick(entries, T0 + sec(10 * k), RNG, 100).emitted == []
    c = row(store, "c")
    assert (c.triggers, c.pending, c.pending_runs, c.skips) == (
        [(T0 + sec(1)).isoformat()],
        [(T0 + sec(30)).isoformat()],
        2,
        2,
    )
    store.run_life.settle_run(first, RunState.COMPLETED, now=T0 + sec(31))
    assert [e.scheduled_for for e in store.tick(entries, T0 + sec(31), RNG, 100).emitted] == [T0 + sec(1)]
    assert (row(store, "c").triggers, row(store, "c").pending_runs) == ([], 1)


@pytest.mark.parametrize("how", ["paused", "stopped", "full"])
def test_a_refused_trigger_changes_nothing(store: Store, how: str) -> None:
    """A trigger on a paused or stopped schedule, or past the bound, is refused with a reason, unstored."""
    entries = setup(store, spec("a", schedule=60))
    first = emit_one(store, entries)
    if how == "paused":
        store.set_paused("a", True, T0 + sec(1))
    elif how == "stopped":
        store.run_life.settle_run(first, RunState.COMPLETED, now=T0 + sec(1), stop=True)
    else:
        for _ in range(MAX_QUEUED_TRIGGERS):
            store.trigger("a", T0 + sec(1))
    before = row(store, "a")
    refused = store.trigger("a", T0 + sec(2))
    assert isinstance(refused, TriggerRefused)
    assert (how if how != "full" else "already wait") in refused.reason
    after = row(store, "a")
    assert (after.triggers, after.pending_runs, after.updated_at) == (
        before.triggers,
        before.pending_runs,
        before.updated_at,
    )


def test_a_trigger_never_reuses_the_time_of_a_run_or_another_trigger(store: Store) -> None:
    """Triggers in the microsecond of an emitted run, or of each other, get the next free microsecond."""
    us = timedelta(microseconds=1)
    entries = setup(store, spec("f", schedule=10, policy={"mode": "fixed_rate", "max_concurrency": 3}))
    emit_one(store, entries)  # the tick at T0, emitted at T0
    assert store.trigger("f", T0) == T0 + us
    assert store.trigger("f", T0) == T0 + 2 * us
    emitted = store.tick(entries, T0, RNG, 100).emitted
    assert sorted(e.scheduled_for for e in emitted) == [T0 + us, T0 + 2 * us]
    assert store.trigger("f", T0) is not None  # all three slots busy: it waits
    assert row(store, "f").triggers == [(T0 + 3 * us).isoformat()]
    assert count(store, RunRow, RunRow.schedule == "f") == 3


def test_trigger_on_an_idle_fixed_delay_schedule_runs_once(store: Store) -> None:
    """Triggering an idle fixed-delay schedule emits one run, not a run per settle."""
    entries = setup(store, spec("d", schedule=60, policy={"mode": "fixed_delay"}))
    store.run_life.settle_run(emit_one(store, entries), RunState.COMPLETED, now=T0 + sec(1))
    store.trigger("d", T0 + sec(10))
    triggered = emit_one(store, entries, T0 + sec(10))
    store.run_life.settle_run(triggered, RunState.COMPLETED, now=T0 + sec(11))
    assert row(store, "d").next_due_at == T0 + sec(71)
    assert store.tick(entries, T0 + sec(12), RNG, 100).emitted == []
    assert count(store, RunRow) == 2


def test_timestamps_come_back_as_aware_utc(store: Store) -> None:
    """Every stored time reads back timezone-aware in UTC, whatever zone it was written in."""
    from zoneinfo import ZoneInfo

    paris = T0.astimezone(ZoneInfo("Europe/Paris"))
    entries = setup(store, spec("a"), now=paris)
    a = row(store, "a")
    assert a.next_due_at == T0
    assert a.next_due_at.tzinfo is not None and a.next_due_at.utcoffset() == timedelta(0)
    run = store.run(emit_one(store, entries))
    assert run is not None and run.scheduled_for.utcoffset() == timedelta(0)
    with pytest.raises(StatementError, match="timezone-aware"):
        store.run_life.heartbeat("host:1", "host", 1, datetime(2030, 1, 1))


def test_config_rows_written_in_bulk_equal_a_schedule_added_alone(store: Store) -> None:
    """Bulk-inserted config rows (COPY on PostgreSQL) hold exactly what a single runtime add stores.

    Values that a text COPY must escape (tabs, newlines, backslashes, ``\\N``, quotes, non-ASCII,
    JSON nulls) come back unchanged, and the row differs from the runtime one only in name and origin.
    """
    from celery_boundedbeat.core.spec import Definition

    awkward: dict[str, Any] = {
        "args": ["a\tb", "line\nnext", "back\\slash", "\\N", None, 1.5, {"k": [None, "é✓"]}],
        "kwargs": {"quote": 'it\'s "x"', "empty": "", "none": None},
        "options": {"queue": "q\tq", "priority": 3},
        "policy": {"mode": "fixed_delay", "initial_delay": 7, "jitter": 2},
        "task": "proj.same",
    }
    config = Definition.of(spec("bulk", 30, **awkward), {"kind": "interval", "every": 30.0})
    single = Definition.of(spec("single", 30, **awkward), {"kind": "interval", "every": 30.0})
    store.sync_config([config], T0, random.Random(9))
    assert store.add_schedule(single, T0, random.Random(9))
    bulk_row, single_row = row(store, "bulk"), row(store, "single")
    # Each is a schedule of its own: its incarnation is its own too.
    apart = ("name", "origin", "config_hash", "incarnation", "slot")  # the slot hashes the name
    keys = [c.key for c in ScheduleRow.__table__.columns if c.key not in apart]
    assert {k: getattr(bulk_row, k) for k in keys} == {k: getattr(single_row, k) for k in keys}
    assert bulk_row.incarnation != single_row.incarnation
    assert (bulk_row.config_hash, single_row.config_hash) == (config.digest, single.digest)
    assert bulk_row.args == awkward["args"] and bulk_row.kwargs == awkward["kwargs"]
    assert (bulk_row.origin, single_row.origin) == ("config", "runtime")


def test_many_config_entries_are_inserted_in_one_reconcile(store: Store) -> None:
    """More entries than one insert chunk all land, each with its own first due time."""
    entries = [spec(f"e{i:04d}", 60, policy={"initial_delay": i}) for i in range(1234)]
    report = store.sync_config(entries, T0, RNG)
    assert len(report.added) == 1234
    rows = {r.name: r for r in store.schedules()}
    assert len(rows) == 1234
    assert all(rows[f"e{i:04d}"].next_due_at == T0 + sec(i) for i in range(1234))


def test_a_run_settled_before_its_publish_was_recorded_is_not_published_after_it(store: Store) -> None:
    """The dispatcher stamps published_at after the broker took the message; a fast worker may
    have started and finished the run by then: published_at is never later than that."""
    entries = setup(store, spec("fast"))
    run_id = emit_one(store, entries)
    claimed = store.claim_batch("d", T0, 10, 60)
    assert [c.run_id for c in claimed] == [run_id]
    assert start(store, run_id, T0 + sec(0.2))
    store.run_life.settle_run(run_id, RunState.COMPLETED, now=T0 + sec(0.3))
    store.mark_published("d", claimed, T0 + sec(0.5))
    with store.session() as s:
        run = s.get(RunRow, run_id)
        assert run is not None
        assert (run.published_at, run.started_at, run.finished_at) == (
            T0 + sec(0.2),
            T0 + sec(0.2),
            T0 + sec(0.3),
        )
