"""FileReader: range reads over a file's extents, with read-ahead of the following chunks
for a reader that goes on where it stopped (a random reader fetches only what it reads).

Chunks come from Volume.fetch_chunk (verified; through the host tier's read cache when one
is attached); the range arithmetic is fusefs.client.extents, shared with every reader.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING

from fusefs.client import extents as ext
from fusefs.client.extents import maybe_inline
from metadata.engine import Attr, Extent

if TYPE_CHECKING:
    from fusefs.client.volume import Volume


class FileReader:
    """Range reads over a file's extents, with read-ahead of the following chunks."""

    def __init__(self, vol: Volume, attr: Attr, *, readahead: int = 16) -> None:
        self.vol = vol
        self.attr = attr
        self.size = attr.size
        self.extents = vol.meta.get_extents(attr.ino)
        self._starts = ext.starts_of(self.extents)
        self._cache: OrderedDict[bytes, Future[bytes | memoryview]] = OrderedDict()
        self._readahead = readahead
        self._pos = 0
        self._end = 0  # where the last pread ended: a read from there is sequential

    def _chunk(self, e: Extent) -> Future[bytes | memoryview]:
        cid = e.chunk_id
        fut = self._cache.get(cid)
        if fut is None:
            # view=True: a raw chunk held on this host comes back as a view of its mapped
            # file (no read into a fresh buffer); pread copies out of it once.
            fut = self.vol.pool.submit(self.vol.fetch_chunk, cid, small=maybe_inline(e), view=True)
            self._cache[cid] = fut
            while len(self._cache) > self._readahead + 4:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(cid)
        return fut

    def pread(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0:
            raise ValueError("negative offset or size")
        size = max(0, min(size, self.size - offset))
        if size == 0:
            return b""
        end = offset + size
        sequential = offset == 0 or offset == self._end
        self._end = end
        idx = ext.overlapping(self.extents, self._starts, offset, end)
        if idx:
            futs = [self._chunk(self.extents[i]) for i in idx]
            if sequential:
                self._prefetch(idx[-1] + 1)
        if len(idx) == 1 and ext.covers(self.extents[idx[0]], offset, end):
            return bytes(ext.view(self.extents[idx[0]], futs[0].result(), offset, end))
        out = bytearray(size)
        for i, fut in zip(idx, futs if idx else [], strict=True):
            e = self.extents[i]
            lo, hi = max(offset, e.offset), min(end, e.offset + e.length)
            ext.fill(out, offset, e, fut.result(), lo, hi)
        return bytes(out)

    def _prefetch(self, i: int) -> None:
        for e in self.extents[i : i + self._readahead]:
            self._chunk(e)

    # file-like sequential API
    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self.size - self._pos
        data = self.pread(self._pos, n)
        self._pos += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = seek_position(self._pos, self.size, pos, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        for fut in self._cache.values():
            fut.cancel()
        self._cache.clear()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def seek_position(pos: int, size: int, offset: int, whence: int) -> int:
    """The new position of a seek (SEEK_SET, SEEK_CUR, SEEK_END); never below 0."""
    base = {0: 0, 1: pos, 2: size}[whence]
    return max(0, base + offset)
