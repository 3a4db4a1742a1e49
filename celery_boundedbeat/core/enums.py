"""Enumerations whose values are the strings of the public contract."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """How a schedule's runs are timed."""

    #: Next run is due ``period`` after the previous run finished; at most one active run.
    FIXED_DELAY = "fixed_delay"
    #: Runs tick on the schedule's grid; at most one active run.
    FIXED_RATE_NO_OVERLAP = "fixed_rate_no_overlap"
    #: Runs tick on the schedule's grid; at most ``max_concurrency`` active runs.
    FIXED_RATE = "fixed_rate"


class MissedTicks(StrEnum):
    """What happens to a tick that finds every slot busy."""

    #: Drop it (counted in ``skips``).
    SKIP = "skip"
    #: Keep at most one pending run, the latest tick.
    COALESCE_LATEST = "coalesce_latest"
    #: Keep at most ``max_pending`` pending runs, oldest first.
    CATCH_UP = "catch_up"
    #: Revoke (terminate) the oldest active run, which settles ``revoked``, and start this one.
    REPLACE = "replace"


class RunState(StrEnum):
    """The life of one run; exactly one terminal state per run."""

    #: Written to the DB-backed queue, not yet handed to the broker.
    QUEUED = "queued"
    #: Accepted by the broker.
    PUBLISHED = "published"
    #: A worker began executing it (a Celery retry keeps it here).
    STARTED = "started"
    #: Returned normally (also after ``stop_schedule()``).
    COMPLETED = "completed"
    #: Raised; the error text is kept.
    FAILED = "failed"
    #: Ran past ``max_run_time``.
    TIMED_OUT = "timed_out"
    #: Revoked or terminated.
    REVOKED = "revoked"
    #: Could not be published, expired, or was rejected before it started.
    REJECTED = "rejected"
    #: Its worker died (heartbeats stopped).
    LOST = "lost"

    @property
    def terminal(self) -> bool:
        """Whether the run has settled."""
        return self not in _ACTIVE

    @property
    def counts_as_failure(self) -> bool:
        """Whether settling in this state increments ``failures`` (else ``runs``)."""
        return self.terminal and self is not RunState.COMPLETED


_ACTIVE = frozenset({RunState.QUEUED, RunState.PUBLISHED, RunState.STARTED})
ACTIVE_STATES: frozenset[RunState] = _ACTIVE


class StopReason(StrEnum):
    """Why a schedule shows ``stopped`` (``stop_reason`` in ``status``)."""

    #: A run called ``stop_schedule()``; ``resume`` lifts it.
    STOP_SCHEDULE = "stop_schedule"
    #: Its ``end_at`` passed; only ``update_schedule`` with a later end revives it.
    END_AT = "end_at"
    #: It emitted ``max_runs`` grid runs; only ``update_schedule`` with a higher bound revives it.
    MAX_RUNS = "max_runs"

    @property
    def ended(self) -> bool:
        """Whether the schedule reached the end its policy gave it (``resume`` refuses it)."""
        return self is not StopReason.STOP_SCHEDULE


class AlertKind(StrEnum):
    """A transition an application may alert on; each is one signal in :mod:`~.signals`."""

    #: ``boundedbeat_failing_threshold`` counted failures in a row (``schedule_failing``).
    FAILING = "schedule_failing"
    #: The first completed run after the schedule was announced failing (``schedule_recovered``).
    RECOVERED = "schedule_recovered"
    #: A tick dropped missed ticks: ``skips`` rose (``ticks_dropped``).
    TICKS_DROPPED = "ticks_dropped"
    #: A run settled ``lost``: its worker died (``run_lost``).
    RUN_LOST = "run_lost"
    #: A run settled ``timed_out``: it passed ``max_run_time`` (``run_timed_out``).
    RUN_TIMED_OUT = "run_timed_out"
