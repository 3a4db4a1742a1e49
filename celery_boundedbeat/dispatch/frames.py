"""AMQP frames of a prepared tick, built before the due time and written in one go at it.

Replaying a recorded ``Producer._publish`` still costs about 150 µs a message on RabbitMQ
(kombu's channel message, py-amqp's method arguments, frame packing and one ``sendall``
each), so the last of a thousand prepared messages left 0.16-0.25 s after the due time. A
:class:`Framer` runs the same py-amqp code (``Channel.prepare_message``, the ``Basic.Publish``
arguments, ``method_framing.frame_writer``) ahead of time into a buffer, for the channel of
the producer the beat holds until the due time; at the due time a chunk of messages is one
socket write of bytes identical to what ``basic_publish`` would have written.

Only where that is exactly equivalent: py-amqp channels without publisher confirms, no
``mandatory``/``immediate`` flag, the same open channel and connection (and ``frame_max``) at
the write as when the frames were built. Anything else is published the usual way.
``tests/dispatch/test_message_parity.py`` compares what a consumer receives both ways.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("celery_boundedbeat.dispatch")

try:  # py-amqp is Celery's AMQP client; without it (Redis-only installs) frames are never built
    from amqp import Channel as _AmqpChannel
    from amqp import spec as _spec
    from amqp.method_framing import frame_writer as _frame_writer
    from amqp.serialization import dumps as _dumps
except ImportError:  # pragma: no cover - exercised only where py-amqp is absent
    _AmqpChannel = None

#: ``Basic.Publish`` argument signature (py-amqp's ``Channel._basic_publish``).
_PUBLISH_ARGS = "Bssbb"


class _Sink:
    """A transport stand-in: ``frame_writer`` writes into this buffer instead of the socket."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def write(self, data: Any) -> None:
        self.buffer += data


class Framer:
    """Builds the frames of recorded publishes for one producer's channel, and writes them."""

    def __init__(self, producer: Any) -> None:
        self.channel = producer.channel
        self.connection = self.channel.connection
        self.frame_max = self.connection.frame_max
        self._sink = _Sink()
        self._write = _frame_writer(self.connection, self._sink)

    @classmethod
    def of(cls, producer: Any) -> Framer | None:
        """A framer for ``producer``'s channel, or ``None`` where frames would not be equivalent."""
        if _AmqpChannel is None:
            return None
        try:
            channel = producer.channel
        except Exception:  # not connected: the publish connects (and reports) as usual
            logger.debug("celery_boundedbeat: no channel to build frames for", exc_info=True)
            return None
        connection = getattr(channel, "connection", None)
        if not isinstance(channel, _AmqpChannel) or connection is None:
            return None
        if getattr(channel, "_confirm_selected", False) or getattr(connection, "confirm_publish", False):
            return None  # every message waits for its confirm: not a plain write
        return cls(producer)

    def frames(self, producer: Any, wire: tuple[tuple[Any, ...], dict[str, Any]]) -> bytes | None:
        """The bytes ``basic_publish`` would write for a recorded ``Producer._publish`` call."""
        args, kwargs = wire
        if kwargs or len(args) < 11:
            return None
        body, priority, content_type, content_encoding, headers, properties = args[:6]
        routing_key, mandatory, immediate, exchange, declare = args[6:11]
        if mandatory or immediate:
            return None
        for entity in declare or ():
            producer.maybe_declare(entity)  # declared now, before the due time: no message yet
        message = self.channel.prepare_message(
            body, priority, content_type, content_encoding, headers, properties
        )
        self._sink.buffer = bytearray()
        method_args = _dumps(_PUBLISH_ARGS, (0, exchange, routing_key, mandatory, immediate))
        self._write(1, self.channel.channel_id, _spec.Basic.Publish, method_args, message)
        return bytes(self._sink.buffer)

    def usable(self, producer: Any) -> bool:
        """Whether frames built here may be written on ``producer`` now."""
        channel = getattr(producer, "_channel", None)
        return (
            channel is self.channel
            and bool(getattr(channel, "is_open", False))
            and channel.connection is self.connection
            and self.connection.frame_max == self.frame_max
            and self.connection.transport is not None
        )

    def write(self, data: bytes) -> None:
        """One socket write of whole frames (the producer is held by this thread alone)."""
        self.connection.transport.write(data)
