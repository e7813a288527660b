"""torch.distributed.checkpoint backend: ranks write the volume directly, no FUSE in the path.

Layout mirrors FileSystemWriter (`.metadata` plus `__{rank}_{n}.distcp`, every item
`torch.save`d at the same offsets), so a checkpoint saved here loads with FileSystemReader
through the mount and vice versa. By default tensors are serialized without torch's zip
CRC32 (built per call, nothing process-global: see `save_tensor`); our chunks carry their
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

import dataclasses
import io
import os
import pickle
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from fusefs.client.registry import tier_spec, volume_for
from fusefs.client.sink import NO_HINT, Hint
from fusefs.client.volume import FileWriter, Volume
from fusefs.dcp.envelope import address, save_tensor
from fusefs.dcp.registry import (
    METADATA_FILE,
    CkptfsError,
    meta_failure,
    new_id,
    norm_path,
    parse_ckpt_path,
    volume_spec,
)
from metadata.engine import MetaError


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
        self.volume = volume_spec(volume)
        self.tier = tier_spec(staging, durability, staging_size)
        self._job_arg, self._step_arg = job, step
        self.path = norm_path(path)
        self.job, self.step = parse_ckpt_path(self.path, job, step)
        self.single_file_per_rank = single_file_per_rank
        self.zip_crc32 = bool(zip_crc32)
        self.thread_count = thread_count
        self.deadline_s = deadline_s
        self.publish_timeout = publish_timeout
        self.save_id = new_id()
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
            self.path = norm_path(checkpoint_id)
            self.job, self.step = parse_ckpt_path(self.path, self._job_arg, self._step_arg)
        self.save_id = new_id()
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
        volume_for(
            self.volume, self.tier
        )  # open early: a bad volume fails the plan step on every rank
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: open the step (hidden until every rank has committed)."""
        meta = volume_for(self.volume, self.tier).meta
        try:
            info = meta.begin(
                self.job, self.step, len(plans), path=self.path, deadline_s=self.deadline_s
            )
        except MetaError as e:
            raise meta_failure(f"cannot start {self.job} step {self.step}: {e}", e) from e
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
            with self._aborting(f"rank {self.rank}", "write_data"):
                results, files = self._write_files(rp, plan.items, planner)
                volume_for(self.volume, self.tier).sink.sync()  # one batch of fsyncs
                if self.is_coordinator:
                    self._pending = files  # committed with .metadata in finish()
                else:
                    self._commit(files)
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
        vol = volume_for(self.volume, self.tier)
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
        meta = volume_for(self.volume, self.tier).meta
        return meta.commit_rank(
            self.job, self.step, self.rank, files, host=socket.gethostname()[:255]
        )

    def _discard_unsynced(self) -> None:
        """Staged-but-unsynced chunks left after write_data belong to a failed save."""
        try:
            volume_for(self.volume, self.tier).sink.discard_unsynced()
        except Exception:  # noqa: S110 - the original error is the one to report
            pass

    @contextmanager
    def _aborting(self, who: str, where: str) -> Iterator[None]:
        """Any failure aborts the step, so `latest` stays at the previous one. MetaError is
        re-raised as CkptfsError: it does not unpickle, and DCP gathers errors across ranks."""
        try:
            yield
        except MetaError as e:
            self._abort(f"{who} failed in {where}: {e}")
            raise meta_failure(f"{who}: {e} (errno {e.errno})", e) from None
        except BaseException as e:
            self._abort(f"{who} failed in {where}: {e!r}")
            raise

    def _abort(self, reason: str) -> None:
        try:
            vol = volume_for(self.volume, self.tier)
            vol.meta.abort(self.job, self.step, reason[:500])
            vol.sink.end_leases()  # this save's chunks are nobody's: gc may take them
        except Exception:  # noqa: S110 - the original error is the one to report
            pass

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write `.metadata`, commit rank 0 last, which publishes the step."""
        try:
            with self._aborting("coordinator", "finish"):
                metadata.version = CURRENT_DCP_VERSION
                storage_md = {}
                for wr_list in results:
                    storage_md.update({wr.index: wr.storage_data for wr in wr_list})
                metadata.storage_data = storage_md
                metadata.storage_meta = self.storage_meta()
                vol = volume_for(self.volume, self.tier)
                w = FileWriter(vol, 0, inline=False)
                try:
                    w.write(pickle.dumps(metadata))
                    w.close(commit=False)
                except BaseException:
                    w.abort()
                    raise
                files = [*self._pending, w.stream.record(METADATA_FILE)]
                info = self._commit(files)
                if info["state"] == "open":
                    info = vol.meta.wait_published(
                        self.job, self.step, timeout=self.publish_timeout
                    )
                if info["state"] != "published":
                    raise CkptfsError(
                        f"{info['job']} step {info['step']} was not published: "
                        f"{info['state']} {info.get('reason', '')}"
                    )
        finally:
            self._pending = []


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_FLOAT_WIDTH = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float64: 8}


class _ChunkFile:
    """A volume file being written, never committed to the namespace (commit_rank does that).

    Where DCP cuts chunks: by the volume's chunker (chunkstore.chunker), forced at every
    item, and (fixed chunking, the default) as lists of views, so a tensor's bytes stay
    where they are (views of its storage), are hashed in place and copied once, only when
    the chunk is new: an unchanged tensor costs a hash and
    a share of one query. Each chunk carries a codec hint from its item's dtype. What
    happens to the chunks is the volume's chunk sink's business (fusefs.client.sink), with
    bigger "which exist?" batches than a FileWriter's."""

    def __init__(self, vol: Volume, batch: int, inflight: int) -> None:
        self.vol = vol
        self.fixed = vol.settings.chunking == "fixed"
        self.chunker = vol.make_chunker(views=True)  # the volume's cutter (chunkstore.chunker)
        self.stream = vol.sink.stream(inline=False, batch=batch, inflight=inflight)
        self.hint: Hint = NO_HINT
        self._keep: list[torch.Tensor] = []  # tensors whose storage our pieces view
        self._source: tuple[int, int] | None = None  # (address, nbytes) of the item's storage

    @property
    def size(self) -> int:
        return self.stream.size

    def set_item(self, t: torch.Tensor | None) -> None:
        """The item about to be written: its dtype picks the codec hint; views of its storage
        may be kept as chunk pieces (the tensor is kept alive until close)."""
        width = _FLOAT_WIDTH.get(t.dtype) if t is not None else None
        if width is not None and self.vol.settings.compression == "auto":
            self.hint = ("float", width)
        else:
            self.hint = NO_HINT
        self._source = None
        if t is not None and self.fixed and t.nbytes:
            self._keep.append(t)
            self._source = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

    def _stable(self, mv: memoryview) -> bool:
        """Is this write a view of the item's own storage (safe to keep without a copy)?"""
        if self._source is None or mv.nbytes < _KEEP_MIN:
            return False
        addr = address(mv)
        lo, n = self._source
        return lo <= addr and addr + mv.nbytes <= lo + n

    def write(self, data: Any) -> int:
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if self.fixed and not self._stable(mv):
            mv = memoryview(bytes(mv))  # torch reuses its small buffers: copy those
        self.stream.add_chunks(self.chunker.feed(mv), self.hint)
        return mv.nbytes

    def cut(self) -> None:
        self.stream.add_chunks(self.chunker.cut(), self.hint)

    def close(self) -> None:
        self.stream.add_chunks(self.chunker.finish(), self.hint)
        self.stream.finish()
        self._keep = []

    def abort(self) -> None:
        self.stream.abort()
        self._keep = []


_KEEP_MIN = 64 * 1024  # smaller writes are copied (cheap, and may be torch's own buffers)


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
                save_tensor(t, sink)
            results.append(_result(item, name, off, sink.n))
        w.close()
    except BaseException:
        w.abort()
        raise
    return results, w.stream.record(name)


def _result(item: WriteItem, name: str, off: int, n: int) -> WriteResult:
    return WriteResult(index=item.index, size_in_bytes=n, storage_data=_StorageInfo(name, off, n))
