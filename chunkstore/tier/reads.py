"""Reading a chunk from a staging directory: staged/ first, then the host cache (cache/).

A mixin shared by WriteBehindTier (the process that owns the uploaders) and HostStager (a
rank process that stages its own files and leaves the rest to its host's agent): both read
the same directory the same way, verified; they differ only in what a miss does
(`_fetch_missing`: the tier fetches from the nodes itself, the stager asks the agent).
Needs `staged_dir`, `cache` (chunkstore.cache.ChunkCache) and `store` on the instance."""

from __future__ import annotations

import logging
import os

from chunkstore import codec
from chunkstore.cache import ChunkCache, read_object, read_object_into
from chunkstore.ids import chunk_id
from chunkstore.store import ChunkStore

log = logging.getLogger("ckptfs.tier")


class StagingReads:
    """get / read_into over staged/ and cache/ of a staging directory."""

    staged_dir: str
    cache: ChunkCache
    store: ChunkStore

    def _fetch_missing(self, cid: bytes, view: bool) -> bytes | memoryview:
        """The raw bytes of a chunk neither staged nor cached here (ChunkUnavailable)."""
        raise NotImplementedError

    def get(self, cid: bytes, *, view: bool = False) -> bytes | memoryview:
        """Verified raw bytes: staged copy, else the host cache, else the nodes (once per host).

        view=True: uncompressed local copies are read the fast way (cache.read_object)."""
        raw = self._read_staged(cid, view)
        if raw is not None:
            return raw
        raw = self.cache.lookup(cid, view)
        if raw is not None:
            self.cache.hits += 1
            return raw
        return self._fetch_missing(cid, view)

    def read_into(self, cid: bytes, views: list[memoryview], *, nowait: bool = False) -> bool:
        """The local copy of a raw chunk (staged, else cached) read straight into `views`
        (cache.read_object_into); False when there is none usable: then `get`.
        nowait=True: from memory only, else BlockingIOError (read_object_into)."""
        seed = self.store.seed
        try:
            if read_object_into(
                os.path.join(self.staged_dir, cid.hex()), views, cid, seed, nowait=nowait
            ):
                return True
        except codec.ChunkFormatError as e:  # as _read_staged reports it
            log.error("staged chunk %s is corrupt: %s", cid.hex(), e)
        path = self.cache.path(cid)
        try:
            if not read_object_into(path, views, cid, seed, nowait=nowait):
                return False
        except codec.ChunkFormatError:
            return False  # the decoding read drops it, with a warning, and fetches it again
        self.cache.hits += 1
        try:
            os.utime(path)  # LRU touch, as a cache lookup does
        except OSError:
            pass
        return True

    def _read_staged(self, cid: bytes, view: bool = False) -> bytes | memoryview | None:
        try:
            raw = read_object(os.path.join(self.staged_dir, cid.hex()), view)
            if chunk_id(raw, self.store.seed) != cid:
                raise codec.ChunkFormatError("content does not match its chunk id")
        except FileNotFoundError:
            return None
        except codec.ChunkFormatError as e:
            log.error("staged chunk %s is corrupt: %s", cid.hex(), e)
            return None
        return raw
