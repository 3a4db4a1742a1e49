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
from ...core.words import format_ms, format_when, plural

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
LABEL_WIDTH = 56
TITLE_HEIGHT = 16
LEGEND_ROW = 16


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


def _begin(run: RunPoint, now: datetime) -> datetime:
    """Where a run's coloured part begins: its start, or its end for a run that never started."""
    return run.started_at or _end(run, now)


def lanes(runs: Sequence[RunPoint], now: datetime) -> list[int]:
    """A lane per run so that no two runs' running parts share one where they overlap (greedy, by start).

    Only running parts claim room: a run that waited for the one before it (``no_overlap``)
    stays in that run's lane, its waiting part drawn behind it (:func:`timeline_svg`), so a
    second lane always means runs that really ran at the same time.
    """
    order = sorted(range(len(runs)), key=lambda i: (_begin(runs[i], now), runs[i].scheduled_for))
    ends: list[datetime] = []
    lane_of = [0] * len(runs)
    for i in order:
        run = runs[i]
        begin = _begin(run, now)
        free = next((n for n, end in enumerate(ends) if end <= begin), None)
        if free is None:
            free = len(ends)
            ends.append(begin)
        ends[free] = max(_end(run, now), begin + timedelta(microseconds=1))
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
        f"scheduled {format_when(run.scheduled_for, zone)} ({zone})",
        f"started {format_when(run.started_at, zone)}",
        f"finished {format_when(run.finished_at, zone)}",
        f"duration {format_ms(run.elapsed_ms)}, drift {format_ms(run.drift_ms)}",
    ]
    if run.error:
        lines.append(run.error.strip().splitlines()[0][:200])
    return escape("\n".join(lines))


def _axis(scale: _Scale, y: float, zone: tzinfo) -> list[str]:
    """Time labels under a picture: seconds shown, the month and day only where they change, and
    the zone after the last one (``10:12:37 CET``). Short enough never to touch each other."""
    out = [
        f'<line x1="{scale.left:.1f}" y1="{y:.1f}" x2="{scale.left + scale.width:.1f}" '
        f'y2="{y:.1f}" stroke="#90a4ae"/>'
    ]
    last_day = ""
    ticks = scale.ticks()
    for n, tick in enumerate(ticks):
        local = tick.astimezone(zone)
        day = local.strftime("%m-%d")
        label = local.strftime("%H:%M:%S") if day == last_day else f"{day} {local:%H:%M:%S}"
        last_day = day
        if n == len(ticks) - 1:
            label += f" {local.tzname() or zone}"
        anchor = "start" if n == 0 else "end" if n == len(ticks) - 1 else "middle"
        out.append(
            f'<text class="bb-axis" x="{scale.x(tick):.1f}" y="{y + 13:.1f}" text-anchor="{anchor}" '
            f'fill="#546e7a">{escape(label)}</text>'
        )
    return out


def _lane_y(lane: int) -> int:
    return MARGIN + lane * (LANE_HEIGHT + LANE_GAP)


def _wait(run: RunPoint, lane: int, scale: _Scale, now: datetime, zone: tzinfo) -> str:
    """A run's waiting part, scheduled to started: a pale strip drawn before every bar, so where the
    run waited for the one before it, that run's bar covers it (it claims no lane of its own)."""
    x0, x1 = scale.x(run.scheduled_for), scale.x(_begin(run, now))
    if x1 - x0 < 0.5:
        return ""
    return (
        f'<rect class="bb-wait" data-run="{escape(run.id)}" x="{x0:.1f}" y="{_lane_y(lane) + 4}" '
        f'width="{x1 - x0:.1f}" height="{LANE_HEIGHT - 8}" fill="{WAIT_COLOUR}">'
        f"<title>{_title(run, zone)}</title></rect>"
    )


def _bar(run: RunPoint, lane: int, scale: _Scale, now: datetime, zone: tzinfo, overlap: bool) -> str:
    """A run's bar in its state's colour from started to end (a grey sliver for one not started)."""
    y = _lane_y(lane)
    x1 = scale.x(_begin(run, now))
    x2 = max(scale.x(_end(run, now)), x1 + 2)
    state = escape(run.state)
    classes = f"bb-run bb-state-{state}" + (" bb-overlap" if overlap else "")
    stroke = ' stroke="#000" stroke-width="1.5"' if overlap else ""
    fill = colour(run.state) if run.started_at is not None or run.finished_at is not None else WAIT_COLOUR
    return (
        f'<g data-run="{escape(run.id)}"><title>{_title(run, zone)}</title>'
        f'<rect class="{classes}" data-state="{state}" x="{x1:.1f}" y="{y}" width="{x2 - x1:.1f}" '
        f'height="{LANE_HEIGHT}" rx="2" fill="{fill}"{stroke}/></g>'
    )


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
    """Each run as a bar from start to finish after a pale strip from scheduled to start.

    Runs whose running parts overlap get lanes of their own and are outlined; a run that only
    waited while another ran stays in its lane, its strip behind that run's bar. A bar still
    growing is active.
    """
    if not runs:
        return '<p class="bb-empty">No runs recorded yet.</p>'
    lane_of = lanes(runs, now)
    overlaps = overlapping(runs, now)
    start = min(run.scheduled_for for run in runs)
    end = max(_end(run, now) for run in runs)
    scale = _Scale(start, end, MARGIN, width - MARGIN)
    body_height = MARGIN + (max(lane_of) + 1) * (LANE_HEIGHT + LANE_GAP)
    legend_y = body_height + AXIS_HEIGHT + 18
    height = legend_y + (LEGEND_ROW if overlaps else 0) + 4
    parts = [_svg_open("bb-timeline", width, height, f"Timeline of the last {len(runs)} runs")]
    placed = list(zip(runs, lane_of, strict=True))
    parts += [_wait(run, lane, scale, now, zone) for run, lane in placed]
    parts += [_bar(run, lane, scale, now, zone, run.id in overlaps) for run, lane in placed]
    parts += _axis(scale, body_height, zone)
    seen = [s for s in STATE_COLOURS if any(run.state == s for run in runs)]
    parts += _legend(seen, MARGIN, legend_y)
    if overlaps:
        parts.append(
            f'<text class="bb-overlap-note" x="{MARGIN}" y="{legend_y + LEGEND_ROW}" fill="#37474f">'
            f"outlined: {plural(len(overlaps), 'run')} ran while another run did</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _panel(
    runs: Sequence[RunPoint],
    values: Sequence[int | None],
    kind: str,
    title: str,
    top: float,
    scale: _Scale,
) -> list[str]:
    """One line chart of ``values`` (ms) against the runs' scheduled times, points in state colours.

    Its title has a row of its own above the plot, and the scale's top and zero sit in the
    gutter left of it, so no text ever lies where a point can be drawn.
    """
    top_value = max([v for v in values if v is not None] + [1])
    plot_top = top + TITLE_HEIGHT
    bottom = plot_top + PANEL_HEIGHT

    def y(value: int) -> float:
        return bottom - max(value, 0) / top_value * (PANEL_HEIGHT - 4)

    gutter = scale.left - 6
    out = [
        f'<text class="bb-panel-title" x="{MARGIN}" y="{top + 11:.1f}" fill="#37474f" font-weight="bold">'
        f"{escape(title)}</text>",
        f'<text class="bb-scale" x="{gutter:.1f}" y="{plot_top + 8:.1f}" text-anchor="end" fill="#546e7a">'
        f"{escape(format_ms(top_value))}</text>",
        f'<text class="bb-scale" x="{gutter:.1f}" y="{bottom:.1f}" text-anchor="end" fill="#546e7a">0</text>',
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
            f"{escape(f'{run.id}: {kind} {format_ms(value)} ({run.state})')}</title></circle>"
        )
    return out


def duration_drift_svg(runs: Sequence[RunPoint], *, zone: tzinfo, width: int = 900) -> str:
    """Two charts over the same time axis: each run's duration and its drift (how late it was emitted)."""
    timed = sorted(runs, key=lambda run: run.scheduled_for)
    if not any(run.elapsed_ms is not None or run.drift_ms is not None for run in timed):
        return '<p class="bb-empty">No durations or drifts recorded yet.</p>'
    start, end = timed[0].scheduled_for, timed[-1].scheduled_for
    scale = _Scale(start, end, LABEL_WIDTH + MARGIN, width - MARGIN)
    second = MARGIN + TITLE_HEIGHT + PANEL_HEIGHT + 12
    height = second + TITLE_HEIGHT + PANEL_HEIGHT + AXIS_HEIGHT + 4
    parts = [_svg_open("bb-chart", width, height, f"Duration and drift of the last {len(timed)} runs")]
    parts += _panel(timed, [r.elapsed_ms for r in timed], "duration", "duration of each run", MARGIN, scale)
    parts += _panel(
        timed, [r.drift_ms for r in timed], "drift", "drift: how late each run was emitted", second, scale
    )
    parts += _axis(scale, second + TITLE_HEIGHT + PANEL_HEIGHT, zone)
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
