"""Which database failures are outages (retry, in order) and which are data errors (do not).

A loop that retries a data error forever (a text the driver cannot encode, a value the
server refuses) holds every later write behind it; a loop that gives up on an outage loses
writes that would have landed a second later. Every writer asks here.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the database could not be reached or was busy (worth a retry)."""
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeoutError | ConnectionError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)
