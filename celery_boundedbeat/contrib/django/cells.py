"""Small HTML pieces of the admin's list cells and read-only fields, escaped by ``format_html``.

One owner for how a state, a run id, a time and a schedule's status look, so the schedule
list, the run list and the detail pages say them the same way.
"""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .charts import colour
from .readable import format_when

#: Characters of a run id shown in lists (the whole id is in the tooltip and on its page).
SHORT_ID_CHARS = 8
#: Colours of a schedule's status that is not a run state.
PAUSED_COLOUR = "#b26a00"
STOPPED_COLOUR = "#546e7a"
IDLE_COLOUR = "#607d8b"


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


def when(value: datetime | None, *, compact: bool = False) -> SafeString:
    """A time with seconds in the current time zone; date and time may wrap between them.

    ``compact`` leaves today's date out (the full time is in the tooltip), for narrow columns.
    """
    zone = timezone.get_current_timezone()
    text = format_when(value, zone)
    if value is None:
        return format_html("{}", text)
    day, _, clock = text.partition(" ")
    if compact and day == format_when(timezone.now(), zone).partition(" ")[0]:
        return format_html(
            '<span class="bb-when" title="{}" style="white-space:nowrap">{}</span>', text, clock
        )
    return format_html(
        '<span class="bb-when"><span style="white-space:nowrap">{}</span> '
        '<span style="white-space:nowrap">{}</span></span>',
        day,
        clock,
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
