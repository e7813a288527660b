"""Dirty blocks of the mount's file cache: what a block keeps and what it copies."""

from __future__ import annotations

import errno
import os

import pytest
import trio
import trio.testing

from fusefs.client.volume import Volume
from fusefs.mount.blocks import (
    PIECE_MIN,
    PIECES_MAX,
    BufferPool,
    DirtyBlock,
    FileError,
    Pieces,
    parts_of,
)
from fusefs.mount.filecache import FileCache
from metadata.engine import MetaError

KiB = 1024
BLOCK = 4 * KiB * KiB


def _content(blk: DirtyBlock) -> bytes:
    return (
        b"".join(bytes(p) for p in parts_of(blk.buf))
        if isinstance(blk.buf, Pieces)
        else bytes(blk.buf)
    )


def test_unaligned_writers_split_requests_keep_big_pieces_uncopied():
    """A 1 MiB write() from a buffer 48 bytes past a page arrives as 1 MiB - 48 and 48
    bytes: the big requests stay views, the tails are copied as pieces of their own."""
    blk = DirtyBlock(1, 0, BufferPool(BLOCK, 2))
    want = bytearray()
    reqs = []
    for _ in range(4):
        big = os.urandom(KiB * KiB - 48)
        reqs.append(big)
        for part in (big, os.urandom(48)):
            blk.write(len(want), memoryview(part), stable=True)
            want += part
    assert isinstance(blk.buf, Pieces)
    assert len(blk.buf.parts) == 8
    assert _content(blk) == want and blk.covers(BLOCK)
    big_views = [p for p in blk.buf.parts if len(p) > 48]
    assert [p.obj for p in big_views] == reqs  # views of the requests, not copies


def test_a_small_head_then_big_appends_keep_the_bulk_uncopied():
    """torch.save starts most blocks with a few KiB (a zip header, or the end of a request
    that straddles the block boundary), then appends 1 MiB requests: the head is copied,
    the requests stay views. A pooled buffer taken at the first big append made every later
    write into the block a copy."""
    blk = DirtyBlock(1, 0, BufferPool(BLOCK, 2))
    head = os.urandom(3 * KiB)  # a request's last pages, the caller's buffer
    blk.write(0, memoryview(bytearray(head)), stable=False)
    want = bytearray(head)
    reqs = []
    while len(want) < BLOCK:
        req = os.urandom(min(KiB * KiB, BLOCK - len(want)))
        reqs.append(req)
        blk.write(len(want), memoryview(req), stable=True)
        want += req
    assert isinstance(blk.buf, Pieces)
    assert _content(blk) == want and blk.covers(BLOCK)
    assert [p.obj for p in blk.buf.parts[1:]] == reqs  # views of the requests


def test_small_appends_past_the_piece_limit_and_overwrites_materialize():
    blk = DirtyBlock(1, 0, BufferPool(BLOCK, 2))
    want = bytearray(os.urandom(PIECE_MIN))
    blk.write(0, memoryview(bytes(want)), stable=True)
    for _ in range(PIECES_MAX + 5):  # 4 KiB appends: pieces, then one buffer
        more = os.urandom(4 * KiB)
        blk.write(len(want), memoryview(more), stable=True)
        want += more
    assert not isinstance(blk.buf, Pieces)
    assert _content(blk)[: len(want)] == want
    blk2 = DirtyBlock(1, 0, BufferPool(BLOCK, 2))
    first = os.urandom(PIECE_MIN * 2)
    blk2.write(0, memoryview(first), stable=True)
    blk2.write(len(first), memoryview(b"tail"), stable=False)
    blk2.write(10, memoryview(b"XYZ"), stable=True)  # not an append: one buffer from here
    assert not isinstance(blk2.buf, Pieces)
    exp = bytearray(first + b"tail")
    exp[10:13] = b"XYZ"
    assert _content(blk2)[: len(exp)] == exp
    assert blk2.spans == [[0, len(exp)]]


def test_a_copied_tail_does_not_alias_a_reused_buffer():
    """An unstable (caller-owned) small append is copied: changing the caller's buffer
    afterwards changes nothing in the block."""
    blk = DirtyBlock(1, 0, BufferPool(BLOCK, 2))
    head = os.urandom(PIECE_MIN)
    blk.write(0, memoryview(head), stable=True)
    scratch = bytearray(b"abcdefgh")
    blk.write(len(head), memoryview(scratch), stable=False)
    scratch[:] = b"ZZZZZZZZ"
    assert _content(blk) == head + b"abcdefgh"


@pytest.fixture
def vol(tmp_path):
    v = Volume.create(str(tmp_path / "vol"))
    yield v
    v.close()


def _run(vol: Volume, attr, body) -> None:
    """`await body(cache, st)` with a FileCache on `vol` and `attr`'s file opened in it."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cache = FileCache(vol, nursery)
            await body(cache, await cache.open_state(attr))
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_commit_waits_for_a_block_that_another_task_is_sealing(vol):
    """An fsync while an eviction seals the file's partly written block (reading its gaps
    from the old content) must publish that block's writes. It used to go on without the
    block and mark its writes committed, so the next close published nothing: the fsync'd
    write was lost."""
    MiB = KiB * KiB
    old = os.urandom(4 * MiB)
    patch = os.urandom(MiB)
    attr = vol.write_file("/f", old)

    async def body(cache: FileCache, st) -> None:
        await cache.write(st, MiB, patch)  # block 0, partly written
        blk = st.blocks[0]
        cache.nursery.start_soon(cache.seal, st, blk)  # as an eviction does
        await trio.testing.wait_all_tasks_blocked()
        assert blk.busy and not st.sealing  # reading its gaps
        await cache.commit(st)  # the fsync
        assert not st.dirty and not st.blocks

    _run(vol, attr, body)
    want = old[:MiB] + patch + old[2 * MiB :]
    assert vol.read_file("/f") == want


def test_a_block_whose_store_failed_is_kept_and_stored_by_the_next_commit(vol):
    """The store of a sealed block fails (the metadata service unreachable past the
    client's retry window): the commit reports EIO once, the block stays dirty, and the
    next commit, with the service back, stores and publishes it. The data used to be
    dropped and the file marked failed for good."""
    MiB = KiB * KiB
    attr = vol.write_file("/f", b"")
    real = vol.meta.missing_chunks
    down = [True]

    def missing_chunks(ids):
        if down[0]:
            raise MetaError(errno.ETIMEDOUT, "metadata service unreachable")
        return real(ids)

    vol.meta.missing_chunks = missing_chunks  # type: ignore[method-assign]
    first, second = os.urandom(4 * MiB), os.urandom(MiB)

    async def body(cache: FileCache, st) -> None:
        await cache.write(st, 0, first)  # a whole block: sealed and stored at once
        await cache.write(st, 4 * MiB, second)
        with pytest.raises(FileError) as e:
            await cache.commit(st)  # the close while the service is down
        assert e.value.errno == errno.EIO
        assert st.dirty and 0 in st.blocks  # kept
        down[0] = False
        await cache.commit(st)  # the service is back: the next close stores it
        assert not st.dirty and not st.blocks

    _run(vol, attr, body)
    assert vol.read_file("/f") == first + second


def test_a_sealed_small_block_reads_back_before_its_commit(vol):
    """A block of at most INLINE_DATA_MAX bytes sealed by an eviction is stored nowhere
    until the commit carries it into the metadata, but the file's extents name it at once.
    Reads of it, and the gap read when the block is written again, must be served from the
    record the file holds: they returned EIO, and every later commit of the file failed."""
    from metadata.engine import INLINE, INLINE_DATA_MAX

    attr = vol.write_file("/log.csv", b"")
    first, more = os.urandom(10 * KiB), os.urandom(3 * KiB)
    assert len(first) <= INLINE_DATA_MAX

    async def body(cache: FileCache, st) -> None:
        await cache.write(st, 0, first)
        await cache.seal(st, st.blocks[0])  # as an eviction under dirty pressure
        await cache.settle(st)  # waits for the store (no block left to seal)
        (rec,) = st.new_chunks.values()
        assert rec.state == INLINE and not vol.meta.inline_data([rec.chunk_id])
        assert bytes(await cache.read(st, 0, len(first))) == first
        await cache.write(st, len(first), more)  # block 0 again, its head a gap
        await cache.commit(st)
        assert not st.dirty and not st.new_chunks

    _run(vol, attr, body)
    assert vol.read_file("/log.csv") == first + more


def test_records_of_superseded_small_blocks_are_dropped_before_the_commit(vol):
    """A small block sealed again and again (each time under dirty pressure, each time a
    new version) kept a record, with its bytes, per seal until the next commit: memory grew
    16 KiB a seal, and over the service such a commit outgrew the frame limit and failed
    for good. Records no extent names any more are dropped; the commit stores the last
    version, and the chunks of the versions before it are stored nowhere."""
    from fusefs.mount.blocks import RECORDS_MAX

    attr = vol.write_file("/f", b"")
    versions = [os.urandom(8 * KiB) for _ in range(3 * RECORDS_MAX)]

    async def body(cache: FileCache, st) -> None:
        most = 0
        for data in versions:
            await cache.write(st, 0, data)
            await cache.seal(st, st.blocks[0])
            await cache.settle(st)
            most = max(most, len(st.new_chunks))
        assert most <= RECORDS_MAX + 1
        assert bytes(await cache.read(st, 0, len(versions[-1]))) == versions[-1]
        await cache.commit(st)
        assert not st.dirty and not st.new_chunks

    _run(vol, attr, body)
    assert vol.read_file("/f") == versions[-1]
    old = vol.sink.ids(versions[:-1])
    assert vol.meta.missing_chunks(old) == set(old)
