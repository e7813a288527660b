"""verify: read back the chunks scoped writers registered, and vouch for the whole ones.

A scoped writer's commit claims its new chunks are stored; the metadata cannot check
that (it holds no node credentials and imports no chunk store), so such a row carries
the writer's trust domain and counts for that scope's deduplication only
(metadata/sql/chunkrefs.py, "Trust domains"). This pass is the trusted process that
lifts the restriction: run with the admin credential (gc runs it first), it pages
through the unverified rows (`unverified_chunks`, an index of only those), reads each
chunk from its nodes, checks the header checksum and the content id against the
volume's seed, and marks the row verified (`mark_verified`) once R replicas are whole.
From then on every scope deduplicates against it.

A row it cannot vouch for (absent, corrupt, fewer than R whole replicas, a node down)
is left as it is and looked at again next time: its content is then stored again by
the next writer of another scope that needs it, never skipped. The cost is a read of
every byte a scoped writer stores for the first time, once, and cross-scope
deduplication of new content delayed until the next pass.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from chunkstore import codec
from chunkstore.ids import chunk_id
from chunkstore.nodes import NodeError
from chunkstore.store import ChunkStore
from fusefs.client.volume import Volume

log = logging.getLogger("ckptfs.verify")

BATCH = 1000  # rows asked for, and marked, at a time
THREADS = 4  # chunks read in parallel (node reads block on disk or network)


@dataclass
class VerifyReport:
    checked: int = 0  # unverified rows looked at
    verified: int = 0  # rows marked verified
    unproven: int = 0  # rows left as they were (fewer than R whole replicas)
    bytes_read: int = 0
    errors: list[str] = field(default_factory=list)  # the first few unproven chunks, why
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def whole_replicas(store: ChunkStore, cid: bytes) -> tuple[int, int, str]:
    """(whole replicas found, bytes read, why not R): reads the chunk's nodes in read
    order until R whole replicas (header checksum and content id both right) are found."""
    whole = nbytes = 0
    why = []
    for node in store.read_order(cid):
        try:
            blob = node.get(cid)
        except NodeError as e:
            why.append(f"{node.name}: {e}")
            continue
        nbytes += len(blob)
        try:
            if chunk_id(codec.decode(blob, id_checked=True), store.seed) != cid:
                raise codec.ChunkFormatError("content does not match its chunk id")
        except codec.ChunkFormatError as e:
            why.append(f"{node.name}: corrupt ({e})")
            continue
        whole += 1
        if whole >= store.replicas:
            break
    return whole, nbytes, "; ".join(why)


def verify_chunks(vol: Volume, *, batch: int = BATCH, max_rows: int | None = None) -> VerifyReport:
    """Vouch for the unverified chunk rows whose objects are whole on R nodes (module
    docstring). `max_rows` bounds one pass (None: every unverified row, once)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    t0 = time.monotonic()
    rep = VerifyReport()
    store = vol.store
    after = b""
    with ThreadPoolExecutor(THREADS, thread_name_prefix="ckptfs-verify") as pool:
        while max_rows is None or rep.checked < max_rows:
            n = batch if max_rows is None else min(batch, max_rows - rep.checked)
            ids = vol.meta.unverified_chunks(after, n)
            if not ids:
                break
            after = ids[-1]
            good = []
            for cid, (whole, nbytes, why) in zip(
                ids, pool.map(lambda c: whole_replicas(store, c), ids), strict=True
            ):
                rep.checked += 1
                rep.bytes_read += nbytes
                if whole >= store.replicas:
                    good.append(cid)
                else:
                    rep.unproven += 1
                    if len(rep.errors) < 20:
                        rep.errors.append(f"chunk {cid.hex()}: {whole} whole replica(s); {why}")
            if good:
                rep.verified += vol.meta.mark_verified(good)
            if len(ids) < n:
                break
    if rep.unproven:
        log.warning("verify: %d chunk row(s) not proven stored (left unverified)", rep.unproven)
    rep.seconds = time.monotonic() - t0
    return rep
