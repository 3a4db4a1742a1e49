# mypy: allow-subclassing-any, allow-untyped-decorators
"""Admin pages for schedules and runs, with pause / resume / trigger actions.

Runs are read-only. Runtime schedules are added, changed and removed through the schedule API
(:mod:`celery_boundedbeat.schedules`), each change under its own permission; config schedules
are read-only (their config owns them). The actions go through
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
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ...exceptions import BoundedBeatError, ScheduleEndedError
from ...rows import RUNTIME
from ...schedules import remove_schedule
from ...store import Store
from ...ticks import TriggerRefused
from .conf import admin_database, celery_app, store
from .forms import POLICY_FIELDS, ScheduleForm
from .models import Run, Schedule

logger = logging.getLogger("celery_boundedbeat")

#: Characters of a run's error shown in the run list (the detail page shows all of it).
SHORT_ERROR_CHARS = 80


class TablesAdmin(admin.ModelAdmin):
    """Pages over the ``BOUNDEDBEAT_ADMIN_DATABASE`` alias (default ``"default"``)."""

    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(admin_database())


class ReadOnlyAdmin(TablesAdmin):
    """View-only pages: nobody adds, changes or deletes these rows here."""

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


def _runtime(obj: Model | None) -> bool:
    """Whether a page may write ``obj``: no object (a list page) or a runtime schedule."""
    return obj is None or getattr(obj, "origin", None) == RUNTIME


class NotRemoved(Exception):
    """``remove_schedule`` refused or found nothing: the delete page says so instead of "deleted"."""


#: The counters and state of a schedule, shown read-only on every schedule page.
STATE_FIELDSETS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "State",
        {
            "fields": (
                "paused",
                "pause_reason",
                "stopped",
                "stop_reason",
                "active_runs",
                "pending_runs",
                "next_due_at",
            )
        },
    ),
    (
        "Counters",
        {
            "fields": (
                "runs",
                "grid_runs",
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
    ("Timestamps", {"fields": ("version", "created_at", "updated_at")}),
)
#: The form of a runtime schedule (add, and change with ``change_schedule``).
FORM_FIELDSETS: tuple[tuple[str | None, dict[str, Any]], ...] = (
    (None, {"fields": ("name", "task")}),
    (
        "Timing",
        {
            "fields": (
                "kind",
                "every",
                ("minute", "hour", "day_of_week", "day_of_month", "month_of_year"),
                ("event", "lat", "lon"),
            ),
            "description": "Only the fields of the chosen timing are read. Crontab times are in the "
            "Celery app's time zone (CELERY_TIMEZONE); solar events need the ephem package.",
        },
    ),
    ("Arguments", {"fields": ("args", "kwargs", "options")}),
    (
        "Policy",
        {
            "fields": (("mode", "missed_ticks"), *POLICY_FIELDS[2:]),
            "description": "A blank field takes its default (when adding, the one in "
            "CELERY_BOUNDEDBEAT_DEFAULT_POLICY first).",
        },
    ),
)
#: What a config schedule, or a user who may only view, sees.
VIEW_FIELDSETS: tuple[tuple[str | None, dict[str, Any]], ...] = (
    (None, {"fields": ("name", "defined_in", "task", "mode", "schedule", "period", "origin")}),
    ("Policy and arguments", {"fields": ("policy", "timing", "args", "kwargs", "options")}),
)
_STATE_FIELDS = tuple(f for _, options in STATE_FIELDSETS for f in options["fields"])


@admin.register(Schedule)
class ScheduleAdmin(TablesAdmin):
    """Schedules: every one readable; runtime ones added, changed and removed through the API.

    ``add_schedule`` / ``change_schedule`` / ``delete_schedule`` apply to runtime schedules
    only; a config schedule (``beat_schedule``) is read-only here, whatever the user may do.
    """

    form = ScheduleForm
    list_display = (
        "name",
        "task",
        "origin",
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
    list_filter = ("origin", "mode", "paused", "stopped")
    search_fields = ("name", "task")
    ordering = ("name",)
    actions = ("pause_schedules", "resume_schedules", "trigger_schedules")
    fieldsets = FORM_FIELDSETS

    def get_fieldsets(self, request: HttpRequest, obj: Model | None = None) -> Any:
        if obj is None:
            return FORM_FIELDSETS
        head = ((None, {"fields": ("name", "defined_in", "task")}), *FORM_FIELDSETS[1:])
        editable = self.has_change_permission(request, obj)
        return (*(head if editable else VIEW_FIELDSETS), *STATE_FIELDSETS)

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> Any:
        return () if obj is None else ("name", "defined_in", *_STATE_FIELDS)

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        """``change_schedule``, and only for a runtime schedule (a config one is changed in its config)."""
        return super().has_change_permission(request, obj) and _runtime(obj)

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        """``delete_schedule``, and only for a runtime schedule (beat owns the config ones)."""
        return super().has_delete_permission(request, obj) and _runtime(obj)

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        """No bulk delete: it would delete rows behind the API's back (no revoke, no notify)."""
        actions: dict[str, Any] = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def save_model(self, request: HttpRequest, obj: Model, form: Any, change: bool) -> None:
        """Nothing to save: validating the form called the API, which wrote the row."""

    def delete_model(self, request: HttpRequest, obj: Model) -> None:
        """``remove_schedule``, revoking the active runs when the confirmation page asked to."""
        name = str(obj.pk)
        revoke = request.POST.get("revoke_active") == "on"
        with celery_app() as app:
            try:
                removed = remove_schedule(app, name, revoke_active=revoke)
            except BoundedBeatError as exc:
                raise NotRemoved(f"Schedule {name!r} was not removed: {exc}") from None
        if not removed:
            raise NotRemoved(f"Schedule {name!r} is no longer in the database.")
        if revoke:
            self.message_user(request, f"The active runs of {name!r}, if any, were revoked.", messages.INFO)

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> HttpResponse:
        """Django's confirmation page; a refused removal redirects with a warning (nothing logged)."""
        try:
            return super().delete_view(request, object_id, extra_context)
        except NotRemoved as exc:
            self.message_user(request, str(exc), messages.WARNING)
            return HttpResponseRedirect(
                reverse(f"{self.admin_site.name}:celery_boundedbeat_schedule_changelist")
            )

    @admin.display(description="defined in")
    def defined_in(self, obj: Schedule) -> str:
        if obj.origin == RUNTIME:
            return "Added at runtime (add_schedule(), celery boundedbeat add, or this admin)."
        return (
            "beat_schedule in the beat's Celery config (CELERY_BEAT_SCHEDULE in Django settings): "
            "change it there; the beat that takes the lease applies it. Read-only here."
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
            except ScheduleEndedError as exc:
                self.message_user(request, f"Schedule {name!r} was not resumed: {exc}.", messages.WARNING)
                continue
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
