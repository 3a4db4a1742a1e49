"""The beat lease: which of several beats on one database schedules, and until when.

:class:`LeaseKeeper` is a small state machine around three store calls (``acquire_lease``,
``release_lease``, ``lease_holder``). It renews every ``renew_interval`` and lets its beat
act only until ``ttl - renew_interval`` after the *start* of its last successful renewal,
so a holder that cannot renew (database lost, process frozen) stops a whole renew interval
before its lease can expire for the others. A failed renewal is retried after
``min(1 s, renew_interval)``, giving a holder several attempts before it has to stop;
finding another holder stops it at once, whatever its own clock says.

The keeper does not log: each :meth:`LeaseKeeper.keep` returns a :class:`LeaseTurn` naming
the transitions, and the scheduler logs and acts on them. Time comes from an injected
monotonic ``clock`` so the timing is tested with plain numbers.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from enum import Enum
from typing import Protocol

from .store import utcnow

#: The name of the beat lease row (``boundedbeat_leases.name``).
LEASE_NAME = "beat"
#: The shortest stretch a renewal lets a beat act, however short ``ttl - renew_interval`` is.
MIN_ACTING = 0.5
#: The longest wait before a failed renewal is tried again (seconds).
RETRY_AFTER_ERROR = 1.0


class LeaseStore(Protocol):
    """The store calls the keeper makes (:class:`~celery_boundedbeat.db.store.Store` has them)."""

    def acquire_lease(self, name: str, holder: str, now: datetime, ttl: float) -> bool: ...

    def release_lease(self, name: str, holder: str) -> None: ...

    def lease_holder(self, name: str, now: datetime) -> tuple[str, datetime] | None: ...


class LeaseEvent(Enum):
    """A transition of the lease, as seen by this beat."""

    #: A renewal found the lease ours after this beat did not hold it: it may schedule.
    GAINED = "gained"
    #: Another beat holds the lease this beat held: it stopped at once.
    TAKEN = "taken"
    #: Another beat holds the lease; said once per stretch of standing by.
    STANDING_BY = "standing_by"
    #: No renewal succeeded in time: this beat stopped a renew interval before expiry.
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseTurn:
    """What one :meth:`LeaseKeeper.keep` did and found."""

    #: Whether this beat may schedule now.
    acting: bool = False
    #: The transitions of this turn, in the order they happened.
    events: tuple[LeaseEvent, ...] = ()
    #: Wall-clock start of the renewal made this turn (``None``: none was due).
    renewal_started: datetime | None = None
    #: What that renewal raised (``None``: it reached the database).
    error: Exception | None = None
    #: With :attr:`LeaseEvent.STANDING_BY`: who holds the lease, if that could be read.
    other_holder: str | None = None


def new_holder_id() -> str:
    """A holder id unique per process and start: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaseKeeper:
    """Keeps (or waits for) one lease and says when its beat may act."""

    def __init__(
        self,
        store: LeaseStore,
        *,
        ttl: float,
        renew_interval: float,
        holder: str | None = None,
        name: str = LEASE_NAME,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = utcnow,
    ) -> None:
        self.name = name
        self.holder = holder or new_holder_id()
        self.ttl = ttl
        self.renew_interval = renew_interval
        #: Monotonic time of the next renewal attempt (0: at the next :meth:`keep`).
        self.next_renewal_at = 0.0
        self._store = store
        self._clock = clock
        self._now = now
        self._acting_until = 0.0
        self._held = False
        self._announced_standby = False

    @property
    def held(self) -> bool:
        """Whether this beat holds the lease as far as it knows (what :meth:`release` gives up)."""
        return self._held

    def acting(self) -> bool:
        """Whether this beat may schedule now (safe to call from any thread)."""
        return self._clock() < self._acting_until

    def keep(self) -> LeaseTurn:
        """Renew if it is time, then say whether this beat may act and what changed."""
        mono = self._clock()
        turn = self._renew(mono) if mono >= self.next_renewal_at else LeaseTurn()
        acting = self.acting()
        if not acting and self._held:
            self._held = False
            return replace(turn, events=(*turn.events, LeaseEvent.EXPIRED))
        return replace(turn, acting=acting)

    def seconds_to_renewal(self) -> float:
        """Seconds until the next renewal attempt (negative when overdue)."""
        return self.next_renewal_at - self._clock()

    def seconds_to_next_look(self) -> float:
        """Seconds until the lease needs attention: a renewal, or the end of acting."""
        return max(min(self.next_renewal_at, self._acting_until) - self._clock(), 0.0)

    def release(self) -> bool:
        """Stop acting and give the lease up if held, so a standby takes over at once."""
        if not self._held:
            return False
        self._held = False
        self._acting_until = 0.0
        self._store.release_lease(self.name, self.holder)
        return True

    def _renew(self, mono: float) -> LeaseTurn:
        """One renewal attempt; ``mono`` was read before it began."""
        started = self._now()
        self.next_renewal_at = mono + self.renew_interval
        try:
            ours = self._store.acquire_lease(self.name, self.holder, started, self.ttl)
        except Exception as exc:
            self.next_renewal_at = mono + min(RETRY_AFTER_ERROR, self.renew_interval)
            return LeaseTurn(renewal_started=started, error=exc)
        if ours:
            return LeaseTurn(renewal_started=started, events=self._kept(mono))
        events, other = self._refused(started)
        return LeaseTurn(renewal_started=started, events=events, other_holder=other)

    def _kept(self, mono: float) -> tuple[LeaseEvent, ...]:
        # ``mono`` precedes the renewal, so acting ends a whole renew interval before the
        # lease (written as now + ttl) can expire for the other beats.
        self._acting_until = mono + max(self.ttl - self.renew_interval, MIN_ACTING)
        if self._held:
            return ()
        self._held = True
        self._announced_standby = False
        return (LeaseEvent.GAINED,)

    def _refused(self, started: datetime) -> tuple[tuple[LeaseEvent, ...], str | None]:
        self._acting_until = 0.0
        events: tuple[LeaseEvent, ...] = ()
        if self._held:
            self._held = False
            events = (LeaseEvent.TAKEN,)
        if self._announced_standby:
            return events, None
        self._announced_standby = True
        try:
            found = self._store.lease_holder(self.name, started)
        except Exception:
            found = None  # only for the log line: "another beat" says enough
        return (*events, LeaseEvent.STANDING_BY), found[0] if found else None
