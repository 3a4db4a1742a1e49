# mypy: allow-subclassing-any
"""The admin's add and change form of runtime schedules.

The form does not judge a schedule itself. It turns its fields into the arguments of
:func:`~celery_boundedbeat.add_schedule` / :func:`~celery_boundedbeat.update_schedule`
and makes the call while validating, so the admin holds a schedule to exactly the rules and
error texts of the API and of ``beat_schedule``, and the call that checks is the one
transaction that writes. Each :class:`~celery_boundedbeat.core.exceptions.ConfigurationError`
problem is shown on the field its key names; a form is valid exactly when the API accepted it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any

from celery import Celery
from celery.exceptions import ImproperlyConfigured
from celery.schedules import crontab, solar
from django import forms
from django.contrib.admin import widgets
from django.utils.html import escape
from sqlalchemy.exc import SQLAlchemyError

from ...api.schedules import add_schedule, update_schedule
from ...config.cron import CRONTAB_FIELDS, crontab_problems
from ...config.message_options import option_refusals, option_warnings
from ...core.enums import MissedTicks, Mode
from ...core.exceptions import BoundedBeatError, ConfigurationError
from ...core.limits import MAX_SCHEDULE_NAME, MAX_TASK_NAME
from ...db.row_state import RUNTIME
from .conf import celery_app
from .models import Schedule

logger = logging.getLogger("celery_boundedbeat")

#: The timing kinds, as stored in ``timing["kind"]``.
KINDS = (("interval", "interval (every N seconds)"), ("crontab", "crontab"), ("solar", "solar event"))
#: The form fields each timing kind reads.
TIMING_FIELDS: Mapping[str, tuple[str, ...]] = {
    "interval": ("every",),
    "crontab": CRONTAB_FIELDS,
    "solar": ("event", "lat", "lon"),
}
JSON_FIELDS = ("args", "kwargs", "options")
#: One form field per policy key, named as the key (``policy.max_runs`` is the ``max_runs`` field).
POLICY_FIELDS = (
    "mode",
    "missed_ticks",
    "max_concurrency",
    "max_pending",
    "initial_delay",
    "max_run_time",
    "jitter",
    "start_at",
    "end_at",
    "max_runs",
    "catchup_window",
    "pause_on_failure",
    "keep_runs",
    "keep_for",
    "timezone",
    "retry",
)
SECONDS_FIELDS = frozenset({"initial_delay", "max_run_time", "jitter", "catchup_window", "keep_for"})

_BLANK = ("", "(default policy)")


def _json_text(value: Any) -> Any:
    """A JSON column as Python (:class:`~.models.JSONTextField` reads it as text)."""
    return json.loads(value) if isinstance(value, str) else value


def _number(value: Any) -> Decimal | None:
    """A stored float as the decimal its form field shows (and compares unchanged)."""
    return None if value is None else Decimal(str(value))


def _cron_text(value: Any) -> str:
    """A stored crontab field (text, a number or a list of numbers) as crontab text."""
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return "*" if value is None else str(value)


def row_initial(row: Schedule) -> dict[str, Any]:
    """The form's starting values from a stored row: its timing, arguments and policy as fields."""
    timing = _json_text(row.timing) or {}
    kind = timing.get("kind", "interval")
    initial: dict[str, Any] = {"task": row.task, "kind": kind}
    if kind == "interval":
        initial["every"] = _number(timing.get("every", row.period))
    elif kind == "crontab":
        initial.update({f: _cron_text(timing.get(f)) for f in CRONTAB_FIELDS})
    elif kind == "solar":
        initial.update(
            event=timing.get("event"), lat=_number(timing.get("lat")), lon=_number(timing.get("lon"))
        )
    for key in JSON_FIELDS:
        initial[key] = _json_text(getattr(row, key))
    policy = _json_text(row.policy) or {}
    for key in POLICY_FIELDS:
        value = policy.get(key)
        if key in SECONDS_FIELDS:
            value = _number(value)
        elif key in ("start_at", "end_at") and value is not None:
            value = datetime.fromisoformat(value)
        initial[key] = value
    return initial


def policy_value(key: str, value: Any) -> Any:
    """A cleaned policy field as the API takes it; ``None`` (blank) drops the key to its default."""
    if value in (None, ""):
        return None
    if isinstance(value, Decimal):
        return float(value)
    return value


def json_value(data: Mapping[str, Any], key: str) -> Any:
    """A JSON field's value for the API: blank is the empty list or object, the rest as given."""
    value = data.get(key)
    if value is None:
        return [] if key == "args" else {}
    return value


def field_for(key: str, kind: str | None) -> str | None:
    """The form field a problem's key names, or ``None`` for a problem of the whole schedule."""
    if key == "schedule":
        return "every" if kind == "interval" else "kind"
    if key in ("name", "task", *JSON_FIELDS):
        return key
    field = key.removeprefix("policy.").split(".")[0]  # policy.retry.on is the retry field
    if key.startswith("policy.") and field in POLICY_FIELDS:
        return field
    return None


def _seconds(label: str, help_text: str) -> forms.DecimalField:
    return forms.DecimalField(required=False, label=label, help_text=help_text)


def _json(help_text: str, initial: type) -> forms.JSONField:
    return forms.JSONField(
        required=False, initial=initial, help_text=help_text, widget=forms.Textarea(attrs={"rows": 2})
    )


def _cron(label: str) -> forms.CharField:
    return forms.CharField(required=False, initial="*", label=label, max_length=200)


class ScheduleForm(forms.ModelForm):
    """Add (every field) or change (only the fields that changed) one runtime schedule."""

    name = forms.CharField(max_length=MAX_SCHEDULE_NAME, help_text="Unique; it cannot be changed later.")
    task = forms.CharField(
        max_length=MAX_TASK_NAME, help_text="The registered task name, e.g. proj.tasks.report."
    )
    kind = forms.ChoiceField(choices=KINDS, initial="interval", label="Timing")
    every = forms.DecimalField(required=False, label="Every (seconds)", help_text="Interval timing.")
    minute = _cron("Minute")
    hour = _cron("Hour")
    day_of_week = _cron("Day of week")
    day_of_month = _cron("Day of month")
    month_of_year = _cron("Month of year")
    event = forms.ChoiceField(
        required=False, choices=[("", "---------"), *((e, e) for e in sorted(solar._all_events))]
    )
    lat = forms.DecimalField(required=False, min_value=-90, max_value=90, label="Latitude")
    lon = forms.DecimalField(required=False, min_value=-180, max_value=180, label="Longitude")
    args = _json("Positional arguments, a JSON list.", list)
    kwargs = _json("Keyword arguments, a JSON object.", dict)
    options = _json("apply_async options, a JSON object (queue, priority, expires, ...).", dict)
    mode = forms.ChoiceField(required=False, choices=[_BLANK, *((m.value, m.value) for m in Mode)])
    missed_ticks = forms.ChoiceField(
        required=False, choices=[_BLANK, *((m.value, m.value) for m in MissedTicks)]
    )
    max_concurrency = forms.IntegerField(required=False, help_text="Runs active at once (fixed_rate only).")
    max_pending = forms.IntegerField(required=False, help_text="Missed ticks kept (catch_up only).")
    initial_delay = _seconds("Initial delay (seconds)", "Wait before the first run.")
    max_run_time = _seconds("Max run time (seconds)", "A run still active after this is timed_out.")
    jitter = _seconds("Jitter (seconds)", "Each run is delayed by up to this much at random.")
    start_at = forms.SplitDateTimeField(
        required=False, widget=widgets.AdminSplitDateTime, help_text="No grid run before this time."
    )
    end_at = forms.SplitDateTimeField(
        required=False, widget=widgets.AdminSplitDateTime, help_text="No grid run after this time."
    )
    max_runs = forms.IntegerField(
        required=False, help_text="At most this many grid runs (triggers not counted)."
    )
    catchup_window = _seconds(
        "Catch-up window (seconds)", "Grid ticks found later than this after their time are dropped."
    )
    pause_on_failure = forms.IntegerField(
        required=False, help_text="Pause after this many failed, timed-out or lost runs in a row."
    )
    keep_runs = forms.IntegerField(
        required=False, help_text="Retention: keep at most this many settled runs in the history."
    )
    keep_for = _seconds("Keep for (seconds)", "Retention: settled runs older than this are deleted.")
    timezone = forms.CharField(
        required=False,
        max_length=64,
        label="Time zone",
        help_text="Crontab/solar only: an IANA name such as Europe/Berlin; blank: the app's time zone.",
    )
    retry = forms.JSONField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text=(
            'Run a grid time again after a lost or timed-out run, a JSON object such as {"on": '
            '["lost", "timed_out"], "max_attempts": 3, "backoff": 10, "max_backoff": 300}; '
            "blank: no retries."
        ),
    )

    class Meta:
        model = Schedule
        fields = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Starting values come from the stored row (change) or the request (add), never from
        # Django's model_to_dict, which reads the JSON columns as text.
        given = dict(kwargs.get("initial") or {})
        self.adding = bool(self.instance._state.adding)
        #: Unknown ``options`` keys of the saved schedule: the admin shows them as warnings.
        self.warnings: list[str] = []
        if self.adding:
            self.initial = given
            return
        self.initial = {**row_initial(self.instance), **given}
        stored = self.initial.get("options")
        if isinstance(stored, Mapping) and "options" in self.fields:
            # The admin renders help text as HTML: the stored keys are escaped.
            self.fields["options"].help_text += "".join(
                f" Warning: {escape(w)}" for w in option_warnings(stored)
            )
        for key in ("mode", "missed_ticks"):  # stored in full: "default" is no choice on a change
            field = self.fields.get(key)
            if isinstance(field, forms.ChoiceField):
                field.required = True
                field.choices = [c for c in field.choices if c[0] != ""]

    def clean(self) -> dict[str, Any]:
        """Ask for the fields of the chosen timing kind (the others are ignored)."""
        data = super().clean() or {}
        kind = data.get("kind")
        needed = ("every",) if kind == "interval" else ("event", "lat", "lon") if kind == "solar" else ()
        for key in needed:
            if key in self.fields and data.get(key) in (None, "") and key not in self.errors:
                self.add_error(key, "Required for this timing.")
        return data

    def _post_clean(self) -> None:
        """Apply through the API once every field parsed, in place of Django's model validation.

        The unmanaged row is written by the API (one transaction that validates and writes),
        never by ``Model.save``; the admin's ``save_model`` therefore has nothing left to do.
        """
        if self.errors:
            return
        data = self.cleaned_data
        options = data.get("options")
        if isinstance(options, Mapping):
            for refusal in option_refusals(options):
                self.add_error("options", refusal)
            if self.errors:
                return
            self.warnings = option_warnings(options)
        with celery_app() as app:
            try:
                schedule = self._schedule(app, data)
                if schedule is not None:
                    self._apply(app, data, schedule)
            except ConfigurationError as exc:
                self._show(exc.problems, data.get("kind"))
            except (BoundedBeatError, ImproperlyConfigured) as exc:  # e.g. settings, or solar without ephem
                self.add_error(None, str(exc))
            except SQLAlchemyError as exc:
                logger.exception("celery_boundedbeat admin: writing schedule %r failed", self.instance.name)
                self.add_error(None, f"The schedule database could not be written ({type(exc).__name__}).")

    def _schedule(self, app: Celery, data: Mapping[str, Any]) -> Any:
        """The schedule value the API takes for the chosen kind: seconds, a crontab or a solar.

        Celery parses crontab text and solar events itself; what it refuses is shown on the
        field it came from. ``None`` when something was refused.
        """
        kind = data["kind"]
        if kind == "interval":
            return float(data["every"])
        if kind == "solar":
            return solar(data["event"], float(data["lat"]), float(data["lon"]), app=app)
        fields = {f: (data.get(f) or "*").strip() for f in CRONTAB_FIELDS}
        for _, key, reason in crontab_problems(self.instance.name or "", fields):
            self.add_error(key, reason[0].upper() + reason[1:])
        return None if self.errors else crontab(**fields, app=app)

    def _apply(self, app: Celery, data: Mapping[str, Any], schedule: Any) -> None:
        if self.adding:
            self._add(app, data, schedule)
            return
        changes = self.changes(data, schedule)
        if changes:
            update_schedule(app, self.instance.name, **changes)

    def _add(self, app: Celery, data: Mapping[str, Any], schedule: Any) -> None:
        policy = {k: policy_value(k, data.get(k)) for k in POLICY_FIELDS}
        outcome = add_schedule(
            app,
            data["name"],
            data["task"],
            schedule,
            args=json_value(data, "args"),
            kwargs=json_value(data, "kwargs"),
            options=json_value(data, "options"),
            policy={k: v for k, v in policy.items() if v is not None},
        )
        if outcome == "already_present":
            self.add_error(
                "name", "A schedule of this name exists already (config or runtime); nothing changed."
            )
            return
        self.instance.name = data["name"]
        self.instance.task = data["task"]
        self.instance.origin = RUNTIME

    def changes(self, data: Mapping[str, Any], schedule: Any) -> dict[str, Any]:
        """``update_schedule``'s keyword arguments: only what the user changed on this page."""
        changed = set(self.changed_data)
        out: dict[str, Any] = {}
        if "task" in changed:
            out["task"] = data["task"]
        if changed & {"kind", *TIMING_FIELDS[data["kind"]]}:
            out["schedule"] = schedule
        for key in JSON_FIELDS:
            if key in changed:
                out[key] = json_value(data, key)
        policy = {k: policy_value(k, data.get(k)) for k in POLICY_FIELDS if k in changed}
        if policy:
            out["policy"] = policy
        return out

    def _show(self, problems: list[tuple[str, str, str]], kind: str | None) -> None:
        """Each problem on the field its key names; the rest above the form, key first."""
        for _entry, key, reason in problems:
            field = field_for(key, kind)
            if field is not None and field in self.fields:
                self.add_error(field, reason)
            else:
                self.add_error(None, f"{key}: {reason}")
