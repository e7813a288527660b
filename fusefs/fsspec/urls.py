"""`ckptfs://` URLs and storage options -> the volume an fsspec filesystem opens.

    ckptfs://HOST:PORT/PATH[?token_file=F&tls=1&ca=PEM]   a metadata service (port 7410
                                                          if omitted, as `meta serve`)
    ckptfs:///PATH                                         the embedded default volume
    ckptfs:///PATH with storage option volume=DIR          a volume directory

The netloc is always the service: a path without one takes three slashes, as file:///.
The token comes as for every client (the URL's token_file=, CKPTFS_TOKEN,
CKPTFS_TOKEN_FILE), or from the `token=` / `token_file=` storage options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import parse_qs, urlencode, urlsplit

PROTOCOL = "ckptfs"
DEFAULT_PORT = 7410  # `ckptfs meta serve` listens there by default
URL_OPTIONS = ("token_file", "tls", "ca", "retry")  # query keys a service URL may carry


def strip_url(path: str) -> str:
    """A volume path ("/a/b", root "/") from a URL or a path: scheme, service and query
    removed, slashes collapsed, no trailing slash."""
    if path.startswith(PROTOCOL + "://"):
        rest = path[len(PROTOCOL) + 3 :]
        slash = rest.find("/")
        rest = "" if slash < 0 else rest[slash:]
        rest = rest.split("?", 1)[0]
        path = rest
    elif path.startswith(PROTOCOL + "::"):
        path = path[len(PROTOCOL) + 2 :]
    parts = [p for p in path.split("/") if p and p != "."]
    return "/" + "/".join(parts)


def url_options(url: str) -> dict:
    """The storage options a URL carries: host and port, and its query's token_file, tls,
    ca and retry. A URL without a service (ckptfs:///PATH) carries none."""
    if not url.startswith(PROTOCOL + "://"):
        return {}
    parts = urlsplit(url)
    if not parts.netloc:
        return {}
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"bad ckptfs URL {url!r}: the port must be a number") from None
    out: dict = {"host": parts.hostname, "port": port or DEFAULT_PORT}
    for key, values in parse_qs(parts.query).items():
        if key in URL_OPTIONS and values:
            out[key] = values[0]
    return out


@dataclass(frozen=True)
class Target:
    """What a filesystem opens: a service URL, or a volume directory (None: the default)."""

    host: str | None = None
    port: int | None = None
    volume: str | None = None
    token_file: str | None = None
    tls: bool = False
    ca: str | None = None
    retry: float | None = None

    def __post_init__(self) -> None:
        if self.host is not None and self.volume is not None:
            raise ValueError(
                "give either a service (ckptfs://HOST:PORT/...) or volume=DIR, not both"
            )

    @property
    def prefix(self) -> str:
        """What names this volume in a URL: `ckptfs://HOST:PORT` or `ckptfs://`."""
        if self.host is None:
            return f"{PROTOCOL}://"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{PROTOCOL}://{host}:{self.port or DEFAULT_PORT}"

    def spec(self) -> str | None:
        """The spec Volume.open takes: a service URL with its options, a volume directory,
        or None for the embedded default volume."""
        if self.host is None:
            return os.path.abspath(self.volume) if self.volume else None
        query = {}
        if self.token_file:
            query["token_file"] = os.path.abspath(self.token_file)
        if self.ca:
            query["ca"] = os.path.abspath(self.ca)
        elif self.tls:
            query["tls"] = "1"
        if self.retry is not None:
            query["retry"] = str(self.retry)
        return self.prefix + ("?" + urlencode(query) if query else "")


def truthy(value: object) -> bool:
    """A URL's `tls=1` / `tls=true`, or a storage option's True."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
