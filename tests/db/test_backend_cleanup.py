"""``celery.backend_cleanup`` in the built specs: these open the Celery result database (a SQLite
file), since whether results can expire on their own is the result backend's to say."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from helpers.apps import make_app

from celery_boundedbeat.config.entries import build_specs
from celery_boundedbeat.core.timing import CalendarTiming


@pytest.mark.parametrize(
    ("backend", "expires", "installed"),
    [
        ("db+sqlite:///{tmp}/results.sqlite3", timedelta(days=1), True),  # cannot expire results itself
        ("redis://127.0.0.1:6379/0", timedelta(days=1), False),  # expires keys on its own
        (None, timedelta(days=1), False),  # no result backend at all
        ("db+sqlite:///{tmp}/results.sqlite3", None, False),  # results never expire
    ],
)
def test_celery_backend_cleanup_is_scheduled_as_stock_beat_does(
    backend: str | None, expires: timedelta | None, installed: bool, tmp_path: Path
) -> None:
    """celery.backend_cleanup runs daily at 4:00 when results expire in a backend that cannot expire them."""
    app = make_app({"mine": {"task": "t.mine", "schedule": 10}})
    app.conf.result_backend = backend.format(tmp=tmp_path) if backend else None
    app.conf.result_expires = expires
    specs = build_specs(app, {})
    assert ("celery.backend_cleanup" in specs) is installed
    if installed:
        cleanup = specs["celery.backend_cleanup"]
        assert cleanup.task == "celery.backend_cleanup"
        assert isinstance(cleanup.timing, CalendarTiming)
        assert cleanup.options == {"expires": 12 * 3600}


def test_a_user_entry_named_backend_cleanup_wins_over_the_default(tmp_path: Path) -> None:
    """The user's own celery.backend_cleanup entry is kept as written."""
    app = make_app({"celery.backend_cleanup": {"task": "celery.backend_cleanup", "schedule": 60}})
    app.conf.result_backend = f"db+sqlite:///{tmp_path}/results.sqlite3"
    assert build_specs(app, {})["celery.backend_cleanup"].period == 60.0
