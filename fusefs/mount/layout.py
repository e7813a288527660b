"""Where a file written through the mount is cut into chunks.

A file's blocks (the units the mount seals into chunks) start at each *cut* of the file
and then every chunk size after it, up to the next cut:

    cuts 0, c1, c2 ...   ->   blocks [0, bs) [bs, 2bs) ... [k*bs, c1) [c1, c1+bs) ...

An ordinary file has the one cut 0: fixed, chunk-size-aligned blocks, as before (the
volume's chunking). A zip archive written front to back, which is what `torch.save`
writes, gets a cut at each of its entries (`ZipEntries`): each tensor's storage is an
entry, so an unchanged tensor is cut into the same chunks whatever its neighbours did,
and a step that changes 2 of 20 tensors stores those two, not the chunks they share with
their neighbours (with fixed 4 MiB chunks a changed tensor dragged up to two neighbouring
chunks along: 1.4-1.7x the changed bytes).

Cuts are only ever added at or past the end of what the file holds (the entry parser runs
on appends before their bytes are placed), so a cut never splits a block that holds data:
whatever the layout, a block is a plain byte range and the extents stay exact. Entries
smaller than ENTRY_MIN are grouped with the entries after them (a zip's tiny records,
byte order and version, do not each become a chunk). A file opened again takes its cuts
from its committed extents (`Layout.of_extents`), so a rewrite in place cuts the same
chunks as the first write did.
"""

from __future__ import annotations

import bisect
import struct

from metadata.engine import Extent

ENTRY_MIN = 16 * 1024  # a cut at an entry needs this many bytes since the previous cut
ZIP_LOCAL = b"PK\x03\x04"  # a zip local file header: an entry starts
_ENDS = (b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06")  # central directory, end records
_DESC = b"PK\x07\x08"  # a data descriptor: the sizes of an entry written as a stream
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # signature .. extra length: 30 bytes
_ZIP64_EXTRA = 0x0001


class Layout:
    """Block boundaries of one file: its cuts, and the chunk size between them."""

    __slots__ = ("bs", "cuts")

    def __init__(self, bs: int, cuts: list[int] | None = None) -> None:
        self.bs = bs
        self.cuts = cuts if cuts else [0]

    @classmethod
    def of_extents(cls, bs: int, extents: list[Extent]) -> Layout:
        """The cuts a committed file was written with: every extent that starts a chunk
        (chunk offset 0) off the grid of the cut before it. An aligned file has none."""
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

    def cut_entry(self, at: int) -> bool:
        """Cut where an entry starts (past every cut so far: cuts come from appends),
        unless the entries since the last cut are too small to be a chunk of their own
        (ENTRY_MIN): then they are grouped with this one. Returns whether it cut."""
        if at - self.cuts[-1] < ENTRY_MIN:
            return False
        self.cuts.append(at)
        return True

    def clip(self, size: int) -> None:
        """Forget the cuts past a truncated file's end."""
        while len(self.cuts) > 1 and self.cuts[-1] > size:
            self.cuts.pop()


class ZipEntries:
    """The entry boundaries of a zip archive written front to back, found as it arrives.

    `feed(off, data)` takes each append in order and returns the offsets where entries
    (and, at the end, the central directory) start in the stream, for the layout to cut
    at. It gives up for good (`done`) on anything else: a write that is not the next
    append, bytes that are not a zip record where one must be, the central directory.

    An entry's length is in its local header, or, when the archive is written as a stream
    (flag bit 3; torch.save's writer does this), only in the data descriptor after its
    data. Scanning every byte for the descriptor's signature (`bytes.find` of its four
    bytes) ran at 1.6 GB/s on this machine, too slow beside the serving thread; its last
    two bytes, b"\\x07\\x08", are found at ~15 GB/s, and their false hits (one in 64 KiB of
    random data) are checked here. A candidate counts only if its size field equals the
    bytes since the entry's data began and a zip record follows it: a chance match would
    need 64 bits to agree.
    """

    __slots__ = ("fed", "state", "at", "data_start", "tail", "tail_off", "done")

    HEADER = 0  # a local header (or the central directory) expected at `at`
    SKIP = 1  # inside an entry whose header gave its size: the next header at `at`
    DESC = 2  # inside a streamed entry: its descriptor is at `at` or later

    def __init__(self) -> None:
        self.fed = 0  # the stream so far: the next append starts here
        self.state = self.HEADER
        self.at = 0
        self.data_start = 0
        self.tail = b""  # stream bytes [tail_off, fed) a record not complete yet needs
        self.tail_off = 0
        self.done = False

    def feed(self, off: int, data: bytes) -> list[int]:
        if self.done:
            return []
        if off != self.fed:
            self.done = True
            return []
        found: list[int] = []
        try:
            self._parse(off, data, found)
        except (struct.error, ValueError):
            self.done = True
        self.fed = off + len(data)
        if not self.done:  # keep what an unfinished record needs (at most ~128 KiB)
            keep = self.at if self.state != self.SKIP else self.fed
            keep = min(max(keep, self.tail_off), self.fed)
            if keep < off:
                self.tail = self.tail[keep - self.tail_off :] + data
            else:
                self.tail = bytes(data[keep - off :])
            self.tail_off = keep
        return found

    def _get(self, off: int, data: bytes, lo: int, hi: int) -> bytes | None:
        """Stream bytes [lo, hi) from the tail and this append; None if not all here."""
        if hi > off + len(data):
            return None
        if lo >= off:
            return data[lo - off : hi - off]
        head = self.tail[lo - self.tail_off : hi - self.tail_off]
        return head if hi <= off else head + data[: hi - off]

    def _parse(self, off: int, data: bytes, found: list[int]) -> None:
        end = off + len(data)
        while True:
            if self.state == self.SKIP:
                if self.at >= end:
                    return
                self.state = self.HEADER
            if self.state == self.HEADER:
                at = self.at
                head = self._get(off, data, at, at + _LOCAL.size)
                sig = head[:4] if head is not None else self._get(off, data, at, at + 4)
                if sig is None:
                    return
                if sig in _ENDS:  # the central directory: no more entries
                    found.append(at)
                    self.done = True
                    return
                if sig != ZIP_LOCAL:
                    self.done = True
                    return
                if head is None:
                    return
                _, _, flags, _, _, _, _, csize, usize, nlen, elen = _LOCAL.unpack(head)
                full = self._get(off, data, at, at + _LOCAL.size + nlen + elen)
                if full is None:
                    return
                found.append(at)
                self.data_start = at + len(full)
                if flags & 0x8:  # the sizes follow the data, in a descriptor
                    self.state, self.at = self.DESC, self.data_start
                else:
                    if csize == 0xFFFFFFFF:
                        csize = _zip64_size(full[_LOCAL.size + nlen :], usize)
                    self.state, self.at = self.SKIP, self.data_start + csize
                continue
            if not self._descriptor(off, data):
                return

    def _descriptor(self, off: int, data: bytes) -> bool:
        """Find the current entry's descriptor from `at` on: True when found (the state
        moves to the record after it); False when it is not in what arrived so far (`at`
        stays where the search must go on)."""
        end = off + len(data)
        # pairs b"\x07\x08" at stream offset s: a descriptor would start at s - 2. Those
        # starting below `off` are looked for across the seam with the tail.
        seam_lo = max(self.at + 2, self.tail_off)
        if seam_lo < off:
            seam = self.tail[seam_lo - self.tail_off :] + data[:1]
            s = seam.find(b"\x07\x08")
            while s != -1:
                got = self._check(off, data, seam_lo + s - 2)
                if got is not None:
                    return got
                s = seam.find(b"\x07\x08", s + 1)
        k = data.find(b"\x07\x08", max(0, self.at + 2 - off))
        while k != -1:
            got = self._check(off, data, off + k - 2)
            if got is not None:
                return got
            k = data.find(b"\x07\x08", k + 1)
        self.at = max(self.at, end - 3)  # a signature split by the end of this append
        return False

    def _check(self, off: int, data: bytes, q: int) -> bool | None:
        """Is the current entry's descriptor at q? True: yes (moved past it); False: maybe,
        the rest of it has not arrived (the search resumes at q); None: no."""
        n = q - self.data_start
        if n < 0:
            return None
        for size, fmt in ((16, "<4sIII"), (24, "<4sIQQ")):
            rec = self._get(off, data, q, q + size + 4)
            if rec is None:
                self.at = q
                return False
            sig, _, csize, _ = struct.unpack(fmt, rec[:size])
            if sig != _DESC:
                return None
            if csize == n and rec[size:] in _RECORDS:
                self.state, self.at = self.HEADER, q + size
                return True
        return None


_RECORDS = (ZIP_LOCAL, *_ENDS)


def _zip64_size(extra: bytes, usize: int) -> int:
    """The compressed size from a local header's zip64 extra field."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == _ZIP64_EXTRA:
            i = 8 if usize == 0xFFFFFFFF else 0  # the original size first, if it overflowed
            return struct.unpack_from("<Q", extra, pos + 4 + i)[0]
        pos += 4 + n
    raise ValueError("zip64 entry without its extra field")
