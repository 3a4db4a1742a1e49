"""A schedule's ``options``: the keys Celery's ``apply_async`` knows, and values it cannot take.

Celery passes options it does not know on without a word, so ``{"queu": "reports"}`` sends the
task to the default queue and ``{"priorty": 9}`` sets no priority. The admin's form shows
:func:`option_warnings` above the saved schedule (a warning, not a refusal: an application may
pass keys to its own router) and refuses what :func:`option_refusals` finds (a value Celery
would fail on when the message is built or sent). Pure: ``tests/unit/test_message_options.py``
holds :data:`KNOWN_OPTIONS` to Celery's own ``apply_async`` documentation and signatures.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from datetime import datetime
from typing import Any

#: Message options Celery understands (``Task.apply_async``'s documented options, and the
#: keyword arguments of ``amqp.as_task_v2`` and of the task sender that a JSON value can carry).
KNOWN_OPTIONS = frozenset(
    {
        "add_to_parent",
        "argsrepr",
        "chain",
        "chord",
        "compression",
        "confirm_timeout",
        "countdown",
        "declare",
        "delivery_mode",
        "eta",
        "exchange",
        "exchange_type",
        "expires",
        "group_id",
        "group_index",
        "headers",
        "ignore_result",
        "kwargsrepr",
        "link",
        "link_error",
        "priority",
        "queue",
        "reply_to",
        "retry",
        "retry_policy",
        "routing_key",
        "serializer",
        "shadow",
        "soft_time_limit",
        "stamped_headers",
        "task_id",
        "time_limit",
        "timeout",
    }
)
#: The highest message priority any broker takes (AMQP; Redis maps 0-9).
MAX_PRIORITY = 255
_NAMES = ("queue", "exchange", "routing_key", "serializer", "compression", "shadow")
_SECONDS = ("countdown", "time_limit", "soft_time_limit")


def option_warnings(options: Mapping[str, Any] | None) -> list[str]:
    """One sentence per key Celery does not know, with the known key it most resembles."""
    out = []
    for key in sorted(k for k in (options or {}) if k not in KNOWN_OPTIONS):
        near = difflib.get_close_matches(str(key), sorted(KNOWN_OPTIONS), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        out.append(
            f"options: {key!r} is not a Celery apply_async option{hint}; Celery ignores it unless "
            f"your own router reads it"
        )
    return out


def option_refusals(options: Mapping[str, Any] | None) -> list[str]:
    """One sentence per known key whose value Celery cannot use (empty: nothing clearly wrong)."""
    out = []
    given = options or {}
    for key in _NAMES:
        value = given.get(key)
        if key in given and not (isinstance(value, str) and value.strip()):
            out.append(f"options: {key!r} must be a non-empty name, got {value!r}")
    priority = given.get("priority")
    if priority is not None and (not _is_int(priority) or not 0 <= priority <= MAX_PRIORITY):
        out.append(f"options: 'priority' must be an integer from 0 to {MAX_PRIORITY}, got {priority!r}")
    for key in _SECONDS:
        value = given.get(key)
        if value is not None and (not _is_number(value) or value < 0):
            out.append(f"options: {key!r} must be a number of seconds >= 0, got {value!r}")
    expires = given.get("expires")
    if expires is not None and not (_is_number(expires) and expires > 0) and not _is_iso(expires):
        out.append(f"options: 'expires' must be seconds > 0 or an ISO 8601 time, got {expires!r}")
    if "headers" in given and not isinstance(given["headers"], Mapping):
        out.append(f"options: 'headers' must be an object, got {given['headers']!r}")
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_iso(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True
