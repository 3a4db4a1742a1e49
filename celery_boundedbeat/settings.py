"""All celery_boundedbeat settings, read once from the Celery config into a frozen value."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .exceptions import ConfigurationError

DEFAULT_DATABASE_URL = "sqlite:///celerybeat-boundedbeat.sqlite3"


class ConfLike(Protocol):
    def get(self, key: str, default: Any = None) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """Every knob with its default; the README's settings table mirrors this class."""

    #: SQLAlchemy URL of the state/history database.
    database_url: str = DEFAULT_DATABASE_URL
    #: Policy keys applied to entries without their own (CONTRACT §2).
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
    dispatch_batch_size: int = 500
    #: A claimed row whose dispatcher died returns to the queue after this many seconds.
    dispatch_claim_timeout: float = 60.0
    #: A queued run that could not be published for this long settles ``rejected``.
    publish_timeout: float = 3600.0
    #: A published run that no worker started for this long settles ``rejected``.
    start_timeout: float = 3600.0
    #: Worker heartbeat period; a run is ``lost`` after three missed beats.
    heartbeat_interval: float = 3.0
    #: Leader lease time-to-live and renewal period, in seconds.
    lease_ttl: float = 15.0
    lease_renew_interval: float = 5.0
    #: Seconds background loops get to finish on shutdown.
    shutdown_grace: float = 10.0
    #: Delete finished runs older than this many days (``None`` keeps everything).
    retention_days: float | None = None
    #: Most schedules handled in one tick transaction.
    tick_batch_size: int = 1000

    @classmethod
    def from_conf(cls, conf: ConfLike) -> Settings:
        """Read ``boundedbeat_*`` keys (Django: ``CELERY_BOUNDEDBEAT_*``) and validate them."""
        problems: list[tuple[str, str, str]] = []
        values: dict[str, Any] = {}
        defaults = cls()
        for name in cls.__dataclass_fields__:
            key = f"boundedbeat_{name}"
            raw = conf.get(key)
            if raw is None:
                continue
            default = getattr(defaults, name)
            if name == "database_url":
                if not isinstance(raw, str) or not raw:
                    problems.append(("settings", key, "must be a non-empty SQLAlchemy URL string"))
                    continue
            elif name == "default_policy":
                if not isinstance(raw, Mapping):
                    problems.append(("settings", key, f"must be a dict, got {type(raw).__name__}"))
                    continue
            elif name in ("auto_migrate", "dispatch_enabled"):
                if not isinstance(raw, bool):
                    problems.append(("settings", key, f"must be True or False, got {raw!r}"))
                    continue
            elif isinstance(default, int) and not isinstance(default, bool):
                if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
                    problems.append(("settings", key, f"must be an integer >= 1, got {raw!r}"))
                    continue
            else:
                if (
                    isinstance(raw, bool)
                    or not isinstance(raw, int | float)
                    or not math.isfinite(raw)
                    or raw < 0
                ):
                    problems.append(("settings", key, f"must be a number of seconds >= 0, got {raw!r}"))
                    continue
                raw = float(raw)
            values[name] = raw
        if problems:
            raise ConfigurationError(problems)
        return cls(**values)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def should_auto_migrate(self) -> bool:
        return self.is_sqlite if self.auto_migrate is None else self.auto_migrate
