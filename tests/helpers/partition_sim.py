"""A discrete-event simulation of the partition protocol, driving the beats' own keeper.

Every beat runs the real :class:`~celery_boundedbeat.db.partitions.PartitionKeeper` (and so the
pure :mod:`~celery_boundedbeat.core.partitions` code) against one fake database, under fake
clocks: the database's clock is the simulation's time (it alone decides expiry, as the real
store does); each beat has a monotonic clock that runs slightly fast or slow (drift) and a wall
clock off by a fixed offset. Faults: crashes (no leave; a restart is a new member), freezes
longer than the TTL (``freeze``: the process is stopped and its monotonic clock runs on;
``suspend``: the host sleeps and its monotonic clock stops while the wall clock does not),
database latency spikes (a call started inside one reaches the database late and returns
later still), outages (calls fail), ``flaky`` claims (the claim fails after the renewal and
release went through), wall clock steps (corrected later), joins and graceful leaves
(``keeper.leave()``). A failing history replays exactly from its seed.

A beat's step: ``keeper.keep()``, then for each schedule in its acting partitions, publish the
grid times its wall clock says are due. A beat keeps each acting partition's next grid times
in memory, loaded from the database when the partition starts acting (as a beat that takes a
partition over reads its schedules' rows), so two beats acting at once would publish twice:
the fake database records every publish instead of refusing the second by a unique key, and
checks at each publish that the publisher holds an unexpired claim for the partition and is
inside the trust window its last renewal gave it.

Store calls inside one keep() run at one database instant (a latency spike delays that instant
and the return); the tick transaction runs at the step's instant (its own duplicates are the
unique run key's business, not this protocol's).
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from celery_boundedbeat.core.partitions import assign, moved, partition_of, slot_of
from celery_boundedbeat.db.partitions import PartitionKeeper

T0 = datetime(2030, 1, 1, tzinfo=UTC)
TTL = 15.0
RENEW = 5.0
#: The longest a beat sleeps between steps (it wakes sooner for a renewal or a due grid time).
STEP = 2.0
#: The shortest (grid times closer than this are published together).
NAP = 0.5
#: The largest monotonic clock drift and wall clock offset the histories draw.
MAX_DRIFT = 0.02
MAX_OFFSET = 1.0
#: How late a grid time may be published outside any fault: a cooperative handover leaves a
#: partition unowned from the releaser's renewal until the new owner's next renewal (one renew
#: interval, and one more when the views of the members differ for a renewal), plus the
#: publisher's wall clock offset, the drift of those intervals and a nap. (Measured: at most 9 s.)
LATE = 2 * RENEW * (1 + MAX_DRIFT) + MAX_OFFSET + NAP
#: After a fault ends, how long the others may still need to take its partitions over: the
#: claims and member rows expire a TTL after the last renewal, and the next renewal claims them.
RECOVERY = TTL + LATE


@functools.lru_cache(maxsize=256)
def assigned(members: frozenset[str], partitions: int) -> dict[int, str]:
    """The checks' own :func:`assign` (cached: the same members are checked many times)."""
    return assign(members, partitions)


class Outage(Exception):
    """A store call inside an outage window (a lost connection)."""


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault window: the grid times it may excuse are those it overlaps (plus recovery)."""

    kind: str
    start: float
    end: float
    beat: int | None = None
    #: For latency spikes: the largest delay of a call started before ``active_end``.
    delay: float = 0.0
    active_end: float = 0.0

    def excuses(self, grid: float) -> bool:
        return self.start <= grid + LATE and grid <= self.end + RECOVERY


@dataclass(slots=True)
class Violation:
    seed: int
    time: float
    what: str

    def __str__(self) -> str:
        return f"seed {self.seed} t={self.time:.2f}: {self.what}"


@dataclass(slots=True)
class Publish:
    time: float
    member: str


@dataclass
class FakeDb:
    """Member rows, claim rows and the runs, decided on the database's clock ``t``."""

    ttl: float
    t: float = 0.0
    members: dict[str, float] = field(default_factory=dict)
    claims: dict[int, tuple[str, float]] = field(default_factory=dict)
    runs: dict[tuple[str, float], list[Publish]] = field(default_factory=dict)
    outages: list[Fault] = field(default_factory=list)
    #: Windows in which a claim fails after the renewal and release went through (a
    #: serialization failure, a statement timeout).
    flaky: list[Fault] = field(default_factory=list)
    #: The last grid time published for each schedule (what its row says).
    last: dict[str, float] = field(default_factory=dict)

    def check(self) -> None:
        if any(f.start <= self.t < f.end for f in self.outages):
            raise Outage(f"database unreachable at {self.t:.2f}")

    def live(self) -> list[str]:
        return [m for m, end in self.members.items() if end > self.t]

    def owner(self, partition: int) -> str | None:
        held = self.claims.get(partition)
        return held[0] if held and held[1] > self.t else None

    def publish(self, schedule: str, grid: float, member: str) -> None:
        self.check()
        self.runs.setdefault((schedule, grid), []).append(Publish(self.t, member))
        self.last[schedule] = max(grid, self.last.get(schedule, grid))


class SimStore:
    """The :class:`~celery_boundedbeat.db.partitions.PartitionStore` of one beat, on the fake DB."""

    def __init__(self, db: FakeDb) -> None:
        self.db = db

    def renew_member(self, member: str, now: datetime, ttl: float) -> list[str]:
        self.db.check()
        self.db.members[member] = self.db.t + ttl
        return self.db.live()

    def claim_partitions(self, member: str, partitions: Iterable[int], now: datetime, ttl: float) -> set[int]:
        self.db.check()
        if any(f.start <= self.db.t < f.end for f in self.db.flaky):
            raise Outage(f"claim failed at {self.db.t:.2f}")
        got = set()
        for p in partitions:
            held = self.db.claims.get(p)
            if held is None or held[1] <= self.db.t or held[0] == member:
                self.db.claims[p] = (member, self.db.t + ttl)
                got.add(p)
        return got

    def release_partitions(self, member: str, partitions: Iterable[int]) -> None:
        self.db.check()
        for p in partitions:
            if self.db.claims.get(p, ("",))[0] == member:
                del self.db.claims[p]

    def leave(self, member: str) -> None:
        self.db.check()
        self.db.members.pop(member, None)
        for p in [p for p, (m, _) in self.db.claims.items() if m == member]:
            del self.db.claims[p]


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    period: float
    phase: float
    partition: int

    def grids(self, start: float, end: float) -> list[float]:
        """The grid times in ``[start, end)``."""
        k = math.ceil((start - self.phase) / self.period)
        out = []
        while (g := self.phase + k * self.period) < end:
            out.append(round(g, 6))
            k += 1
        return out


class Beat:
    """One beat incarnation: a keeper, its clocks, and the grid times it keeps in memory."""

    def __init__(self, sim: Sim, slot: int, incarnation: int, rate: float, offset: float) -> None:
        self.sim = sim
        self.slot = slot
        self.member = f"beat{slot}.{incarnation}"
        self.rate = rate
        self.offset = offset
        self.mono_ref = 1000.0 * (slot + 1) + incarnation
        self.t_ref = sim.t
        self.mono_runs = True
        #: While a late keep() runs: the real time it began (the clocks read as then).
        self.pinned: float | None = None
        self.pinned_mono = 0.0
        self.alive = True
        self.frozen = False
        self.busy = False
        self.leaving = False
        self.next_due: dict[str, float] = {}
        self.loaded: set[int] = set()
        #: Real time of the renewal start that last gave each held partition its trust.
        self.trusted_from: dict[int, float] = {}
        self.keeper = PartitionKeeper(
            SimStore(sim.db),
            member=self.member,
            partitions=sim.partitions,
            ttl=sim.ttl,
            renew_interval=sim.renew,
            clock=self.clock,
            now=self.wall,
        )

    def mono_at(self, t: float) -> float:
        return self.mono_ref + (self.rate * (t - self.t_ref) if self.mono_runs else 0.0)

    def clock(self) -> float:
        return self.mono_at(self.sim.t) if self.pinned is None else self.pinned_mono

    def wall(self) -> datetime:
        t = self.sim.t if self.pinned is None else self.pinned
        return T0 + timedelta(seconds=t + self.offset)

    def stop_clock(self) -> None:
        self.mono_ref, self.t_ref, self.mono_runs = self.mono_at(self.sim.t), self.sim.t, False

    def start_clock(self) -> None:
        self.t_ref, self.mono_runs = self.sim.t, True


class Sim:
    """One seeded history: the events, the beats, the fake database and the checks."""

    def __init__(
        self,
        seed: int,
        *,
        partitions: int,
        schedules: list[Schedule],
        duration: float,
        ttl: float = TTL,
        renew: float = RENEW,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.partitions = partitions
        self.schedules = schedules
        self.by_partition: dict[int, list[Schedule]] = {}
        for s in schedules:
            self.by_partition.setdefault(s.partition, []).append(s)
        self.duration = duration
        self.ttl = ttl
        self.renew = renew
        self.t = 0.0
        self.db = FakeDb(ttl=ttl)
        self.beats: dict[int, Beat] = {}
        self.incarnations: dict[int, int] = {}
        self.faults: list[Fault] = []
        self.spikes: list[Fault] = []
        self.violations: list[Violation] = []
        self.moves: list[tuple[int, int, int]] = []
        self.fair_checks = 0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._quiet_from = 0.0
        self._empty_from: float | None = None

    # -- events ----------------------------------------------------------------------------

    def at(self, t: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (t, self._seq, action))

    def run(self) -> None:
        while self._queue:
            t, _, action = heapq.heappop(self._queue)
            if t > self.duration:
                break
            self.t = self.db.t = t
            action()

    def flag(self, what: str) -> None:
        self.violations.append(Violation(self.seed, self.t, what))

    # -- membership --------------------------------------------------------------------------

    def start_beat(self, slot: int, *, rate: float | None = None, offset: float | None = None) -> Beat:
        inc = self.incarnations[slot] = self.incarnations.get(slot, -1) + 1
        rate = rate if rate is not None else 1 + self.rng.uniform(-MAX_DRIFT, MAX_DRIFT)
        offset = offset if offset is not None else self.rng.uniform(-MAX_OFFSET, MAX_OFFSET)
        before = self.alive_members()
        beat = self.beats[slot] = Beat(self, slot, inc, rate, offset)
        self.membership(before, before | {beat.member}, self.t)
        self.step(beat)
        return beat

    def live_beats(self) -> list[Beat]:
        return [b for b in self.beats.values() if b.alive and not b.frozen]

    def membership(self, before: set[str], after: set[str], quiet_from: float) -> None:
        """The live beats change: the movement (``before`` empty: not a join or leave), when the
        assignment may settle, and the spells with no beat at all."""
        if before and after and before != after:
            move = moved(
                assigned(frozenset(before), self.partitions), assigned(frozenset(after), self.partitions)
            )
            self.moves.append((len(before), len(after), move))
        self._quiet_from = max(self._quiet_from, quiet_from)
        if not after and self._empty_from is None:
            self._empty_from = self.t
        elif after and self._empty_from is not None:
            self.faults.append(Fault("no beat", self._empty_from, self.t))
            self._empty_from = None

    def alive_members(self) -> set[str]:
        return {b.member for b in self.beats.values() if b.alive}

    def crash(self, slot: int, restart_after: float | None) -> None:
        beat = self.beats.get(slot)
        if beat is None or not beat.alive:
            return
        beat.alive = False
        self.faults.append(Fault("crash", self.t, self.t, slot))
        self.membership(set(), self.alive_members(), self.t + self.ttl)
        if restart_after is not None:
            self.at(self.t + restart_after, lambda: self.start_beat(slot))

    def leave(self, slot: int) -> None:
        beat = self.beats.get(slot)
        if beat is not None and beat.alive:
            beat.leaving = True

    def freeze(self, slot: int, seconds: float, *, clock_stops: bool) -> None:
        beat = self.beats.get(slot)
        if beat is None or not beat.alive or beat.frozen:
            return
        beat.frozen = True
        if clock_stops:
            beat.stop_clock()
        kind = "suspend" if clock_stops else "freeze"
        self.faults.append(Fault(kind, self.t, self.t + seconds, slot))
        self._quiet_from = max(self._quiet_from, self.t + seconds + self.ttl)

        def thaw() -> None:
            if clock_stops:
                beat.start_clock()
            beat.frozen = False
            if not beat.busy:
                self.step(beat)

        self.at(self.t + seconds, thaw)

    def step_clock(self, slot: int, seconds: float, lasting: float) -> None:
        """The beat's wall clock is stepped wrong, and right again ``lasting`` seconds later."""
        beat = self.beats.get(slot)
        if beat is None or not beat.alive:
            return
        if beat.frozen:
            # Stepped (and corrected) by a running host: a wall clock stepped back between two
            # looks of a keeper would hide a sleep from it (the beat's clock should count sleep).
            self.at(self.t + 1.0, functools.partial(self.step_clock, slot, seconds, lasting))
            return
        beat.offset += seconds
        self.faults.append(Fault("clock step", self.t, self.t + lasting + abs(seconds), slot))
        self._quiet_from = max(self._quiet_from, self.t + lasting + self.ttl)

        def corrected() -> None:
            if beat.frozen:
                self.at(self.t + 1.0, corrected)
            else:
                beat.offset -= seconds

        self.at(self.t + lasting, corrected)

    def spike(self, start: float, seconds: float, delay: float) -> None:
        fault = Fault("latency", start, start + seconds + delay, delay=delay, active_end=start + seconds)
        self.faults.append(fault)
        self.spikes.append(fault)
        self._quiet_from = max(self._quiet_from, start + seconds + delay + self.ttl)

    def outage(self, start: float, seconds: float, *, kind: str = "outage") -> None:
        """Store calls fail (``flaky``: only claims, after the renewal and release went through)."""
        fault = Fault(kind, start, start + seconds)
        self.faults.append(fault)
        (self.db.flaky if kind == "flaky" else self.db.outages).append(fault)
        self._quiet_from = max(self._quiet_from, start + seconds + self.ttl)

    # -- a beat's step -----------------------------------------------------------------------

    def step(self, beat: Beat) -> None:
        if not beat.alive or beat.frozen or beat.busy:
            return
        if beat.leaving:
            before = self.alive_members()
            beat.alive = False
            self.membership(before, before - {beat.member}, self.t)
            try:
                beat.keeper.leave()
            except Outage:
                self.faults.append(Fault("outage", self.t, self.t, beat.slot))
            return
        delay = max((f.delay for f in self.spikes if f.start <= self.t < f.active_end), default=0.0)
        if delay and beat.keeper.seconds_to_next_look() == 0:
            there = self.rng.uniform(0, delay)
            back = self.rng.uniform(0, delay - there)
            beat.busy, beat.pinned, beat.pinned_mono, started = True, self.t, beat.clock(), self.t
            self.at(self.t + there, lambda: self.keep_late(beat, started, back))
            return
        self.keep(beat, self.t)
        self.tick(beat)

    def keep_late(self, beat: Beat, started: float, back: float) -> None:
        """A keep() begun at ``started`` reaches the database now and returns ``back`` later."""
        if not beat.alive:
            return
        self.keep(beat, started)
        beat.pinned = None

        def returned() -> None:
            beat.busy = False
            if beat.alive and not beat.frozen:
                self.tick(beat)

        self.at(self.t + back, returned)

    def keep(self, beat: Beat, started: float) -> None:
        """keep(); a partition lost (even if won again) is read afresh when it next acts."""
        turn = beat.keeper.keep()
        if turn.members is not None and turn.error is None:
            for p in beat.keeper.held:
                beat.trusted_from[p] = started
        self.unload(beat, turn.lost)

    def unload(self, beat: Beat, partitions: Iterable[int]) -> None:
        for p in partitions:
            beat.loaded.discard(p)
            for s in self.by_partition.get(p, ()):
                beat.next_due.pop(s.name, None)

    def tick(self, beat: Beat) -> None:
        acting = beat.keeper.acting()
        self.unload(beat, beat.loaded - acting)
        wall = self.t + beat.offset
        try:
            for p in sorted(acting):
                if p not in beat.loaded:
                    self.load(beat, p)
                for s in self.by_partition.get(p, ()):
                    while beat.next_due[s.name] <= wall:
                        self.check_publish(beat, p, s)
                        self.db.publish(s.name, beat.next_due[s.name], beat.member)
                        beat.next_due[s.name] = round(beat.next_due[s.name] + s.period, 6)
        except Outage:
            beat.loaded.clear()
            beat.next_due.clear()
        self.at(self.t + self.sleep(beat, wall), lambda: self.step(beat))

    def sleep(self, beat: Beat, wall: float) -> float:
        """Real seconds until the beat's next step: its next renewal or due grid time, at most STEP."""
        due = min(beat.next_due.values(), default=math.inf) - wall
        return max(min(beat.keeper.seconds_to_next_look() / beat.rate, due, STEP / beat.rate), NAP)

    def load(self, beat: Beat, partition: int) -> None:
        """Read the partition's schedules from the database: it has just started acting."""
        self.db.check()
        for s in self.by_partition.get(partition, ()):
            last = self.db.last.get(s.name)
            beat.next_due[s.name] = s.phase if last is None else round(last + s.period, 6)
        beat.loaded.add(partition)

    def check_publish(self, beat: Beat, partition: int, schedule: Schedule) -> None:
        grid = beat.next_due[schedule.name]
        if self.db.owner(partition) != beat.member:
            held = self.db.claims.get(partition)
            self.flag(
                f"{beat.member} publishes {schedule.name}@{grid} of {partition} without its claim ({held})"
            )
        started = beat.trusted_from.get(partition)
        window = (self.ttl - self.renew) / (1 - MAX_DRIFT)
        if started is None or self.t > started + window + 1e-9:
            self.flag(
                f"{beat.member} publishes {schedule.name}@{grid} after its trust window (from {started})"
            )
        others = self.db.runs.get((schedule.name, grid), [])
        if others:
            first = f"{others[0].member} at {others[0].time:.2f}"
            self.flag(f"{schedule.name}@{grid} published again by {beat.member} (first by {first})")

    # -- the checks at the end and at quiet times -------------------------------------------

    def check_fair(self) -> None:
        """Membership stable long enough: every live beat holds its fair share, all are owned."""
        if self.t < self._quiet_from + 2 * self.renew * (1 + MAX_DRIFT) + STEP:
            return
        live = self.live_beats()
        if not live or any(b.busy for b in live):
            return
        want = assigned(frozenset(b.member for b in live), self.partitions)
        self.fair_checks += 1
        n = len(live)
        for b in live:
            mine = {p for p, m in want.items() if m == b.member}
            if b.keeper.held != mine or b.keeper.acting() != mine:
                held, acting = sorted(b.keeper.held), sorted(b.keeper.acting())
                self.flag(f"{b.member} holds {held} acting {acting}, its share is {sorted(mine)}")
            if len(mine) not in (self.partitions // n, -(-self.partitions // n)):
                self.flag(f"{b.member} share {len(mine)} of {self.partitions} over {n} is not fair")
        for p in range(self.partitions):
            if self.db.owner(p) != want[p]:
                self.flag(f"partition {p} claimed by {self.db.owner(p)}, assigned to {want[p]}")

    def missed(self) -> list[tuple[str, float, float | None, str]]:
        """Grid times published later than LATE (or never): schedule, grid, lateness, reason."""
        out = []
        for s in self.schedules:
            for g in s.grids(0.0, self.duration - RECOVERY):
                runs = self.db.runs.get((s.name, g))
                late = None if not runs else runs[0].time - g
                if late is not None and late <= LATE:
                    continue
                reasons = sorted({f.kind for f in self.faults if f.excuses(g)})
                out.append((s.name, g, late, ",".join(reasons)))
        return out

    def finish(self) -> None:
        if self._empty_from is not None:
            self.faults.append(Fault("no beat", self._empty_from, self.duration))
        for s, g, late, reason in self.missed():
            if not reason:
                self.flag(f"{s}@{g} missed (late {late}) outside any fault window")


def make_schedules(rng: random.Random, count: int, partitions: int) -> list[Schedule]:
    out = []
    for i in range(count):
        name = f"sched-{i}"
        period = rng.choice((1.0, 2.0, 3.0, 5.0, 7.0, 10.0))
        out.append(
            Schedule(
                name,
                period,
                round(rng.uniform(0, period), 3) % period,
                partition_of(slot_of(name), partitions),
            )
        )
    return out


GRACEFUL = ("join", "leave")
FAULTS = ("crash", "freeze", "suspend", "spike", "outage", "flaky", "clock step")


def random_history(seed: int, *, duration: float = 90.0, kinds: tuple[str, ...] = GRACEFUL + FAULTS) -> Sim:
    """A seeded history: 1 to 4 beats at first, then 2 to 6 events of ``kinds``."""
    rng = random.Random(seed)
    partitions = rng.choice((4, 8, 16, 16, 32))
    sim = Sim(
        seed,
        partitions=partitions,
        schedules=make_schedules(rng, rng.randint(6, 16), partitions),
        duration=duration,
    )
    first = rng.randint(1, 4)
    for slot in range(first):
        sim.at(rng.uniform(0, 1.0), lambda slot=slot: sim.start_beat(slot))
    slots = first
    for _ in range(rng.randint(2, 6)):
        at = rng.uniform(5, duration - RECOVERY - 10)
        kind = rng.choice(kinds)
        if kind == "join":
            sim.at(at, lambda slot=slots: sim.start_beat(slot))
            slots += 1
        elif kind == "spike":
            sim.at(at, functools.partial(sim.spike, at, rng.uniform(1, 20), rng.uniform(1, 2 * TTL)))
        elif kind in ("outage", "flaky"):
            sim.at(at, functools.partial(sim.outage, at, rng.uniform(1, 25), kind=kind))
        else:
            slot, arg = rng.randrange(slots), rng.uniform(TTL + 1, 2.5 * TTL)
            if kind == "leave":
                sim.at(at, lambda slot=slot: sim.leave(slot))
            elif kind == "clock step":
                jump, lasting = rng.choice((-1, 1)) * rng.uniform(2, 30), rng.uniform(1, 30)
                sim.at(at, functools.partial(sim.step_clock, slot, jump, lasting))
            elif kind == "crash":
                restart = rng.choice((None, rng.uniform(1, 30)))
                sim.at(at, lambda slot=slot, r=restart: sim.crash(slot, r))
            else:
                sim.at(
                    at,
                    lambda slot=slot, s=arg, stops=kind == "suspend": sim.freeze(slot, s, clock_stops=stops),
                )
    for k in range(1, int(duration // 7)):
        sim.at(k * 7.0 + 0.25, sim.check_fair)
    sim.run()
    sim.finish()
    return sim
