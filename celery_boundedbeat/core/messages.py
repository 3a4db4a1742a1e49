"""What we put into a Celery message of a run, and how error text is cut to fit a row.

Pure: the store writes these options into queue rows, the dispatcher publishes them, the
worker-side tracking reads the headers back. One owner for the header names and the error
cut, so the three sides cannot drift apart.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from .policy import Policy

#: Header names put on every message so workers recognise a scheduled run.
RUN_HEADER = "boundedbeat_run"
SCHEDULE_HEADER = "boundedbeat_schedule"
MAX_RUN_TIME_HEADER = "boundedbeat_max_run_time"
#: The grid time the run belongs to (ISO 8601 in UTC), read back by ``current_run()``.
SCHEDULED_FOR_HEADER = "boundedbeat_scheduled_for"

#: The longest error text kept in a row (runs, queue rows, iterations).
MAX_ERROR_CHARS = 4000
#: Marks a traceback whose first frames were cut to fit :data:`MAX_ERROR_CHARS`.
TRACEBACK_CUT = "[... traceback cut ...]\n"


def message_options(
    spec_options: Mapping[str, Any],
    policy: Policy,
    run_id: str,
    schedule: str,
    *,
    expires_after: float | None = None,
    scheduled_for: datetime | None = None,
) -> dict[str, Any]:
    """Publish options of one run: the entry's options, our headers, time limits and expiry.

    ``scheduled_for`` (the run's grid time) travels in a header so a task can learn it
    without a query; messages written without it are answered from the run's row.
    """
    options = dict(spec_options)
    if expires_after is not None:
        options.setdefault("expires", expires_after)
    headers = dict(options.pop("headers", None) or {})
    headers[RUN_HEADER] = run_id
    headers[SCHEDULE_HEADER] = schedule
    if scheduled_for is not None:
        headers[SCHEDULED_FOR_HEADER] = scheduled_for.astimezone(UTC).isoformat()
    if policy.max_run_time is not None:
        headers[MAX_RUN_TIME_HEADER] = policy.max_run_time
        # The soft limit lets the task clean up; the hard limit follows a little later.
        options.setdefault("soft_time_limit", policy.max_run_time)
        options.setdefault("time_limit", policy.max_run_time + max(1.0, policy.max_run_time * 0.1))
    options["headers"] = headers
    return options


def clip_error(text: str) -> str:
    """An error text every database can store, cut to what a row keeps.

    PostgreSQL refuses NUL characters and no driver encodes a lone surrogate (a non-UTF-8
    file name in an ``OSError``): both are written as backslash escapes instead.
    """
    text = text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text[:MAX_ERROR_CHARS]


def error_text(exc: BaseException | None) -> str:
    """``Type: message`` of an exception, cut to what a row keeps."""
    if exc is None:
        return "unknown error"
    return clip_error(f"{type(exc).__name__}: {exc}")


def error_with_traceback(exc: BaseException | None, tb: TracebackType | str | None = None) -> str:
    """``Type: message``, then the traceback, cut to what a row keeps.

    The first line stays the one-line summary lists and the CLI show; when the whole text is
    too long, the traceback's middle goes, since its last frames say where it raised. A prefork
    parent hands ``task_failure`` the traceback already formatted (billiard's ``ExceptionInfo``),
    so text is kept as it came.
    """
    head = error_text(exc)
    if exc is None:
        return head
    if isinstance(tb, str):
        body = tb.rstrip()
    else:
        frames = tb if isinstance(tb, TracebackType) else getattr(exc, "__traceback__", None)
        if frames is None:
            return head
        body = "".join(traceback.format_exception(type(exc), exc, frames)).rstrip()
    if not body:
        return head
    room = MAX_ERROR_CHARS - len(head) - len(TRACEBACK_CUT) - 2
    if len(body) > room:
        body = TRACEBACK_CUT + body[-max(room, 0) :]
    return clip_error(f"{head}\n\n{body}")


def parse_scheduled_for(value: object) -> datetime | None:
    """The grid time a :data:`SCHEDULED_FOR_HEADER` carries (aware UTC), or ``None`` if unreadable."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)
