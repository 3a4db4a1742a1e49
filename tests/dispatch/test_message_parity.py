"""The dispatcher's publish path (:mod:`celery_boundedbeat.dispatch.publish`) sends exactly what
``app.send_task`` would send.

``Publisher`` builds messages through Celery's amqp layer directly (and caches routing per
batch) because ``send_task`` per row was too slow; these tests pin that shortcut to the real
thing on a real RabbitMQ: same routing, headers, properties and body, for default routing,
queue options, ``task_routes``, the task's own options, custom exchanges, expiry and limits.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from amqp.exceptions import NotFound
from celery import Celery
from kombu import Connection, Exchange, Queue

from celery_boundedbeat.core.messages import message_options
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.db.claims import Claimed
from celery_boundedbeat.dispatch.publish import Publisher

pytestmark = [
    pytest.mark.rabbitmq,
    # The task-level ``queue``/``priority`` attributes still work but warn; we test that they work.
    pytest.mark.filterwarnings("ignore::celery.exceptions.CDeprecationWarning"),
]

RABBIT = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def names() -> Iterator[dict[str, str]]:
    """Unique queue and exchange names for this test; deleted afterwards."""
    uid = uuid.uuid4().hex[:10]
    made = {
        "default": f"bb_par_default_{uid}",
        "other": f"bb_par_other_{uid}",
        "routed": f"bb_par_routed_{uid}",
        "own": f"bb_par_own_{uid}",
        "exchange": f"bb_par_ex_{uid}",
        "bound": f"bb_par_bound_{uid}",
    }
    yield made
    with Connection(RABBIT) as conn:
        channel = conn.default_channel
        for key, name in made.items():
            if key == "exchange":
                channel.exchange_delete(name)
            else:
                channel.queue_delete(name)


def make_app(names: dict[str, str], *, confirms: bool = False) -> Celery:
    app = Celery(f"parity_{uuid.uuid4().hex[:6]}", broker=RABBIT, set_as_current=False)
    if confirms:
        app.conf.broker_transport_options = {"confirm_publish": True}
    app.conf.task_default_queue = names["default"]
    app.conf.task_routes = {"proj.routed": {"queue": names["routed"]}}
    app.conf.task_create_missing_queues = True

    @app.task(name="proj.plain", shared=False)
    def plain() -> None: ...

    @app.task(name="proj.own", queue=names["own"], priority=4, shared=False)
    def own() -> None: ...

    app.finalize()  # as in a running beat or dispatcher
    return app


def received(queue: str) -> dict[str, Any]:
    """The one message waiting on ``queue``, with the parts a worker would see."""
    deadline = time.monotonic() + 10
    with Connection(RABBIT) as conn:
        # Publishing is asynchronous: the message may still be on its way.
        while (message := get(conn, queue)) is None:
            assert time.monotonic() < deadline, f"nothing arrived on {queue}"
            time.sleep(0.05)
        properties = dict(message.properties)
        headers = dict(properties.pop("application_headers", {}) or {})
        return {
            "headers": headers,
            "properties": properties,
            "body": message.body,
            "routing_key": message.delivery_info["routing_key"],
            "exchange": message.delivery_info["exchange"],
        }


def get(conn: Connection, queue: str) -> Any:
    try:
        return conn.default_channel.basic_get(queue, no_ack=True)
    except NotFound:  # not declared yet; the channel is closed by the error
        conn.close()
        conn.connect()
        return None


def claimed(task: str, options: dict[str, Any], *, args: list[Any] | None = None) -> Claimed:
    run_id = str(uuid.uuid4())
    now = datetime.now(UTC)
    return Claimed(
        id=1,
        run_id=run_id,
        task_id=run_id,
        task=task,
        args=args if args is not None else [1, "two"],
        kwargs={"three": 3},
        options=message_options(options, Policy(max_run_time=30.0), run_id, "parity"),
        due_at=now,
    )


CASES = [
    ("default queue", "proj.plain", {}, "default"),
    ("queue option", "proj.plain", {"queue": "{other}"}, "other"),
    ("task_routes", "proj.routed", {}, "routed"),
    ("the task's own options", "proj.own", {}, "own"),
    ("priority and expiry", "proj.plain", {"priority": 7, "expires": 600}, "default"),
    ("unregistered task", "proj.elsewhere", {"queue": "{other}"}, "other"),
]


@pytest.mark.parametrize(
    "ahead", ["", "ahead", "frames"], ids=["built at publish", "built ahead", "frames built ahead"]
)
@pytest.mark.parametrize("confirms", [False, True], ids=["pooled producer", "confirming channel"])
@pytest.mark.parametrize(("label", "task", "options", "lands_on"), CASES, ids=[c[0] for c in CASES])
def test_publisher_sends_what_send_task_sends(
    names: dict[str, str],
    label: str,
    task: str,
    options: dict[str, Any],
    lands_on: str,
    confirms: bool,
    ahead: str,
) -> None:
    """One row through ``Publisher``, the same row through ``send_task``: identical messages.

    Also with ``confirm_publish``, where ``Publisher`` publishes on its own confirming channel,
    with the messages built ahead by ``Publisher.prepare`` (a prepared tick), and with their
    AMQP frames built ahead for a held producer and written as bytes (not with confirms).
    """
    app = make_app(names, confirms=confirms)
    options = {k: (v.format(**names) if isinstance(v, str) else v) for k, v in options.items()}
    row = claimed(task, options)
    publisher = Publisher(app, confirm_timeout=10)
    assert publisher.confirms is confirms

    # Twice in one batch: the second message takes the cached route.
    twin = claimed(task, options)
    twin.id = 2
    ready = publisher.prepare([row, twin], hold=ahead == "frames") if ahead else None
    assert ready is None or set(ready) == {row.id, twin.id}
    # No publish-signal receivers here: the whole send_task_message path ran ahead.
    assert ready is None or all(r.wire is not None for r in ready.values())
    framed = ahead == "frames" and not confirms
    assert ready is None or all((r.frames is not None) is framed for r in ready.values())
    build = app.amqp.create_task_message
    if ahead:  # built ahead means built: publishing must not build them again
        app.amqp.create_task_message = None
    if framed:  # written as frames: not replayed through kombu either
        publisher._deliver = None  # type: ignore[assignment,method-assign]
    try:
        done, error = publisher.publish([row, twin], ready=ready)
    finally:
        publisher.close()
        app.amqp.create_task_message = build
    assert error is None and len(done) == 2, error
    ours = received(names[lands_on])
    ours_again = received(names[lands_on])

    reference = dict(row.options)
    app.send_task(row.task, args=row.args, kwargs=row.kwargs, task_id=row.task_id, **reference)
    theirs = received(names[lands_on])

    # ``expires`` is turned into a timestamp at publish time, so it differs by a few ms.
    for message in (ours, theirs):
        expires = message["headers"].pop("expires")
        assert (expires is None) == ("expires" not in options), (label, expires)
    for part in ("headers", "properties", "body", "routing_key", "exchange"):
        if isinstance(ours[part], dict):
            diff = {
                k: (ours[part].get(k), theirs[part].get(k))
                for k in ours[part].keys() | theirs[part].keys()
                if ours[part].get(k) != theirs[part].get(k)
            }
            assert not diff, (label, part, diff)
    assert ours == theirs, label
    assert ours_again["headers"]["id"] == twin.task_id
    assert ours_again["routing_key"] == ours["routing_key"] and ours_again["exchange"] == ours["exchange"]


def test_custom_exchange_and_routing_key(names: dict[str, str]) -> None:
    """An explicit exchange and routing key are honoured exactly as ``send_task`` honours them."""
    app = make_app(names)
    exchange = Exchange(names["exchange"], type="topic")
    with Connection(RABBIT) as conn:
        Queue(names["bound"], exchange, routing_key="reports.#")(conn.default_channel).declare()
    options = {"exchange": names["exchange"], "routing_key": "reports.daily"}
    row = claimed("proj.plain", options)
    done, error = Publisher(app, confirm_timeout=10).publish([row])  # no confirms: nothing to close
    assert error is None and done == [row], error
    ours = received(names["bound"])
    app.send_task(row.task, args=row.args, kwargs=row.kwargs, task_id=row.task_id, **dict(row.options))
    theirs = received(names["bound"])
    assert ours == theirs
    assert (ours["exchange"], ours["routing_key"]) == (names["exchange"], "reports.daily")


def test_messages_built_ahead_send_the_publish_signals_at_the_publish(names: dict[str, str]) -> None:
    """With a receiver of Celery's publish signals, nothing is sent while building ahead: the
    signals come with the broker write, once per message."""
    from celery import signals

    app = make_app(names)
    heard: list[tuple[str, str]] = []

    def before(headers: dict[str, Any], **_: Any) -> None:
        heard.append(("before", headers["id"]))

    def after(headers: dict[str, Any], **_: Any) -> None:
        heard.append(("after", headers["id"]))

    signals.before_task_publish.connect(before, weak=False)
    signals.after_task_publish.connect(after, weak=False)
    try:
        rows = [claimed("proj.plain", {}), claimed("proj.plain", {})]
        rows[1].id = 2
        publisher = Publisher(app, confirm_timeout=10)
        ready = publisher.prepare(rows)
        assert heard == [] and all(r.wire is None for r in ready.values())
        done, error = publisher.publish(rows, ready=ready)
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)
    assert error is None and done == rows
    assert heard == [(kind, r.task_id) for r in rows for kind in ("before", "after")]
    assert received(names["default"])["headers"]["id"] == rows[0].task_id
