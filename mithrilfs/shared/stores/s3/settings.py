"""Where a bucket is and how to sign for it, found the way AWS tools find it.

``s3://BUCKET/PREFIX`` names the bucket.  The rest comes from the
conventions every AWS SDK and the aws CLI follow, so a platform team's
existing setup (a Kubernetes Secret in the environment, a profile file)
works unchanged:

- endpoint: ``--remote-endpoint``, else ``AWS_ENDPOINT_URL_S3``, else
  ``AWS_ENDPOINT_URL``, else the profile's ``endpoint_url``; none: AWS S3;
- credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_SESSION_TOKEN``, else the profile (``AWS_PROFILE``, default
  ``default``) in ``AWS_SHARED_CREDENTIALS_FILE`` (``~/.aws/credentials``)
  or ``AWS_CONFIG_FILE`` (``~/.aws/config``); a pod's web identity or a
  container's credentials endpoint is left to the client; nothing at all:
  anonymous requests (a public bucket);
- region: ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile's ``region``,
  else ``us-east-1``.

Resolved once, in the CLI process (a bad setting is a one-line error before
anything mounts); the daemon gets them with its options, never on a command
line.
"""

from __future__ import annotations

import configparser
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class S3Location:
    """``s3://BUCKET/PREFIX``: the bucket, and the key prefix every object goes under ("" for none)."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """ValueError with a one-line reason unless *url* is ``s3://BUCKET[/PREFIX]``."""
        parsed = urlparse(url)
        if parsed.scheme != "s3":
            raise ValueError(f"invalid remote {url!r} (use s3://BUCKET/PREFIX)")
        if parsed.username or parsed.password or parsed.port or parsed.query or parsed.fragment:
            raise ValueError(f"invalid remote {url!r}: credentials and options do not go in the URL"
                             " (use the AWS_* environment variables or a profile)")
        bucket = parsed.netloc  # as written: hostname would lower-case it
        if not bucket:
            raise ValueError(f"invalid remote {url!r}: no bucket (use s3://BUCKET/PREFIX)")
        if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise ValueError(f"invalid remote {url!r}: {bucket!r} is not a bucket name"
                             " (3-63 lower-case letters, digits, dots and hyphens)")
        prefix = parsed.path.strip("/")
        if not prefix.isprintable():  # the client refuses them deep inside; a terminal would obey them
            raise ValueError(f"invalid remote {url!r}: the prefix has a control character")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise ValueError(f"invalid remote {url!r}: the prefix has an empty, '.' or '..' part")
        return cls(bucket, prefix)

    def shown(self, endpoint: str | None) -> str:
        url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{url} at {endpoint}" if endpoint else url


@dataclass(frozen=True)
class S3Settings:
    endpoint: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = None
    #: Secret: kept out of logs, stats and command lines (``__repr__`` hides it).
    secret_access_key: str | None = None
    session_token: str | None = None
    #: Credentials the client finds itself (a pod's web identity, a container credentials endpoint).
    ambient_credentials: bool = False

    def __repr__(self) -> str:
        return f"S3Settings(endpoint={self.endpoint!r}, region={self.region!r}, access_key_id={self.access_key_id!r})"

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> S3Settings:
        return cls(**d)


def _profile_file(env: Mapping[str, str], var: str, default: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    path = Path(env.get(var) or Path(env.get("HOME", "~")) / ".aws" / default).expanduser()
    try:
        parser.read(path)
    except configparser.Error as e:
        raise ValueError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    return parser


def _check_endpoint(endpoint: str) -> str:
    parsed = urlparse(endpoint)
    try:
        parsed.port  # noqa: B018 (a bad port raises)
    except ValueError:
        raise ValueError(f"invalid endpoint {endpoint!r}: the port must be a number") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"invalid endpoint {endpoint!r} (use http://host:port or https://host)")
    if parsed.username or parsed.password:
        raise ValueError("invalid endpoint: credentials do not go in its URL (use the AWS_* variables or a profile)")
    return endpoint.rstrip("/")


def _clean(name: str, value: str | None) -> str | None:
    """A setting as a header can carry it: surrounding whitespace dropped (a Secret file's newline), no
    control characters inside (the client would fail on them at its first request)."""
    if value is None:
        return None
    value = value.strip()
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{name} holds a control character")
    return value or None


def settings_from(env: Mapping[str, str], endpoint: str | None = None) -> S3Settings:
    """The endpoint, region and credentials by the AWS conventions (see the module doc); ValueError in one line."""
    profile_name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    credentials = _profile_file(env, "AWS_SHARED_CREDENTIALS_FILE", "credentials")
    config = _profile_file(env, "AWS_CONFIG_FILE", "config")
    config_section = profile_name if profile_name == "default" else f"profile {profile_name}"

    def from_profile(key: str) -> str | None:
        for parser, section in ((credentials, profile_name), (config, config_section)):
            if parser.has_option(section, key):
                return parser.get(section, key).strip() or None
        return None

    if profile_name != "default" and env.get("AWS_PROFILE") and not (
            credentials.has_section(profile_name) or config.has_section(config_section)):
        raise ValueError(f"AWS_PROFILE names profile {profile_name!r}, which no AWS credentials or config file has")
    endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or from_profile("endpoint_url")
    region = _clean("AWS_REGION", env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or from_profile("region")
                    ) or "us-east-1"
    key_id = _clean("AWS_ACCESS_KEY_ID", env.get("AWS_ACCESS_KEY_ID"))
    secret = _clean("AWS_SECRET_ACCESS_KEY", env.get("AWS_SECRET_ACCESS_KEY"))
    token = _clean("AWS_SESSION_TOKEN", env.get("AWS_SESSION_TOKEN"))
    if bool(key_id) != bool(secret):
        raise ValueError("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together")
    if not key_id:
        key_id = _clean("aws_access_key_id", from_profile("aws_access_key_id"))
        secret = _clean("aws_secret_access_key", from_profile("aws_secret_access_key"))
        token = _clean("aws_session_token", from_profile("aws_session_token"))
        if bool(key_id) != bool(secret):
            raise ValueError(f"profile {profile_name!r} has only one of aws_access_key_id and aws_secret_access_key")
    ambient = not key_id and any(env.get(v) for v in (
        "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"))
    return S3Settings(endpoint=_check_endpoint(endpoint) if endpoint else None, region=region,
                      access_key_id=key_id or None, secret_access_key=secret or None, session_token=token or None,
                      ambient_credentials=ambient)


def from_environment(endpoint: str | None = None) -> S3Settings:
    return settings_from(os.environ, endpoint)
