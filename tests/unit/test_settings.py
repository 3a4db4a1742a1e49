"""Settings are read once from the Celery config into a frozen, validated value."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import celery
import pytest

from celery_boundedbeat.config.settings import (
    DEFAULT_DATABASE_URL,
    Settings,
    unknown_settings,
    warn_unknown_settings,
)
from celery_boundedbeat.core.exceptions import ConfigurationError


def from_conf(**conf: Any) -> Settings:
    app = celery.Celery("t", set_as_current=False)
    app.conf.update(conf)
    return Settings.from_conf(app.conf)


def problem_keys(**conf: Any) -> set[str]:
    with pytest.raises(ConfigurationError) as info:
        from_conf(**conf)
    assert all(entry == "settings" for entry, _k, _r in info.value.problems)
    return {key for _e, key, _r in info.value.problems}


def test_defaults_are_safe() -> None:
    """An empty Celery config gives the documented defaults (SQLite file, dispatch in beat)."""
    settings = from_conf()
    assert settings == Settings()
    assert settings.database_url == DEFAULT_DATABASE_URL == "sqlite:///celerybeat-boundedbeat.sqlite3"
    assert dict(settings.default_policy) == {}
    assert settings.dispatch_enabled is True
    assert settings.retention_days is None
    assert settings.is_sqlite and settings.should_auto_migrate


def test_values_are_read_from_boundedbeat_keys() -> None:
    """boundedbeat_* keys set the matching fields; integers given for seconds become floats."""
    settings = from_conf(
        boundedbeat_database_url="postgresql+psycopg://u@h/db",
        boundedbeat_default_policy={"mode": "fixed_delay"},
        boundedbeat_dispatch_batch_size=50,
        boundedbeat_lease_ttl=20,
        boundedbeat_retention_days=7,
        boundedbeat_auto_migrate=True,
        boundedbeat_report_writer="process",
    )
    assert settings.database_url == "postgresql+psycopg://u@h/db"
    assert settings.report_writer == "process" and Settings().report_writer == "auto"
    assert dict(settings.default_policy) == {"mode": "fixed_delay"}
    assert settings.dispatch_batch_size == 50
    assert settings.lease_ttl == 20.0 and isinstance(settings.lease_ttl, float)
    assert settings.retention_days == 7.0
    assert not settings.is_sqlite
    assert settings.should_auto_migrate is True


def test_postgres_is_not_auto_migrated_by_default() -> None:
    """Only SQLite databases are migrated automatically unless auto_migrate says otherwise."""
    assert from_conf(boundedbeat_database_url="postgresql://h/db").should_auto_migrate is False
    assert from_conf(boundedbeat_auto_migrate=False).should_auto_migrate is False


def test_settings_are_frozen() -> None:
    """The settings value cannot be changed after it is read."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().lease_ttl = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("boundedbeat_database_url", 5),
        ("boundedbeat_database_url", ""),
        ("boundedbeat_default_policy", "fixed_delay"),
        ("boundedbeat_auto_migrate", "yes"),
        ("boundedbeat_dispatch_enabled", 1),
        ("boundedbeat_dispatch_batch_size", True),
        ("boundedbeat_dispatch_batch_size", 0),
        ("boundedbeat_dispatch_batch_size", 2.5),
        ("boundedbeat_tick_batch_size", "10"),
        ("boundedbeat_lease_ttl", -1),
        ("boundedbeat_lease_ttl", "15"),
        ("boundedbeat_lease_ttl", True),
        ("boundedbeat_poll_interval", float("nan")),
        ("boundedbeat_heartbeat_interval", float("inf")),
        ("boundedbeat_retention_days", -2),
        ("boundedbeat_unstarted_warning", -1),
        ("boundedbeat_unstarted_warning", "5m"),
        ("boundedbeat_report_writer", "processes"),
        ("boundedbeat_report_writer", True),
    ],
)
def test_bad_values_are_refused_with_their_key(key: str, value: Any) -> None:
    """A wrongly typed or out-of-range setting is refused, naming its key."""
    assert problem_keys(**{key: value}) == {key}


@pytest.mark.parametrize(
    "key",
    [
        "boundedbeat_heartbeat_interval",
        "boundedbeat_lease_ttl",
        "boundedbeat_lease_renew_interval",
        "boundedbeat_poll_interval",
        "boundedbeat_dispatch_claim_timeout",
        "boundedbeat_publish_timeout",
        "boundedbeat_start_timeout",
    ],
)
def test_intervals_that_must_be_positive_refuse_zero(key: str) -> None:
    """Zero would mark every run lost, expire the lease at once or spin a loop: it is refused."""
    assert problem_keys(**{key: 0}) == {key}


def test_zero_is_allowed_where_it_has_a_meaning() -> None:
    """A zero dispatch interval (floored to 1 s), shutdown grace or unstarted warning (off) is accepted."""
    settings = from_conf(
        boundedbeat_dispatch_interval=0, boundedbeat_shutdown_grace=0, boundedbeat_unstarted_warning=0
    )
    assert (settings.dispatch_interval, settings.shutdown_grace, settings.unstarted_warning) == (
        0.0,
        0.0,
        0.0,
    )
    assert Settings().unstarted_warning == 300.0


def test_a_renewal_slower_than_the_lease_is_refused() -> None:
    """A lease renewed less often than it expires would change hands between renewals."""
    assert problem_keys(boundedbeat_lease_ttl=5, boundedbeat_lease_renew_interval=5) == {
        "boundedbeat_lease_renew_interval"
    }
    assert from_conf(boundedbeat_lease_ttl=5, boundedbeat_lease_renew_interval=2).lease_renew_interval == 2


def test_every_bad_setting_is_reported_at_once() -> None:
    """Several bad settings produce one error listing each of them."""
    assert problem_keys(
        boundedbeat_database_url=None,
        boundedbeat_lease_ttl="x",
        boundedbeat_dispatch_batch_size=0,
        boundedbeat_auto_migrate="no",
    ) == {"boundedbeat_lease_ttl", "boundedbeat_dispatch_batch_size", "boundedbeat_auto_migrate"}


def test_an_unknown_setting_is_named_with_the_closest_known_one() -> None:
    """A typo gets its closest setting, written as the user wrote theirs (Celery's or Django's form)."""
    keys = [
        "boundedbeat_databse_url",
        "CELERY_BOUNDEDBEAT_LEASE_TT",
        "boundedbeat_poll_interval",
        "BOUNDEDBEAT_ADMIN_DATABASE",
        "boundedbeat_zzzz",
        "broker_url",
    ]
    assert unknown_settings(keys) == [
        ("CELERY_BOUNDEDBEAT_LEASE_TT", "CELERY_BOUNDEDBEAT_LEASE_TTL"),
        ("boundedbeat_databse_url", "boundedbeat_database_url"),
        ("boundedbeat_zzzz", None),
    ]


def test_an_unknown_setting_is_warned_about_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    """Read twice (beat builds two schedulers), the typo is one warning naming the setting meant."""
    app = celery.Celery("t", set_as_current=False)
    app.conf.update(boundedbeat_retention_dayz=3)
    log = logging.getLogger("celery_boundedbeat.test_settings")
    with caplog.at_level("WARNING", logger=log.name):
        warn_unknown_settings(app.conf, log)
        warn_unknown_settings(app.conf, log)
    assert [r.getMessage() for r in caplog.records] == [
        "celery_boundedbeat: unknown setting boundedbeat_retention_dayz is ignored; "
        "did you mean boundedbeat_retention_days?"
    ]
