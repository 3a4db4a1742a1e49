"""When a crontab fires in a time zone, with Vixie cron's rule for DST changes.

The rule, as users read it: docs/policies.md, "Time zones and DST".

Pure: a fire time is asked about a time it is given, over aware datetimes, and comes back in
UTC. Celery's ``crontab.remaining_delta`` does arithmetic on local wall-clock times, so across
a DST change it can name a time that does not exist or give a repeated hour twice; here each
wall-clock match is turned into instants by the zone itself:

- a wall time that exists once fires at that instant;
- a wall time inside a gap (spring forward) fires once, at the first instant after the gap
  (the transition), whatever the job; several times in one gap make one fire;
- a wall time that happens twice (fall back) fires at its first occurrence only for a job at
  fixed hours, and at both for a job whose hour field is ``*`` or a step (hourly, every 15
  minutes), which so keeps running on elapsed time through the change.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from functools import lru_cache

#: The Gregorian calendar repeats every 400 years: a crontab Celery accepts matches within it.
MAX_SEARCH_YEARS = 400

_MINUTE = timedelta(minutes=1)
_DAY = timedelta(days=1)


@dataclass(frozen=True, slots=True)
class CronFields:
    """A crontab's expanded fields; day of week 0 is Sunday, as in cron and Celery."""

    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days_of_month: frozenset[int]
    months: tuple[int, ...]
    days_of_week: frozenset[int]
    #: The hour field is ``*`` or a step: the job keeps elapsed time across a DST change.
    elapsed: bool

    @classmethod
    def of(
        cls,
        *,
        minutes: Collection[int],
        hours: Collection[int],
        days_of_month: Collection[int],
        months: Collection[int],
        days_of_week: Collection[int],
        hour_field: object,
    ) -> CronFields:
        """Fields from their sets; ``hour_field`` is the hour as written (``"*"``, ``"*/2"``, ``3``)."""
        text = str(hour_field).replace(" ", "")
        return cls(
            minutes=tuple(sorted(minutes)),
            hours=tuple(sorted(hours)),
            days_of_month=frozenset(days_of_month),
            months=tuple(sorted(months)),
            days_of_week=frozenset(days_of_week),
            elapsed=text == "*" or "/" in text or len(set(hours)) == 24,
        )

    def day_matches(self, t: datetime) -> bool:
        """Both day fields must match (Celery's crontab, unlike Vixie's either-or)."""
        return t.day in self.days_of_month and t.isoweekday() % 7 in self.days_of_week


def next_match(fields: CronFields, naive: datetime) -> datetime | None:
    """The first wall-clock minute at or after ``naive`` (a naive local time) the fields match."""
    t = naive.replace(second=0, microsecond=0)
    if t < naive:
        t += _MINUTE
    limit = t.year + MAX_SEARCH_YEARS
    while t.year <= limit:
        i = bisect_left(fields.months, t.month)
        if i == len(fields.months):
            t = datetime(t.year + 1, fields.months[0], 1)
            continue
        if fields.months[i] != t.month:
            t = datetime(t.year, fields.months[i], 1)
            continue
        if not fields.day_matches(t):
            t = datetime(t.year, t.month, t.day) + _DAY
            continue
        h = bisect_left(fields.hours, t.hour)
        if h == len(fields.hours):
            t = datetime(t.year, t.month, t.day) + _DAY
            continue
        if fields.hours[h] != t.hour:
            t = t.replace(hour=fields.hours[h], minute=0)
        m = bisect_left(fields.minutes, t.minute)
        if m == len(fields.minutes):
            t = t.replace(minute=0) + timedelta(hours=1)
            continue
        return t.replace(minute=fields.minutes[m])
    return None


@lru_cache(maxsize=256)
def _transition(zone: tzinfo, before: datetime, after: datetime) -> datetime:
    """The first instant in ``(before, after]`` (UTC) with ``after``'s offset: where a gap ends.

    Zone transitions fall on whole seconds, so a bisection over seconds finds it exactly.
    """
    target = after.astimezone(zone).utcoffset()
    lo, hi = math.floor(before.timestamp()), math.ceil(after.timestamp())
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, zone).utcoffset() == target:
            hi = mid
        else:
            lo = mid
    return datetime.fromtimestamp(hi, UTC)


def fires_of(fields: CronFields, wall: datetime, zone: tzinfo) -> tuple[datetime, datetime | None]:
    """The instants (UTC) a matching wall time fires at: the first, and a second one or ``None``."""
    early = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    late = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if early == late:
        return early, None
    if early < late:  # happens twice: the fold of a fall-back night
        return early, (late if fields.elapsed else None)
    # In a gap: fold=0 reads it with the offset before the change, fold=1 with the one after,
    # so the change itself lies between them.
    return _transition(zone, late, early), None


def _latest(wall: datetime, zone: tzinfo) -> datetime:
    """The last instant a wall time stands for (its second occurrence in a fold)."""
    return max(wall.replace(tzinfo=zone, fold=f).astimezone(UTC) for f in (0, 1))


def next_fire(fields: CronFields, zone: tzinfo, after: datetime) -> datetime:
    """The first fire time strictly after ``after`` (aware), in UTC.

    Wall times are walked in order; the first instant of each never decreases from one wall
    time to the next, so the walk stops once it reaches the best fire found. It starts early
    enough that a repeated hour being lived the first time still yields its second occurrence.
    """
    after = after.astimezone(UTC)
    start = after.astimezone(zone).replace(tzinfo=None, fold=0)
    while _latest(start, zone) > after:
        start -= timedelta(hours=1)
    best: datetime | None = None
    wall = next_match(fields, start)
    while wall is not None:
        first, second = fires_of(fields, wall, zone)
        if best is not None and first >= best:
            break
        for t in (first, second):
            if t is not None and t > after and (best is None or t < best):
                best = t
        wall = next_match(fields, wall + _MINUTE)
    if best is None:
        raise ValueError(f"the crontab matches no time within {MAX_SEARCH_YEARS} years")
    return best
