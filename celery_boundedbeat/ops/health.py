"""The health probe: is a beat scheduling, and is the queue moving? (``boundedbeat health``).

One read (:func:`read_beat_state`: one ``SELECT`` of the lease row and the oldest queue row's
due time, and one of the published runs no worker started within ``--max-unstarted-age``,
which reads the schedules' options only when some wait) and a pure decision over what it
found (:func:`judge`), so every verdict is tested with fixed times. The probe runs in its own
short-lived process (a Kubernetes exec probe, a cron job), never inside beat.

What "ticked" means: the lease holder renews ``boundedbeat_leases.renewed_at`` from its tick
loop (``Scheduler.tick`` keeps the lease before it emits), every ``lease_renew_interval``.
A tick loop that hangs or a process that is frozen stops renewing, so the age of
``renewed_at`` is the age of the last turn of the tick loop. A frozen holder also loses the
lease after ``lease_ttl``: from then on the probe reports that no beat holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, Engine, func, literal, select

from ..core.exceptions import BoundedBeatError
from ..core.redact import driver_reason, mask_url, scrub
from ..core.unstarted import DEFAULT_UNSTARTED_WARNING, Unstarted, describe
from ..db.engine import get_engine
from ..db.faults import is_outage
from ..db.lease import LEASE_NAME
from ..db.partitions import PARTITION_PREFIX
from ..db.tables import LeaseRow, QueueRow
from ..db.unstarted import read_unstarted

#: Default bound on the age of the last tick (seconds); ``--max-tick-age``.
DEFAULT_MAX_TICK_AGE = 60.0
#: Default bound on how long ago the oldest queued message was due (seconds); ``--max-queue-age``.
DEFAULT_MAX_QUEUE_AGE = 300.0


class Problem(StrEnum):
    """Why the probe fails; the value is the ``problem`` field of ``health --json``."""

    #: No lease row, or the last holder's lease expired: nothing is scheduling.
    NO_BEAT = "no_beat"
    #: A beat holds the lease but its tick loop has not turned within ``--max-tick-age``.
    STALLED = "stalled"
    #: The oldest queued message was due more than ``--max-queue-age`` ago (broker down,
    #: dispatcher stuck or too slow).
    BEHIND = "behind"
    #: Runs were handed to the broker more than ``--max-unstarted-age`` ago and no worker
    #: started them: their queue has no consumer (a typo in the entry's ``options``?) or
    #: every worker is down.
    UNSTARTED = "unstarted"
    #: Partitioned beats: some partitions have no live beat ticking them.
    UNOWNED = "unowned"
    #: The database could not be reached or read.
    DATABASE = "database"


@dataclass(frozen=True, kw_only=True, slots=True)
class Bounds:
    """What the probe tolerates."""

    #: Seconds since the last tick; must exceed ``lease_renew_interval`` (the tick is recorded
    #: once per renewal).
    max_tick_age: float = DEFAULT_MAX_TICK_AGE
    #: Seconds the oldest queued message may be overdue; ``None``: the queue is not checked.
    max_queue_age: float | None = DEFAULT_MAX_QUEUE_AGE
    #: Seconds a published run may wait for a worker to start it (``boundedbeat_unstarted_warning``
    #: by default); ``None``: not checked.
    max_unstarted_age: float | None = DEFAULT_UNSTARTED_WARNING
    #: ``boundedbeat_partitions``: above 1, every partition must have a live owner.
    partitions: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class BeatState:
    """What the one read found (``None``: no lease row, or an empty queue)."""

    holder: str | None = None
    renewed_at: datetime | None = None
    expires_at: datetime | None = None
    oldest_queued_due_at: datetime | None = None
    #: Per schedule, the published runs no worker started within ``max_unstarted_age``.
    unstarted: tuple[Unstarted, ...] = ()
    #: Partitioned beats: the partitions no live beat holds.
    unowned: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Health:
    """The verdict: healthy when ``problem`` is ``None``; ``message`` is the one line to print."""

    problem: Problem | None
    message: str
    checked_at: datetime
    state: BeatState
    bounds: Bounds

    @property
    def healthy(self) -> bool:
        return self.problem is None

    def to_json(self) -> dict[str, Any]:
        """The ``health --json`` object (times ISO 8601 in UTC, ages in seconds, or null)."""
        s = self.state
        return {
            "healthy": self.healthy,
            "problem": None if self.problem is None else self.problem.value,
            "message": self.message,
            "checked_at": self.checked_at.isoformat(),
            "holder": s.holder,
            "last_tick_at": _iso(s.renewed_at),
            "last_tick_age_seconds": _age(self.checked_at, s.renewed_at),
            "lease_expires_at": _iso(s.expires_at),
            "queue_oldest_due_at": _iso(s.oldest_queued_due_at),
            "queue_oldest_age_seconds": _age(self.checked_at, s.oldest_queued_due_at),
            "max_tick_age": self.bounds.max_tick_age,
            "max_queue_age": self.bounds.max_queue_age,
            "unstarted_runs": sum(u.runs for u in s.unstarted),
            "unstarted": [
                {
                    "schedule": u.schedule,
                    "queue": u.queue,
                    "runs": u.runs,
                    "oldest_published_at": _iso(u.oldest_published_at),
                }
                for u in s.unstarted
            ],
            "max_unstarted_age": self.bounds.max_unstarted_age,
            "unowned_partitions": list(s.unowned),
        }


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _age(now: datetime, then: datetime | None) -> float | None:
    """Seconds from ``then`` to ``now``, never negative (a clock a little ahead is not "late")."""
    return None if then is None else round(max((now - then).total_seconds(), 0.0), 3)


def bound_refusal(bounds: Bounds, renew_interval: float) -> str | None:
    """Why these bounds cannot work with this beat's settings (``None``: they can).

    Beat records a tick once per lease renewal, so a bound at or below the renew interval
    would fail a perfectly healthy beat between two renewals.
    """
    if bounds.max_tick_age <= renew_interval:
        return (
            f"--max-tick-age {bounds.max_tick_age:g} s must be longer than boundedbeat_lease_renew_interval "
            f"({renew_interval:g} s): beat records its tick once per lease renewal"
        )
    return None


def judge(state: BeatState, now: datetime, bounds: Bounds) -> Health:
    """The verdict over one read: the first problem found, in the order an operator fixes them."""
    tick_age = _age(now, state.renewed_at)
    if state.holder is None or state.expires_at is None or state.expires_at <= now:
        return _verdict(Problem.NO_BEAT, _no_beat(state, now), now, state, bounds)
    if tick_age is None or tick_age > bounds.max_tick_age:
        message = (
            f"beat {state.holder} holds the lease but stopped ticking: last tick {tick_age or 0:.1f} s "
            f"ago (bound {bounds.max_tick_age:g} s)"
        )
        return _verdict(Problem.STALLED, message, now, state, bounds)
    if state.unowned:
        message = (
            f"partition(s) {', '.join(map(str, state.unowned))} of {bounds.partitions} have no live beat: "
            "their schedules are not ticked (a beat stopped or died; the others take them over "
            "within boundedbeat_lease_ttl and one renewal)"
        )
        return _verdict(Problem.UNOWNED, message, now, state, bounds)
    queue_age = _age(now, state.oldest_queued_due_at)
    if bounds.max_queue_age is not None and queue_age is not None and queue_age > bounds.max_queue_age:
        message = (
            f"the dispatcher is behind: the oldest queued message was due {queue_age:.1f} s ago "
            f"(bound {bounds.max_queue_age:g} s)"
        )
        return _verdict(Problem.BEHIND, message, now, state, bounds)
    if bounds.max_unstarted_age is not None and state.unstarted:
        message = describe(state.unstarted, now, bounds.max_unstarted_age)
        return _verdict(Problem.UNSTARTED, message, now, state, bounds)
    queue = "queue empty" if queue_age is None else f"oldest queued message due {queue_age:.1f} s ago"
    message = f"beat {state.holder} holds the lease; last tick {tick_age:.1f} s ago; {queue}"
    return _verdict(None, message, now, state, bounds)


def _no_beat(state: BeatState, now: datetime) -> str:
    if state.holder is None or state.expires_at is None:
        return (
            "no beat holds the lease (no lease row: no beat has started on this database, "
            "or the last one stopped cleanly)"
        )
    expired = _age(now, state.expires_at) or 0.0
    tick = _age(now, state.renewed_at)
    last = "" if tick is None else f"; its last tick was {tick:.1f} s ago"
    return f"no beat holds the lease: the lease of {state.holder} expired {expired:.1f} s ago{last}"


def _verdict(
    problem: Problem | None, message: str, now: datetime, state: BeatState, bounds: Bounds
) -> Health:
    prefix = "healthy" if problem is None else "unhealthy"
    return Health(problem=problem, message=f"{prefix}: {message}", checked_at=now, state=state, bounds=bounds)


def database_failure(url: str, exc: BaseException, now: datetime, bounds: Bounds) -> Health:
    """The verdict when the read failed: the masked URL and the driver's reason, one line."""
    if isinstance(exc, BoundedBeatError):  # an invalid URL: its text names it, masked, on one line
        return _verdict(Problem.DATABASE, " ".join(scrub(str(exc), url).split()), now, BeatState(), bounds)
    # SQLite reports a missing table as an OperationalError, the class of outages.
    if is_outage(exc) and "no such table" not in str(getattr(exc, "orig", exc)):
        what = f"cannot reach the database {mask_url(url)}"
    else:  # reachable, but the read is refused: most often a database never migrated
        what = f"cannot read the beat lease from the database {mask_url(url)} (is it migrated?)"
    return _verdict(Problem.DATABASE, f"{what}: {driver_reason(exc, url)}", now, BeatState(), bounds)


def read_beat_state(
    engine: Engine, now: datetime | None = None, unstarted_after: float | None = None, partitions: int = 1
) -> BeatState:
    """The lease row and the oldest queue row's due time, in one ``SELECT``; with ``now`` and
    ``unstarted_after``, the published runs no worker started within that many seconds too.

    The queue's oldest due time is one step down the ``(due_at, id)`` index, claimed or not: a
    claimed row not yet published is as late as an unclaimed one. The one-row subquery keeps a
    result row when there is no lease row.
    """
    oldest = select(func.min(QueueRow.due_at)).scalar_subquery().label("oldest")
    one = select(literal(1).label("one")).subquery()
    query = select(LeaseRow.holder, LeaseRow.renewed_at, LeaseRow.expires_at, oldest).select_from(
        one.outerjoin(LeaseRow, LeaseRow.name == LEASE_NAME)
    )
    with engine.connect() as conn:
        row = conn.execute(query).one()
        unstarted = () if now is None else read_unstarted(conn, now, unstarted_after)
        unowned = () if now is None or partitions <= 1 else _unowned(conn, now, partitions)
    return BeatState(
        holder=row[0],
        renewed_at=row[1],
        expires_at=row[2],
        oldest_queued_due_at=row[3],
        unstarted=unstarted,
        unowned=unowned,
    )


def _unowned(conn: Connection, now: datetime, partitions: int) -> tuple[int, ...]:
    """The partitions without a live claim (partitioned beats)."""
    live = conn.scalars(
        select(LeaseRow.name).where(LeaseRow.name.startswith(PARTITION_PREFIX), LeaseRow.expires_at > now)
    )
    held = {int(name.removeprefix(PARTITION_PREFIX)) for name in live}
    return tuple(p for p in range(partitions) if p not in held)


def probe(url: str, now: datetime, bounds: Bounds) -> Health:
    """Read and judge; a database that cannot be reached or read is a verdict, not an exception."""
    try:
        state = read_beat_state(get_engine(url), now, bounds.max_unstarted_age, bounds.partitions)
    except Exception as exc:
        return database_failure(url, exc, now, bounds)
    return judge(state, now, bounds)
