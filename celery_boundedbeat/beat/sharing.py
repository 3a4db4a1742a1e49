"""Partitioned beats, the beat's side: keep this beat's share and tick only its schedules.

With ``boundedbeat_partitions`` above 1 every live beat ticks the partitions it holds
(:class:`~celery_boundedbeat.db.partitions.PartitionKeeper`), the lease holder alone still
reconciles ``beat_schedule`` and does the housekeeping (reaper, alerts, retention), and
ticks are never prepared ahead (a prepared tick holds its rows across a handover). One
partition (the default) is the single-leader beat, unchanged.

Fewer, larger ticks: a beat ticking ``1/k`` of the partitions finds about ``1/k`` of the
due rows in each tick, yet pays the whole fixed cost of a tick (its statements, its
dispatcher's claim and mark). Ticking as soon as its next row was due, four beats ran twice
as many tick transactions as one beat, and spent 1.4 times its CPU per run. So after a tick
that emitted, a beat gathers what falls due for a while before it ticks again
(:func:`gather_for`): together the beats tick about as often as one beat would, and a run
waits at most :data:`MAX_GATHER` longer for it. Its own dispatcher publishes its ticks,
woken directly, without waking every other beat's (:attr:`~.tick.Share.wake_dispatchers`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

from ..config.settings import Settings
from ..db.partitions import PartitionKeeper, PartitionRows, PartitionTurn
from ..db.store import Store, TickResult, utcnow
from ..db.tick import Share

logger = logging.getLogger("celery_boundedbeat")

#: The longest a partitioned beat waits after a tick before the next (seconds): the most a
#: run due meanwhile is published later than it would be by ticking at once.
MAX_GATHER = 0.1
#: The least a tick is counted as lasting when working out the wait: on an idle machine a
#: tick of a few runs takes a few milliseconds, and two beats waiting that little ticked back
#: to back, each far more often than one beat alone.
MIN_TICK = 0.025


def gather_for(share: Share | None, took: float) -> float:
    """Seconds to wait after a tick that took ``took`` seconds before ticking the share again.

    A beat holding ``1/k`` of the partitions waits ``k - 1`` ticks' time (a tick counted as
    at least :data:`MIN_TICK`, the wait at most :data:`MAX_GATHER`): ``k`` such beats, each
    ticking every ``k`` tick times, tick about as often together as one beat holding every
    partition, which ticks back to back under load.
    Nothing to wait with one beat, or with no partition (or none to share).
    """
    if share is None or not share.mine:
        return 0.0
    beats = share.count / len(share.mine)
    return min(MAX_GATHER, max(0.0, (beats - 1) * max(took, MIN_TICK)))


def gather(result: TickResult, share: Share | None, took: float) -> None:
    """Put a partitioned beat's next tick off until :func:`gather_for` has passed.

    A tick that was a full batch is still followed at once (the beat's wait sees a backlog):
    the rows falling due meanwhile go in the next tick, never earlier.
    """
    due = result.next_due_at
    wait = gather_for(share, took)
    if due is not None and wait > 0:
        result.next_due_at = max(due, utcnow() + timedelta(seconds=wait))


class BeatShare:
    """This beat's share of the partitions, or nothing to share (one partition: the leader ticks all)."""

    def __init__(self, store: Store, settings: Settings, member: str) -> None:
        self.keeper: PartitionKeeper | None = None
        #: Whether this beat's own dispatcher publishes its ticks (it is woken directly).
        self.dispatches = settings.dispatch_enabled
        if settings.partitions > 1:
            self.keeper = PartitionKeeper(
                PartitionRows(store.db),
                member=member,
                partitions=settings.partitions,
                ttl=settings.lease_ttl,
                renew_interval=settings.lease_renew_interval,
                clock=time.monotonic,
                now=utcnow,
            )

    @property
    def partitioned(self) -> bool:
        return self.keeper is not None

    def acting(self) -> bool:
        """Whether this beat ticks any partition now (its dispatcher may publish)."""
        return self.keeper is not None and bool(self.keeper.acting())

    def keep(
        self, failed: Callable[[str, BaseException], None], succeeded: Callable[[str], None]
    ) -> tuple[Share | None, bool]:
        """The partitions this beat ticks now (``None``: not partitioned), and whether it gained one."""
        if self.keeper is None:
            return None, False
        share, turn = keep_share(self.keeper, failed=failed, succeeded=succeeded)
        if self.dispatches:
            share = replace(share, wake_dispatchers=False)
        return share, bool(turn.gained)

    def heard(self, payload: str) -> bool:
        """A beat joined, left or handed over (``payload``: which): re-plan at once unless it was us."""
        if self.keeper is None or payload == self.keeper.member:
            return False
        self.keeper.renew_now()
        return True

    def seconds_to_next_look(self) -> float:
        return float("inf") if self.keeper is None else self.keeper.seconds_to_next_look()

    def leave(self) -> None:
        """Give every partition up (after the last drain): the others tick from the rows at once."""
        if self.keeper is None:
            return
        try:
            self.keeper.leave()
        except Exception:
            logger.debug("celery_boundedbeat: could not give the partitions up", exc_info=True)


def keep_share(
    keeper: PartitionKeeper,
    *,
    failed: Callable[[str, BaseException], None],
    succeeded: Callable[[str], None],
) -> tuple[Share, PartitionTurn]:
    """Renew when due; the partitions this beat ticks now, and what the turn changed (logged)."""
    turn = keeper.keep()
    if turn.error is not None:
        failed("partition renewal", turn.error)
    elif turn.members is not None:
        succeeded("partition renewal")
    # What was given up is logged before what was won, as it happened: a beat back from a
    # freeze lost its lapsed partitions before its renewal won some of them again.
    renewed = turn.error is None and turn.members is not None
    handed = turn.lost - turn.lapsed if renewed else frozenset()
    if turn.lost - handed:
        logger.info(
            "celery_boundedbeat: %s gave up partition(s) %s (not renewed in time)",
            keeper.member,
            _listed(turn.lost - handed),
        )
    if handed:
        logger.info(
            "celery_boundedbeat: %s gave up partition(s) %s (handed over)", keeper.member, _listed(handed)
        )
    if turn.gained:
        logger.info(
            "celery_boundedbeat: %s now ticks partition(s) %s of %d (%d beat(s) live)",
            keeper.member,
            _listed(turn.gained),
            keeper.partitions,
            len(turn.members or ()),
        )
    return Share(keeper.partitions, tuple(sorted(turn.acting))), turn


def _listed(partitions: frozenset[int]) -> str:
    return ", ".join(str(p) for p in sorted(partitions))
