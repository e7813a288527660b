"""The chunk sink: the one way chunks get from any writer into storage.

Every frontend writes through here: the volume's FileWriter (CLI, `write_file`), the DCP
writer (per-item cuts, tensors hashed in place), the batched `stage_files` and the mount's
dirty blocks and small files. All cut with chunkstore.chunker; they differ only in the
batch they have at hand and how they publish the result (commit_file or commit_rank);
what happens to a chunk is decided once, in this module:

    pieces -> id (xxh3-128, a batch at a time)
           -> "which of these exist?" (`plan`: one query per batch for its distinct ids not
              already stored by this writer, which leases the missing ones; a chunk that
              goes inline is not asked; known ones are skipped)
           -> new chunk:  small and committed with commit_file  -> inline in the metadata
                          local write-behind tier                -> staged raw, unsynced
                          otherwise                              -> encoded, put unsynced
           -> before the commit that names them: `sync()`, one batch of fsyncs.

Why raw staging: on two cores even zstd's probe costs more than the local disk, so a save
stages bytes as they are and the tier's uploader compresses them (codec.transcoder) after
the save. Why unsynced puts: a writer that commits many chunks at once pays one round of
fsyncs at its commit, not three per chunk. Why a bound on unsynced bytes: the tier can
neither upload nor evict an unacknowledged chunk, so a long write syncs every
`unsynced_cap` bytes (UNSYNCED_MAX, or a quarter of the staging budget if smaller) and a
full staging of them can never stall it.

The sink is per volume and thread-safe: its unsynced set is the volume's, since a sync
acknowledges everything the tier (or the nodes) hold unsynced, whoever wrote it. A
ChunkStream is one file's ordered pipeline over the sink: extents, new chunk records and
a bounded window of stores in flight.

The sink also counts what went through it (chunks, logical bytes, dedup hits, stores by
where they went, bytes stored): plain int attributes bumped on the paths above, read by
the metrics collector (fusefs.metrics) at scrape time, so writers pay an integer add.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from chunkstore import codec
from chunkstore.ids import chunk_id, pieces_id
from metadata.engine import DURABLE, INLINE_DATA_MAX, Extent, NewChunk

if TYPE_CHECKING:
    from fusefs.client.volume import Volume

HASH_BATCH = 8  # chunks per "which exist?" query of a FileWriter
INFLIGHT_BYTES = 64 * 2**20  # raw bytes being encoded/stored per stream
UNSYNCED_MAX = 256 * 2**20  # unacknowledged bytes a volume's writers may hold
RENEW_EVERY_S = 300.0  # lease renewals of uncommitted chunks (leases last LEASE_TTL_S)

T = TypeVar("T")
R = TypeVar("R")
Buffer = bytes | bytearray | memoryview
Pieces = Sequence[Buffer]  # one chunk as consecutive buffers (not joined: copied once, late)
Hint = tuple[str | None, int | None]  # (codec name, float element width) for a new chunk
NO_HINT: Hint = (None, None)
log = logging.getLogger("ckptfs")


def _joined(pieces: Pieces) -> Buffer:
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class ChunkSink:
    """Ids, existence, storing and acknowledging chunks for every writer of one volume."""

    def __init__(self, vol: Volume) -> None:
        self.vol = vol
        self._cond = threading.Condition()
        self._unsynced: dict[bytes, int] = {}  # stored unsynced: chunk id -> bytes admitted
        self._unsynced_bytes = 0  # their sum
        self._reserved = 0  # bytes admitted for puts still running
        self._leased: dict[bytes, None] = {}  # ids leased to this volume's writers, in flight
        self._renewer: threading.Thread | None = None
        self._closed = threading.Event()
        self.renew_every = RENEW_EVERY_S
        # Counters (monotonic; read by fusefs.metrics). Chunks and raw bytes every writer
        # handed in, those already stored (dedup hits: known to the volume or repeated in
        # the same file), new chunks by where they went, and the bytes written for them
        # (raw plus header when staged, encoded when put to the nodes, raw when inline).
        self.chunks_in = 0
        self.bytes_in = 0
        self.dedup_hits = 0
        self.dedup_bytes = 0
        self.puts_inline = 0
        self.puts_tier = 0
        self.puts_nodes = 0
        self.stored_bytes = 0

    # -- ids and existence ---------------------------------------------------------------
    def ids(self, chunks: Sequence[Buffer | Pieces], *, spread: bool = True) -> list[bytes]:
        """The ids of a batch of chunks, each one buffer or a list of pieces (pieces_id).

        spread: hashed on the pool in one task per worker (`spread`), for a batch that has
        the pool to itself (stage_files). A stream hashes in its own thread (spread=False):
        the pool is busy storing its earlier chunks, and hashing queued behind those stores
        held a GiB write for 2.4 s of its 3.2 s, where xxh3 hashes ~20 GB/s on one thread."""
        seed = self.vol.seed

        def one(c: Any) -> bytes:
            return pieces_id(c, seed) if isinstance(c, list) else chunk_id(c, seed)

        return self.spread(one, chunks) if spread else [one(c) for c in chunks]

    def spread(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """[fn(x) for x in items] on the volume's pool, in one task per worker, each taking
        every worker-th item (interleaved, so big and small items spread evenly): a task per
        item is a wake-up and a GIL hand-off each. One item or one worker: inline."""
        n = min(len(items), self.vol.workers)
        if n <= 1:
            return [fn(x) for x in items]
        out: list[Any] = [None] * len(items)
        for k, part in enumerate(
            self.vol.pool.map(lambda k: [fn(x) for x in items[k::n]], range(n))
        ):
            out[k::n] = part
        return out

    def counted(self, n: int, *, known: bool) -> None:
        """One chunk of n bytes handed in by a writer; `known`: already stored (dedup)."""
        self.chunks_in += 1
        self.bytes_in += n
        if known:
            self.dedup_hits += 1
            self.dedup_bytes += n

    def missing(self, ids: list[bytes]) -> set[bytes]:
        """Which of these chunks the volume lacks; the rest are written already (dedup).
        Asking counts as a foreground write for the host's tier (WriteBehindTier.foreground)."""
        if self.vol.tier is not None:
            self.vol.tier.foreground()
        missing = self.vol.meta.missing_chunks(ids)
        if missing:
            self._lease(missing)
        return missing

    # -- leases of uncommitted chunks (metadata/sql/leases.py) ---------------------------------
    def _lease(self, ids: set[bytes]) -> None:
        """The metadata leased these ids to us (missing_chunks): renew them until a commit
        registers them, so gc keeps their objects however long the file stays open."""
        with self._cond:
            self._leased.update(dict.fromkeys(ids))
            if self._renewer is None:
                self._renewer = threading.Thread(
                    target=self._renew_loop, name="ckptfs-lease-renewer", daemon=True
                )
                self._renewer.start()

    def _renew_loop(self) -> None:
        """Every renew_every seconds, renew the leases of ids not yet registered; ids the
        metadata no longer renews (registered, or lost: the commit will refuse them) are
        dropped. Ends when none are left (a later missing() starts it again)."""
        while not self._closed.wait(self.renew_every):
            with self._cond:
                ids = list(self._leased)
                if not ids:
                    self._renewer = None
                    return
            try:
                done = self.vol.meta.renew_chunk_leases(ids)
            except Exception as e:  # noqa: BLE001 - retried next round; the commit checks
                log.warning("ckptfs: renewing %d chunk leases failed: %s", len(ids), e)
                continue
            with self._cond:
                for cid in done:
                    self._leased.pop(cid, None)
        with self._cond:
            self._renewer = None

    def end_leases(self) -> None:
        """Give up every chunk leased to this volume's writers and not committed (a save
        that failed, a process closing its volume): gc may then collect them after its
        grace period. Ids committed meanwhile are unaffected (their rows keep them).
        Best effort: otherwise they lapse at their TTL."""
        with self._cond:
            ids = list(self._leased)
            self._leased.clear()
        if ids:
            try:
                self.vol.meta.end_chunk_leases(ids)
            except Exception as e:  # noqa: BLE001 - they lapse at their TTL anyway
                log.warning("ckptfs: ending %d chunk leases failed: %s", len(ids), e)

    def close(self) -> None:
        """Stop renewing (the volume is closing: its engine goes next)."""
        self._closed.set()
        renewer = self._renewer
        if renewer is not None:
            renewer.join(timeout=5)

    # -- storing -------------------------------------------------------------------------
    def store(
        self, cid: bytes, pieces: Pieces, n: int, hint: Hint = NO_HINT, *, inline: bool = False
    ) -> NewChunk:
        """Store one new chunk (blocking, any thread); its record for the commit.

        inline=True (a writer committing with commit_file): a chunk of at most
        INLINE_DATA_MAX bytes is not stored; its record carries the bytes into the commit
        (INLINE). Checkpoint commits (commit_rank) carry no bytes. The chunk is durable only
        after the next `sync()`, which the writer calls before the commit naming it."""
        if inline and n <= INLINE_DATA_MAX:
            self.puts_inline += 1
            self.stored_bytes += n
            return NewChunk.inline(cid, bytes(_joined(pieces)))
        codec_name, width = hint
        vol, tier = self.vol, self.vol.tier
        if tier is not None and tier.durability == "local":
            parts = codec.raw_parts(list(pieces))  # not joined: fileio.write_new copies once
            with self._unsynced_put(cid, n):
                state = tier.put(cid, parts, sync=False, width=width)
            self.puts_tier += 1
            self.stored_bytes += n + codec.HEADER
            return NewChunk(cid, n, n + codec.HEADER, state)
        blob = codec.encode(
            _joined(pieces), codec_name or vol.settings.compression, elem_width=width
        )
        if tier is not None:  # durability=remote: on R nodes when put returns
            state = tier.put(cid, blob, sync=False, width=width)
            self.puts_tier += 1
        else:
            with self._unsynced_put(cid, n):
                vol.store.put_encoded(cid, blob, sync=False)
            state = DURABLE
            self.puts_nodes += 1
        self.stored_bytes += len(blob)
        return NewChunk(cid, n, len(blob), state)

    def plan(
        self,
        ids: Sequence[bytes],
        sizes: Sequence[int],
        *,
        inline: bool,
        planned: set[bytes] | None = None,
    ) -> list[bool]:
        """THE "which exist?" policy, for every writer: which chunks of a batch to store.

        A batch is what the writer has at hand (a stream's next `batch` chunks, the mount's
        sealed block, stage_files' whole batch of files). Its distinct ids, less those this
        writer already `planned` (stored or storing), are asked in ONE query (missing(),
        which leases what it reports missing); a chunk that goes inline (`inline` and at
        most INLINE_DATA_MAX bytes) is not asked: its record carries the bytes, and the
        commit keeps a chunk row already there. Returns, per chunk, whether to store it:
        the first occurrence of an id neither known nor planned (added to `planned`).
        Every chunk is counted (dedup hits included)."""
        planned = set() if planned is None else planned
        small = INLINE_DATA_MAX if inline else -1
        ask = [
            cid
            for cid, n in dict(zip(ids, sizes, strict=True)).items()
            if n > small and cid not in planned
        ]
        missing = self.missing(ask) if ask else set()
        out: list[bool] = []
        for cid, n in zip(ids, sizes, strict=True):
            new = cid not in planned and (n <= small or cid in missing)
            if new:
                planned.add(cid)
            self.counted(n, known=not new)
            out.append(new)
        return out

    def hash_and_store(self, pieces: Pieces, n: int) -> tuple[bytes, NewChunk | None]:
        """One chunk in one call, by `plan` (the mount seals a block at a time, from many
        files at once, in one worker call each): its id, its "is it known?" query and its
        store; the record is None for a known chunk."""
        cid = pieces_id(list(pieces), self.vol.seed)
        (new,) = self.plan([cid], [n], inline=True)
        return cid, self.store(cid, pieces, n, inline=True) if new else None

    # -- acknowledging -------------------------------------------------------------------
    @property
    def unsynced_cap(self) -> int:
        """Unacknowledged bytes allowed: a quarter of the staging budget, at most UNSYNCED_MAX."""
        budget = getattr(self.vol.tier, "budget", None)
        return min(UNSYNCED_MAX, budget // 4) if budget else UNSYNCED_MAX

    @contextmanager
    def _unsynced_put(self, cid: bytes, n: int) -> Iterator[None]:
        """Admit an unsynced put of n bytes under the cap, then count it as unacknowledged.

        Admission waits while the bytes held (admitted puts still running plus stored,
        unacknowledged ones) would pass the cap, acknowledging what is stored meanwhile; a
        chunk bigger than the cap alone always goes. Counting before the put, not after,
        keeps the bound strict with many workers storing at once."""
        while True:
            with self._cond:
                held = self._reserved + self._unsynced_bytes
                if not held or held + n <= self.unsynced_cap:
                    self._reserved += n
                    break
                if not self._unsynced_bytes:  # only puts in flight: wait for one to land
                    self._cond.wait(timeout=1.0)
                    continue
            self.sync()
        try:
            yield
        except BaseException:
            with self._cond:
                self._reserved -= n
                self._cond.notify_all()
            raise
        with self._cond:
            self._reserved -= n
            if cid not in self._unsynced:
                self._unsynced[cid] = n
                self._unsynced_bytes += n
            self._cond.notify_all()

    def is_unsynced(self, cid: bytes) -> bool:
        return cid in self._unsynced

    def sync(self) -> None:
        """Acknowledge every chunk stored unsynced so far (one batch of fsyncs). Chunks
        stored while this runs stay in the set for the next call."""
        with self._cond:
            ids = list(self._unsynced)
        if not ids:
            return
        if self.vol.tier is not None:
            self.vol.tier.sync_staged()
        else:
            self.vol.store.sync()
        with self._cond:
            for cid in ids:
                self._unsynced_bytes -= self._unsynced.pop(cid, 0)
            self._cond.notify_all()

    def discard_unsynced(self) -> None:
        """Forget chunks stored unsynced by a save that failed (the tier drops its files)."""
        with self._cond:
            self._unsynced.clear()
            self._unsynced_bytes = 0
            self._cond.notify_all()
        if self.vol.tier is not None:
            self.vol.tier.discard_unsynced()

    def stream(
        self, *, inline: bool, batch: int = HASH_BATCH, inflight: int = INFLIGHT_BYTES
    ) -> ChunkStream:
        return ChunkStream(self, inline=inline, batch=batch, inflight=inflight)


class ChunkStream:
    """One file's chunks, in file order: extents and the records of its new chunks.

    Chunks are added in order; every `batch` of them is hashed together and checked with
    one query, and the new ones go to the pool to be stored, at most `inflight` raw bytes
    at a time (memory stays bounded whatever the file size). `finish()` waits for the
    stores; the caller then syncs (the sink) and commits. Pieces must stay unchanged until
    finish (DCP keeps the tensors they view alive until then)."""

    def __init__(self, sink: ChunkSink, *, inline: bool, batch: int, inflight: int) -> None:
        self.sink = sink
        self.inline = inline
        self.batch_n = batch
        self.inflight_max = inflight
        self.size = 0
        self.extents: list[Extent] = []
        self.new_chunks: dict[bytes, NewChunk] = {}
        self._batch: list[tuple[int, Pieces, int, Hint]] = []
        self._inflight: deque[tuple[Future[NewChunk], int]] = deque()
        self._inflight_bytes = 0
        self._planned: set[bytes] = set()

    def add_chunks(self, chunks: list[bytes] | list[list[Buffer]], hint: Hint = NO_HINT) -> None:
        """The next chunks as a chunker cut them (chunkstore.chunker: bytes, or lists of
        views from a `views=True` fixed chunker)."""
        for ch in chunks:
            if isinstance(ch, list):
                self.add(ch, sum(len(p) for p in ch), hint)
            else:
                self.add([ch], len(ch), hint)

    def add(self, pieces: Pieces, n: int, hint: Hint = NO_HINT) -> None:
        """The next chunk of the file: n bytes as one or more pieces."""
        self._batch.append((self.size, pieces, n, hint))
        self.size += n
        if len(self._batch) >= self.batch_n:
            self.flush()

    def flush(self) -> None:
        """Hash and look up the chunks added so far; send the new ones to be stored."""
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        sink = self.sink
        ids = sink.ids([p[0] if len(p) == 1 else list(p) for _, p, _, _ in batch], spread=False)
        new = sink.plan(ids, [n for _, _, n, _ in batch], inline=self.inline, planned=self._planned)
        for (off, pieces, n, hint), cid, store in zip(batch, ids, new, strict=True):
            self.extents.append(Extent(off, n, cid, 0))
            if store:
                while self._inflight and self._inflight_bytes + n > self.inflight_max:
                    self._reap()
                fut = sink.vol.pool.submit(sink.store, cid, pieces, n, hint, inline=self.inline)
                self._inflight.append((fut, n))
                self._inflight_bytes += n

    def _reap(self) -> None:
        fut, n = self._inflight.popleft()
        self._inflight_bytes -= n
        rec = fut.result()
        self.new_chunks[rec.chunk_id] = rec

    def finish(self) -> None:
        """Every chunk added is stored (unsynced) or known; raises the first store error."""
        self.flush()
        while self._inflight:
            self._reap()

    def abort(self) -> None:
        """Cancel or wait out the stores in flight; the first error is the one reported."""
        self._batch = []
        while self._inflight:
            fut, _ = self._inflight.popleft()
            fut.cancel()
            try:
                fut.result()
            except BaseException:  # noqa: S110
                pass

    def record(self, path: str) -> dict:
        """The file as commit_rank takes it."""
        return {
            "path": path,
            "size": self.size,
            "extents": self.extents,
            "new_chunks": list(self.new_chunks.values()),
        }
