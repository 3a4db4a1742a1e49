"""The partition protocol: its pure functions, and the simulation of many beats under faults.

The simulation (:mod:`helpers.partition_sim`) runs the beats' own
:class:`~celery_boundedbeat.db.partitions.PartitionKeeper` on a fake database and fake clocks.
A failing seeded history names its seed: ``random_history(seed)`` replays it exactly.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterable
from datetime import datetime, timedelta

import pytest
from helpers.clock import T0
from helpers.partition_sim import (
    FAULTS,
    GRACEFUL,
    LATE,
    RENEW,
    TTL,
    FakeDb,
    Fault,
    Schedule,
    Sim,
    SimStore,
    random_history,
)

from celery_boundedbeat.core.partitions import (
    SLOTS,
    TrustWindow,
    assign,
    is_power_of_two,
    moved,
    partition_of,
    plan,
    share_of,
    slot_of,
)
from celery_boundedbeat.db.partitions import PartitionKeeper

#: Seeded histories: with every fault, and with joins and leaves only (nothing may be missed).
#: ``BOUNDEDBEAT_SIM_SCALE=20`` runs twenty times as many (new seeds too), for a soak.
SCALE = int(os.environ.get("BOUNDEDBEAT_SIM_SCALE", "1"))
FAULT_HISTORIES = 1000 * SCALE
GRACEFUL_HISTORIES = 250 * SCALE


def movement_bound(partitions: int, before: int, after: int) -> int:
    """The most partitions one join or leave moves: measured, not proven.

    Plain rendezvous hashing moves only the joiner's (or leaver's) share, about
    ``ceil(P / beats)``; the load bound makes a change cascade a little (a partition pushed
    off a full beat displaces another), worst with few partitions per beat: 16 partitions
    from 7 to 8 beats moves up to 8 (a share is 2), 256 from 8 to 9 up to 40 (a share is 29).
    """
    share = math.ceil(partitions / max(before, after))
    return min(partitions, share + math.ceil(math.sqrt(partitions)) + 2)


# -- pure functions --------------------------------------------------------------------------


def test_slot_of_is_stable() -> None:
    # crc32 of the UTF-8 name, modulo SLOTS: the same on every host and version.
    assert SLOTS == 1024
    assert slot_of("") == 0
    # Pinned values: a change here re-partitions every deployment's schedules.
    assert slot_of("a") == 0xE8B7BE43 % 1024 == 579
    assert [slot_of(n) for n in ("send-report", "celery.backend_cleanup", "été")] == [38, 12, 212]
    assert partition_of(1023, 16) == 15
    assert partition_of(579, 1) == 0
    assert partition_of(579, 64) == 579 % 64 == partition_of(partition_of(579, 256), 64)


def test_is_power_of_two() -> None:
    assert [n for n in range(-2, 70) if is_power_of_two(n)] == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("partitions", [1, 4, 16, 64])
def test_assign_does_not_depend_on_member_order(partitions: int) -> None:
    rng = random.Random(partitions)
    for n in range(1, 7):
        members = [f"beat{rng.randrange(10**6)}" for _ in range(n)]
        expected = assign(members, partitions)
        for _ in range(4):
            rng.shuffle(members)
            assert assign(members, partitions) == expected
            assert assign(members + members[:1], partitions) == expected


@pytest.mark.parametrize("partitions", [1, 2, 8, 16, 32, 256])
def test_assign_gives_every_member_a_fair_share(partitions: int) -> None:
    rng = random.Random(partitions)
    for n in range(1, 10):
        members = [f"b{rng.randrange(10**6)}.{i}" for i in range(n)]
        owner = assign(members, partitions)
        assert sorted(owner) == list(range(partitions))
        counts = [sum(1 for m in owner.values() if m == member) for member in members]
        assert sorted(set(counts)) <= [partitions // n, -(-partitions // n)]
        assert sum(counts) == partitions
        for member in members:
            assert share_of(member, members, partitions) == {p for p, m in owner.items() if m == member}


def test_assign_of_no_member_is_empty() -> None:
    assert assign([], 16) == {}


def test_plan_releases_what_is_no_longer_assigned() -> None:
    members = ["a", "b"]
    mine = share_of("a", members, 8)
    done = plan("a", members, held=range(8), partitions=8)
    assert done.claim == mine
    assert done.release == frozenset(range(8)) - mine
    assert plan("a", [], held=(), partitions=4).claim == frozenset(range(4))


@pytest.mark.parametrize("partitions", [4, 8, 16, 32, 64, 256])
def test_a_join_or_leave_moves_few_partitions(partitions: int) -> None:
    rng = random.Random(partitions)
    for n in range(1, 9 if partitions < 256 else 3):
        for _ in range(12 if partitions < 256 else 2):
            members = [f"b{rng.randrange(10**6)}.{i}" for i in range(n + 1)]
            before, after = assign(members[:n], partitions), assign(members, partitions)
            move = moved(before, after)
            assert move == moved(after, before)
            assert move <= movement_bound(partitions, n, n + 1), (partitions, n, members)
            # Every partition the joiner took counts, and at least its share moves.
            assert move >= sum(1 for m in after.values() if m == members[n]) >= partitions // (n + 1)


def test_trust_window_ends_a_margin_before_the_claim() -> None:
    trust = TrustWindow(ttl=15, margin=5)
    trust.renewed([1, 2], started=100.0)
    assert trust.acting(109.99) == {1, 2}
    assert trust.acting(110.0) == frozenset()
    trust.dropped([1])
    assert trust.acting(105) == {2}


# -- the keeper on its own -------------------------------------------------------------------


class Clocks:
    """A monotonic and a wall clock that move together unless told otherwise."""

    def __init__(self) -> None:
        self.mono = 500.0
        self.wall = T0

    def advance(self, seconds: float, *, mono: bool = True) -> None:
        self.mono += seconds if mono else 0.0
        self.wall += timedelta(seconds=seconds)

    def now(self) -> datetime:
        return self.wall


def keeper_on(db: FakeDb, clocks: Clocks, member: str = "a") -> PartitionKeeper:
    return PartitionKeeper(
        SimStore(db),
        member=member,
        partitions=4,
        ttl=TTL,
        renew_interval=RENEW,
        clock=lambda: clocks.mono,
        now=clocks.now,
    )


def test_a_host_that_slept_does_not_act_on_its_old_claims() -> None:
    # The monotonic clock stops while the host sleeps; the wall clock is right on waking.
    db, clocks = FakeDb(ttl=TTL), Clocks()
    keeper = keeper_on(db, clocks)
    assert keeper.keep().acting == frozenset(range(4))
    clocks.advance(2)
    db.t += 2
    assert keeper.acting() == frozenset(range(4))
    clocks.advance(40, mono=False)
    db.t += 40
    other = keeper_on(db, clocks, "b")
    other.keep()
    assert db.owner(0) == "b"
    assert keeper.acting() == frozenset()
    turn = keeper.keep()
    assert turn.members is not None, "it renews at once on waking"
    assert not turn.acting & other.acting()


def test_a_wall_clock_stepped_forward_ends_trust_early_and_back_changes_nothing() -> None:
    # Forward: as if the host had slept (the safe side), so it renews at once and acts again.
    db, clocks = FakeDb(ttl=TTL), Clocks()
    keeper = keeper_on(db, clocks)
    keeper.keep()
    clocks.wall += timedelta(seconds=60)
    assert keeper.acting() == frozenset()
    assert keeper.seconds_to_next_look() == 0
    assert keeper.keep().acting == frozenset(range(4))
    # Backward: the monotonic clock alone keeps time.
    clocks.wall -= timedelta(seconds=600)
    clocks.advance(TTL - RENEW - 0.5)
    db.t += TTL - RENEW - 0.5
    assert keeper.acting() == frozenset(range(4))
    clocks.advance(0.5)
    assert keeper.acting() == frozenset()


def test_a_claim_that_lapsed_and_was_won_again_is_gained_anew() -> None:
    # Frozen past its trust window, no keep() saw the claim lapse: the next renewal must say
    # it was lost and gained (another beat may have held it), so state kept for it is reread.
    db, clocks = FakeDb(ttl=TTL), Clocks()
    keeper = keeper_on(db, clocks)
    keeper.keep()
    clocks.advance(30)
    db.t += 30
    turn = keeper.keep()
    assert turn.acting == frozenset(range(4))
    assert turn.gained == turn.lost == frozenset(range(4))
    clocks.advance(RENEW)
    db.t += RENEW
    turn = keeper.keep()
    assert turn.gained == turn.lost == frozenset()


def test_a_failed_claim_does_not_keep_acting_for_what_was_released() -> None:
    # The renewal and the release go through, the claim fails (a serialization failure, a
    # timeout): the released partitions are the other beat's at once, so no longer ours.
    db, clocks = FakeDb(ttl=TTL), Clocks()
    a, b = keeper_on(db, clocks, "a"), keeper_on(db, clocks, "b")
    a.keep()
    b.keep()
    clocks.advance(RENEW)
    db.t += RENEW
    db.flaky.append(Fault("flaky", db.t, db.t + 1))
    turn = a.keep()
    assert turn.error is not None
    released = frozenset(range(4)) - share_of("a", ["a", "b"], 4)
    assert released and turn.lost == released
    assert not a.acting() & released
    clocks.advance(1)
    db.t += 1
    assert b.keep().acting == released
    assert not a.acting() & b.acting()


# -- the simulation: targeted histories --------------------------------------------------------


def schedules(partitions: int, count: int = 24, period: float = 1.0) -> list[Schedule]:
    names = [f"job-{i}" for i in range(count)]
    return [
        Schedule(n, period, (i % 10) / 10, partition_of(slot_of(n), partitions)) for i, n in enumerate(names)
    ]


def owners_at(sim: Sim, times: Iterable[float]) -> dict[float, dict[int, str | None]]:
    seen: dict[float, dict[int, str | None]] = {}
    for t in times:
        sim.at(t, lambda t=t: seen.__setitem__(t, {p: sim.db.owner(p) for p in range(sim.partitions)}))
    return seen


def steady(sim: Sim, beats: int) -> None:
    for slot in range(beats):
        sim.at(0.1 * slot, lambda slot=slot: sim.start_beat(slot, rate=1.0, offset=0.0))
    for k in range(1, int(sim.duration // 5)):
        sim.at(5.0 * k + 0.3, sim.check_fair)


def finished(sim: Sim) -> Sim:
    sim.run()
    sim.finish()
    assert not sim.violations, "\n".join(map(str, sim.violations[:10]))
    return sim


def test_graceful_join_and_leave_miss_nothing_and_move_the_reassigned_partitions() -> None:
    sim = Sim(1, partitions=16, schedules=schedules(16), duration=100)
    steady(sim, 2)
    sim.at(30, lambda: sim.start_beat(2, rate=1.0, offset=0.0))
    sim.at(60, lambda: sim.leave(0))
    seen = owners_at(sim, (29.9, 50, 59.9, 80))
    finished(sim)
    assert sim.missed() == []
    assert sim.fair_checks >= 5
    two, three, back = (["beat0.0", "beat1.0"], ["beat0.0", "beat1.0", "beat2.0"], ["beat1.0", "beat2.0"])
    assert (
        seen[29.9] == assign(two, 16)
        and seen[50] == seen[59.9] == assign(three, 16)
        and seen[80] == assign(back, 16)
    )
    changed = {p for p in range(16) if seen[29.9][p] != seen[50][p]}
    assert changed == {p for p in range(16) if assign(two, 16)[p] != assign(three, 16)[p]}
    assert [m for *_, m in sim.moves] == [
        16 // 2,
        moved(assign(two, 16), assign(three, 16)),
        moved(assign(three, 16), assign(back, 16)),
    ]


def test_a_killed_beat_is_taken_over_within_ttl_and_a_renewal() -> None:
    sim = Sim(2, partitions=8, schedules=schedules(8), duration=90)
    steady(sim, 2)
    sim.at(30.05, lambda: sim.crash(0, restart_after=None))  # just after its renewal at 30
    samples = [30 + 0.25 * k for k in range(120)]
    seen = owners_at(sim, samples)
    finished(sim)
    taken = next(t for t in samples if all(o == "beat1.0" for o in seen[t].values()))
    assert 30 < taken <= 30 + TTL + RENEW + 0.25
    missed = sim.missed()
    assert missed and all(reason == "crash" for *_, reason in missed)
    assert all(30 - LATE <= g <= 30 + TTL + RENEW for _, g, _, _ in missed)


@pytest.mark.parametrize("clock_stops", [False, True], ids=["stopped", "host-asleep"])
def test_a_frozen_beat_publishes_nothing_after_its_trust_window(clock_stops: bool) -> None:
    # Frozen for 2 TTLs: beat1 takes its partitions over, and on thawing beat0 must neither
    # publish on its old trust nor from what it knew before it froze (sim.violations).
    sim = Sim(3, partitions=8, schedules=schedules(8), duration=120)
    steady(sim, 2)
    sim.at(31, lambda: sim.freeze(0, 2 * TTL, clock_stops=clock_stops))  # a second after a renewal
    finished(sim)
    frozen_pubs = [
        (name, g, run.time)
        for (name, g), runs in sim.db.runs.items()
        for run in runs
        if run.member == "beat0.0" and 31 <= run.time <= 31 + 2 * TTL
    ]
    assert frozen_pubs == []
    assert any(
        run.member == "beat0.0" and run.time > 31 + 2 * TTL for runs in sim.db.runs.values() for run in runs
    ), "beat0 acts again after thawing and a renewal"
    assert all(reason for *_, reason in sim.missed())


def test_drift_offsets_and_latency_keep_the_protocol_safe() -> None:
    sim = Sim(4, partitions=16, schedules=schedules(16, period=2.0), duration=120)
    for slot, (rate, offset) in enumerate([(0.98, -1.0), (1.02, 1.0), (1.0, 0.5)]):
        sim.at(0.2 * slot, lambda slot=slot, r=rate, o=offset: sim.start_beat(slot, rate=r, offset=o))
    sim.at(40, lambda: sim.spike(40, 10, 2 * TTL))
    for k in range(1, 24):
        sim.at(5.0 * k + 0.3, sim.check_fair)
    finished(sim)
    assert sim.fair_checks >= 5
    assert all(reason == "latency" for *_, reason in sim.missed())


# -- the simulation: seeded histories ------------------------------------------------------------


def run_histories(seeds: range, kinds: tuple[str, ...]) -> list[Sim]:
    sims, failed = [], []
    for seed in seeds:
        sim = random_history(seed, kinds=kinds)
        sims.append(sim)
        bad = [str(v) for v in sim.violations]
        bad += [
            f"seed {seed}: {a}->{b} beats moved {m} > {movement_bound(sim.partitions, a, b)}"
            for a, b, m in sim.moves
            if m > movement_bound(sim.partitions, a, b)
        ]
        if bad:
            failed.append(f"seed {seed} ({kinds}): " + "; ".join(bad[:3]))
    assert not failed, f"{len(failed)} histories failed, replay with random_history(seed):\n" + "\n".join(
        failed[:10]
    )
    return sims


def test_seeded_histories_with_faults() -> None:
    sims = run_histories(range(FAULT_HISTORIES), GRACEFUL + FAULTS)
    # The checks ran: settled assignments were checked, faults did make grid times late.
    assert sum(s.fair_checks for s in sims) > FAULT_HISTORIES
    reasons = {r for s in sims for *_, r in s.missed()}
    assert {"crash", "freeze", "suspend", "latency", "outage", "flaky", "clock step"} <= {
        k for r in reasons for k in r.split(",")
    }


def test_seeded_histories_of_joins_and_leaves_miss_nothing() -> None:
    sims = run_histories(range(10**6, 10**6 + GRACEFUL_HISTORIES), GRACEFUL)
    assert sum(s.fair_checks for s in sims) > GRACEFUL_HISTORIES
    assert all(reason == "no beat" for s in sims for *_, reason in s.missed())
    assert sum(len(s.moves) for s in sims) > GRACEFUL_HISTORIES
