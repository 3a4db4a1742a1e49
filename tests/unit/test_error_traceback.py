"""What a failed run keeps of its exception: the one-line summary first, then the traceback, bounded."""

from __future__ import annotations

from billiard.exceptions import TimeLimitExceeded

from celery_boundedbeat.core.messages import MAX_ERROR_CHARS, TRACEBACK_CUT, error_with_traceback


def _raise_deep(depth: int) -> None:
    if depth == 0:
        raise KeyError("missing-partner-id")
    _raise_deep(depth - 1)


def test_a_failed_runs_error_keeps_its_summary_line_and_traceback() -> None:
    """The first line is `Type: message`; the traceback follows with the frame that raised."""
    try:
        _raise_deep(2)
    except KeyError as exc:
        text = error_with_traceback(exc, exc.__traceback__)
    summary, _, rest = text.partition("\n\n")
    assert summary == "KeyError: 'missing-partner-id'"
    assert rest.startswith("Traceback (most recent call last):")
    assert "in _raise_deep" in rest and rest.endswith("KeyError: 'missing-partner-id'")


def test_a_long_traceback_is_cut_in_the_middle_to_fit_a_row() -> None:
    """A chain of long errors keeps the summary and the traceback's end within MAX_ERROR_CHARS."""
    try:
        try:
            _raise_deep(3)
        except KeyError as first:
            raise RuntimeError("retry failed: " + "x" * 1500) from first
    except RuntimeError as exc:
        text = error_with_traceback(exc)
    assert len(text) <= MAX_ERROR_CHARS
    assert text.startswith("RuntimeError: retry failed: xxx")
    assert f"\n\n{TRACEBACK_CUT}" in text and "Traceback (most recent call last)" in text
    assert text.endswith("RuntimeError: retry failed: " + "x" * 1500)


def test_without_a_traceback_only_the_summary_is_kept() -> None:
    """An exception that was never raised (or none at all) gives the summary line alone."""
    assert error_with_traceback(ValueError("boom")) == "ValueError: boom"
    assert error_with_traceback(None) == "unknown error"


def test_a_traceback_handed_over_as_text_is_kept_as_text() -> None:
    """A prefork parent's ``task_failure`` (a hard time limit) carries the traceback formatted."""
    formatted = (
        "Traceback (most recent call last):\n"
        '  File "billiard/pool.py", line 745, in on_hard_timeout\n'
        "    raise TimeLimitExceeded(job._timeout)\n"
        "billiard.exceptions.TimeLimitExceeded: TimeLimitExceeded(3.0,)\n"
    )
    text = error_with_traceback(TimeLimitExceeded(3.0), formatted)
    summary, _, rest = text.partition("\n\n")
    assert summary == "TimeLimitExceeded: TimeLimitExceeded(3.0,)"
    assert rest == formatted.rstrip()
