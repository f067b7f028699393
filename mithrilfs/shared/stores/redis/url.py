"""Redis URLs: checked, and shown or passed on without their password.

Apart from the store (``redis_wire``) because the CLI needs them too, and a URL's
password must never reach a log, an error or a process title (``redact``).
"""

from __future__ import annotations

from urllib.parse import urlparse, urlunparse


def check_url(url: str) -> None:
    """ValueError with a one-line reason unless *url* is a redis:// or rediss:// URL."""
    parsed = urlparse(url)
    shown = redact(url)
    try:
        port = parsed.port
    except ValueError:
        raise ValueError(f"invalid remote {shown!r}: the port must be a number") from None
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
        raise ValueError(f"invalid remote {shown!r} (use redis://host:port/db or rediss://...)")
    if port == 0:
        raise ValueError(f"invalid remote {shown!r}: port 0")
    if parsed.path not in ("", "/") and not parsed.path.lstrip("/").isdigit():
        raise ValueError(f"invalid remote {shown!r}: the database must be a number")


def _with_password(url: str, replacement: str | None) -> str:
    """*url* with its password replaced (None: dropped, with its colon); unchanged when it has none."""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    user = parsed.username or ""
    host = parsed.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parsed.port}" if parsed.port else ""
    userinfo = f"{user}:{replacement}@" if replacement is not None else (f"{user}@" if user else "")
    return urlunparse(parsed._replace(netloc=f"{userinfo}{host}{port}"))


def redact(url: str) -> str:
    """*url* with its password replaced by ``***`` (for logs, errors and process titles)."""
    try:
        return _with_password(url, "***")
    except ValueError:
        return "redis://***"


def url_password(url: str) -> str | None:
    return urlparse(url).password


def without_password(url: str) -> str:
    """*url* with no password at all (it is passed separately)."""
    return _with_password(url, None)
