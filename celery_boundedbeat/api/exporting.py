"""Schedules as code: every runtime schedule written to a file, and read back (docs/migrating.md).

``boundedbeat export`` writes each runtime schedule as stored (timing, task, args, kwargs,
options, the complete policy, paused and stopped state) in JSON, or YAML when PyYAML is
installed (the ``yaml`` extra). ``boundedbeat import FILE`` reads such a file back into
:class:`~.importing.Incoming` values for :func:`~.importing.plan_import`: importing an export
into an empty database and exporting again gives the same file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery import Celery

from ..config.definitions import schedule_value
from ..config.settings import Settings
from ..core.enums import StopReason
from ..core.exceptions import ConfigurationError
from ..db.engine import get_engine
from ..db.row_state import RUNTIME
from ..db.store import Store
from ..db.tables import ScheduleRow
from .importing import Incoming, Refused

#: Names the file's top level, so a stray JSON document is not read as schedules.
FORMAT = "celery_boundedbeat.schedules"
VERSION = 1
#: The keys of one schedule in the file.
FIELDS = ("name", "task", "timing", "args", "kwargs", "options", "policy", "paused", "stop_reason")


def _schedule(row: ScheduleRow) -> dict[str, Any]:
    return {
        "name": row.name,
        "task": row.task,
        "timing": row.timing,
        "args": list(row.args or ()),
        "kwargs": dict(row.kwargs or {}),
        "options": dict(row.options or {}),
        "policy": dict(row.policy or {}),
        "paused": bool(row.paused),
        "stop_reason": row.stop_reason,
    }


def export_document(app: Celery) -> dict[str, Any]:
    """Every runtime schedule, by name, as the file holds it (config schedules live in code)."""
    settings = Settings.from_conf(app.conf, only=("database_url",))
    rows = Store(get_engine(settings.database_url)).schedules()
    schedules = [_schedule(row) for row in sorted(rows, key=lambda r: r.name) if row.origin == RUNTIME]
    return {"format": FORMAT, "version": VERSION, "schedules": schedules}


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise ConfigurationError(
            [("export", "format", "YAML needs PyYAML: pip install 'celery-boundedbeat[yaml]'")]
        ) from None
    return yaml


def dump(document: Mapping[str, Any], fmt: str) -> str:
    """The document as JSON (keys sorted, 2-space indent) or YAML."""
    if fmt == "yaml":
        text: str = _yaml().safe_dump(dict(document), sort_keys=True, allow_unicode=True)
        return text
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def format_of(path: str) -> str:
    """``yaml`` for a ``.yaml`` or ``.yml`` file, else ``json``."""
    return "yaml" if Path(path).suffix.lower() in (".yaml", ".yml") else "json"


def load(text: str, fmt: str) -> Any:
    """A file's text as data; a syntax error is a :class:`ConfigurationError` naming the format."""
    try:
        return _yaml().safe_load(text) if fmt == "yaml" else json.loads(text)
    except ValueError as exc:
        raise ConfigurationError([("file", fmt, f"cannot be read ({exc})")]) from None
    except Exception as exc:  # PyYAML's YAMLError is no ValueError
        raise ConfigurationError([("file", fmt, f"cannot be read ({type(exc).__name__}: {exc})")]) from None


def read_document(app: Celery, data: Any) -> list[Incoming | Refused]:
    """The schedules of an exported document; a schedule that cannot be read is refused."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise ConfigurationError(
            [("file", "format", f"is not a file written by boundedbeat export ({FORMAT})")]
        )
    if data.get("version") != VERSION:
        raise ConfigurationError([("file", "version", f"must be {VERSION}, got {data.get('version')!r}")])
    schedules = data.get("schedules")
    if not isinstance(schedules, list):
        raise ConfigurationError([("file", "schedules", "must be a list")])
    return [_incoming(app, i, s) for i, s in enumerate(schedules)]


def _incoming(app: Celery, index: int, s: Any) -> Incoming | Refused:
    if not isinstance(s, Mapping) or not isinstance(s.get("name"), str):
        return Refused(name=f"#{index + 1}", reason="must be an object with a name")
    name = s["name"]
    unknown = sorted(set(s) - set(FIELDS))
    if unknown:
        return Refused(name=name, reason=f"unknown keys {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    try:
        schedule, zone = schedule_value(name, s.get("timing"), app)
        stop = None if s.get("stop_reason") is None else StopReason(s["stop_reason"])
    except ConfigurationError as exc:
        return Refused(
            name=name, task=str(s.get("task")), reason="; ".join(f"{k}: {r}" for _, k, r in exc.problems)
        )
    except ValueError:
        return Refused(name=name, task=str(s.get("task")), reason=f"unknown stop_reason {s['stop_reason']!r}")
    if not isinstance(s.get("task"), str):
        return Refused(name=name, reason=f"task must be a task name, got {s.get('task')!r}")
    if not isinstance(s.get("paused", False), bool):
        return Refused(
            name=name, task=str(s.get("task")), reason=f"paused must be true or false, got {s['paused']!r}"
        )
    return Incoming(
        name=name,
        task=s["task"],
        schedule=schedule,
        args=s.get("args") or [],
        kwargs=s.get("kwargs") or {},
        options=s.get("options") or {},
        policy=s.get("policy") or {},
        paused=s.get("paused", False),
        stop_reason=stop,
        zone=zone,
        merge_default=False,
    )
