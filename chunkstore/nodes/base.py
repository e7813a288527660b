"""The object-node interface: one small contract, one backend per file.

Nodes store opaque, already-encoded chunk objects under their chunk id. They
never see file names or user-chosen keys, so a backend only has to map a
16-byte id to a location; no client-supplied string ever becomes a path or an
object key. All methods are blocking and thread-safe: callers run them in
worker threads, never on the trio loop.

A put never replaces a whole object: objects are content-addressed, so one already
under the id whose header checksum (and, once the store has told the node its seed,
content id) is right holds the same bytes, and the put keeps it. Only a damaged or
planted object is replaced (scrub's and fsck's repairs rewrite those). So the write
path needs no delete right, and an honest writer never clobbers anyone's object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from chunkstore import codec
from chunkstore.ids import chunk_id


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
    content_seed: int | None = None  # the volume's chunk-id seed (ChunkStore sets it)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def domain(self) -> str:
        return self.info.domain

    @abstractmethod
    def put(self, cid: bytes, blob: bytes | memoryview) -> None:
        """Store the object durably (the call returns only once it is), unless a whole
        object is there already (module docstring: never overwrite)."""

    def keeps(self, cid: bytes, old: bytes) -> bool:
        """Is `old`, found under `cid`, a whole object of that id (so a put keeps it)?"""
        try:
            raw = codec.decode(old, id_checked=True)
        except codec.ChunkFormatError:
            return False
        return self.content_seed is None or chunk_id(raw, self.content_seed) == cid

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
