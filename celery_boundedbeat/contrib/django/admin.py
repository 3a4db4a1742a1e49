# mypy: allow-subclassing-any, allow-untyped-decorators
"""Read-only admin pages for schedules and runs, with pause / resume / trigger actions.

Nobody may add, change or delete rows here: the beat owns them. The actions go through
:class:`celery_boundedbeat.store.Store`, exactly like ``celery -A proj boundedbeat pause``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.db.models import Model, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ...exceptions import BoundedBeatError
from ...store import Store
from ...ticks import TriggerRefused
from .conf import admin_database, store
from .models import Run, Schedule

logger = logging.getLogger("celery_boundedbeat")

#: Characters of a run's error shown in the run list (the detail page shows all of it).
SHORT_ERROR_CHARS = 80


class ReadOnlyAdmin(admin.ModelAdmin):
    """View-only pages over the ``BOUNDEDBEAT_ADMIN_DATABASE`` alias (default ``"default"``)."""

    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(admin_database())

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(Schedule)
class ScheduleAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "task",
        "mode",
        "paused",
        "stopped",
        "active_runs",
        "pending_runs",
        "runs",
        "failures",
        "skips",
        "overlaps",
        "next_due_at",
        "run_history",
    )
    list_filter = ("mode", "paused", "stopped")
    search_fields = ("name", "task")
    ordering = ("name",)
    actions = ("pause_schedules", "resume_schedules", "trigger_schedules")
    fieldsets = (
        (None, {"fields": ("name", "task", "mode", "schedule", "period", "origin")}),
        ("Policy and arguments", {"fields": ("policy", "args", "kwargs", "options")}),
        ("State", {"fields": ("paused", "stopped", "active_runs", "pending_runs", "next_due_at")}),
        (
            "Counters",
            {
                "fields": (
                    "runs",
                    "failures",
                    "skips",
                    "overlaps",
                    "last_drift_ms",
                    "last_elapsed_ms",
                    "max_elapsed_ms",
                    "last_finished_at",
                )
            },
        ),
        ("Timestamps", {"fields": ("created_at", "updated_at")}),
    )

    @admin.display(description="history")
    def run_history(self, obj: Schedule) -> SafeString:
        url = reverse(f"{self.admin_site.name}:celery_boundedbeat_run_changelist")
        return format_html('<a href="{}?{}">runs</a>', url, urlencode({"schedule": obj.name}))

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Pausing, resuming and triggering need ``celery_boundedbeat.operate_schedule``."""
        opts = self.opts
        return bool(request.user.has_perm(f"{opts.app_label}.operate_schedule"))

    @admin.action(description="Pause selected schedules", permissions=["operate"])
    def pause_schedules(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._each(request, queryset, "paused", lambda s, name, now: s.set_paused(name, True, now))

    @admin.action(description="Resume selected schedules", permissions=["operate"])
    def resume_schedules(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._each(request, queryset, "resumed", lambda s, name, now: s.set_paused(name, False, now))

    @admin.action(description="Trigger one run of selected schedules now", permissions=["operate"])
    def trigger_schedules(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._each(
            request,
            queryset,
            "triggered (one run starts as soon as a slot is free)",
            lambda s, name, now: s.trigger(name, now),
        )

    def _each(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        done: str,
        change: Callable[[Store, str, datetime], object],
    ) -> None:
        """Apply ``change`` to each selected schedule, one transaction and one message each.

        ``change`` returns something falsy for a schedule no longer in the database, or a
        :class:`~celery_boundedbeat.ticks.TriggerRefused` saying why nothing was done.
        """
        try:
            target = store()
        except BoundedBeatError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        for schedule in queryset:
            name = schedule.name
            try:
                found = change(target, name, datetime.now(UTC))
            except Exception as exc:
                logger.exception("celery_boundedbeat admin: action on schedule %r failed", name)
                self.message_user(
                    request, f"Schedule {name!r} was not changed: {type(exc).__name__}", messages.ERROR
                )
                continue
            if isinstance(found, TriggerRefused):
                self.message_user(
                    request, f"Schedule {name!r} was not triggered: {found.reason}.", messages.WARNING
                )
            elif found:
                self.log_change(request, schedule, f"Schedule {done} from the admin.")
                self.message_user(request, f"Schedule {name!r} {done}.", messages.SUCCESS)
            else:
                self.message_user(
                    request, f"Schedule {name!r} is no longer in the database.", messages.WARNING
                )


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "schedule",
        "task",
        "state",
        "scheduled_for",
        "started_at",
        "finished_at",
        "elapsed_ms",
        "drift_ms",
        "worker",
        "short_error",
    )
    list_filter = ("state", "schedule")
    search_fields = ("id", "schedule", "task", "error")
    date_hierarchy = "scheduled_for"
    ordering = ("-enqueued_at",)
    list_per_page = 100
    actions = None
    fieldsets = (
        (None, {"fields": ("id", "schedule", "task", "state", "worker")}),
        (
            "Timeline",
            {
                "fields": (
                    "scheduled_for",
                    "enqueued_at",
                    "published_at",
                    "started_at",
                    "finished_at",
                    "elapsed_ms",
                    "drift_ms",
                )
            },
        ),
        ("Error", {"fields": ("error",)}),
    )

    @admin.display(description="error", ordering="error")
    def short_error(self, obj: Run) -> str:
        first = (obj.error or "").strip().splitlines()[:1]
        text = first[0] if first else ""
        return text if len(text) <= SHORT_ERROR_CHARS else text[: SHORT_ERROR_CHARS - 1] + "…"
