# mypy: allow-subclassing-any, allow-untyped-decorators
"""Admin pages for schedules and runs, with pause / resume / trigger actions.

Runs are read-only. Runtime schedules are added, changed and removed through the schedule API
(:mod:`celery_boundedbeat.api.schedules`), each change under its own permission; config schedules
are read-only (their config owns them). The actions go through
:class:`celery_boundedbeat.db.store.Store`, exactly like ``celery -A proj boundedbeat pause``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from ...api.schedules import plural_runs, remove_schedule_revoking
from ...core.exceptions import BoundedBeatError, ScheduleEndedError
from ...core.ticks import TriggerRefused
from ...core.unstarted import queue_of, waiting_for
from ...core.words import describe_timing, plural
from ...db.row_state import RUNTIME
from ...db.store import Store
from .cells import (
    IDLE_COLOUR,
    NEUTRAL_COLOUR,
    OUTCOME_LABELS,
    PAUSED_COLOUR,
    STOPPED_COLOUR,
    breakable,
    label,
    state_badge,
    sub,
    when,
    zoned,
)
from .charts import RunPoint, colour, duration_drift_svg, sparkline_svg, timeline_svg
from .conf import admin_database, celery_app, store
from .forms import POLICY_FIELDS, ScheduleForm
from .models import Schedule
from .pages import TablesAdmin, when_field
from .recent import recent_runs, schedule_runs, unsuccessful_counts
from .runs_admin import RunAdmin  # noqa: F401  (importing it registers the run pages)
from .waiting import ticked_by, unstarted_runs

logger = logging.getLogger("celery_boundedbeat")


def _runtime(obj: Model | None) -> bool:
    """Whether a page may write ``obj``: no object (a list page) or a runtime schedule."""
    return obj is None or getattr(obj, "origin", None) == RUNTIME


#: The list actions a schedule's page offers as buttons: their label, and when they are shown.
PAGE_ACTIONS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "pause_schedules": ("Pause", lambda obj: not obj.paused),
    "resume_schedules": ("Resume", lambda obj: obj.paused or obj.stopped),
    "trigger_schedules": ("Trigger a run now", lambda obj: True),
}


class NotRemoved(Exception):
    """``remove_schedule`` refused or found nothing: the delete page says so instead of "deleted"."""


#: The counters and state of a schedule, shown read-only on every schedule page.
STATE_FIELDSETS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "State",
        {
            "fields": (
                "status",
                "pause_reason",
                "stop_reason",
                "active_runs",
                "pending_runs",
                "next_due_time",
                "last_run_time",
                "ticked_by",
            )
        },
    ),
    (
        "Counters",
        {
            "fields": (
                "counts",
                "runs",
                "grid_runs",
                "failures",
                "skips",
                "overlaps",
                "retried",
                "last_drift_ms",
                "last_elapsed_ms",
                "max_elapsed_ms",
                "last_finished",
            )
        },
    ),
    ("Timestamps", {"fields": ("version", "created", "updated")}),
)
#: The pictures of a schedule's recent runs, on its page above everything else it shows.
RECENT_FIELDSET: tuple[str, dict[str, Any]] = (
    "Recent runs",
    {
        "fields": ("run_timeline", "run_chart"),
        "description": "The last runs, oldest left: a pale strip from scheduled to started, then the "
        "state's colour until finished; a second lane means runs ran at the same time. Hover a bar or "
        "point for its times.",
    },
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
    (None, {"fields": ("name", "defined_in", "task", "mode", "readable_schedule", "origin")}),
    ("Policy and arguments", {"fields": ("policy", "timing", "args", "kwargs", "options")}),
)
_STATE_FIELDS = tuple(f for _, options in STATE_FIELDSETS for f in options["fields"])


def _page_runs(obj: Schedule) -> list[RunPoint]:
    """A schedule page's recent runs, read once for both of its pictures."""
    found: list[RunPoint] | None = getattr(obj, "bb_page_runs", None)
    if found is None:
        found = schedule_runs(admin_database(), obj.name)
        obj.bb_page_runs = found
    return found


def _recent(obj: Schedule) -> list[RunPoint]:
    """The runs the change list read for this row in its one query; a detail page reads its own."""
    found: list[RunPoint] | None = getattr(obj, "bb_recent", None)
    return _page_runs(obj) if found is None else found


def _unsuccessful(obj: Schedule) -> dict[str, int]:
    """The change list's counts of this row's unsuccessful runs; a detail page reads its own."""
    found: dict[str, int] | None = getattr(obj, "bb_unsuccessful", None)
    if found is None:
        found = unsuccessful_counts(admin_database(), [obj.name])[obj.name]
        obj.bb_unsuccessful = found
    return found


def _unstarted(obj: Schedule) -> int:
    """Its published runs no worker started: what the change list read, or one query."""
    found: int | None = getattr(obj, "bb_unstarted", None)
    if found is None:
        found = unstarted_runs(admin_database(), [obj.name]).get(obj.name, 0)
        obj.bb_unstarted = found
    return found


def _options(obj: Schedule) -> dict[str, Any] | None:
    try:
        value = json.loads(obj.options) if isinstance(obj.options, str) else obj.options
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _timing(obj: Schedule) -> dict[str, Any] | None:
    try:
        value = json.loads(obj.timing) if isinstance(obj.timing, str) else obj.timing
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ScheduleChangeList(ChangeList):
    """A page of schedules that reads the recent runs of all its rows in one query.

    The sparkline, counts and last-run columns read what this attached to each row, so a page
    of 100 schedules costs two queries on the runs table, not 200.
    """

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        rows: list[Any] = list(self.result_list)  # type: ignore[has-type]
        names = [row.name for row in rows]
        recent = recent_runs(admin_database(), names)
        unsuccessful = unsuccessful_counts(admin_database(), names)
        busy = unstarted_runs(admin_database(), [row.name for row in rows if row.active_runs])
        for row in rows:
            row.bb_recent = recent.get(row.name, [])
            row.bb_unsuccessful = unsuccessful.get(row.name, {})
            row.bb_unstarted = busy.get(row.name, 0)
        self.result_list = rows


@admin.register(Schedule)
class ScheduleAdmin(TablesAdmin):
    """Schedules: every one readable; runtime ones added, changed and removed through the API.

    ``add_schedule`` / ``change_schedule`` / ``delete_schedule`` apply to runtime schedules
    only; a config schedule (``beat_schedule``) is read-only here, whatever the user may do.
    """

    form = ScheduleForm
    # Few, stacked columns: with the admin's navigation and filter sidebars open, a 1,400 px
    # window leaves about 750 px for the table, and nothing may hide behind a scroll bar.
    list_display = ("name", "task_and_origin", "schedule_and_mode", "last_run", "next_due", "run_history")
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
        first, *rest = head if editable else VIEW_FIELDSETS
        state, *counters = STATE_FIELDSETS
        return (first, state, RECENT_FIELDSET, *rest, *counters)

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> Any:
        if obj is None:
            return ()
        return ("name", "defined_in", "readable_schedule", *RECENT_FIELDSET[1]["fields"], *_STATE_FIELDS)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return ScheduleChangeList

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
        """Nothing to save: validating the form called the API, which wrote the row; what it
        saved but warns about (unknown ``options`` keys) is shown above the next page."""
        for warning in getattr(form, "warnings", ()):
            self.message_user(request, warning, messages.WARNING)

    def delete_model(self, request: HttpRequest, obj: Model) -> None:
        """``remove_schedule``, revoking the active runs when the confirmation page asked to (and
        saying how many)."""
        name = str(obj.pk)
        revoke = request.POST.get("revoke_active") == "on"
        with celery_app() as app:
            try:
                revoked = remove_schedule_revoking(app, name, revoke_active=revoke)
            except BoundedBeatError as exc:
                raise NotRemoved(f"Schedule {name!r} was not removed: {exc}") from None
        if revoked is None:
            raise NotRemoved(f"Schedule {name!r} is no longer in the database.")
        if revoke:
            self.message_user(
                request, f"{plural_runs(len(revoked))} of {name!r} revoked (the active ones).", messages.INFO
            )

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
            return "Added at runtime (add_schedule(), celery -A proj boundedbeat add, or this admin)."
        return (
            "beat_schedule in the beat's Celery config (CELERY_BEAT_SCHEDULE in Django settings): "
            "change it there; the beat that takes the lease applies it. Read-only here."
        )

    @admin.display(description="runs")
    def run_history(self, obj: Schedule) -> SafeString:
        """The sparkline of the last runs (a link to all of them) above the counters."""
        url = reverse(f"{self.admin_site.name}:celery_boundedbeat_run_changelist")
        picture = mark_safe(sparkline_svg(_recent(obj)))  # built from escaped parts
        return format_html(
            '<a href="{}?{}" title="all runs of this schedule">{}</a>{}',
            url,
            urlencode({"schedule": obj.name}),
            picture,
            sub(self.counts(obj)),
        )

    @admin.display(description="task", ordering="task")
    def task_and_origin(self, obj: Schedule) -> SafeString:
        return format_html("{}{}", breakable(obj.task, "."), sub(obj.origin))

    @admin.display(description="schedule", ordering="period")
    def schedule_and_mode(self, obj: Schedule) -> SafeString:
        return format_html("{}{}", self.readable_schedule(obj), sub(breakable(obj.mode, "_")))

    @admin.display(description="schedule")
    def readable_schedule(self, obj: Schedule) -> str:
        return describe_timing(_timing(obj), obj.period, obj.schedule)

    @admin.display(description="ticked by")
    def ticked_by(self, obj: Schedule) -> str:
        """The beat that ticks it: the lease holder, or its partition's owner (partitioned beats)."""
        return ticked_by(admin_database(), obj.slot)

    @admin.display(description="status")
    def status(self, obj: Schedule) -> SafeString:
        """Paused or stopped (with why in the tooltip), else what is running and pending."""
        if obj.paused:
            return label("paused", PAUSED_COLOUR, obj.pause_reason or "no run is emitted until resumed")
        if obj.stopped:
            return label("stopped", STOPPED_COLOUR, f"stopped: {obj.stop_reason or 'stop_schedule()'}")
        busy = [
            f"{n} {word}" for n, word in ((obj.active_runs, "running"), (obj.pending_runs, "pending")) if n
        ]
        if not busy:
            return label("idle", IDLE_COLOUR, "no run active or pending")
        unstarted = _unstarted(obj)
        if unstarted:
            return label(
                waiting_for(queue_of(_options(obj))),
                colour("published"),
                f"{unstarted} published run(s) not started by any worker within "
                "boundedbeat_unstarted_warning: does a worker consume that queue?",
            )
        return label(", ".join(busy), colour("started"))

    @admin.display(description="counts")
    def counts(self, obj: Schedule) -> SafeString:
        """Completed runs always; each other outcome, skips and overlaps only when there are any.

        Only ``failed`` runs are called failed (in red); time-outs, lost and rejected runs have
        their own amber words, and the runs ``replace`` revoked a neutral one.
        """
        items = [("completed", obj.runs, "completed", colour("completed"))]
        found = _unsuccessful(obj)
        items += [(state, found[state], word, tint) for state, word, tint in OUTCOME_LABELS if state in found]
        for key, value, word, tint in (
            ("replaced", obj.replaced, "replaced", NEUTRAL_COLOUR),
            ("skipped", obj.skips, "skipped", NEUTRAL_COLOUR),
            ("overlaps", obj.overlaps, plural(obj.overlaps, "overlap").partition(" ")[2], NEUTRAL_COLOUR),
        ):
            if value:
                items.append((key, value, word, tint))
        return format_html_join(
            ", ",
            '<span class="bb-count bb-count-{0}" style="color:{3};white-space:nowrap">{1} {2}</span>',
            items,
        )

    def _last_run(self, obj: Schedule, *, compact: bool) -> SafeString:
        runs = _recent(obj)
        if not runs:
            return format_html("{}", "—")
        newest = runs[-1]
        started = when(newest.started_at or newest.scheduled_for, compact=compact)
        return format_html("{}<br>{}", started, state_badge(newest.state))

    @admin.display(description=zoned("last run"))
    def last_run(self, obj: Schedule) -> SafeString:
        """The newest run's start (or grid time, before it started) and its state."""
        return self._last_run(obj, compact=True)

    @admin.display(description="last run")
    def last_run_time(self, obj: Schedule) -> SafeString:
        """The schedule page's last run: its whole time and zone."""
        return self._last_run(obj, compact=False)

    def _next_due(self, obj: Schedule, *, compact: bool) -> SafeString:
        if obj.paused or obj.stopped:
            return self.status(obj)
        status = self.status(obj)
        busy = sub(status) if obj.active_runs or obj.pending_runs else ""
        return format_html("{}{}", when(obj.next_due_at, compact=compact), busy)

    @admin.display(description=zoned("next due"), ordering="next_due_at")
    def next_due(self, obj: Schedule) -> SafeString:
        """Paused or stopped instead of a time (the stored one is stale until it resumes), else the
        time and what is running or pending."""
        return self._next_due(obj, compact=True)

    @admin.display(description="next due")
    def next_due_time(self, obj: Schedule) -> SafeString:
        """The schedule page's next due: its whole time and zone."""
        return self._next_due(obj, compact=False)

    last_finished = when_field("last_finished_at", "last finished")
    created = when_field("created_at", "created")
    updated = when_field("updated_at", "updated")

    @admin.display(description="timeline")
    def run_timeline(self, obj: Schedule) -> SafeString:
        now = datetime.now(UTC)
        return mark_safe(timeline_svg(_page_runs(obj), now=now, zone=timezone.get_current_timezone()))

    @admin.display(description="duration and drift")
    def run_chart(self, obj: Schedule) -> SafeString:
        return mark_safe(duration_drift_svg(_page_runs(obj), zone=timezone.get_current_timezone()))

    def get_urls(self) -> list[URLPattern]:
        """The schedule page's Pause / Resume / Trigger buttons post to ``<id>/operate/<action>/``."""
        name = f"{self.opts.app_label}_{self.opts.model_name}_operate"
        view = self.admin_site.admin_view(self.operate_view)  # staff only, CSRF checked
        return [path("<path:object_id>/operate/<str:action>/", view, name=name), *super().get_urls()]

    def operate_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        """Run one list action (pause, resume, trigger) on this schedule, then back to its page.

        The same action functions the list runs, offered by the same ``get_actions`` (so each
        needs the permission its list action needs): one code path, one message per schedule.
        """
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        actions = self.get_actions(request)
        obj = self.get_object(request, unquote(object_id))
        if action not in PAGE_ACTIONS or action not in actions:
            raise PermissionDenied
        if obj is None or not self.has_view_or_change_permission(request, obj):
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        func = actions[action][0]
        func(self, request, self.get_queryset(request).filter(pk=obj.pk))
        return HttpResponseRedirect(
            reverse(f"{self.admin_site.name}:celery_boundedbeat_schedule_change", args=[quote(obj.pk)])
        )

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Model | None = None,
    ) -> HttpResponse:
        """A schedule's page gets a link to its runs and the buttons its user may press."""
        if obj is not None:
            context["bb_runs_url"] = self.runs_url(obj)
            context["bb_buttons"] = self.page_buttons(request, obj)
        return super().render_change_form(request, context, add, change, form_url, obj)

    def runs_url(self, obj: Model) -> str:
        """The run list filtered to this schedule."""
        url = reverse(f"{self.admin_site.name}:celery_boundedbeat_run_changelist")
        return f"{url}?{urlencode({'schedule': obj.pk})}"

    def page_buttons(self, request: HttpRequest, obj: Model) -> list[dict[str, str]]:
        """The page's buttons the user may press and that change something now: Resume only for a
        paused or stopped schedule, Pause only for one that is not paused."""
        actions = self.get_actions(request)
        shown = []
        for action, (text, fits) in PAGE_ACTIONS.items():
            if action in actions and fits(obj):
                name = f"{self.admin_site.name}:celery_boundedbeat_schedule_operate"
                url = reverse(name, args=[quote(obj.pk), action])
                shown.append({"action": action, "label": text, "url": url})
        return shown

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
        :class:`~celery_boundedbeat.core.ticks.TriggerRefused` saying why nothing was done.
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
