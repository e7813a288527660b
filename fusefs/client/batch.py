"""Many files through one pass of the chunk sink, and back: what a host does for its ranks.

A host that saves for hundreds of ranks at once (the load-test harness's simulated hosts, a
host agent speaking for its local ranks) pays, when each rank writes alone, fixed costs per
rank that dwarf its bytes: a "which exist?" query (a write transaction on the service: it
leases what is missing), a thread hand-off per chunk, a sync of the tier with its own pool
of fsyncs, a commit request. Measured at 4,096 ranks of 256 KiB (docs/benchmark-history.md)
that was ~3.5 ms of CPU per rank against 30 us of hashing. Here a batch of files is

    cut            by the volume's chunker, a boundary after each buffer (as FileWriter.cut)
    -> ids         one hashing task per pool worker for the whole batch (ChunkSink.ids)
    -> which exist one query for the batch's distinct ids (ChunkSink.plan, as every writer)
    -> store       the new ones, one task per worker, each storing its share (ChunkSink.store)
    -> sync        one acknowledgement for the batch (ChunkSink.sync)

so the fixed cost is paid per batch. The chunks, their ids, where they go and the records
handed to the commit are exactly what a FileWriter would produce for the same bytes: this
is a batching of the one write path (sink.py), not a second one.

Reading back (`read_many`) reads the files whose chunks are in memory on the calling
thread, and splits the rest over the pool's workers; each reads its files' chunks straight
into the file's buffer when the host tier holds them raw (else through Volume.fetch_chunk,
which verifies), and runs the caller's check on the buffer before dropping it, so decoding
and verifying happen in the thread that read the bytes and memory stays at one file per
worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from fusefs.client import extents as ext
from metadata.engine import Extent, NewChunk

if TYPE_CHECKING:
    from fusefs.client.sink import Buffer
    from fusefs.client.volume import Volume

T = TypeVar("T")
Timings = dict[str, float]


@dataclass
class StagedFile:
    """One file of a batch: stored and acknowledged, not committed (commit_rank names it)."""

    size: int = 0
    extents: list[Extent] = field(default_factory=list)
    new_chunks: list[NewChunk] = field(default_factory=list)  # the batch's new chunks it uses
    stored: int = 0  # bytes written for the new chunks it was the first to use

    def record(self, path: str) -> dict:
        """The file as commit_rank takes it."""
        return {
            "path": path,
            "size": self.size,
            "extents": self.extents,
            "new_chunks": self.new_chunks,
        }


def _timed(timings: Timings | None, name: str, t0: float) -> float:
    now = time.perf_counter()
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + now - t0
    return now


def stage_files(
    vol: Volume, files: Sequence[Sequence[Buffer]], timings: Timings | None = None
) -> list[StagedFile]:
    """Store the contents of many files (each a sequence of buffers) and acknowledge them.

    Returns one StagedFile per file, in order. `timings`, if given, gets the wall seconds
    of each stage added under "chunk", "hash", "exist", "store" and "sync". Raises what
    the sink raises; chunks stored before the error stay unacknowledged (the caller's
    `sink.discard_unsynced()` or a later sync decides), as with a FileWriter."""
    sink = vol.sink
    if vol.tier is not None:  # a save from here on: the host's uploaders hold off
        vol.tier.foreground()
    t = time.perf_counter()
    out = [StagedFile() for _ in files]
    owner: list[int] = []  # file index of each chunk
    chunks: list[bytes] = []
    for i, bufs in enumerate(files):
        chunker = vol.make_chunker()
        for buf in bufs:
            got = chunker.feed(buf)
            got += chunker.cut()
            owner += [i] * len(got)
            chunks += got
    t = _timed(timings, "chunk", t)
    ids = sink.ids(chunks)
    t = _timed(timings, "hash", t)
    new = sink.plan(ids, [len(c) for c in chunks], inline=False)
    t = _timed(timings, "exist", t)
    todo = [k for k, store in enumerate(new) if store]
    stored = sink.spread(lambda k: sink.store(ids[k], [chunks[k]], len(chunks[k])), todo)
    records: dict[int, NewChunk] = dict(zip(todo, stored, strict=True))
    t = _timed(timings, "store", t)
    sink.sync()
    _timed(timings, "sync", t)
    seen: list[set[bytes]] = [set() for _ in files]  # each file's new chunks
    by_id = {rec.chunk_id: rec for rec in stored}
    for k, (cid, data) in enumerate(zip(ids, chunks, strict=True)):
        f, n = out[owner[k]], len(data)
        f.extents.append(Extent(f.size, n, cid, 0))
        f.size += n
        rec = records.get(k)
        if rec is not None:
            f.stored += rec.stored_len
        rec = by_id.get(cid)
        if rec is not None and cid not in seen[owner[k]]:
            seen[owner[k]].add(cid)
            f.new_chunks.append(rec)
    return out


def read_whole(vol: Volume, extents: list[Extent], size: int, *, nowait: bool = False) -> bytearray:
    """A file's bytes (holes read as zeros): chunks the host tier holds raw are read straight
    into the buffer (Volume.read_chunk_into); the rest come verified from fetch_chunk, after
    one request to bring them all to the host (a HostStager's `prefetch`: its agent fills
    the host cache with them at once, not one round trip per chunk).
    nowait=True: only from memory, else BlockingIOError (a chunk on the disk or elsewhere)."""
    buf = bytearray(size)
    mv = memoryview(buf)
    whole = ext.whole_chunks(extents, ext.starts_of(extents), 0, size)
    done: set[int] = set()
    if whole is not None:
        for i, (cid, off, n) in enumerate(whole):
            if vol.read_chunk_into(cid, [mv[off : off + n]], nowait=nowait):
                done.add(i)
    prefetch = None if nowait else getattr(vol.tier, "prefetch", None)
    if prefetch is not None and len(extents) - len(done) > 1:  # one request for them all
        prefetch(  # (not a maybe-inline chunk: no node holds one; fetch_chunk asks the meta)
            [e.chunk_id for i, e in enumerate(extents) if i not in done and not ext.maybe_inline(e)]
        )
    for i, e in enumerate(extents):
        if i in done:
            continue
        lo, hi = max(0, e.offset), min(size, e.offset + e.length)
        if hi > lo:
            if nowait:
                raise BlockingIOError("a chunk of the file is not held raw in memory here")
            raw = vol.fetch_chunk(e.chunk_id, view=True, small=ext.maybe_inline(e))
            ext.fill(buf, 0, e, raw, lo, hi)
    return buf


def read_many(
    vol: Volume,
    files: Sequence[tuple[list[Extent], int]],
    check: Callable[[int, bytearray], T],
) -> list[T]:
    """Read many files (extents, size) and return check(index, bytes) for each, in order;
    each buffer is dropped after its check.

    Files whose chunks are all in the page cache are read on the calling thread; from the
    first one that is not, the rest are split over the pool's workers, which overlap the
    disk. Why not always the pool: a warm chunk costs ~15 us of copying and ~35 us of
    Python, and spread over 8 threads each chunk's GIL hand-offs doubled the CPU of a
    warm load (512 files of 256 KiB: 115 us a file on one thread, 205-270 on 4-8) and
    made it slower too; cold, 8 workers read in half the time of one."""
    if vol.tier is not None:  # a job is waiting for these bytes: the uploaders hold off
        vol.tier.foreground()
    out: list[T] = []
    for i, (extents, size) in enumerate(files):
        try:
            buf = read_whole(vol, extents, size, nowait=True)
        except BlockingIOError:
            break
        out.append(check(i, buf))
        del buf  # memory stays at one file per thread
    rest = range(len(out), len(files))
    return out + vol.sink.spread(lambda i: check(i, read_whole(vol, *files[i])), rest)
