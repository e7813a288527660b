"""Per-inode dirty data and the chunk read cache of one mount (trio side).

A file open through the mount is its committed extent list plus, while it is
written, chunk-size-aligned dirty blocks. Blocks are aligned to the volume's
chunk size so a file rewritten in place cuts the same chunks as a sequential
write of it, and unchanged blocks deduplicate.

A dirty block only remembers which byte ranges were written ("spans"); the
old content of its gaps is read when the block is sealed, so a sequential
writer, or any writer that covers whole blocks, never reads anything back.
A block is sealed (hashed, looked up, stored) as soon as it is complete, in
a background task, so a long sequential write streams to the chunk store and
memory stays bounded: `dirty_max` bytes of unsealed blocks (the oldest are
sealed early when it is exceeded) plus `inflight_max` bytes being stored
(writers wait above it). Flush/fsync/close seal what is left and commit the
file's full extent list in one metadata call.

Existence checks are grouped: while one "which of these chunks exist?" query runs, the
ids of blocks sealed meanwhile queue up for the next one, so concurrent writers cost one
metadata transaction per batch, not one per block. A file that is one small block (the
small-file case) is hashed, stored and committed in a single worker call at close.

Sealed blocks go through the volume's one chunk sink (fusefs.client.sink), which stores
them unsynced and acknowledges them in one batch right before the commit that names them
(and bounds the unacknowledged bytes). A chunk read back before its commit is synced first:
the tier serves only acknowledged chunks.

Reads see committed extents, then blocks being stored, then dirty spans. A read inside one
cached chunk is answered with a view of it (no copy on the trio thread).
Chunks are fetched in worker threads with single-flight (one fetch per chunk
however many readers wait) and sequential readers get read-ahead of the
following chunks.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import trio

from chunkstore.ids import pieces_id
from fusefs.client.extents import clip, maybe_inline, overlapping, splice
from fusefs.client.volume import Volume
from metadata.engine import (
    INLINE,
    INLINE_DATA_MAX,
    Attr,
    Extent,
    MetaError,
    NewChunk,
    UnknownChunks,
)

log = logging.getLogger("ckptfs.mount")

_ZEROS = bytes(1 << 20)


class FileError(Exception):
    """A data-path failure reported to the kernel as an errno."""

    def __init__(self, err: int, message: str) -> None:
        super().__init__(message)
        self.errno = err


# -- dirty blocks ------------------------------------------------------------------
class BufferPool:
    """Reused block-sized buffers.

    A fresh multi-MiB allocation costs a page fault per 4 KiB on first touch,
    which made copying into new buffers the most expensive step of a write.
    Buffers handed to a store task come back here when it is done.
    """

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._free: list[bytearray] = []

    def get(self) -> bytearray:
        return self._free.pop() if self._free else bytearray(self.size)

    def put(self, buf: bytearray) -> None:
        if len(buf) == self.size and len(self._free) < self.keep:
            self._free.append(buf)


SMALL_BLOCK = 256 * 1024  # below this a block grows on demand; above, it takes a pooled buffer
PIECE_MIN = 64 * 1024  # smaller appends are copied: many tiny pieces cost more than a copy
# Pieces a block may have before it is copied into one buffer. A 1 MiB write() from a buffer
# that is not page aligned reaches us as two requests (the kernel pins at most 256 pages a
# request): 1 MiB less the misalignment, then the rest, a few bytes. Copying such a tail as a
# piece of its own keeps the block's big pieces uncopied; materializing the block there cost
# a 4 MiB copy per block.
PIECES_MAX = 64
RECORDS_MAX = 64  # inline records a file holds before superseded ones are dropped


class Pieces:
    """A block written front to back, kept as the request buffers it arrived in.

    The kernel's 1 MiB writes reach us as immutable bytes objects; copying each into a block
    buffer was a quarter of the serving thread's CPU in a sequential write (the other copy
    is pyfuse3's own). A block sealed in this form is hashed piece by piece and copied once,
    in a worker thread, into the direct-I/O buffer. Slicing returns a copy (reads of dirty
    data are rare)."""

    __slots__ = ("parts", "n")

    def __init__(self, parts: list[memoryview] | None = None) -> None:
        self.parts: list[memoryview] = parts or []
        self.n = sum(len(p) for p in self.parts)

    def append(self, mv: memoryview) -> None:
        self.parts.append(mv)
        self.n += len(mv)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, sl: slice) -> bytes:
        start, stop, _ = sl.indices(self.n)
        out = bytearray()
        pos = 0
        for p in self.parts:
            end = pos + len(p)
            if end > start and pos < stop:
                out += p[max(start - pos, 0) : min(stop - pos, len(p))]
            pos = end
            if pos >= stop:
                break
        return bytes(out)

    def head(self, n: int) -> Pieces:
        """The first n bytes, as views (a file truncated below what was written)."""
        parts, pos = [], 0
        for p in self.parts:
            if pos >= n:
                break
            parts.append(p[: n - pos])
            pos += len(parts[-1])
        return Pieces(parts)

    def release(self) -> None:
        self.parts = []


class DirtyBlock:
    """Written bytes of one aligned block; `spans` are the written [s, e) ranges."""

    __slots__ = ("ino", "index", "buf", "spans", "counted", "busy", "pool")

    def __init__(self, ino: int, index: int, pool: BufferPool | None = None) -> None:
        self.ino = ino
        self.index = index
        self.buf = bytearray()  # grows on demand: a 4 KiB file costs 4 KiB, not a chunk
        self.spans: list[list[int]] = []
        self.counted = 0  # bytes of it in FileCache.dirty_bytes
        self.busy = False  # being sealed
        self.pool = pool

    def write(self, off: int, data: bytes | memoryview, stable: bool = False) -> None:
        """Record data at off. `stable`: data views an immutable object, safe to keep."""
        end = off + len(data)
        buf = self.buf
        big = stable and len(data) >= PIECE_MIN
        if off == len(buf):
            if isinstance(buf, Pieces) and len(buf.parts) < PIECES_MAX:
                # a small append is copied, but the pieces before it stay as they are
                buf.append(memoryview(data) if big else memoryview(bytes(data)))
                self._add_span(off, end)
                return
            if big and off == 0:
                self.buf = Pieces([memoryview(data)])
                self._add_span(off, end)
                return
            if big and len(buf) < PIECE_MIN:
                # A small head, then the bulk: torch.save's zip headers and its requests
                # that straddle a block boundary start most blocks with a few KiB. Copying
                # the head keeps the bulk as views; taking a pooled buffer here made every
                # later write into the block a copy (nearly all of a checkpoint's bytes).
                self.buf = Pieces([memoryview(bytes(buf)), memoryview(data)])
                self._add_span(off, end)
                return
        if isinstance(buf, Pieces):
            self._materialize()
        if len(self.buf) < end:
            pool = self.pool
            if pool is not None and end > SMALL_BLOCK and end <= pool.size:
                # Stale bytes of a reused buffer sit only outside the spans: reads never
                # look there and sealing fills every gap with the old content first.
                big = pool.get()
                big[: len(self.buf)] = self.buf
                self.buf = big
                self.pool = None  # fixed size from now on
            else:
                self.buf.extend(_zeros(end - len(self.buf)))
        self.buf[off:end] = data
        self._add_span(off, end)

    def _materialize(self) -> None:
        """Copy the pieces into a buffer: the next write is not an append."""
        pieces = self.buf
        assert isinstance(pieces, Pieces)
        pool = self.pool
        if pool is not None and len(pieces) <= pool.size:
            buf = pool.get()
            self.pool = None
        else:
            buf = bytearray(len(pieces))
        pos = 0
        for p in pieces.parts:
            buf[pos : pos + len(p)] = p
            pos += len(p)
        self.buf = buf

    def _add_span(self, s: int, e: int) -> None:
        spans = self.spans
        if spans and spans[-1][1] == s:  # the sequential case: extend the last span
            spans[-1][1] = e
            if len(spans) == 1 or spans[-2][1] < s:
                return
        merged: list[list[int]] = []
        placed = False
        for a, b in spans:
            if b < s:
                merged.append([a, b])
            elif a > e:
                if not placed:
                    merged.append([s, e])
                    placed = True
                merged.append([a, b])
            else:
                s, e = min(a, s), max(b, e)
        if not placed:
            merged.append([s, e])
        merged.sort()
        self.spans = merged

    def gaps(self, lo: int, hi: int) -> list[tuple[int, int]]:
        out, pos = [], lo
        for a, b in self.spans:
            if b <= pos:
                continue
            if a >= hi:
                break
            if a > pos:
                out.append((pos, min(a, hi)))
            pos = max(pos, b)
        if pos < hi:
            out.append((pos, hi))
        return out

    def fill(self, off: int, data: bytes) -> None:
        """Write old content only where nothing newer was written."""
        for s, e in self.gaps(off, off + len(data)):
            self.write(s, data[s - off : e - off])

    def covers(self, n: int) -> bool:
        return bool(self.spans) and self.spans[0][0] == 0 and self.spans[0][1] >= n

    @property
    def nbytes(self) -> int:
        return len(self.buf)


def _parts(data: bytes | memoryview | Pieces) -> list[bytes | memoryview]:
    """A block's bytes as a list of buffers (a Pieces' own, else the one buffer)."""
    return list(data.parts) if isinstance(data, Pieces) else [data]


def _zeros(n: int) -> bytes:
    return _ZEROS[:n] if n <= len(_ZEROS) else bytes(n)


@dataclass(eq=False)
class FileState:
    """What the mount holds for one open (or dirty) inode."""

    ino: int
    attr: Attr
    size: int
    extents: list[Extent]
    blocks: dict[int, DirtyBlock] = field(default_factory=dict)
    sealing: dict[int, memoryview | Pieces] = field(default_factory=dict)
    new_chunks: dict[bytes, NewChunk] = field(default_factory=dict)
    version: int = 0
    committed: int = 0
    error: Exception | None = None
    opens: int = 0
    mtime_ns: int = 0
    read_end: int = -1
    commit_lock: trio.Lock = field(default_factory=trio.Lock)
    records_max: int = RECORDS_MAX  # past this many new_chunks: drop_superseded_inline
    _starts: list[int] | None = None
    _stored: int | None = None  # bytes the extents map (what a commit records as alloc)

    @property
    def dirty(self) -> bool:
        return self.version != self.committed

    @property
    def unflushed(self) -> bool:
        """Writes not committed yet, or blocks still held or being stored."""
        return self.dirty or bool(self.blocks) or bool(self.sealing)

    def allocated(self) -> int:
        """Bytes holding data, unflushed writes included: st_blocks of a dirty file.

        The extents' bytes plus the written spans of dirty and sealing blocks. A block that
        rewrites stored bytes counts twice, so this overstates by at most the dirty bytes,
        where counting every write since the last commit overstated a file rewritten in
        place by the number of rewrites."""
        if self._stored is None:
            self._stored = sum(e.length for e in self.extents)
        dirty = sum(e - s for blk in self.blocks.values() for s, e in blk.spans)
        return self._stored + dirty + sum(len(d) for d in self.sealing.values())

    def starts(self) -> list[int]:
        if self._starts is None:
            self._starts = [e.offset for e in self.extents]
        return self._starts

    def set_extents(self, extents: list[Extent]) -> None:
        self.extents = extents
        self._starts = None
        self._stored = None

    def drop_superseded_inline(self) -> None:
        """Forget the records of inline chunks no extent names any more.

        An inline record holds its chunk's bytes until the file's commit, which alone
        drops records. A small block sealed again and again under dirty pressure (each
        time a new version) piled up a record per seal: 16 KiB of memory each, and a
        commit over the service that outgrew the frame limit and could never succeed.
        Such a record is needed by no one: its bytes are stored nowhere else, so nothing
        is left behind. (A staged record stays: its object is in the tier, and the commit
        registers it so that gc can collect it.) Runs when the records double, so a file
        of many small blocks, all still named, does not rescan its extents at every seal."""
        named = {e.chunk_id for e in self.extents}
        for cid, rec in list(self.new_chunks.items()):
            if rec.state == INLINE and cid not in named:
                del self.new_chunks[cid]
        self.records_max = max(RECORDS_MAX, 2 * len(self.new_chunks))

    def records(self) -> dict[bytes, NewChunk]:
        """A copy of the records a commit carries, superseded inline ones dropped first
        (they would only register chunks nothing names). A single inline record is the
        common case (a file's small tail) and is carried as it is."""
        if sum(r.state == INLINE for r in self.new_chunks.values()) > 1:
            self.drop_superseded_inline()
        return dict(self.new_chunks)

    def touch(self) -> None:
        self.version += 1
        self.mtime_ns = time.time_ns()


class _Slot:
    __slots__ = ("event", "data", "error", "nbytes", "ahead")

    def __init__(self, ahead: bool = False) -> None:
        self.event = trio.Event()
        self.data: bytes | None = None
        self.error: BaseException | None = None
        self.nbytes = 0
        self.ahead = ahead  # fetched by read-ahead and not read yet


SMALL_COMMIT = 256 * 1024  # a file that is one block up to this size: store+commit in one call
INLINE_COMMIT = 64 * 1024  # ...and up to this size hashed on the loop to try an inline commit


class FileCache:
    """Dirty state of every open inode, the write pipeline and the chunk read cache."""

    def __init__(
        self,
        vol: Volume,
        nursery: trio.Nursery,
        *,
        dirty_max: int = 64 * 2**20,
        inflight_max: int = 64 * 2**20,
        cache_max: int = 128 * 2**20,
        readahead: int = 8,
        workers: int = 6,
        local: Any = None,
    ) -> None:
        self.vol = vol
        self.local = local  # the mount's inline SQLite connection (CkptFS._local_call), or None
        self.nursery = nursery
        self.block = vol.settings.chunk_size
        self.dirty_max = dirty_max
        self.inflight_max = inflight_max
        self.cache_max = cache_max
        self.readahead = readahead
        self.store_limiter = trio.CapacityLimiter(workers)
        self.fetch_limiter = trio.CapacityLimiter(workers)
        self.meta_limiter = trio.CapacityLimiter(4)
        self.pool = BufferPool(self.block, keep=max(4, (dirty_max + inflight_max) // self.block))
        self.states: dict[int, FileState] = {}
        self.dirty_bytes = 0
        self.inflight_bytes = 0
        self._lru: OrderedDict[tuple[int, int], DirtyBlock] = OrderedDict()
        self._chunks: OrderedDict[bytes, _Slot] = OrderedDict()
        self._cached_bytes = 0
        self._ahead_bytes = 0  # read-ahead slots not read yet (a block each)
        self._changed = trio.lowlevel.ParkingLot()

    async def meta(self, fn, *args, **kw):
        """Run a blocking metadata call in a worker thread."""
        if kw:
            return await trio.to_thread.run_sync(lambda: fn(*args, **kw), limiter=self.meta_limiter)
        return await trio.to_thread.run_sync(fn, *args, limiter=self.meta_limiter)

    # -- states --------------------------------------------------------------
    async def _committed_extents(self, attr: Attr) -> list[Extent]:
        """The file's committed extents, cut at its size: what an open starts from."""
        extents = await self.meta(self.vol.meta.get_extents, attr.ino) if attr.size else []
        return clip(extents, attr.size)

    async def open_state(self, attr: Attr) -> FileState:
        st = self.states.get(attr.ino)
        if st is None:
            extents = await self._committed_extents(attr)
            st = self.states.get(attr.ino)  # another open may have raced us here
            if st is None:
                st = FileState(attr.ino, attr, attr.size, extents)
                self.states[attr.ino] = st
        st.opens += 1
        return st

    async def reload(self, st: FileState, attr: Attr) -> bool:
        """Take another mount's commit of a file we hold open (close-to-open): its size and
        extents replace ours, unless we have unflushed writes (then the last close wins).
        Returns whether it did."""
        if st.unflushed:
            return False
        extents = await self._committed_extents(attr)
        if st.unflushed:  # a write of ours came in meanwhile
            return False
        st.attr = attr
        st.size = attr.size
        st.set_extents(extents)
        return True

    def drop_if_idle(self, st: FileState) -> None:
        if st.opens <= 0 and not st.unflushed:
            if self.states.get(st.ino) is st:
                del self.states[st.ino]

    def discard(self, st: FileState) -> None:
        """Forget unflushed data (the file was unlinked and closed)."""
        for idx, blk in list(st.blocks.items()):
            self._forget_block(st, idx, blk)
        st.committed = st.version
        st.new_chunks.clear()

    def _forget_block(self, st: FileState, idx: int, blk: DirtyBlock) -> None:
        if st.blocks.get(idx) is blk:
            del st.blocks[idx]
        self._lru.pop((st.ino, idx), None)
        self.dirty_bytes -= blk.counted
        blk.counted = 0

    # -- write path -------------------------------------------------------------
    async def write(self, st: FileState, off: int, data: bytes) -> int:
        if st.error is not None:
            raise FileError(errno.EIO, f"earlier write error on inode {st.ino}: {st.error}")
        bs = self.block
        pos, n = 0, len(data)
        mv = memoryview(data)
        stable = isinstance(data, bytes)  # immutable: blocks may keep views of it
        while pos < n:
            at = off + pos
            idx, boff = divmod(at, bs)
            take = min(n - pos, bs - boff)
            while idx in st.sealing:  # an overwrite of a block being stored: let it land
                await self._changed.park()
            blk = st.blocks.get(idx)
            if blk is None:
                blk = st.blocks[idx] = DirtyBlock(st.ino, idx, self.pool)
            before = blk.nbytes
            blk.write(boff, mv[pos : pos + take], stable)
            blk.counted += blk.nbytes - before
            self.dirty_bytes += blk.nbytes - before
            if not blk.busy:
                self._lru[(st.ino, idx)] = blk
                self._lru.move_to_end((st.ino, idx))
            pos += take
            st.size = max(st.size, at + take)
            st.touch()
            if blk.covers(bs):
                await self.seal(st, blk)
        while self.dirty_bytes > self.dirty_max and self._lru:
            (ino, _), old = self._lru.popitem(last=False)
            ost = self.states.get(ino)
            if ost is not None:
                await self.seal(ost, old)
        while self.inflight_bytes > self.inflight_max:
            await self._changed.park()
        return n

    async def seal(self, st: FileState, blk: DirtyBlock) -> None:
        """Complete the block from the old content and hand it to a store task."""
        if blk.busy:
            return
        blk.busy = True
        lo = blk.index * self.block
        self._lru.pop((st.ino, blk.index), None)  # nobody else picks it while we fill
        try:
            for _ in range(16):  # racing writers only shrink the gaps; bounded anyway
                length = min(self.block, st.size - lo)
                gaps = blk.gaps(0, length)
                if not gaps:
                    break
                snap = st.extents
                for s, e in gaps:
                    old = await self._read_extents(snap, None, lo + s, e - s)
                    blk.fill(s, old)
            else:
                raise FileError(errno.EIO, f"block {blk.index} of inode {st.ino} kept changing")
        except BaseException:
            blk.busy = False
            self._changed.unpark_all()  # a settle waiting for this block seals it itself
            raise
        if st.blocks.get(blk.index) is not blk:  # discarded meanwhile
            self._changed.unpark_all()
            return
        length = min(self.block, st.size - lo)
        self._forget_block(st, blk.index, blk)
        if length <= 0:
            self._changed.unpark_all()
            return
        buf = blk.buf
        data: memoryview | Pieces
        if isinstance(buf, Pieces):
            data = buf if len(buf) == length else buf.head(length)
        else:
            if len(buf) < length:  # cannot happen: the fill loop leaves no gap below length
                buf.extend(_zeros(length - len(buf)))
            data = memoryview(buf)[:length]
        st.sealing[blk.index] = data
        self.inflight_bytes += length
        self.nursery.start_soon(self._store, st, blk.index, data, buf)

    async def _store(
        self, st: FileState, idx: int, data: memoryview | Pieces, buf: bytearray | Pieces
    ) -> None:
        try:
            # One worker call per block: hash, "is it known?", store. Separate calls for the
            # hash, a grouped query on the loop and the store cost three thread round trips
            # a block, each a wakeup on both sides; one call took a fresh 1 GiB write from
            # 2.0-2.2 to 1.6-1.9 daemon CPU-s and 480-550 to 540-650 MB/s.
            cid, rec = await trio.to_thread.run_sync(
                self._hash_and_store, data, limiter=self.store_limiter
            )
        except Exception as e:  # the writer learns it at flush/fsync/close
            log.error("storing block %d of inode %d failed: %s", idx, st.ino, e)
            st.error = e
            self._requeue(st, idx, data)
        else:
            lo = idx * self.block
            st.set_extents(splice(st.extents, lo, lo + len(data), [Extent(lo, len(data), cid, 0)]))
            if rec is not None:
                st.new_chunks[cid] = rec
                if len(st.new_chunks) > st.records_max:
                    st.drop_superseded_inline()
        finally:
            st.sealing.pop(idx, None)
            self.inflight_bytes -= len(data)
            data.release()
            if isinstance(buf, bytearray):
                self.pool.put(buf)
            self._changed.unpark_all()

    def _requeue(self, st: FileState, idx: int, data: memoryview | Pieces | bytes) -> None:
        """A block whose store failed goes back as dirty, whole (called while its index is
        still in `st.sealing`, so no newer block for it exists). The commit that reports the
        error clears it and the next one stores the block again: a metadata service down
        past the client's retry window used to mark the file failed for good, and its data
        was dropped at unmount even after the service came back."""
        if st.attr.nlink <= 0 and st.opens <= 0:
            return  # unlinked and closed meanwhile: nobody can read it back
        blk = DirtyBlock(st.ino, idx)
        pos = 0
        for part in _parts(data):  # copied: the sealed buffer goes back to the pool
            blk.write(pos, part)
            pos += len(part)
        blk.counted = blk.nbytes
        self.dirty_bytes += blk.nbytes
        st.blocks[idx] = blk

    def _hash_and_store(self, data: memoryview | Pieces) -> tuple[bytes, NewChunk | None]:
        """Worker thread: the block through the volume's chunk sink in one call."""
        return self.vol.sink.hash_and_store(_parts(data), len(data))

    def _put(self, cid: bytes, data: bytes | memoryview | Pieces) -> NewChunk:
        """Worker thread: store a block already known to be new (ChunkSink.store)."""
        return self.vol.sink.store(cid, _parts(data), len(data), inline=True)

    def _publish(self, ino: int, extents, size: int, chunks: list[NewChunk], mtime_ns: int):
        """Worker thread: sync what was stored unsynced, then commit the file."""
        self.vol.sink.sync()
        return self.vol.meta.commit_file(ino, extents, size, chunks, mtime_ns=mtime_ns)

    async def settle(self, st: FileState) -> None:
        """Seal every dirty block of the file and wait until all are stored.

        A block that another task is sealing (`busy`: its gaps being read from the old
        content) is waited for as well: it is in neither `st.sealing` nor the blocks this
        call can seal yet. A commit that went on without it published the file without that
        block's writes, and marked them committed: an fsync'd write was lost."""
        for _ in range(8):
            for blk in list(st.blocks.values()):
                await self.seal(st, blk)
            while st.sealing or any(blk.busy for blk in st.blocks.values()):
                await self._changed.park()
            if not st.blocks or st.error is not None:
                return  # a failed store: the commit reports it, the next one retries

    async def commit(self, st: FileState) -> None:
        """Store and publish the file's current content (flush, fsync, close)."""
        # A close is nearly always uncontended: take the lock without `async with`, whose
        # checkpoint costs a pass of the scheduler (an epoll wait and every ready task) on
        # each small file's close.
        lock = st.commit_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            if await self._commit_small(st):
                return
            await self.settle(st)
            if st.error is not None:  # reported once; the failed blocks wait, dirty, for a retry
                err, st.error = st.error, None
                raise FileError(errno.EIO, f"write error on inode {st.ino}: {err}")
            if not st.dirty:
                return
            version, size = st.version, st.size
            # Writers racing this commit may have left blocks that settle did not wait for:
            # their writes are not in these extents, so the file stays dirty for the next one.
            complete = not st.blocks and not st.sealing
            extents = clip(st.extents, size)
            chunks = st.records()
            attr = await self.meta(
                self._publish, st.ino, extents, size, list(chunks.values()), st.mtime_ns
            )
            for cid in chunks:
                st.new_chunks.pop(cid, None)
            st.attr = attr
            if complete:
                st.committed = version
        finally:
            lock.release()

    async def _commit_small(self, st: FileState) -> bool:
        """A file that is one small, fully written block: hash, store and commit in one call.

        Saves the small-file close two trips between the trio thread and the workers."""
        if st.error is not None or st.sealing or len(st.blocks) != 1 or st.size > SMALL_COMMIT:
            return False
        ((idx, blk),) = st.blocks.items()
        lo = idx * self.block
        length = st.size - lo
        if blk.busy or idx != 0 or length <= 0 or blk.gaps(0, length):
            return False
        self._forget_block(st, idx, blk)
        data = bytes(blk.buf[:length])
        if isinstance(blk.buf, bytearray):
            self.pool.put(blk.buf)
        st.sealing[idx] = memoryview(data)
        version, size, mtime_ns = st.version, st.size, st.mtime_ns
        chunks = st.records()
        base = st.extents

        known: tuple[bytes, Attr] | None = None
        new_cid: bytes | None = None  # hashed and found missing inline: store it

        def work() -> tuple[bytes, NewChunk | None, Attr | Exception]:
            if new_cid is not None:
                cid, rec = new_cid, self._put(new_cid, data)
            else:
                cid, rec = self._hash_and_store(data)
            mine = dict(chunks)
            if rec is not None:
                mine[cid] = rec
            extents = clip(splice(base, lo, lo + length, [Extent(lo, length, cid, 0)]), size)
            try:
                attr = self._publish(st.ino, extents, size, list(mine.values()), mtime_ns)
            except Exception as e:  # stored but not published: the next commit retries
                return cid, rec, e
            return cid, rec, attr

        try:
            if self.local is not None and not chunks and not base and length <= INLINE_COMMIT:
                known, new_cid = self._commit_known_inline(st.ino, data, length, size, mtime_ns)
            if known is not None:
                (cid, attr), rec = known, None
            else:
                cid, rec, attr = await trio.to_thread.run_sync(work, limiter=self.store_limiter)
        except Exception as e:  # the store failed: like a failed background store
            log.error("storing the block of inode %d failed: %s", st.ino, e)
            self._requeue(st, idx, data)  # reported here, retried by the next commit
            raise FileError(errno.EIO, f"write error on inode {st.ino}: {e}") from None
        finally:
            st.sealing.pop(idx, None)
            self._changed.unpark_all()
        st.set_extents(splice(st.extents, lo, lo + length, [Extent(lo, length, cid, 0)]))
        if isinstance(attr, Exception):
            if rec is not None:
                st.new_chunks[cid] = rec
            raise attr
        for c in chunks:
            st.new_chunks.pop(c, None)
        st.attr = attr
        st.committed = version
        return True

    def _commit_known_inline(
        self, ino: int, data: bytes, length: int, size: int, mtime_ns: int
    ) -> tuple[tuple[bytes, Attr] | None, bytes | None]:
        """A new small file committed right here, on the mount's inline connection, as its
        namespace calls are, saving the close a worker round trip. Content of at most
        INLINE_DATA_MAX bytes goes into the same transaction (an inline chunk; one already known
        stays as it is): nothing is staged or uploaded, and no fsync orders data before the
        metadata naming it. Larger content is committed here only if it is already stored
        (the same file saved again at every step): commit_file refuses extents naming an
        unregistered chunk (UnknownChunks), so asking "is it known?" first would only add a
        second transaction, and a chunk it finds cannot be collected in between (gc deletes
        rows of unreferenced chunks in a transaction of its own). Returns ((chunk id,
        attributes), None) when committed; (None, chunk id) when the content is new (the
        worker stores it without asking again); (None, None) for anything else (a busy
        database, a refusal): the worker path."""
        cid = pieces_id([data], self.vol.seed)
        new = [NewChunk.inline(cid, data)] if length <= INLINE_DATA_MAX else []
        try:
            attr = self.local.commit_file(
                ino, [Extent(0, length, cid, 0)], size, new, mtime_ns=mtime_ns
            )
        except UnknownChunks:
            return None, cid
        except MetaError as e:  # MetaBusy (nothing done) or a refusal
            log.debug("inline commit of inode %d: %s; via a worker", ino, e)
            return None, None
        return (cid, attr), None

    async def shutdown(self) -> None:
        """Unmount: publish every file still dirty (best effort, logged)."""
        for st in list(self.states.values()):
            if st.dirty and st.attr.nlink > 0:
                try:
                    await self.commit(st)
                except Exception as e:
                    log.error("inode %d: unflushed data lost at unmount: %s", st.ino, e)

    # -- read path ------------------------------------------------------------
    async def read(self, st: FileState, off: int, size: int) -> bytes:
        size = max(0, min(size, st.size - off))
        if size == 0:
            return b""
        end = off + size
        # Snapshot newer data first, so a store landing while we fetch cannot hide it.
        bs = self.block
        layers: list[tuple[int, bytes]] = []
        for idx in range(off // bs, (end - 1) // bs + 1):
            if idx in st.sealing:  # copied: the buffer goes back to the pool once stored
                lo, buf = idx * bs, st.sealing[idx]
                s, e = max(lo, off), min(lo + len(buf), end)
                if s < e:
                    layers.append((s, bytes(buf[s - lo : e - lo])))
        spans: list[tuple[int, bytes]] = []
        for idx in range(off // bs, (end - 1) // bs + 1):
            blk = st.blocks.get(idx)
            if blk is None:
                continue
            lo = idx * bs
            for a, b in blk.spans:
                s, e = max(lo + a, off), min(lo + b, end)
                if s < e:
                    spans.append((s, bytes(blk.buf[s - lo : e - lo])))
        sequential = off <= st.read_end <= end or off == 0
        st.read_end = end
        data = await self._read_extents(st.extents, st, off, size, readahead=sequential)
        if not layers and not spans:
            return data
        out = bytearray(data)
        for s, buf in layers + spans:
            out[s - off : s - off + len(buf)] = buf
        return out

    async def _read_extents(
        self,
        extents: list[Extent],
        st: FileState | None,
        off: int,
        size: int,
        *,
        readahead: bool = False,
    ) -> bytes | bytearray | memoryview:
        """Bytes [off, off+size) of an extent list; holes read as zeros.

        Inside one chunk the answer is a view of the cached chunk, not a copy."""
        end = off + size
        starts = (
            st.starts() if st is not None and st.extents is extents else [e.offset for e in extents]
        )
        idx = overlapping(extents, starts, off, end)
        if readahead and idx:
            self._prefetch(extents[idx[-1] + 1 : idx[-1] + 1 + self.readahead])
        if len(idx) == 1:
            e = extents[idx[0]]
            if e.offset <= off and e.offset + e.length >= end:
                raw = await self.chunk(e)
                s = e.chunk_off + off - e.offset
                return memoryview(raw)[s : s + size]
        slots = [(extents[i], self._slot(extents[i])) for i in idx]
        out = bytearray(size)
        for e, slot in slots:
            raw = await self._wait(e.chunk_id, slot)
            s = max(off, e.offset)
            t = min(end, e.offset + e.length)
            view = memoryview(raw)[e.chunk_off + s - e.offset : e.chunk_off + t - e.offset]
            out[s - off : t - off] = view
        return out

    def _prefetch(self, extents: list[Extent]) -> None:
        """Fetch the next chunks of a sequential reader, within half the cache.

        Many readers at once (8 DCP ranks, each with its own file) would otherwise prefetch
        more than the cache holds and evict each other's chunks before they are read, then
        fetch them again: measured, 8 parallel cold readers ran at half the speed of the
        same reads one after another."""
        for e in extents:
            if self._ahead_bytes + self.block > self.cache_max // 2:
                return
            if e.chunk_id not in self._chunks:
                self._slot(e, ahead=True)

    def _slot(self, e: Extent, ahead: bool = False) -> _Slot:
        cid = e.chunk_id
        slot = self._chunks.get(cid)
        if slot is not None:
            self._chunks.move_to_end(cid)
            if not ahead:
                self._consumed(slot)
            return slot
        self._evict(self.cache_max - self.block)
        slot = self._chunks[cid] = _Slot(ahead)
        if ahead:
            self._ahead_bytes += self.block
        self.nursery.start_soon(self._fetch, cid, slot, maybe_inline(e))
        return slot

    def _consumed(self, slot: _Slot) -> None:
        if slot.ahead:
            slot.ahead = False
            self._ahead_bytes -= self.block

    async def _fetch(self, cid: bytes, slot: _Slot, small: bool) -> None:
        try:
            data = self._unpublished(cid) if small else None
            slot.data = (
                data
                if data is not None
                else await trio.to_thread.run_sync(
                    self._get, cid, small, limiter=self.fetch_limiter
                )
            )
            slot.nbytes = len(slot.data)
            self._cached_bytes += slot.nbytes
        except Exception as e:
            log.error("chunk %s unreadable: %s", cid.hex(), e)
            slot.error = e
            if self._chunks.get(cid) is slot:
                del self._chunks[cid]  # the next reader tries again
                self._consumed(slot)
        finally:
            slot.event.set()
        self._evict(self.cache_max)

    def _unpublished(self, cid: bytes) -> bytes | None:
        """The bytes of an inline chunk a file of this mount holds but has not committed
        yet (on the loop, which alone changes `new_chunks`). A sealed block of at most
        INLINE_DATA_MAX bytes is stored nowhere until its file's commit carries it into
        the metadata, but the file's extents name it at once: its reads, and the gap
        reads of the block's next version, come here (they got EIO, and the file could
        never be committed again)."""
        for st in self.states.values():
            rec = st.new_chunks.get(cid)
            if rec is not None and rec.data:
                return rec.data
        return None

    def _get(self, cid: bytes, small: bool) -> bytes | memoryview:
        """Worker thread: a chunk's bytes (synced first if we staged it unsynced).

        A raw object in the host tier comes back as a view of the mapped file (as DCP loads
        do, cache.read_object fast=True): no read into a fresh buffer, no payload checksum
        pass beside the id check. A cold 1 GiB read went from 532-748 to 814-916 MB/s and
        the daemon's CPU from 1.6-1.9 s to 1.2 s."""
        if self.vol.sink.is_unsynced(cid):  # the tier serves only acknowledged chunks
            self.vol.sink.sync()
        return self.vol.fetch_chunk(cid, view=True, small=small)

    def _evict(self, limit: int) -> None:
        """Drop the least recently used fetched chunks (never in-flight ones), chunks already
        read before read-ahead nobody has used yet."""
        if self._cached_bytes <= limit:
            return
        for spare_ahead in (True, False):
            for cid, slot in list(self._chunks.items()):
                if self._cached_bytes <= limit:
                    return
                if slot.event.is_set() and not (spare_ahead and slot.ahead):
                    del self._chunks[cid]
                    self._cached_bytes -= slot.nbytes
                    self._consumed(slot)

    async def _wait(self, cid: bytes, slot: _Slot) -> bytes:
        await slot.event.wait()
        if slot.error is not None:
            raise FileError(errno.EIO, f"chunk {cid.hex()} unreadable: {slot.error}")
        assert slot.data is not None
        return slot.data

    async def chunk(self, e: Extent) -> bytes:
        return await self._wait(e.chunk_id, self._slot(e))
