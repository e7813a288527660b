"""Cutting a byte stream into chunks with bounded memory.

Two strategies share one small interface (:class:`Chunker`): fixed-size blocks, which are cheapest
and align with tensors when the DCP writer forces a cut at each tensor, and content-defined
chunking (FastCDC-style gear hashing with normalized chunking), which keeps boundaries stable when
bytes are inserted or removed so that a shifted checkpoint still deduplicates.

Every frontend cuts here, by one rule per kind. FileWriter (CLI, fsspec, `write_file`) and
the batched `stage_files` feed the volume's chunker (`Volume.make_chunker`); the DCP writer
feeds a ``views=True`` one (tensors hashed in place) and forces a cut at every item, its
tensor-aligned hint; the mount, whose writes come in any order, places them by
:class:`Layout`, the fixed rule in random-access form, with cuts where a torch.save zip's
entries begin and end (its hints, found by fusefs.mount.layout.ZipBoundaries). The mount
has no CDC: a block's place is fixed before the bytes around it are known, so a CDC
volume gets fixed blocks through the mount.

CDC boundary rule (must never change: stored chunk ids depend on it). With ``gear`` the standard
32-bit gear hash ``h = (h << 1) + G[byte]`` (so the window is the last 32 bytes), a chunk that
starts at offset ``c`` ends after byte ``i`` at the first ``i`` with ``len = i + 1 - c`` where

* ``len >= min_size`` and ``gear(i) & MASK_S == 0`` while ``len < avg`` (stricter mask), or
* ``gear(i) & MASK_L == 0`` once ``len >= avg`` (looser mask), or
* ``len == max_size``.

``G`` is derived with splitmix64 from ``seed`` (pure Python, so it is identical on every numpy
version and machine). Both masks contain bits 0..7, which lets the scan run as an 8-bit prefilter
over the whole region (1 table lookup via ``bytes.translate`` plus a few numpy adds) and evaluate
the full 32-bit hash only at the ~1/256 surviving positions. A per-byte Python loop would run at
a few MB/s; this runs at several hundred MB/s.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

__all__ = [
    "MIN_CHUNK",
    "MAX_CHUNK",
    "Chunker",
    "FixedChunker",
    "CdcChunker",
    "Layout",
    "make_chunker",
]

MIN_CHUNK = 64 * 1024
MAX_CHUNK = 64 * 1024 * 1024

_WINDOW = 32  # bytes that influence the 32-bit gear hash
_BLOCK = 256 * 1024  # scan granularity: fits in L2, bounds wasted hashing past a cut
_LAZY = 64 * 1024  # small feeds are only buffered until this much is left to scan


class Chunker(Protocol):
    """A stream cutter: feed bytes in, get finished chunks out (bytes objects; lists of
    views from a ``views=True`` fixed chunker)."""

    def feed(self, data: bytes | memoryview) -> list[Any]:
        """Append ``data``; return the chunks it completed."""
        ...

    def cut(self) -> list[Any]:
        """Force a boundary here; return the pending tail as a chunk if non-empty."""
        ...

    def finish(self) -> list[Any]:
        """End of stream; return the remaining bytes as a final chunk if any."""
        ...


def _check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int number of bytes, got {value!r}")
    if not MIN_CHUNK <= value <= MAX_CHUNK:
        raise ValueError(
            f"{name}={value} bytes is outside the allowed chunk size range "
            f"[{MIN_CHUNK} (64 KiB), {MAX_CHUNK} (64 MiB)]"
        )


class Layout:
    """The fixed rule in random-access form: boundaries at each cut and every ``bs`` bytes
    after it, up to the next cut (cuts 0, c1 ... -> [0, bs) ... [k*bs, c1) [c1, c1+bs) ...).

    :class:`FixedChunker` walks this rule over a stream; the mount, whose writes come in any
    order, asks it where the block holding a byte begins and ends (fusefs.mount.blocks), so
    a file written through the mount is cut exactly as a FileWriter or the DCP writer cuts
    the same bytes with the same forced cuts."""

    __slots__ = ("bs", "cuts")

    def __init__(self, bs: int, cuts: list[int] | None = None) -> None:
        self.bs = bs
        self.cuts = cuts if cuts else [0]

    @classmethod
    def of_extents(cls, bs: int, extents: Iterable[Any]) -> Layout:
        """The cuts a stored file was written with, from its extents (``offset``,
        ``chunk_off``): every extent that starts a chunk off the grid of the cut before it.
        An aligned file has none."""
        cuts = [0]
        for e in extents:
            if e.chunk_off == 0 and (e.offset - cuts[-1]) % bs:
                cuts.append(e.offset)
        return cls(bs, cuts)

    def span(self, x: int) -> tuple[int, int]:
        """The block holding byte x: [lo, hi)."""
        cuts = self.cuts
        if len(cuts) == 1:
            lo = x - x % self.bs
            return lo, lo + self.bs
        i = bisect.bisect_right(cuts, x) - 1
        c = cuts[i]
        lo = c + (x - c) // self.bs * self.bs
        hi = lo + self.bs
        if i + 1 < len(cuts) and cuts[i + 1] < hi:
            hi = cuts[i + 1]
        return lo, hi

    def cut(self, at: int) -> None:
        """A new cut, past every cut so far (cuts come from appends, in order)."""
        if at > self.cuts[-1]:
            self.cuts.append(at)

    def clip(self, size: int) -> None:
        """Forget the cuts past a truncated file's end."""
        while len(self.cuts) > 1 and self.cuts[-1] > size:
            self.cuts.pop()


class FixedChunker:
    """Boundaries every ``size`` bytes since the start or the last forced :meth:`cut` (the
    rule of :class:`Layout`, over a stream).

    ``views=True``: chunks come out as lists of memoryviews of the fed buffers, not copied
    (the DCP writer hashes a tensor's bytes in place and copies only new chunks, once); the
    caller keeps every fed buffer unchanged until its chunks are stored. Otherwise each
    chunk is one bytes object (one copy per byte)."""

    def __init__(self, size: int = 4 * 2**20, *, views: bool = False) -> None:
        _check_size("size", size)
        self.size = size
        self.views = views
        self._buf = bytearray()  # pending bytes of the current (incomplete) chunk
        self._pieces: list[memoryview] = []  # ...or, views=True, its pending views
        self._plen = 0  # their bytes

    def feed(self, data: bytes | memoryview) -> list[Any]:
        if self.views:
            return self._feed_views(data)
        size = self.size
        out: list[Any] = []
        with memoryview(data) as mv_in:
            mv = mv_in.cast("B") if mv_in.format != "B" or mv_in.ndim != 1 else mv_in
            pos = 0
            n = len(mv)
            if self._buf:
                take = min(size - len(self._buf), n)
                self._buf += mv[:take]
                pos = take
                if len(self._buf) == size:
                    out.append(bytes(self._buf))
                    self._buf = bytearray()
            # slice full chunks straight out of the caller's buffer: one copy per byte
            while n - pos >= size:
                out.append(bytes(mv[pos : pos + size]))
                pos += size
            if pos < n:
                self._buf += mv[pos:]
        return out

    def _feed_views(self, data: bytes | memoryview) -> list[Any]:
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        out: list[Any] = []
        pos, n, size = 0, len(mv), self.size
        while pos < n:
            take = min(size - self._plen, n - pos)
            self._pieces.append(mv[pos : pos + take])
            self._plen += take
            pos += take
            if self._plen == size:
                out.append(self._pieces)
                self._pieces, self._plen = [], 0
        return out

    def cut(self) -> list[Any]:
        if self.views:
            if not self._plen:
                return []
            pieces, self._pieces, self._plen = self._pieces, [], 0
            return [pieces]
        if not self._buf:
            return []
        chunk = bytes(self._buf)
        self._buf = bytearray()
        return [chunk]

    def finish(self) -> list[Any]:
        return self.cut()


def _splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return state, z ^ (z >> 31)


def _gear_table(seed: int) -> list[int]:
    """256 pseudo-random 32-bit gear values; pure Python so they never depend on numpy's RNG."""
    state = (0x636B7074667343DC ^ seed) & 0xFFFFFFFFFFFFFFFF  # "ckptfsC" salt
    table = []
    for _ in range(256):
        state, z = _splitmix64(state)
        table.append(z >> 32)
    return table


def _mask(bits: int) -> int:
    """A 32-bit mask with ``bits`` ones: bits 0..7 (for the 8-bit prefilter) + spread high bits."""
    extra = bits - 8
    mask = 0xFF
    for j in range(extra):
        mask |= 1 << (31 - (j * 24) // extra)
    assert bin(mask).count("1") == bits
    return mask


class CdcChunker:
    """Content-defined chunking (FastCDC-style, normalized level 2), vectorized with numpy."""

    def __init__(
        self,
        avg: int = 4 * 2**20,
        min_size: int | None = None,
        max_size: int | None = None,
        seed: int = 0,
    ) -> None:
        _check_size("avg", avg)
        if min_size is None:
            min_size = max(avg // 4, MIN_CHUNK)
        if max_size is None:
            max_size = min(avg * 4, MAX_CHUNK)
        _check_size("min_size", min_size)
        _check_size("max_size", max_size)
        if not min_size <= avg <= max_size:
            raise ValueError(
                f"CDC sizes must satisfy min_size <= avg <= max_size, "
                f"got min_size={min_size}, avg={avg}, max_size={max_size}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.avg, self.min_size, self.max_size, self.seed = avg, min_size, max_size, seed
        bits = round(np.log2(avg))  # 16..26 for the allowed range
        self.mask_s = _mask(bits + 2)  # stricter below avg: fewer tiny chunks
        self.mask_l = _mask(bits - 2)  # looser above avg: fewer max-size chunks
        gear = _gear_table(seed)
        self._g32 = np.array(gear, dtype=np.uint32)
        self._g8 = bytes(g & 0xFF for g in gear)  # translate table for the prefilter
        self._col_shift = np.arange(_WINDOW - 1, -1, -1, dtype=np.uint32)  # shift per window col
        self._buf = bytearray()  # bytes of the current chunk not yet emitted (starts at its start)
        self._scanned = 0  # next chunk-relative index whose cut condition is still unknown

    # -- scanning ----------------------------------------------------------------------------

    def _find_cut(self, arr: np.ndarray) -> int:
        """Length of the chunk at the start of ``arr``, or 0 if more data is needed."""
        n = len(arr)
        lo = max(self._scanned, self.min_size - 1)  # index of the last byte of a candidate
        hi = min(n, self.max_size - 1)  # indexes < hi are checked now; max_size - 1 is forced
        avg_idx = self.avg - 1  # from this index on the chunk length is >= avg: loose mask
        while lo < hi:
            end = min(hi, lo + _BLOCK)
            hit = self._scan_block(arr, lo, end, avg_idx)
            if hit >= 0:
                self._scanned = 0
                return hit + 1
            lo = end
        if n >= self.max_size:
            self._scanned = 0
            return self.max_size
        self._scanned = lo
        return 0

    def _scan_block(self, arr: np.ndarray, lo: int, end: int, avg_idx: int) -> int:
        """First index in [lo, end) satisfying the cut condition, or -1."""
        start = lo - (_WINDOW - 1)  # window bytes needed before lo (lo >= min_size - 1 >= 31)
        # 8-bit gear hash via doubling: H_2m[i] = H_m[i] + (H_m[i-m] << m) (mod 256). Each step
        # drops the first m entries, so after the loop h[j] is the hash at index start + 7 + j.
        h = np.frombuffer(arr[start:end].tobytes().translate(self._g8), dtype=np.uint8)
        for m in (1, 2, 4):
            s = h[:-m] + h[:-m]  # shift by adds: numpy has no SIMD uint8 shift
            for _ in range(m - 1):
                s += s
            h = h[m:] + s
        # h[_WINDOW - 8] is index lo, the first one with a full 32-byte window
        cand = np.flatnonzero(h[_WINDOW - 8 :] == 0)
        if not len(cand):
            return -1
        idx = cand + lo
        # full 32-bit gear hash at the survivors: sum_k G[b[i-k]] << k (mod 2**32); row r of
        # the window view holds bytes i-31..i, i.e. term k = 31 - column
        win = np.lib.stride_tricks.sliding_window_view(arr, _WINDOW)[idx - (_WINDOW - 1)]
        terms = self._g32.take(win, mode="clip")
        terms <<= self._col_shift
        full = np.add.reduce(terms, axis=1, dtype=np.uint32)
        mask = np.where(idx < avg_idx, self.mask_s, self.mask_l).astype(np.uint32)
        ok = np.flatnonzero((full & mask) == 0)
        return int(idx[ok[0]]) if len(ok) else -1

    # -- Chunker API -----------------------------------------------------------------------------

    def feed(self, data: bytes | memoryview) -> list[bytes]:
        out: list[bytes] = []
        with memoryview(data) as mv_in:
            mv = mv_in.cast("B") if mv_in.format != "B" or mv_in.ndim != 1 else mv_in
            pos = 0
            while self._buf:
                # complete the pending chunk: copy at most max_size bytes into the buffer
                take = min(len(mv) - pos, self.max_size - len(self._buf))
                self._buf += mv[pos : pos + take]
                pos += take
                unscanned = len(self._buf) - max(self._scanned, self.min_size - 1)
                if len(self._buf) < self.max_size and unscanned < _LAZY:
                    return out  # small writes: defer the scan (it has a fixed numpy cost)
                done = self._drain(out)
                if not done:
                    return out  # all of data is buffered, no boundary yet
                rest = len(self._buf) - done
                if rest <= take:  # the tail is all from data: re-read it from there, no copy
                    pos -= rest
                    self._buf = bytearray()
                else:
                    del self._buf[:done]
            # then cut straight out of the caller's buffer (no staging copy), keep only the tail
            arr = np.frombuffer(mv, dtype=np.uint8)
            while pos < len(mv):
                length = self._find_cut(arr[pos:])
                if not length:
                    break
                out.append(bytes(mv[pos : pos + length]))
                pos += length
            del arr
            if pos < len(mv):
                self._buf = bytearray(mv[pos:])
        return out

    def _drain(self, out: list[bytes]) -> int:
        """Append every chunk that ends inside the buffer to ``out``; return bytes consumed."""
        pos = 0
        arr = np.frombuffer(self._buf, dtype=np.uint8)
        with memoryview(self._buf) as mv:
            while pos < len(mv) and (length := self._find_cut(arr[pos:])):
                out.append(bytes(mv[pos : pos + length]))
                pos += length
        del arr  # release the export so the bytearray can be resized
        return pos

    def cut(self) -> list[bytes]:
        out: list[bytes] = []
        if self._buf:
            # a deferred scan may still hold content-defined boundaries: emit those first
            done = self._drain(out)
            if done < len(self._buf):
                out.append(bytes(memoryview(self._buf)[done:]))
        self._buf = bytearray()
        self._scanned = 0
        return out

    def finish(self) -> list[bytes]:
        return self.cut()


def make_chunker(
    kind: str,
    size: int,
    *,
    min_size: int | None = None,
    max_size: int | None = None,
    views: bool = False,
) -> Chunker:
    """Build a chunker from config: ``kind`` "fixed" (``size`` bytes) or "cdc" (``size`` = avg).

    ``min_size``/``max_size`` only apply to "cdc"; a fixed chunker has no use for them.
    ``views`` only applies to "fixed" (FixedChunker); CDC chunks are always copies.
    """
    if kind == "fixed":
        return FixedChunker(size, views=views)
    if kind == "cdc":
        return CdcChunker(size, min_size=min_size, max_size=max_size)
    raise ValueError(f"unknown chunker kind {kind!r}: expected 'fixed' or 'cdc'")
