"""A bare Celery app for the tests that read ``beat_schedule`` without any process."""

from __future__ import annotations

from typing import Any

import celery


def make_app(beat_schedule: dict[str, Any] | None = None) -> celery.Celery:
    app = celery.Celery("t", set_as_current=False)
    app.conf.beat_schedule = beat_schedule or {}
    return app
