"""CkptfsReader: DCP's StorageReader over a ckptfs volume.

Chunks are fetched in parallel, ordered by file offset, through Volume.fetch_chunk (the
host read cache with single-flight when a tier is attached), at most READ_WINDOW raw bytes
ahead of the item being decoded. A tensor whose envelope is known is read straight into
its target (no torch.load); the range arithmetic is fusefs.client.extents."""

from __future__ import annotations

import errno
import functools
import io
import os
import pickle
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future as CFuture
from concurrent.futures import wait as futures_wait
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    _StorageInfo,
    _StorageReaderTransforms,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fusefs.client import extents as ext
from fusefs.client.extents import maybe_inline
from fusefs.client.registry import tier_spec, volume_for
from fusefs.client.volume import Volume
from fusefs.dcp.envelope import (
    Envelope,
    ViewReader,
    direct_envelope,
    load_in_place,
    tensor_bytes,
)
from fusefs.dcp.registry import (
    METADATA_FILE,
    CkptfsError,
    meta_failure,
    new_id,
    norm_path,
    volume_spec,
)
from metadata.engine import Extent, MetaError

READ_WINDOW = 256 * 2**20  # raw chunk bytes fetched ahead of the item being decoded


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
        self.volume = volume_spec(volume)
        self.tier = tier_spec(staging, "local", staging_size)
        self.path = norm_path(path)
        self.read_window = max(1, int(read_window))
        self.storage_data: dict[Any, Any] = {}
        self.load_id = new_id()
        self.transforms = _StorageReaderTransforms()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["storage_data"] = {}
        return state

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = norm_path(checkpoint_id)
        self.load_id = new_id()

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def _file(self, rel: str) -> tuple[int, list[Extent]]:
        vol = volume_for(self.volume, self.tier)
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
            raise meta_failure(f"reading {self.path}: {e} (errno {e.errno})", e) from None

    def _read_metadata(self, rank: int | None) -> Metadata:
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        size, extents = self._file(name)
        data = b"".join(
            bytes(b)
            for b in _assemble(
                volume_for(self.volume, self.tier), extents, [(0, size)], self.read_window
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
            raise meta_failure(f"reading {self.path}: {e} (errno {e.errno})", e) from None
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        vol = volume_for(self.volume, self.tier)
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
        (`Envelope`): then the stored tensor *is* those bytes, read by the kernel into
        the target (`Volume.read_chunk_into`, id checked), with no torch.load, no mapping
        and no second copy. Anything else, including a failed read, takes `_assemble`.

        The targets are resolved up front and filled concurrently, so an item whose target
        shares memory with another item's (tied weights; a planner that hands out one
        scratch buffer and copies it out in commit_tensor) takes the ordinary path too:
        one item at a time, in offset order, resolved again right before its copy, as
        FileSystemReader does."""
        starts = ext.starts_of(extents)
        plans: list[tuple[ReadItem, torch.Tensor, Envelope | None, list | None]] = []
        for req in reqs:
            md: _StorageInfo = self.storage_data[req.storage_index]
            if req.type != LoadItemType.TENSOR or md.transform_descriptors:
                continue
            target = planner.resolve_tensor(req).detach()
            env = direct_envelope(req, target)
            pieces = None
            if env is not None and md.length == len(env.head) + target.nbytes + len(env.tail):
                pieces = ext.whole_chunks(extents, starts, md.offset, md.length)
            plans.append((req, target, env, pieces))
        shared = _shared_memory([_span(t) for _, t, _, _ in plans])
        jobs: list[tuple[ReadItem, torch.Tensor, Envelope, bytearray, bytearray, CFuture]] = []
        done: set[int] = set()
        try:
            for i, (req, target, env, pieces) in enumerate(plans):
                if env is None or pieces is None or i in shared:
                    continue
                head, tail = bytearray(len(env.head)), bytearray(len(env.tail))
                layout = [memoryview(head), tensor_bytes(target), memoryview(tail)]
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
            stream = ViewReader(data)  # no transform: read the chunk bytes in place
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return
        tensor = None
        if not md.transform_descriptors and isinstance(data, memoryview) and not data.readonly:
            tensor = load_in_place(data)
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


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The memory [lo, hi) a tensor's elements lie in (empty for no elements)."""
    if not t.numel():
        return (0, 0)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _shared_memory(spans: list[tuple[int, int]]) -> set[int]:
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


def _assemble(
    vol: Volume, extents: list[Extent], ranges: list[tuple[int, int]], window: int
) -> Iterator[bytes | memoryview]:
    """Bytes of each (offset, length) range, in order; chunks fetched ahead in parallel.

    Every chunk is fetched once per call however many ranges use it, through
    Volume.fetch_chunk (the host read cache with single-flight when a tier is
    attached), at most `window` raw bytes ahead of the range being assembled.
    """
    starts = ext.starts_of(extents)
    pieces = [ext.pieces(extents, starts, off, off + n) for off, n in ranges]
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
                # the whole chunk (an item is one chunk, usually): the bytes object itself
                at = e.chunk_off + lo - e.offset
                whole = at == 0 and n == len(raw) and isinstance(raw, bytes)
                out: bytes | memoryview = raw if whole else ext.view(e, raw, lo, hi)
            else:
                buf = bytearray(n)  # holes (no extent) read as zeros
                for e, lo, hi in mine:
                    ext.fill(buf, off, e, futs[e.chunk_id].result(), lo, hi)
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
