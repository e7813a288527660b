"""RankFiles: what the host's tier does for rank processes that stage their own chunk files.

With one agent per host (issue 42) the bytes of a save never cross its socket: each rank
writes and renames its chunk files into staged/ itself (chunkstore.tier.stager
HostStager, on its own cores), then asks the agent to `adopt` them: the agent makes them
durable (synced=False: one syncfs shared by every rank adopting at that moment, where each
rank used to pay a file and a directory fsync of its own: 4,096 harness ranks of 256 KiB
spent 27 s in a first save that way), journals them in its segment (the acknowledgement)
and its uploaders drain them like chunks it staged itself. For reads the rank asks
`fill_cache`: the agent fetches what is not on the host into cache/ once (single-flight),
and the rank reads the file, verified.

A mixin of WriteBehindTier (its state: staged_dir, seg, _pending, _staging, _cond...)."""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time

from chunkstore.fileio import fdatasync_path
from chunkstore.store import ChunkUnavailable

log = logging.getLogger("ckptfs.tier")

Entry = tuple[bytes, int, int | None]  # chunk id, size of staged/<hex>, float width hint


class AdoptError(ValueError):
    """A rank asked to adopt a chunk whose staged file is missing or of another size."""


class RankFiles:
    """adopt / fill_cache (mixed into WriteBehindTier)."""

    def adopt(self, entries: list[Entry], *, synced: bool = True) -> int:
        """Take over chunk files another process put into staged/ (synced: fsync'd, and the
        directory; else made durable here first, by one syncfs shared with every
        concurrent adopter: `_files_durable`): check each is there with its stated size,
        journal them P with one group-committed fsync, queue them for upload. Returns the
        chunks newly journaled; once it returns they are acknowledged (a crash of this
        process leaves them to the next tier).

        All or nothing: a missing or short file raises AdoptError naming the chunk before
        anything is journaled. Idempotent: a chunk already pending is not journaled again,
        and one being adopted or staged by another caller is waited for (it is
        acknowledged only once journaled). Blocks (fsync, and while staging is over its
        budget, like a writer of this tier: ENOSPC if nothing drains for stall_timeout)."""
        if self._stop.is_set():
            raise RuntimeError("write-behind tier is closed")
        self.foreground()  # a rank's save: the uploaders hold off, as for our own writers
        todo = list({e[0]: e for e in entries}.values())
        adopted = 0
        while todo:
            mine = threading.Event()
            claimed: list[Entry] = []
            others: list[tuple[Entry, threading.Event]] = []
            with self._cond:
                for e in todo:
                    if e[0] in self._pending:
                        continue
                    ev = self._staging.get(e[0])
                    if ev is None:
                        self._staging[e[0]] = mine
                        claimed.append(e)
                    else:
                        others.append((e, ev))
            try:
                if claimed:
                    adopted += self._adopt_claimed(claimed, synced)
            finally:
                with self._cond:
                    for e in claimed:
                        if self._staging.get(e[0]) is mine:
                            del self._staging[e[0]]
                mine.set()
            for _, ev in others:
                ev.wait()
            todo = [e for e, _ in others]  # pending now, or theirs failed: ours to do
        return adopted

    def _files_durable(self, entries: list[Entry]) -> None:
        """Make these staged files and their renames durable before the journal names them:
        one syncfs of the staging filesystem for every adopter waiting at that moment
        (GroupSync), or, without syncfs, an fdatasync each and one directory fsync."""
        if self._syncfs_fd is not None:
            self._fs_sync.sync()
            return
        for cid, _, _ in entries:
            fdatasync_path(os.path.join(self.staged_dir, cid.hex()))
        self._dirsync.sync()

    def _adopt_claimed(self, claimed: list[Entry], synced: bool = True) -> int:
        new: list[Entry] = []
        gone: list[bytes] = []
        for cid, size, width in claimed:
            path = os.path.join(self.staged_dir, cid.hex())
            try:
                got: int | None = os.stat(path).st_size
            except FileNotFoundError:
                got = None
            if got == size:
                new.append((cid, size, width))
            elif got is None and os.path.exists(self.cache.path(cid)):
                # Another rank staged the same chunk, ours replaced its file, and the upload
                # of it moved the file to cache/ before we got here: on the nodes already.
                gone.append(cid)
            else:
                what = "is missing" if got is None else f"holds {got} bytes"
                raise AdoptError(
                    f"cannot adopt chunk {cid.hex()}: staged/{cid.hex()} {what}, the rank "
                    f"stated {size} bytes; nothing of this batch was adopted"
                )
        if gone:  # marked durable like an upload of ours (the metadata may not know it yet)
            with self._cond:
                self._to_mark.extend(gone)
        if not new:
            return 0
        self._await_room()
        if not synced:
            self._files_durable(new)
        t_ns = time.time_ns()
        self.seg.add_pending([(cid, n, t_ns) for cid, n, _ in new], {})
        # Queued as _now_pending does, and counted in the space estimate now: left to the
        # next _rescan, a rank could write a budget's worth between two rescans unseen. (The
        # rescan may have counted some already: corrected at the next one. That looks like
        # space freed only while adopts go on, so a stall is still seen as one.)
        with self._cond:
            for cid, n, width in new:
                if width is not None:
                    self._hints[cid] = width
                self._used += n
                self._own_staged += n
                self._pending[cid] = (n, t_ns)
                self._seq += 1
                heapq.heappush(self._queue, (t_ns, self._seq, cid))
            self._cond.notify_all()
        return len(new)

    def _await_room(self) -> None:
        """Wait while staging is over its budget, evicting the read cache first, as a writer
        of this tier waits in _reserve (the rank's files are on disk already: counted by the
        last rescan, so this asks for no more room). ENOSPC if nothing frees space for
        stall_timeout; returns at once when none of it is ours to drain."""
        start = time.monotonic()
        waited = False
        with self._cond:
            while self._used > self.budget and self._own_staged > 0:
                freed = self._evict_unlocked(self._used - self.budget)
                if freed:
                    self._evicted(freed)
                    continue
                self._raise_if_stalled(start)
                if not waited:
                    waited = True
                    self.waits += 1
                    log.info("staging %s full: a rank's adopt waits for the uploader", self.root)
                self._cond.wait(0.25)

    def fill_cache(self, ids: list[bytes]) -> None:
        """Make each chunk readable from this host's staging directory: staged or cached
        already, nothing; else fetched from the nodes, verified, into cache/ (single-flight
        with every other reader here). ChunkUnavailable, naming them, for chunks no node has
        (after trying all). A chunk the cache had no room for is not there afterwards: the
        rank then reads it from the nodes itself (HostStager)."""
        missing: list[str] = []
        for cid in dict.fromkeys(ids):
            name = cid.hex()
            if os.path.exists(os.path.join(self.staged_dir, name)) or os.path.exists(
                self.cache.path(cid)
            ):
                continue
            try:
                self._fetch_missing(cid, False)
            except ChunkUnavailable as e:
                missing.append(str(e))
        if missing:
            raise ChunkUnavailable("; ".join(missing))
