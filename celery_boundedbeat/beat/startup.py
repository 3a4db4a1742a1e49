"""Beat's start and stop: the database checks, the banner lines, the last drain.

Start checks end the process with one line and a sysexits status instead of a traceback: a
bad URL or a missing migration is EX_CONFIG, a database that cannot be reached at start is
EX_UNAVAILABLE.
"""

from __future__ import annotations

import gc
import logging
import threading

from sqlalchemy import Engine, func, select

from ..config.settings import Settings
from ..core.exceptions import BoundedBeatError
from ..core.redact import driver_reason, mask_url, scrub
from ..db.engine import get_engine
from ..db.faults import is_outage
from ..db.migrate import require_current, upgrade
from ..db.row_state import CONFIG
from ..db.tables import ScheduleRow
from ..dispatch.dispatcher import Dispatcher

logger = logging.getLogger("celery_boundedbeat.beat")

#: Exit status when the configuration is invalid (EX_CONFIG).
EX_CONFIG = 78
#: Exit status when the database cannot be reached at start (EX_UNAVAILABLE).
EX_UNAVAILABLE = 69


def freeze_startup_heap() -> None:
    """Keep what start-up built (Celery, the drivers, the app, the engine) out of full collections.

    A full collection walks every object the collector tracks, holding the GIL all along. Under
    a thousand schedule changes a second the beat ran one every several seconds, 90-120 ms each
    on a busy two-core machine, and every run due meanwhile waited as long. What start-up built
    lives as long as the process: walking it again never frees anything. Collected first, so
    no garbage is frozen with it.
    """
    gc.collect()
    gc.freeze()


def prepare_database(url: str, auto_migrate: bool, app: str | None = None) -> Engine:
    """The engine, with the schema migrated or checked; one clean line and an exit otherwise.

    A bad URL or a missing migration is a configuration error (EX_CONFIG); a database that
    cannot be reached at start is EX_UNAVAILABLE, said once with the (masked) reason
    instead of a page of traceback per retry.
    """
    try:
        engine = get_engine(url)
        if auto_migrate:
            upgrade(engine)
        else:
            require_current(engine, mask_url(url), app)
    except BoundedBeatError as exc:
        logger.critical("%s", scrub(str(exc), url))
        raise SystemExit(EX_CONFIG) from None
    except Exception as exc:
        if not is_outage(exc):
            raise
        logger.critical(
            "celery_boundedbeat: cannot reach the database %s: %s", mask_url(url), driver_reason(exc, url)
        )
        raise SystemExit(EX_UNAVAILABLE) from None
    return engine


def runtime_schedule_count(url: str) -> int | None:
    """How many runtime schedules the database holds; ``None`` when it cannot say yet.

    Read for the banner, before beat migrates or checks the database: a database not
    migrated yet (or not reachable) leaves the count unknown, and the start checks that follow
    say why.
    """
    try:
        with get_engine(url).connect() as conn:
            # Every schedule less the config ones: two index-only counts (the primary key and
            # the config rows' partial index), where counting the runtime rows themselves reads
            # the whole table (over a second for a million schedules, at every start).
            every = conn.scalar(select(func.count()).select_from(ScheduleRow))
            config = conn.scalar(select(func.count()).where(ScheduleRow.origin == CONFIG))
    except Exception:
        return None
    return int(every or 0) - int(config or 0)


def schedule_counts(config_count: int, runtime_count: int | None) -> str:
    """``3 from beat_schedule, 12 at runtime`` (the runtime count unknown before the database is)."""
    runtime = "runtime ones not counted yet" if runtime_count is None else f"{runtime_count} at runtime"
    return f"{config_count} from beat_schedule, {runtime}"


def banner_info(settings: Settings, config_count: int, runtime_count: int | None) -> str:
    """The lines beat's banner shows for this scheduler, as Celery's own: ``    . key -> value``."""
    lines = [
        f"database -> {mask_url(settings.database_url)}",
        "dispatcher -> " + ("in beat" if settings.dispatch_enabled else "external (boundedbeat dispatch)"),
        f"schedules -> {schedule_counts(config_count, runtime_count)}",
    ]
    return "\n".join(f"    . {line}" for line in lines)


def log_schedules(config_count: int, url: str) -> None:
    """Once the database is ready: how many schedules this beat starts with, and where."""
    counts = schedule_counts(config_count, runtime_schedule_count(url))
    logger.info("celery_boundedbeat: schedules: %s; database %s", counts, mask_url(url))


#: Seconds a last drain cut by its grace has to record what it published (one transaction).
CUT_WAIT = 5.0


def last_drain(dispatcher: Dispatcher, grace: float) -> None:
    """Publish what this beat committed before it was told to stop, for ``grace`` seconds.

    A tick committed just before SIGTERM would otherwise wait in the queue for the next
    beat or dispatcher; the rows a prepared tick's interrupted publish gave back (the ones
    the broker had not taken) are published here. The drain runs in a daemon thread so a
    broker that hangs cannot hold the shutdown; whatever it leaves stays queued, not lost.
    A beat that no longer holds the lease publishes nothing (the dispatcher's ``may_run``).

    At the end of the grace the batch being published stops at its next message, and the drain
    gets ``CUT_WAIT`` more seconds to record what the broker took and give the rest back: the
    process exits right after, and a batch left claimed would be published again by another
    dispatcher once its claim expired.
    """
    stop, cut = threading.Event(), threading.Event()
    drain = threading.Thread(
        target=lambda: dispatcher.drain(stop, cut), name="boundedbeat-last-drain", daemon=True
    )
    drain.start()
    drain.join(grace)
    stop.set()
    cut.set()
    drain.join(CUT_WAIT)
    if drain.is_alive():
        logger.warning(
            "celery_boundedbeat: the last drain did not end within %g s; the rest stays queued", grace
        )
