# mypy: allow-subclassing-any
"""Unmanaged models over the contract tables (docs/sql.md).

Django never creates, alters or writes these tables: ``celery -A proj boundedbeat migrate``
creates them, beat and the schedule API (:mod:`celery_boundedbeat.api.schedules`) write them.
"""

from __future__ import annotations

import json
from typing import Any

from django.db import models

from ...core.enums import Mode, RunState, StopReason
from ...db.row_state import CONFIG, RUNTIME


class JSONTextField(models.TextField):
    """A JSON column written by SQLAlchemy, read as JSON text.

    PostgreSQL's driver hands back decoded values and SQLite hands back text; Django's
    ``JSONField`` expects only the latter, so this field shows both as the same text.
    """

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> str | None:
        if value is None or isinstance(value, str):
            return value
        return json.dumps(value, sort_keys=True, default=str)


class Schedule(models.Model):
    """One schedule, its policy and counters (``boundedbeat_schedules``)."""

    name = models.CharField(max_length=200, primary_key=True)
    incarnation = models.CharField(
        max_length=36,
        unique=True,
        editable=False,
        help_text="This schedule of the name: a new one when the name is removed and added again.",
    )
    task = models.CharField(max_length=255)
    mode = models.CharField(max_length=32, choices=[(m.value, m.value) for m in Mode])
    schedule = models.CharField(max_length=500)
    period = models.FloatField(null=True, help_text="Seconds between ticks (number schedules).")
    policy = JSONTextField()
    args = JSONTextField()
    kwargs = JSONTextField()
    options = JSONTextField()
    origin = models.CharField(
        max_length=16,
        choices=[(CONFIG, CONFIG), (RUNTIME, RUNTIME)],
        help_text="config: beat_schedule; runtime: add_schedule(), the CLI or this admin.",
    )
    timing = JSONTextField(null=True, help_text="The grid as stored: interval, crontab or solar.")
    version = models.BigIntegerField(help_text="Bumped by every change of the definition.")
    paused = models.BooleanField()
    stopped = models.BooleanField(help_text="stop_schedule() (resume lifts it), end_at or max_runs.")
    stop_reason = models.CharField(max_length=32, null=True, choices=[(r.value, r.value) for r in StopReason])
    pause_reason = models.TextField(null=True, help_text="Set when pause_on_failure paused it.")
    active_runs = models.IntegerField()
    pending_runs = models.IntegerField()
    runs = models.BigIntegerField(help_text="Runs that completed.")
    grid_runs = models.BigIntegerField(help_text="Runs emitted from the grid (what max_runs bounds).")
    skips = models.BigIntegerField(help_text="Ticks dropped: busy skips + window drops + buffer drops.")
    busy_skips = models.BigIntegerField(help_text="Ticks dropped because every slot was busy.")
    window_drops = models.BigIntegerField(help_text="Ticks found past catchup_window, dropped.")
    buffer_drops = models.BigIntegerField(help_text="Ticks dropped from the pending buffer.")
    replaced = models.BigIntegerField(help_text="Active runs revoked for a newer tick (replace).")
    overlaps = models.BigIntegerField(help_text="Runs started while another was active.")
    retried = models.BigIntegerField(
        help_text="Runs emitted again by the retry policy (attempts 2 and later)."
    )
    slot = models.IntegerField(
        editable=False, help_text="Hash slot: partition slot % boundedbeat_partitions."
    )
    failures = models.BigIntegerField(
        help_text="Runs that did not complete: failed, timed out, lost, rejected, revoked or replaced "
        "(the counts above name each)."
    )
    last_drift_ms = models.BigIntegerField(null=True)
    last_elapsed_ms = models.BigIntegerField(null=True)
    max_elapsed_ms = models.BigIntegerField(null=True)
    next_due_at = models.DateTimeField(null=True)
    last_finished_at = models.DateTimeField(null=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "boundedbeat_schedules"
        ordering = ("name",)
        # add / change / delete apply to runtime schedules only (the admin refuses config ones).
        default_permissions = ("add", "change", "delete", "view")
        permissions = (("operate_schedule", "Can pause, resume and trigger schedules"),)

    def __str__(self) -> str:
        return self.name  # type: ignore[no-any-return]


class Run(models.Model):
    """One emitted run and its whole life (``boundedbeat_runs``); its id is the Celery task id."""

    id = models.CharField(max_length=36, primary_key=True)
    schedule = models.CharField(max_length=200)
    incarnation = models.CharField(
        max_length=36,
        null=True,
        editable=False,
        help_text="The incarnation of the schedule that emitted the run (its schedule's incarnation).",
    )
    task = models.CharField(max_length=255)
    state = models.CharField(max_length=16, choices=[(s.value, s.value) for s in RunState])
    scheduled_for = models.DateTimeField(help_text="The grid tick this run belongs to.")
    enqueued_at = models.DateTimeField()
    published_at = models.DateTimeField(null=True)
    started_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)
    elapsed_ms = models.BigIntegerField(null=True)
    drift_ms = models.BigIntegerField(null=True, help_text="How late the run was emitted.")
    worker = models.CharField(max_length=255, null=True)
    error = models.TextField(null=True)
    attempt = models.IntegerField(
        default=1, help_text="1 for the first run of its grid time; 2.. for the attempts of the retry policy."
    )
    retry_of = models.CharField(max_length=36, null=True, help_text="The run this one attempts again.")

    class Meta:
        managed = False
        db_table = "boundedbeat_runs"
        ordering = ("-enqueued_at",)
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.schedule} @ {self.scheduled_for:%Y-%m-%d %H:%M:%S %Z} ({self.id})"
