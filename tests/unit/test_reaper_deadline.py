"""When the reaper may call a started run timed out: after the pool has had its turn."""

from __future__ import annotations

from celery.app.task import Context

from celery_boundedbeat.core.messages import MAX_RUN_TIME_HEADER
from celery_boundedbeat.worker import receivers


def test_a_run_with_a_hard_limit_is_left_to_the_pool_for_a_grace_after_it() -> None:
    """Prefork kills the child at the hard limit and reports it: the reaper waits past that.

    Before this grace the reaper's deadline was the hard limit itself, and its pass could settle
    the run a few milliseconds before the pool's ``TimeLimitExceeded`` arrived.
    """
    request = Context(timelimit=(3.0, 2.0))
    assert receivers._time_limit(request) == 3.0 + receivers.POOL_REPORT_GRACE
    assert receivers.POOL_REPORT_GRACE >= 1.0


def test_without_time_limits_the_deadline_is_max_run_time() -> None:
    """A message without Celery limits (they were turned off) falls back to the header's value."""
    request = Context(timelimit=(None, None), **{MAX_RUN_TIME_HEADER: 5})
    assert receivers._time_limit(request) == 5.0
    assert receivers._time_limit(Context()) is None
