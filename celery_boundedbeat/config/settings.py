"""All celery_boundedbeat settings, read once from the Celery config into a frozen value."""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote, urlencode

from ..core.exceptions import ConfigurationError
from ..core.partitions import MAX_PARTITIONS, is_power_of_two
from ..core.unstarted import DEFAULT_UNSTARTED_WARNING

DEFAULT_DATABASE_URL = "sqlite:///celerybeat-boundedbeat.sqlite3"

#: Zero here would mark every run lost, expire the lease at once, or spin a loop.
_POSITIVE = frozenset(
    {
        "poll_interval",
        "dispatch_claim_timeout",
        "publish_timeout",
        "start_timeout",
        "heartbeat_interval",
        "lease_ttl",
        "lease_renew_interval",
        "metrics_refresh_interval",
        "retention_interval",
    }
)
#: The longest ``prepare_ahead``: a prepared tick holds its schedules' row locks that long.
MAX_PREPARE_AHEAD = 5.0
#: Values of ``report_writer``.
REPORT_WRITERS = ("auto", "thread", "process")
#: The highest TCP port (``metrics_port``; 0 lets the system pick a free one).
_MAX_PORT = 65535


class ConfLike(Protocol):
    def get(self, key: str, default: Any = None) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """Every knob with its default; the README's settings table mirrors this class."""

    #: SQLAlchemy URL of the state/history database (in a configured Django project without
    #: it: Django's default database). Left out of ``repr`` because it may hold a password.
    database_url: str = field(default=DEFAULT_DATABASE_URL, repr=False)
    #: Policy keys applied to entries without their own (docs/policies.md).
    default_policy: Mapping[str, Any] = field(default_factory=dict)
    #: Migrate the schema when beat starts; ``None`` means "only for SQLite".
    auto_migrate: bool | None = None
    #: Longest beat sleep between looks at the database (SQLite polls completions this often).
    poll_interval: float = 1.0
    #: Run the dispatcher inside the beat process.
    dispatch_enabled: bool = True
    #: Dispatcher base sleep when idle (0 means 1 s) and its cap, in seconds.
    dispatch_interval: float = 1.0
    dispatch_max_interval: float = 30.0
    #: Queue rows claimed and published per batch.
    dispatch_batch_size: int = 1000
    #: A claimed row whose dispatcher died returns to the queue after this many seconds.
    dispatch_claim_timeout: float = 60.0
    #: A queued run that could not be published for this long settles ``rejected``.
    publish_timeout: float = 3600.0
    #: A published run that no worker started for this long settles ``rejected``.
    start_timeout: float = 3600.0
    #: A published run no worker started for this long is reported ("waiting for a worker on
    #: queue x") by ``health``, the metrics, ``status`` and the admin; 0 turns the warning off.
    unstarted_warning: float = DEFAULT_UNSTARTED_WARNING
    #: Worker heartbeat period; a dead worker's run is ``lost`` within 3⅓ intervals (10 s by default).
    heartbeat_interval: float = 3.0
    #: Leader lease time-to-live and renewal period, in seconds.
    lease_ttl: float = 15.0
    lease_renew_interval: float = 5.0
    #: Schedules are split into this many partitions (a power of two up to 1024), and every
    #: live beat ticks its share of them; 1: one beat (the lease holder) ticks every schedule.
    partitions: int = 1
    #: Seconds background loops get to finish on shutdown.
    shutdown_grace: float = 10.0
    #: Delete finished runs older than this many days (``None`` keeps everything).
    retention_days: float | None = None
    #: Seconds between two retention passes (global ``retention_days`` and the per-schedule
    #: ``keep_runs`` / ``keep_for`` policy keys), run by the lease holder off the tick thread.
    retention_interval: float = 3600.0
    #: ``schedule_failing`` is sent when this many counted failures come in a row.
    failing_threshold: int = 1
    #: Most schedules handled in one tick transaction.
    tick_batch_size: int = 1000
    #: PostgreSQL: seconds before a due time the beat writes that tick (uncommitted) and builds
    #: its messages, so at the due instant only the commit and the broker writes are left
    #: (:mod:`~celery_boundedbeat.beat.prepared`); 0 turns it off. Changes to those schedules made
    #: within this lead wait for the commit.
    prepare_ahead: float = 0.5
    #: Where a worker's run reports are written: ``"thread"`` (a thread of the worker process),
    #: ``"process"`` (a child process of its own, off the worker's GIL) or ``"auto"``: the
    #: process for the threads pool, where every task shares that GIL, the thread elsewhere.
    report_writer: str = "auto"
    #: A worker records each run's start before the task's body runs, and a second delivery of
    #: a run another process started does not run the body again. ``False``: starts are
    #: written behind the task like outcomes (cheaper per run; a duplicate delivery runs).
    skip_duplicate_deliveries: bool = True
    #: Beat serves Prometheus metrics on this port (``/metrics``); ``None``: no endpoint.
    metrics_port: int | None = None
    #: The address the metrics endpoint binds to (loopback: nothing outside the host sees it).
    metrics_host: str = "127.0.0.1"
    #: Seconds between two reads of the metrics snapshot a scrape is served from.
    metrics_refresh_interval: float = 10.0

    @classmethod
    def from_conf(cls, conf: ConfLike, only: Collection[str] | None = None) -> Settings:
        """Read ``boundedbeat_*`` keys (Django: ``CELERY_BOUNDEDBEAT_*``) and validate them.

        Without ``boundedbeat_database_url``, a process whose Django settings are configured
        uses Django's ``DATABASES["default"]``; any other process uses the SQLite default.
        ``only`` reads just those settings (the others keep their defaults): a runtime API call
        needs two, and each lookup in Celery's configuration costs microseconds.
        """
        problems: list[tuple[str, str, str]] = []
        values: dict[str, Any] = {}
        defaults = cls()
        for name in cls.__dataclass_fields__ if only is None else only:
            raw = conf.get(f"boundedbeat_{name}")
            if raw is None:
                continue
            value, problem = _check_value(name, raw, getattr(defaults, name))
            if problem is not None:
                problems.append(("settings", f"boundedbeat_{name}", problem))
            else:
                values[name] = value
        ttl = values.get("lease_ttl", defaults.lease_ttl)
        renew = values.get("lease_renew_interval", defaults.lease_renew_interval)
        if not problems and renew >= ttl:
            problems.append(
                (
                    "settings",
                    "boundedbeat_lease_renew_interval",
                    f"must be shorter than boundedbeat_lease_ttl ({ttl:g} s), got {renew:g}",
                )
            )
        wanted = only is None or "database_url" in only
        refused = any(problem[1] == "boundedbeat_database_url" for problem in problems)
        if wanted and "database_url" not in values and not refused:
            _use_django_database(values, problems)
        if problems:
            raise ConfigurationError(problems)
        return cls(**values)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def should_auto_migrate(self) -> bool:
        return self.is_sqlite if self.auto_migrate is None else self.auto_migrate


#: Keys with the ``boundedbeat_`` prefix that are not :class:`Settings` fields but are known
#: (the Django admin's ``BOUNDEDBEAT_ADMIN_DATABASE``).
_OTHER_KEYS = frozenset({"admin_database"})
#: The prefixes a setting is written with: Celery's own and Django's ``CELERY_`` namespace.
_PREFIXES = ("celery_boundedbeat_", "boundedbeat_")

#: Unknown keys already warned about in this process (beat builds two schedulers, a worker
#: may run several apps: each typo is said once).
_warned: set[str] = set()


def unknown_settings(keys: Iterable[str]) -> list[tuple[str, str | None]]:
    """Each ``boundedbeat_*`` key that is no setting, with the closest known one as it would be written.

    ``boundedbeat_databse_url`` gives ``boundedbeat_database_url``; Django's
    ``CELERY_BOUNDEDBEAT_DATABSE_URL`` gives ``CELERY_BOUNDEDBEAT_DATABASE_URL``.
    """
    known = sorted({*Settings.__dataclass_fields__, *_OTHER_KEYS})
    found: list[tuple[str, str | None]] = []
    for key in keys:
        lowered = key.lower()
        prefix = next((p for p in _PREFIXES if lowered.startswith(p)), None)
        if prefix is None or lowered[len(prefix) :] in known:
            continue
        close = difflib.get_close_matches(lowered[len(prefix) :], known, n=1)
        suggestion = None
        if close:
            written = key[: len(prefix)] + close[0]
            suggestion = written.upper() if key.isupper() else written
        found.append((key, suggestion))
    return sorted(found)


def warn_unknown_settings(conf: Any, logger: logging.Logger) -> None:
    """Log one warning per unknown ``boundedbeat_*`` key in ``conf`` (once per process).

    A mistyped setting is otherwise ignored without a word, and its default used.
    """
    keys = getattr(conf, "keys", None)
    if keys is None:
        return
    for key, suggestion in unknown_settings(str(k) for k in keys()):
        if key in _warned:
            continue
        _warned.add(key)
        hint = f"; did you mean {suggestion}?" if suggestion else ""
        logger.warning("celery_boundedbeat: unknown setting %s is ignored%s", key, hint)


def _check_value(name: str, raw: Any, default: Any) -> tuple[Any, str | None]:
    """One setting's value as stored, or why it is refused (the default's type decides)."""
    if name == "database_url":
        if not isinstance(raw, str) or not raw:
            return None, "must be a non-empty SQLAlchemy URL string"
    elif name == "metrics_port":
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= _MAX_PORT:
            return None, f"must be a TCP port, an integer from 0 to {_MAX_PORT}, got {raw!r}"
    elif name == "metrics_host":
        if not isinstance(raw, str) or not raw.strip():
            return None, f"must be a non-empty host name or address, got {raw!r}"
    elif name == "report_writer":
        if raw not in REPORT_WRITERS:
            return None, f"must be one of {', '.join(map(repr, REPORT_WRITERS))}, got {raw!r}"
    elif name == "default_policy":
        if not isinstance(raw, Mapping):
            return None, f"must be a dict, got {type(raw).__name__}"
    elif name == "partitions":
        if (
            isinstance(raw, bool)
            or not isinstance(raw, int)
            or not is_power_of_two(raw)
            or raw > MAX_PARTITIONS
        ):
            return None, f"must be a power of two from 1 to {MAX_PARTITIONS} (1, 2, 4, ... 1024), got {raw!r}"
    elif name in ("auto_migrate", "dispatch_enabled", "skip_duplicate_deliveries"):
        if not isinstance(raw, bool):
            return None, f"must be True or False, got {raw!r}"
    elif isinstance(default, int) and not isinstance(default, bool):
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
            return None, f"must be an integer >= 1, got {raw!r}"
    else:
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or raw < 0:
            return None, f"must be a number of seconds >= 0, got {raw!r}"
        if name in _POSITIVE and raw == 0:
            return None, "must be > 0 seconds, got 0"
        if name == "prepare_ahead" and raw > MAX_PREPARE_AHEAD:
            # Its locks are held that long: a settle or a pause of those schedules waits as long.
            return None, f"must be at most {MAX_PREPARE_AHEAD:g} seconds, got {raw!r}"
        return float(raw), None
    return raw, None


def _use_django_database(values: dict[str, Any], problems: list[tuple[str, str, str]]) -> None:
    """Without a URL of our own, a configured Django project's default database is used."""
    try:
        django_url = django_default_database_url()
    except ValueError as exc:
        problems.append(
            (
                "settings",
                "boundedbeat_database_url",
                f"is not set (CELERY_BOUNDEDBEAT_DATABASE_URL in Django settings) and "
                f"Django's DATABASES['default'] cannot be used instead: {exc}",
            )
        )
    else:
        if django_url is not None:
            values["database_url"] = django_url


#: Django backends (last part of ENGINE) whose DATABASES entry can become a SQLAlchemy URL.
_DJANGO_POSTGRES = frozenset({"postgresql", "postgis"})
_DJANGO_SQLITE = frozenset({"sqlite3", "spatialite"})
#: libpq connection keywords copied from a PostgreSQL entry's OPTIONS (Django's own keys such as
#: ``pool`` or ``isolation_level`` are not; secrets such as ``sslpassword`` stay out of the URL).
_LIBPQ_OPTIONS = frozenset(
    {
        "application_name",
        "channel_binding",
        "connect_timeout",
        "gssencmode",
        "keepalives",
        "keepalives_count",
        "keepalives_idle",
        "keepalives_interval",
        "options",
        "passfile",
        "service",
        "sslcert",
        "sslcrl",
        "sslkey",
        "sslmode",
        "sslrootcert",
        "target_session_attrs",
    }
)
#: Database names that need no escaping (others go in the ``dbname`` query parameter).
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.$-]+")


def app_name(app: Any) -> str | None:
    """What ``celery -A`` names for ``app`` (its ``main``), for the commands a message quotes.

    ``None`` for an app without one and for the app the Django admin builds for itself.
    """
    main = getattr(app, "main", None)
    if not isinstance(main, str) or not main or main == "__main__" or main.startswith("celery_boundedbeat"):
        return None
    return main


def django_configured() -> bool:
    """Whether this process has configured Django settings (never imports Django)."""
    django_conf = sys.modules.get("django.conf")
    django_settings = getattr(django_conf, "settings", None)
    return django_settings is not None and bool(django_settings.configured)


def django_default_database_url() -> str | None:
    """Django's ``DATABASES["default"]`` as a SQLAlchemy URL, when Django settings are configured.

    Django is never imported here (settings stay pure): a process that has not loaded
    ``django.conf`` cannot have configured Django settings, so plain Celery apps return ``None``.
    """
    django_conf = sys.modules.get("django.conf")
    django_settings = getattr(django_conf, "settings", None)
    if django_settings is None or not django_settings.configured:
        return None
    default = (getattr(django_settings, "DATABASES", None) or {}).get("default")
    return database_url_from_django(default) if default else None


def database_url_from_django(db: Mapping[str, Any]) -> str:
    """The SQLAlchemy URL of one Django ``DATABASES`` entry (PostgreSQL or SQLite).

    Built with stdlib percent-escaping that every supported SQLAlchemy parses the same way
    (settings import no SQLAlchemy). Raises ``ValueError`` whose text never holds the password.
    """
    engine = str(db.get("ENGINE") or "")
    backend = engine.rsplit(".", 1)[-1]
    name = db.get("NAME")
    if backend in _DJANGO_SQLITE:
        path = os.fspath(name) if name else ""
        if not path or path == ":memory:" or "mode=memory" in path:
            raise ValueError("it is an in-memory SQLite database, which no other process can share")
        if "?" in path or "%" in path:
            raise ValueError(f"its SQLite path {path!r} contains '?' or '%'")
        return "sqlite:///" + os.path.abspath(path)
    if backend not in _DJANGO_POSTGRES:
        raise ValueError(f"its ENGINE {engine!r} is neither PostgreSQL nor SQLite")
    userinfo = ""
    if db.get("USER") or db.get("PASSWORD"):
        userinfo = quote(str(db.get("USER") or ""), safe="")
        if db.get("PASSWORD"):
            userinfo += ":" + quote(str(db["PASSWORD"]), safe="")
        userinfo += "@"
    query: dict[str, str] = {}
    host = str(db.get("HOST") or "")
    port = str(db.get("PORT") or "")
    if port and not port.isdigit():
        raise ValueError(f"its PORT {port!r} is not a number")
    if host.startswith("/"):  # a Unix socket directory
        query["host"], host = host, ""
    elif ":" in host:  # an IPv6 address
        host = f"[{host}]"
    if port and not host:
        query["port"], port = port, ""
    path = ""
    if name and _PLAIN_NAME.fullmatch(str(name)):
        path = f"/{name}"
    elif name:
        query["dbname"] = str(name)
    for key, value in (db.get("OPTIONS") or {}).items():
        if key in _LIBPQ_OPTIONS and isinstance(value, str | int) and not isinstance(value, bool):
            query[key] = str(value)
    url = f"postgresql+psycopg://{userinfo}{host}{':' + port if port else ''}{path}"
    return f"{url}?{urlencode(query)}" if query else url
