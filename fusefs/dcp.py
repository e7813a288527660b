"""torch.distributed.checkpoint backend: ranks write the volume directly, no FUSE in the path.

Layout mirrors FileSystemWriter (`.metadata` plus `__{rank}_{n}.distcp`, every item
`torch.save`d at the same offsets), so a checkpoint saved here loads with FileSystemReader
through the mount and vice versa. By default tensors are serialized without torch's zip
CRC32 (built per call, nothing process-global: see `_save_tensor`); our chunks carry their
own checksums and ids, verified on every read. `zip_crc32=True` gives FileSystemWriter's
exact bytes at ~1.3x the serialization cost. What differs is where bytes go:

- each file is cut into chunks at every item, so an unchanged tensor yields the same
  chunks (and stores nothing) even when its neighbours change. The tensor's bytes are
  hashed in place (views of its storage); only new chunks are copied, once;
- by default saves go through the host's write-behind tier (durability=local): new chunks
  are written raw to staging and fsync'd in one batch per rank just before its commit,
  so a save costs about what a local-disk save costs. Compression and the R replicas
  happen when the tier drains, after the save (its uploader yields to foreground writes
  on the host). `latest` advances at publish, `latest_durable` once drained; `drain()`
  waits for it, and a process drains at exit. `staging=False` writes straight to the
  nodes (compressed, durable on return);
- files are never committed into the live namespace. Each rank commits its files
  with the step's `commit_rank`; the coordinator commits last, in `finish`, with
  `.metadata`, which makes the metadata service publish the step atomically.
  Any failure aborts the step, so `latest` stays at the previous step;
- the writer pickles (no open Volume inside it): each process opens the volume
  lazily and keeps it in a per-process cache, which is what `dcp.async_save` in
  PROCESS mode needs.
"""

from __future__ import annotations

import atexit
import bisect
import dataclasses
import errno
import functools
import io
import logging
import os
import pickle
import re
import socket
import threading
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    _split_by_size_and_type,
    _StorageInfo,
    _StorageReaderTransforms,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

import chunkstore.writeback  # noqa: F401 - imported with this module, not inside the first save
import metadata.sqlite  # noqa: F401 - (the Volume imports them lazily; profiled: ~0.2 s a rank)
from chunkstore import codec
from fusefs.volume import FileWriter, Volume, drain_quietly, maybe_inline
from metadata.engine import DURABLE, Extent, MetaError, NewChunk

__all__ = [
    "CkptfsWriter",
    "CkptfsReader",
    "drain",
    "latest_step",
    "resume_path",
    "parse_ckpt_path",
]

log = logging.getLogger("ckptfs.dcp")
EXIT_DRAIN_S = 600.0  # how long a process waits at exit for its staged chunks to drain
METADATA_FILE = ".metadata"
READ_WINDOW = 256 * 2**20  # raw chunk bytes fetched ahead of the item being decoded
_STEP_RE = re.compile(r"(\d+)$")


class CkptfsError(RuntimeError):
    """A checkpoint-level problem a user can act on (bad path, step already used...)."""


# -- one Volume per process and spec ---------------------------------------------------------
_VOLUMES: dict[tuple, Volume] = {}
_VLOCK = threading.Lock()


TierSpec = (
    tuple[str | None, str, int | None] | None
)  # (staging dir or None=default, durability, size)


def _volume(spec: str, tier: TierSpec = None) -> Volume:
    """Open the volume once per process (the writer itself never holds one: it must pickle).

    With `tier`, the host write-behind tier is attached: saves return once chunks are
    staged on local disk, and reads go through the host read cache with single-flight.
    """
    key = (os.getpid(), spec, tier)
    with _VLOCK:
        vol = _VOLUMES.get(key)
        if vol is None:
            vol = Volume.open(spec, workers=_pool_size())
            if tier is not None:
                try:
                    vol.attach_tier(tier[0], tier[2], tier[1])
                except BaseException:
                    vol.close()
                    raise
            _VOLUMES[key] = vol
        return vol


def _pool_size() -> int:
    """Chunk threads per rank: the host's cores shared by its ranks (torchrun's
    LOCAL_WORLD_SIZE), at least 2 so hashing overlaps I/O, at most 8. Eight ranks with
    eight threads each on a 2-core host mostly add context switches."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(8, 2 * (cores or 1) // local))


def _tier_spec(staging: str | os.PathLike | bool | None, durability: str, size: int | None):
    if staging is None or staging is False:
        return None
    if durability not in ("local", "remote"):
        raise ValueError(f"durability must be local or remote, not {durability!r}")
    where = None if staging is True else os.path.abspath(os.fspath(staging))
    return (where, durability, size)


def drain(timeout: float | None = None) -> None:
    """Wait until every chunk this process staged is on the object nodes (marked durable).

    Saves return once chunks are fsync'd in the host's write-behind tier; a reader on another
    host (or one without the tier, e.g. a plain mount) needs them drained first."""
    with _VLOCK:
        tiers = [v.tier for k, v in _VOLUMES.items() if k[0] == os.getpid() and v.tier]
    for t in tiers:
        t.flush(timeout=timeout)


def close_volumes(drain_timeout: float | None = EXIT_DRAIN_S) -> None:
    """Close every volume this process opened (atexit; tests call it between volumes).

    Staged chunks are drained first (up to `drain_timeout`): a process that exits right after
    a save leaves its checkpoint on the nodes, not only journaled for the next tier on this
    host to adopt (which is still what happens if the drain times out: nothing is lost)."""
    with _VLOCK:
        mine = [k for k in _VOLUMES if k[0] == os.getpid()]
        vols = [_VOLUMES.pop(k) for k in mine]
    for v in vols:
        try:
            if v.tier is not None and drain_timeout:
                v.tier.flush(timeout=drain_timeout)
        except Exception as e:  # the journal keeps what did not drain
            log.warning("write-behind tier not drained at exit: %s", e)
        try:
            v.close()
        except Exception:  # noqa: S110 - best effort at exit
            pass


def _register_exit_drain() -> None:
    """Drain and close at exit *before* concurrent.futures stops accepting work (its hook
    runs at threading shutdown, ahead of plain atexit; the tier's uploads need the pools).
    threading._register_atexit hooks run last-registered first; atexit stays as a fallback."""
    hook = getattr(threading, "_register_atexit", None)
    if hook is not None:
        try:
            hook(close_volumes)
        except RuntimeError:  # already shutting down
            pass
    atexit.register(close_volumes)


_register_exit_drain()


def _spec(volume: Any) -> str:
    if isinstance(volume, Volume):
        raise TypeError(
            "pass the volume directory or ckptfs://HOST:PORT, not a Volume object: "
            "the writer must pickle for dcp.async_save"
        )
    if not isinstance(volume, str | os.PathLike):
        raise TypeError(f"volume must be a directory or ckptfs://HOST:PORT, not {volume!r}")
    s = os.fspath(volume)
    return s if s.startswith("ckptfs://") else os.path.abspath(s)


def _norm_path(path: Any) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"checkpoint path must be a string, not {path!r}")
    parts = [p for p in os.fspath(path).split("/") if p and p != "."]
    if not parts or ".." in parts:
        raise ValueError(f"bad checkpoint path {path!r}: want e.g. 'job/step-000100'")
    return "/".join(parts)


def parse_ckpt_path(path: str, job: str | None = None, step: int | None = None) -> tuple[str, int]:
    """'a/job/step-000100' -> ('a/job', 100); explicit job/step win over the path."""
    parts = _norm_path(path).split("/")
    if step is None:
        m = _STEP_RE.search(parts[-1])
        if m is None:
            raise ValueError(
                f"cannot tell the step from {path!r}: end the path in a number "
                "(e.g. job/step-000100) or pass step="
            )
        step = int(m.group(1))
    if job is None:
        if len(parts) < 2:
            raise ValueError(f"cannot tell the job from {path!r}: use job/step-N or pass job=")
        job = "/".join(parts[:-1])
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, not {step!r}")
    return job, step


# -- writer ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank: its file prefix.

    Not the step: with DCP's plan caching (`DefaultSavePlanner(enable_plan_caching=True)`)
    a rank whose plan did not change gets its previous save's final plan back, storage_data
    and all, so anything per-save carried here would be the last save's. Each rank commits
    to its own writer's (job, step); a rank given another path than the coordinator's finds
    that step not begun and fails the save."""

    prefix: str


class _Sink(io.RawIOBase):
    """The file-like torch.save writes an item into (counts bytes, feeds the FileWriter)."""

    def __init__(self, w: FileWriter) -> None:
        self.w = w
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self.w.write(b)
        self.n += n
        return n


def _cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """As FileSystemWriter's loader: on CPU, with storage no larger than the tensor."""
    t = t.detach().cpu()
    if t.untyped_storage().size() != t.nbytes:
        t = t.clone()
    return t


class CkptfsWriter(StorageWriter, BlockingAsyncStager):
    """StorageWriter onto a ckptfs volume; publishes the step through the checkpoint API."""

    def __init__(
        self,
        volume: str | os.PathLike,
        path: str,
        *,
        job: str | None = None,
        step: int | None = None,
        single_file_per_rank: bool = True,
        thread_count: int = 1,
        deadline_s: float = 600.0,
        publish_timeout: float = 120.0,
        cache_staged_state_dict: bool = False,
        staging: str | os.PathLike | bool | None = True,
        durability: str = "local",
        staging_size: int | None = None,
        zip_crc32: bool = False,
    ) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if not isinstance(thread_count, int) or not 1 <= thread_count <= 64:
            raise ValueError("thread_count must be an integer in 1..64")
        self.volume = _spec(volume)
        self.tier = _tier_spec(staging, durability, staging_size)
        self._job_arg, self._step_arg = job, step
        self.path = _norm_path(path)
        self.job, self.step = parse_ckpt_path(self.path, job, step)
        self.single_file_per_rank = single_file_per_rank
        self.zip_crc32 = bool(zip_crc32)
        self.thread_count = thread_count
        self.deadline_s = deadline_s
        self.publish_timeout = publish_timeout
        self.save_id = _uuid()
        self.rank: int = 0
        self.is_coordinator = False
        self._pending: list[dict] = []

    # pickling: only specs and plain settings travel (async PROCESS mode)
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["state_dict_cache"] = None
        state["_pending"] = []
        return state

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = _norm_path(checkpoint_id)
            self.job, self.step = parse_ckpt_path(self.path, self._job_arg, self._step_arg)
        self.save_id = _uuid()
        self._pending = []

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked automatically: pass storage_writer=CkptfsWriter(...)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else 0
        if not kwargs.get("use_collectives", True) and _world() > 1:
            raise CkptfsError("CkptfsWriter needs use_collectives=True with more than one rank")
        self._pending = []

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        _volume(
            self.volume, self.tier
        )  # open early: a bad volume fails the plan step on every rank
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: open the step (hidden until every rank has committed)."""
        meta = _volume(self.volume, self.tier).meta
        try:
            info = meta.begin(
                self.job, self.step, len(plans), path=self.path, deadline_s=self.deadline_s
            )
        except MetaError as e:
            raise CkptfsError(f"cannot start {self.job} step {self.step}: {e}") from e
        if info["state"] != "open" or info["committed"]:
            raise CkptfsError(
                f"{self.job} step {self.step} is {info['state']} "
                f"({info['committed']}/{info['world_size']} ranks committed"
                + (f", {info['reason']}" if info.get("reason") else "")
                + "): save under a new step number"
            )
        return [
            dataclasses.replace(p, storage_data=_RankPlan(f"__{i}_")) for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rp: _RankPlan = plan.storage_data
        try:
            results, files = self._write_files(rp, plan.items, planner)
            tier = _volume(self.volume, self.tier).tier
            if tier is not None:
                tier.sync_staged()  # one batch of fsyncs per rank, before its commit
            if self.is_coordinator:
                self._pending = files  # committed with .metadata in finish()
            else:
                self._commit(files)
        except MetaError as e:  # MetaError does not unpickle: DCP gathers errors across ranks
            self._abort(f"rank {self.rank} failed in write_data: {e}")
            raise CkptfsError(f"rank {self.rank}: {e} (errno {e.errno})") from None
        except BaseException as e:
            self._abort(f"rank {self.rank} failed in write_data: {e!r}")
            raise
        finally:
            self._discard_unsynced()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_files(
        self, rp: _RankPlan, items: list[WriteItem], planner: SavePlanner
    ) -> tuple[list[WriteResult], list[dict]]:
        if self.single_file_per_rank:
            buckets = _split_by_size_and_type(self.thread_count, items)
        else:
            buckets = [[it] for it in items]
        names = [f"{rp.prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]
        vol = _volume(self.volume, self.tier)
        work = list(zip(names, buckets, strict=True))
        if self.thread_count == 1 or len(work) <= 1:
            done = [_write_file(vol, n, b, planner, zip_crc32=self.zip_crc32) for n, b in work]
        else:
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="ckptfs-dcp") as ex:
                done = list(
                    ex.map(
                        lambda nb: _write_file(
                            vol, nb[0], nb[1], planner, zip_crc32=self.zip_crc32
                        ),
                        work,
                    )
                )
        results = [r for res, _ in done for r in res]
        return results, [f for _, f in done]

    def _commit(self, files: list[dict]) -> dict:
        meta = _volume(self.volume, self.tier).meta
        return meta.commit_rank(
            self.job, self.step, self.rank, files, host=socket.gethostname()[:255]
        )

    def _discard_unsynced(self) -> None:
        """Staged-but-unsynced chunks left after write_data belong to a failed save."""
        try:
            tier = _volume(self.volume, self.tier).tier
            if tier is not None:
                tier.discard_unsynced()
        except Exception:  # noqa: S110 - the original error is the one to report
            pass

    def _abort(self, reason: str) -> None:
        try:
            _volume(self.volume, self.tier).meta.abort(self.job, self.step, reason[:500])
        except Exception:  # noqa: S110 - the original error is the one to report
            pass

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write `.metadata`, commit rank 0 last, which publishes the step."""
        try:
            metadata.version = CURRENT_DCP_VERSION
            storage_md = {}
            for wr_list in results:
                storage_md.update({wr.index: wr.storage_data for wr in wr_list})
            metadata.storage_data = storage_md
            metadata.storage_meta = self.storage_meta()
            vol = _volume(self.volume, self.tier)
            w = FileWriter(vol, 0, inline=False)
            try:
                w.write(pickle.dumps(metadata))
                w.close(commit=False)
            except BaseException:
                w.abort()
                raise
            files = [*self._pending, _file_record(METADATA_FILE, w)]
            info = self._commit(files)
            if info["state"] == "open":
                info = vol.meta.wait_published(self.job, self.step, timeout=self.publish_timeout)
            if info["state"] != "published":
                raise CkptfsError(
                    f"{info['job']} step {info['step']} was not published: "
                    f"{info['state']} {info.get('reason', '')}"
                )
        except MetaError as e:
            self._abort(f"coordinator failed in finish: {e}")
            raise CkptfsError(f"coordinator: {e} (errno {e.errno})") from None
        except BaseException as e:
            self._abort(f"coordinator failed in finish: {e!r}")
            raise
        finally:
            self._pending = []


def _uuid() -> str:
    import uuid

    return str(uuid.uuid4())


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _file_record(name: str, w: FileWriter | _ChunkFile) -> dict:
    return {
        "path": name,
        "size": w.size,
        "extents": w.extents,
        "new_chunks": list(w.new_chunks.values()),
    }


_FLOAT_WIDTH = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float64: 8}


class _ChunkFile:
    """A volume file being written, never committed to the namespace (commit_rank does that).

    Like fusefs.volume.FileWriter, plus what DCP knows: a forced cut at every item, a
    codec hint per chunk from the item's dtype, and bigger "which exist?" batches. With
    fixed chunking (the default) a chunk is a list of pieces: the tensor's bytes stay where
    they are (a view of its storage), are hashed in place, and are copied once, only when
    the chunk is new, so an unchanged tensor costs a hash and a share of one query. With a
    write-behind tier, new chunks are staged raw and unsynced (`tier.put(sync=False)`):
    compression runs at upload time (`codec.transcoder`), the fsyncs once per rank before commit.
    """

    def __init__(self, vol: Volume, batch: int, inflight: int) -> None:
        self.vol = vol
        self.fixed = vol.settings.chunking == "fixed"
        self.chunk_size = vol.settings.chunk_size
        self.chunker = None if self.fixed else vol.make_chunker()
        self.batch_n = batch
        self.inflight_max = inflight
        self.size = 0
        self.extents: list[Extent] = []
        self.new_chunks: dict[bytes, NewChunk] = {}
        self.hint: tuple[str | None, int | None] = (None, None)
        self._pieces: list[bytes | memoryview] = []
        self._plen = 0
        self._keep: list[torch.Tensor] = []  # tensors whose storage our pieces view
        self._source: tuple[int, int] | None = None  # (address, nbytes) of the item's storage
        self._batch: list[tuple[int, list[bytes | memoryview], int, tuple]] = []
        self._inflight: deque[tuple[CFuture, int]] = deque()
        self._inflight_bytes = 0
        self._planned: set[bytes] = set()

    def set_item(self, t: torch.Tensor | None) -> None:
        """The item about to be written: its dtype picks the codec hint; views of its storage
        may be kept as chunk pieces (the tensor is kept alive until close)."""
        width = _FLOAT_WIDTH.get(t.dtype) if t is not None else None
        if width is not None and self.vol.settings.compression == "auto":
            self.hint = ("float", width)
        else:
            self.hint = (None, None)
        self._source = None
        if t is not None and self.fixed and t.nbytes:
            self._keep.append(t)
            self._source = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

    def _stable(self, mv: memoryview) -> bool:
        """Is this write a view of the item's own storage (safe to keep without a copy)?"""
        if self._source is None or mv.nbytes < _KEEP_MIN:
            return False
        addr = _address(mv)
        lo, n = self._source
        return lo <= addr and addr + mv.nbytes <= lo + n

    def write(self, data: Any) -> int:
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = mv.nbytes
        if self.chunker is not None:
            for ch in self.chunker.feed(mv):
                self._add([ch], len(ch))
            return n
        if not self._stable(mv):
            mv = memoryview(bytes(mv))  # torch reuses its small buffers: copy those
        pos = 0
        while pos < n:
            take = min(self.chunk_size - self._plen, n - pos)
            self._pieces.append(mv[pos : pos + take])
            self._plen += take
            pos += take
            if self._plen == self.chunk_size:
                self.cut()
        return n

    def cut(self) -> None:
        if self.chunker is not None:
            for ch in self.chunker.cut():
                self._add([ch], len(ch))
            return
        if self._plen:
            pieces, n = self._pieces, self._plen
            self._pieces, self._plen = [], 0
            self._add(pieces, n)

    def _add(self, pieces: list[bytes | memoryview], n: int) -> None:
        self._batch.append((self.size, pieces, n, self.hint))
        self.size += n
        if len(self._batch) >= self.batch_n:
            self._flush()

    def _flush(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        ids = self.vol.hash_many([pieces for _, pieces, _, _ in batch])
        ask = [cid for cid in dict.fromkeys(ids) if cid not in self._planned]
        missing = self.vol.missing_chunks(ask) if ask else set()
        for (off, pieces, n, (codec_name, width)), cid in zip(batch, ids, strict=True):
            self.extents.append(Extent(off, n, cid, 0))
            if cid in missing and cid not in self._planned:
                self._planned.add(cid)
                while self._inflight and self._inflight_bytes + n > self.inflight_max:
                    self._reap()
                fut = self.vol.pool.submit(_store, self.vol, cid, pieces, n, codec_name, width)
                self._inflight.append((fut, n))
                self._inflight_bytes += n

    def _reap(self) -> None:
        fut, n = self._inflight.popleft()
        self._inflight_bytes -= n
        rec = fut.result()
        self.new_chunks[rec.chunk_id] = rec

    def close(self) -> None:
        if self.chunker is not None:
            for ch in self.chunker.finish():
                self._add([ch], len(ch))
        self.cut()
        self._flush()
        while self._inflight:
            self._reap()
        self._keep = []

    def abort(self) -> None:
        drain_quietly(self._inflight)
        self._keep = []


_KEEP_MIN = 64 * 1024  # smaller writes are copied (cheap, and may be torch's own buffers)


def _store(
    vol: Volume,
    cid: bytes,
    pieces: list[bytes | memoryview],
    n: int,
    codec_name: str | None,
    width: int | None,
) -> NewChunk:
    """Encode and store one new chunk. With a local-durability tier: raw, unsynced (the
    tier compresses at upload time and the rank syncs once before commit)."""
    tier = vol.tier
    if tier is not None and tier.durability == "local":
        parts = codec.raw_parts(pieces)  # not joined: fileio.write_new copies them once
        state = tier.put(cid, parts, sync=False, width=width)
        return NewChunk(cid, n, n + codec.HEADER, state)
    raw = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    blob = codec.encode(raw, codec_name or vol.settings.compression, elem_width=width)
    if tier is not None:
        state = tier.put(cid, blob)
    else:
        vol.store.put_encoded(cid, blob)
        state = DURABLE
    return NewChunk(cid, n, len(blob), state)


def _save_tensor(t: torch.Tensor, sink: Any) -> None:
    """torch.save(t, sink) without the zip CRC32 (the chunks carry their own checksums).

    torch computes a CRC32 of every record unless told not to, and the switch
    (`set_crc32_options`) is process-global. This builds the same zip writer torch.save does
    with the flag passed explicitly, so nothing global changes (async THREAD saves, other
    threads' torch.save are unaffected). Bytes and offsets equal torch.save's with CRC off.

    Without the CRC, everything torch.save writes around a plain tensor's bytes (the
    pickle, the zip headers and directory: ~1.5 KB in ~40 writes) depends only on the
    tensor's type, dtype, shape and strides. The first save of each such form is captured
    (`_Envelope`); later ones write the captured bytes around the tensor's own. A 40-tensor
    rank spent ~16% of its step-2 CPU in torch's pickling and zip writer."""
    if _NO_CRC_SAVE is None:
        torch.save(t, sink)
        return
    key = _envelope_key(t)
    env = _ENVELOPES.get(key) if key is not None else None
    if env is not None:
        sink.write(env.head)
        sink.write(_tensor_bytes(t))
        sink.write(env.tail)
        return
    rec = _Recorder(sink, t) if key is not None else sink
    writer = torch._C.PyTorchFileWriter(rec, False, _NO_CRC_SAVE)
    torch.serialization._save(t, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    if key is not None:
        env = rec.envelope()
        if env is not None and len(_ENVELOPES) < _ENVELOPES_MAX:
            _ENVELOPES[key] = env


class _Envelope(NamedTuple):
    head: bytes  # what torch.save writes before the tensor's bytes
    tail: bytes  # and after them


_ENVELOPES: dict[tuple, _Envelope] = {}
_ENVELOPES_MAX = 4096  # distinct tensor forms remembered per process


def _envelope_key(t: torch.Tensor) -> tuple | None:
    """The form of a tensor whose torch.save bytes are an envelope around its own bytes,
    or None (a subclass, a grad-tracking or hooked tensor, Python attributes, tensor
    metadata, a view into a larger storage, conj/neg bits, nesting: saved by torch
    every time)."""
    if (
        type(t) is not torch.Tensor
        or t.requires_grad
        or t.layout is not torch.strided
        or t.device.type != "cpu"
        or not t.is_contiguous()
        or t.storage_offset()
        or not t.nbytes
        or t.untyped_storage().nbytes() != t.nbytes
        or t.is_conj()
        or t.is_neg()
        or t.is_quantized
        or t.is_nested
        or t._backward_hooks
        or t.__dict__
        or torch._utils.get_tensor_metadata(t)
    ):
        return None
    return (t.dtype, tuple(t.shape), t.stride())


def _address(mv: memoryview) -> int:
    """Where a buffer's bytes start in memory (read-only buffers too)."""
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Recorder:
    """A sink that forwards torch.save's writes and keeps them, to capture an envelope."""

    def __init__(self, sink: Any, t: torch.Tensor) -> None:
        self.sink = sink
        self.addr, self.n = t.untyped_storage().data_ptr(), t.nbytes
        self.parts: list[bytes | None] = []  # None: the tensor's own bytes

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        if mv.nbytes == self.n and _address(mv) == self.addr:
            self.parts.append(None)
        else:
            self.parts.append(bytes(mv))  # torch reuses its small buffers: copy now
        return self.sink.write(mv)

    def envelope(self) -> _Envelope | None:
        """The writes around the tensor's storage (None if torch wrote it in pieces, or
        not at all: then nothing is cached)."""
        if self.parts.count(None) != 1:
            return None
        i = self.parts.index(None)
        return _Envelope(b"".join(self.parts[:i]), b"".join(self.parts[i + 1 :]))  # type: ignore[arg-type]


def _no_crc_alignment() -> int | None:
    """Storage alignment for _save_tensor, or None if this torch's internals differ."""
    try:
        import inspect

        params = list(inspect.signature(torch.serialization._save).parameters)
        if params != [
            "obj",
            "zip_file",
            "pickle_module",
            "pickle_protocol",
            "_disable_byteorder_record",
        ]:
            return None
        return int(torch.serialization._get_storage_alignment())
    except (AttributeError, TypeError, ValueError):
        return None


_NO_CRC_SAVE = _no_crc_alignment()


def _write_file(
    vol: Volume,
    name: str,
    items: list[WriteItem],
    planner: SavePlanner,
    batch: int = 16,
    inflight: int = 64 * 2**20,
    zip_crc32: bool = False,
) -> tuple[list[WriteResult], dict]:
    """One .distcp file, in FileSystemWriter's order: byte items, then tensors."""
    w = _ChunkFile(vol, batch, inflight)
    results: list[WriteResult] = []
    try:
        for item in [i for i in items if i.type == WriteItemType.BYTE_IO]:
            data = planner.resolve_data(item)
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{item.index.fqn}: byte item resolved to {type(data).__name__}")
            w.cut()
            w.set_item(None)
            off = w.size
            n = w.write(data.getbuffer())
            results.append(_result(item, name, off, n))
        for item in [i for i in items if i.type != WriteItemType.BYTE_IO]:
            t = _cpu_tensor(planner.resolve_data(item))
            w.cut()  # item boundary = chunk boundary: unchanged tensors dedup
            w.set_item(t)
            off = w.size
            sink = _Sink(w)
            if zip_crc32:
                torch.save(t, sink)
            else:
                _save_tensor(t, sink)
            results.append(_result(item, name, off, sink.n))
        w.close()
    except BaseException:
        w.abort()
        raise
    return results, _file_record(name, w)


def _result(item: WriteItem, name: str, off: int, n: int) -> WriteResult:
    return WriteResult(index=item.index, size_in_bytes=n, storage_data=_StorageInfo(name, off, n))


# -- reader ----------------------------------------------------------------------------------
class CkptfsReader(StorageReader):
    """StorageReader from a ckptfs volume: parallel chunk fetches ordered by file offset."""

    def __init__(
        self,
        volume: str | os.PathLike,
        path: str,
        *,
        read_window: int = READ_WINDOW,
        staging: str | os.PathLike | bool | None = True,
        staging_size: int | None = None,
    ) -> None:
        super().__init__()
        self.volume = _spec(volume)
        self.tier = _tier_spec(staging, "local", staging_size)
        self.path = _norm_path(path)
        self.read_window = max(1, int(read_window))
        self.storage_data: dict[Any, Any] = {}
        self.load_id = _uuid()
        self.transforms = _StorageReaderTransforms()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["storage_data"] = {}
        return state

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = _norm_path(checkpoint_id)
        self.load_id = _uuid()

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def _file(self, rel: str) -> tuple[int, list[Extent]]:
        vol = _volume(self.volume, self.tier)
        full = f"{self.path}/{rel}"
        try:
            attr = vol.resolve(full)
        except MetaError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                raise FileNotFoundError(
                    f"no {full} in volume {self.volume} (is the step published?)"
                ) from None
            raise
        if not attr.is_reg:
            raise CkptfsError(f"{full} is not a regular file")
        return attr.size, vol.meta.get_extents(attr.ino)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            return self._read_metadata(kwargs.get("rank"))
        except MetaError as e:
            raise CkptfsError(f"reading {self.path}: {e} (errno {e.errno})") from None

    def _read_metadata(self, rank: int | None) -> Metadata:
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        size, extents = self._file(name)
        data = b"".join(
            bytes(b)
            for b in _assemble(
                _volume(self.volume, self.tier), extents, [(0, size)], self.read_window
            )
        )
        metadata = pickle.loads(data)  # noqa: S301 - DCP's own format (FileSystemReader does the same)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise CkptfsError("checkpoint metadata has no storage_data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            self._read_all(plan, planner)
        except MetaError as e:  # MetaError does not unpickle: DCP gathers errors across ranks
            raise CkptfsError(f"reading {self.path}: {e} (errno {e.errno})") from None
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        vol = _volume(self.volume, self.tier)
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel in sorted(per_file):
            reqs = sorted(per_file[rel], key=lambda r: self.storage_data[r.storage_index].offset)
            size, extents = self._file(rel)
            for r in reqs:
                md: _StorageInfo = self.storage_data[r.storage_index]
                if md.offset + md.length > size:
                    raise CkptfsError(f"{self.path}/{rel}: item {r.storage_index} past end of file")
            if vol.tier is not None:
                reqs = self._read_direct(vol, extents, reqs, planner)
            infos = [self.storage_data[r.storage_index] for r in reqs]
            ranges = [(md.offset, md.length) for md in infos]
            for req, data in zip(
                reqs, _assemble(vol, extents, ranges, self.read_window), strict=True
            ):
                self._load_item(req, data, planner)

    def _read_direct(
        self, vol: Volume, extents: list[Extent], reqs: list[ReadItem], planner: LoadPlanner
    ) -> list[ReadItem]:
        """Load the tensor items that can go straight into their targets; return the others.

        An item qualifies when it is whole chunks this host holds raw (staged or cached),
        its target is a plain contiguous tensor of the stored shape, and the bytes around
        the tensor's are exactly the envelope torch.save writes for that dtype and shape
        (`_Envelope`): then the stored tensor *is* those bytes, read by the kernel into
        the target (`Volume.read_chunk_into`, id checked), with no torch.load, no mapping
        and no second copy. Anything else, including a failed read, takes `_assemble`.

        The targets are resolved up front and filled concurrently, so an item whose target
        shares memory with another item's (tied weights; a planner that hands out one
        scratch buffer and copies it out in commit_tensor) takes the ordinary path too:
        one item at a time, in offset order, resolved again right before its copy, as
        FileSystemReader does."""
        starts = [e.offset for e in extents]
        plans: list[tuple[ReadItem, torch.Tensor, _Envelope | None, list | None]] = []
        for req in reqs:
            md: _StorageInfo = self.storage_data[req.storage_index]
            if req.type != LoadItemType.TENSOR or md.transform_descriptors:
                continue
            target = planner.resolve_tensor(req).detach()
            env = _direct_envelope(req, target)
            pieces = None
            if env is not None and md.length == len(env.head) + target.nbytes + len(env.tail):
                pieces = _whole_chunks(extents, starts, md.offset, md.length)
            plans.append((req, target, env, pieces))
        shared = _overlapping([_span(t) for _, t, _, _ in plans])
        jobs: list[tuple[ReadItem, torch.Tensor, _Envelope, bytearray, bytearray, CFuture]] = []
        done: set[int] = set()
        try:
            for i, (req, target, env, pieces) in enumerate(plans):
                if env is None or pieces is None or i in shared:
                    continue
                head, tail = bytearray(len(env.head)), bytearray(len(env.tail))
                layout = [memoryview(head), _tensor_bytes(target), memoryview(tail)]
                reads = [(cid, _slices(layout, lo, n)) for cid, lo, n in pieces]
                fut = vol.pool.submit(_read_chunks, vol, reads)
                jobs.append((req, target, env, head, tail, fut))
            for req, target, env, head, tail, fut in jobs:
                if fut.result() and head == env.head and tail == env.tail:
                    planner.commit_tensor(req, target)
                    done.add(id(req))
        finally:  # on an error, no read may still be writing into a target after we return
            futs = [job[-1] for job in jobs]
            for fut in futs:
                fut.cancel()
            futures_wait(futs)
        return [r for r in reqs if id(r) not in done]

    def _load_item(self, req: ReadItem, data: bytes | memoryview, planner: LoadPlanner) -> None:
        md: _StorageInfo = self.storage_data[req.storage_index]
        if md.transform_descriptors:
            stream = self.transforms.transform_load_stream(
                req, md.transform_descriptors, io.BytesIO(data)
            )
        elif isinstance(data, bytes):
            stream = io.BytesIO(data)  # shares the bytes (no copy) and reads them in C
        else:
            stream = _ViewReader(data)  # no transform: read the chunk bytes in place
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return
        tensor = None
        if not md.transform_descriptors and isinstance(data, memoryview) and not data.readonly:
            tensor = _load_in_place(data)
        if tensor is None:
            if not stream.seekable():
                stream = io.BytesIO(stream.read(-1))
            tensor = torch.load(stream, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CkptfsError(
                f"item {req.storage_index}: stored size {tuple(tensor.size())} "
                f"does not match the target {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def _direct_envelope(req: ReadItem, target: torch.Tensor) -> _Envelope | None:
    """The envelope torch.save (CRC off, as _save_tensor) writes around a contiguous tensor
    of the target's dtype and shape, when the item is all of the stored tensor and the
    target can take its bytes as they are (any storage around it is left alone); else None."""
    if (
        _NO_CRC_SAVE is None
        or type(target) is not torch.Tensor
        or target.device.type != "cpu"
        or target.layout is not torch.strided
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
        or target.is_quantized
        or not target.nbytes
        or any(req.storage_offsets)
        or tuple(req.lengths) != tuple(target.size())
    ):
        return None
    shape = tuple(target.size())
    stride, step = [], 1
    for n in reversed(shape):  # a fresh tensor's strides, as torch.empty makes them
        stride.append(step)
        step *= max(n, 1)
    key = (target.dtype, shape, tuple(reversed(stride)))
    env = _ENVELOPES.get(key)
    if env is None and len(_ENVELOPES) < _ENVELOPES_MAX:
        try:  # its pages are never touched, but the address space is reserved
            form = torch.empty(shape, dtype=target.dtype)
        except (RuntimeError, MemoryError):
            return None
        if _envelope_key(form) != key:
            return None
        _save_tensor(form, _NullSink())  # captures the envelope; the sink keeps nothing
        env = _ENVELOPES.get(key)
    return env


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The memory [lo, hi) a tensor's elements lie in (empty for no elements)."""
    if not t.numel():
        return (0, 0)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _overlapping(spans: list[tuple[int, int]]) -> set[int]:
    """Indexes of the spans that overlap another one (a sweep in address order)."""
    out: set[int] = set()
    top, top_i = -1, -1
    for i in sorted(range(len(spans)), key=lambda k: spans[k][0]):
        lo, hi = spans[i]
        if hi <= lo:
            continue
        if lo < top:
            out.update((i, top_i))
        if hi > top:
            top, top_i = hi, i
    return out


class _NullSink:
    def write(self, b: Any) -> int:
        return memoryview(b).nbytes


def _whole_chunks(
    extents: list[Extent], starts: list[int], off: int, n: int
) -> list[tuple[bytes, int, int]] | None:
    """(chunk id, offset in the item, length) of the whole chunks that tile [off, off+n)
    exactly, or None (holes, shared or partial chunks)."""
    i = bisect.bisect_left(starts, off)
    out = []
    pos = off
    while pos < off + n:
        if i >= len(extents):
            return None
        e = extents[i]
        if e.offset != pos or e.chunk_off != 0 or e.offset + e.length > off + n:
            return None
        out.append((e.chunk_id, pos - off, e.length))
        pos += e.length
        i += 1
    return out


def _slices(layout: list[memoryview], lo: int, n: int) -> list[memoryview]:
    """The views of bytes [lo, lo+n) of the concatenation of `layout`."""
    out = []
    base = 0
    for mv in layout:
        a, b = max(lo, base), min(lo + n, base + mv.nbytes)
        if b > a:
            out.append(mv[a - base : b - base])
        base += mv.nbytes
    return out


def _read_chunks(vol: Volume, reads: list[tuple[bytes, list[memoryview]]]) -> bool:
    return all(vol.read_chunk_into(cid, views) for cid, views in reads)


def _load_in_place(view: memoryview) -> torch.Tensor | None:
    """torch.load of a torch.save'd tensor whose storage *is* `view` (no copy): the item's
    one copy is then `target.copy_` straight from the mapped cache file, where torch.load
    would first copy every byte into a new storage. This is what torch.load(mmap=True) does
    for a file path, through the same loader (the weights-only unpickler, so the safety is
    the same); it is private API of the pinned torch, so any surprise falls back (None)."""
    try:
        from torch import _weights_only_unpickler
        from torch.serialization import _load, _open_zipfile_reader

        with _open_zipfile_reader(_ViewReader(view)) as zf:
            storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
            out = _load(zf, "cpu", _weights_only_unpickler, overall_storage=storage)
    except (ImportError, AttributeError, TypeError, RuntimeError, ValueError):
        return None
    return out if isinstance(out, torch.Tensor) else None


class _ViewReader(io.RawIOBase):
    """A seekable read-only file over bytes or a memoryview, without copying them first
    (io.BytesIO copies a memoryview; torch.load reads records with readinto)."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.mv = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.mv)}[whence]
        self.pos = max(0, base + off)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        dst = memoryview(b).cast("B")
        n = max(0, min(len(dst), len(self.mv) - self.pos))
        dst[:n] = self.mv[self.pos : self.pos + n]
        self.pos += n
        return n


def _assemble(
    vol: Volume, extents: list[Extent], ranges: list[tuple[int, int]], window: int
) -> Iterator[bytes | memoryview]:
    """Bytes of each (offset, length) range, in order; chunks fetched ahead in parallel.

    Every chunk is fetched once per call however many ranges use it, through
    Volume.fetch_chunk (the host read cache with single-flight when a tier is
    attached), at most `window` raw bytes ahead of the range being assembled.
    """
    starts = [e.offset for e in extents]
    pieces: list[list[tuple[Extent, int, int]]] = []  # per range: (extent, lo, hi) file offsets
    for off, n in ranges:
        end = off + n
        i = max(0, bisect.bisect_right(starts, off) - 1)
        mine = []
        while i < len(extents) and extents[i].offset < end:
            e = extents[i]
            lo, hi = max(off, e.offset), min(end, e.offset + e.length)
            if hi > lo:
                mine.append((e, lo, hi))
            i += 1
        pieces.append(mine)
    order = [e.chunk_id for mine in pieces for e, _, _ in mine]
    fetch = functools.partial(vol.fetch_chunk, view=True)
    uses = Counter(order)
    sizes = {e.chunk_id: e.chunk_off + e.length for mine in pieces for e, _, _ in mine}
    futs: dict[bytes, CFuture] = {}
    ahead = 0  # bytes of fetched-or-fetching chunks still to be used
    # Chunks that may be inline (small extents) come from the metadata in one query.
    small = list({e.chunk_id for mine in pieces for e, _, _ in mine if maybe_inline(e)})
    for cid, data in vol.inline_chunks(small).items():
        futs[cid] = CFuture()
        futs[cid].set_result(data)
        ahead += sizes[cid]
    nxt = 0

    def pump(upto: int) -> None:
        nonlocal nxt, ahead
        while nxt < len(order) and (nxt < upto or ahead < window):
            cid = order[nxt]
            nxt += 1
            if cid not in futs:
                futs[cid] = vol.pool.submit(fetch, cid)
                ahead += sizes[cid]

    try:
        pos = 0
        for (off, n), mine in zip(ranges, pieces, strict=True):
            pos += len(mine)
            pump(pos)
            if len(mine) == 1 and mine[0][1] == off and mine[0][2] == off + n:
                e, lo, hi = mine[0]
                raw = futs[e.chunk_id].result()
                a, b = e.chunk_off + lo - e.offset, e.chunk_off + hi - e.offset
                # the whole chunk (an item is one chunk, usually): the bytes object itself
                whole = a == 0 and b == len(raw) and isinstance(raw, bytes)
                out: bytes | memoryview = raw if whole else memoryview(raw)[a:b]
            else:
                buf = bytearray(n)  # holes (no extent) read as zeros
                for e, lo, hi in mine:
                    raw = futs[e.chunk_id].result()
                    buf[lo - off : hi - off] = memoryview(raw)[
                        e.chunk_off + lo - e.offset : e.chunk_off + hi - e.offset
                    ]
                out = buf
            for e, _, _ in mine:
                uses[e.chunk_id] -= 1
                if uses[e.chunk_id] == 0:
                    futs.pop(e.chunk_id)
                    ahead -= sizes[e.chunk_id]
            yield out
    finally:
        for f in futs.values():
            f.cancel()


# -- resume helpers --------------------------------------------------------------------------
def latest_step(volume: str | os.PathLike, job: str, *, durable: bool = False) -> int | None:
    """The newest published step of `job` (with durable=True: whose chunks are all on nodes)."""
    meta = _volume(_spec(volume)).meta
    return meta.latest_durable(job) if durable else meta.latest(job)


def resume_path(volume: str | os.PathLike, job: str, *, durable: bool = False) -> str | None:
    """The volume path to load from to resume `job`, or None when nothing was published."""
    step = latest_step(volume, job, durable=durable)
    if step is None:
        return None
    return _volume(_spec(volume)).meta.step_state(job, step)["path"]
