"""A schedule's ``options``: unknown keys warned about, invalid values refused, keys pinned to Celery."""

from __future__ import annotations

import inspect

import pytest
from celery import Celery
from celery.app.amqp import AMQP
from celery.app.task import Task

from celery_boundedbeat.config.message_options import KNOWN_OPTIONS, option_refusals, option_warnings


def test_every_known_option_is_one_celery_documents_or_takes() -> None:
    """Each key is in ``apply_async``'s documentation or a keyword of the message builder or sender."""
    documented = Task.apply_async.__doc__ or ""
    taken = set(inspect.signature(AMQP.as_task_v2).parameters)
    taken |= set(inspect.signature(Celery("opts", set_as_current=False).amqp.send_task_message).parameters)
    unknown = {k for k in KNOWN_OPTIONS if f"{k} (" not in documented and k not in taken}
    assert unknown == set()


def test_celery_s_documented_options_are_all_known() -> None:
    """The ones ``apply_async`` documents that a JSON value can carry are all known (none warned)."""
    for key in ("queue", "routing_key", "exchange", "priority", "expires", "countdown", "eta", "headers",
                "serializer", "compression", "time_limit", "soft_time_limit", "shadow", "retry",
                "retry_policy", "ignore_result"):  # fmt: skip
        assert key in KNOWN_OPTIONS


def test_an_unknown_key_is_warned_about_with_the_nearest_known_one() -> None:
    """A typo gets "did you mean"; a key far from any gets the warning alone; known keys nothing."""
    assert option_warnings({"queu": "reports", "queue": "x", "tenant": "a"}) == [
        "options: 'queu' is not a Celery apply_async option (did you mean 'queue'?); Celery ignores it "
        "unless your own router reads it",
        "options: 'tenant' is not a Celery apply_async option; Celery ignores it unless your own router "
        "reads it",
    ]
    assert option_warnings({"queue": "x", "priority": 5, "expires": 60}) == []
    assert option_warnings(None) == []


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"queue": ""}, "'queue' must be a non-empty name, got ''"),
        ({"queue": 3}, "'queue' must be a non-empty name, got 3"),
        ({"priority": "high"}, "'priority' must be an integer from 0 to 255"),
        ({"priority": 256}, "'priority' must be an integer from 0 to 255"),
        ({"countdown": -1}, "'countdown' must be a number of seconds >= 0"),
        ({"expires": "tomorrow"}, "'expires' must be seconds > 0 or an ISO 8601 time"),
        ({"headers": [1]}, "'headers' must be an object"),
    ],
)
def test_a_clearly_invalid_value_is_refused(options: dict[str, object], reason: str) -> None:
    """Values Celery cannot build or send a message with are refused, naming key and value."""
    refusals = option_refusals(options)
    assert len(refusals) == 1 and refusals[0].removeprefix("options: ").startswith(reason), refusals


def test_valid_values_are_not_refused() -> None:
    """Names, a priority, seconds and an ISO expiry pass."""
    given = {
        "queue": "q",
        "priority": 0,
        "countdown": 0,
        "expires": "2026-12-06T10:00:00+00:00",
        "headers": {},
    }
    assert option_refusals(given) == []
