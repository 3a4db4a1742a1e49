"""Draw docs/timeline.svg: what each policy does with a task slower than its period.

The picture is not drawn by hand: every row is a ``beat_schedule`` entry given to
:func:`celery_boundedbeat.testing.simulate`, the simulator users call in their own tests, which
validates it as beat does and drives the package's own tick functions (``first_state``,
``on_due``, ``on_settle``) with a fake clock. Workers are assumed to start a run the moment it
is emitted. Plain SVG text; no plotting library.

    python docs/timeline.py            # rewrites docs/timeline.svg
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from celery_boundedbeat import testing

T0 = datetime(2025, 1, 1, tzinfo=UTC)
HORIZON = 20.0  # seconds shown
EPS = 1e-6


@dataclass(frozen=True)
class Row:
    title: str
    note: str
    period: float
    durations: tuple[float, ...]  # run i takes durations[i % len(durations)] seconds
    policy: dict[str, Any]


#: For comparison: stock beat sends every tick, whatever is still running.
STOCK = Row(
    "stock celery beat (for comparison)",
    "grid every 2 s, runs take 5 s: every tick is sent, runs pile up",
    2.0,
    (5.0,),
    {},
)

ROWS = (
    Row(
        "fixed_delay",
        "every 2 s after the previous run finished (runs take 1.5-3 s)",
        2.0,
        (1.5, 3.0, 1.0, 2.5),
        {"mode": "fixed_delay"},
    ),
    Row(
        "fixed_rate_no_overlap + skip",
        "grid every 2 s, runs take 5 s: ticks finding the slot busy are dropped",
        2.0,
        (5.0,),
        {"mode": "fixed_rate_no_overlap", "missed_ticks": "skip"},
    ),
    Row(
        "fixed_rate_no_overlap + coalesce_latest",
        "grid every 2 s, runs take 5 s: only the latest missed tick waits",
        2.0,
        (5.0,),
        {"mode": "fixed_rate_no_overlap", "missed_ticks": "coalesce_latest"},
    ),
    Row(
        "fixed_rate_no_overlap + catch_up (max_pending 2)",
        "grid every 2 s, runs take 5 s: up to 2 missed ticks wait, oldest first",
        2.0,
        (5.0,),
        {"mode": "fixed_rate_no_overlap", "missed_ticks": "catch_up", "max_pending": 2},
    ),
    Row(
        "fixed_rate, max_concurrency 2 + skip",
        "grid every 1 s, runs take 2.5 s: at most 2 at once",
        1.0,
        (2.5,),
        {"mode": "fixed_rate", "max_concurrency": 2},
    ),
)


@dataclass
class Run:
    scheduled_for: float
    start: float
    end: float
    lane: int = 0


@dataclass
class Simulation:
    runs: list[Run]
    ticks: list[float]  # grid ticks (or fixed-delay due times) inside the horizon
    skips: int
    overlaps: int


def simulate_stock(row: Row) -> Simulation:
    """Stock beat: one run per tick, started at once, however many are still running."""
    ticks = [i * row.period for i in range(int(HORIZON / row.period) + 1) if i * row.period < HORIZON]
    runs = [Run(scheduled_for=t, start=t, end=t + row.durations[0]) for t in ticks]
    assign_lanes(runs)
    overlaps = sum(1 for r in runs if any(o.start < r.start < o.end for o in runs))
    return Simulation(runs=runs, ticks=ticks, skips=0, overlaps=overlaps)


def simulate(row: Row) -> Simulation:
    """The row's entry through the package's own simulator, in seconds after ``T0``.

    :func:`celery_boundedbeat.testing.simulate` is what users call in their tests: it validates
    the entry as beat does and drives the tick functions on a fake clock.
    """
    entry = {"task": "docs.timeline", "schedule": row.period, "policy": row.policy}
    timeline = testing.simulate(
        entry, hours=HORIZON / 3600, task_seconds=row.durations, start=T0, name=row.title
    )
    runs = [
        Run(
            scheduled_for=timeline.seconds(e.scheduled_for),
            start=timeline.seconds(e.start),
            end=timeline.seconds(e.finish),
        )
        for e in timeline.runs
        if e.start is not None and e.finish is not None
    ]
    assign_lanes(runs)
    # Every tick in the horizon is one event: run, skipped, coalesced away or still pending.
    ticks = [timeline.seconds(e.scheduled_for) for e in timeline.events]
    return Simulation(runs=runs, ticks=ticks, skips=timeline.skips, overlaps=timeline.overlaps)


def assign_lanes(runs: list[Run]) -> None:
    """Put each run in the lowest lane free at its start (a lane is a concurrency slot)."""
    lane_free_at: list[float] = []
    for run in sorted(runs, key=lambda r: r.start):
        for lane, free_at in enumerate(lane_free_at):
            if free_at <= run.start + EPS:
                run.lane = lane
                lane_free_at[lane] = run.end
                break
        else:
            run.lane = len(lane_free_at)
            lane_free_at.append(run.end)


# -- drawing ----------------------------------------------------------------------------

WIDTH = 980
LEFT = 40
PLOT_X0, PLOT_X1 = LEFT, WIDTH - 30
SCALE = (PLOT_X1 - PLOT_X0) / HORIZON
LANE_H, BAR_H = 20, 14
ON_TIME, LATE, SKIPPED, DELAY = "#3b7dd8", "#e3a21a", "#d33a2c", "#9aa5b1"
STOCK_RUN = "#8a94a0"
FONT = 'font-family="Helvetica, Arial, sans-serif"'


def x(t: float) -> float:
    return round(PLOT_X0 + t * SCALE, 1)


def text(xp: float, yp: float, body: str, size: int = 12, **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{xp}" y="{yp}" font-size="{size}" {FONT}{extra}>{escape(body)}</text>'


def draw_row(row: Row, sim: Simulation, top: float) -> tuple[list[str], float]:
    out = [
        text(LEFT, top + 14, row.title, 14, font_weight="bold"),
        text(LEFT, top + 30, f"{row.note} | skips {sim.skips}, overlaps {sim.overlaps}", 12, fill="#444"),
    ]
    tick_y = top + 48
    lanes = max((r.lane for r in sim.runs), default=0) + 1
    lane_top = tick_y + 12
    # Lane backgrounds: one per concurrency slot.
    for lane in range(lanes):
        ly = lane_top + lane * LANE_H
        out.append(
            f'<rect x="{PLOT_X0}" y="{ly}" width="{PLOT_X1 - PLOT_X0}" height="{BAR_H}" fill="#f3f5f7"/>'
        )
    ran = {round(r.scheduled_for, 6): r for r in sim.runs}
    for tick in sim.ticks:
        run = ran.get(round(tick, 6))
        tx = x(tick)
        if run is None:  # skipped (or coalesced away)
            out.append(
                f'<path d="M{tx - 4},{tick_y - 4} l8,8 M{tx - 4},{tick_y + 4} l8,-8" '
                f'stroke="{SKIPPED}" stroke-width="2"/>'
            )
        else:
            color = STOCK_RUN if row is STOCK else LATE if run.start > tick + EPS else ON_TIME
            out.append(f'<circle cx="{tx}" cy="{tick_y}" r="4" fill="{color}"/>')
    for run in sim.runs:
        if run.start >= HORIZON:
            continue
        ly = lane_top + run.lane * LANE_H
        late = run.start > run.scheduled_for + EPS
        color = STOCK_RUN if row is STOCK else LATE if late else ON_TIME
        end = min(run.end, HORIZON)
        if late:  # waited as a pending run: dashed line from its tick to its start
            out.append(
                f'<path d="M{x(run.scheduled_for)},{tick_y + 4} L{x(run.scheduled_for)},{ly + BAR_H / 2} '
                f'L{x(run.start)},{ly + BAR_H / 2}" fill="none" stroke="{LATE}" stroke-dasharray="3,2"/>'
            )
        out.append(
            f'<rect x="{x(run.start)}" y="{ly}" width="{max(x(end) - x(run.start) - 1, 1)}" '
            f'height="{BAR_H}" rx="3" fill="{color}"/>'
        )
    if row.policy.get("mode") == "fixed_delay":
        # The delay: from each finish to the next start.
        ordered = sorted(sim.runs, key=lambda r: r.start)
        for before, after in pairwise(ordered):
            if before.end < HORIZON:
                yy = lane_top + BAR_H / 2
                out.append(
                    f'<line x1="{x(before.end)}" y1="{yy}" x2="{x(min(after.start, HORIZON))}" y2="{yy}" '
                    f'stroke="{DELAY}" stroke-width="2" stroke-dasharray="2,2"/>'
                )
    return out, lane_top + lanes * LANE_H + 18


def render(sims: list[tuple[Row, Simulation]]) -> str:
    body: list[str] = [
        text(LEFT, 24, "celery_boundedbeat policies on a fake clock (generated by docs/timeline.py)", 16),
    ]
    legend = [
        (STOCK_RUN, "stock beat run"),
        (ON_TIME, "run started on its tick"),
        (LATE, "pending run, started when a slot freed"),
        (SKIPPED, "tick skipped"),
        (DELAY, "fixed_delay wait"),
    ]
    lx = LEFT
    for color, label in legend:
        if color == SKIPPED:
            body.append(f'<path d="M{lx},{38} l8,8 M{lx},{46} l8,-8" stroke="{color}" stroke-width="2"/>')
        elif color == DELAY:
            body.append(
                f'<line x1="{lx}" y1="42" x2="{lx + 12}" y2="42" stroke="{color}" stroke-width="2" '
                'stroke-dasharray="2,2"/>'
            )
        else:
            body.append(f'<rect x="{lx}" y="36" width="12" height="12" rx="3" fill="{color}"/>')
        body.append(text(lx + 18, 46, label, 12))
        lx += 30 + 7 * len(label)
    top = 60.0
    for row, sim in sims:
        drawn, top = draw_row(row, sim, top)
        body.extend(drawn)
    axis_y = top + 4
    body.append(f'<line x1="{PLOT_X0}" y1="{axis_y}" x2="{PLOT_X1}" y2="{axis_y}" stroke="#333"/>')
    for s in range(int(HORIZON) + 1):
        body.append(
            f'<line x1="{x(s)}" y1="{axis_y}" x2="{x(s)}" y2="{axis_y + (6 if s % 2 == 0 else 3)}" '
            'stroke="#333"/>'
        )
        if s % 2 == 0:
            body.append(text(x(s) - 4, axis_y + 20, f"{s} s" if s == int(HORIZON) else f"{s}", 11))
    height = int(axis_y + 34)
    grid = "".join(
        f'<line x1="{x(s)}" y1="56" x2="{x(s)}" y2="{axis_y}" stroke="#e6e9ec"/>'
        for s in range(0, int(HORIZON) + 1, 2)
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}">\n'
        f'<rect width="100%" height="100%" fill="white"/>\n{grid}\n' + "\n".join(body) + "\n</svg>\n"
    )


def main() -> None:
    sims = [(STOCK, simulate_stock(STOCK))] + [(row, simulate(row)) for row in ROWS]
    target = Path(__file__).with_name("timeline.svg")
    target.write_text(render(sims), encoding="utf-8")
    for row, sim in sims:
        print(f"{row.title}: {len(sim.runs)} runs, {sim.skips} skips, {sim.overlaps} overlaps")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
