"""Ending a schedule (``end_at``, ``max_runs``) in the pure tick state machine, with a fake clock.

``max_runs`` bounds the runs emitted from the grid (or fixed-delay due times); triggered runs
never count. ``end_at`` bounds their ``scheduled_for``: no grid run after it is emitted, and
ticks after it are neither run nor skipped. The schedule stops emitting once its last allowed
run is emitted and shows ``stopped`` with its ``stop_reason`` once nothing of it is active;
``resume`` refuses it, a later end or a higher bound (``on_config_change``) revives it.
"""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab
from helpers.beats import EndingBeat
from helpers.clock import T0, sec

from celery_boundedbeat.config.entries import timing_for
from celery_boundedbeat.core.due import on_due
from celery_boundedbeat.core.enums import Mode, StopReason
from celery_boundedbeat.core.policy import Policy, parse_policy
from celery_boundedbeat.core.spec import EntrySpec
from celery_boundedbeat.core.ticks import (
    ScheduleState,
    Triggered,
    TriggerRefused,
    on_config_change,
    on_resume,
    resume_refusal,
)
from celery_boundedbeat.core.timing import IntervalTiming, Timing


def parse(raw: dict[str, Any], *, kind: str = "interval") -> Policy:
    policy, problems = parse_policy("entry", raw, schedule_kind=kind)
    assert problems == [] and policy is not None, problems
    return policy


def interval_spec(raw: dict[str, Any], period: float = 10) -> EntrySpec:
    return EntrySpec(
        name="entry",
        task="proj.task",
        policy=parse(raw),
        timing=IntervalTiming(period),
        schedule_repr=f"every {period:g}s",
        period=period,
    )


def cron_timing(cron: crontab, zone: str = "UTC") -> Timing:
    timing, kind, _repr, _period, problems = timing_for("entry", cron, ZoneInfo(zone))
    assert problems == [] and kind == "crontab" and timing is not None, problems
    return timing


def times(*seconds: float) -> list[datetime]:
    return [T0 + sec(s) for s in seconds]


# -- max_runs ----------------------------------------------------------------------------


def test_max_runs_ends_a_no_overlap_schedule_after_its_last_run_settles() -> None:
    """With max_runs 2 the second run ends the schedule; it shows stopped (max_runs) once that run settles."""
    beat = EndingBeat(parse({"max_runs": 2}), IntervalTiming(10))
    assert [e.scheduled_for for e in beat.at(0)] == times(0)
    beat.finish()
    assert not beat.state.ended and beat.state.grid_runs == 1
    assert [e.scheduled_for for e in beat.at(10)] == times(10)
    assert (beat.state.grid_runs, beat.state.stop_reason, beat.state.stopped) == (
        2,
        StopReason.MAX_RUNS,
        False,
    )
    assert beat.state.next_due_at is None
    assert beat.at(20) == [] and beat.at(30) == []
    beat.finish()
    assert (beat.state.stopped, beat.state.stop_reason, beat.state.next_due_at) == (
        True,
        StopReason.MAX_RUNS,
        None,
    )
    assert (beat.state.runs, beat.state.skips, beat.state.grid_runs) == (2, 0, 2)
    assert beat.at(100) == [] and beat.grid_times() == times(0, 10)


def test_max_runs_caps_several_fixed_rate_runs_started_in_one_tick() -> None:
    """A late fixed_rate tick passing 5 ticks with 3 free slots and max_runs 2 starts exactly 2, then ends."""
    beat = EndingBeat(parse({"mode": "fixed_rate", "max_concurrency": 3, "max_runs": 2}), IntervalTiming(10))
    emitted = beat.at(45)  # ticks 0, 10, 20, 30 and 40 passed
    assert [e.scheduled_for for e in emitted] == times(30, 40)
    assert (beat.state.active_runs, beat.state.grid_runs, beat.state.skips) == (2, 2, 3)
    assert beat.state.stop_reason is StopReason.MAX_RUNS and not beat.state.stopped
    assert beat.at(50) == []
    beat.finish()
    assert not beat.state.stopped, "one run is still active"
    beat.finish()
    assert beat.state.stopped and beat.state.stop_reason is StopReason.MAX_RUNS


def test_max_runs_counts_fixed_rate_runs_across_ticks_and_overlaps() -> None:
    """fixed_rate, max_concurrency 3, max_runs 4: a run per tick while slots are free; the 4th run ends it."""
    beat = EndingBeat(parse({"mode": "fixed_rate", "max_concurrency": 3, "max_runs": 4}), IntervalTiming(10))
    for second in (0, 10, 20):
        assert len(beat.at(second)) == 1
    assert beat.at(30) == [] and beat.state.skips == 1  # three active: the tick at 30 is skipped
    beat.finish()
    assert [e.scheduled_for for e in beat.at(40)] == times(40)
    assert beat.state.stop_reason is StopReason.MAX_RUNS
    assert beat.grid_times() == times(0, 10, 20, 40) and beat.state.grid_runs == 4
    while beat.active:
        assert not beat.state.stopped
        beat.finish()
    assert beat.state.stopped and beat.at(1000) == []


def test_catch_up_pending_ticks_count_when_they_start_and_are_skipped_when_the_end_comes() -> None:
    """Pending catch_up ticks count toward max_runs as they start; those left at the end are skips."""
    beat = EndingBeat(
        parse({"missed_ticks": "catch_up", "max_pending": 3, "max_runs": 3}), IntervalTiming(10)
    )
    beat.at(0)
    for second in (10, 20, 30):
        assert beat.at(second) == []
    assert beat.state.pending == tuple(times(10, 20, 30)) and beat.state.grid_runs == 1
    beat.finish()
    assert [e.scheduled_for for e in beat.at(31)] == times(10)  # a pending tick, counted now
    assert beat.state.grid_runs == 2 and not beat.state.ended
    beat.finish()
    assert [e.scheduled_for for e in beat.at(32)] == times(20)
    # The third run was the last one: the pending tick at 30 can never start.
    assert (beat.state.grid_runs, beat.state.stop_reason) == (3, StopReason.MAX_RUNS)
    assert (beat.state.pending, beat.state.skips) == ((), 1)
    beat.finish()
    assert beat.state.stopped and beat.state.waiting_runs == 0
    # Every tick that passed is exactly one of: run, skipped (0, 10, 20 ran; 30 skipped).
    assert len(beat.emitted) + beat.state.skips == 4


def test_catch_up_backlog_found_late_starts_only_what_max_runs_allows() -> None:
    """A late catch_up tick on a fixed_rate schedule starts max_runs runs and drops the rest as skips."""
    raw = {
        "mode": "fixed_rate",
        "max_concurrency": 2,
        "missed_ticks": "catch_up",
        "max_pending": 5,
        "max_runs": 3,
    }
    beat = EndingBeat(parse(raw), IntervalTiming(10))
    emitted = beat.at(55)  # ticks 0..50: six passed, two slots
    assert [e.scheduled_for for e in emitted] == times(0, 10)
    assert beat.state.pending == tuple(times(20, 30, 40, 50)) and not beat.state.ended
    beat.finish()
    assert [e.scheduled_for for e in beat.at(56)] == times(20)
    assert beat.state.stop_reason is StopReason.MAX_RUNS
    assert (beat.state.pending, beat.state.skips, beat.state.grid_runs) == ((), 3, 3)


def test_max_runs_ends_a_fixed_delay_schedule() -> None:
    """A fixed_delay schedule with max_runs 2 runs twice, then shows stopped (max_runs), never due again."""
    beat = EndingBeat(parse({"mode": "fixed_delay", "max_runs": 2}), IntervalTiming(10))
    assert len(beat.at(0)) == 1
    beat.at(4)
    beat.finish()
    assert beat.state.next_due_at == T0 + sec(14) and not beat.state.ended
    assert [e.scheduled_for for e in beat.at(14)] == times(14)
    assert beat.state.stop_reason is StopReason.MAX_RUNS and beat.state.next_due_at is None
    beat.at(20)
    beat.finish()
    assert (beat.state.stopped, beat.state.next_due_at, beat.state.runs) == (True, None, 2)
    assert beat.at(1000) == []


# -- end_at ------------------------------------------------------------------------------


def test_end_at_on_an_interval_grid_runs_the_tick_at_the_end_and_nothing_after() -> None:
    """end_at at T0+25 s on a 10 s grid runs 0, 10 and 20; the run at 20 ends the schedule."""
    beat = EndingBeat(parse({"end_at": T0 + sec(25)}), IntervalTiming(10))
    for second in (0, 10):
        beat.at(second)
        beat.finish()
        assert not beat.state.ended
    beat.at(20)
    assert beat.state.stop_reason is StopReason.END_AT and not beat.state.stopped
    assert beat.at(30) == []
    beat.finish()
    assert beat.state.stopped and beat.state.stop_reason is StopReason.END_AT
    assert beat.grid_times() == times(0, 10, 20) and beat.state.skips == 0


def test_a_tick_exactly_at_end_at_is_run() -> None:
    """A grid tick at end_at itself is not after it: it runs and is the last."""
    beat = EndingBeat(parse({"end_at": T0 + sec(20)}), IntervalTiming(10))
    for second in (0, 10, 20):
        beat.at(second)
        beat.finish()
    assert beat.grid_times() == times(0, 10, 20)
    assert beat.state.stopped and beat.state.stop_reason is StopReason.END_AT


def test_ticks_after_end_at_found_late_are_neither_run_nor_skipped() -> None:
    """A beat back after end_at runs the last tick before the end, skips earlier ones, ignores later ones."""
    beat = EndingBeat(parse({"end_at": T0 + sec(35)}), IntervalTiming(10))
    beat.at(0)
    beat.finish()
    emitted = beat.at(95)  # ticks 10..90 passed; only 10, 20 and 30 are before the end
    assert [e.scheduled_for for e in emitted] == times(30)
    assert beat.state.skips == 2, "the ticks at 10 and 20 are skips; 40..90 are past the end"
    assert beat.state.stop_reason is StopReason.END_AT
    beat.finish()
    assert beat.state.stopped and beat.state.skips == 2


def test_busy_ticks_before_end_at_are_skips_and_the_ones_after_are_not_counted() -> None:
    """A long run spanning end_at: ticks it blocks before the end are skips, none after the end is counted."""
    beat = EndingBeat(parse({"end_at": T0 + sec(25)}), IntervalTiming(10))
    beat.at(0)
    assert beat.at(10) == [] and beat.at(20) == []
    assert beat.state.skips == 2 and beat.state.stop_reason is StopReason.END_AT
    assert beat.at(30) == [] and beat.at(40) == []
    beat.finish()
    assert beat.state.stopped and beat.state.skips == 2 and beat.grid_times() == times(0)


def test_end_at_on_a_crontab_grid_in_another_time_zone() -> None:
    """An hourly 9-12 o'clock Europe/Berlin crontab ending 11:00 local time runs 9, 10 and 11, then stops."""
    berlin = ZoneInfo("Europe/Berlin")
    start = datetime(2030, 6, 3, 8, 30, tzinfo=berlin)
    local = [datetime(2030, 6, 3, hour, tzinfo=berlin) for hour in (9, 10, 11)]
    timing = cron_timing(crontab(minute=0, hour="9-12"), "Europe/Berlin")
    end_at = datetime(2030, 6, 3, 11, tzinfo=berlin)
    beat = EndingBeat(parse({"end_at": end_at}, kind="crontab"), timing, gap_s=3600, now=start)
    assert beat.state.grid_at == local[0].astimezone(UTC) == datetime(2030, 6, 3, 7, tzinfo=UTC)
    for tick in local:
        beat.now = tick
        assert len(beat.look()) == 1
        beat.finish()
    assert beat.state.stopped and beat.state.stop_reason is StopReason.END_AT
    assert beat.grid_times() == [t.astimezone(UTC) for t in local]
    beat.now = datetime(2030, 6, 4, 12, tzinfo=berlin)
    assert beat.look() == [] and beat.state.skips == 0


def test_a_late_crontab_tick_after_end_at_counts_only_the_ticks_before_the_end() -> None:
    """A crontab beat back after end_at runs the last tick before the end; later ticks are not skips."""
    start = datetime(2030, 6, 3, 10, 0, tzinfo=UTC)
    timing = cron_timing(crontab(minute="*/15"))
    beat = EndingBeat(
        parse({"end_at": start + timedelta(minutes=40)}, kind="crontab"), timing, gap_s=900, now=start
    )
    beat.look()
    beat.finish()
    beat.now = start + timedelta(minutes=100)  # 10:15 .. 11:30 passed; 10:15 and 10:30 before the end
    emitted = beat.look()
    assert [e.scheduled_for for e in emitted] == [start + timedelta(minutes=30)]
    assert beat.state.skips == 1 and beat.state.stop_reason is StopReason.END_AT


def test_end_at_in_the_past_at_creation_emits_nothing_and_stops() -> None:
    """A schedule created after its end_at emits no run and shows stopped (end_at) at its first look."""
    beat = EndingBeat(parse({"end_at": T0 - sec(1)}), IntervalTiming(10))
    assert beat.look() == []
    assert (beat.state.stopped, beat.state.stop_reason, beat.state.next_due_at) == (
        True,
        StopReason.END_AT,
        None,
    )
    assert (beat.state.grid_runs, beat.state.skips) == (0, 0)


def test_end_at_in_the_past_at_creation_of_a_fixed_delay_schedule_emits_nothing() -> None:
    """A fixed_delay schedule whose end_at already passed emits nothing and shows stopped (end_at)."""
    beat = EndingBeat(parse({"mode": "fixed_delay", "end_at": T0 - sec(1)}), IntervalTiming(10))
    assert beat.look() == []
    assert (beat.state.stopped, beat.state.stop_reason) == (True, StopReason.END_AT)


def test_end_at_ends_a_fixed_delay_schedule_when_its_next_due_time_is_past_the_end() -> None:
    """fixed_delay with end_at: the settle that would make it due after the end stops it instead."""
    beat = EndingBeat(parse({"mode": "fixed_delay", "end_at": T0 + sec(20)}), IntervalTiming(10))
    beat.at(0)
    beat.at(5)
    beat.finish()  # next due at 15: before the end
    assert beat.state.next_due_at == T0 + sec(15) and not beat.state.ended
    assert [e.scheduled_for for e in beat.at(15)] == times(15)
    beat.at(16)
    beat.finish()  # next due at 26: after the end
    final = beat.state
    assert (final.stopped, final.stop_reason, final.next_due_at) == (
        True,
        StopReason.END_AT,
        None,
    )
    assert beat.at(1000) == [] and beat.grid_times() == times(0, 15)


# -- triggers, resume ------------------------------------------------------------------------


def test_triggered_runs_do_not_count_toward_max_runs() -> None:
    """A triggered run between grid runs leaves max_runs 2 room for two grid runs."""
    beat = EndingBeat(parse({"max_runs": 2}), IntervalTiming(10))
    beat.at(0)
    beat.finish()
    beat.now = T0 + sec(3)
    assert isinstance(beat.trigger(), Triggered)
    assert [(e.scheduled_for, e.triggered) for e in beat.look()] == [(T0 + sec(3), True)]
    assert beat.state.grid_runs == 1
    beat.finish()
    assert beat.at(10) != [] and beat.state.stop_reason is StopReason.MAX_RUNS
    assert beat.grid_times() == times(0, 10) and len(beat.emitted) == 3


def test_a_trigger_queued_before_the_end_still_runs_and_the_schedule_stops_after_it() -> None:
    """A trigger waiting for a slot when end_at ends the schedule still runs; stopped comes after it."""
    beat = EndingBeat(parse({"end_at": T0 + sec(15)}), IntervalTiming(10))
    beat.at(0)
    beat.now = T0 + sec(1)
    assert isinstance(beat.trigger(), Triggered)
    assert beat.look() == []  # the run of 0 is still active
    assert beat.at(10) == []  # busy: the tick at 10 is skipped, and the next one is past the end
    assert beat.state.stop_reason is StopReason.END_AT and beat.state.skips == 1
    beat.now = T0 + sec(12)
    beat.finish()
    assert not beat.state.stopped, "a queued trigger is still waiting"
    assert [(e.scheduled_for, e.triggered) for e in beat.look()] == [(T0 + sec(1), True)]
    beat.finish()
    assert beat.state.stopped and beat.state.stop_reason is StopReason.END_AT
    assert (beat.state.grid_runs, beat.state.runs, beat.state.triggers) == (1, 2, ())


@pytest.mark.parametrize("still_active", [True, False])
def test_a_trigger_on_an_ended_schedule_is_refused(still_active: bool) -> None:
    """Once ended (whether or not its last run still runs), a trigger is refused naming the end."""
    beat = EndingBeat(parse({"max_runs": 1}), IntervalTiming(10))
    beat.at(0)
    if not still_active:
        beat.finish()
    before = beat.state
    decided = beat.trigger()
    assert isinstance(decided, TriggerRefused), decided
    assert "ended" in decided.reason and "max_runs" in decided.reason
    assert beat.state == before


def test_resume_refuses_an_ended_schedule() -> None:
    """resume_refusal names the end of a schedule max_runs or end_at ended."""
    for raw, reason in (({"max_runs": 1}, "max_runs"), ({"end_at": T0 + sec(5)}, "end_at")):
        beat = EndingBeat(parse(raw), IntervalTiming(10))
        beat.at(0)
        beat.finish()
        assert beat.state.stopped
        refusal = resume_refusal(beat.state)
        assert refusal is not None and reason in refusal and "update_schedule" in refusal


def test_resume_after_stop_schedule_is_allowed_and_clears_the_reason() -> None:
    """A schedule stopped by stop_schedule() resumes; stop_reason is cleared and it runs again on its grid."""
    beat = EndingBeat(parse({"max_runs": 5}), IntervalTiming(10))
    beat.at(0)
    beat.finish(stop=True)
    assert (beat.state.stopped, beat.state.stop_reason) == (True, StopReason.STOP_SCHEDULE)
    assert resume_refusal(beat.state) is None
    beat.now = T0 + sec(25)
    beat.state = on_resume(beat.policy, beat.state, beat.now, period=10)
    assert (beat.state.stopped, beat.state.stop_reason, beat.state.next_due_at) == (False, None, T0 + sec(30))
    assert [e.scheduled_for for e in beat.at(30)] == times(30)
    assert beat.state.grid_runs == 2


def test_stop_schedule_in_the_last_run_keeps_the_ended_reason() -> None:
    """stop_schedule() in the last run max_runs allows keeps stop_reason max_runs (resume refuses)."""
    beat = EndingBeat(parse({"max_runs": 1}), IntervalTiming(10))
    beat.at(0)
    beat.finish(stop=True)
    assert (beat.state.stopped, beat.state.stop_reason) == (True, StopReason.MAX_RUNS)
    assert resume_refusal(beat.state) is not None


# -- reviving with a new end -----------------------------------------------------------------


def ended_after(raw: dict[str, Any], seconds: tuple[float, ...]) -> EndingBeat:
    beat = EndingBeat(parse(raw), IntervalTiming(10))
    for second in seconds:
        beat.at(second)
        beat.finish()
    assert beat.state.stopped and beat.state.ended
    return beat


def change(beat: EndingBeat, raw: dict[str, Any], now: datetime, *, period: float = 10) -> ScheduleState:
    """What ``update_schedule`` does: the changed definition applied with ``on_config_change``."""
    spec = interval_spec(raw, period)
    newest = max(e.scheduled_for for e in beat.emitted)
    state = on_config_change(
        spec,
        beat.state,
        config_changed=True,
        old_schedule="every 10s",
        old_mode=Mode.FIXED_RATE_NO_OVERLAP,
        now=now,
        rng=random.Random(0),
        last_run_at=newest,
    )
    beat.policy = spec.policy
    beat.timing = spec.timing
    beat.state = state
    return state


def test_a_higher_max_runs_revives_an_ended_schedule_from_the_change_on() -> None:
    """Raising max_runs 2 -> 4 revives it: the grid restarts at the change, two more runs, counters kept."""
    beat = ended_after({"max_runs": 2}, (0, 10))
    new = change(beat, {"max_runs": 4}, T0 + sec(47))
    assert (new.stopped, new.stop_reason, new.grid_at, new.next_due_at) == (
        False,
        None,
        T0 + sec(47),
        T0 + sec(47),
    )
    assert (new.runs, new.grid_runs) == (2, 2)
    assert resume_refusal(new) is None
    beat.at(47)
    beat.finish()
    beat.at(57)
    beat.finish()
    assert beat.grid_times() == times(0, 10, 47, 57)
    assert beat.state.stopped and beat.state.stop_reason is StopReason.MAX_RUNS and beat.state.runs == 4


def test_a_later_end_at_revives_an_ended_schedule() -> None:
    """Moving end_at past now revives an end_at-ended schedule; it runs from the change up to the new end."""
    beat = ended_after({"end_at": T0 + sec(15)}, (0, 10))
    new = change(beat, {"end_at": T0 + sec(75)}, T0 + sec(50))
    assert (new.stopped, new.stop_reason, new.next_due_at) == (False, None, T0 + sec(50))
    for second in (50, 60, 70):
        assert len(beat.at(second)) == 1
        beat.finish()
    assert beat.grid_times() == times(0, 10, 50, 60, 70)
    assert beat.state.stopped and beat.state.stop_reason is StopReason.END_AT


@pytest.mark.parametrize(
    ("raw", "new_raw"),
    [
        ({"max_runs": 2}, {"max_runs": 2, "jitter": 0.5}),  # another change, the bound still reached
        ({"max_runs": 2}, {"max_runs": 1}),
        ({"end_at": T0 + sec(15)}, {"end_at": T0 + sec(40)}),  # later, but still before the change
        ({"end_at": T0 + sec(15)}, {"end_at": T0 + sec(90), "max_runs": 2}),  # max_runs reached
    ],
)
def test_a_change_that_leaves_the_bound_reached_does_not_revive(
    raw: dict[str, Any], new_raw: dict[str, Any]
) -> None:
    """A changed policy whose end is still reached leaves it stopped with its reason; nothing runs."""
    beat = ended_after(raw, (0, 10))
    reason = beat.state.stop_reason
    new = change(beat, new_raw, T0 + sec(50))
    assert new.stopped and new.ended and new.stop_reason is reason
    assert resume_refusal(new) is not None
    beat.now = T0 + sec(1000)
    assert on_due(beat.policy, beat.timing, replace(new, next_due_at=beat.now), beat.now, beat.rng).emit == ()


def test_removing_the_bounds_revives_an_ended_schedule() -> None:
    """Dropping max_runs (None) revives a max_runs-ended schedule from the change on."""
    beat = ended_after({"max_runs": 1}, (0,))
    new = change(beat, {}, T0 + sec(33))
    assert (new.stopped, new.stop_reason, new.next_due_at) == (False, None, T0 + sec(33))
    assert len(beat.at(33)) == 1
