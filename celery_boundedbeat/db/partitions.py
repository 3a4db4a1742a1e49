"""Partitioned beats: each live beat claims its share of the partitions and ticks only those.

:class:`PartitionKeeper` is a small state machine over four store calls, like
:class:`~.lease.LeaseKeeper` for the single lease: every renew interval it renews this
beat's member row, reads the live members, computes the assignment
(:func:`~celery_boundedbeat.core.partitions.plan`), gives up the partitions now assigned to
another beat (cooperative handover: at once, so the new owner needs no expiry) and claims or
renews its own. A claim is a row of ``boundedbeat_leases`` named ``partition:<n>``; it is
taken only when free, expired or already ours, so two beats never hold one partition. The
beat acts for a partition only inside its trust window (the renewal's start plus ``ttl -
renew_interval`` on the monotonic clock): frozen or cut off, it stops before the claim can
expire for the others. The monotonic clock stops while the host sleeps (a suspended laptop or
virtual machine), so the keeper's elapsed time also moves on by any time the wall clock saw
pass and the monotonic clock did not: a beat that wakes after its claims expired does not act
on them. Time comes from injected clocks, so the protocol simulation drives this very class.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any, Protocol, cast

from sqlalchemy import Select, Table, delete, func, or_, select
from sqlalchemy.orm import Session

from ..core.partitions import TrustWindow, plan
from .database import Database
from .tables import LeaseRow

#: The lease-row name prefixes: one member row per live beat, one claim row per owned partition.
MEMBER_PREFIX = "member:"
PARTITION_PREFIX = "partition:"


def claim_name(partition: int) -> str:
    return f"{PARTITION_PREFIX}{partition}"


class PartitionStore(Protocol):
    """The store calls the keeper makes (:class:`~celery_boundedbeat.db.store.Store` has them)."""

    def renew_member(self, member: str, now: datetime, ttl: float) -> list[str]:
        """Renew ``member``'s row; the live members (itself included)."""
        ...

    def claim_partitions(self, member: str, partitions: Iterable[int], now: datetime, ttl: float) -> set[int]:
        """Claim or renew each partition free, expired or ``member``'s own; the ones now held."""
        ...

    def release_partitions(self, member: str, partitions: Iterable[int]) -> None:
        """Give up ``member``'s claims on ``partitions`` (others' claims are left alone)."""
        ...

    def leave(self, member: str) -> None:
        """Remove ``member``'s row and every claim it holds."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionTurn:
    """What one :meth:`PartitionKeeper.keep` did."""

    #: The partitions this beat may tick now.
    acting: frozenset[int] = frozenset()
    gained: frozenset[int] = frozenset()
    #: Given up to another beat (handover), or lost (refused, trust window over).
    lost: frozenset[int] = frozenset()
    #: The part of ``lost`` whose trust window ended unrenewed (a freeze, an outage): it may
    #: be in ``gained`` too, won again by the renewal that noticed the lapse.
    lapsed: frozenset[int] = frozenset()
    #: The live members the renewal saw (``None``: no renewal this turn).
    members: tuple[str, ...] | None = None
    error: Exception | None = None


class PartitionKeeper:
    """Keeps this beat's share of ``partitions`` and says which it may tick."""

    def __init__(
        self,
        store: PartitionStore,
        *,
        member: str,
        partitions: int,
        ttl: float,
        renew_interval: float,
        clock: Callable[[], float],
        now: Callable[[], datetime],
    ) -> None:
        self.member = member
        self.partitions = partitions
        self.ttl = ttl
        self.renew_interval = renew_interval
        self.next_renewal_at = 0.0
        self.held: frozenset[int] = frozenset()
        self._store = store
        self._clock = clock
        self._now = now
        self._trust = TrustWindow(ttl=ttl, margin=renew_interval)
        self._look: tuple[float, datetime] | None = None
        self._skew = 0.0
        self._look_lock = threading.Lock()

    def _elapsed(self) -> float:
        """The monotonic clock, moved on by any time the wall clock saw pass and it did not.

        ``time.monotonic()`` does not count a host's sleep; the wall clock is set right on
        waking. Never running slower than either clock, the trust window ends in time (unless
        the wall clock is also stepped back across the sleep: a clock that counts sleep, such
        as ``CLOCK_BOOTTIME`` on Linux, is the better ``clock`` where there is one).
        """
        with self._look_lock:
            mono, wall = self._clock(), self._now()
            if self._look is not None:
                behind = (wall - self._look[1]).total_seconds() - (mono - self._look[0])
                self._skew += max(behind, 0.0)
            self._look = (mono, wall)
            return mono + self._skew

    def acting(self) -> frozenset[int]:
        """The partitions this beat may tick and publish for now (safe from any thread)."""
        return self._trust.acting(self._elapsed())

    def renew_now(self) -> None:
        """Renew at the next :meth:`keep` (a beat joined or left: re-plan at once)."""
        self.next_renewal_at = 0.0

    def keep(self) -> PartitionTurn:
        """Renew if it is time; then the partitions this beat may act for."""
        mono = self._elapsed()
        if mono < self.next_renewal_at:
            return self._expire(PartitionTurn(), mono)
        started = self._now()
        before = self.held
        # A claim whose trust window ended since the last look lapsed (another beat may have
        # held it since): won again now, it is gained anew, not kept.
        trusted = before & self._trust.acting(mono)
        self.next_renewal_at = mono + self.renew_interval
        try:
            members = self._store.renew_member(self.member, started, self.ttl)
            todo = plan(self.member, members, before, self.partitions)
            if todo.release:
                # Stop acting before the others can take them, even if the claim below fails.
                self._trust.dropped(todo.release)
                self.held -= todo.release
                self._store.release_partitions(self.member, todo.release)
            got = frozenset(self._store.claim_partitions(self.member, todo.claim, started, self.ttl))
        except Exception as exc:
            self.next_renewal_at = mono + min(1.0, self.renew_interval)
            turn = self._expire(PartitionTurn(error=exc), self._elapsed())
            return PartitionTurn(acting=turn.acting, lost=before - self.held, lapsed=turn.lapsed, error=exc)
        self._trust.dropped(before - got)
        self._trust.renewed(got, mono)
        self.held = got
        return PartitionTurn(
            acting=self._trust.acting(self._elapsed()),
            gained=got - trusted,
            lost=(before - got) | (before - trusted),
            lapsed=before - trusted,
            members=tuple(sorted(members)),
        )

    def _expire(self, turn: PartitionTurn, mono: float) -> PartitionTurn:
        """Partitions whose trust window ended without a renewal are held no more."""
        acting = self._trust.acting(mono)
        gone = self.held - acting
        if gone:
            self._trust.dropped(gone)
            self.held = acting
        return PartitionTurn(acting=acting, lost=gone, lapsed=gone, error=turn.error)

    def seconds_to_next_look(self) -> float:
        """Seconds until a renewal is due."""
        return max(self.next_renewal_at - self._elapsed(), 0.0)

    def leave(self) -> None:
        """Give every partition up and leave the members (SIGTERM): the others take over at once."""
        self._trust.dropped(self.held)
        self.held = frozenset()
        self._store.leave(self.member)


#: Woken when a beat joins or leaves or gives partitions up: the others re-plan at once.
BEATS_CHANNEL = "boundedbeat_beats"


class PartitionRows:
    """The member and claim rows in ``boundedbeat_leases`` (the :class:`PartitionStore` calls).

    Expiry is judged by the database's clock on PostgreSQL, so beats on hosts whose clocks
    disagree still agree on who holds what (SQLite: the one host's clock). Claims are locked
    in name order, so two beats claiming at once never deadlock.
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    def _now(self, s: Session, fallback: datetime) -> datetime:
        if not self.db.is_postgres:
            return fallback
        found: datetime = s.execute(select(func.now())).scalar_one()
        return found.astimezone(UTC)

    def renew_member(self, member: str, now: datetime, ttl: float) -> list[str]:
        name = f"{MEMBER_PREFIX}{member}"
        with self.db.session() as s:
            at = self._now(s, now)
            row = s.get(LeaseRow, name, with_for_update=True)
            if row is None:
                s.add(
                    LeaseRow(
                        name=name, holder=member, acquired_at=at, renewed_at=at, expires_at=_after(at, ttl)
                    )
                )
                self.db.notify(s, BEATS_CHANNEL, member)
            else:
                row.renewed_at, row.expires_at = at, _after(at, ttl)
            # Members dead for a whole ttl are forgotten (a restarted beat is a new member).
            s.execute(
                delete(LeaseRow).where(
                    LeaseRow.name.startswith(MEMBER_PREFIX), LeaseRow.expires_at < at - timedelta(seconds=ttl)
                )
            )
            live = select(LeaseRow.holder).where(
                LeaseRow.name.startswith(MEMBER_PREFIX), LeaseRow.expires_at > at
            )
            return sorted({*s.scalars(live), member})

    def claim_partitions(self, member: str, partitions: Iterable[int], now: datetime, ttl: float) -> set[int]:
        names = sorted(claim_name(p) for p in partitions)
        got: set[int] = set()
        if not names:
            return got
        with self.db.session() as s:
            at = self._now(s, now)
            rows = {r.name: r for r in s.scalars(_locked(names))}
            for name in names:
                row = rows.get(name)
                if row is None:
                    # Never claimed: another beat may be inserting it now (both start at once).
                    # The loser takes nothing rather than failing the whole claim with its renewals.
                    new = {"name": name, "holder": member, "acquired_at": at, "renewed_at": at}
                    new["expires_at"] = _after(at, ttl)
                    if s.execute(_insert_if_free(self.db.is_postgres), new).first() is None:
                        continue
                elif row.holder == member or row.expires_at <= at:
                    if row.holder != member:
                        row.holder, row.acquired_at = member, at
                    row.renewed_at, row.expires_at = at, _after(at, ttl)
                else:
                    continue
                got.add(int(name.removeprefix(PARTITION_PREFIX)))
        return got

    def release_partitions(self, member: str, partitions: Iterable[int]) -> None:
        names = [claim_name(p) for p in partitions]
        with self.db.session() as s:
            s.execute(delete(LeaseRow).where(LeaseRow.name.in_(names), LeaseRow.holder == member))
            self.db.notify(s, BEATS_CHANNEL, member)

    def leave(self, member: str) -> None:
        with self.db.session() as s:
            s.execute(
                delete(LeaseRow).where(
                    LeaseRow.holder == member,
                    or_(
                        LeaseRow.name.startswith(PARTITION_PREFIX),
                        LeaseRow.name == f"{MEMBER_PREFIX}{member}",
                    ),
                )
            )
            self.db.notify(s, BEATS_CHANNEL, member)

    def owners(self, now: datetime) -> dict[int, str]:
        """Each claimed partition's live owner (read-only: ``status``, ``beats``)."""
        with self.db.session() as s:
            at = self._now(s, now)
            rows = s.execute(
                select(LeaseRow.name, LeaseRow.holder).where(
                    LeaseRow.name.startswith(PARTITION_PREFIX), LeaseRow.expires_at > at
                )
            )
            return {int(name.removeprefix(PARTITION_PREFIX)): holder for name, holder in rows}

    def members(self, now: datetime) -> list[tuple[str, datetime, datetime]]:
        """The live beats: ``(id, joined at, renewed at)``, oldest first (read-only)."""
        with self.db.session() as s:
            at = self._now(s, now)
            rows = s.execute(
                select(LeaseRow.holder, LeaseRow.acquired_at, LeaseRow.renewed_at)
                .where(LeaseRow.name.startswith(MEMBER_PREFIX), LeaseRow.expires_at > at)
                .order_by(LeaseRow.acquired_at, LeaseRow.holder)
            )
            return [(holder, joined, renewed) for holder, joined, renewed in rows]


@cache
def _insert_if_free(postgres: bool) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING RETURNING name`` into the lease rows."""
    if postgres:
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert  # type: ignore[assignment]
    table = cast(Table, LeaseRow.__table__)
    return dialect_insert(table).on_conflict_do_nothing().returning(table.c.name)


def _after(at: datetime, ttl: float) -> datetime:
    return at + timedelta(seconds=ttl)


def _locked(names: list[str]) -> Select[LeaseRow]:
    return select(LeaseRow).where(LeaseRow.name.in_(names)).order_by(LeaseRow.name).with_for_update()
