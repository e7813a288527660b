"""HostStager: a rank's side of the host's write-behind tier when an agent owns the tier.

With one ckptfs agent per host (issue 42) the agent process holds the WriteBehindTier: its
journal, its uploaders and the host read cache. The bytes of a save still do not cross the
agent's socket: a rank writes its chunk files into the shared staging directory itself, on
its own cores, and sends only control. HostStager stands in for WriteBehindTier under a
rank's Volume (`vol.tier`) and offers what the client uses of it, with the same meaning:

- put(sync=False) writes the encoded object to tmp/ (no fsync); `sync_staged()` renames
  the batch into staged/ and `link.adopt`s it unsynced: the agent makes the files durable
  with one syncfs shared by every rank adopting at that moment (a rank's own fdatasync and
  directory fsync, paid per rank, were most of a many-rank save), checks and journals
  them, and only when that returns is the batch acknowledged. If adopt raises, the save
  fails: nothing is acknowledged. A copy of the same chunk already in staged/ (another
  rank's) is kept when its size is right (the rename is RENAME_NOREPLACE): replacing a
  file another rank's acknowledgement rests on by one not yet durable could lose it in a
  power cut.
- get / read_into read staged/ and cache/ verified (reads.StagingReads, as the tier does);
  a miss asks the agent to `fetch` the chunk into cache/ (once per host) and reads it.
- durability="remote": puts go straight to the nodes through `store`; nothing is adopted.

It has no threads. What a rank leaves behind when killed is the agent's to clean up:
temp files of a dead pid, and a staged file renamed but never adopted (tier.tidy; see the
package docstring's crash-safety paragraph). A rank never removes a file from staged/:
another rank may have staged the same chunk under the same name."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from chunkstore.cache import ChunkCache
from chunkstore.fileio import rename_noreplace, temp_path, write_new
from chunkstore.store import ChunkStore, ChunkUnavailable
from chunkstore.tier.journal import ACTIVE_FILE
from chunkstore.tier.reads import StagingReads
from chunkstore.tier.tier import (
    DURABILITY,
    DURABLE,
    STAGED,
    default_staging_size,
    touch_activity,
)

log = logging.getLogger("ckptfs.tier")
SKIP_AGENT_S = 10.0  # seconds a failed prefetch sends a reader's misses to the nodes


class AgentLink(Protocol):
    """The control a rank sends its host's agent (fusefs/agent implements it)."""

    def adopt(self, entries: list[tuple[bytes, int, int | None]], synced: bool = True) -> None:
        """(chunk id, size of staged/<hex>, float width hint): journal them on the agent
        (WriteBehindTier.adopt; synced=False: the agent syncs the files first); returns
        once they are durable there, raises if refused."""

    def fetch(self, ids: list[bytes]) -> None:
        """Bring these chunks into the host cache (WriteBehindTier.fill_cache); raises
        chunkstore.store.ChunkUnavailable for a chunk no node has."""

    def flush(self, timeout: float | None) -> None:
        """Wait until the agent's tier has drained (WriteBehindTier.flush; TimeoutError)."""


class HostStager(StagingReads):
    """The write-behind tier as a rank sees it when its host's agent owns the tier."""

    def __init__(
        self,
        store: ChunkStore,
        staging_dir: str,
        link: AgentLink,
        *,
        durability: str = "local",
        size: int | None = None,
    ) -> None:
        if durability not in DURABILITY:
            raise ValueError(f"durability must be local or remote, not {durability!r}")
        if size is not None and size <= 0:
            raise ValueError(f"staging size must be positive, got {size}")
        self.store = store
        self.link = link
        self.durability = durability
        self.root = os.path.abspath(staging_dir)
        self.staged_dir = os.path.join(self.root, "staged")
        self.tmp_dir = os.path.join(self.root, "tmp")
        status_dir = os.path.join(self.root, "status")
        for d in (self.staged_dir, self.tmp_dir, status_dir):
            os.makedirs(d, exist_ok=True)
        self.active_path = os.path.join(status_dir, ACTIVE_FILE)
        # The agent's budget is what bounds the directory; a rank's caps its unsynced bytes
        # (sink.unsynced_cap), so pass the agent's size when it is not the default.
        self.budget = size if size is not None else default_staging_size(self.root)
        self.cache = ChunkCache(self.root, store.seed)
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        # written to tmp/, not yet acknowledged: cid -> (temp path, size, width hint)
        self._unsynced: dict[bytes, tuple[str, int, int | None]] = {}
        self._closed = False
        self._last_mark = 0.0
        self._skip_agent_until = 0.0  # a prefetch found the agent failing: until then, nodes
        self.adopted_chunks = 0  # acknowledged by the agent
        self.adopted_bytes = 0
        self.fetches = 0  # misses the agent was asked to fetch
        self.direct_reads = 0  # misses read from the nodes here (agent unreachable, no room)
        self.uploaded_chunks = 0  # the agent uploads; a rank puts only with durability=remote
        self.uploaded_bytes = 0

    # -- write path -----------------------------------------------------------------------
    def put(
        self,
        cid: bytes,
        blob: bytes | list[bytes | memoryview],
        *,
        sync: bool = True,
        width: int | None = None,
    ) -> int:
        """Store an encoded chunk: STAGED once acknowledged by the agent (sync=True: before
        returning; sync=False: by the next `sync_staged()`), DURABLE with durability=remote."""
        if self._closed:
            raise RuntimeError("host stager is closed")
        self.foreground()
        if self.durability == "remote":
            data = b"".join(blob) if isinstance(blob, list) else blob
            self.store.put_encoded(cid, data)
            self.uploaded_chunks += 1
            self.uploaded_bytes += len(data)
            return DURABLE
        with self._lock:
            if not sync and cid in self._unsynced:
                return STAGED
        tmp = temp_path(self.tmp_dir, "s")  # our pid in the name: tier._clean_tmp
        n = write_new(tmp, blob, sync=False)
        if sync:  # this very file, acknowledged before returning (not someone's batch)
            with self._sync_lock:
                self._acknowledge([(cid, (tmp, n, width))])
            return STAGED
        with self._lock:
            if cid in self._unsynced:  # another thread won the race: keep the first
                os.unlink(tmp)
            else:
                self._unsynced[cid] = (tmp, n, width)
        return STAGED

    def sync_staged(self) -> int:
        """Acknowledge every chunk put with sync=False: rename into staged/, `link.adopt`
        unsynced (the agent syncs and journals them). Returns the chunks acknowledged.
        Any failure drops the whole batch (its writers fail and write it again)."""
        with self._sync_lock:
            with self._lock:
                batch = list(self._unsynced.items())
            return self._acknowledge(batch)

    def _acknowledge(self, batch: list[tuple[bytes, tuple[str, int, int | None]]]) -> int:
        """Make `batch` durable and adopted (under _sync_lock)."""
        if not batch:
            return 0
        self.foreground()  # the agent's syncs are foreground work: its uploaders keep off
        try:
            for cid, (tmp, n, _) in batch:
                dst = os.path.join(self.staged_dir, cid.hex())
                if rename_noreplace(tmp, dst):
                    continue
                if _size(dst) == n:  # another rank's copy (module docstring): keep it
                    os.unlink(tmp)
                else:  # a damaged leftover no acknowledgement rests on: ours replaces it
                    os.rename(tmp, dst)
            # The agent syncs them (one syncfs for every rank adopting now), then journals.
            self.link.adopt([(cid, n, width) for cid, (_, n, width) in batch], synced=False)
        except BaseException:
            # Unknown what is durable or journaled: nothing is acknowledged. Renamed files
            # stay (the agent adopts or removes them: tidy); temp files go.
            self._drop(batch)
            raise
        self._forget(batch)
        with self._lock:
            self.adopted_chunks += len(batch)
            self.adopted_bytes += sum(n for _, (_, n, _) in batch)
        self.foreground()
        return len(batch)

    def discard_unsynced(self) -> None:
        """Drop chunks put with sync=False and never acknowledged (their save failed)."""
        with self._sync_lock:
            with self._lock:
                batch = list(self._unsynced.items())
            self._drop(batch)

    def _forget(self, batch: list[tuple[bytes, tuple[str, int, int | None]]]) -> None:
        """Take these files out of the unsynced set (each entry only if it is that file)."""
        with self._lock:
            for cid, (tmp, _, _) in batch:
                if self._unsynced.get(cid, ("",))[0] == tmp:
                    del self._unsynced[cid]

    def _drop(self, batch: list[tuple[bytes, tuple[str, int, int | None]]]) -> None:
        """Forget these files and remove those still in tmp/."""
        self._forget(batch)
        for _, (tmp, _, _) in batch:
            try:
                os.unlink(tmp)
            except OSError:  # renamed into staged/ already
                pass

    def foreground(self) -> None:
        """Mark the host busy (the activity file every uploader on the host reads), at most
        every 50 ms: the agent's uploaders hold off while a rank saves or loads."""
        now = time.time()
        if now - self._last_mark >= 0.05:
            self._last_mark = now
            touch_activity(self.active_path)

    # -- read path ------------------------------------------------------------------------
    def _fetch_missing(self, cid: bytes, view: bool) -> bytes | memoryview:
        """Ask the agent to bring the chunk into cache/, then read it there, verified. A copy
        that does not verify is dropped by the read and asked for once more; the nodes are
        read directly when the agent cannot be asked or had no room to cache it."""
        self.cache.misses += 1
        for _ in range(0 if time.monotonic() < self._skip_agent_until else 2):
            self.fetches += 1
            try:
                self.link.fetch([cid])
            except ChunkUnavailable:
                raise
            except Exception as e:  # the agent is gone or failing: reads do not need it
                log.warning("agent fetch of chunk %s failed (%s): reading the nodes", cid.hex(), e)
                break
            raw = self._read_staged(cid, view)
            if raw is None:
                raw = self.cache.lookup(cid, view)
            if raw is not None:
                return raw
        self.direct_reads += 1
        return self.store.get(cid)

    def prefetch(self, ids: list[bytes]) -> None:
        """Ask the agent once to bring these chunks into the host cache (a reader about to
        `get` each of them: one round trip, not one per chunk). Best effort: a chunk it
        could not bring is fetched, or found unavailable, by its own `get` as before."""
        ids = [
            cid
            for cid in dict.fromkeys(ids)
            if not os.path.exists(os.path.join(self.staged_dir, cid.hex()))
            and not os.path.exists(self.cache.path(cid))
        ]
        if len(ids) < 2:  # none, or one: its own get asks for it, as it would have
            return
        self.fetches += 1
        try:
            self.link.fetch(ids)
        except ChunkUnavailable:  # the others were fetched; that one's own get decides
            pass
        except Exception as e:  # the agent is gone or failing: these read the nodes
            log.warning("agent fetch of %d chunks failed (%s): reading the nodes", len(ids), e)
            self._skip_agent_until = time.monotonic() + SKIP_AGENT_S

    # -- the rest of the tier's surface ---------------------------------------------------
    def flush(
        self,
        progress: Callable[[int, int], None] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Acknowledge what is unsynced, then wait until the agent's tier has drained
        (TimeoutError on timeout). `progress` is not called: the agent drains."""
        self.sync_staged()
        self.link.flush(timeout)

    def drained(self) -> bool:
        """Whether the agent's tier has nothing left to upload (asked without waiting)."""
        try:
            self.link.flush(0.0)
        except TimeoutError:
            return False
        return True

    def stats(self) -> dict:
        """The tier's stats keys (fusefs.metrics sums them over tiers): this rank's part.
        Uploads, queues and the budget's use are the agent's, reported by the agent."""
        with self._lock:
            unsynced = len(self._unsynced)
            unsynced_bytes = sum(n for _, n, _ in self._unsynced.values())
        zero = (
            "used_bytes cached_bytes pending_chunks pending_bytes to_upload_chunks "
            "to_upload_bytes undurable_bytes awaiting_commit_chunks upload_rate_bps "
            "upload_failures housekeeping_failures writer_waits lost_chunks journal_fsyncs"
        )
        return {
            **dict.fromkeys(zero.split(), 0),
            "staging": self.root,
            "segment": None,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "durability": self.durability,
            "budget_bytes": 0,  # the agent's tier reports the budget, once per host
            "oldest_pending_ns": None,
            "last_error": "",
            "uploaded_chunks": self.uploaded_chunks,
            "uploaded_bytes": self.uploaded_bytes,
            "cache_hits": self.cache.hits,
            "cache_misses": self.cache.misses,
            "unsynced_chunks": unsynced,
            "unsynced_bytes": unsynced_bytes,
            "adopted_chunks": self.adopted_chunks,
            "adopted_bytes": self.adopted_bytes,
            "agent_fetches": self.fetches,
            "direct_reads": self.direct_reads,
            "updated": time.time(),
        }

    def close(self) -> None:
        """Drop what was never acknowledged; the link is its owner's to close."""
        if self._closed:
            return
        self._closed = True
        self.discard_unsynced()


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None
