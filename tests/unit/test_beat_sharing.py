"""What a partitioned beat logs about its share: the lines read in order give what it holds.

A beat frozen past its trust window (SIGSTOP, a starved VM) loses its partitions and, on its
first renewal after waking, may win some of them back in the same turn. Its log must say the
lapse first and the gain after, so an operator (or a test) replaying the log ends with what
the beat ticks, and name the lapse for what it is, not a handover.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import pytest
from helpers.clock import T0
from helpers.partition_sim import FakeDb, SimStore

from celery_boundedbeat.beat.sharing import keep_share
from celery_boundedbeat.db.partitions import PartitionKeeper

TTL, RENEW = 6.0, 2.0


class Clocks:
    def __init__(self) -> None:
        self.mono = 100.0

    def now(self) -> datetime:
        return T0 + timedelta(seconds=self.mono)


def replay(lines: list[str]) -> set[int]:
    """The partitions the log says the beat ticks, read line by line."""
    held: set[int] = set()
    for line in lines:
        if " now ticks " in line:
            held |= {int(p) for p in line.split("partition(s) ", 1)[1].split(" of ", 1)[0].split(", ")}
        elif " gave up " in line:
            held -= {int(p) for p in line.split("partition(s) ", 1)[1].split(" (", 1)[0].split(", ")}
    return held


def test_a_beat_frozen_past_its_trust_window_logs_the_lapse_before_winning_its_share_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    db = FakeDb(ttl=TTL)
    clocks = Clocks()
    keeper = PartitionKeeper(
        SimStore(db),
        member="a",
        partitions=4,
        ttl=TTL,
        renew_interval=RENEW,
        clock=lambda: clocks.mono,
        now=clocks.now,
    )
    caplog.set_level(logging.INFO, logger="celery_boundedbeat")
    share, _turn = keep_share(keeper, failed=lambda *_: None, succeeded=lambda _: None)
    assert share.mine == (0, 1, 2, 3)
    clocks.mono += 2 * TTL  # frozen: no other beat came, so its claims are free to win again
    db.t += 2 * TTL
    caplog.clear()
    share, turn = keep_share(keeper, failed=lambda *_: None, succeeded=lambda _: None)
    assert share.mine == (0, 1, 2, 3)
    assert turn.gained == turn.lost == frozenset({0, 1, 2, 3})
    lines = [r.getMessage() for r in caplog.records]
    assert replay(lines) == {0, 1, 2, 3}, lines
    assert "not renewed in time" in next(line for line in lines if " gave up " in line), lines
