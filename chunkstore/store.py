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
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from chunkstore import codec
from chunkstore.health import NodeHealth
from chunkstore.ids import chunk_id
from chunkstore.nodes import NodeError, ObjectMissing, ObjectNode
from chunkstore.placement import place, rank_nodes

log = logging.getLogger("ckptfs.store")


BAD_REPLICAS_KEPT = 1000  # the newest bad replicas a store remembers


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
        for n in self.nodes:  # a put keeps a whole object of the id (nodes/base.py)
            n.content_seed = seed
        self._domains = [n.domain for n in self.nodes]
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="ckptfs-io")
        self._lock = threading.Lock()
        # The latest bad replicas seen (for the CLI's warnings; a long-running mount would
        # otherwise keep every one): fsck and the on_bad_replica hook see them all.
        self.bad_replicas: deque[BadReplica] = deque(maxlen=BAD_REPLICAS_KEPT)
        self.bad_replicas_seen = 0
        self.on_bad_replica: Callable[[BadReplica], None] | None = None
        # Node health and the replicas a degraded write could not place (see put_encoded).
        self.health = {n.name: NodeHealth() for n in self.nodes}
        self.under_replicated: dict[bytes, set[str]] = {}
        self.on_under_replicated: Callable[[bytes, list[str]], None] | None = None

    def placement(self, cid: bytes) -> list[ObjectNode]:
        return [self.nodes[i] for i in place(cid, self._names, self._domains, self.replicas)]

    def read_order(self, cid: bytes) -> list[ObjectNode]:
        """Placement nodes first, then every other node (chunks placed before a node change,
        handoff copies); nodes whose breaker is open go last, so a dead node costs no wait."""
        primary = self.placement(cid)
        rest = [self.nodes[i] for i in rank_nodes(cid, self._names)]
        order = primary + [n for n in rest if n not in primary]
        now = time.monotonic()
        return sorted(order, key=lambda n: not self.health[n.name].available(now))

    def put_encoded(self, cid: bytes, blob: bytes, *, sync: bool = True) -> list[str]:
        """Write an encoded chunk object to its R nodes in parallel.

        sync=False leaves the object's durability to the next `sync()` (one batch of
        fsyncs before the metadata commit that names it, instead of two per object).

        Returns the names of the nodes that hold it. A placement node that is
        down (its breaker open) or fails is replaced by the next-ranked healthy
        node (hinted handoff), and the chunk is reported as under-replicated on
        it so fsck/heal can copy it back. The write fails only when no node at
        all took a replica.
        """
        targets = self.placement(cid)
        now = time.monotonic()
        live = [n for n in targets if self.health[n.name].available(now)]
        missed = [n for n in targets if n not in live]
        ok, errors = self._put_all(cid, blob, live, sync)
        missed += [n for n in live if n.name not in ok]
        if missed:
            for n in self.read_order(cid):
                if len(ok) >= self.replicas:
                    break
                if n in targets or not self.health[n.name].available():
                    continue
                extra, errs = self._put_all(cid, blob, [n], sync)
                ok += extra
                errors += errs
            if not ok:  # every breaker open: try the skipped placement nodes anyway
                extra, errs = self._put_all(cid, blob, [n for n in targets if n not in live], sync)
                ok += extra
                errors += errs
            if not ok:
                raise ChunkStoreError(
                    f"chunk {cid.hex()}: no node took a replica: {'; '.join(errors)}"
                )
            lacking = [n.name for n in targets if n.name not in ok]
            if lacking:
                self._under_replicated(cid, lacking)
        return ok

    def _put_all(
        self, cid: bytes, blob: bytes, nodes: Sequence[ObjectNode], sync: bool = True
    ) -> tuple[list[str], list[str]]:
        """Put to these nodes in parallel; (names that acknowledged, error strings)."""
        ok, errors = [], []
        if len(nodes) == 1:
            try:
                put = nodes[0].put if sync else nodes[0].put_nosync
                self._guarded(nodes[0], put, cid, blob)
                ok.append(nodes[0].name)
            except NodeError as e:
                errors.append(f"{nodes[0].name}: {e}")
            return ok, errors
        futs = {
            self._pool.submit(self._guarded, n, n.put if sync else n.put_nosync, cid, blob): n
            for n in nodes
        }
        wait(futs)
        for f, n in futs.items():
            exc = f.exception()
            if exc is None:
                ok.append(n.name)
            else:
                errors.append(f"{n.name}: {exc}")
        return ok, errors

    def _guarded(self, node: ObjectNode, fn: Callable, *args: object) -> object:
        """Call a node method, feeding its circuit breaker; returns the result or the error."""
        health = self.health[node.name]
        try:
            out = fn(*args)
        except ObjectMissing:
            health.ok()
            raise
        except NodeError as e:
            health.failed(str(e))
            raise
        health.ok()
        return out

    def _under_replicated(self, cid: bytes, nodes: list[str]) -> None:
        log.warning("chunk %s under-replicated: missing on %s", cid.hex(), ", ".join(nodes))
        with self._lock:
            self.under_replicated.setdefault(cid, set()).update(nodes)
        if self.on_under_replicated is not None:
            try:
                self.on_under_replicated(cid, nodes)
            except Exception:  # the save succeeded; fsck finds what was not recorded
                log.exception("could not record under-replicated chunk %s", cid.hex())

    def sync(self) -> None:
        """Make every object put with sync=False durable (all nodes in parallel)."""
        errors = []
        for f, n in [(self._pool.submit(self._guarded, n, n.sync), n) for n in self.nodes]:
            exc = f.exception()
            if exc is not None:
                errors.append(f"{n.name}: {exc}")
        if errors:
            raise ChunkStoreError(f"syncing chunk objects failed: {'; '.join(errors)}")

    def get(self, cid: bytes) -> bytes:
        """Return the verified raw bytes of a chunk from the first good replica."""
        reasons = []
        for node in self.read_order(cid):
            try:
                blob = self._guarded(node, node.get, cid)
            except ObjectMissing as e:
                if node in self.placement(cid):
                    self._report(BadReplica(cid, node.name, "missing", True))
                reasons.append(f"{node.name}: missing ({e})")
                continue
            except NodeError as e:
                reasons.append(f"{node.name}: {e}")
                continue
            try:
                raw = codec.decode(blob, id_checked=True)
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
            self.bad_replicas_seen += 1
        if self.on_bad_replica is not None:
            self.on_bad_replica(bad)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for n in self.nodes:
            n.close()
