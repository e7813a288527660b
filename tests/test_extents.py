"""fusefs.client.extents against a byte-array model: every reader and writer of the client
relies on these to map file ranges onto chunks, so a wrong piece is a wrong byte read back."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from fusefs.client import extents as ext
from metadata.engine import Extent

CHUNKS: dict[bytes, bytes] = {}


def _chunk(data: bytes) -> bytes:
    cid = hashlib.blake2b(data, digest_size=16).digest()
    CHUNKS[cid] = data
    return cid


def _read(extents: list[Extent], off: int, size: int) -> bytes:
    """Bytes [off, off+size) through pieces/covers/view/fill, as the readers do."""
    starts = ext.starts_of(extents)
    ps = ext.pieces(extents, starts, off, off + size)
    if len(ps) == 1 and ext.covers(ps[0][0], off, off + size):
        e, lo, hi = ps[0]
        return bytes(ext.view(e, CHUNKS[e.chunk_id], lo, hi))
    out = bytearray(size)
    for e, lo, hi in ps:
        ext.fill(out, off, e, CHUNKS[e.chunk_id], lo, hi)
    return bytes(out)


writes = st.lists(
    st.tuples(st.integers(0, 300), st.binary(min_size=1, max_size=120)), min_size=1, max_size=12
)


@settings(max_examples=300, deadline=None)
@given(writes, st.integers(0, 400), st.integers(0, 400), st.integers(0, 200))
def test_splice_clip_and_reads_match_a_byte_model(ops, cut, off, size):
    model = bytearray()
    extents: list[Extent] = []
    for pos, data in ops:
        # a chunk holding the data with a prefix, so chunk_off is not always 0
        pad = bytes([len(data) % 7]) * (pos % 5)
        cid = _chunk(pad + data)
        extents = ext.splice(extents, pos, pos + len(data), [Extent(pos, len(data), cid, len(pad))])
        if len(model) < pos + len(data):
            model.extend(bytes(pos + len(data) - len(model)))
        model[pos : pos + len(data)] = data
        assert [e.offset for e in extents] == sorted({e.offset for e in extents})
        assert all(
            a.offset + a.length <= b.offset for a, b in zip(extents, extents[1:], strict=False)
        )
    assert _read(extents, 0, len(model)) == bytes(model)
    size = min(size, max(0, len(model) - off))
    assert _read(extents, off, size) == bytes(model[off : off + size])
    clipped = ext.clip(extents, cut)
    want = bytes(model[:cut]) + bytes(max(0, cut - len(model)))
    assert _read(clipped, 0, cut) == want
    assert all(e.offset + e.length <= cut for e in clipped)


def test_whole_chunks_tiles_only_exactly():
    a, b = _chunk(b"a" * 10), _chunk(b"b" * 6)
    extents = [Extent(0, 10, a, 0), Extent(10, 6, b, 0)]
    starts = ext.starts_of(extents)
    assert ext.whole_chunks(extents, starts, 0, 16) == [(a, 0, 10), (b, 10, 6)]
    assert ext.whole_chunks(extents, starts, 10, 6) == [(b, 0, 6)]
    assert ext.whole_chunks(extents, starts, 0, 12) is None  # ends inside a chunk
    assert ext.whole_chunks(extents, starts, 0, 20) is None  # runs past the last extent
    shared = [Extent(0, 4, a, 6)]  # part of a chunk
    assert ext.whole_chunks(shared, ext.starts_of(shared), 0, 4) is None
    holed = [Extent(0, 10, a, 0), Extent(12, 6, b, 0)]
    assert ext.whole_chunks(holed, ext.starts_of(holed), 0, 18) is None


def test_maybe_inline_follows_the_inline_limit():
    from metadata.engine import INLINE_DATA_MAX

    assert ext.maybe_inline(Extent(0, INLINE_DATA_MAX, b"x" * 16, 0))
    assert not ext.maybe_inline(Extent(0, INLINE_DATA_MAX + 1, b"x" * 16, 0))
