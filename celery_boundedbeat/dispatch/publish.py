"""Publishing claimed rows exactly as ``app.send_task`` would, at a fraction of its cost.

``send_task`` per row was the dispatcher's bottleneck: it looks up the task, its options, the
router, the backend and the node name again for every message. :class:`Publisher` does the
same work through Celery's own amqp layer (``create_task_message``, ``send_task_message``)
with what stays the same for a whole batch looked up once (:class:`_BatchCache`), and with
Celery's ``confirm_publish`` it collects the broker's confirms once per batch instead of once
per message (:class:`_ConfirmingPublisher`). Because this re-does a library's work,
``tests/dispatch/test_message_parity.py`` pins it to Celery's own ``send_task`` output on a
real RabbitMQ: same routing, headers, properties and body.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from datetime import datetime
from time import monotonic
from typing import Any

from celery import Celery, signals
from celery.utils.nodenames import anon_nodename
from kombu.messaging import Producer

from ..db.claims import Claimed
from .frames import Framer

# The publish path logs under the dispatcher's logger: one name to configure for both halves.
logger = logging.getLogger("celery_boundedbeat.dispatch")


#: The error of a batch cut short because its claim may have passed to another dispatcher.
CLAIM_EXPIRED = "the batch's claim expired before it was published (the dispatcher was paused)"

#: The error of a batch cut short because the process is stopping (its grace is over).
STOPPED = "the dispatcher was stopped in the middle of a batch"

#: Celery's signals sent around each publish: with receivers, messages are not recorded ahead.
_PUBLISH_SIGNALS = (signals.before_task_publish, signals.after_task_publish, signals.task_sent)

#: Messages per flush of kombu's publish batch (see ``Publisher._publish_rows``).
PUBLISH_CHUNK = 100

#: Options whose handling in ``app.send_task`` is more than routing (delayed delivery).
_NEEDS_SEND_TASK = frozenset({"eta", "countdown", "chain", "link", "link_error", "chord", "group_id"})


class Publisher:
    """Publishes batches of claimed rows, each message with ``task_id`` = run id.

    With Celery's ``confirm_publish`` on AMQP, a row counts as published only once the broker
    acknowledged its message. ``close()`` after each drain gives back the confirming
    connection (the next ``publish`` opens a fresh one).
    """

    def __init__(self, app: Celery, *, confirm_timeout: float) -> None:
        self.app = app
        self._sent_event = bool(app.conf.task_send_sent_event)
        #: Celery's ``confirm_publish`` asks for broker confirms; on AMQP we collect them per batch.
        self._confirming = _ConfirmingPublisher(app, confirm_timeout) if _wants_confirms(app) else None
        #: The producer :meth:`prepare` holds for the publish (``hold=True``) and its framer.
        self._held: ExitStack | None = None
        self._held_producer: Any = None
        self._framer: Framer | None = None
        #: The rows of the current (or last) :meth:`publish` handed to the broker so far, in
        #: order: each is added just before the write that may carry its message. A publish cut
        #: short by an exception (SystemExit from a signal handler) leaves here every row the
        #: broker took or may have taken, so none of them is ever given back to be sent again.
        self.handed: list[Claimed] = []

    @property
    def confirms(self) -> bool:
        """Whether rows count as published only once the broker confirmed their message."""
        return self._confirming is not None

    def publish(
        self,
        batch: list[Claimed],
        *,
        deadline: float = math.inf,
        ready: Mapping[int, Ready] | None = None,
        cut: threading.Event | None = None,
    ) -> tuple[list[Claimed], str | None]:
        """Publish a batch; return the rows the broker took and the error that stopped it.

        With confirms, "took" means the broker acknowledged the message: the rows it refused
        or never answered for go back to the queue, however far the batch got.

        ``deadline`` (``time.monotonic()``) is when the batch's claim may have passed to
        another dispatcher: no message is published after it (the error is
        :data:`CLAIM_EXPIRED`). A process frozen mid-batch (SIGSTOP, a long pause) thus never
        goes on to publish rows that another dispatcher re-claimed and published meanwhile.

        ``ready`` holds messages built ahead by :meth:`prepare` (by queue row id): those rows
        only need the broker write.

        ``cut`` set (a stopping process's grace is over) stops the batch at its next message
        (the error is :data:`STOPPED`), so what the broker took can be recorded before exit.
        """
        publisher = self._confirming
        done: list[Claimed] = []
        self.handed = []
        first_tag = 0
        expired = False
        try:
            cache = _BatchCache(self.app)
            if publisher is not None:
                first_tag = publisher.next_tag
                producing: Any = nullcontext(publisher.producer())
            elif self._held_producer is not None:
                producing = nullcontext(self._held_producer)
            else:
                producing = self.app.producer_or_acquire()
            with producing as producer:
                expired = self._publish_rows(producer, batch, cache, deadline, done, ready or {}, cut)
            if publisher is not None:
                sent = len(done)
                done = publisher.accepted(first_tag, done, wait=True)
                if len(done) < sent:
                    refused = sent - len(done)
                    return done, f"the broker refused {refused} of {sent} messages (negative acknowledgement)"
        except Exception as exc:
            if publisher is not None:
                done = publisher.accepted(first_tag, done, wait=False)
                publisher.close()  # the next batch starts on a fresh connection
            return done, f"{type(exc).__name__}: {exc}"
        if expired:
            return done, STOPPED if cut is not None and cut.is_set() else CLAIM_EXPIRED
        return done, None

    def _publish_rows(
        self,
        producer: Any,
        batch: list[Claimed],
        cache: _BatchCache,
        deadline: float,
        done: list[Claimed],
        ready: Mapping[int, Ready],
        cut: threading.Event | None = None,
    ) -> bool:
        """Publish chunk after chunk, appending each flushed chunk to ``done``; True when the
        deadline (or ``cut``) cut it short.

        Each chunk goes through kombu's ``Producer.batch()``: on Redis one pipelined round trip
        instead of one per message (a third of the time per message), elsewhere message by
        message as before. A chunk counts as published only once it was flushed, so a broker
        failure leaves at most that one chunk in doubt (republished with the same task ids),
        as a lost reply leaves one message in doubt without batching.
        """
        declared: set[str] = set()
        framer = self._framer if self._framer is not None and self._framer.usable(producer) else None
        # Not built ahead (the dispatcher loop): each chunk is still framed before it is written.
        recorder = None
        if not ready and framer is None and self._may_record():
            framer = Framer.of(producer)
            recorder = _Recorder(producer) if framer is not None else None
        for start in range(0, len(batch), PUBLISH_CHUNK):
            rows = batch[start : start + PUBLISH_CHUNK]
            if recorder is not None and framer is not None:
                ready = self._frame_chunk(producer, rows, cache, declared, recorder, framer)
            chunk: list[Claimed] = []
            # Room for every command a chunk can need (a queue with an expiry adds a command per
            # priority step): nothing is flushed before the chunk is complete.
            with _publish_batch(producer):
                expired = self._publish_chunk(
                    producer, rows, cache, deadline, chunk, ready, framer, declared, cut
                )
            done.extend(chunk)
            if expired:
                return True
        return False

    def _publish_chunk(
        self,
        producer: Any,
        rows: list[Claimed],
        cache: _BatchCache,
        deadline: float,
        chunk: list[Claimed],
        ready: Mapping[int, Ready],
        framer: Framer | None,
        declared: set[str],
        cut: threading.Event | None = None,
    ) -> bool:
        """Publish ``rows`` into ``chunk``; frames built ahead go out in one write per run of them."""
        frames: list[bytes] = []
        framed: list[Claimed] = []  # the rows of ``frames``, handed at their write
        handed = self.handed
        expired = False
        for row in rows:
            if monotonic() >= deadline or (cut is not None and cut.is_set()):
                expired = True
                break
            built = ready.get(row.id)
            if built is not None and built.frames is not None and framer is not None:
                if built.tracked:
                    cache.backend.on_task_call(producer, built.task_id)
                frames.append(built.frames)
                framed.append(row)
            else:
                if frames and framer is not None:
                    handed.extend(framed)
                    framed.clear()
                    framer.write(b"".join(frames))
                    frames.clear()
                handed.append(row)
                if built is None:
                    self._publish_row(producer, row, cache, declared)
                else:
                    self._deliver(producer, built, cache)
            chunk.append(row)
        if frames and framer is not None:
            handed.extend(framed)
            framer.write(b"".join(frames))
        return expired

    def _may_record(self) -> bool:
        """Whether the dispatcher's chunks may be framed: no confirms, nothing listening to publishes."""
        return not (
            self._confirming is not None or self._sent_event or any(s.receivers for s in _PUBLISH_SIGNALS)
        )

    def _frame_chunk(
        self,
        producer: Any,
        rows: list[Claimed],
        cache: _BatchCache,
        declared: set[str],
        recorder: _Recorder,
        framer: Framer,
    ) -> dict[int, Ready]:
        """Build a chunk's messages and their frames just before it is written (see :mod:`.frames`).

        One socket write per chunk instead of ``basic_publish``'s per message: the dispatcher's
        drain then costs less per message than a loop of ``Producer.publish``.
        """
        built: dict[int, Ready] = {}
        for row in rows:
            options = self._options(row, declared)
            if _NEEDS_SEND_TASK.isdisjoint(options):
                ready = built[row.id] = self._build(row, options, cache)
                ready.wire = recorder.record(self.app, ready)
                if ready.wire is not None:
                    ready.frames = framer.frames(producer, ready.wire)
        return built

    def _publish_row(self, producer: Any, row: Claimed, cache: _BatchCache, declared: set[str]) -> None:
        options = self._options(row, declared)
        if _NEEDS_SEND_TASK.isdisjoint(options):
            self._send(producer, row, options, cache)
            return
        self.app.send_task(
            row.task,
            args=row.args,
            kwargs=row.kwargs,
            task_id=row.task_id,
            producer=producer,
            # A failed publish fails the batch; the loop's backoff retries it.
            retry=False,
            add_to_parent=False,
            **options,
        )

    def close(self) -> None:
        """Give back the confirming connection and the held producer, if any."""
        if self._confirming is not None:
            self._confirming.close()
        held, self._held, self._held_producer, self._framer = self._held, None, None, None
        if held is not None:
            held.close()

    def prepare(self, batch: list[Claimed], *, hold: bool = False) -> dict[int, Ready]:
        """Build the messages of ``batch`` ahead of publishing them (by queue row id).

        Everything ``send_task`` does before the broker write: routing, the task's options, the
        protocol 2 message. Rows that need ``send_task`` itself (delayed delivery) are left out
        and go through it when published. Publish signals are sent at the publish, not here.
        """
        cache = _BatchCache(self.app)
        declared: set[str] = set()
        built: dict[int, Ready] = {}
        recorder = self._recorder()
        framer = self._hold_producer() if hold and recorder is not None else None
        for row in batch:
            options = self._options(row, declared)
            if _NEEDS_SEND_TASK.isdisjoint(options):
                ready = built[row.id] = self._build(row, options, cache)
                if recorder is not None:
                    ready.wire = recorder.record(self.app, ready)
                if framer is not None and ready.wire is not None:
                    ready.frames = framer.frames(self._held_producer, ready.wire)
        return built

    def _hold_producer(self) -> Framer | None:
        """Take a producer from the pool until :meth:`close`, and a framer for its channel.

        With ``hold=True`` the publish uses this producer, so frames built for its channel are
        written on that channel. Not with confirms: that path has its own connection.
        """
        if self._confirming is not None:
            return None
        self.close()
        stack = ExitStack()
        self._held_producer = stack.enter_context(self.app.producer_or_acquire())
        self._held = stack
        self._framer = Framer.of(self._held_producer)
        return self._framer

    def _recorder(self) -> _Recorder | None:
        """A stand-in producer that runs ``send_task_message`` ahead up to the broker write.

        Only where that run has no effect of its own: no receiver of Celery's publish signals
        (they must be sent at the publish) and no ``task-sent`` events (they are messages too).
        """
        if self._sent_event or any(s.receivers for s in _PUBLISH_SIGNALS):
            return None
        with self.app.producer_or_acquire() as producer:
            return _Recorder(producer)

    def _options(self, row: Claimed, declared: set[str]) -> dict[str, Any]:
        options: dict[str, Any] = dict(row.options)
        # Declare each destination once per batch, not once per message.
        route = repr(options.get("queue"))
        if route in declared:
            options.setdefault("declare", [])
        declared.add(route)
        return options

    def _send(self, producer: Any, row: Claimed, options: dict[str, Any], batch: _BatchCache) -> None:
        """Publish one message the way ``app.send_task`` does, minus its per-call overhead."""
        self._deliver(producer, self._build(row, options, batch), batch)

    def _build(self, row: Claimed, options: dict[str, Any], batch: _BatchCache) -> Ready:
        """The message ``app.send_task`` would publish for ``row``, and its publish options.

        Same routing (the task's own options, ``task_routes``), same message (protocol 2 with
        ``task_id`` = run id, expiry and time limits). Delayed messages (``eta``/``countdown``)
        go through ``send_task`` itself (see ``_NEEDS_SEND_TASK``).
        """
        app = self.app
        task_type, defaults = batch.task(row.task)
        if defaults:
            options = dict(defaults, **options)
        headers = options.pop("headers", None)
        time_limit = options.pop("time_limit", None)
        soft_time_limit = options.pop("soft_time_limit", None)
        expires = options.pop("expires", None)
        ignore_result = options.pop("ignore_result", None)
        declare = options.pop("declare", None)
        options = batch.route(options, row, task_type)
        if declare is not None:
            options["declare"] = declare
        if expires is not None:
            # The broker drops the message at expiry too (AMQP ``expiration``), as send_task does.
            options["expiration"] = _seconds_until(expires, app)
        message = app.amqp.create_task_message(
            row.task_id,
            row.task,
            row.args,
            row.kwargs,
            expires=expires,
            reply_to=batch.reply_to,
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
            create_sent_event=self._sent_event,
            ignore_result=ignore_result,
            origin=batch.origin,
            **options,
        )
        return Ready(
            task=row.task,
            task_id=row.task_id,
            message=message,
            options=options,
            headers=headers,
            tracked=not ignore_result,
        )

    def _deliver(self, producer: Any, ready: Ready, batch: _BatchCache) -> None:
        """The broker write of a built message, with Celery's publish signals."""
        if ready.tracked:
            batch.backend.on_task_call(producer, ready.task_id)
        if ready.wire is not None:
            args, kwargs = ready.wire
            producer._publish(*args, **kwargs)  # what Producer.publish passes on, recorded ahead
            return
        self.app.amqp.send_task_message(
            producer, ready.task, ready.message, headers=ready.headers, retry=False, **ready.options
        )


@dataclass(slots=True)
class Ready:
    """A message built ahead (:meth:`Publisher.prepare`): only its broker write is left."""

    task: str
    task_id: str
    #: Celery's ``task_message`` (headers, properties, body, sent event).
    message: Any
    #: Routing and publish options for ``send_task_message``.
    options: dict[str, Any]
    headers: Any
    #: Whether the result backend hears of the task (``on_task_call``), as ``send_task`` does.
    tracked: bool
    #: The serialized message as kombu's ``Producer.publish`` hands it to ``Producer._publish``
    #: (channel message, declares, broker write), recorded by :class:`_Recorder`; ``None``:
    #: ``send_task_message`` runs at the publish.
    wire: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    #: The AMQP frames of ``wire`` for the producer held until the publish (:mod:`.frames`).
    frames: bytes | None = None


class _Recording(Producer):
    """A kombu producer that keeps what ``publish`` would write instead of writing it."""

    recorded: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def _publish(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = (args, kwargs)


class _Recorder:
    """Runs Celery's ``send_task_message`` and kombu's ``Producer.publish`` ahead of time.

    Everything up to the broker write happens here, in the libraries' own code: routing,
    delivery mode, serialization, headers and properties. The publish later replays the
    recorded call on the real producer (its channel message, declares and write), so the
    message is the one ``send_task`` sends (``tests/dispatch/test_message_parity.py``).
    """

    def __init__(self, producer: Any) -> None:
        self._producer = _Recording(  # type: ignore[no-untyped-call]
            None,
            exchange=producer.exchange,
            routing_key=producer.routing_key,
            serializer=producer.serializer,
            compression=producer.compression,
            auto_declare=False,
        )

    def record(self, app: Celery, ready: Ready) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._producer.recorded = None
        app.amqp.send_task_message(
            self._producer, ready.task, ready.message, headers=ready.headers, retry=False, **ready.options
        )
        return self._producer.recorded


def _publish_batch(producer: Any) -> Any:
    """kombu's publish batch (kombu 5.7 and later); message by message with older kombu."""
    batch = getattr(producer, "batch", None)
    return nullcontext() if batch is None else batch(max_size=PUBLISH_CHUNK * 16)


def _wants_confirms(app: Celery) -> bool:
    """Whether to collect publisher confirms: asked for (Celery's ``confirm_publish``) on AMQP."""
    if not (app.conf.broker_transport_options or {}).get("confirm_publish"):
        return False
    return bool(app.connection_for_write().transport.driver_type == "amqp")


class _ConfirmingPublisher:
    """A broker connection whose channel confirms each message it accepted (AMQP).

    Used when ``broker_transport_options`` set ``confirm_publish``. Celery then waits for the
    broker after every message, a round trip each (a quarter of the unconfirmed rate here);
    the dispatcher publishes a whole batch and then collects the broker's confirms once, so a
    run is still marked ``published`` only for a message the broker acknowledged. Delivery
    tags count from 1 on the channel, one per message published on it; this channel is ours
    alone, so the count is exact. Closed at the end of each drain or after an error.
    """

    def __init__(self, app: Celery, timeout: float) -> None:
        self.app = app
        self.timeout = timeout
        #: The delivery tag the next message published on the channel will get.
        self.next_tag = 1
        self._connection: Any = None
        self._producer: Any = None
        self._unresolved = 1  # the lowest tag without an answer yet
        self._answers: dict[int, bool] = {}  # tag -> acknowledged (True) or refused (False)

    def producer(self) -> Any:
        if self._producer is None:
            # Our own connection, not one from Celery's pool: its channel must not wait per message.
            options = dict(self.app.conf.broker_transport_options or {}, confirm_publish=False)
            connection = self.app.connection_for_write(transport_options=options)
            try:
                channel = connection.default_channel
                channel.events["basic_ack"].add(self._on_ack)
                channel.events["basic_nack"].add(self._on_nack)
                channel.confirm_select()
            except BaseException:
                connection.release()
                raise
            self._connection = connection
            self._producer = self.app.amqp.Producer(channel)
        return self._producer

    def _answer(self, tag: int, multiple: bool, accepted: bool) -> None:
        first = self._unresolved if multiple else tag
        for each in range(first, tag + 1):
            self._answers.setdefault(each, accepted)
        while self._unresolved in self._answers:
            self._unresolved += 1

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._answer(delivery_tag, multiple, True)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._answer(delivery_tag, multiple, False)

    def accepted(self, first_tag: int, rows: list[Claimed], *, wait: bool) -> list[Claimed]:
        """The rows (tags from ``first_tag`` on) the broker acknowledged, waiting for its answers.

        ``rows`` are the ones published since ``first_tag``, in order: they took those tags.
        """
        self.next_tag = first_tag + len(rows)
        last = self.next_tag - 1
        if wait:
            deadline = time.monotonic() + self.timeout
            while self._unresolved <= last:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the broker did not confirm the batch within {self.timeout:g} s")
                self._connection.drain_events(timeout=remaining)
        accepted = [row for tag, row in enumerate(rows, first_tag) if self._answers.get(tag)]
        for tag in range(first_tag, last + 1):
            self._answers.pop(tag, None)
        return accepted

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.release()
            except Exception:  # already broken; nothing to give back
                logger.debug("celery_boundedbeat: closing the confirming connection failed", exc_info=True)
        # A new connection's channel numbers its messages from 1 again.
        self._connection = self._producer = None
        self.next_tag = self._unresolved = 1
        self._answers.clear()


class _BatchCache:
    """What stays the same for every message of one batch, looked up once.

    Routing is cached only without ``task_routes``: a router may look at each message's
    arguments, so with routers every message is routed on its own.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.router = app.amqp.router
        self.backend = app.backend
        self.reply_to = app.thread_oid
        self.origin = anon_nodename()
        self._tasks: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._routes: dict[Any, dict[str, Any]] | None = None if self.router.routes else {}

    def task(self, name: str) -> tuple[Any, dict[str, Any]]:
        """The registered task (or None) and its non-empty execution defaults."""
        found = self._tasks.get(name)
        if found is None:
            task_type = self.app.tasks.get(name)
            defaults: dict[str, Any] = {}
            if task_type is not None:
                defaults = {k: v for k, v in (task_type._get_exec_options() or {}).items() if v is not None}
            found = self._tasks[name] = (task_type, defaults)
        return found

    def route(self, options: dict[str, Any], row: Claimed, task_type: Any) -> dict[str, Any]:
        if self._routes is None:
            return self.router.route(options, row.task, row.args, row.kwargs, task_type)  # type: ignore[no-any-return]
        try:
            key = (row.task, frozenset(options.items()))
        except TypeError:  # an unhashable option (a declare list, a Queue object)
            return self.router.route(options, row.task, row.args, row.kwargs, task_type)  # type: ignore[no-any-return]
        routed = self._routes.get(key)
        if routed is None:
            routed = self._routes[key] = self.router.route(options, row.task, row.args, row.kwargs, task_type)
        return dict(routed)


def _seconds_until(expires: Any, app: Celery) -> float:
    """``expires`` (seconds, datetime or ISO text) as a non-negative TTL in seconds."""
    if isinstance(expires, str):
        expires = datetime.fromisoformat(expires)
    if isinstance(expires, datetime):
        when = expires if expires.tzinfo is not None else expires.replace(tzinfo=app.timezone)
        now: datetime = app.now()
        return max(0.0, (when - now).total_seconds())
    return max(0.0, float(expires))
