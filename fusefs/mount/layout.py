"""Where a file written through the mount is cut into chunks.

A file's blocks (the units the mount seals into chunks) start at each *cut* of the file
and then every chunk size after it, up to the next cut:

    cuts 0, c1, c2 ...   ->   blocks [0, bs) [bs, 2bs) ... [k*bs, c1) [c1, c1+bs) ...

An ordinary file has the one cut 0: fixed, chunk-size-aligned blocks, as before (the
volume's chunking). A zip archive written front to back, which is what `torch.save`
writes, is cut where each entry's data begins and ends (`ZipEntries`): each tensor's
storage is an entry, so an unchanged tensor maps to the same chunks whatever its
neighbours did, and a step that changes 2 of 20 tensors stores those two, not the chunks
they share with their neighbours (with fixed 4 MiB chunks a changed tensor dragged up to
two neighbouring chunks along: 1.4-1.7x the changed bytes). The bytes between two
entries' data (a data descriptor, the next local header with its name and padding) are a
small chunk of their own: they change with the CRC of the data and with the archive's
name, which torch.save takes from the file name (`step-100/data/0`), so data chunks that
held them would differ at every step. Entries with less than ENTRY_MIN bytes of data get
no cuts: they stay with the records around them (byte order, version, a step counter).

A cut is made before the bytes at it are placed in a block, or, when an entry turns out
big only after its first bytes were placed, by splitting the block that holds them while
it is still dirty (`FileCache._cut`); a block being stored is never split (the cut is then
skipped, which costs deduplication, not correctness). Whatever the layout, a block is a
plain byte range and the extents stay exact. A file opened again takes its cuts from its
committed extents (`Layout.of_extents`), so a rewrite in place cuts the same chunks as the
first write did.
"""

from __future__ import annotations

import bisect
import struct

from metadata.engine import Extent

ENTRY_MIN = 64 * 1024  # entries with less data than this are not cut out
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

    def cut(self, at: int) -> None:
        """A new cut, past every cut so far (cuts come from appends, in order)."""
        if at > self.cuts[-1]:
            self.cuts.append(at)

    def clip(self, size: int) -> None:
        """Forget the cuts past a truncated file's end."""
        while len(self.cuts) > 1 and self.cuts[-1] > size:
            self.cuts.pop()


class ZipEntries:
    """Where the data of a zip archive's entries begins and ends, found as it is written
    front to back: the cuts of its layout.

    `feed(off, data)` takes each append in order and returns the offsets to cut at: the
    start and the end of the data of every entry with at least ENTRY_MIN bytes of data.
    The start of an entry whose size only its descriptor tells (below) is returned once
    ENTRY_MIN of its bytes have arrived, so it may lie below `off`. The parser gives up for
    good (`done`) on anything else: a write that is not the next append, bytes that are not
    a zip record where one must be; and it is done at the central directory.

    An entry's length is in its local header, or, when the archive is written as a stream
    (flag bit 3; torch.save's writer does this), only in the data descriptor after its
    data. Scanning every byte for the descriptor's signature (`bytes.find` of its four
    bytes) ran at 1.6 GB/s on this machine, too slow beside the serving thread; its last
    two bytes, b"\\x07\\x08", are found at ~15 GB/s, and their false hits (one in 64 KiB of
    random data) are checked here. A candidate counts only if its size field equals the
    bytes since the entry's data began and a zip record follows it: a chance match would
    need 64 bits to agree.
    """

    __slots__ = ("fed", "state", "at", "data_start", "big", "tail", "tail_off", "done")

    HEADER = 0  # a local header (or the central directory) expected at `at`
    SKIP = 1  # inside an entry whose header gave its size: the next header at `at`
    DESC = 2  # inside a streamed entry: its descriptor is at `at` or later

    def __init__(self) -> None:
        self.fed = 0  # the stream so far: the next append starts here
        self.state = self.HEADER
        self.at = 0
        self.data_start = 0
        self.big = False  # the current streamed entry's start was returned as a cut
        self.tail = b""  # stream bytes [tail_off, fed) a record not complete yet needs
        self.tail_off = 0
        self.done = False

    def feed(self, off: int, data: bytes) -> list[int]:
        if self.done:
            return []
        if off != self.fed:
            self.done = True
            return []
        cuts: list[int] = []
        try:
            self._parse(off, data, cuts)
        except (struct.error, ValueError):
            self.done = True
        self.fed = end = off + len(data)
        if self.done:
            return cuts
        if self.state == self.DESC and not self.big and end - self.data_start >= ENTRY_MIN:
            cuts.append(self.data_start)  # a big streamed entry: cut where its data began
            self.big = True
        # keep what an unfinished record needs (at most ~128 KiB)
        keep = self.at if self.state != self.SKIP else end
        keep = min(max(keep, self.tail_off), end)
        if keep < off:
            self.tail = self.tail[keep - self.tail_off :] + data
        else:
            self.tail = bytes(data[keep - off :])
        self.tail_off = keep
        return cuts

    def _get(self, off: int, data: bytes, lo: int, hi: int) -> bytes | None:
        """Stream bytes [lo, hi) from the tail and this append; None if not all here."""
        if hi > off + len(data):
            return None
        if lo >= off:
            return data[lo - off : hi - off]
        head = self.tail[lo - self.tail_off : hi - self.tail_off]
        return head if hi <= off else head + data[: hi - off]

    def _parse(self, off: int, data: bytes, cuts: list[int]) -> None:
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
                if sig != ZIP_LOCAL:  # the central directory ends the entries; or not a zip
                    self.done = True
                    return
                if head is None:
                    return
                _, _, flags, _, _, _, _, csize, usize, nlen, elen = _LOCAL.unpack(head)
                full = self._get(off, data, at, at + _LOCAL.size + nlen + elen)
                if full is None:
                    return
                ds = self.data_start = at + len(full)
                if flags & 0x8:  # the sizes follow the data, in a descriptor
                    self.state, self.at, self.big = self.DESC, ds, False
                else:
                    if csize == 0xFFFFFFFF:
                        csize = _zip64_size(full[_LOCAL.size + nlen :], usize)
                    if csize >= ENTRY_MIN:
                        cuts += (ds, ds + csize)
                    self.state, self.at = self.SKIP, ds + csize
                continue
            desc = self._descriptor(off, data)
            if desc is None:
                return
            if self.big or desc - self.data_start >= ENTRY_MIN:
                if not self.big:
                    cuts.append(self.data_start)
                cuts.append(desc)

    def _descriptor(self, off: int, data: bytes) -> int | None:
        """The offset of the current entry's descriptor, if it is in what arrived (the
        state then moves to the record after it); else None, and `at` stays where the
        search must go on."""
        end = off + len(data)
        # pairs b"\x07\x08" at stream offset s: a descriptor would start at s - 2. Those
        # starting below `off` are looked for across the seam with the tail.
        seam_lo = max(self.at + 2, self.tail_off)
        searches = [(data, off, max(0, self.at + 2 - off))]
        if seam_lo < off:
            searches.insert(0, (self.tail[seam_lo - self.tail_off :] + data[:1], seam_lo, 0))
        for buf, base, start in searches:
            s = buf.find(b"\x07\x08", start)
            while s != -1:
                q = base + s - 2
                got = self._check(off, data, q)
                if got is not None:
                    return q if got else None
                s = buf.find(b"\x07\x08", s + 1)
        self.at = max(self.at, end - 3)  # a signature split by the end of this append
        return None

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
