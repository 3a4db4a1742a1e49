"""What the reaper can find among the runs in flight, read without walking them.

The reaper settles runs nobody will finish: ``lost`` and ``timed_out`` ones are ``started``,
``rejected`` ones were ``published`` longer than ``boundedbeat_start_timeout`` ago. While runs
wait published for a worker and none has started, nothing can be lost or time out, and none can
be rejected before the earliest ``published_at`` plus the timeout: one probe per reaper pass
(two ``EXISTS`` on the runs' ``(state, started_at)`` index) tells the beat whether it must look
further, whatever the number of runs waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, exists, func, select

from ..core.enums import ACTIVE_STATES, RunState
from .tables import RunRow


@dataclass(frozen=True, slots=True)
class InFlight:
    """Whether any run is queued, published or started, and whether any is started."""

    active: bool
    started: bool


_PROBE = select(
    exists().where(RunRow.state.in_([s.value for s in ACTIVE_STATES])),
    exists().where(RunRow.state == RunState.STARTED.value),
)
_FIRST_PUBLISHED = select(func.min(RunRow.published_at)).where(RunRow.state == RunState.PUBLISHED.value)


def in_flight(engine: Engine) -> InFlight:
    """One statement, two index probes: what the reaper may have to settle now.

    Outside a transaction on PostgreSQL: one round trip, where ``BEGIN`` and the rollback that
    returns the connection to the pool made it three, every pass.
    """
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        active, started = conn.execute(_PROBE).one()
    return InFlight(active=bool(active), started=bool(started))


def first_published_at(engine: Engine) -> datetime | None:
    """The earliest ``published_at`` of the runs still waiting for a worker (``None``: none waits).

    Read once per start timeout, not per pass: runs published later carry a later time, and a
    run leaving ``published`` only moves the earliest one later.
    """
    with engine.connect() as conn:
        first: datetime | None = conn.scalar(_FIRST_PUBLISHED)
    return first
