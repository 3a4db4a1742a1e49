"""Bookkeeping of batch publisher confirms (``publish._ConfirmingPublisher``) with a scripted broker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_boundedbeat.db.claims import Claimed
from celery_boundedbeat.dispatch.publish import _ConfirmingPublisher, _wants_confirms


def rows(n: int) -> list[Claimed]:
    return [
        Claimed(id=i, run_id=None, task_id=f"t{i}", task="t", args=[], kwargs={}, options={}, due_at=None)  # type: ignore[arg-type]
        for i in range(n)
    ]


class ScriptedBroker:
    """Each ``drain_events`` call delivers the next scripted answer (or times out)."""

    def __init__(self, publisher: _ConfirmingPublisher, answers: list[Callable[[], None]]) -> None:
        self.answers = answers
        self.calls = 0
        publisher._connection = self

    def drain_events(self, timeout: float) -> None:
        self.calls += 1
        if not self.answers:
            raise TimeoutError("socket timed out")
        self.answers.pop(0)()


@pytest.fixture
def publisher() -> _ConfirmingPublisher:
    return _ConfirmingPublisher(Celery("confirms", set_as_current=False), timeout=1.0)


def published(publisher: _ConfirmingPublisher, batch: list[Any]) -> int:
    first = publisher.next_tag
    publisher.next_tag += len(batch)
    return first


def test_one_multiple_ack_confirms_the_whole_batch(publisher: _ConfirmingPublisher) -> None:
    batch = rows(5)
    first = published(publisher, batch)
    broker = ScriptedBroker(publisher, [lambda: publisher._on_ack(5, True)])
    assert publisher.accepted(first, batch, wait=True) == batch
    assert broker.calls == 1


def test_single_acks_out_of_order_are_waited_for_until_all_arrive(publisher: _ConfirmingPublisher) -> None:
    batch = rows(3)
    first = published(publisher, batch)
    broker = ScriptedBroker(
        publisher,
        [
            lambda: publisher._on_ack(3, False),
            lambda: publisher._on_ack(1, False),
            lambda: publisher._on_ack(2, False),
        ],
    )
    assert publisher.accepted(first, batch, wait=True) == batch
    assert broker.calls == 3


def test_nacked_messages_are_left_out_and_the_rest_kept(publisher: _ConfirmingPublisher) -> None:
    batch = rows(6)
    first = published(publisher, batch)
    ScriptedBroker(
        publisher,
        [
            lambda: publisher._on_ack(2, True),
            lambda: publisher._on_nack(4, True),
            lambda: publisher._on_ack(6, True),
        ],
    )
    assert [r.id for r in publisher.accepted(first, batch, wait=True)] == [0, 1, 4, 5]


def test_tags_continue_across_batches_on_one_channel(publisher: _ConfirmingPublisher) -> None:
    one, two = rows(2), rows(3)
    first = published(publisher, one)
    ScriptedBroker(publisher, [lambda: publisher._on_ack(2, True)])
    assert publisher.accepted(first, one, wait=True) == one
    second = published(publisher, two)
    assert second == 3
    ScriptedBroker(publisher, [lambda: publisher._on_ack(4, True), lambda: publisher._on_nack(5, False)])
    assert publisher.accepted(second, two, wait=True) == two[:2]


def test_a_broker_that_never_answers_fails_the_batch(publisher: _ConfirmingPublisher) -> None:
    batch = rows(2)
    first = published(publisher, batch)
    ScriptedBroker(publisher, [lambda: publisher._on_ack(1, False)])
    with pytest.raises(TimeoutError):
        publisher.accepted(first, batch, wait=True)


def test_without_waiting_only_what_was_already_acknowledged_counts(publisher: _ConfirmingPublisher) -> None:
    """After a failed publish, rows already acknowledged stay published; the rest go back."""
    batch = rows(4)
    first = published(publisher, batch)
    publisher._on_ack(2, True)
    assert publisher.accepted(first, batch, wait=False) == batch[:2]


def test_close_starts_the_count_again_for_a_new_connection(publisher: _ConfirmingPublisher) -> None:
    published(publisher, rows(3))
    publisher._on_ack(1, False)
    publisher.close()
    assert publisher.next_tag == 1
    batch = rows(1)
    ScriptedBroker(publisher, [lambda: publisher._on_ack(1, False)])
    assert publisher.accepted(published(publisher, batch), batch, wait=True) == batch


@pytest.mark.parametrize(
    ("broker", "options", "expected"),
    [
        ("amqp://guest@localhost//", {"confirm_publish": True}, True),
        ("amqp://guest@localhost//", {}, False),
        (
            "redis://localhost:6379/0",
            {"confirm_publish": True},
            False,
        ),  # no confirms there: writes are synchronous
        ("memory://", {"confirm_publish": True}, False),
    ],
)
def test_batch_confirms_follow_celerys_confirm_publish_on_amqp_only(
    broker: str, options: dict[str, Any], expected: bool
) -> None:
    app = Celery("confirms", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = options
    assert _wants_confirms(app) is expected
