"""The CLI's text tables: one line per row, 100 columns by default, every column with ``--wide``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from celery_boundedbeat.ops.tables import (
    STATUS_WIDTH,
    WIDE_HEADERS,
    history_table,
    one_line,
    status_table,
    table,
)

NOW = datetime(2026, 12, 6, 10, 0, 0, tzinfo=UTC)
STORED = (
    "ZeroDivisionError: division by zero\n\nTraceback (most recent call last):\n"
    '  File "/app/proj/tasks.py", line 12, in report\n    return 1 / 0\n'
    "           ~~^~~\nZeroDivisionError: division by zero"
)


@dataclass(frozen=True)
class Schedule:
    name: str
    task: str = "proj.tasks.export_the_monthly_report_for_every_customer"
    origin: str = "config"
    mode: str = "fixed_rate_no_overlap"
    timezone: str | None = None
    paused: bool = False
    stopped: bool = False
    running: bool = False
    stop_reason: str | None = None
    next_due_at: datetime | None = NOW
    active_runs: int = 0
    pending_runs: int = 0
    runs: int = 123456
    failures: int = 12
    skips: int = 3456
    busy_skips: int = 3456
    window_drops: int = 0
    buffer_drops: int = 0
    replaced: int = 0
    overlaps: int = 0
    retried: int = 0
    last_elapsed_ms: int | None = 5003


@dataclass(frozen=True)
class Run:
    id: str
    error: str | None
    schedule: str = "report"
    state: str = "failed"
    scheduled_for: datetime = NOW
    started_at: datetime | None = NOW
    elapsed_ms: int | None = 3
    drift_ms: int | None = 1
    attempt: int = 1


def test_a_stored_error_shows_as_its_exception_on_one_line() -> None:
    """``Type: message`` of a stored error, never the traceback after it."""
    assert one_line(STORED) == "ZeroDivisionError: division by zero"


def test_a_bare_traceback_shows_its_last_line() -> None:
    """An error that is only a traceback shows the exception it ends with."""
    assert one_line(STORED.split("\n\n", 1)[1] + "\n") == "ZeroDivisionError: division by zero"


def test_a_long_or_multi_line_message_is_collapsed_and_cut_with_an_ellipsis() -> None:
    """Whitespace runs become one space; a text past the width ends in an ellipsis."""
    text = one_line("ValueError: first line\n   second   line " + "x" * 100, 40)
    assert text.startswith("ValueError: first line second line x") and text.endswith("…")
    assert len(text) == 40 and "\n" not in text
    assert one_line(None) == "" and one_line("not started within 3600 s") == "not started within 3600 s"


def test_history_takes_one_line_per_run() -> None:
    """Failed runs with tracebacks take one line each, the exception in the ERROR column."""
    runs = [Run(id=f"run-{n}", error=STORED) for n in range(3)]
    lines = history_table(runs).splitlines()
    assert len(lines) == 2 + 3
    assert all(line.endswith("ZeroDivisionError: division by zero") for line in lines[2:])


def test_a_table_fits_its_width_by_cutting_the_cuttable_columns() -> None:
    """The cuttable columns shrink, widest first, each cut cell ending in an ellipsis."""
    text = table(["A", "B", "C"], [["a" * 50, "b" * 50, "c" * 10]], width=60, cuttable={"A": 5, "B": 30})
    lines = text.splitlines()
    assert max(len(line) for line in lines) == 60
    assert lines[2].split() == ["a" * 15 + "…", "b" * 29 + "…", "c" * 10]
    assert table(["A"], [["a" * 50]], width=10, cuttable={"A": 20}).splitlines()[2] == "a" * 19 + "…"


def test_status_fits_100_columns_with_its_schedule_in_words() -> None:
    """Long names, schedules and a waiting state still fit 100 columns by default."""
    schedules = [
        Schedule(
            name="export-the-monthly-report-for-every-customer-of-the-shop", running=True, active_runs=1
        ),
        Schedule(name="tick"),
    ]
    words = {
        schedules[0].name: "at 02:30, 14:30 on Mon-Fri in Jan, Feb (Europe/Berlin)",
        "tick": "every 10 s",
    }
    waiting = {schedules[0].name: "waiting for a worker on queue reports-eu-west-1"}
    lines = status_table(schedules, words, waiting).splitlines()
    assert max(len(line) for line in lines) <= STATUS_WIDTH, "\n".join(lines)
    assert "every 10 s" in lines[3] and "12-06 10:00:00" in lines[3]
    assert "waiting: queue reports-…" in lines[2]
    headers = ["NAME", "SCHEDULE", "STATE", "NEXT", "DUE", "(UTC)", "ACT/PEND", "RUNS", "FAIL", "SKIPS"]
    assert lines[0].split() == headers


def test_status_wide_shows_every_column_uncut() -> None:
    """``--wide``: every column, the full mode, task and waiting text, whatever the width."""
    s = Schedule(name="report", running=True, active_runs=1)
    text = status_table(
        [s], {"report": "every 10 s"}, {"report": "waiting for a worker on queue x"}, wide=True
    )
    header, _, row = text.splitlines()
    assert all(h in header for h in WIDE_HEADERS)
    assert s.task in row and "fixed_rate_no_overlap" in row and "waiting for a worker on queue x" in row
    assert row.index("3456/0/0") == header.index("BUSY/WINDOW/BUFFER")
