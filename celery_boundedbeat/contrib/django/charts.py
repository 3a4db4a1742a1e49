"""Server-side SVG pictures of runs: a schedule's timeline, its duration and drift, a sparkline.

Pure: run values in, markup out (no Django, no SQL), so the admin needs no JavaScript or
build step and a change list pays only for string building. Every text that reaches the
markup (run ids, states, error lines, times) goes through :func:`html.escape`, since schedule
names and error texts are user data. Elements carry classes (``bb-run``, ``bb-state-<state>``)
and ``data-run`` ids so pages can be checked in a browser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo
from html import escape

from ...core.enums import RunState
from .readable import format_ms, format_when

#: One colour per run state; the lists' state labels use the same ones.
STATE_COLOURS: dict[str, str] = {
    RunState.COMPLETED.value: "#2e7d32",
    RunState.FAILED.value: "#c62828",
    RunState.TIMED_OUT.value: "#e65100",
    RunState.LOST.value: "#6a1b9a",
    RunState.REVOKED.value: "#5d4037",
    RunState.REJECTED.value: "#ad1457",
    RunState.STARTED.value: "#1565c0",
    RunState.PUBLISHED.value: "#42a5f5",
    RunState.QUEUED.value: "#9e9e9e",
}
#: The waiting part of a bar (scheduled, not yet started).
WAIT_COLOUR = "#cfd8dc"
UNKNOWN_COLOUR = "#757575"
FONT = 'font-family="system-ui, sans-serif" font-size="11"'

LANE_HEIGHT = 14
LANE_GAP = 4
MARGIN = 8
AXIS_HEIGHT = 18
PANEL_HEIGHT = 80
LABEL_WIDTH = 80


@dataclass(frozen=True, kw_only=True)
class RunPoint:
    """What the pictures need of one run (a row of ``boundedbeat_runs``)."""

    id: str
    state: str
    scheduled_for: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    elapsed_ms: int | None = None
    drift_ms: int | None = None
    error: str | None = None


def colour(state: str) -> str:
    """The colour of a run state (grey for one this version does not know)."""
    return STATE_COLOURS.get(state, UNKNOWN_COLOUR)


def _end(run: RunPoint, now: datetime) -> datetime:
    """Where a run's bar ends: its finish, ``now`` while it is active, else where it began."""
    if run.finished_at is not None:
        return run.finished_at
    if run.state in (RunState.STARTED.value, RunState.PUBLISHED.value, RunState.QUEUED.value):
        return max(now, run.started_at or run.scheduled_for)
    return run.started_at or run.scheduled_for


def lanes(runs: Sequence[RunPoint], now: datetime) -> list[int]:
    """A lane per run so no two bars share one where they overlap in time (greedy, by scheduled time)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i].scheduled_for)
    ends: list[datetime] = []
    lane_of = [0] * len(runs)
    for i in order:
        run = runs[i]
        free = next((n for n, end in enumerate(ends) if end <= run.scheduled_for), None)
        if free is None:
            free = len(ends)
            ends.append(run.scheduled_for)
        ends[free] = max(_end(run, now), run.scheduled_for + timedelta(microseconds=1))
        lane_of[i] = free
    return lane_of


def overlapping(runs: Sequence[RunPoint], now: datetime) -> set[str]:
    """Ids of the runs that were executing while another run of the same list was."""
    spans = sorted((run.started_at, _end(run, now), run.id) for run in runs if run.started_at is not None)
    found: set[str] = set()
    latest_end: datetime | None = None
    latest_id = ""
    for start, end, run_id in spans:
        if latest_end is not None and start < latest_end:
            found.update((run_id, latest_id))
        if latest_end is None or end > latest_end:
            latest_end, latest_id = end, run_id
    return found


class _Scale:
    """Maps times onto x pixels between ``left`` and ``right``."""

    def __init__(self, start: datetime, end: datetime, left: float, right: float) -> None:
        self.start = start
        self.seconds = max((end - start).total_seconds(), 1.0)
        self.left = left
        self.width = right - left

    def x(self, when: datetime) -> float:
        return self.left + (when - self.start).total_seconds() / self.seconds * self.width

    def ticks(self, count: int = 6) -> list[datetime]:
        step = self.seconds / (count - 1)
        return [self.start + timedelta(seconds=step * n) for n in range(count)]


def _title(run: RunPoint, zone: tzinfo) -> str:
    lines = [
        f"run {run.id}: {run.state}",
        f"scheduled {format_when(run.scheduled_for, zone)}",
        f"started {format_when(run.started_at, zone)}",
        f"finished {format_when(run.finished_at, zone)}",
        f"duration {format_ms(run.elapsed_ms)}, drift {format_ms(run.drift_ms)}",
    ]
    if run.error:
        lines.append(run.error.strip().splitlines()[0][:200])
    return escape("\n".join(lines))


def _axis(scale: _Scale, y: float, zone: tzinfo) -> list[str]:
    """Time labels under a picture; seconds shown, and the date only where it changes."""
    out = [
        f'<line x1="{scale.left:.1f}" y1="{y:.1f}" x2="{scale.left + scale.width:.1f}" '
        f'y2="{y:.1f}" stroke="#90a4ae"/>'
    ]
    last_day = ""
    for n, tick in enumerate(scale.ticks()):
        local = tick.astimezone(zone)
        day = local.strftime("%Y-%m-%d")
        label = local.strftime("%H:%M:%S") if day == last_day else f"{day} {local:%H:%M:%S}"
        last_day = day
        anchor = "start" if n == 0 else "end" if n == 5 else "middle"
        out.append(
            f'<text class="bb-axis" x="{scale.x(tick):.1f}" y="{y + 13:.1f}" text-anchor="{anchor}" '
            f'fill="#546e7a">{escape(label)}</text>'
        )
    return out


def _bar(run: RunPoint, lane: int, scale: _Scale, now: datetime, zone: tzinfo, overlap: bool) -> str:
    """A run's bar: a pale part from scheduled to started, its state's colour from started to end."""
    y = MARGIN + lane * (LANE_HEIGHT + LANE_GAP)
    x0 = scale.x(run.scheduled_for)
    begin = run.started_at or _end(run, now)
    x1 = scale.x(begin)
    x2 = max(scale.x(_end(run, now)), x1 + 2)
    state = escape(run.state)
    classes = f"bb-run bb-state-{state}" + (" bb-overlap" if overlap else "")
    stroke = ' stroke="#000" stroke-width="1.5"' if overlap else ""
    fill = colour(run.state) if run.started_at is not None or run.finished_at is not None else WAIT_COLOUR
    parts = [f'<g data-run="{escape(run.id)}"><title>{_title(run, zone)}</title>']
    if x1 - x0 >= 0.5:
        parts.append(
            f'<rect class="bb-wait" x="{x0:.1f}" y="{y + 4}" width="{x1 - x0:.1f}" '
            f'height="{LANE_HEIGHT - 8}" fill="{WAIT_COLOUR}"/>'
        )
    parts.append(
        f'<rect class="{classes}" data-state="{state}" x="{x1:.1f}" y="{y}" width="{x2 - x1:.1f}" '
        f'height="{LANE_HEIGHT}" rx="2" fill="{fill}"{stroke}/>'
    )
    parts.append("</g>")
    return "".join(parts)


def _legend(states: Sequence[str], x: float, y: float) -> list[str]:
    out = []
    for state in states:
        out.append(
            f'<rect class="bb-legend" x="{x:.1f}" y="{y - 9:.1f}" width="10" height="10" '
            f'fill="{colour(state)}"/><text x="{x + 14:.1f}" y="{y:.1f}" fill="#37474f">'
            f"{escape(state)}</text>"
        )
        x += 24 + 7 * len(state)
    return out


def _svg_open(cls: str, width: int, height: int, title: str) -> str:
    """An SVG drawn ``width`` px wide that shrinks with a narrower page (its viewBox keeps the shape)."""
    return (
        f'<svg class="{cls}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" style="max-width:100%;height:auto" role="img" {FONT}>'
        f"<title>{escape(title)}</title>"
    )


def timeline_svg(runs: Sequence[RunPoint], *, now: datetime, zone: tzinfo, width: int = 900) -> str:
    """Each run as a bar from scheduled to start to finish, overlapping runs in lanes of their own.

    Outlined bars ran while another run did (an overlap); a bar still growing is active.
    """
    if not runs:
        return '<p class="bb-empty">No runs recorded yet.</p>'
    lane_of = lanes(runs, now)
    overlaps = overlapping(runs, now)
    start = min(run.scheduled_for for run in runs)
    end = max(_end(run, now) for run in runs)
    scale = _Scale(start, end, MARGIN, width - MARGIN)
    body_height = MARGIN + (max(lane_of) + 1) * (LANE_HEIGHT + LANE_GAP)
    height = body_height + AXIS_HEIGHT + 22
    parts = [_svg_open("bb-timeline", width, height, f"Timeline of the last {len(runs)} runs")]
    parts += [
        _bar(run, lane, scale, now, zone, run.id in overlaps) for run, lane in zip(runs, lane_of, strict=True)
    ]
    parts += _axis(scale, body_height, zone)
    seen = [s for s in STATE_COLOURS if any(run.state == s for run in runs)]
    parts += _legend(seen, MARGIN, height - 4)
    if overlaps:
        parts.append(
            f'<text class="bb-overlap-note" x="{width - MARGIN}" y="{height - 4}" text-anchor="end" '
            f'fill="#37474f">outlined: {len(overlaps)} runs overlapped another</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _panel(
    runs: Sequence[RunPoint],
    values: Sequence[int | None],
    label: str,
    top: float,
    scale: _Scale,
    zone: tzinfo,
) -> list[str]:
    """One line chart of ``values`` (ms) against the runs' scheduled times, points in state colours."""
    top_value = max([v for v in values if v is not None] + [1])
    bottom = top + PANEL_HEIGHT

    def y(value: int) -> float:
        return bottom - max(value, 0) / top_value * (PANEL_HEIGHT - 6)

    kind = label.split()[0]
    out = [
        f'<text x="{MARGIN}" y="{top + 10:.1f}" fill="#37474f" font-weight="bold">{escape(label)}</text>',
        f'<text x="{MARGIN}" y="{top + 24:.1f}" fill="#546e7a">max {escape(format_ms(top_value))}</text>',
        f'<line x1="{scale.left:.1f}" y1="{bottom:.1f}" x2="{scale.left + scale.width:.1f}" '
        f'y2="{bottom:.1f}" stroke="#cfd8dc"/>',
    ]
    points = [
        (scale.x(run.scheduled_for), y(v), run, v)
        for run, v in zip(runs, values, strict=True)
        if v is not None
    ]
    if len(points) > 1:
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py, _, _ in points)
        out.append(f'<polyline class="bb-{kind}" points="{path}" fill="none" stroke="#78909c"/>')
    for px, py, run, value in points:
        out.append(
            f'<circle class="bb-point bb-{kind} bb-state-{escape(run.state)}" data-run="{escape(run.id)}" '
            f'cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour(run.state)}"><title>'
            f"{escape(f'{run.id}: {label} {format_ms(value)} ({run.state})')}</title></circle>"
        )
    return out


def duration_drift_svg(runs: Sequence[RunPoint], *, zone: tzinfo, width: int = 900) -> str:
    """Two charts over the same time axis: each run's duration and its drift (how late it was emitted)."""
    timed = sorted(runs, key=lambda run: run.scheduled_for)
    if not any(run.elapsed_ms is not None or run.drift_ms is not None for run in timed):
        return '<p class="bb-empty">No durations or drifts recorded yet.</p>'
    start, end = timed[0].scheduled_for, timed[-1].scheduled_for
    scale = _Scale(start, end, LABEL_WIDTH + MARGIN, width - MARGIN)
    second = MARGIN + PANEL_HEIGHT + 16
    height = second + PANEL_HEIGHT + AXIS_HEIGHT + 4
    parts = [_svg_open("bb-chart", width, height, f"Duration and drift of the last {len(timed)} runs")]
    parts += _panel(timed, [r.elapsed_ms for r in timed], "duration (ms)", MARGIN, scale, zone)
    parts += _panel(timed, [r.drift_ms for r in timed], "drift (ms)", second, scale, zone)
    parts += _axis(scale, second + PANEL_HEIGHT, zone)
    parts.append("</svg>")
    return "".join(parts)


def sparkline_svg(runs: Sequence[RunPoint], *, slots: int = 20, width: int = 100, height: int = 20) -> str:
    """The last ``slots`` runs as bars, oldest left: height is duration, colour is state."""
    shown = sorted(runs, key=lambda run: run.scheduled_for)[-slots:]
    if not shown:
        return '<span class="bb-sparkline-empty">no runs</span>'
    longest = max([run.elapsed_ms or 0 for run in shown] + [1])
    slot = width / slots
    parts = [
        f'<svg class="bb-sparkline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">'
    ]
    for n, run in enumerate(shown):
        bar = max(3.0, (run.elapsed_ms or 0) / longest * height)
        tip = f"{run.state}, {format_ms(run.elapsed_ms)}"
        parts.append(
            f'<rect class="bb-spark bb-state-{escape(run.state)}" data-run="{escape(run.id)}" '
            f'x="{n * slot + 0.5:.1f}" y="{height - bar:.1f}" width="{max(slot - 1, 1):.1f}" '
            f'height="{bar:.1f}" fill="{colour(run.state)}"><title>{escape(tip)}</title></rect>'
        )
    parts.append("</svg>")
    return "".join(parts)
