"""How long a stored text may be: the lengths of the tables' text columns, checked at input.

The tables declare their columns with these numbers, so a value accepted here always fits;
``tests/db`` checks the columns against them.
"""

from __future__ import annotations

#: The longest schedule name (schedules, runs and alerts keep it).
MAX_SCHEDULE_NAME = 200
#: The longest task name (schedules, runs and the queue keep it).
MAX_TASK_NAME = 255
#: The longest schedule text (``repr`` of the timing) the schedules table keeps.
MAX_SCHEDULE_TEXT = 500
#: The longest task id the queue keeps (``enqueue(task_id=...)``); a UUID's text.
MAX_TASK_ID = 36


def text_problem(value: str, limit: int) -> str | None:
    """Why ``value`` cannot be stored in a text column of ``limit`` characters (``None``: it can).

    SQLite keeps any length and NUL characters; PostgreSQL refuses both, so input is checked
    here, where it enters, rather than failing later inside a transaction that holds others.
    """
    if len(value) > limit:
        return f"must be at most {limit} characters, got {len(value)}"
    if "\x00" in value:
        return "must not contain NUL characters"
    return None
