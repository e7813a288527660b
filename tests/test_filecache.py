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


# -- layouts: where blocks are cut ------------------------------------------------------
def _torch_writes(sd: dict) -> list[bytes]:
    """torch.save's own write() calls, in order: what a writer then buffers or not."""
    import io

    torch = pytest.importorskip("torch")

    class Record(io.RawIOBase):
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            self.writes.append(bytes(b))
            return len(b)

    rec = Record()
    torch.save(sd, rec)
    return rec.writes


def _python_syscalls(writes: list[bytes], buffer_size: int = KiB * KiB) -> list[bytes]:
    """The write() calls of a Python file object (open(path, "wb") on the mount, whose
    st_blksize makes its buffer 1 MiB) that torch.save writes to."""
    import io

    calls: list[bytes] = []

    class Raw(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            calls.append(bytes(b))
            return len(b)

    f = io.BufferedWriter(Raw(), buffer_size=buffer_size)
    for w in writes:
        f.write(w)
    f.flush()
    return calls


def _cxx_syscalls(writes: list[bytes], buf: int = 8191, chunk: int = 1024) -> list[bytes]:
    """The write()/writev() calls of torch's C++ writer (torch.save to a path: libstdc++'s
    filebuf): small writes are buffered, a big one goes out in one call with them."""
    calls: list[bytes] = []
    pending = b""
    for w in writes:
        if len(w) >= min(chunk, buf - len(pending)):
            calls.append(pending + w)
            pending = b""
        else:
            pending += w
    if pending:
        calls.append(pending)
    return calls


async def _write_syscalls(cache: FileCache, st, calls: list[bytes], seed: int) -> None:
    """Each call as FUSE delivers it: requests of up to 1 MiB, the first one shorter by
    the buffer's misalignment (the kernel pins at most 256 pages a request)."""
    import random

    rng = random.Random(seed)
    pos = 0
    for call in calls:
        cut = KiB * KiB - rng.choice([0, 48, 4000])
        done = 0
        while done < len(call):
            n = min(len(call) - done, cut if done == 0 else KiB * KiB)
            await cache.write(st, pos + done, call[done : done + n])
            done += n
        pos += len(call)


def _entry_data(data: bytes) -> list[tuple[int, int]]:
    """[start, end) of each zip entry's data (the oracle: zipfile and the local headers)."""
    import io
    import struct
    import zipfile

    out = []
    for info in zipfile.ZipFile(io.BytesIO(data)).infolist():
        nlen, elen = struct.unpack_from("<HH", data, info.header_offset + 26)
        start = info.header_offset + 30 + nlen + elen
        out.append((start, start + info.compress_size))
    return out


def _state_dict(seed: int, sizes: list[int]):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    sd = {f"layer{i}.weight": torch.randn(n // 4, generator=g) for i, n in enumerate(sizes)}
    sd["step"] = torch.tensor(7)  # a tiny entry: no chunk of its own
    return sd


def test_torch_save_is_cut_at_its_entries_and_unchanged_tensors_keep_their_chunks(vol):
    """A torch.save file written through the mount is cut where each big tensor's data
    begins and ends, as both of torch's writers hand it over (a path: the C++ writer; a
    file object: Python's buffered writer); saved again with 2 of 20 tensors changed, under
    another archive name (torch.save names it after the file), by the other writer, every
    other tensor maps to the chunks it had. With fixed chunks a changed tensor dragged
    along the chunks it shared with its neighbours."""
    import io

    from fusefs.mount.layout import ENTRY_MIN

    torch = pytest.importorskip("torch")
    sizes = [(i % 7 + 1) * 320_000 + 4 * i for i in range(20)]  # 0.3-2.2 MB, unaligned
    sd = _state_dict(0, sizes)
    one = _torch_writes(sd)
    for k in ("layer3.weight", "layer11.weight"):
        sd[k] = torch.randn(sd[k].numel())
    two = [w.replace(b"archive/", b"step-02/") for w in _torch_writes(sd)]  # as by path
    files = {"/one.pt": _cxx_syscalls(one), "/two.pt": _python_syscalls(two)}
    assert torch.load(io.BytesIO(b"".join(files["/two.pt"])))["step"] == 7
    attrs = {p: vol.write_file(p, b"") for p in files}
    extents = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cache = FileCache(vol, nursery, dirty_max=8 * BLOCK)
            for seed, (p, calls) in enumerate(files.items()):
                st = await cache.open_state(attrs[p])
                await _write_syscalls(cache, st, calls, seed)
                await cache.commit(st)
                extents[p] = st.extents
            nursery.cancel_scope.cancel()

    trio.run(main)
    for p, calls in files.items():
        assert vol.read_file(p) == b"".join(calls)
    # the C++ writer hands every entry over at a write of its own: all big ones are cut
    entries = _entry_data(b"".join(files["/one.pt"]))
    big = [c for s, e in entries if e - s >= ENTRY_MIN for c in (s, e)]
    assert len(big) == 40 and set(big) <= {e.offset for e in extents["/one.pt"]}
    # the second save shares every chunk but the changed tensors' and the small records
    # between entries (descriptors with CRCs, headers with the archive's name); Python's
    # buffer keeps entries under 1 MiB with their neighbours, whose chunks are new too
    new = {e.chunk_id for e in extents["/two.pt"]} - {e.chunk_id for e in extents["/one.pt"]}
    new_bytes = sum(e.length for e in extents["/two.pt"] if e.chunk_id in new)
    changed = (sizes[3] // 4 + sizes[11] // 4) * 4
    buffered = sum(e - s for s, e in _entry_data(b"".join(files["/two.pt"])) if e - s <= KiB * KiB)
    assert changed <= new_bytes <= changed + buffered + 16 * KiB, (new_bytes, changed)
    big_two = [s for s, e in _entry_data(b"".join(files["/two.pt"])) if e - s > KiB * KiB]
    assert set(big_two) <= {e.offset for e in extents["/two.pt"]}


def test_a_cut_file_rewritten_in_place_or_truncated_keeps_its_layout(vol):
    """A file with entry cuts, opened again: a write inside one tensor stores one new
    chunk (the blocks come from the committed extents); a truncate into an entry and an
    append after it read back exactly."""
    sd = _state_dict(1, [(i % 5 + 1) * 400_000 + i for i in range(12)])
    calls = _cxx_syscalls(_torch_writes(sd))
    data = bytearray(b"".join(calls))
    attr = vol.write_file("/f.pt", b"")
    log: dict[str, list] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cache = FileCache(vol, nursery)
            st = await cache.open_state(attr)
            await _write_syscalls(cache, st, calls, 3)
            await cache.commit(st)
            log["first"] = st.extents
            st.opens = 0
            cache.drop_if_idle(st)  # closed: the next open starts from the commit
            st = await cache.open_state(vol.resolve("/f.pt"))
            mid = _entry_data(bytes(data))[6][0] + 1000
            patch = os.urandom(300)
            await cache.write(st, mid, patch)
            data[mid : mid + len(patch)] = patch
            await cache.commit(st)
            log["patched"] = st.extents
            cut = _entry_data(bytes(data))[9][0] + 77
            st.truncated(cut)  # as the mount's truncate does, after the metadata's
            vol.meta.setattr(st.ino, size=cut)
            data[cut:] = b""
            tail = os.urandom(2 * BLOCK + 5)
            await cache.write(st, cut, tail)
            data.extend(tail)
            await cache.commit(st)
            nursery.cancel_scope.cancel()

    trio.run(main)
    first, patched = log["first"], log["patched"]
    assert len(first) > 24 and [e.offset for e in first] == [e.offset for e in patched]
    changed = [a for a, b in zip(first, patched, strict=True) if a.chunk_id != b.chunk_id]
    assert len(changed) == 1
    assert vol.read_file("/f.pt") == bytes(data)


def test_zip_boundaries_are_found_at_the_writers_requests_only():
    """The cuts ZipBoundaries finds for both writers' request patterns, against zipfile:
    every big entry the writer handed over at a write of its own, nothing that is not an
    entry boundary, never below the request that revealed it; and it stops at a write
    that is not the next append."""
    import random

    from fusefs.mount.layout import ENTRY_MIN, ZipBoundaries

    rng = random.Random(2)
    for trial in range(6):
        sizes = [rng.choice([8, 3000, 70_000, 900_000, 3_000_000]) for _ in range(12)]
        writes = _torch_writes(_state_dict(trial, sizes))
        for calls, handed_over in ((_cxx_syscalls(writes), 1024),
                                   (_python_syscalls(writes), KiB * KiB + 1)):  # fmt: skip
            stream = b"".join(calls)
            entries = _entry_data(stream)
            every = {c for s, e in entries for c in (s, e)}
            z = ZipBoundaries()
            got: list[int] = []
            pos = 0
            for call in calls:
                for k in range(0, len(call), KiB * KiB):
                    part = call[k : k + KiB * KiB]
                    found = z.feed(pos, part)
                    assert all(c >= pos for c in found)
                    got += found
                    pos += len(part)
            assert got == sorted(got) and set(got) <= every, (trial, sorted(set(got) - every))
            need = {c for s, e in entries if e - s >= max(ENTRY_MIN, handed_over) for c in (s, e)}
            assert need <= set(got), (trial, sorted(need - set(got)))
    z = ZipBoundaries()
    z.feed(0, b"PK\x03\x04" + bytes(40))
    assert z.feed(10**6, b"PK\x07\x08") == [] and z.done
