"""One way to show a database or broker URL without its secrets.

Every URL this package prints (beat banner, logs, CLI output, error messages) goes through
:func:`mask_url`; error texts that may quote a URL go through :func:`scrub`. Pure and
stdlib-only, so it cannot fail on a URL another library refuses to parse: such a URL is
still masked, by pattern, rather than shown raw in the error that refuses it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from urllib.parse import parse_qsl, urlsplit

#: What a password is replaced with (SQLAlchemy's ``hide_password`` marker).
MASK = "***"

#: Query parameters that carry a secret (libpq, redis-py, kombu transport options, ...).
SECRET_PARAMS = frozenset(
    {
        "password",
        "passwd",
        "pass",
        "pwd",
        "secret",
        "token",
        "access_token",
        "api_key",
        "apikey",
        "sasl_password",
        "ssl_password",
        "sslpassword",
        "aws_secret_access_key",
        "secret_key",
    }
)

# user:password@ in the authority part, found without parsing the URL.
_USERINFO = re.compile(r"(?P<head>^[A-Za-z][A-Za-z0-9+.\-]*://[^/@:;?#\s]*:)(?P<pw>[^@;\s]*)(?=@)")
_PARAM = re.compile(r"(?P<key>[?&;](?P<name>[^=&;#\s]+)=)(?P<value>[^&;#\s]*)")


def _mask_params(query: str) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group("name").lower() in SECRET_PARAMS:
            return match.group("key") + MASK
        return match.group(0)

    return _PARAM.sub(replace, "?" + query)[1:] if query else query


def _mask_one(url: str) -> str:
    """Mask one URL's password and secret query parameters; never raises."""
    url = url.strip()
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            if ":" in userinfo:
                userinfo = userinfo.split(":", 1)[0] + ":" + MASK
            netloc = f"{userinfo}@{hostport}"
        masked = f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else f"{netloc}{parts.path}"
        if parts.query:
            masked += "?" + _mask_params(parts.query)
        if parts.fragment:
            masked += "#" + parts.fragment
        return masked
    except ValueError:
        # urlsplit refuses some malformed authorities: mask by pattern instead.
        return _PARAM.sub(
            lambda m: m.group("key") + MASK if m.group("name").lower() in SECRET_PARAMS else m.group(0),
            _USERINFO.sub(lambda m: m.group("head") + MASK, url),
        )


def mask_url(value: str | Sequence[str] | None) -> str:
    """``value`` with every password masked: one URL, a ``;``-separated failover list, or a list.

    Celery accepts a list or a ``;``-separated string for ``broker_url``; each URL in it is
    masked (kombu's ``maybe_sanitize_url`` masks only the first one).
    """
    if value is None:
        return ""
    urls: Iterable[str] = value.split(";") if isinstance(value, str) else value
    return ";".join(_mask_one(str(url)) for url in urls if str(url).strip())


def secrets_of(value: str | Sequence[str] | None) -> list[str]:
    """The secret strings in ``value`` (passwords and secret query values), longest first."""
    if value is None:
        return []
    urls = value.split(";") if isinstance(value, str) else [str(u) for u in value]
    found: set[str] = set()
    for url in urls:
        match = _USERINFO.search(url.strip())
        if match and match.group("pw"):
            found.add(match.group("pw"))
        query = url.partition("?")[2].partition("#")[0]
        for name, secret in parse_qsl(query, keep_blank_values=False):
            if name.lower() in SECRET_PARAMS and secret:
                found.add(secret)
    return sorted(found, key=len, reverse=True)


def scrub(text: str, *urls: str | Sequence[str] | None) -> str:
    """``text`` (an error message) with every URL in ``urls`` masked and their secrets removed.

    Drivers and older SQLAlchemy releases quote the whole URL, or a DSN built from it, in
    their errors; the raw URL is replaced by its masked form, then any secret left over.
    """
    for url in urls:
        if url is None:
            continue
        whole = url if isinstance(url, str) else ";".join(str(u) for u in url)
        if whole:
            text = text.replace(whole, mask_url(url))
        for secret in secrets_of(url):
            text = text.replace(secret, MASK)
    return text


def driver_reason(exc: BaseException, *urls: str | Sequence[str] | None) -> str:
    """``Type: first line`` of a database error, scrubbed of ``urls``: why, without a page of text.

    SQLAlchemy wraps the driver's exception (``exc.orig``), whose first line is the reason a
    person needs ("connection refused"); the rest is SQL and a link to SQLAlchemy's docs.
    """
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    reason = scrub(lines[0].strip(), *urls) if lines else ""
    return f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__
