"""WriteBehindTier: saves land on local disk, drain to the object nodes later.

The staging layout, the crash-safety argument and the ownership rules are in the package
docstring (chunkstore/tier/__init__.py); the journal format is journal.py, recovery of dead
processes' journals recover.py."""

from __future__ import annotations

import errno
import heapq
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

from chunkstore import codec
from chunkstore.cache import ChunkCache
from chunkstore.fileio import (
    dir_bytes,
    fdatasync_path,
    fsync_dir,
    open_syncfs,
    sync_filesystem,
    temp_path,
    write_new,
)
from chunkstore.ids import chunk_id
from chunkstore.nodes import NodeError
from chunkstore.store import ChunkStore, ChunkStoreError
from chunkstore.tier.journal import (
    ACTIVE_FILE,
    COMPACT_BYTES,
    INLINE_HELD_MAX,
    INLINE_MAX,
    KIND_UPLOADED,
    SEGMENT_SUFFIX,
    GroupSync,
    Segment,
    place_inline,
)
from chunkstore.tier.ranks import RankFiles
from chunkstore.tier.reads import StagingReads
from chunkstore.tier.recover import RECONCILE_AGE_S, Recovery

log = logging.getLogger("ckptfs.tier")

SYNCFS_MIN = 32  # files in one sync_staged from which one syncfs beats an fdatasync each
STAGED, DURABLE = 0, 1  # == metadata.engine.STAGED / DURABLE
DURABILITY = ("local", "remote")


def default_staging_dir(volume_uuid: str) -> str:
    """`$XDG_CACHE_HOME/ckptfs/staging/<volume uuid>`: per host, per volume."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptfs", "staging", volume_uuid)


def default_staging_size(path: str) -> int:
    """10% of the free space where staging lives, between 256 MiB and 64 GiB."""
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "."
    st = os.statvfs(probe)
    return max(256 * 2**20, min(64 * 2**30, st.f_bavail * st.f_frsize // 10))


def sync_files(paths: list[str], syncfs_fd: int | None) -> None:
    """Make written files durable: one fdatasync, one syncfs from SYNCFS_MIN files on (through
    `syncfs_fd`, fileio.open_syncfs), else an fdatasync each in parallel. Shared with
    HostStager, which syncs its rank's files the same way."""
    if len(paths) == 1:  # one big chunk: no pool to start for one fsync
        fdatasync_path(paths[0])
    elif len(paths) >= SYNCFS_MIN and syncfs_fd is not None:
        sync_filesystem(syncfs_fd)  # one call, not an fdatasync each
    elif paths:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(8, len(paths)), thread_name_prefix="ckptfs-sync") as ex:
            list(ex.map(fdatasync_path, paths))


def touch_activity(path: str) -> None:
    """Set the host-wide activity file's mtime to now (WriteBehindTier.foreground)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            with open(path, "a"):
                pass
        except OSError:
            pass
    except OSError:
        pass


class WriteBehindTier(Recovery, RankFiles, StagingReads):
    """Stage chunks on local disk (durability=local) or write through (remote); upload,
    mark durable, cache and serve reads. Blocking and thread safe; close() joins its threads."""

    def __init__(
        self,
        store: ChunkStore,
        staging_dir: str,
        *,
        size: int | None = None,
        durability: str = "local",
        on_durable: Callable[[list[bytes], list[int]], list[bytes]] | None = None,
        uploaders: int = 4,
        keep_cache: bool = True,
        stall_timeout: float = 120.0,
        register_timeout: float = 3600.0,
        mark_batch: int = 256,
        idle_s: float = 0.5,
        high_water: float = 0.5,
        max_defer_s: float = 30.0,
        transcode: Callable[[bytes, int | None], bytes] | None = None,
    ) -> None:
        if durability not in DURABILITY:
            raise ValueError(f"durability must be local or remote, not {durability!r}")
        if size is not None and size <= 0:
            raise ValueError(f"staging size must be positive, got {size}")
        if uploaders < 1:
            raise ValueError("the tier needs at least one uploader thread")
        self.store = store
        self.root = os.path.abspath(staging_dir)
        self.durability = durability
        self.on_durable = on_durable
        self.keep_cache = keep_cache
        self.stall_timeout = stall_timeout
        self.register_timeout = register_timeout
        self.mark_batch = mark_batch
        self.idle_s = idle_s
        self.high_water = high_water
        self.max_defer_s = max_defer_s
        self.transcode = transcode
        self.staged_dir = os.path.join(self.root, "staged")
        self.journal_dir = os.path.join(self.root, "journal")
        self.status_dir = os.path.join(self.root, "status")
        self.tmp_dir = os.path.join(self.root, "tmp")
        for d in (self.staged_dir, self.journal_dir, self.status_dir, self.tmp_dir):
            os.makedirs(d, exist_ok=True)
        self._syncfs_fd = open_syncfs(self.tmp_dir)  # for the tier's life (fileio.open_syncfs)
        self.budget = size if size is not None else default_staging_size(self.root)
        self.cache = ChunkCache(self.root, store.seed)
        self._dirsync = GroupSync(lambda: fsync_dir(self.staged_dir))
        self._fs_sync = GroupSync(self._syncfs)  # ranks' unsynced adopts (ranks.py)
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.seg = Segment(self.journal_dir, name + SEGMENT_SUFFIX)
        self.status_path = os.path.join(self.status_dir, name + ".json")
        self.active_path = os.path.join(self.status_dir, ACTIVE_FILE)

        self._cond = threading.Condition()
        self._pending: dict[bytes, tuple[int, int]] = {}  # journaled, not yet D
        self._queue: list[tuple[int, int, bytes]] = []  # (staged ns, seq, cid): oldest first
        self._seq = 0
        self._uploading: set[bytes] = set()
        self._to_mark: list[bytes] = []
        # uploaded, but the metadata does not know the chunk yet: (first try, last try)
        self._unregistered: dict[bytes, tuple[float, float]] = {}
        self._staging: dict[bytes, threading.Event] = {}
        # written to tmp/ without fsync (put(sync=False)): acknowledged by sync_staged();
        # (temp path, size, the object's bytes when it is small enough to journal inline)
        self._unsynced: dict[bytes, tuple[str, int, bytes | None]] = {}
        self._inline_held = 0  # bytes of those payloads
        self._hints: dict[bytes, int | None] = {}  # float width hint for transcode
        self._stored_lens: dict[bytes, int] = {}  # transcoded on upload: size on the nodes
        self._sync_lock = threading.Lock()
        self._last_put = 0.0  # monotonic time of this process's last foreground put
        self._busy_since = 0.0  # monotonic start of the current unbroken foreground stretch
        self._last_mark = 0.0  # wall time we last touched the host-wide activity file
        self._flushing = 0  # flush() callers waiting: drain regardless of foreground writes
        self._own_staged = 0  # bytes of our pending files
        self._reserved = 0  # reserved, not yet renamed into staged/
        self._used = 0  # estimate: staged/ + cache/ of every process + reserved
        # The part of _used that is cache/: evictable at any time, so it never calls for a
        # drain (a warm read cache of a full budget made the uploader compete with every save).
        self._cached = 0
        self._last_freed = time.monotonic()
        self._stop = threading.Event()
        self._mark_lock = threading.Lock()
        self.uploaded_chunks = 0
        self.uploaded_bytes = 0
        self.failures = 0
        self.last_error = ""
        self.lost = 0
        self.waits = 0  # writers that had to wait for space
        self.housekeeping_failures = 0  # passes that raised (logged, retried next pass)
        self._rate: deque[tuple[float, int]] = deque()
        self._born = time.monotonic()  # the upload rate averages over min(10 s, its age)
        self._rescan()
        self._clean_tmp()
        self.adopt_orphans()
        self.reconcile_staged()
        self._threads = [
            threading.Thread(target=self._upload_loop, name=f"ckptfs-upload-{i}", daemon=True)
            for i in range(uploaders)
        ]
        self._threads.append(
            threading.Thread(target=self._housekeep, name="ckptfs-tier", daemon=True)
        )
        for t in self._threads:
            t.start()
        self._write_status()

    # -- write path ---------------------------------------------------------------------------
    def put(
        self,
        cid: bytes,
        blob: bytes | list[bytes | memoryview],
        *,
        sync: bool = True,
        width: int | None = None,
    ) -> int:
        """Store an encoded chunk; STAGED once fsync'd + journaled here, DURABLE once on R nodes.

        With sync=False the chunk is only written (no fsync, no journal record) and is
        acknowledged by the next `sync_staged()`: a writer that commits many chunks at once
        pays one batch of fsyncs at commit instead of three fsyncs per chunk. `width` is
        the float width hint `transcode` gets at upload time. `blob` may be a list of
        buffers (the encoded object's parts, see codec.raw_parts), written out in order."""
        if self._stop.is_set():
            raise RuntimeError("write-behind tier is closed")
        self.foreground()
        if not sync and self.durability == "local":
            return self._put_unsynced(cid, blob, width)
        if isinstance(blob, list):
            blob = b"".join(blob)
        if self.durability == "remote":
            self.store.put_encoded(cid, blob)
            self._cache_if_room(cid, blob)
            return DURABLE
        if width is not None:
            self._hints[cid] = width
        while True:
            with self._cond:
                if cid in self._pending:
                    return STAGED
                if cid in self._unsynced:
                    ev = None  # written unsynced by another writer: acknowledge it now
                    break
                ev = self._staging.get(cid)
                if ev is None:
                    ev = self._staging[cid] = threading.Event()
                    break
            ev.wait()  # the same chunk is being staged by another thread: share its ack
        if ev is None:
            self.sync_staged()
            return STAGED
        try:
            self._stage(cid, blob)
        finally:
            with self._cond:
                self._staging.pop(cid, None)
            ev.set()
        return STAGED

    def _put_unsynced(
        self, cid: bytes, blob: bytes | list[bytes | memoryview], width: int | None
    ) -> int:
        """Write to tmp/ (named by our pid: a crash leaves only temp files _clean_tmp removes)."""
        with self._cond:
            if cid in self._pending or cid in self._unsynced:
                return STAGED
            ev = self._staging.get(cid)
        if ev is not None:
            ev.wait()
            with self._cond:
                if cid in self._pending or cid in self._unsynced:
                    return STAGED
        parts = [memoryview(p).cast("B") for p in (blob if isinstance(blob, list) else [blob])]
        n = sum(p.nbytes for p in parts)
        self._reserve(n)
        with self._cond:  # journaled with its bytes, while the held bytes stay bounded
            inline = n <= INLINE_MAX and self._inline_held + n <= INLINE_HELD_MAX
            if inline:
                self._inline_held += n
        payload = b"".join(parts) if inline else None
        tmp = temp_path(self.tmp_dir, "s")
        try:
            write_new(tmp, parts, sync=False, writeback=payload is None)
        except OSError as e:
            self._write_failed(cid, n, e)
            if payload is not None:
                with self._cond:
                    self._inline_held -= n
            raise
        with self._cond:
            if cid in self._unsynced or cid in self._pending:  # lost a race: keep the first
                self._reserved -= n
                self._used -= n
                if payload is not None:
                    self._inline_held -= n
                os.unlink(tmp)
                return STAGED
            self._unsynced[cid] = (tmp, n, payload)
            if width is not None:
                self._hints[cid] = width
        return STAGED

    def sync_staged(self) -> int:
        """Make every chunk put with sync=False durable here: fsync the files (in parallel;
        from SYNCFS_MIN files on, one syncfs instead: docs/ARCHITECTURE.md), rename them
        into staged/, one directory fsync, one journal append + fsync. Returns the chunks
        acknowledged. Same crash-safety order as `put`.
        Small chunks skip their file's and the directory's fsync: their journal records
        carry their bytes (see the module docstring)."""
        with self._sync_lock:
            with self._cond:
                batch = list(self._unsynced.items())
            if not batch:
                return 0
            self.foreground()  # the fsyncs are foreground work too: uploaders keep off
            paths = [tmp for _, (tmp, _, payload) in batch if payload is None]
            try:
                sync_files(paths, self._syncfs_fd)
            except OSError:  # unknown what reached the disk, and a retry would not say:
                self._drop_unsynced([cid for cid, _ in batch])  # its writers fail, redo it
                raise
            replaced = False
            for cid, (tmp, _, payload) in batch:
                dst = os.path.join(self.staged_dir, cid.hex())
                if payload is None:
                    os.rename(tmp, dst)
                else:
                    replaced |= place_inline(tmp, dst, payload)
            if paths or replaced:
                fsync_dir(self.staged_dir)
            t_ns = time.time_ns()
            inline = {cid: payload for cid, (_, _, payload) in batch if payload is not None}
            self.seg.add_pending([(cid, n, t_ns) for cid, (_, n, _) in batch], inline)
            with self._cond:
                for cid, (_, n, payload) in batch:
                    self._unsynced.pop(cid, None)
                    self._now_pending(cid, n, t_ns)
                    if payload is not None:
                        self._inline_held -= n
                self._cond.notify_all()
            self.foreground()
            return len(batch)

    def _syncfs(self) -> None:
        if self._syncfs_fd is not None:
            sync_filesystem(self._syncfs_fd)

    def discard_unsynced(self) -> None:
        """Drop chunks put with sync=False and never acknowledged (their save failed)."""
        with self._sync_lock:
            self._drop_unsynced(None)

    def _drop_unsynced(self, ids: list[bytes] | None) -> None:
        """Forget these unacknowledged chunks (None: all) and remove their temp files."""
        with self._cond:
            if ids is None:
                batch, self._unsynced = self._unsynced, {}
            else:
                batch = {c: self._unsynced.pop(c) for c in ids if c in self._unsynced}
            for cid, (tmp, n, payload) in batch.items():
                self._hints.pop(cid, None)
                self._reserved -= n
                self._used -= n
                if payload is not None:
                    self._inline_held -= n
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            self._cond.notify_all()

    def foreground(self) -> None:
        """Note a foreground write, here and host-wide (the activity file's mtime), so every
        uploader on the host holds off while any process on it is saving. Writers call it
        for content they find already stored too (`ChunkSink.missing`): a step-2 save
        is mostly such content, and with only its few new chunks counted the uploaders saw
        half-second lulls and compressed and uploaded in the middle of it, taking the GIL
        from the serving thread for each chunk's copies."""
        mono = time.monotonic()
        if mono - self._last_put >= self.idle_s:  # after a lull: a new stretch of work
            self._busy_since = mono
        self._last_put = mono
        now = time.time()
        if now - self._last_mark >= 0.05:
            self._last_mark = now
            touch_activity(self.active_path)

    def _should_drain(self) -> float:
        """0 when the uploader may go now, else seconds to wait before asking again. Uploads
        yield to foreground work (disk, CPU, the GIL): they go after `idle_s` without a
        foreground put or batch load, on flush/close, above `high_water` of the budget, when
        this process has been busy `max_defer_s` without a lull (not "the oldest chunk waited
        that long": a job saving every few seconds then drained in its next save), when only
        other processes here are busy and a chunk waited that long, or one waited 4x that."""
        if self._flushing or self._stop.is_set():
            return 0.0
        if self._used - self._cached > self.high_water * self.budget:
            return 0.0
        now = time.monotonic()
        quiet = now - self._last_put
        if quiet < self.idle_s and now - self._busy_since > self.max_defer_s:
            return 0.0
        if self._queue and time.time_ns() - self._queue[0][0] > 4 * self.max_defer_s * 1e9:
            return 0.0
        if quiet < self.idle_s:
            return self.idle_s - quiet
        try:
            host_quiet = time.time() - os.stat(self.active_path).st_mtime
        except OSError:
            return 0.0
        if host_quiet < self.idle_s:  # another process here is busy: wait, but not forever
            if self._queue and time.time_ns() - self._queue[0][0] > self.max_defer_s * 1e9:
                return 0.0
            return max(0.01, self.idle_s - host_quiet)
        return 0.0

    def _stage(self, cid: bytes, blob: bytes) -> None:
        n = len(blob)
        self._reserve(n)
        try:
            tmp = temp_path(self.tmp_dir, "s")
            write_new(tmp, blob, sync=True)
            os.rename(tmp, os.path.join(self.staged_dir, cid.hex()))
            self._dirsync.sync()  # the rename is durable before the journal names it
            t_ns = time.time_ns()
            self.seg.add_pending([(cid, n, t_ns)])
        except OSError as e:
            self._write_failed(cid, n, e)
            raise
        with self._cond:
            self._now_pending(cid, n, t_ns)
            self._cond.notify_all()

    def _now_pending(self, cid: bytes, n: int, t_ns: int) -> None:
        """A reserved chunk is staged and journaled: queue it for upload (under _cond)."""
        self._reserved -= n
        self._own_staged += n
        self._pending[cid] = (n, t_ns)
        self._seq += 1
        heapq.heappush(self._queue, (t_ns, self._seq, cid))

    def _write_failed(self, cid: bytes, n: int, e: OSError) -> None:
        """Give back the space reserved for a chunk whose staging write failed."""
        with self._cond:
            self._reserved -= n
            self._used -= n
            self._cond.notify_all()
        if e.errno == errno.ENOSPC:
            log.error("staging %s: disk full writing chunk %s", self.root, cid.hex())

    def _reserve(self, n: int) -> None:
        """Back-pressure: wait until staging has room; ENOSPC only if nothing frees space."""
        start = time.monotonic()
        waited = False
        with self._cond:
            while True:
                if self._used + n <= self.budget:
                    break
                freed = self._evict_unlocked(self._used + n - self.budget)
                if freed:
                    self._evicted(freed)
                if self._used + n <= self.budget:
                    break
                if self._own_staged == 0 and self._reserved == 0 and n > self.budget:
                    break  # one oversized chunk at a time rather than never
                self._raise_if_stalled(start)
                if not waited:
                    waited = True
                    self.waits += 1
                    log.info("staging %s full: writer waits for the uploader", self.root)
                self._cond.wait(0.25)
            self._used += n
            self._reserved += n

    def _raise_if_stalled(self, start: float) -> None:
        """ENOSPC (logged) once staging is full and nothing freed space for stall_timeout
        since `start` or the last free: a writer, or a rank's adopt, waits that long."""
        if time.monotonic() - max(self._last_freed, start) > self.stall_timeout:
            msg = (
                f"staging {self.root} full ({self._used} of {self.budget} bytes) and "
                f"nothing drained for {self.stall_timeout:.0f}s (object nodes down?)"
            )
            log.error("ENOSPC: %s; last upload error: %s", msg, self.last_error or "-")
            raise OSError(errno.ENOSPC, msg)

    def _freed(self, n: int) -> None:
        self._used = max(0, self._used - n)
        self._last_freed = time.monotonic()
        self._cond.notify_all()

    def _evict_unlocked(self, need: int) -> int:
        """Evict `need` bytes of the read cache without holding `_cond` (the scan and the
        unlinks are slow; puts and reads go on meanwhile); called with it held. Bytes freed."""
        self._cond.release()
        try:
            return self.cache.evict(need)
        finally:
            self._cond.acquire()

    def _evicted(self, n: int) -> None:
        """`n` bytes of the read cache were evicted (under _cond)."""
        self._cached = max(0, self._cached - n)
        self._freed(n)

    def _cache_if_room(self, cid: bytes, blob: bytes) -> None:
        """Keep a copy for readers if the budget allows, evicting older cache entries."""
        n = len(blob)
        with self._cond:
            if self._used + n > self.budget:
                self._evicted(self._evict_unlocked(self._used + n - self.budget))
                if self._used + n > self.budget:
                    return
            self._used += n
            self._cached += n
        added = self.cache.add(cid, blob)
        if added < n:
            with self._cond:
                self._used -= n - added
                self._cached = max(0, self._cached - (n - added))

    # -- read path ----------------------------------------------------------------------------
    def _fetch_missing(self, cid: bytes, view: bool = False) -> bytes:
        """A chunk neither staged nor cached here: from the nodes, once per host (reads.py)."""
        return self.cache.single_flight(cid, lambda: self._fetch(cid))

    def _fetch(self, cid: bytes) -> bytes:
        """One node read for the common case (keeping the stored encoding for the cache);
        any trouble falls back to the store's replica walk, which reports bad replicas."""
        blob = None
        try:
            node = self.store.read_order(cid)[0]
            got = node.get(cid)
            raw = codec.decode(got)
            if chunk_id(raw, self.store.seed) == cid:
                blob = got
        except (NodeError, codec.ChunkFormatError):
            pass
        if blob is None:
            raw = self.store.get(cid)
            blob = codec.encode(raw, "none")
        self._cache_if_room(cid, blob)
        return raw

    # -- uploader -----------------------------------------------------------------------------
    def _upload_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stop.is_set():
                        return
                    if not self._queue:
                        self._cond.wait()
                        continue
                    wait = self._should_drain()
                    if wait <= 0:
                        break
                    self._cond.wait(min(wait, self.idle_s))
                _, _, cid = heapq.heappop(self._queue)
                self._uploading.add(cid)
            ok = False
            try:
                ok = self._upload_one(cid)
            except Exception:  # a bug must not kill the uploader: retry the chunk later
                log.exception("uploader: unexpected error on chunk %s", cid.hex())
                self._stop.wait(1.0)  # and must not spin on it
            with self._cond:
                self._uploading.discard(cid)
                if ok:
                    self._to_mark.append(cid)
                elif cid in self._pending:
                    t_ns = self._pending[cid][1]
                    self._seq += 1
                    heapq.heappush(self._queue, (t_ns, self._seq, cid))
                self._cond.notify_all()

    def _upload_one(self, cid: bytes) -> bool:
        """Upload with retries and backoff until it succeeds (True) or the tier stops."""
        delay = 0.2
        while not self._stop.is_set():
            try:
                with open(os.path.join(self.staged_dir, cid.hex()), "rb") as f:
                    blob = f.read()
            except FileNotFoundError:
                # Only an uploader moves a file out of staged/, after it is durable: another
                # process staged the same chunk and finished first.
                return True
            if self.transcode is not None:
                try:
                    blob = self.transcode(blob, self._hints.get(cid))
                except codec.ChunkFormatError as e:
                    log.error("staged chunk %s is corrupt, cannot upload: %s", cid.hex(), e)
                    with self._cond:
                        self.lost += 1
                    # Nothing good to upload. Marked done all the same: as durable, the chunk
                    # has no replica, which fsck reports as lost; left staged, fsck would
                    # take it for an upload in flight and say nothing.
                    return True
            try:
                t0 = time.monotonic()
                self.store.put_encoded(cid, blob)
            except (ChunkStoreError, NodeError) as e:
                with self._cond:
                    self.failures += 1
                    self.last_error = str(e)[:300]
                log.warning("upload of chunk %s failed (retry in %.1fs): %s", cid.hex(), delay, e)
                self._stop.wait(delay)
                delay = min(delay * 2, 10.0)
                continue
            now = time.monotonic()
            with self._cond:
                if self.transcode is not None:
                    self._stored_lens[cid] = len(blob)  # reported with the durable mark
                self.uploaded_chunks += 1
                self.uploaded_bytes += len(blob)
                self._rate.append((now, len(blob)))
            log.debug("uploaded %s (%d B) in %.3fs", cid.hex(), len(blob), now - t0)
            return True
        return False

    def _mark(self, final: bool = False) -> None:
        with self._mark_lock:
            self._mark_locked(final)

    def _mark_locked(self, final: bool) -> None:
        """Mark uploaded chunks durable in the metadata and free their staged files.

        A chunk the metadata does not know yet (its file is not committed) is journaled U
        (uploaded) and its staged space freed anyway, since it is on R nodes; marking it is
        retried every second until its commit lands (or `register_timeout`: never committed)."""
        with self._cond:
            batch, self._to_mark = self._to_mark, []
            now = time.monotonic()
            retry = [c for c, (_, last) in self._unregistered.items() if final or now - last >= 1]
        if not batch and not retry:
            return
        ids = batch + retry
        unknown: set[bytes] = set()
        if self.on_durable is not None:
            try:
                for i in range(0, len(ids), self.mark_batch):
                    part = ids[i : i + self.mark_batch]
                    with self._cond:
                        sizes = [self._stored_lens.get(c, 0) for c in part]
                    unknown.update(self.on_durable(part, sizes) or [])
                    with self._cond:
                        for c in part:
                            if c not in unknown:
                                self._stored_lens.pop(c, None)
            except Exception as e:
                log.warning("could not mark %d chunks durable (will retry): %s", len(ids), e)
                with self._cond:
                    self._to_mark = batch + self._to_mark
                    for c in retry:
                        self._unregistered[c] = (self._unregistered[c][0], now)
                return
        with self._cond:
            given_up = [
                c
                for c in retry
                if c in unknown and now - self._unregistered[c][0] > self.register_timeout
            ]
        if given_up:
            log.warning("%d uploaded chunks were never committed; no longer tracked", len(given_up))
        new_unknown = [c for c in batch if c in unknown]
        done = [c for c in ids if c not in unknown] + given_up
        if new_unknown:
            self.seg.add_done(new_unknown, KIND_UPLOADED)
        if done:
            self.seg.add_done(done)
        freed = 0
        moved: set[bytes] = set()
        for c in batch:
            src = os.path.join(self.staged_dir, c.hex())
            try:
                if self.keep_cache:
                    os.rename(src, self.cache.path(c))
                    moved.add(c)
                else:
                    freed += os.stat(src).st_size
                    os.unlink(src)
            except FileNotFoundError:
                pass
        with self._cond:
            for c in new_unknown:
                self._unregistered[c] = (now, now)
            for c in retry:
                if c in unknown and c not in given_up:
                    self._unregistered[c] = (self._unregistered[c][0], now)
                else:
                    self._unregistered.pop(c, None)
            for c in batch:
                self._hints.pop(c, None)
                ent = self._pending.pop(c, None)
                if ent is not None:
                    self._own_staged -= ent[0]
                    if c in moved:
                        self._cached += ent[0]
            if freed:
                self._freed(freed)
            self._cond.notify_all()

    # -- housekeeping -------------------------------------------------------------------------
    def _housekeep(self) -> None:
        last_status = last_adopt = compact_after = 0.0
        last_tidy = time.monotonic()  # __init__ just did it
        failing: str | None = None  # the OSError last reported, until a status write succeeds
        while not self._stop.wait(0.1):
            try:
                self._mark()
                now = time.monotonic()
                if now - last_status >= 1.0:
                    last_status = now
                    self._rescan()
                    self._write_status()
                    if failing is not None:
                        log.info("write-behind housekeeping in %s works again", self.root)
                        failing = None
                    big = self.seg.size > max(COMPACT_BYTES, 4 * self.seg.live_bytes)
                    if big and now >= compact_after:
                        try:
                            self.seg.compact()
                        except OSError as e:  # retried in a minute, not every second
                            compact_after = now + 60.0
                            log.error("compacting journal %s: %s", self.seg.path, e)
                if now - last_adopt >= 5.0:
                    last_adopt = now
                    self.adopt_orphans()
                if now - last_tidy >= RECONCILE_AGE_S:  # what dead ranks left (ranks.py)
                    last_tidy = now
                    self.tidy()
            except OSError as e:
                # A full or failing disk: an expected condition, reported once (the pass
                # retries), without a traceback, until a status write succeeds again.
                self.housekeeping_failures += 1
                if str(e) != failing:
                    failing = str(e)
                    log.error("write-behind housekeeping in %s: %s", self.root, e)
            except Exception:  # a bug: keep housekeeping alive; the next pass retries
                self.housekeeping_failures += 1
                log.exception("write-behind housekeeping failed")

    def _rescan(self) -> None:
        """Resync the space estimate with the directory (other processes stage and evict too;
        the journals' I records hold a second copy of small staged chunks). Every second: a
        stat per cached file (36 ms of CPU for 16k entries). Scanned less often, a process
        counted only its own evictions, and its next put evicted other ranks' phantom excess
        (a review's repro: one 256 KiB put removed 11 cached chunks)."""
        cached = dir_bytes(self.cache.dir)
        used = dir_bytes(self.staged_dir) + cached + dir_bytes(self.journal_dir)
        with self._cond:
            self._cached = cached
            new = used + self._reserved
            if new < self._used:
                self._freed(self._used - new)
            self._used = new

    # -- visibility ---------------------------------------------------------------------------
    def stats(self) -> dict:
        now = time.monotonic()
        with self._cond:
            while self._rate and now - self._rate[0][0] > 10.0:
                self._rate.popleft()
            # over the last 10 s, or the tier's life if shorter (not a fifth of it at 2 s)
            rate = sum(n for _, n in self._rate) / max(0.5, min(10.0, now - self._born))
            oldest = min((t for _, t in self._pending.values()), default=None)
            to_upload = len(self._queue) + len(self._uploading)
            return {
                "staging": self.root,
                "segment": self.seg.name,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "durability": self.durability,
                "budget_bytes": self.budget,
                "used_bytes": self._used,
                "cached_bytes": self._cached,
                "pending_chunks": len(self._pending),
                "pending_bytes": sum(s for s, _ in self._pending.values()),
                "to_upload_chunks": to_upload,
                "to_upload_bytes": sum(self._pending[c][0] for _, _, c in self._queue)
                + sum(self._pending[c][0] for c in self._uploading if c in self._pending),
                "undurable_bytes": sum(s for s, _ in self._pending.values()),
                "awaiting_commit_chunks": len(self._unregistered),
                "oldest_pending_ns": oldest,
                "uploaded_chunks": self.uploaded_chunks,
                "uploaded_bytes": self.uploaded_bytes,
                "upload_rate_bps": rate,
                "upload_failures": self.failures,
                "housekeeping_failures": self.housekeeping_failures,
                "last_error": self.last_error,
                "writer_waits": self.waits,
                "lost_chunks": self.lost,
                "cache_hits": self.cache.hits,
                "cache_misses": self.cache.misses,
                "journal_fsyncs": self.seg.fsyncs,
                "updated": time.time(),
            }

    def _write_status(self) -> None:
        tmp = self.status_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.stats(), f)
        os.rename(tmp, self.status_path)

    def drained(self) -> bool:
        with self._cond:
            return not self._queue and not self._uploading and not self._to_mark

    def flush(
        self,
        progress: Callable[[int, int], None] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Wait until every chunk staged so far is on R nodes and marked durable.

        `progress(done_bytes, total_bytes)` is called as the drain advances. Chunks whose file
        was never committed count as drained (they are on the nodes). TimeoutError on timeout."""
        self.sync_staged()
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
        try:
            self._flush(progress, timeout)
        finally:
            with self._cond:
                self._flushing -= 1

    def _flush(self, progress: Callable[[int, int], None] | None, timeout: float | None) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        total = 0
        last = -1
        while True:
            with self._cond:
                left = sum(s for s, _ in self._pending.values())
                busy = bool(self._queue or self._uploading or self._to_mark)
            total = max(total, left)
            if progress is not None and total - left != last:
                last = total - left
                progress(last, total)
            if not busy and left == 0:
                self._mark(final=True)  # files committed since their upload: mark them now
                return
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"staging {self.root}: {left} bytes still not durable")
            with self._cond:
                self._cond.wait(0.1)

    def close(self) -> None:
        """Stop the threads (an upload in flight finishes), mark what was uploaded, keep the
        rest journaled for the next tier to adopt."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        self.discard_unsynced()  # never acknowledged: their save did not reach its commit
        if self._syncfs_fd is not None:
            os.close(self._syncfs_fd)
            self._syncfs_fd = None
        try:
            self._mark(final=True)
        except Exception:
            log.exception("final durable marking failed; the journal keeps those chunks")
        with self._cond:
            clean = not self._pending
        if clean:
            try:
                os.unlink(self.status_path)
            except FileNotFoundError:
                pass
        else:
            self._write_status()
            log.info(
                "closing with %d chunks not yet durable; they stay journaled", len(self._pending)
            )
        self.seg.close(remove=clean)
