"""The host read cache of the write-behind tier, with single-flight across processes.

Cached chunk objects live in `STAGING/cache/<hex>` (already encoded, verified on every read,
so a torn or corrupt file is dropped and refetched, never returned; hence no fsync). Entries
are evicted oldest-mtime first (reads touch the mtime: an LRU that every process sharing the
directory sees). Single-flight: a fetch holds an flock on one of `STRIPES` lock files picked
by the chunk id, so N processes reading the same cold chunk fetch it from the nodes once; the
others wait on the lock and then find it in the cache. Stripes (not one lock file per chunk)
keep the lock directory bounded and avoid the unlink-while-locked race.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from chunkstore import codec
from chunkstore.fileio import temp_path, write_new
from chunkstore.ids import chunk_id, id_hasher

log = logging.getLogger("ckptfs.cache")

STRIPES = 4096
EVICT_BATCH = 4096  # entries one eviction scan keeps as candidates (ChunkCache.evict)
EVICT_LIST_S = 5.0  # ... for at most this long


MAP_MIN = 256 * 1024  # raw objects at least this big are mapped, not read
# read_object_into reads and hashes a window at a time: the hash then reads the bytes from the
# L2 the kernel's copy just left them in, not from memory. Measured on this project's 2-core
# host, pread + xxh3 of a page-cached 4 MiB object: 3.45 GB/s in one read, 4.25 GB/s in
# 256 KiB windows (1 MiB: 3.8; 128 KiB: 4.15, the syscalls start to cost).
VERIFY_WINDOW = 256 * 1024


def read_object(path: str, fast: bool = False) -> bytes | memoryview:
    """Read and decode the chunk object at `path` (FileNotFoundError, ChunkFormatError).

    fast=True is for callers that check the chunk id of what they get (every read path here
    does): a raw (uncompressed) object's payload is returned as a view of the file mapped
    into memory (its page-cache pages: no copy, no fresh buffer to fault in), so a DCP load
    copies each byte once, into its tensor. Profiled: 8 ranks reading 4 MiB objects with
    read() spent most of the load copying and faulting in new buffers. The mapping is
    private and writable, so torch can wrap it without a read-only warning; nothing writes
    to it (a write would only copy that page). No MAP_POPULATE: on a writable private
    mapping it breaks copy-on-write, i.e. copies every page; WILLNEED reads ahead instead.
    Mapping is safe because objects are immutable once renamed into place (tmp + rename;
    eviction unlinks, which leaves a mapping valid), so the file never shrinks under the
    view. The payload checksum is skipped: the id check hashes the very same bytes.
    Small or compressed objects are read and decoded as before."""
    with open(path, "rb") as f:
        if not fast:
            return codec.decode(f.read())
        head = f.read(codec.HEADER)
        version, name, raw_len = codec.header_info(head)
        if name != "none" or version != codec.VERSION:
            return codec.decode(head + f.read())
        size = os.fstat(f.fileno()).st_size
        if size != codec.HEADER + raw_len:
            raise codec.ChunkFormatError(
                f"raw payload is {size - codec.HEADER} bytes, header says {raw_len}"
            )
        if raw_len < MAP_MIN:
            return f.read()
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    m.madvise(mmap.MADV_WILLNEED)
    return memoryview(m)[codec.HEADER :]


# preadv2's RWF_NOWAIT: read only what the page cache holds (EAGAIN otherwise, having started
# the read-ahead). None where the platform has no such flag: then nothing is memory-only.
_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def read_object_into(
    path: str, views: list[memoryview], cid: bytes, seed: int, *, nowait: bool = False
) -> bool:
    """Read a raw object's payload straight into `views` (whose lengths sum to it) and check
    it against `cid`. False when the object is missing, compressed, of another length or
    unreadable; ChunkFormatError when its content does not match the id. Either way the
    caller takes the decoding read next, which replaces a bad copy.

    Why: a DCP load into preallocated tensors then costs one copy per byte, made by the
    kernel, with no mapping to fault in and tear down and no buffer in between. The views
    may be partly overwritten before a False.

    nowait=True: only from memory. BlockingIOError when a byte of the object would have to
    come from the disk (or the filesystem cannot tell): a batch reader reads what is in the
    page cache on its own thread and hands the rest to its pool (batch.read_many)."""
    if nowait and _NOWAIT is None:
        raise BlockingIOError("no memory-only reads on this platform")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return _read_into(fd, views, cid, seed, _NOWAIT if nowait else 0)
    except OSError as e:  # the decoding read meets the same error and reports it
        if nowait and isinstance(e, BlockingIOError):
            raise
        if nowait and e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            raise BlockingIOError(f"no memory-only reads here: {e}") from None
        log.debug("direct read of %s failed: %s", path, e)
        return False
    finally:
        os.close(fd)


def _read_fully(fd: int, buf: memoryview, pos: int, flags: int) -> int:
    """Fill `buf` from `pos`, over short reads, until full or the end of the file; returns
    the bytes read. With RWF_NOWAIT a short read means "not all in memory": BlockingIOError."""
    done = 0
    while done < buf.nbytes:
        got = os.preadv(fd, [buf[done:]], pos + done, flags)
        if flags and done + got < buf.nbytes:
            raise BlockingIOError("only part of the object is in memory")
        if got <= 0:
            break
        done += got
    return done


def _read_into(fd: int, views: list[memoryview], cid: bytes, seed: int, flags: int = 0) -> bool:
    if len(views) == 1 and views[0].nbytes <= VERIFY_WINDOW:
        got = _read_small_into(fd, views[0], cid, seed, flags)
        if got is not None:
            return got
    total = sum(v.nbytes for v in views)
    head = bytearray(codec.HEADER)
    if _read_fully(fd, memoryview(head), 0, flags) < codec.HEADER:
        return False
    if not _raw_of_length(head, total):
        return False
    if os.fstat(fd).st_size != codec.HEADER + total:
        return False
    h = id_hasher(seed)
    pos = codec.HEADER
    for v in views:
        for at in range(0, v.nbytes, VERIFY_WINDOW):
            win = v[at : at + VERIFY_WINDOW]
            if _read_fully(fd, win, pos, flags) < win.nbytes:
                return False  # the file ended early: torn
            h.update(win)  # hashed while the bytes just read are still in the L2
            pos += win.nbytes
    if h.digest() != cid:
        raise codec.ChunkFormatError("content does not match its chunk id")
    return True


def _read_small_into(
    fd: int, view: memoryview, cid: bytes, seed: int, flags: int = 0
) -> bool | None:
    """An object that fits one verify window, in one preadv: header, payload and one byte
    past the end (which must not exist), so a load of many small chunks pays one read per
    chunk instead of a header read, a size check and the payload read. None when the read
    came up short (a torn object, or a filesystem giving short reads): the caller's
    general path then decides; with RWF_NOWAIT, BlockingIOError (the blocking read that
    follows tells a torn object from one not yet in memory)."""
    head, past = bytearray(codec.HEADER), bytearray(1)
    want = codec.HEADER + view.nbytes
    got = os.preadv(fd, [head, view, past], 0, flags)
    if got < want:
        if flags:
            raise BlockingIOError("only part of the object is in memory")
        return None
    if got > want or not _raw_of_length(head, view.nbytes):  # overlong, or not raw
        return False
    h = id_hasher(seed)
    h.update(view)
    if h.digest() != cid:
        raise codec.ChunkFormatError("content does not match its chunk id")
    return True


def _raw_of_length(head: bytes | bytearray, total: int) -> bool:
    """Whether an object's header announces an uncompressed payload of `total` bytes."""
    try:
        version, name, raw_len = codec.header_info(head)
    except codec.ChunkFormatError:
        return False
    return name == "none" and version == codec.VERSION and raw_len == total


class ChunkCache:
    def __init__(self, root: str, seed: int) -> None:
        self.root = root
        self.seed = seed
        self.dir = os.path.join(root, "cache")
        self.tmp = os.path.join(root, "tmp")
        self.locks = os.path.join(root, "locks")
        for d in (self.dir, self.tmp, self.locks):
            os.makedirs(d, exist_ok=True)
        self._flights: dict[bytes, Future[bytes]] = {}
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._candidates: list[tuple[int, str]] = []  # (mtime_ns, path), oldest last
        self._scanned_at = 0.0  # monotonic time of the scan that made _candidates
        self.hits = 0
        self.misses = 0

    def path(self, cid: bytes) -> str:
        return os.path.join(self.dir, cid.hex())

    def read_verified(self, path: str, cid: bytes, view: bool = False) -> bytes | None:
        """Raw bytes of the object at `path` if it is there and good; a bad file is removed.

        view=True: the fast read of `read_object` (the id is checked right here)."""
        try:
            raw = read_object(path, view)
            if chunk_id(raw, self.seed) != cid:
                raise codec.ChunkFormatError("content does not match its chunk id")
        except FileNotFoundError:
            return None
        except codec.ChunkFormatError as e:
            log.warning("dropping bad cached chunk %s: %s", cid.hex(), e)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        return raw

    def lookup(self, cid: bytes, view: bool = False) -> bytes | None:
        p = self.path(cid)
        raw = self.read_verified(p, cid, view)
        if raw is not None:
            try:
                os.utime(p)  # LRU touch
            except OSError:
                pass
        return raw

    def add(self, cid: bytes, blob: bytes) -> int:
        """Cache an encoded object (temp + rename; no fsync: reads verify). Returns bytes added."""
        tmp = temp_path(self.tmp, "c")
        try:
            write_new(tmp, blob, sync=False)
            os.rename(tmp, self.path(cid))
        except OSError as e:
            log.warning("could not cache chunk %s: %s", cid.hex(), e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return 0
        return len(blob)

    def evict(self, need: int) -> int:
        """Delete least recently used entries until `need` bytes are freed; returns freed.

        Why the candidate list: once the tier's budget is full every put evicts about one
        chunk, and a scan of the directory (a stat per entry) for each of them made a save
        into a warm staging dir quadratic. 1 GiB through the mount went from ~850 to
        ~300 MB/s, the puts' threads spending 3 CPU-s in scans. One scan now keeps its
        oldest entries (up to `EVICT_BATCH` of them) and later calls take from those,
        one stat and one unlink each, until they run out or are `EVICT_LIST_S` old. An
        entry read since the scan (a newer mtime: the LRU touch) is skipped, so it stays.
        Entries added since are mostly newer, but an uploaded chunk is renamed in from
        staged/ with the mtime of its staging, so the list is rebuilt every few seconds
        to take those in their turn."""
        if need <= 0:
            return 0
        freed = 0
        with self._evict_lock:
            rescanned = False
            while freed < need:
                stale = time.monotonic() - self._scanned_at > EVICT_LIST_S
                if not self._candidates or (stale and not rescanned):
                    if rescanned:
                        break  # nothing left to evict
                    self._candidates = self._scan_oldest()
                    self._scanned_at = time.monotonic()
                    rescanned = True
                    continue
                mtime_ns, p = self._candidates.pop()
                try:
                    st = os.stat(p)
                    if st.st_mtime_ns != mtime_ns:
                        continue  # read since the scan: recently used, the next scan sees it
                    os.unlink(p)
                except FileNotFoundError:
                    continue  # evicted or dropped by another process
                freed += st.st_size
        return freed

    def _scan_oldest(self) -> list[tuple[int, str]]:
        """The directory's oldest entries, newest first (so `pop()` takes the oldest)."""
        entries = []
        with os.scandir(self.dir) as it:
            for e in it:
                try:
                    entries.append((e.stat().st_mtime_ns, e.path))
                except FileNotFoundError:
                    continue
        return heapq.nsmallest(EVICT_BATCH, entries)[::-1]

    def single_flight(self, cid: bytes, fetch: Callable[[], bytes]) -> bytes:
        """Run `fetch` for `cid` once per host at a time: threads share one future,
        processes share a striped flock; whoever waited rechecks the cache first."""
        with self._lock:
            fut = self._flights.get(cid)
            owner = fut is None
            if owner:
                fut = self._flights[cid] = Future()
        if not owner:
            return fut.result()
        try:
            raw = self._locked(cid, fetch)
        except BaseException as e:
            fut.set_exception(e)
            raise
        else:
            fut.set_result(raw)
            return raw
        finally:
            with self._lock:
                self._flights.pop(cid, None)

    def _locked(self, cid: bytes, fetch: Callable[[], bytes]) -> bytes:
        stripe = int.from_bytes(cid[:4], "little") % STRIPES
        fd = os.open(os.path.join(self.locks, f"{stripe:03x}"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = time.monotonic() - t0
            raw = self.lookup(cid)
            if raw is not None:
                self.hits += 1
                if waited > 0.001:
                    log.debug("chunk %s fetched by another reader", cid.hex())
                return raw
            self.misses += 1
            return fetch()  # the fetcher caches the object before the lock is released
        finally:
            os.close(fd)  # releases the flock
