"""The write-behind tier's journal: one append-only segment per process.

Records are fixed-size (kind, chunk id, stored size, time) with a CRC each; an I record
carries a small chunk's bytes after its header. P: pending (staged, fsync'd), I: pending
with its bytes, U: uploaded but its file not yet committed, D: done (on R nodes, marked
durable). Concurrent writers share fsyncs (GroupSync: one fsync acknowledges every record
written before it). A segment is compacted when it holds COMPACT_BYTES of records, and is
adopted by another process when its owner dies (chunkstore.tier.recover)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import xxhash

from chunkstore.fileio import (
    fdatasync_path,
    fsync_dir,
    rename_noreplace,
    write_all,
)

log = logging.getLogger("ckptfs.tier")

_REC = struct.Struct("<B3x16sQQ")  # kind, chunk id, stored size, time_ns
_CRC = struct.Struct("<I")
REC_SIZE = _REC.size + _CRC.size  # 40
ACTIVE_FILE = "foreground"  # status/foreground: mtime = last foreground put on this host
KIND_PENDING, KIND_UPLOADED, KIND_DONE = ord("P"), ord("U"), ord("D")
KIND_INLINE = ord("I")  # pending, with the chunk's bytes after the header (size of them)
INLINE_MAX = 64 * 1024  # chunks up to this size put unsynced are journaled with their bytes
INLINE_HELD_MAX = 32 * 2**20  # bytes of them held in memory until sync_staged; then fsync
COMPACT_BYTES = 8 * 2**20  # rewrite a segment once it holds this many bytes of records
SEGMENT_SUFFIX = ".jnl"


def pack_record(kind: int, cid: bytes, size: int = 0, t_ns: int = 0, payload: bytes = b"") -> bytes:
    body = _REC.pack(kind, cid, size, t_ns) + payload
    return body + _CRC.pack(xxhash.xxh32_intdigest(body))


def pack_inline(cid: bytes, payload: bytes, t_ns: int) -> bytes:
    """An I record: a P record that carries the staged object itself, checksummed whole."""
    return pack_record(KIND_INLINE, cid, len(payload), t_ns, payload)


@dataclass
class SegmentState:
    pending: dict[bytes, tuple[int, int]]  # cid -> (size, staged time_ns): to upload
    uploaded: dict[bytes, int]  # on the nodes, not yet marked durable in the metadata
    done: dict[bytes, int]  # cid -> time_ns of its D (or U) record
    records: int
    torn: bool  # a partial or corrupt tail was ignored
    inline: dict[bytes, bytes] = field(default_factory=dict)  # pending from I records: bytes
    corrupt: int = 0  # damaged runs in the middle, skipped (the records after them are kept)
    skipped: int = 0  # bytes in those runs


_KINDS = (KIND_PENDING, KIND_INLINE, KIND_UPLOADED, KIND_DONE)


def _record_at(data: bytes, off: int) -> tuple[int, bytes, int, int, int] | None:
    """(kind, cid, size, time_ns, end of body) of a whole, checksummed record at `off`."""
    if len(data) - off < REC_SIZE:
        return None
    kind, cid, size, t_ns = _REC.unpack_from(data, off)
    if kind not in _KINDS:
        return None
    body_end = off + _REC.size + (size if kind == KIND_INLINE else 0)
    if kind == KIND_INLINE and (size > INLINE_MAX or body_end + _CRC.size > len(data)):
        return None
    (crc,) = _CRC.unpack_from(data, body_end)
    if xxhash.xxh32_intdigest(data[off:body_end]) != crc:
        return None
    return kind, cid, size, t_ns, body_end


def parse_segment(data: bytes) -> SegmentState:
    """Replay a segment. A record that does not check out is skipped up to the next one
    that does: in the middle (a damaged sector) the records after it are kept and counted
    in `corrupt`; at the end (a crash mid-append) it is a torn tail. A damaged run used to
    end the replay, losing every record after it."""
    st = SegmentState({}, {}, {}, 0, False)
    off, end = 0, len(data)
    while off < end:
        rec = _record_at(data, off)
        if rec is None:
            nxt = next((o for o in range(off + 1, end - REC_SIZE + 1) if _record_at(data, o)), None)
            if nxt is None:
                st.torn = True
                break
            st.corrupt += 1
            st.skipped += nxt - off
            off = nxt
            continue
        kind, cid, size, t_ns, body_end = rec
        if kind in (KIND_PENDING, KIND_INLINE):
            st.pending[cid] = (size, t_ns)
            st.uploaded.pop(cid, None)
            st.done.pop(cid, None)
            if kind == KIND_INLINE:
                st.inline[cid] = bytes(data[off + _REC.size : body_end])
            else:
                st.inline.pop(cid, None)
        else:
            st.pending.pop(cid, None)
            st.inline.pop(cid, None)
            if kind == KIND_UPLOADED:
                st.uploaded[cid] = t_ns
            else:
                st.uploaded.pop(cid, None)
            st.done[cid] = t_ns
        st.records += 1
        off = body_end + _CRC.size
    return st


def read_segment(path: str) -> SegmentState:
    with open(path, "rb") as f:
        return parse_segment(f.read())


class GroupSync:
    """Group commit: `sync()` returns once an fsync that started after the call finished.

    Concurrent callers share one fsync instead of queueing one each."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._cond = threading.Condition()
        self._requested = 0
        self._synced = 0
        self._running = False
        self._retired = False
        self.fsyncs = 0

    def sync(self) -> None:
        with self._cond:
            self._requested += 1
            mine = self._requested
            while self._synced < mine and not self._retired:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                target = self._requested
                self._cond.release()
                try:
                    self._fn()
                    ok = True
                finally:
                    self._cond.acquire()
                    self._running = False
                    self._cond.notify_all()
                if ok:
                    self._synced = max(self._synced, target)
                    self.fsyncs += 1

    def retire(self, close: Callable[[], None]) -> None:
        """From now on every sync returns at once, and `close` runs as soon as no fsync is
        running. For a replaced file whose records are durable elsewhere (a compacted
        segment holds every live record of the old one, fsync'd before the swap)."""
        with self._cond:
            self._retired = True
            while self._running:
                self._cond.wait()
            close()
            self._cond.notify_all()


class Segment:
    """This process's journal segment: flock'd for its lifetime, appended with group fsync.

    It tracks its own live (P, I or U without D) records, so compaction can rewrite exactly
    them under the append lock without racing a concurrent writer; for I records it keeps
    where they are, to copy their bytes from this file and from nowhere else."""

    def __init__(self, journal_dir: str, name: str) -> None:
        self.dir = journal_dir
        self.name = name
        self.path = os.path.join(journal_dir, name)
        self.fd = self._open_locked(self.path)
        fsync_dir(journal_dir)
        self._lock = threading.Lock()
        self._sync = GroupSync(lambda: os.fsync(self.fd))
        self.live: dict[bytes, tuple[int, int, int]] = {}  # cid -> (kind, size, time_ns)
        self._inline_at: dict[bytes, tuple[int, int]] = {}  # live I record: (offset, length)
        self.live_bytes = 0  # what a compaction would write
        self.size = 0

    @staticmethod
    def _open_locked(path: str) -> int:
        """Create the segment already locked: made under a name adopters ignore, locked, then
        renamed into place. (Created in place, a tier starting at the same moment could see
        an unlocked segment, take it for a dead process's and adopt it.)"""
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.init"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd

    @property
    def fsyncs(self) -> int:
        return self._sync.fsyncs

    def _append(self, data: bytes) -> GroupSync:
        """Append whole records (under _lock). A failed write (a full disk) is cut off
        again: a fragment left in the file would hide every later record from a replay,
        and put the offsets of I records out of step."""
        try:
            write_all(self.fd, data)
        except BaseException:
            os.ftruncate(self.fd, self.size)
            raise
        self.size += len(data)
        return self._sync

    def _forget(self, cid: bytes) -> None:
        """Drop a live record's accounting (under _lock)."""
        old = self.live.pop(cid, None)
        if old is not None:
            at = self._inline_at.pop(cid, None)
            self.live_bytes -= at[1] if at else REC_SIZE

    def add_pending(
        self, items: list[tuple[bytes, int, int]], inline: dict[bytes, bytes] | None = None
    ) -> None:
        """Journal (cid, size, time_ns) as staged, those in `inline` with their bytes (an
        I record: their staged files need not be durable); returns once on disk."""
        inline = inline or {}
        recs = [
            pack_inline(c, inline[c], t) if c in inline else pack_record(KIND_PENDING, c, s, t)
            for c, s, t in items
        ]
        with self._lock:
            at = self.size
            sync = self._append(b"".join(recs))
            for (c, s, t), rec in zip(items, recs, strict=True):
                self._forget(c)
                self.live[c] = (KIND_INLINE if c in inline else KIND_PENDING, s, t)
                if c in inline:
                    self._inline_at[c] = (at, len(rec))
                self.live_bytes += len(rec)
                at += len(rec)
        sync.sync()

    def add_done(self, ids: list[bytes], kind: int = KIND_DONE) -> None:
        """Journal chunks as done (D) or as uploaded but not yet marked durable (U)."""
        t_ns = time.time_ns()
        data = b"".join(pack_record(kind, c, 0, t_ns) for c in ids)
        with self._lock:
            sync = self._append(data)
            for c in ids:
                self._forget(c)
                if kind != KIND_DONE:
                    self.live[c] = (kind, 0, t_ns)
                    self.live_bytes += REC_SIZE
        sync.sync()

    def compact(self) -> None:
        """Replace the segment by its live records, atomically and keeping ownership: the new
        file is locked before it is renamed over the old one. A writer still waiting on the
        old file's fsync is released (its record is in the new file, fsync'd here). A live
        I record is copied from this file as it is, and checked: its bytes are the only
        durable copy of its chunk."""
        with self._lock:
            recs: list[bytes] = []
            inline_at: dict[bytes, tuple[int, int]] = {}
            at = 0
            for c, (k, s, t) in self.live.items():
                if k == KIND_INLINE:
                    off, n = self._inline_at[c]
                    rec = os.pread(self.fd, n, off)
                    if parse_segment(rec).inline.get(c) is None:
                        raise OSError(errno.EIO, f"journal {self.path}: record of {c.hex()} at "
                                      f"{off} no longer reads back")  # fmt: skip
                    inline_at[c] = (at, n)
                else:
                    rec = pack_record(k, c, s, t)
                recs.append(rec)
                at += len(rec)
            data = b"".join(recs)
            tmp = self.path + ".new"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                write_all(fd, data)
                os.fsync(fd)
                os.rename(tmp, self.path)
            except BaseException:
                os.close(fd)
                raise
            # Renamed: the new file is the segment now, whatever happens next (closing it
            # would free its lock for another tier to adopt while we went on appending).
            # The old file is closed once no fsync of it runs: writers still waiting on it
            # have their records in the new file, fsync'd above. Kept open, every old fd
            # pinned its unlinked file's blocks, which the staging budget never saw.
            old_fd, old_sync = self.fd, self._sync
            self.fd, self.size = fd, len(data)
            self._inline_at, self.live_bytes = inline_at, len(data)
            self._sync = GroupSync(lambda: os.fsync(fd))
            old_sync.retire(lambda: os.close(old_fd))
            fsync_dir(self.dir)

    def close(self, *, remove: bool) -> None:
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)


def same_bytes(path: str, payload: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(payload) + 1) == payload
    except FileNotFoundError:
        return False


def place_inline(tmp: str, dst: str, payload: bytes) -> bool:
    """Put an inline chunk's temp file in place as `dst`, never over a file already there.
    If one is: the same bytes stay (our I record covers them) and ours goes; other bytes
    (garbage a power cut left of a file never journaled, or another valid encoding) are
    replaced by ours, made durable first, so a P record of another process naming `dst`
    never names a file that is not on disk. True when it replaced one (the caller fsyncs
    the directory)."""
    if rename_noreplace(tmp, dst):
        return False
    if same_bytes(dst, payload):
        os.unlink(tmp)
        return False
    fdatasync_path(tmp)
    os.rename(tmp, dst)
    return True


def open_segments(journal_dir: str, skip: str | None = None) -> Iterator[tuple[str, str, int]]:
    """(name, path, read-only fd) of each journal segment in the directory but `skip`, in
    name order; each fd is closed when the caller moves on. Segments that vanish meanwhile
    (adopted or compacted by another process) are passed over."""
    for name in sorted(os.listdir(journal_dir)):
        if not name.endswith(SEGMENT_SUFFIX) or name == skip:
            continue
        path = os.path.join(journal_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            yield name, path, fd
        finally:
            os.close(fd)
