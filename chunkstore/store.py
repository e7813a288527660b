"""ChunkStore: replicated, verified chunk objects over a set of object nodes.

Writes go to the R placement nodes in parallel (an I/O thread pool; node calls
block on disk or network). Reads walk the replicas in placement order, verify
the stored checksum *and* the content id after decoding, and fall back to the
next replica on any failure, so a corrupt or missing replica is never returned
to a caller; it is reported (logged and kept in `bad_replicas`) for repair.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from chunkstore import codec
from chunkstore.ids import chunk_id
from chunkstore.node import NodeError, ObjectMissing, ObjectNode
from chunkstore.placement import place, rank_nodes

log = logging.getLogger("ckptfs.store")


class ChunkStoreError(Exception):
    """A chunk could not be stored or read; the message names the chunk."""


class ChunkUnavailable(ChunkStoreError):
    """No replica of a chunk could be read and verified."""


@dataclass(frozen=True)
class BadReplica:
    cid: bytes
    node: str
    reason: str
    missing: bool


class ChunkStore:
    def __init__(
        self,
        nodes: Sequence[ObjectNode],
        replicas: int,
        seed: int,
        *,
        io_threads: int = 16,
    ) -> None:
        if not nodes:
            raise ValueError("a chunk store needs at least one node")
        if not 1 <= replicas <= len(nodes):
            raise ValueError(f"replicas must be 1..{len(nodes)} (the node count), got {replicas}")
        self.nodes = list(nodes)
        self.replicas = replicas
        self.seed = seed
        self._names = [n.name for n in self.nodes]
        self._domains = [n.domain for n in self.nodes]
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="ckptfs-io")
        self._lock = threading.Lock()
        self.bad_replicas: list[BadReplica] = []
        self.on_bad_replica: Callable[[BadReplica], None] | None = None

    def placement(self, cid: bytes) -> list[ObjectNode]:
        return [self.nodes[i] for i in place(cid, self._names, self._domains, self.replicas)]

    def read_order(self, cid: bytes) -> list[ObjectNode]:
        """Placement nodes first, then every other node (chunks placed before a node change)."""
        primary = self.placement(cid)
        rest = [self.nodes[i] for i in rank_nodes(cid, self._names)]
        return primary + [n for n in rest if n not in primary]

    def put_encoded(self, cid: bytes, blob: bytes) -> list[str]:
        """Write an encoded chunk object to its R nodes in parallel.

        Returns the names of the nodes that hold it. Raises ChunkStoreError
        unless every placement node acknowledged it.
        """
        targets = self.placement(cid)
        if len(targets) == 1:
            try:
                targets[0].put(cid, blob)
            except NodeError as e:
                raise ChunkStoreError(f"chunk {cid.hex()}: replica write failed: {e}") from e
            return [targets[0].name]
        futs = {self._pool.submit(n.put, cid, blob): n for n in targets}
        wait(futs)
        ok, errors = [], []
        for f, n in futs.items():
            exc = f.exception()
            if exc is None:
                ok.append(n.name)
            else:
                errors.append(f"{n.name}: {exc}")
        if errors:
            raise ChunkStoreError(f"chunk {cid.hex()}: {len(errors)} of {len(targets)} replica "
                                  f"writes failed: {'; '.join(errors)}")
        return ok

    def get(self, cid: bytes) -> bytes:
        """Return the verified raw bytes of a chunk from the first good replica."""
        reasons = []
        for node in self.read_order(cid):
            try:
                blob = node.get(cid)
            except ObjectMissing as e:
                if node in self.placement(cid):
                    self._report(BadReplica(cid, node.name, "missing", True))
                reasons.append(f"{node.name}: missing ({e})")
                continue
            except NodeError as e:
                reasons.append(f"{node.name}: {e}")
                continue
            try:
                raw = codec.decode(blob)
                if chunk_id(raw, self.seed) != cid:
                    raise codec.ChunkFormatError("content does not match its chunk id")
            except codec.ChunkFormatError as e:
                self._report(BadReplica(cid, node.name, str(e), False))
                reasons.append(f"{node.name}: corrupt ({e})")
                continue
            return raw
        raise ChunkUnavailable(f"chunk {cid.hex()} unreadable: " + "; ".join(reasons))

    def _report(self, bad: BadReplica) -> None:
        log.warning("bad replica of chunk %s on node %s: %s", bad.cid.hex(), bad.node, bad.reason)
        with self._lock:
            self.bad_replicas.append(bad)
        if self.on_bad_replica is not None:
            self.on_bad_replica(bad)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for n in self.nodes:
            n.close()
