"""Extent-list arithmetic: the one place that knows how a file maps onto chunks.

A file is a sorted list of disjoint extents (offset, length, chunk id, offset in the chunk);
holes (no extent) read as zeros. Writers replace ranges (`splice`), truncates cut the list
(`clip`), and every reader (the volume's FileReader, the mount's file cache, the DCP
reader) turns a byte range into pieces of extents (`pieces`) and each piece into a view of
its chunk's bytes (`view`). The functions are pure: callers own the list and its `starts`
(the extents' offsets, kept beside the list for bisecting).
"""

from __future__ import annotations

import bisect

from metadata.engine import INLINE_DATA_MAX, Extent

Piece = tuple[Extent, int, int]  # an extent and the file range [lo, hi) read from it


def starts_of(extents: list[Extent]) -> list[int]:
    return [e.offset for e in extents]


def splice(extents: list[Extent], start: int, end: int, new: list[Extent]) -> list[Extent]:
    """A new list where [start, end) is replaced by `new` (which lies inside it)."""
    out: list[Extent] = []
    placed = False
    for e in extents:
        e_end = e.offset + e.length
        if e_end <= start or e.offset >= end:
            if e.offset >= end and not placed:
                out.extend(new)
                placed = True
            out.append(e)
            continue
        if e.offset < start:
            out.append(Extent(e.offset, start - e.offset, e.chunk_id, e.chunk_off))
        if e_end > end:
            if not placed:
                out.extend(new)
                placed = True
            cut = end - e.offset
            out.append(Extent(end, e_end - end, e.chunk_id, e.chunk_off + cut))
    if not placed:
        out.extend(new)
    return out


def clip(extents: list[Extent], size: int) -> list[Extent]:
    """The extents cut at the file size (what a truncate keeps)."""
    out = []
    for e in extents:
        if e.offset >= size:
            break
        if e.offset + e.length > size:
            e = Extent(e.offset, size - e.offset, e.chunk_id, e.chunk_off)
        out.append(e)
    return out


def overlapping(extents: list[Extent], starts: list[int], lo: int, hi: int) -> list[int]:
    """Indexes of the extents that overlap [lo, hi)."""
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    out = []
    while i < len(extents) and extents[i].offset < hi:
        e = extents[i]
        if e.offset + e.length > lo:
            out.append(i)
        i += 1
    return out


def pieces(extents: list[Extent], starts: list[int], lo: int, hi: int) -> list[Piece]:
    """The extents that overlap [lo, hi), each with the part of the range it holds."""
    out = []
    for i in overlapping(extents, starts, lo, hi):
        e = extents[i]
        out.append((e, max(lo, e.offset), min(hi, e.offset + e.length)))
    return out


def covers(e: Extent, lo: int, hi: int) -> bool:
    """Does this one extent hold all of [lo, hi)? (A read then is a view of one chunk.)"""
    return e.offset <= lo and e.offset + e.length >= hi


def view(e: Extent, raw: bytes | bytearray | memoryview, lo: int, hi: int) -> memoryview:
    """The chunk bytes behind file range [lo, hi) of extent `e`, given the chunk's bytes."""
    a = e.chunk_off + lo - e.offset
    return memoryview(raw)[a : a + hi - lo]


def fill(out: bytearray, off: int, e: Extent, raw: bytes | memoryview, lo: int, hi: int) -> None:
    """Copy piece [lo, hi) of `e` into `out`, a buffer that holds the file from `off`."""
    out[lo - off : hi - off] = view(e, raw, lo, hi)


def maybe_inline(e: Extent) -> bool:
    """Can the chunk this extent names be inline? Only if the extent is small: an inline
    chunk has at most INLINE_DATA_MAX bytes, and an extent covers part of its chunk at most."""
    return e.length <= INLINE_DATA_MAX


def whole_chunks(
    extents: list[Extent], starts: list[int], off: int, n: int
) -> list[tuple[bytes, int, int]] | None:
    """(chunk id, offset in the item, length) of the whole chunks that tile [off, off+n)
    exactly, or None (holes, shared or partial chunks)."""
    i = bisect.bisect_left(starts, off)
    out = []
    pos = off
    while pos < off + n:
        if i >= len(extents):
            return None
        e = extents[i]
        if e.offset != pos or e.chunk_off != 0 or e.offset + e.length > off + n:
            return None
        out.append((e.chunk_id, pos - off, e.length))
        pos += e.length
        i += 1
    return out
