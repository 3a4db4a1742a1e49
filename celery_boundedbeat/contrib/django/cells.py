"""Small HTML pieces of the admin's list cells and read-only fields, escaped by ``format_html``.

One owner for how a state, a run id, a time and a schedule's status look, so the schedule
list, the run list and the detail pages say them the same way.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone
from django.utils.functional import lazy
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ...core.words import format_when
from .charts import colour

#: Characters of a run id shown in lists (the whole id is in the tooltip and on its page).
SHORT_ID_CHARS = 8
#: Colours of a schedule's status that is not a run state.
PAUSED_COLOUR = "#b26a00"
STOPPED_COLOUR = "#546e7a"
IDLE_COLOUR = "#607d8b"
#: Outcomes worth a look that are not failures (a time-out, a lost or a rejected run).
WARNING_COLOUR = "#b26a00"
#: Outcomes that are someone's decision or the policy doing what was asked (revoked, replaced).
NEUTRAL_COLOUR = "#455a64"
#: How the schedules' counts name and colour each unsuccessful outcome: only ``failed`` is red.
OUTCOME_LABELS: tuple[tuple[str, str, str], ...] = (
    ("failed", "failed", colour("failed")),
    ("timed_out", "timed out", WARNING_COLOUR),
    ("lost", "lost", WARNING_COLOUR),
    ("rejected", "rejected", WARNING_COLOUR),
    ("revoked", "revoked", NEUTRAL_COLOUR),
)


def state_badge(state: str) -> SafeString:
    """A run state in its colour (the same colour as its bars in the pictures)."""
    return format_html(
        '<span class="bb-state bb-state-{}" style="color:{};font-weight:600;white-space:nowrap">{}</span>',
        state,
        colour(state),
        state,
    )


def short_id(run_id: str) -> SafeString:
    """The first characters of a run id on one line; the full id in its tooltip."""
    short = run_id if len(run_id) <= SHORT_ID_CHARS else run_id[:SHORT_ID_CHARS] + "…"
    return format_html(
        '<span class="bb-id" title="{}" style="font-family:monospace;white-space:nowrap">{}</span>',
        run_id,
        short,
    )


def zone_name() -> str:
    """The name of the time zone the admin shows times in (``TIME_ZONE``, or the activated one)."""
    return str(timezone.get_current_timezone_name())


def zoned(description: str) -> Any:
    """A column header naming the time zone, read when the page is drawn: ``scheduled (UTC)``."""
    return lazy(lambda: f"{description} ({zone_name()})", str)()


def when(value: datetime | None, *, compact: bool = False) -> SafeString:
    """A time with seconds in the current time zone.

    A page (``compact`` false) names the zone after the time: ``2026-12-06 10:04:05 UTC``. A
    list cell (``compact``) has no room for it or the year: ``12-06 10:04:05`` on one line, the
    whole time and zone in its tooltip and the zone in the column's header (:func:`zoned`).
    """
    zone = timezone.get_current_timezone()
    text = format_when(value, zone)
    if value is None:
        return format_html("{}", text)
    full = f"{text} {value.astimezone(zone).tzname() or zone_name()}"
    if compact:
        return format_html(
            '<span class="bb-when" title="{}" style="white-space:nowrap">{}</span>',
            full,
            format_when(value, zone, short=True),
        )
    return format_html('<span class="bb-when" style="white-space:nowrap">{}</span>', full)


def clipped(text: str | None, *, full: str | None = None, width: str = "16em") -> SafeString:
    """``text`` on one line cut with an ellipsis at ``width``; ``full`` (default ``text``) in its tooltip."""
    if not text:
        return format_html("{}", "—")
    return format_html(
        '<span class="bb-clip" title="{}" style="display:block;max-width:{};overflow:hidden;'
        'text-overflow:ellipsis;white-space:nowrap">{}</span>',
        full or text,
        width,
        text,
    )


def label(text: str, colour_: str, title: str = "") -> SafeString:
    """A coloured word, with an optional tooltip."""
    return format_html(
        '<span class="bb-status" title="{}" style="color:{};font-weight:600;white-space:nowrap">{}</span>',
        title,
        colour_,
        text,
    )


def sub(content: str) -> SafeString:
    """A second, smaller grey line under a cell's main value (``content`` is escaped unless safe)."""
    return format_html('<div class="bb-sub" style="color:#607d8b;font-size:0.9em">{}</div>', content)


def breakable(text: str, after: str) -> SafeString:
    """``text`` allowed to wrap after each ``after`` (dotted task names, snake_case modes)."""
    pieces = text.split(after)
    return format_html_join(
        "", "{}{}<wbr>", ((piece, after if n < len(pieces) - 1 else "") for n, piece in enumerate(pieces))
    )
