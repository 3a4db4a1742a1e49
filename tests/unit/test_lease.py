"""LeaseKeeper: the beat lease's timing and transitions, on a fake store and a fake clock."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from helpers.clock import T0

from celery_boundedbeat.db.lease import LEASE_NAME, LeaseEvent, LeaseKeeper


class Outage(Exception):
    """Stands for a lost database connection."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return T0 + timedelta(seconds=self.now)


class FakeStore:
    """One lease row: ``owner`` holds it; ``down`` makes every call raise."""

    def __init__(self) -> None:
        self.owner: str | None = None
        self.down = False
        self.holder_query_fails = False
        self.acquired: list[tuple[str, str, datetime, float]] = []
        self.released: list[tuple[str, str]] = []
        self.holder_queries = 0

    def acquire_lease(self, name: str, holder: str, now: datetime, ttl: float) -> bool:
        if self.down:
            raise Outage("refused")
        self.acquired.append((name, holder, now, ttl))
        if self.owner in (None, holder):
            self.owner = holder
            return True
        return False

    def release_lease(self, name: str, holder: str) -> None:
        self.released.append((name, holder))
        if self.owner == holder:
            self.owner = None

    def lease_holder(self, name: str, now: datetime) -> tuple[str, datetime] | None:
        self.holder_queries += 1
        if self.down or self.holder_query_fails:
            raise Outage("refused")
        return (self.owner, now) if self.owner else None


def keeper(store: FakeStore, clock: FakeClock, ttl: float = 15.0, renew: float = 5.0) -> LeaseKeeper:
    return LeaseKeeper(store, ttl=ttl, renew_interval=renew, holder="me", clock=clock, now=clock.wall)


def test_the_first_keep_acquires_the_lease_and_says_so() -> None:
    """The first keep() takes a free lease named "beat" for ttl seconds: GAINED, and the beat may act."""
    store, clock = FakeStore(), FakeClock()
    lease = keeper(store, clock)
    assert not lease.acting() and not lease.held
    turn = lease.keep()
    assert turn.acting and turn.events == (LeaseEvent.GAINED,)
    assert turn.error is None and turn.renewal_started == clock.wall()
    assert store.acquired == [(LEASE_NAME, "me", clock.wall(), 15.0)]
    assert lease.held and lease.acting()


def test_renewals_come_every_renew_interval_and_extend_acting_quietly() -> None:
    """The lease is renewed only once per renew interval; a renewal of a held lease reports no event."""
    store, clock = FakeStore(), FakeClock()
    lease = keeper(store, clock)
    lease.keep()
    clock.now += 4.9
    turn = lease.keep()
    assert turn.renewal_started is None and turn.events == () and turn.acting
    assert len(store.acquired) == 1
    assert lease.seconds_to_renewal() == pytest.approx(0.1)
    clock.now += 0.1
    turn = lease.keep()
    assert turn.renewal_started is not None and turn.events == () and turn.acting
    assert len(store.acquired) == 2
    clock.now += 9.99  # acting lasts ttl - renew = 10 s from the start of the last renewal
    assert lease.acting()


def test_a_holder_that_cannot_renew_stops_a_renew_interval_before_expiry() -> None:
    """With ttl 15 and renew 5, a holder that cannot renew stops 10 s after its last success, once."""
    store, clock = FakeStore(), FakeClock()
    lease = keeper(store, clock)
    start = clock.now
    lease.keep()
    store.down = True
    turns = []
    while clock.now < start + 12:
        clock.now += 0.25
        turns.append((clock.now - start, lease.keep()))
    failed = [t for _, t in turns if t.error is not None]
    assert failed and all(isinstance(t.error, Outage) for t in failed)
    assert all(t.acting for at, t in turns if at < 10)
    assert not any(t.acting for at, t in turns if at >= 10)
    expired = [at for at, t in turns if LeaseEvent.EXPIRED in t.events]
    assert expired == [10.0], "stopped exactly at ttl - renew, said once"
    assert not lease.held, "nothing left to release"


def test_a_failed_renewal_is_retried_after_a_second_or_the_renew_interval_if_shorter() -> None:
    """After a failed renewal the next attempt comes min(1 s, renew interval) later, not a whole interval."""
    for renew, retry in ((5.0, 1.0), (0.5, 0.5)):
        store, clock = FakeStore(), FakeClock()
        lease = keeper(store, clock, ttl=15.0, renew=renew)
        lease.keep()
        clock.now += renew
        store.down = True
        assert lease.keep().error is not None
        assert lease.seconds_to_renewal() == pytest.approx(retry)
        clock.now += retry - 0.01
        assert lease.keep().renewal_started is None
        clock.now += 0.01
        store.down = False
        turn = lease.keep()
        assert turn.error is None and turn.renewal_started is not None and turn.events == ()


def test_another_holder_means_standing_by_announced_once() -> None:
    """A beat finding the lease held stands by: STANDING_BY with the holder's id once, silence after."""
    store, clock = FakeStore(), FakeClock()
    store.owner = "other"
    lease = keeper(store, clock)
    turn = lease.keep()
    assert not turn.acting
    assert turn.events == (LeaseEvent.STANDING_BY,) and turn.other_holder == "other"
    for _ in range(3):
        clock.now += 5
        turn = lease.keep()
        assert not turn.acting and turn.events == ()
    assert store.holder_queries == 1


def test_losing_the_lease_to_another_beat_stops_acting_at_once() -> None:
    """A holder whose renewal finds another holder stops at once (TAKEN, STANDING_BY), not at its deadline."""
    store, clock = FakeStore(), FakeClock()
    lease = keeper(store, clock)
    lease.keep()
    store.owner = "other"
    clock.now += 5
    turn = lease.keep()
    assert not turn.acting and not lease.acting()
    assert turn.events == (LeaseEvent.TAKEN, LeaseEvent.STANDING_BY)
    assert lease.release() is False and store.released == []
    store.owner = None
    clock.now += 5
    turn = lease.keep()
    assert turn.acting and turn.events == (LeaseEvent.GAINED,)
    store.owner = "third"
    clock.now += 5
    assert lease.keep().events == (LeaseEvent.TAKEN, LeaseEvent.STANDING_BY), "announced again after a gain"


def test_standing_by_without_a_readable_holder_names_nobody() -> None:
    """When the holder cannot be read, STANDING_BY carries no holder (the log says "another beat")."""
    store, clock = FakeStore(), FakeClock()
    store.owner = "other"
    store.holder_query_fails = True
    turn = keeper(store, clock).keep()
    assert turn.events == (LeaseEvent.STANDING_BY,) and turn.other_holder is None


def test_release_gives_the_lease_up_only_if_held() -> None:
    """release() deletes the lease row only when this beat holds it, and stops it acting."""
    store, clock = FakeStore(), FakeClock()
    lease = keeper(store, clock)
    assert lease.release() is False and store.released == []
    lease.keep()
    assert lease.release() is True
    assert store.released == [(LEASE_NAME, "me")] and store.owner is None
    assert not lease.acting() and not lease.held
    assert lease.release() is False and len(store.released) == 1


def test_next_look_is_the_sooner_of_renewal_and_the_end_of_acting() -> None:
    """seconds_to_next_look() is the time to the next renewal or the end of acting, whichever is sooner."""
    store, clock = FakeStore(), FakeClock()
    lease = keeper(store, clock)
    lease.keep()
    assert lease.seconds_to_next_look() == pytest.approx(5.0)
    store.down = True
    clock.now += 9.5
    lease.keep()  # fails: retry in 1 s, but acting ends in 0.5 s
    assert lease.seconds_to_next_look() == pytest.approx(0.5)
    clock.now += 3
    assert lease.seconds_to_next_look() == 0.0


def test_a_short_ttl_still_acts_half_a_second() -> None:
    """When ttl - renew is tiny the beat still acts for half a second after a renewal."""
    store, clock = FakeStore(), FakeClock()
    lease = keeper(store, clock, ttl=1.0, renew=0.9)
    lease.keep()
    clock.now += 0.49
    assert lease.acting()
    clock.now += 0.01
    assert not lease.acting()


def test_every_keeper_has_its_own_holder_id() -> None:
    """Without a given holder id each keeper makes a distinct host:pid:random one."""
    a = LeaseKeeper(FakeStore(), ttl=15, renew_interval=5)
    b = LeaseKeeper(FakeStore(), ttl=15, renew_interval=5)
    assert a.holder != b.holder and a.holder.count(":") >= 2
