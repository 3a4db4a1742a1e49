"""Which database failures are outages (retry, in order) and which are data errors (do not).

A loop that retries a data error forever (a text the driver cannot encode, a value the
server refuses) holds every later write behind it; a loop that gives up on an outage loses
writes that would have landed a second later. Every writer asks here.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

#: The DB-API (PEP 249) error classes that mean the connection or the server, not the data.
_DRIVER_OUTAGES = frozenset({"OperationalError", "InterfaceError"})


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the database could not be reached or was busy (worth a retry)."""
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeoutError | ConnectionError):
        return True
    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated)
    return _driver_outage(exc)


def _driver_outage(exc: BaseException) -> bool:
    """The driver's own error, not wrapped by SQLAlchemy: statements sent to psycopg directly
    (:mod:`.driver`) raise ``psycopg.OperationalError`` and its subclasses."""
    if type(exc).__module__.split(".")[0] != "psycopg":
        return False
    return any(cls.__name__ in _DRIVER_OUTAGES for cls in type(exc).__mro__)
