"""Where a client goes and with what token: `ckptfs://` URLs and token files.

URL: `ckptfs://HOST:PORT[,HOST:PORT...][?token_file=PATH&retry=SECONDS&tls=1&ca=PATH]`
(an IPv6 address in brackets: `[::1]:7410`). The token comes from, in order: the URL's
`token_file=`, `CKPTFS_TOKEN`, `CKPTFS_TOKEN_FILE`; a token file group or others may read
is refused, as ssh refuses such keys.
"""

from __future__ import annotations

import errno
import math
import os
from typing import Any
from urllib.parse import parse_qs, urlsplit

from metadata.engine import MetaError

MAX_RETRY = 600.0  # the most `retry=` may ask: services keep request ids far longer
UNREACHABLE = "cannot reach the metadata service at "


def resolve_token(params: dict[str, list[str]]) -> str:
    files = params.get("token_file")
    if files:
        return _read_token(files[0])
    if os.environ.get("CKPTFS_TOKEN"):
        return os.environ["CKPTFS_TOKEN"].strip()
    if os.environ.get("CKPTFS_TOKEN_FILE"):
        return _read_token(os.environ["CKPTFS_TOKEN_FILE"])
    raise MetaError(
        errno.EACCES,
        "no token for the metadata service: set CKPTFS_TOKEN or CKPTFS_TOKEN_FILE, "
        "or add ?token_file=PATH to the ckptfs:// URL",
    )


def _read_token(path: str) -> str:
    try:
        return read_token_file(path)
    except OSError as e:
        raise MetaError(errno.EACCES, f"cannot read token file {path}: {e.strerror}") from None


def token_file_too_open(path: str, mode: int) -> str | None:
    """The one-line refusal for a token file group or others may access, else None.

    As ssh with a private key: a token readable by other users on a shared host lets any
    of them act as the volume's owner, maintenance calls included, and a writable one
    lets them swap it. Refusing (rather than warning) is what makes the mistake visible
    the first time, before a copied 0644 file spreads through job scripts."""
    if mode & 0o077:
        return (
            f"token file {path} is accessible by group or others (mode {mode & 0o777:04o}): "
            f"run chmod 600 {path}"
        )
    return None


def read_token_file(path: str) -> str:
    """A token file's token, refused (MetaError EACCES) if group or others may access it.

    The mode is read from the open descriptor (fstat), so a file swapped between the
    check and the read is not the one checked. OSError passes through to the caller."""
    with open(path) as f:
        refusal = token_file_too_open(path, os.fstat(f.fileno()).st_mode)
        if refusal:
            raise MetaError(errno.EACCES, refusal)
        return f.read().strip()


_USAGE = "expected ckptfs://HOST:PORT[,HOST:PORT...][?OPTIONS]"


def parse_url(spec: str) -> tuple[list[tuple[str, int]], dict[str, list[str]]]:
    """The replicas (host, port) of a service URL, in order, and its query options."""
    if not isinstance(spec, str):
        raise MetaError(errno.EINVAL, f"bad service URL {spec!r}: {_USAGE}")
    try:
        parts = urlsplit(spec)
        params = parse_qs(parts.query)
    except ValueError as e:
        raise MetaError(errno.EINVAL, f"bad service URL {spec!r}: {e} ({_USAGE})") from None
    if parts.scheme != "ckptfs":
        raise MetaError(errno.EINVAL, f"bad service URL {spec!r}: {_USAGE}")
    if "@" in parts.netloc or parts.path not in ("", "/") or parts.fragment:
        raise MetaError(errno.EINVAL, f"bad service URL {spec!r}: {_USAGE} (no user, path or #)")
    replicas = [_host_port(spec, item) for item in parts.netloc.split(",")]
    if len(set(replicas)) != len(replicas):
        raise MetaError(errno.EINVAL, f"bad service URL {spec!r}: a replica is listed twice")
    return replicas, params


def _host_port(spec: str, item: str) -> tuple[str, int]:
    """One `HOST:PORT` (or `[IPV6]:PORT`) of a URL's replica list."""
    if item.startswith("["):
        host, sep, port = item[1:].partition("]:")
    else:
        host, sep, port = item.rpartition(":")
        if ":" in host:
            sep = ""  # an IPv6 address without brackets: its port cannot be told apart
    if not sep or not host or not port.isascii() or not port.isdigit():
        what = f"replica {item!r}" if item else "an empty replica"
        raise MetaError(errno.EINVAL, f"bad service URL {spec!r}: {what}: {_USAGE}")
    if not 0 < int(port) < 65536:
        raise MetaError(errno.EINVAL, f"bad service URL {spec!r}: port {port} out of range")
    return host, int(port)


def check_retry(value: Any) -> float:
    """A retry window in seconds: a number in [0, MAX_RETRY] (0: one round, no waiting)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if isinstance(value, bool) or not 0 <= v <= MAX_RETRY:
        raise MetaError(
            errno.EINVAL,
            f"retry must be a number of seconds in [0, {MAX_RETRY:.0f}], not {value!r}",
        )
    return v
