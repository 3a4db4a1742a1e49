"""Test your schedules before you deploy them: a pytest plugin and :func:`simulate`.

``simulate(entry, hours=24, task_seconds=...)`` answers "what will my policy do with a task
this slow?" without a broker, a database or a clock: the entry is validated exactly as beat
validates it (the same :class:`~celery_boundedbeat.ConfigurationError` texts), then the
package's own tick functions (:func:`~celery_boundedbeat.core.ticks.first_state`,
:func:`~celery_boundedbeat.core.ticks.on_due`, :func:`~celery_boundedbeat.core.ticks.on_settle`, the
very calls the beat's store makes) are driven on a fake clock. Nothing about the policy is
re-implemented here: this module only keeps the clock, starts each emitted run at once (an
idle worker) and finishes it ``task_seconds`` later, and writes down what happened to every
tick, so a user's test can assert on it.

Installed with the package, pytest loads this module as the plugin ``boundedbeat`` (entry
point ``pytest11``). Its fixture :func:`boundedbeat_simulate` is :func:`simulate` bound to the
``celery_app`` fixture of Celery's classic in-process test plugin (``celery.contrib.pytest``,
which pytest-celery also ships), so ``celery_config`` settings such as
``boundedbeat_default_policy`` and ``timezone`` apply as they would in beat. The classic plugin
is loaded if nothing provides it yet, so ``-p no:celery -p celery.contrib.pytest`` (the
in-process fixtures instead of pytest-celery's container ones) keeps working.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

import celery
import pytest

from .config.entries import validate_entries
from .config.settings import Settings
from .core.due import on_due
from .core.enums import Mode, RunState
from .core.spec import EntrySpec
from .core.ticks import ScheduleState, TickOutcome, first_state, on_settle

__all__ = ["DEFAULT_START", "EventKind", "Timeline", "TimelineEvent", "boundedbeat_simulate", "simulate"]

#: Where the fake clock starts unless ``start=`` says otherwise: a Monday, midnight UTC (fixed,
#: so a timeline is the same on every machine and every day).
DEFAULT_START = datetime(2025, 1, 6, tzinfo=UTC)

#: ``task_seconds``: one duration for every run, durations used in turn, or ``f(run_index)``.
TaskSeconds = float | Sequence[float] | Callable[[int], float]


class EventKind(StrEnum):
    """What happened to one tick of the schedule (a grid tick, or a fixed-delay due time)."""

    #: A run was emitted; it started at once and finished ``task_seconds`` later.
    RUN = "run"
    #: Dropped: every slot was busy and ``missed_ticks`` kept no room for it (``skip``, a full
    #: ``catch_up``), or it was still pending when the schedule ended. Counted in ``skips``.
    SKIPPED = "skipped"
    #: Replaced by a later tick under ``coalesce_latest`` (only the latest missed tick waits).
    #: Counted in ``skips`` as well.
    COALESCED = "coalesced"
    #: Still waiting for a slot when the simulation ended (neither run nor dropped yet).
    PENDING = "pending"


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineEvent:
    """One tick and its fate; times are aware UTC datetimes on the fake clock."""

    kind: EventKind
    #: The grid time the tick belongs to (a run's ``scheduled_for``); fixed delay: its due time.
    scheduled_for: datetime
    #: When the beat dealt with it: the run's start, or the moment the tick was dropped
    #: (for ``pending``: the end of the simulation).
    at: datetime
    #: A run's start and finish (``None`` for the other kinds). The finish may lie past the end.
    start: datetime | None = None
    finish: datetime | None = None
    #: Whether another run of the schedule was active when this one started (``fixed_rate``).
    overlap: bool = False
    #: A run revoked by a newer tick (``missed_ticks: "replace"``): ``finish`` is when.
    revoked: bool = False

    @property
    def drift(self) -> timedelta:
        """How late the tick was dealt with after its grid time (a run's ``drift_ms``)."""
        return self.at - self.scheduled_for


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """What :func:`simulate` saw: every tick in ``[start, end)`` and the schedule's counters.

    ``events`` are in ``scheduled_for`` order. Accounting holds as in beat: every tick is one
    event, and ``len(skipped) + len(coalesced) == skips``.
    """

    name: str
    start: datetime
    end: datetime
    events: tuple[TimelineEvent, ...]
    #: The schedule's counters at the end, as ``boundedbeat status`` would show them.
    skips: int
    overlaps: int
    #: Runs that finished before the end and were not revoked (each one ``completed``).
    completed: int

    def of_kind(self, kind: EventKind) -> tuple[TimelineEvent, ...]:
        """The events of one kind, in ``scheduled_for`` order."""
        return tuple(e for e in self.events if e.kind is kind)

    @property
    def runs(self) -> tuple[TimelineEvent, ...]:
        """The emitted runs (started within the simulated time)."""
        return self.of_kind(EventKind.RUN)

    @property
    def skipped(self) -> tuple[TimelineEvent, ...]:
        return self.of_kind(EventKind.SKIPPED)

    @property
    def coalesced(self) -> tuple[TimelineEvent, ...]:
        return self.of_kind(EventKind.COALESCED)

    @property
    def pending(self) -> tuple[TimelineEvent, ...]:
        return self.of_kind(EventKind.PENDING)

    def seconds(self, at: datetime) -> float:
        """``at`` as seconds after :attr:`start`: short numbers to compare in an assertion."""
        return (at - self.start).total_seconds()

    @property
    def max_active(self) -> int:
        """The most runs active at one instant (a run finishing frees its slot at that instant)."""
        edges = sorted(
            [(r.finish, -1) for r in self.runs if r.finish is not None]
            + [(r.start, 1) for r in self.runs if r.start is not None]
        )
        active = peak = 0
        for _, step in edges:
            active += step
            peak = max(peak, active)
        return peak

    def __str__(self) -> str:
        """One line per tick in seconds after the start, for an assertion message."""
        counts = ((len(self.runs), "run"), (self.skips, "skip"), (self.overlaps, "overlap"))
        lines = [f"{self.name}: " + ", ".join(f"{n} {word}{'' if n == 1 else 's'}" for n, word in counts)]
        for e in self.events:
            line = f"  {self.seconds(e.scheduled_for):>10.3f}  {e.kind.value:<9}"
            if e.start is not None and e.finish is not None:
                line += f"  start {self.seconds(e.start):.3f}  finish {self.seconds(e.finish):.3f}"
            elif e.kind is not EventKind.PENDING:
                line += f"  at {self.seconds(e.at):.3f}"
            lines.append(line + ("  overlap" if e.overlap else ""))
        return "\n".join(lines)


def _durations(task_seconds: TaskSeconds) -> Callable[[int], float]:
    """``task_seconds`` as a function of the run's index (0 for the first run)."""
    if callable(task_seconds):
        return task_seconds
    if isinstance(task_seconds, int | float):
        value = float(task_seconds)
        return lambda _i: value
    values = [float(v) for v in task_seconds]
    if not values:
        raise ValueError("task_seconds: give at least one duration")
    return lambda i: values[i % len(values)]


def validated_spec(name: str, entry: Mapping[str, Any], app: celery.Celery | None = None) -> EntrySpec:
    """``entry`` validated as beat validates ``beat_schedule`` (the app's settings included).

    Raises :class:`~celery_boundedbeat.ConfigurationError` with beat's texts: a bad setting
    (``boundedbeat_default_policy``, ...) or every problem of the entry, naming entry and key.
    """
    app = app if app is not None else celery.current_app
    settings = Settings.from_conf(app.conf)
    return validate_entries({name: entry}, settings.default_policy)[name]


@dataclass(kw_only=True, slots=True)
class _Run:
    scheduled_for: datetime
    start: datetime
    finish: datetime
    overlap: bool
    revoked: bool = False


class _Clock:
    """The fake clock and the bookkeeping around the tick functions (no decision of its own).

    Each step settles the runs finished by ``now`` (``on_settle``, as the worker's report does),
    then, if the schedule is due, lets ``on_due`` decide, and records the fate of every tick
    that decision touched.
    """

    def __init__(
        self, spec: EntrySpec, start: datetime, rng: random.Random, durations: Callable[[int], float]
    ) -> None:
        self.spec = spec
        self.rng = rng
        self.durations = durations
        self.state: ScheduleState = first_state(spec, start, rng)
        self.active: list[_Run] = []
        self.runs: list[_Run] = []
        self.dropped: list[TimelineEvent] = []

    def settle_finished(self, now: datetime) -> None:
        for run in sorted((r for r in self.active if r.finish <= now), key=lambda r: r.finish):
            self.active.remove(run)
            self.state = on_settle(
                self.spec.policy,
                self.state,
                outcome=RunState.COMPLETED,
                elapsed_ms=int((run.finish - run.start).total_seconds() * 1000),
                now=run.finish,
                stop=False,
                gap_s=self.spec.period or 0.0,
                rng=self.rng,
            )

    def due(self, now: datetime) -> None:
        state = self.state
        if state.next_due_at is None or state.next_due_at > now:
            return
        outcome = on_due(self.spec.policy, self.spec.timing, state, now, self.rng, revocable=len(self.active))
        self.state = outcome.state
        self._revoke(outcome.revoke, now)
        self._record(state, outcome, now)

    def _revoke(self, count: int, now: datetime) -> None:
        """``replace``: the oldest active runs end now, revoked (their slots went to new runs)."""
        for run in sorted(self.active, key=lambda r: r.scheduled_for)[:count]:
            self.active.remove(run)
            run.finish = now
            run.revoked = True

    def _record(self, before: ScheduleState, outcome: TickOutcome, now: datetime) -> None:
        """Runs for the emissions; the ticks no longer pending nor run were dropped."""
        for emission in outcome.emit:
            duration = self.durations(len(self.runs))
            if duration < 0:
                raise ValueError(
                    f"task_seconds gave a negative duration for run {len(self.runs)}: {duration}"
                )
            run = _Run(
                scheduled_for=emission.scheduled_for,
                start=now,
                finish=now + timedelta(seconds=duration),
                overlap=emission.overlap,
            )
            self.runs.append(run)
            self.active.append(run)
        emitted = {e.scheduled_for for e in outcome.emit}
        kept = set(outcome.state.pending)
        kind = EventKind.COALESCED if outcome.coalesced else EventKind.SKIPPED
        for tick in [*before.pending, *self._ticks_passed(before, outcome, now)]:
            if tick not in emitted and tick not in kept:
                self.dropped.append(TimelineEvent(kind=kind, scheduled_for=tick, at=now))

    def _ticks_passed(self, before: ScheduleState, outcome: TickOutcome, now: datetime) -> Iterator[datetime]:
        """The ticks ``on_due`` counted (``outcome.ticks``), from the grid's own arithmetic."""
        if self.spec.policy.mode is Mode.FIXED_DELAY:
            if outcome.ticks and before.next_due_at is not None:
                yield before.next_due_at
            return
        if before.grid_at is None or before.grid_at > now:
            return
        _, tick_at, _ = self.spec.timing.passed(before.grid_at, now)
        for i in range(outcome.ticks):
            yield tick_at(i)

    def next_event(self, now: datetime) -> datetime | None:
        """The next instant anything can happen: a finish or the next due time."""
        times = [r.finish for r in self.active]
        if self.state.next_due_at is not None:
            times.append(max(self.state.next_due_at, now + timedelta(microseconds=1)))
        return min(times) if times else None


def simulate(
    entry: Mapping[str, Any],
    *,
    hours: float = 24,
    task_seconds: TaskSeconds = 1.0,
    start: datetime = DEFAULT_START,
    seed: int = 0,
    name: str = "simulated",
    app: celery.Celery | None = None,
) -> Timeline:
    """What beat would do with ``entry`` over ``hours``, each run taking ``task_seconds``.

    ``entry`` is a ``beat_schedule`` entry as you write it (``task``, ``schedule``, ``args``,
    ``kwargs``, ``options``, ``policy``), validated with ``app``'s settings (default: the
    current app) exactly as beat does. ``task_seconds`` is a number, a sequence of numbers used
    in turn, or a function of the run's index (0 for the first run). Workers are idle: a run
    starts the instant it is emitted and every run completes. ``seed`` seeds the jitter, as
    the only randomness. Ticks in ``[start, start + hours)`` are simulated.
    """
    if start.tzinfo is None:
        raise ValueError("start must be an aware datetime (the beat works in UTC)")
    spec = validated_spec(name, entry, app)
    end = start + timedelta(hours=hours)
    clock = _Clock(spec, start, random.Random(seed), _durations(task_seconds))
    now: datetime | None = start
    while now is not None and now < end:
        clock.settle_finished(now)
        clock.due(now)
        now = clock.next_event(now)
    runs = [
        TimelineEvent(
            kind=EventKind.RUN,
            scheduled_for=r.scheduled_for,
            at=r.start,
            start=r.start,
            finish=r.finish,
            overlap=r.overlap,
            revoked=r.revoked,
        )
        for r in clock.runs
    ]
    waiting = [TimelineEvent(kind=EventKind.PENDING, scheduled_for=t, at=end) for t in clock.state.pending]
    events = sorted([*runs, *clock.dropped, *waiting], key=lambda e: (e.scheduled_for, e.at))
    return Timeline(
        name=name,
        start=start,
        end=end,
        events=tuple(events),
        skips=clock.state.skips,
        overlaps=clock.state.overlaps,
        completed=sum(1 for r in clock.runs if r.finish < end and not r.revoked),
    )


# -- the pytest plugin (entry point ``boundedbeat``) -------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """Make sure ``celery_app`` exists: load Celery's in-process plugin unless something has.

    pytest-celery's own plugin (``celery``) re-exports it; ``-p celery.contrib.pytest`` loads it
    by name. Loading it a second time would register its fixtures twice, so only when neither did.
    """
    manager = config.pluginmanager
    if not (manager.has_plugin("celery") or manager.has_plugin("celery.contrib.pytest")):
        manager.import_plugin("celery.contrib.pytest")


@pytest.fixture
def boundedbeat_simulate(celery_app: celery.Celery) -> Callable[..., Timeline]:
    """:func:`simulate` validating with the ``celery_app`` fixture's settings (``celery_config``)."""

    def simulate_with_app(entry: Mapping[str, Any], **kwargs: Any) -> Timeline:
        kwargs.setdefault("app", celery_app)
        return simulate(entry, **kwargs)

    return simulate_with_app
