# mypy: allow-subclassing-any, allow-untyped-decorators
"""The run history's admin pages: a list that fits a 1,400 px window, and each run's page."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ...core.words import format_ms
from .cells import breakable, clipped, short_id, state_badge, sub, when, zoned
from .models import Run
from .pages import ReadOnlyAdmin, when_field

#: Widths of the run list's worker and error cells (CSS): longer texts end in an ellipsis and
#: show whole in their tooltips (a run's page shows all of its error).
WORKER_WIDTH = "7em"
ERROR_WIDTH = "13em"


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    """The run history: read-only, newest first, every time with seconds and states in colour.

    The list fits a 1,400 px window with both sidebars open, error column included: the start
    under the scheduled time (each without the year, on one line, the zone in the header), the
    task under its schedule, the drift under the duration, the worker and the error cut with an
    ellipsis (the whole text in their tooltips). A run's page has every time in full.
    """

    list_display = (
        "run_id",
        "schedule_and_task",
        "state_label",
        "scheduled_and_started",
        "duration_and_drift",
        "worker_cell",
        "short_error",
    )
    list_display_links = ("run_id",)
    list_filter = ("state", "schedule")
    search_fields = ("id", "schedule", "task", "error")
    date_hierarchy = "scheduled_for"
    ordering = ("-enqueued_at",)
    list_per_page = 100
    actions = None
    fieldsets = (
        (None, {"fields": ("id", "schedule_link", "task", "state_label", "attempt_text", "worker")}),
        (
            "Timeline",
            {"fields": ("scheduled", "enqueued", "published", "started", "finished", "duration", "drift")},
        ),
        ("Error", {"fields": ("error_text",)}),
    )
    readonly_fields = (
        "schedule_link",
        "state_label",
        "attempt_text",
        "scheduled",
        "enqueued",
        "published",
        "started",
        "finished",
        "duration",
        "drift",
        "error_text",
    )

    scheduled = when_field("scheduled_for", "scheduled for")
    enqueued = when_field("enqueued_at", "enqueued")
    published = when_field("published_at", "published")
    started = when_field("started_at", "started")
    finished = when_field("finished_at", "finished")

    @admin.display(description=zoned("scheduled / started"), ordering="scheduled_for")
    def scheduled_and_started(self, obj: Run) -> SafeString:
        return format_html(
            "{}{}", when(obj.scheduled_for, compact=True), sub(when(obj.started_at, compact=True))
        )

    @admin.display(description="duration / drift", ordering="elapsed_ms")
    def duration_and_drift(self, obj: Run) -> SafeString:
        return format_html(
            '<span style="white-space:nowrap">{}</span>{}',
            format_ms(obj.elapsed_ms),
            sub(format_ms(obj.drift_ms)),
        )

    @admin.display(description="run", ordering="id")
    def run_id(self, obj: Run) -> SafeString:
        return short_id(obj.id)

    @admin.display(description="schedule", ordering="schedule")
    def schedule_link(self, obj: Run) -> SafeString:
        url = reverse(
            f"{self.admin_site.name}:celery_boundedbeat_schedule_change", args=[quote(obj.schedule)]
        )
        return format_html('<a href="{}">{}</a>', url, obj.schedule)

    @admin.display(description="schedule / task", ordering="schedule")
    def schedule_and_task(self, obj: Run) -> SafeString:
        return format_html("{}{}", self.schedule_link(obj), sub(breakable(obj.task, ".")))

    @admin.display(description="worker", ordering="worker")
    def worker_cell(self, obj: Run) -> SafeString:
        return clipped(obj.worker, width=WORKER_WIDTH)

    @admin.display(description="state", ordering="state")
    def state_label(self, obj: Run) -> SafeString:
        """The state, and under it "attempt N" for a run of the retry policy."""
        if (obj.attempt or 1) == 1:
            return state_badge(obj.state)
        return format_html("{}{}", state_badge(obj.state), sub(f"attempt {obj.attempt}"))

    @admin.display(description="attempt")
    def attempt_text(self, obj: Run) -> SafeString | str:
        """1 for a grid run; a retry links the run it attempts again."""
        if not obj.retry_of:
            return str(obj.attempt or 1)
        url = reverse(f"{self.admin_site.name}:celery_boundedbeat_run_change", args=[quote(obj.retry_of)])
        return format_html('{} (retries <a href="{}">{}</a>)', obj.attempt, url, short_id(obj.retry_of))

    @admin.display(description="duration", ordering="elapsed_ms")
    def duration(self, obj: Run) -> str:
        return format_ms(obj.elapsed_ms)

    @admin.display(description="drift", ordering="drift_ms")
    def drift(self, obj: Run) -> str:
        return format_ms(obj.drift_ms)

    @admin.display(description="error")
    def error_text(self, obj: Run) -> SafeString | str:
        """The whole error, traceback included, as preformatted text."""
        if not obj.error:
            return "—"
        return format_html('<pre class="bb-error" style="white-space:pre-wrap;margin:0">{}</pre>', obj.error)

    @admin.display(description="error", ordering="error")
    def short_error(self, obj: Run) -> SafeString:
        """The error's first line, cut with an ellipsis to the column; the whole error in its tooltip."""
        first = (obj.error or "").strip().splitlines()[:1]
        return clipped(first[0] if first else "", full=obj.error, width=ERROR_WIDTH)
