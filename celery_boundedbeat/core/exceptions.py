"""Errors users can catch; every message names what was wrong."""

from __future__ import annotations


class BoundedBeatError(Exception):
    """Base class of every error raised by celery_boundedbeat."""


class ConfigurationError(BoundedBeatError):
    """One or more schedule entries or settings are invalid.

    ``problems`` lists every offending ``(entry, key, reason)`` so beat can report them all
    at once instead of making the user fix them one restart at a time.
    """

    def __init__(self, problems: list[tuple[str, str, str]]) -> None:
        self.problems = list(problems)
        lines = [f"  - entry {entry!r}, key {key!r}: {reason}" for entry, key, reason in problems]
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(
            f"invalid celery_boundedbeat configuration ({len(problems)} {noun}):\n" + "\n".join(lines)
        )


class DatabaseNotMigratedError(BoundedBeatError):
    """The state database is missing tables or is behind the shipped migrations."""


class UnknownScheduleError(BoundedBeatError):
    """A command named a schedule that is not in the database."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no schedule named {name!r}")


class NotInScheduledRunError(BoundedBeatError):
    """``stop_schedule()`` was called outside a run emitted by celery_boundedbeat."""


class ScheduleEndedError(BoundedBeatError):
    """``resume`` was asked of a schedule its ``end_at`` or ``max_runs`` ended."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        super().__init__(f"cannot resume {name!r}: {reason}")


class BackfillRefusedError(BoundedBeatError):
    """``backfill`` was asked of a schedule that cannot take it (paused, stopped, fixed delay, full)."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"cannot backfill {name!r}: {reason}")
