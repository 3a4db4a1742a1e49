"""The CLI's text tables (``status``, ``history``, ``check``): values in, lines of text out.

Pure: no database, no Celery, no click. The rows come in as any objects with the attributes
below (the read models of :mod:`celery_boundedbeat.api.queries` have them), so this room
needs no other. ``status`` fits :data:`STATUS_WIDTH` columns unless asked for every column
(``--wide``): it shows fewer, shorter columns and cuts the longest texts with an ellipsis.
Every cell is one line: an error keeps only its exception, never its traceback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol

#: The width ``status`` fits by default (``--wide``: no limit).
STATUS_WIDTH = 100
#: Characters of a run's error in ``history``.
ERROR_CHARS = 60
#: How a traceback begins (Python's own words).
TRACEBACK = "Traceback (most recent call last):"


class ScheduleView(Protocol):
    """What a ``status`` row reads of a schedule (``api.queries.ScheduleSnapshot``)."""

    @property
    def name(self) -> str: ...
    @property
    def task(self) -> str: ...
    @property
    def origin(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def timezone(self) -> str | None: ...
    @property
    def paused(self) -> bool: ...
    @property
    def stopped(self) -> bool: ...
    @property
    def running(self) -> bool: ...
    @property
    def stop_reason(self) -> str | None: ...
    @property
    def next_due_at(self) -> datetime | None: ...
    @property
    def active_runs(self) -> int: ...
    @property
    def pending_runs(self) -> int: ...
    @property
    def runs(self) -> int: ...
    @property
    def failures(self) -> int: ...
    @property
    def skips(self) -> int: ...
    @property
    def busy_skips(self) -> int: ...
    @property
    def window_drops(self) -> int: ...
    @property
    def buffer_drops(self) -> int: ...
    @property
    def replaced(self) -> int: ...
    @property
    def overlaps(self) -> int: ...
    @property
    def retried(self) -> int: ...
    @property
    def last_elapsed_ms(self) -> int | None: ...


class RunView(Protocol):
    """What a ``history`` row reads of a run (``api.queries.RunRecord``)."""

    @property
    def id(self) -> str: ...
    @property
    def schedule(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def scheduled_for(self) -> datetime: ...
    @property
    def started_at(self) -> datetime | None: ...
    @property
    def elapsed_ms(self) -> int | None: ...
    @property
    def drift_ms(self) -> int | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def attempt(self) -> int: ...


def fmt_time(value: datetime | None, *, short: bool = False) -> str:
    """``2026-12-06 10:05:03`` in UTC (``short``: ``12-06 10:05:03``); ``-`` for none."""
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%m-%d %H:%M:%S" if short else "%Y-%m-%d %H:%M:%S")


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, an ellipsis marking a cut."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def one_line(error: str | None, width: int = ERROR_CHARS) -> str:
    """A stored error on one line: its exception (never the traceback), whitespace collapsed, cut.

    Errors are stored as ``Type: message``, a blank line, then the traceback; an error that
    is a bare traceback shows its last line, which names the exception.
    """
    if not error:
        return ""
    head, found, tail = error.partition(TRACEBACK)
    text = (
        head
        if head.strip() or not found
        else next((line for line in reversed(tail.splitlines()) if line.strip()), "")
    )
    return cut(" ".join(text.split()), width)


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    cuttable: Mapping[str, int] | None = None,
) -> str:
    """Columns padded to their widest cell; with ``width``, the ``cuttable`` columns (header ->
    the fewest characters it keeps) are cut, the widest first, until the table fits."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    if width is not None and cuttable:
        _fit(widths, {i: cuttable[h] for i, h in enumerate(headers) if h in cuttable}, width)
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(cut(c, w).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _fit(widths: list[int], cuttable: Mapping[int, int], width: int) -> None:
    """Narrow the cuttable columns in place, one character of the widest at a time."""
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    while excess > 0:
        candidates = [i for i, fewest in cuttable.items() if widths[i] > fewest]
        if not candidates:
            return
        widest = max(candidates, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1


def state_of(s: ScheduleView, waiting: str | None, *, wide: bool) -> str:
    """``idle``, ``running``, ``paused``, ``stopped (max_runs)``, or waiting for a worker."""
    state = "paused" if s.paused else "stopped" if s.stopped else "running" if s.running else "idle"
    if s.stop_reason and (s.stopped or s.stop_reason != "stop_schedule"):
        state += f" ({s.stop_reason})"
    if waiting is not None and state == "running":
        return waiting if wide else waiting.replace("waiting for a worker on ", "waiting: ")
    return state


#: ``status --wide``: every column; ``status``: the ones that fit 100 characters (the mode,
#: task, origin, time zone, drop counters and last duration are in ``--wide`` and ``--json``).
WIDE_HEADERS = (
    "NAME", "TASK", "ORIGIN", "MODE", "SCHEDULE", "TIMEZONE", "STATE", "NEXT DUE (UTC)", "ACTIVE",
    "PENDING", "RUNS", "FAILURES", "SKIPS", "BUSY/WINDOW/BUFFER", "REPLACED", "OVERLAPS", "RETRIED",
    "LAST MS",
)  # fmt: skip
NARROW_HEADERS = ("NAME", "SCHEDULE", "STATE", "NEXT DUE (UTC)", "ACT/PEND", "RUNS", "FAIL", "SKIPS")
#: The columns cut to fit when names and schedules are long, and the characters each keeps
#: (the state keeps room for "waiting: queue ...").
NARROW_CUTTABLE: Mapping[str, int] = {"NAME": 12, "SCHEDULE": 10, "STATE": 24}


def status_table(
    schedules: Sequence[ScheduleView],
    schedule_words: Mapping[str, str],
    waiting: Mapping[str, str],
    *,
    wide: bool = False,
) -> str:
    """The ``status`` table: ``schedule_words`` and ``waiting`` (the "waiting for a worker on
    queue x" text) by schedule name."""
    rows = [
        _status_row(s, schedule_words.get(s.name, "-"), waiting.get(s.name), wide=wide) for s in schedules
    ]
    if wide:
        return table(WIDE_HEADERS, rows)
    return table(NARROW_HEADERS, rows, width=STATUS_WIDTH, cuttable=NARROW_CUTTABLE)


def _status_row(s: ScheduleView, words: str, waiting: str | None, *, wide: bool) -> list[str]:
    state = state_of(s, waiting, wide=wide)
    if not wide:
        return [
            s.name,
            words,
            state,
            fmt_time(s.next_due_at, short=True),
            f"{s.active_runs}/{s.pending_runs}",
            str(s.runs),
            str(s.failures),
            str(s.skips),
        ]
    return [
        s.name,
        s.task,
        s.origin,
        s.mode,
        words,
        s.timezone or "-",
        state,
        fmt_time(s.next_due_at),
        str(s.active_runs),
        str(s.pending_runs),
        str(s.runs),
        str(s.failures),
        str(s.skips),
        f"{s.busy_skips}/{s.window_drops}/{s.buffer_drops}",
        str(s.replaced),
        str(s.overlaps),
        str(s.retried),
        "-" if s.last_elapsed_ms is None else str(s.last_elapsed_ms),
    ]


HISTORY_HEADERS = (
    "ID",
    "SCHEDULE",
    "STATE",
    "TRY",
    "SCHEDULED FOR (UTC)",
    "STARTED",
    "ELAPSED MS",
    "DRIFT MS",
    "ERROR",
)


def history_table(runs: Sequence[RunView]) -> str:
    """The ``history`` table: one line per run, its error cut to its exception."""
    return table(
        HISTORY_HEADERS,
        [
            [
                r.id,
                r.schedule,
                str(r.state),
                str(r.attempt),
                fmt_time(r.scheduled_for),
                fmt_time(r.started_at),
                "-" if r.elapsed_ms is None else str(r.elapsed_ms),
                "-" if r.drift_ms is None else str(r.drift_ms),
                one_line(r.error),
            ]
            for r in runs
        ],
    )
