"""The object-node interface: one small contract, one backend per file.

Nodes store opaque, already-encoded chunk objects under their chunk id. They
never see file names or user-chosen keys, so a backend only has to map a
16-byte id to a location; no client-supplied string ever becomes a path or an
object key. All methods are blocking and thread-safe: callers run them in
worker threads, never on the trio loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass


class NodeError(Exception):
    """A node could not serve a request (unreachable, I/O error, timeout)."""


class ObjectMissing(NodeError):
    """The node answered, and it does not hold the object."""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    url: str
    domain: str


class ObjectNode(ABC):
    info: NodeInfo

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def domain(self) -> str:
        return self.info.domain

    @abstractmethod
    def put(self, cid: bytes, blob: bytes | memoryview) -> None:
        """Store the object durably (the call returns only once it is)."""

    def put_nosync(self, cid: bytes, blob: bytes | memoryview) -> None:
        """Store the object; durable only after the next `sync()` (default: at once)."""
        self.put(cid, blob)

    def sync(self) -> None:  # noqa: B027 - nodes whose put is durable have nothing to do
        """Make every object stored by `put_nosync` durable."""

    @abstractmethod
    def get(self, cid: bytes) -> bytes:
        """Return the stored object; ObjectMissing if absent."""

    @abstractmethod
    def exists(self, cid: bytes) -> bool: ...

    @abstractmethod
    def delete(self, cid: bytes) -> None:
        """Remove the object; absent objects are not an error."""

    @abstractmethod
    def list(self) -> Iterator[tuple[bytes, int, float]]:
        """Yield (chunk id, stored size, modification time) of every object."""

    @abstractmethod
    def used_bytes(self) -> int: ...

    def capacity(self) -> tuple[int, int]:
        """(total, free) bytes of the backing store; (0, 0) when unknown."""
        return (0, 0)

    def sweep_tmp(self, cutoff: float) -> tuple[int, int]:
        """Remove partial writes a crash left, older than `cutoff` (a time.time()); return
        (files, bytes). Nodes whose puts are atomic (S3) leave none."""
        return (0, 0)

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def parse_node_url(url: str, *, name: str, domain: str | None = None) -> NodeInfo:
    """Validate a node URL (`dir:/path` or `s3://bucket/prefix?...`) and its labels.

    A `domain=` query parameter on the URL sets the failure domain; by default
    every node is its own domain.
    """
    from urllib.parse import parse_qs, urlsplit

    if url.startswith("dir:"):
        path, _, query = url[4:].partition("?")
        if not path:
            raise ValueError(f"node {url!r}: dir: needs a path")
    elif url.startswith("s3://"):
        parts = urlsplit(url)
        if not parts.netloc:
            raise ValueError(f"node {url!r}: s3:// needs a bucket")
        query = parts.query
    else:
        raise ValueError(f"node {url!r}: expected dir:/path or s3://bucket/prefix")
    params = parse_qs(query)
    dom = domain or (params.get("domain") or [None])[0] or name
    return NodeInfo(name=name, url=url, domain=dom)


def open_node(info: NodeInfo, base_dir: str | None = None) -> ObjectNode:
    """Instantiate the backend for a node; relative dir: paths resolve against base_dir."""
    if info.url.startswith("dir:"):
        from chunkstore.dirnode import DirNode

        return DirNode(info, base_dir=base_dir)
    if info.url.startswith("s3://"):
        from chunkstore.s3node import S3Node

        return S3Node(info)
    raise ValueError(f"unknown node kind: {info.url!r}")
