"""What a file open through the mount holds besides its committed extents: dirty blocks.

A file being written is its committed extent list plus dirty blocks, laid out by the
file's `Layout` (chunkstore.chunker, the rule every writer cuts by; its cuts from
fusefs.mount.layout: chunk-size-aligned for an ordinary file; starting at each entry for a
zip written front to back, as torch.save writes), so a file rewritten in place cuts the
same chunks as a sequential write of it, and unchanged blocks deduplicate. A block is
keyed by its first byte's offset in the file. A block only remembers which byte ranges
were written ("spans"); the old content of its gaps is read when it is sealed, so a writer
that covers whole blocks never reads anything back. Large appends are kept as views of the
writer's buffers (Pieces) rather than copied. FileState is a file's state on the mount:
extents, blocks, records of new chunks not yet committed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

from chunkstore.chunker import Layout
from fusefs.client.extents import clip
from fusefs.mount.layout import ZIP_LOCAL, ZipBoundaries
from metadata.engine import (
    INLINE,
    Attr,
    Extent,
    NewChunk,
)

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
    """Written bytes of one block starting at file offset `lo`; `spans` are the written
    [s, e) ranges, relative to `lo`."""

    __slots__ = ("ino", "lo", "buf", "spans", "counted", "busy", "pool")

    def __init__(self, ino: int, lo: int, pool: BufferPool | None = None) -> None:
        self.ino = ino
        self.lo = lo
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
                self.buf.extend(zeros(end - len(self.buf)))
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


def parts_of(data: bytes | memoryview | Pieces) -> list[bytes | memoryview]:
    """A block's bytes as a list of buffers (a Pieces' own, else the one buffer)."""
    return list(data.parts) if isinstance(data, Pieces) else [data]


def zeros(n: int) -> bytes:
    return _ZEROS[:n] if n <= len(_ZEROS) else bytes(n)


@dataclass(eq=False)
class FileState:
    """What the mount holds for one open (or dirty) inode."""

    ino: int
    attr: Attr
    size: int
    extents: list[Extent]
    blocks: dict[int, DirtyBlock] = field(default_factory=dict)  # by first byte's offset
    sealing: dict[int, memoryview | Pieces] = field(default_factory=dict)  # the same
    new_chunks: dict[bytes, NewChunk] = field(default_factory=dict)
    version: int = 0
    committed: int = 0
    error: Exception | None = None
    opens: int = 0
    mtime_ns: int = 0
    read_end: int = -1
    run_start: int = 0  # where the reader's current run of contiguous reads began
    commit_lock: trio.Lock = field(default_factory=trio.Lock)
    records_max: int = RECORDS_MAX  # past this many new_chunks: drop_superseded_inline
    layout: Layout | None = None  # block boundaries; made at the first write (`layout_for`)
    entries: ZipBoundaries | None = None  # a zip written front to back: finds its cuts
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

    def layout_for(self, bs: int) -> Layout:
        """The file's block layout: the cuts its committed extents were written with."""
        if self.layout is None:
            self.layout = Layout.of_extents(bs, self.extents)
        return self.layout

    def cut_entries(self, off: int, data: bytes) -> list[int]:
        """Where to cut this file for the zip entries this append reveals (torch.save
        files; fusefs.mount.layout), in order, none below `off`.

        A file written from byte 0 whose first bytes are a zip local header is followed,
        append by append, by ZipBoundaries; any other write stops it for good."""
        entries = self.entries
        if entries is None:
            if off != 0 or self.size != 0 or data[:4] != ZIP_LOCAL:
                return []
            entries = self.entries = ZipBoundaries()
        return entries.feed(off, data)

    def truncated(self, size: int) -> None:
        """The file was truncated (or extended) to `size`: its extents, cuts and size.
        A zip written front to back is followed again only from an empty file."""
        self.size = size
        self.set_extents(clip(self.extents, size))
        if self.layout is not None:
            self.layout.clip(size)
        self.entries = None

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
