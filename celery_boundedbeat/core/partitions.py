"""Which beat ticks which schedules: partitions, and their assignment to the live beats.

Every schedule has a fixed hash slot (:func:`slot_of`, stored with it). With
``boundedbeat_partitions = P`` (a power of two up to :data:`SLOTS`), partition ``slot % P``
groups the slots, so changing ``P`` needs no rewrite of the rows. Each live beat computes the
same assignment from the same member list (:func:`assign`): no messages between beats, and a
beat that joins or leaves moves about ``P / beats`` partitions, not all of them.

The assignment is rendezvous (highest random weight) hashing with bounded load: each
partition goes to the member that weighs it highest among those with room left, the pairs
taken heaviest first, and no member takes more than its fair share (``ceil(P / beats)`` for
the first ``P % beats`` members in weight order, ``floor`` for the rest). Plain rendezvous
hashing moves as little but leaves shares uneven on few partitions (16 over 4 beats is often
2 to 7); the bound makes every share fair while a change still moves few partitions.

Pure: the keeper (:mod:`~celery_boundedbeat.db.partitions`) reads the members and claims from
the database, and the protocol simulation drives these same functions under a fake clock.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from hashlib import blake2b

#: Hash slots: a schedule's slot never changes; partitions are groups of slots.
SLOTS = 1024
#: The most partitions a deployment may have (each partition is at least one slot).
MAX_PARTITIONS = SLOTS


def slot_of(name: str) -> int:
    """The schedule's hash slot (stable across processes, versions and machines)."""
    return zlib.crc32(name.encode("utf-8")) % SLOTS


def partition_of(slot: int, partitions: int) -> int:
    """The partition a slot belongs to with ``partitions`` partitions (a power of two)."""
    return slot % partitions


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def weight(member: str, partition: int) -> int:
    """The rendezvous weight of ``member`` for ``partition`` (the same on every host)."""
    digest = blake2b(f"{member}\x00{partition}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def assign(members: Iterable[str], partitions: int) -> dict[int, str]:
    """Each partition's owner among ``members`` (empty when there is no member)."""
    alive = sorted(set(members))
    if not alive:
        return {}
    base, extra = divmod(partitions, len(alive))
    # Who gets the extra partitions must not depend on list order: the heaviest members overall.
    by_total = sorted(alive, key=lambda m: (-weight(m, -1), m))
    room = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_total)}
    pairs = sorted(
        ((weight(m, p), m, p) for p in range(partitions) for m in alive),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    owner: dict[int, str] = {}
    for _w, member, partition in pairs:
        if partition in owner or room[member] == 0:
            continue
        owner[partition] = member
        room[member] -= 1
        if len(owner) == partitions:
            break
    return owner


def share_of(member: str, members: Iterable[str], partitions: int) -> frozenset[int]:
    """The partitions ``member`` should own while ``members`` are live (itself included)."""
    return frozenset(p for p, m in assign({*members, member}, partitions).items() if m == member)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What a beat does with its partitions at one renewal."""

    #: Partitions to claim (or renew): assigned to it.
    claim: frozenset[int] = frozenset()
    #: Partitions to give up now: held, but assigned to another live beat (cooperative handover).
    release: frozenset[int] = frozenset()


def plan(me: str, members: Iterable[str], held: Iterable[int], partitions: int) -> Plan:
    """The claims and releases of one renewal, from the live members and what ``me`` holds."""
    mine = share_of(me, members, partitions)
    return Plan(claim=mine, release=frozenset(held) - mine)


@dataclass(kw_only=True, slots=True)
class TrustWindow:
    """Until when a beat may act for a partition it claimed, on its own monotonic clock.

    A claim written at database time ``t`` expires at ``t + ttl`` for the others. The beat
    trusts it only until ``renewal start + ttl - margin`` on its monotonic clock: the renewal
    began before ``t``, so a beat frozen, slowed or cut off stops acting a whole ``margin``
    before another beat can claim the partition, whatever the wall clocks say.
    """

    ttl: float
    margin: float
    until: dict[int, float] = field(default_factory=dict)

    def renewed(self, partitions: Iterable[int], started: float) -> None:
        """``partitions`` were claimed by a renewal that began at monotonic ``started``."""
        end = started + max(self.ttl - self.margin, 0.0)
        for p in partitions:
            self.until[p] = end

    def dropped(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self.until.pop(p, None)

    def acting(self, now: float) -> frozenset[int]:
        """The partitions this beat may tick and publish for at monotonic ``now``."""
        return frozenset(p for p, end in self.until.items() if now < end)


def moved(before: Mapping[int, str], after: Mapping[int, str]) -> int:
    """How many partitions changed owner between two assignments."""
    return sum(1 for p, m in after.items() if before.get(p) != m)
