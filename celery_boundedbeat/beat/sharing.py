"""Partitioned beats, the beat's side: keep this beat's share and tick only its schedules.

With ``boundedbeat_partitions`` above 1 every live beat ticks the partitions it holds
(:class:`~celery_boundedbeat.db.partitions.PartitionKeeper`), the lease holder alone still
reconciles ``beat_schedule`` and does the housekeeping (reaper, alerts, retention), and
ticks are never prepared ahead (a prepared tick holds its rows across a handover). One
partition (the default) is the single-leader beat, unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..config.settings import Settings
from ..db.partitions import PartitionKeeper, PartitionRows, PartitionTurn
from ..db.store import Store, utcnow
from ..db.tick import Share

logger = logging.getLogger("celery_boundedbeat")


class BeatShare:
    """This beat's share of the partitions, or nothing to share (one partition: the leader ticks all)."""

    def __init__(self, store: Store, settings: Settings, member: str) -> None:
        self.keeper: PartitionKeeper | None = None
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
