"""Every URL we show goes through one masking function; no password survives it."""

from __future__ import annotations

import pytest

from celery_boundedbeat.core.exceptions import ConfigurationError
from celery_boundedbeat.core.redact import mask_url, scrub, secrets_of
from celery_boundedbeat.db.engine import get_engine


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://bb:pw1@db:5432/app", "postgresql+psycopg://bb:***@db:5432/app"),
        ("redis://:pw1@cache:6379/0", "redis://:***@cache:6379/0"),
        ("amqp://guest@rabbit//", "amqp://guest@rabbit//"),
        ("sqlite:///celerybeat.sqlite3", "sqlite:///celerybeat.sqlite3"),
        (
            "postgresql://db/app?user=bb&password=pw1&sslmode=require",
            "postgresql://db/app?user=bb&password=***&sslmode=require",
        ),
        ("sqs://AKIA:pw1@", "sqs://AKIA:***@"),
        ("postgresql://bb:pw1@db:notaport/app", "postgresql://bb:***@db:notaport/app"),
        ("postgresql://bb:pw1@[::1/app", "postgresql://bb:***@[::1/app"),
    ],
)
def test_one_url_loses_its_password_and_secret_parameters(url: str, shown: str) -> None:
    """A password in the authority or a secret query parameter is masked; the rest is kept."""
    assert mask_url(url) == shown
    assert "pw1" not in mask_url(url)


def test_every_url_of_a_failover_string_or_list_is_masked() -> None:
    """``;``-separated and list broker URLs mask the password of every URL, not just the first."""
    urls = ["amqp://u:first@h1//", "amqp://u:second@h2//"]
    for value in (";".join(urls), urls, tuple(urls)):
        shown = mask_url(value)
        assert "first" not in shown and "second" not in shown, shown
        assert shown == "amqp://u:***@h1//;amqp://u:***@h2//"


def test_scrub_removes_the_url_and_its_secrets_from_an_error_text() -> None:
    """An error quoting the URL, or a DSN with the password, keeps no secret."""
    url = "postgresql://bb:Zecret9@db/app?password=Other7"
    text = f"could not parse {url}; dsn 'password=Zecret9 host=db' token Other7"
    out = scrub(text, url)
    assert "Zecret9" not in out and "Other7" not in out
    assert "postgresql://bb:***@db/app?password=***" in out
    assert secrets_of(url) == ["Zecret9", "Other7"]


def test_an_unparsable_database_url_is_a_configuration_error_without_the_password() -> None:
    """get_engine refuses a URL SQLAlchemy cannot parse with a masked, named error."""
    url = "postgresql+psycopg://bb:Zecret9@db:notaport/app"
    with pytest.raises(ConfigurationError) as info:
        get_engine(url)
    assert "Zecret9" not in str(info.value)
    assert "boundedbeat_database_url" in str(info.value)
    assert "bb:***@db:notaport" in str(info.value)
