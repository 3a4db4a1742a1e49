"""Alert signals: each transition announced once, decided purely, stored with its change, sent once."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from helpers.clock import T0, sec
from sqlalchemy import Engine

from celery_boundedbeat import signals
from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.alerts import Alert, on_settled, on_ticked
from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.enums import AlertKind, RunState
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import ScheduleState, initial_state, on_resume, on_settle
from celery_boundedbeat.db.alertlog import record, take
from celery_boundedbeat.db.store import Store

RNG = random.Random(3)


class Schedule:
    """One schedule's state and ``failing_since`` driven through settles as the store does."""

    def __init__(self, threshold: int, **raw: Any) -> None:
        parsed, problems = parse_policy("job", raw)
        assert parsed is not None, problems
        self.policy: Policy = parsed
        self.threshold = threshold
        self.state = ScheduleState(grid_at=T0, next_due_at=T0)
        self.failing_since: datetime | None = None
        self.now = T0

    def settle(self, outcome: RunState, run_id: str = "r") -> list[AlertKind]:
        self.now += sec(10)
        self.state = on_settle(
            self.policy,
            ScheduleState(**{**{f: getattr(self.state, f) for f in self.state.__slots__}, "active_runs": 1}),
            outcome=outcome,
            elapsed_ms=1,
            now=self.now,
            stop=False,
            gap_s=10,
            rng=RNG,
            run_id=run_id,
        )
        decided = on_settled(
            schedule="job",
            run_id=run_id,
            outcome=outcome,
            error="boom" if outcome.counts_as_failure else None,
            streak=self.state.consecutive_failures,
            failing_since=self.failing_since,
            threshold=self.threshold,
            now=self.now,
        )
        self.failing_since = decided.failing_since
        return [a.kind for a in decided.alerts]


F, C = RunState.FAILED, RunState.COMPLETED


def test_failing_is_announced_once_when_the_streak_reaches_the_threshold() -> None:
    """With threshold 3: nothing for two failures, failing at the third, nothing for the fourth and fifth."""
    job = Schedule(threshold=3)
    assert [job.settle(F) for _ in range(5)] == [[], [], [AlertKind.FAILING], [], []]


def test_the_first_completed_run_after_failing_recovers_once() -> None:
    """Recovered comes with the first completed run after failing, never with the later ones."""
    job = Schedule(threshold=1)
    assert job.settle(F) == [AlertKind.FAILING]
    assert job.settle(C) == [AlertKind.RECOVERED]
    assert job.settle(C) == [] and job.failing_since is None
    assert job.settle(F) == [AlertKind.FAILING]  # a new spell is announced again


def test_a_streak_broken_below_the_threshold_announces_nothing() -> None:
    """Two failures, a success, two failures with threshold 3: never failing, never recovered."""
    job = Schedule(threshold=3)
    assert [job.settle(o) for o in (F, F, C, F, F, C)] == [[]] * 6


def test_revoked_and_rejected_runs_neither_count_nor_recover() -> None:
    """Revoked and rejected runs leave the streak and a failing spell as they are."""
    job = Schedule(threshold=2)
    assert job.settle(F) == []
    assert job.settle(RunState.REVOKED) == [] and job.settle(RunState.REJECTED) == []
    assert job.settle(F) == [AlertKind.FAILING]
    assert job.settle(RunState.REVOKED) == [] and job.failing_since is not None


def test_resume_resets_the_streak_but_the_spell_ends_only_with_a_completed_run() -> None:
    """After pause_on_failure and resume, more failures announce nothing new; the next success recovers."""
    job = Schedule(threshold=2, pause_on_failure=2)
    assert job.settle(F) == [] and job.settle(F) == [AlertKind.FAILING]
    assert job.state.pause_reason is not None
    job.state = on_resume(job.policy, job.state, job.now, period=10)
    assert job.state.consecutive_failures == 0
    assert job.settle(F) == [] and job.settle(F) == [] and job.settle(F) == []
    assert job.settle(C) == [AlertKind.RECOVERED]


def test_every_lost_or_timed_out_run_is_its_own_alert() -> None:
    """run_lost and run_timed_out come for each such run; the threshold crossing adds failing once."""
    job = Schedule(threshold=2)
    assert job.settle(RunState.LOST) == [AlertKind.RUN_LOST]
    assert job.settle(RunState.TIMED_OUT) == [AlertKind.RUN_TIMED_OUT, AlertKind.FAILING]
    assert job.settle(RunState.LOST) == [AlertKind.RUN_LOST]


def test_failing_names_the_run_its_state_error_and_the_streak() -> None:
    """The failing alert carries the crossing run, its state and error, and the failures in a row."""
    decided = on_settled(
        schedule="job",
        run_id="r9",
        outcome=RunState.LOST,
        error="worker heartbeat stopped",
        streak=4,
        failing_since=None,
        threshold=4,
        now=T0,
    )
    failing = decided.alerts[-1]
    assert (failing.kind, failing.run_id, failing.state, failing.count, failing.error, failing.at) == (
        AlertKind.FAILING,
        "r9",
        RunState.LOST,
        4,
        "worker heartbeat stopped",
        T0,
    )
    assert decided.failing_since == T0


def test_ticks_dropped_comes_only_from_ticks_that_dropped_and_says_how_many() -> None:
    """A busy skip schedule: the tick at 10 s drops 1, a late one at 35 s drops 2, the first none."""
    parsed, _ = parse_policy("job", {})
    assert parsed is not None
    timing = _spec("job").timing
    state = initial_state(parsed, timing, T0, RNG)
    first = on_due(parsed, timing, state, T0, RNG)  # starts a run at T0
    assert on_ticked({"job": first}, T0) == []
    busy = on_due(parsed, timing, first.state, T0 + sec(10), RNG)
    assert [(a.kind, a.count) for a in on_ticked({"job": busy}, T0 + sec(10))] == [
        (AlertKind.TICKS_DROPPED, 1)
    ]
    late = on_due(parsed, timing, busy.state, T0 + sec(35), RNG)
    assert [a.count for a in on_ticked({"job": late}, T0 + sec(35))] == [2]
    assert late.state.skips == 3  # the counts announced are exactly what skips rose by


def _spec(name: str, **raw: Any) -> EntrySpec:
    built, problems = parse_entry(name, {"task": f"proj.{name}", "schedule": 10, **raw}, {})
    assert built is not None, problems
    return built


# -- the signals ---------------------------------------------------------------------------


@pytest.fixture
def received() -> Iterator[list[tuple[str, Any, dict[str, Any]]]]:
    """Every boundedbeat signal received while the test runs: (signal name, sender, arguments)."""
    got: list[tuple[str, Any, dict[str, Any]]] = []

    def receiver(signal: Any, sender: Any, **named: Any) -> None:
        got.append((signal.name, sender, named))

    sigs = (
        signals.schedule_failing,
        signals.schedule_recovered,
        signals.ticks_dropped,
        signals.run_lost,
        signals.run_timed_out,
    )
    for sig in sigs:
        sig.connect(receiver, weak=False)
    try:
        yield got
    finally:
        for sig in sigs:
            sig.disconnect(receiver)


def test_each_signal_passes_the_documented_arguments_with_the_schedule_as_sender(
    received: list[tuple[str, Any, dict[str, Any]]],
) -> None:
    """send() maps every alert kind to its signal and the keyword arguments the module documents."""
    signals.send(
        [
            Alert(kind=AlertKind.FAILING, schedule="a", at=T0, run_id="r1", state=F, count=3, error="e"),
            Alert(kind=AlertKind.RECOVERED, schedule="a", at=T0, run_id="r2", state=C, since=T0 - sec(5)),
            Alert(kind=AlertKind.TICKS_DROPPED, schedule="b", at=T0, count=2),
            Alert(kind=AlertKind.RUN_LOST, schedule="c", at=T0, run_id="r3", state=RunState.LOST, error="x"),
            Alert(kind=AlertKind.RUN_TIMED_OUT, schedule="c", at=T0, run_id="r4", state=RunState.TIMED_OUT),
        ]
    )
    assert received == [
        (
            "schedule_failing",
            "a",
            {"schedule": "a", "at": T0, "run_id": "r1", "state": "failed", "error": "e", "failures": 3},
        ),
        ("schedule_recovered", "a", {"schedule": "a", "at": T0, "run_id": "r2", "since": T0 - sec(5)}),
        ("ticks_dropped", "b", {"schedule": "b", "at": T0, "count": 2}),
        ("run_lost", "c", {"schedule": "c", "at": T0, "run_id": "r3", "state": "lost", "error": "x"}),
        (
            "run_timed_out",
            "c",
            {"schedule": "c", "at": T0, "run_id": "r4", "state": "timed_out", "error": None},
        ),
    ]


def test_a_receiver_can_listen_to_one_schedule_and_a_raising_one_stops_nobody() -> None:
    """connect(sender=name) filters by schedule name; a receiver that raises leaves the others called."""
    got: list[str] = []

    def only_b(sender: Any, **named: Any) -> None:
        got.append(sender)

    def broken(sender: Any, **named: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.ticks_dropped.connect(broken, weak=False)
    signals.ticks_dropped.connect(only_b, sender="b", weak=False)
    try:
        signals.send([Alert(kind=AlertKind.TICKS_DROPPED, schedule=n, at=T0, count=1) for n in "abab"])
    finally:
        signals.ticks_dropped.disconnect(broken)
        signals.ticks_dropped.disconnect(only_b, sender="b")
    assert got == ["b", "b"]


# -- stored with the change, taken out once (SQLite and PostgreSQL) -------------------------


@pytest.fixture
def store(migrated: Engine) -> Store:
    return Store(migrated, failing_threshold=2)


def _run(store: Store, entries: dict[str, EntrySpec], now: datetime) -> str:
    result = store.tick(entries, now, RNG, 100)
    assert len(result.emitted) == 1, result.emitted
    run_id = result.emitted[0].id
    assert store.run_life.start_run(run_id, worker="w", process="w:1", now=now, max_run_time=None)
    return run_id


def test_settles_store_each_transition_once_and_take_hands_each_out_once(store: Store) -> None:
    """Three failures then two successes with threshold 2: failing once, recovered once, nothing twice."""
    entries = {"job": _spec("job")}
    store.sync_config(entries.values(), T0, RNG)
    ids = []
    for i, outcome in enumerate((F, F, F, C, C)):
        now = T0 + sec(10 * i)
        run_id = _run(store, entries, now)
        ids.append(run_id)
        assert store.run_life.settle_run(
            run_id, outcome, now=now + sec(1), error="boom" if outcome is F else None
        )
    taken = store.take_alerts()
    assert [(a.kind, a.run_id, a.count) for a in taken] == [
        (AlertKind.FAILING, ids[1], 2),
        (AlertKind.RECOVERED, ids[3], None),
    ]
    assert taken[0].error == "boom" and taken[0].state is F and taken[0].at == T0 + sec(11)
    assert taken[1].since == T0 + sec(11)
    assert store.take_alerts() == []
    assert store.schedules(["job"])[0].failing_since is None


def test_a_settle_rolled_back_leaves_no_alert(store: Store) -> None:
    """A settle whose transaction rolls back writes neither its outcome nor its alert."""
    entries = {"job": _spec("job")}
    store.sync_config(entries.values(), T0, RNG)
    store.run_life.failing_threshold = 1
    run_id = _run(store, entries, T0)
    with pytest.raises(RuntimeError), store.session() as s:
        assert store.run_life.settle_in(s, run_id, F, now=T0 + sec(1), error="boom")
        raise RuntimeError("the transaction fails after the settle")
    assert store.take_alerts() == []
    assert store.run(run_id).state == "started"  # type: ignore[union-attr]


def test_the_reaper_announces_a_lost_run_and_the_failing_it_completes(store: Store) -> None:
    """Two runs lost to a dead worker: run_lost for each, failing with the second (threshold 2)."""
    entries = {"job": _spec("job")}
    store.sync_config(entries.values(), T0, RNG)
    lost = []
    for i in range(2):
        now = T0 + sec(20 * i)
        lost.append(_run(store, entries, now))
        assert store.run_life.reap(now + sec(11), heartbeat_interval=3, start_timeout=3600, rng=RNG)
    kinds = [(a.kind, a.run_id) for a in store.take_alerts()]
    assert kinds == [
        (AlertKind.RUN_LOST, lost[0]),
        (AlertKind.RUN_LOST, lost[1]),
        (AlertKind.FAILING, lost[1]),
    ]


def test_concurrent_takers_never_hand_out_one_alert_twice(store: Store) -> None:
    """Four threads taking alerts at once receive every one of 200 rows exactly once."""
    with store.session() as s:
        record(s, [Alert(kind=AlertKind.TICKS_DROPPED, schedule=f"s{i}", at=T0, count=i) for i in range(200)])
    got: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def taker() -> None:
        try:
            while True:
                batch = [a.count or 0 for a in take(store.engine, limit=7)]
                if not batch:
                    return
                with lock:
                    got.extend(batch)
        except BaseException as exc:  # a failure in a thread must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=taker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sorted(got) == list(range(200))


def test_sending_logs_in_words_never_a_signal_name_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """A failing schedule is a WARNING and a recovery an INFO line in words; the signal names
    (ticks_dropped, run_lost, ...) are DEBUG only: the tick and the reaper say those in words."""
    caplog.set_level("DEBUG", logger="celery_boundedbeat")
    signals.send(
        [
            Alert(kind=AlertKind.FAILING, schedule="a", at=T0, run_id="r1", state=F, count=3, error="e"),
            Alert(kind=AlertKind.RECOVERED, schedule="a", at=T0, run_id="r2", state=C, since=T0),
            Alert(kind=AlertKind.TICKS_DROPPED, schedule="b", at=T0, count=2),
            Alert(kind=AlertKind.RUN_LOST, schedule="c", at=T0, run_id="r3", state=RunState.LOST, error="x"),
        ]
    )
    above_debug = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelname != "DEBUG"]
    assert above_debug == [
        (
            "WARNING",
            "celery_boundedbeat: schedule 'a' is failing: 3 failure(s) in a row, the last run r1 failed",
        ),
        ("INFO", "celery_boundedbeat: schedule 'a' recovered: run r2 completed"),
    ]
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG"]
    assert "celery_boundedbeat: sending the ticks_dropped signal for 'b'" in debug
