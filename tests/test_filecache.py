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
def _torch_bytes(sd: dict) -> bytes:
    import io

    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


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


def _cuts_of(data: bytes) -> list[int]:
    """Where ZipEntries must cut: both ends of the data of every entry of ENTRY_MIN or more."""
    from fusefs.mount.layout import ENTRY_MIN

    return [c for s, e in _entry_data(data) if e - s >= ENTRY_MIN for c in (s, e)]


async def _write_as_kernel(cache: FileCache, st, data: bytes, seed: int) -> None:
    """Appends the way FUSE delivers a writer's bytes: requests of up to 1 MiB, split
    at arbitrary points (a write() from an unaligned buffer is two requests)."""
    import random

    rng = random.Random(seed)
    pos = 0
    while pos < len(data):
        n = rng.choice([KiB * KiB, KiB * KiB - 48, 48, rng.randrange(1, KiB * KiB)])
        await cache.write(st, pos, data[pos : pos + n])
        pos += n


def test_torch_save_is_cut_at_its_entries_and_unchanged_tensors_keep_their_chunks(vol):
    """A torch.save file written through the mount is cut where each tensor's data begins
    and ends (tensors under ENTRY_MIN stay with the records around them), whatever the
    request boundaries; saved again with 2 of 20 tensors changed, and under another
    archive name (torch.save names it after the file), every other tensor maps to the
    chunks it had. With fixed chunks a changed tensor dragged along the chunks it shared
    with its neighbours."""
    torch = pytest.importorskip("torch")
    import io

    g = torch.Generator().manual_seed(0)
    sizes = [(i % 7 + 1) * 150_000 + 4 * i for i in range(20)]  # 0.15-1.05 MB, unaligned
    sd = {f"layer{i}.weight": torch.randn(n // 4, generator=g) for i, n in enumerate(sizes)}
    sd["step"] = torch.tensor(7)  # a tiny entry: no chunk of its own
    one = _torch_bytes(sd)
    for k in ("layer3.weight", "layer11.weight"):
        sd[k] = torch.randn(sd[k].numel(), generator=g)
    two = _torch_bytes(sd).replace(b"archive/", b"step-02/")  # as torch.save("step-02")
    assert len(one) == len(two) and torch.load(io.BytesIO(two))["step"] == 7
    files = {"/one.pt": one, "/two.pt": two}
    attrs = {p: vol.write_file(p, b"") for p in files}
    extents = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cache = FileCache(vol, nursery, dirty_max=8 * BLOCK)
            for seed, (p, data) in enumerate(files.items()):
                st = await cache.open_state(attrs[p])
                await _write_as_kernel(cache, st, data, seed)
                await cache.commit(st)
                extents[p] = st.extents
            nursery.cancel_scope.cancel()

    trio.run(main)
    for p, data in files.items():
        assert vol.read_file(p) == data
    cuts = _cuts_of(one)
    assert len(cuts) == 40 and set(cuts) <= {e.offset for e in extents["/one.pt"]}
    # the second save shares every chunk but the changed tensors' and the small records
    # between entries (descriptors with CRCs, headers with the archive's name)
    new = {e.chunk_id for e in extents["/two.pt"]} - {e.chunk_id for e in extents["/one.pt"]}
    new_bytes = sum(e.length for e in extents["/two.pt"] if e.chunk_id in new)
    changed = (sizes[3] // 4 + sizes[11] // 4) * 4
    assert changed <= new_bytes <= changed + 16 * KiB, (new_bytes, changed)


def test_a_cut_file_rewritten_in_place_or_truncated_keeps_its_layout(vol):
    """A file with entry cuts, opened again: a write inside one tensor stores one new
    chunk (the blocks come from the committed extents); a truncate into an entry and an
    append after it read back exactly."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    sd = {f"t{i}": torch.randn((i % 5 + 1) * 100_000 + i, generator=g) for i in range(12)}
    data = bytearray(_torch_bytes(sd))
    attr = vol.write_file("/f.pt", b"")
    log: dict[str, list] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cache = FileCache(vol, nursery)
            st = await cache.open_state(attr)
            await _write_as_kernel(cache, st, bytes(data), 3)
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
    assert [e.offset for e in first] == [e.offset for e in patched]
    changed = [a for a, b in zip(first, patched, strict=True) if a.chunk_id != b.chunk_id]
    assert len(changed) == 1
    assert vol.read_file("/f.pt") == bytes(data)


def test_zip_entries_are_found_across_any_request_boundaries():
    """The entry parser on streamed (descriptor) and sized entries, zip64 descriptors,
    data holding descriptor signatures, appends of 1 byte and up, against zipfile."""
    import io
    import random
    import struct
    import zipfile

    from fusefs.mount.layout import ENTRY_MIN, ZipEntries

    class Stream(io.RawIOBase):  # not seekable: zipfile writes data descriptors
        def __init__(self) -> None:
            self.b = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, d) -> int:
            self.b += d
            return len(d)

    rng = random.Random(5)
    for trial in range(60):
        out: io.BytesIO | Stream = Stream() if trial % 2 else io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            for k in range(rng.randint(1, 6)):
                body = os.urandom(rng.choice([0, 5, ENTRY_MIN - 13, ENTRY_MIN + 3]))
                body += b"PK\x07\x08" * 3  # descriptor signatures inside the data
                if isinstance(out, Stream):
                    with z.open(f"e{k}", "w", force_zip64=trial % 4 == 1) as f:
                        f.write(body)
                else:
                    z.writestr(f"e{k}", body)
        data = bytes(out.b) if isinstance(out, Stream) else out.getvalue()
        z = ZipEntries()
        got: list[int] = []
        pos = 0
        while pos < len(data):
            n = rng.choice([1, 2, 3, 17, 30, 4096, 70000])
            got += z.feed(pos, data[pos : pos + n])
            pos += n
        assert got == _cuts_of(data), (trial, got)
        assert z.done  # the central directory ends it
    z = ZipEntries()  # a streamed entry named "a", then some of its data
    head = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 8, 0, 0, 0, 0, 0, 0, 1, 0)
    assert z.feed(0, head + b"a" + bytes(40)) == [] and not z.done
    assert z.feed(71, bytes(ENTRY_MIN)) == [31] and not z.done  # big: cut where it began
    assert z.feed(10**6, b"x") == [] and z.done  # not the next append: given up for good


def test_a_block_split_where_a_big_entry_began_keeps_every_byte(vol):
    """A streamed zip entry is known to be big only once ENTRY_MIN of its bytes came; the
    dirty block that holds its first bytes is then split where its data began. As pieces
    (views of the requests) or as a buffer, the bytes on each side stay where they were."""
    import struct

    from fusefs.mount.layout import ENTRY_MIN

    for stable, kind in ((True, Pieces), (False, bytearray)):
        parts = [7, 50, 1000]
        blk = DirtyBlock(1, 0, BufferPool(BLOCK, 2))
        data = os.urandom(sum(parts) + PIECE_MIN)
        pos = 0
        for n in [*parts, PIECE_MIN]:
            blk.write(pos, memoryview(data)[pos : pos + n], stable=stable)
            pos += n
        assert isinstance(blk.buf, kind)
        for rel in (1, parts[0], parts[0] + parts[1] - 1):
            b = DirtyBlock(1, 0)
            b.buf = (
                Pieces(list(blk.buf.parts)) if isinstance(blk.buf, Pieces) else bytearray(blk.buf)
            )
            b.spans = [list(x) for x in blk.spans]
            tail = b.split(rel)
            assert tail.lo == rel and _content(b)[:rel] == data[:rel]
            assert _content(tail)[: len(data) - rel] == data[rel:]
            assert b.spans == [[0, rel]] and tail.spans == [[0, len(data) - rel]]

    name = b"archive/data/0"
    head = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 8, 0, 0, 0, 0, 0, 0, len(name), 0)
    body = os.urandom(2 * ENTRY_MIN + 5)
    ds = len(head) + len(name)
    crc = 0
    stream = head + name + body + struct.pack("<4sIII", b"PK\x07\x08", crc, len(body), len(body))
    stream += b"PK\x01\x02" + bytes(60)  # a central directory follows
    attr = vol.write_file("/z", b"")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cache = FileCache(vol, nursery)
            st = await cache.open_state(attr)
            # the header and the first bytes in one small request, the bulk later
            for lo, hi in ((0, ds + 100), (ds + 100, ds + 900), (ds + 900, len(stream))):
                await cache.write(st, lo, stream[lo:hi])
            await cache.commit(st)
            assert st.layout.cuts == [0, ds, ds + len(body)]
            assert [e.offset for e in st.extents] == [0, ds, ds + len(body)]
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert vol.read_file("/z") == stream
