"""Where a file written through the mount is cut into chunks: the hints.

The rule is the one every writer cuts by (chunkstore.chunker.Layout, the fixed rule in
random-access form); this module finds the mount's tensor-aligned cuts.

A file's blocks (the units the mount seals into chunks) start at each *cut* of the file
and then every chunk size after it, up to the next cut:

    cuts 0, c1, c2 ...   ->   blocks [0, bs) [bs, 2bs) ... [k*bs, c1) [c1, c1+bs) ...

An ordinary file has the one cut 0: fixed, chunk-size-aligned blocks, as before (the
volume's chunking). A zip archive written front to back, which is what `torch.save`
writes, is cut where each entry's data begins and ends (`ZipBoundaries`): each tensor's
storage is an entry, so an unchanged tensor maps to the same chunks whatever its
neighbours did, and a step that changes 2 of 20 tensors stores those two, not the chunks
they share with their neighbours (with fixed 4 MiB chunks a changed tensor dragged up to
two neighbouring chunks along: 1.4-1.7x the changed bytes). The bytes between two
entries' data (a data descriptor, the next local header with its name and padding) are a
small chunk of their own: they change with the CRC of the data and with the archive's
name, which torch.save takes from the file name (`step-100/data/0`), so data chunks that
held them would differ at every step. Entries seen to hold less than ENTRY_MIN bytes of
data get no cuts: they stay with the records around them (byte order, version, a step
counter).

How the boundaries are found without reading every byte on the serving thread
(`ZipBoundaries`): both of torch's writers write a big entry's data with a write() of its
own, and the descriptor after it starts the next write() (Python's BufferedWriter writes a
piece bigger than its buffer directly; torch's C++ writer hands its buffered header bytes
and the data over in one writev). So only the start of each write request is looked at:
a descriptor there ends an entry, a local header ending there begins one, and local
headers in the request's first HEAD_SCAN bytes (the buffered bytes the C++ writer sends
ahead of the data) begin others. Entries a writer buffers together with their neighbours
(Python's buffer is st_blksize, 1 MiB on the mount) are not found and stay with the
records around them. Scanning every byte for the descriptors of all entries instead cost
1 ms per MiB with `bytes.find` (0.36 with numpy): as much again as everything else the
serving thread does for a write.

A cut is made before the bytes at it are placed in a block (it is never below the
request that reveals it), so it never splits a block that holds data: whatever the
layout, a block is a plain byte range and the extents stay exact. A file opened again
takes its cuts from its committed extents (`Layout.of_extents`), so a rewrite in place
cuts the same chunks as the first write did.
"""

from __future__ import annotations

import struct

from chunkstore.chunker import Layout

__all__ = ["ENTRY_MIN", "HEAD_SCAN", "Layout", "ZIP_LOCAL", "ZipBoundaries"]

ENTRY_MIN = 64 * 1024  # entries seen to hold less data than this are not cut out
HEAD_SCAN = 16 * 1024  # bytes after a request's start searched for local headers
HEADER_BACK = 1024  # how far before a request's start its local header may begin
ZIP_LOCAL = b"PK\x03\x04"  # a zip local file header: an entry starts
_DESC = b"PK\x07\x08"  # a data descriptor: the sizes of an entry written as a stream
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # signature .. extra length: 30 bytes
_NAME_MAX = 1024


class ZipBoundaries:
    """The cuts of a zip archive written front to back, found at its write requests'
    starts (see the module's docstring): where big entries' data begins and ends.

    `feed(off, data)` takes each append in order and returns the cuts it reveals, all at
    or past `off`. A write that is not the next append ends it for good (`done`)."""

    __slots__ = ("fed", "tail", "done")

    def __init__(self) -> None:
        self.fed = 0  # the next append starts here
        self.tail = b""  # the last HEADER_BACK bytes before `fed`
        self.done = False

    def feed(self, off: int, data: bytes | memoryview) -> list[int]:
        if self.done:
            return []
        if off != self.fed:
            self.done = True
            return []
        head = bytes(data[: HEAD_SCAN + 1024])
        window, base = self.tail + head, off - len(self.tail)
        begins: set[int] = set()
        ends: set[int] = set()
        if head[:4] == _DESC:  # the entry before ends where this request starts
            ends.add(off)
        k = window.find(ZIP_LOCAL)
        while k != -1:
            h, k = base + k, window.find(ZIP_LOCAL, k + 1)
            ds = _data_start(window, h - base)
            if ds is None or (h < off and base + ds != off):
                continue  # before this request: only a header whose data begins with it
            begins.add(base + ds)
            for size in (16, 24):  # the descriptor of the entry before it
                q = h - size
                if q >= off and window[q - base : q - base + 4] == _DESC:
                    ends.add(q)
        self.fed = off + len(data)
        self.tail = (
            (self.tail + head)[-HEADER_BACK:]
            if len(data) < HEADER_BACK
            else bytes(data[-HEADER_BACK:])
        )
        return _grouped(sorted(begins), sorted(ends), off)


def _grouped(begins: list[int], ends: list[int], off: int) -> list[int]:
    """The cuts: every data start and end found, except both ends of an entry seen to hold
    less than ENTRY_MIN (it stays with the records around it), and any below `off`."""
    cuts: set[int] = set()
    for b in begins:
        e = next((x for x in ends if x > b), None)
        if e is None or e - b >= ENTRY_MIN:
            cuts.add(b)
    for e in ends:
        b = max((x for x in begins if x < e), default=None)
        if b is None or e - b >= ENTRY_MIN:
            cuts.add(e)
    return sorted(c for c in cuts if c >= off)


def _data_start(buf: bytes, h: int) -> int | None:
    """Where the data of the entry whose local header is at buf[h] begins (in buf), if a
    plausible local header is there whole (an ASCII name of sane length, stored or
    deflated, the flag bits zip writers use)."""
    if h + _LOCAL.size > len(buf):
        return None
    sig, _, flags, method, _, _, _, _, _, nlen, elen = _LOCAL.unpack_from(buf, h)
    if sig != ZIP_LOCAL or method not in (0, 8) or not 0 < nlen <= _NAME_MAX or flags & 0xF7F0:
        return None
    name = buf[h + _LOCAL.size : h + _LOCAL.size + nlen]
    if len(name) < nlen or not all(0x20 <= c < 0x7F for c in name):
        return None
    return h + _LOCAL.size + nlen + elen
