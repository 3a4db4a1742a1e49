"""Three periodic tasks, one per scheduling mode (their policies are in proj/settings.py)."""

import logging
import time

from celery import shared_task

logger = logging.getLogger(__name__)


@shared_task
def refresh_cache(seconds: float = 1.0) -> str:
    """fixed_delay: the next run is due 3 s after this one *finishes*, however long it took."""
    time.sleep(seconds)
    return "cache refreshed"


@shared_task
def export_report(seconds: float = 5.0) -> str:
    """fixed_rate_no_overlap + coalesce_latest: slower (5 s) than its period (2 s).

    Stock beat would queue a new copy every 2 s and run several at once; here at most one
    runs, and the ticks missed meanwhile collapse into a single pending run.
    """
    time.sleep(seconds)
    return "report exported"


@shared_task
def poll_partner(seconds: float = 2.5) -> str:
    """fixed_rate with max_concurrency 2: ticks every second, at most two runs at once."""
    time.sleep(seconds)
    return "partner polled"
