"""What a schedule entry may ask for: the policy value and its validation.

Pure: validation collects every problem (entry, key, reason) so one failed start shows the
user everything to fix; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from enum import Enum
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .enums import MissedTicks, Mode, RunState

POLICY_KEYS = frozenset(
    {
        "mode",
        "missed_ticks",
        "max_pending",
        "max_concurrency",
        "initial_delay",
        "max_run_time",
        "jitter",
        "end_at",
        "max_runs",
        "catchup_window",
        "pause_on_failure",
        "keep_runs",
        "keep_for",
        "timezone",
        "start_at",
        "retry",
    }
)
#: Retention keys, stored only when set: a schedule without them keeps the digest it had
#: before they existed, so an upgrade does not count every config schedule as changed.
RETENTION_KEYS = ("keep_runs", "keep_for")
#: Keys added after schedules were first stored, written only when set for the same reason as
#: the retention keys.
OPTIONAL_KEYS = (*RETENTION_KEYS, "timezone", "catchup_window", "start_at")

#: The outcomes ``retry.on`` may name: a run that ended without doing its work. ``completed``
#: and ``revoked`` (a person or the scheduler chose it) are never retried.
RETRYABLE = (RunState.LOST, RunState.TIMED_OUT, RunState.REJECTED, RunState.FAILED)
RETRY_KEYS = ("on", "max_attempts", "backoff", "max_backoff")


@dataclass(frozen=True, kw_only=True, slots=True)
class Retry:
    """The ``retry`` policy key: run a grid time again after its run ended in one of ``on``.

    ``failed`` is allowed but not the default: a task's own Celery retries come first, and a
    task that raised usually raises again; a lost or timed-out run says nothing about the task.
    """

    on: tuple[RunState, ...] = (RunState.LOST, RunState.TIMED_OUT)
    #: Attempts in all, the first run included (>= 2).
    max_attempts: int = 3
    #: Seconds before the second attempt; each later attempt waits twice the one before.
    backoff: float = 10.0
    #: The longest wait between attempts (seconds).
    max_backoff: float = 300.0

    def delay(self, attempt: int) -> timedelta:
        """The wait before the attempt after ``attempt`` (1 = the first run): doubling, capped."""
        return timedelta(seconds=min(self.backoff * 2 ** max(attempt - 1, 0), self.max_backoff))

    def wants(self, outcome: RunState, attempt: int) -> bool:
        """Whether a run that ended ``outcome`` as attempt ``attempt`` is attempted again."""
        return outcome in self.on and attempt < self.max_attempts

    def to_json(self) -> dict[str, Any]:
        return {
            "on": [state.value for state in self.on],
            "max_attempts": self.max_attempts,
            "backoff": self.backoff,
            "max_backoff": self.max_backoff,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Retry:
        return cls(
            on=tuple(RunState(state) for state in data["on"]),
            max_attempts=int(data["max_attempts"]),
            backoff=float(data["backoff"]),
            max_backoff=float(data["max_backoff"]),
        )


Problem = tuple[str, str, str]

_E = TypeVar("_E", bound=Enum)


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """A validated per-schedule policy (docs/policies.md)."""

    mode: Mode = Mode.FIXED_RATE_NO_OVERLAP
    missed_ticks: MissedTicks = MissedTicks.SKIP
    max_pending: int | None = None
    max_concurrency: int | None = None
    initial_delay: float = 0.0
    max_run_time: float | None = None
    jitter: float | None = None
    #: No grid run scheduled after this instant is emitted (aware UTC).
    end_at: datetime | None = None
    #: At most this many runs from the grid (triggers do not count).
    max_runs: int | None = None
    #: Grid ticks found more than this many seconds after their time are dropped, whatever
    #: ``missed_ticks`` says (``None``: every passed tick goes to ``missed_ticks``).
    catchup_window: float | None = None
    #: Pause after this many consecutive failed, timed-out or lost runs.
    pause_on_failure: int | None = None
    #: Retention: keep at most this many settled runs of the schedule in the history.
    keep_runs: int | None = None
    #: Retention: delete settled runs finished longer ago than this many seconds (instead of
    #: the global ``boundedbeat_retention_days``).
    keep_for: float | None = None
    #: The IANA zone a crontab keeps wall-clock time in; ``None``: the app's ``timezone``.
    timezone: str | None = None
    #: No grid run scheduled before this instant is emitted (aware UTC): an interval grid
    #: starts at it, a calendar skips its fire times before it.
    start_at: datetime | None = None
    #: Run a grid time again after a lost, timed-out (...) run, inside the concurrency bound.
    retry: Retry | None = None

    @property
    def limit(self) -> int:
        """How many runs of this schedule may be active at once."""
        if self.mode is Mode.FIXED_RATE:
            assert self.max_concurrency is not None
            return self.max_concurrency
        return 1

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with the contract's key names (optional keys only when set)."""
        data: dict[str, Any] = {
            "mode": self.mode.value,
            "missed_ticks": self.missed_ticks.value,
            "max_pending": self.max_pending,
            "max_concurrency": self.max_concurrency,
            "initial_delay": self.initial_delay,
            "max_run_time": self.max_run_time,
            "jitter": self.jitter,
            "end_at": None if self.end_at is None else self.end_at.isoformat(),
            "max_runs": self.max_runs,
            "pause_on_failure": self.pause_on_failure,
        }
        for key in OPTIONAL_KEYS:
            value = getattr(self, key)
            if value is not None:
                data[key] = value.isoformat() if isinstance(value, datetime) else value
        if self.retry is not None:
            data["retry"] = self.retry.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Policy:
        """Inverse of :meth:`to_json` for rows this package wrote itself."""
        return cls(
            mode=Mode(data["mode"]),
            missed_ticks=MissedTicks(data["missed_ticks"]),
            max_pending=data.get("max_pending"),
            max_concurrency=data.get("max_concurrency"),
            initial_delay=float(data.get("initial_delay") or 0.0),
            max_run_time=data.get("max_run_time"),
            jitter=data.get("jitter"),
            end_at=None if data.get("end_at") is None else datetime.fromisoformat(data["end_at"]),
            max_runs=data.get("max_runs"),
            catchup_window=data.get("catchup_window"),
            pause_on_failure=data.get("pause_on_failure"),
            keep_runs=data.get("keep_runs"),
            keep_for=data.get("keep_for"),
            timezone=data.get("timezone"),
            start_at=None if data.get("start_at") is None else datetime.fromisoformat(data["start_at"]),
            retry=None if data.get("retry") is None else Retry.from_json(data["retry"]),
        )

    @property
    def ends(self) -> bool:
        """Whether the schedule has an end (``end_at`` or ``max_runs``)."""
        return self.end_at is not None or self.max_runs is not None


def _seconds(value: Any) -> float | None:
    """Seconds from a number or timedelta; ``None`` when the type is wrong."""
    if isinstance(value, bool):
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return float(value)
    return None


@dataclass(slots=True)
class _Reader:
    """Reads the keys of one merged policy, collecting problems in the order they are found."""

    entry: str
    merged: Mapping[str, Any]
    problems: list[Problem] = field(default_factory=list)

    def problem(self, key: str, reason: str) -> None:
        self.problems.append((self.entry, key, reason))

    def choice(self, key: str, enum: type[_E], default: _E) -> _E | None:
        """One enum member by its contract string (``mode``, ``missed_ticks``)."""
        raw = self.merged.get(key, default.value)
        try:
            return enum(raw)
        except ValueError:
            known = ", ".join(m.value for m in enum)
            self.problem(f"policy.{key}", f"unknown {key} {raw!r} (use {known})")
            return None

    def positive_int(self, key: str) -> int | None:
        """A bound such as ``max_pending``: an int >= 1 (a bool is not an int here)."""
        value = self.merged.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(f"policy.{key}", f"must be an integer >= 1, got {value!r}")
            return None
        if value < 1:
            self.problem(f"policy.{key}", f"must be >= 1, got {value}")
            return None
        return value

    def instant(self, key: str) -> datetime | None:
        """An aware datetime, or an ISO 8601 string with a UTC offset (``end_at``)."""
        value = self.merged.get(key)
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value)
            except ValueError:
                self.problem(f"policy.{key}", f"must be an ISO 8601 time with a UTC offset, got {value!r}")
                return None
        if not isinstance(value, datetime):
            self.problem(f"policy.{key}", f"must be an aware datetime or ISO 8601 string, got {value!r}")
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            self.problem(f"policy.{key}", f"must carry a time zone (an aware datetime), got {value!r}")
            return None
        return value.astimezone(UTC)

    def duration(self, key: str, *, allow_zero: bool) -> float | None:
        """Seconds from a number or a timedelta, finite and not negative."""
        value = self.merged.get(key)
        if value is None:
            return None
        seconds = _seconds(value)
        if seconds is None:
            self.problem(f"policy.{key}", f"must be seconds (number) or a timedelta, got {value!r}")
            return None
        if seconds < 0 or (seconds == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            self.problem(f"policy.{key}", f"must be {bound} seconds, got {value!r}")
            return None
        return seconds

    def zone(self, key: str) -> str | None:
        """An IANA time zone name (or a zone object that has one), checked against the zone database."""
        value = self.merged.get(key)
        if value is None:
            return None
        if isinstance(value, tzinfo):  # a ZoneInfo (or a pytz zone) stands for its name
            value = getattr(value, "key", None) or getattr(value, "zone", None) or value
        if not isinstance(value, str):
            self.problem(
                f"policy.{key}", f"must be an IANA time zone name (such as 'Europe/Berlin'), got {value!r}"
            )
            return None
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            self.problem(
                f"policy.{key}", f"unknown time zone {value!r} (use an IANA name such as 'Europe/Berlin')"
            )
            return None
        return value


def _check_timezone(read: _Reader, own: Mapping[str, Any], kind: str) -> str | None:
    """A zone is for calendar schedules: an interval runs on elapsed time, not the wall clock.

    Only the entry's own key is refused on an interval; a ``timezone`` in the default policy
    is meant for the calendar schedules and does not apply to the others.
    """
    if kind == "interval" and own.get("timezone") is not None:
        read.problem(
            "policy.timezone",
            "is only for crontab and solar schedules (an interval runs on elapsed time, not the wall clock)",
        )
        return None
    zone = read.zone("timezone")  # a default's zone is checked even where it does not apply
    return zone if kind != "interval" else None


def _check_concurrency(read: _Reader, mode: Mode | None) -> None:
    """``max_concurrency`` belongs to ``fixed_rate`` alone, which cannot do without it."""
    given = read.merged.get("max_concurrency") is not None
    if mode is Mode.FIXED_RATE:
        if not given:
            read.problem("policy.max_concurrency", "is required (int >= 1) with mode 'fixed_rate'")
    elif mode is not None and given:
        read.problem("policy.max_concurrency", f"is only allowed with mode 'fixed_rate', not {mode.value!r}")


def _check_pending(read: _Reader, missed: MissedTicks | None) -> None:
    """``max_pending`` belongs to ``catch_up`` alone, which cannot do without it."""
    given = read.merged.get("max_pending") is not None
    if missed is MissedTicks.CATCH_UP:
        if not given:
            read.problem("policy.max_pending", "is required (int >= 1) with missed_ticks 'catch_up'")
    elif missed is not None and given:
        read.problem(
            "policy.max_pending", f"is only allowed with missed_ticks 'catch_up', not {missed.value!r}"
        )


def _check_fixed_delay(read: _Reader, mode: Mode | None, missed: MissedTicks | None, kind: str) -> None:
    """Fixed delay has no grid: no missed ticks to handle and no calendar to follow."""
    if mode is not Mode.FIXED_DELAY:
        return
    if missed is not None and missed is not MissedTicks.SKIP:
        read.problem("policy.missed_ticks", f"must stay 'skip' with mode 'fixed_delay', got {missed.value!r}")
    if kind != "interval":
        read.problem("schedule", f"mode 'fixed_delay' needs a number or timedelta schedule, not a {kind}")
    if read.merged.get("catchup_window") is not None:
        read.problem(
            "policy.catchup_window",
            "is not allowed with mode 'fixed_delay' (it has no grid: a late due time runs once)",
        )


def _check_window(read: _Reader, window: float | None, jitter: float | None) -> None:
    """A window within the jitter would drop ticks that are late only because jitter delayed them."""
    if window is not None and jitter is not None and window <= jitter:
        read.problem(
            "policy.catchup_window",
            f"must be longer than jitter ({jitter:g} s), or jittered ticks would be dropped on time, "
            f"got {window:g}",
        )


def _check_span(read: _Reader, start_at: datetime | None, end_at: datetime | None) -> None:
    """A schedule that ends before it starts would never run: surely a typo."""
    if start_at is not None and end_at is not None and end_at < start_at:
        read.problem(
            "policy.end_at", f"must not be before start_at ({start_at.isoformat()}), got {end_at.isoformat()}"
        )


def _check_retry(read: _Reader) -> Retry | None:
    """``retry``: a dict of :data:`RETRY_KEYS`, each optional, every problem named at once."""
    raw = read.merged.get("retry")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        read.problem("policy.retry", f"must be a dict (keys {', '.join(RETRY_KEYS)}), got {raw!r}")
        return None
    sub = _Reader(read.entry, {f"retry.{k}": v for k, v in raw.items()})
    for key in sorted(set(map(str, raw)) - set(RETRY_KEYS)):
        sub.problem(f"policy.retry.{key}", f"unknown retry key (known: {', '.join(RETRY_KEYS)})")
    on = _retry_states(sub, raw.get("on"))
    attempts = sub.positive_int("retry.max_attempts")
    if attempts is not None and attempts < 2:
        sub.problem("policy.retry.max_attempts", f"must be >= 2 (it counts the first run), got {attempts}")
    backoff = sub.duration("retry.backoff", allow_zero=True)
    cap = sub.duration("retry.max_backoff", allow_zero=True)
    default = Retry()
    backoff = default.backoff if backoff is None else backoff
    if cap is not None and cap < backoff:
        sub.problem("policy.retry.max_backoff", f"must be >= backoff ({backoff:g} s), got {cap:g}")
    read.problems.extend(sub.problems)
    if sub.problems:
        return None
    return Retry(
        on=default.on if on is None else on,
        max_attempts=attempts or default.max_attempts,
        backoff=backoff,
        max_backoff=max(default.max_backoff, backoff) if cap is None else cap,
    )


def _retry_states(read: _Reader, raw: Any) -> tuple[RunState, ...] | None:
    """``retry.on``: a non-empty list of :data:`RETRYABLE` state names."""
    if raw is None:
        return None
    known = ", ".join(state.value for state in RETRYABLE)
    if isinstance(raw, str) or not isinstance(raw, list | tuple) or not raw:
        read.problem("policy.retry.on", f"must be a non-empty list of states ({known}), got {raw!r}")
        return None
    states = []
    for value in raw:
        if value not in {state.value for state in RETRYABLE}:
            read.problem("policy.retry.on", f"cannot retry on {value!r} (use {known})")
            continue
        if RunState(value) not in states:
            states.append(RunState(value))
    return tuple(states)


def parse_policy(
    entry: str,
    raw: Any,
    default: Mapping[str, Any] | None = None,
    *,
    schedule_kind: str = "interval",
) -> tuple[Policy | None, list[Problem]]:
    """Merge ``raw`` over ``default`` and validate; returns the policy or every problem.

    ``schedule_kind`` is ``"interval"`` for numbers and timedeltas, anything else
    (``"crontab"``, ``"solar"``) for calendar schedules, which cannot be fixed-delay.
    """
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        return None, [(entry, "policy", f"must be a dict, got {type(raw).__name__}")]
    merged: dict[str, Any] = dict(default or {})
    merged.update(raw)
    read = _Reader(entry, merged)
    for key in sorted(set(merged) - POLICY_KEYS):
        read.problem(f"policy.{key}", f"unknown policy key (known: {', '.join(sorted(POLICY_KEYS))})")
    values: dict[str, Any] = {
        "mode": read.choice("mode", Mode, Mode.FIXED_RATE_NO_OVERLAP),
        "missed_ticks": read.choice("missed_ticks", MissedTicks, MissedTicks.SKIP),
        "max_pending": read.positive_int("max_pending"),
        "max_concurrency": read.positive_int("max_concurrency"),
        "initial_delay": read.duration("initial_delay", allow_zero=True) or 0.0,
        "max_run_time": read.duration("max_run_time", allow_zero=False),
        "jitter": read.duration("jitter", allow_zero=True),
        "end_at": read.instant("end_at"),
        "start_at": read.instant("start_at"),
        "max_runs": read.positive_int("max_runs"),
        "catchup_window": read.duration("catchup_window", allow_zero=False),
        "pause_on_failure": read.positive_int("pause_on_failure"),
        "keep_runs": read.positive_int("keep_runs"),
        "keep_for": read.duration("keep_for", allow_zero=False),
        "timezone": _check_timezone(read, raw, schedule_kind),
    }
    mode, missed = values["mode"], values["missed_ticks"]
    _check_concurrency(read, mode)
    _check_pending(read, missed)
    _check_fixed_delay(read, mode, missed, schedule_kind)
    _check_window(read, values["catchup_window"], values["jitter"])
    _check_span(read, values["start_at"], values["end_at"])
    values["retry"] = _check_retry(read)
    if read.problems or mode is None or missed is None:
        return None, read.problems
    return Policy(**values), []
