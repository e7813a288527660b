"""Codec tests: round trips, codec choice, ratios, and that corruption never yields wrong bytes."""

from __future__ import annotations

import struct
import threading

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore import codec
from chunkstore.codec import CODECS, HEADER, ChunkFormatError, decode, encode, header_info, verify

KiB, MiB = 1024, 1024 * 1024


def bf16(n_elems: int, seed: int = 0) -> bytes:
    """torch-like bf16 weights: the top 16 bits of float32 normal(0, 0.02)."""
    f = np.random.default_rng(seed).normal(0, 0.02, n_elems).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def fp32(n_elems: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).normal(0, 1, n_elems).astype(np.float32).tobytes()


DATA = {
    "empty": b"",
    "one": b"\x07",
    "three": b"abc",
    "random": np.random.default_rng(1).bytes(1 * MiB),
    "zeros": bytes(1 * MiB),
    "text": b"checkpoint step 100 rank 42 " * 5000,
    "bf16": bf16(512 * KiB),
    "bf16-odd": bf16(100_001) + b"\x01",
    "fp32": fp32(256 * KiB),
    "fp32-odd": fp32(50_000) + b"xyz",
}


def reseal(blob: bytes, **fields) -> bytes:
    """Rewrite header fields and recompute a valid checksum (to reach checks after it)."""
    payload = fields.pop("payload", blob[HEADER:])
    magic, version, cod, width, raw_len, _ = struct.unpack_from("<3sBBBQQ", blob)
    vals = dict(magic=magic, version=version, codec=cod, width=width, raw_len=raw_len)
    vals.update(fields)
    prefix = struct.pack("<3sBBBQ", *vals.values())
    seed = xxhash.xxh3_64_intdigest(prefix)
    return prefix + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload, seed=seed)) + payload


@pytest.mark.parametrize("name", DATA)
@pytest.mark.parametrize("name_codec", CODECS)
def test_round_trip(name, name_codec):
    raw = DATA[name]
    blob = encode(raw, name_codec)
    assert decode(blob) == raw
    assert decode(memoryview(blob)) == raw
    verify(blob)
    version, used, raw_len = header_info(blob)
    assert (version, raw_len) == (1, len(raw))
    assert used in ("none", "zstd", "float")
    assert len(blob) <= HEADER + len(raw)  # never worse than storing raw


@pytest.mark.parametrize(
    ("name", "asked", "used"),
    [
        ("random", "zstd", "none"),
        ("random", "float", "none"),
        ("random", "auto", "none"),
        ("zeros", "none", "none"),
        ("zeros", "zstd", "zstd"),
        ("text", "auto", "zstd"),
        ("bf16", "float", "float"),
        ("bf16", "auto", "float"),
        ("fp32", "auto", "float"),
        ("empty", "auto", "none"),
        ("one", "float", "none"),
    ],
)
def test_codec_actually_used(name, asked, used):
    assert header_info(encode(DATA[name], asked))[1] == used


def test_encode_accepts_typed_memoryview():
    arr = np.arange(10_000, dtype=np.float32)
    for c in CODECS:
        assert decode(encode(memoryview(arr), c)) == arr.tobytes()


def test_float_ratio_on_bf16_and_beats_zstd():
    raw = bf16(8 * MiB, seed=7)  # 16 MiB, stored as 4 MiB chunks like the volume does
    chunks = [raw[i : i + 4 * MiB] for i in range(0, len(raw), 4 * MiB)]
    fsize = sum(len(encode(c, "float")) for c in chunks)
    zsize = sum(len(encode(c, "zstd")) for c in chunks)
    asize = sum(len(encode(c, "auto")) for c in chunks)
    assert fsize / len(raw) <= 0.72
    assert fsize < zsize * 0.95
    assert asize == fsize


def test_float_explicit_width_and_width_choice():
    raw = fp32(256 * KiB)
    w4 = encode(raw, "float", elem_width=4)
    w2 = encode(raw, "float", elem_width=2)
    assert decode(w4) == raw and decode(w2) == raw
    assert len(w4) < len(w2)
    assert encode(raw, "float") == w4  # the probe picks 4 for fp32
    assert encode(DATA["bf16"], "float") == encode(DATA["bf16"], "float", elem_width=2)
    fp64 = np.random.default_rng(0).normal(size=50_000).tobytes()
    assert decode(encode(fp64, "float", elem_width=8)) == fp64


def test_auto_does_not_compress_incompressible_chunk(monkeypatch):
    """Random data through auto: only the probe samples see zstd, never the whole chunk."""
    seen: list[int] = []
    real = codec._compressor

    class Spy:
        def __init__(self, level: int) -> None:
            self.inner = real(level)

        def compress(self, data) -> bytes:
            seen.append(len(memoryview(data).cast("B")))
            return self.inner.compress(data)

    monkeypatch.setattr(codec, "_compressor", Spy)
    raw = np.random.default_rng(3).bytes(4 * MiB)
    blob = encode(raw, "auto")
    assert header_info(blob)[1] == "none" and len(blob) == HEADER + len(raw)
    assert sum(seen) <= 3 * 64 * KiB
    assert decode(blob) == raw


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(codec="lz4"),
        dict(codec="zstd", level=23),
        dict(codec="zstd", level="3"),
        dict(codec="float", elem_width=3),
    ],
)
def test_bad_encode_arguments(kwargs):
    with pytest.raises(ValueError, match=r"\S"):
        encode(b"data" * 100, kwargs.pop("codec"), **kwargs)


# -- corruption --------------------------------------------------------------------------------


def small_blobs() -> dict[str, bytes]:
    raw = bf16(1500, seed=4) + b"!"
    blobs = {
        "none": encode(raw, "none"),
        "zstd": encode(bytes(1000) + raw, "zstd"),
        "float": encode(raw, "float", elem_width=2),
        "float-fp32-tail": encode(fp32(800, seed=5) + b"ab", "float", elem_width=4),
    }
    assert [header_info(b)[1] for b in blobs.values()] == ["none", "zstd", "float", "float"]
    return blobs


@pytest.mark.parametrize("kind", ["none", "zstd", "float", "float-fp32-tail"])
def test_every_single_byte_corruption_is_detected(kind):
    blob = small_blobs()[kind]
    for i in range(len(blob)):
        for bit in (0x01, 0x80):
            bad = bytearray(blob)
            bad[i] ^= bit
            with pytest.raises(ChunkFormatError):
                decode(bytes(bad))
            with pytest.raises(ChunkFormatError):
                verify(bytes(bad))


@pytest.mark.parametrize("kind", ["none", "zstd", "float"])
def test_truncated_or_extended_blob_is_detected(kind):
    blob = small_blobs()[kind]
    for n in range(len(blob)):
        with pytest.raises(ChunkFormatError):
            decode(blob[:n])
        with pytest.raises(ChunkFormatError):
            verify(blob[:n])
    with pytest.raises(ChunkFormatError):
        decode(blob + b"\x00")


@settings(max_examples=50, deadline=None)
@given(
    pos=st.floats(0, 1, exclude_max=True),
    xor=st.integers(1, 255),
    name=st.sampled_from(["bf16", "fp32", "text"]),
)
def test_random_corruption_of_large_blob(pos, xor, name):
    blob = bytearray(encode(DATA[name], "auto"))
    blob[int(pos * len(blob))] ^= xor
    with pytest.raises(ChunkFormatError):
        decode(bytes(blob))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(magic=b"XYZ"), "magic"),
        (dict(version=2), "version"),
        (dict(codec=9), "codec"),
        (dict(width=3), "width"),
    ],
)
def test_unknown_header_values_rejected_with_clear_message(fields, message):
    blob = reseal(encode(DATA["bf16"], "float"), **fields)
    with pytest.raises(ChunkFormatError, match=message):
        decode(blob)
    with pytest.raises(ChunkFormatError, match=message):
        verify(blob)


@pytest.mark.parametrize("name", ["zeros", "bf16"])
def test_length_mismatch_with_valid_checksum_is_rejected(name):
    blob = encode(DATA[name], "auto")
    bad = reseal(blob, raw_len=len(DATA[name]) + 2)
    with pytest.raises(ChunkFormatError):
        decode(bad)
    with pytest.raises(ChunkFormatError):
        verify(bad)


def test_zstd_frame_without_content_size_is_rejected():
    raw = bytes(50_000)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    blob = reseal(encode(raw, "zstd"), payload=frame)
    with pytest.raises(ChunkFormatError):
        decode(blob)


def test_header_info_rejects_garbage():
    with pytest.raises(ChunkFormatError):
        header_info(b"CKC")
    with pytest.raises(ChunkFormatError, match="magic"):
        header_info(b"\x00" * 40)


# -- concurrency -------------------------------------------------------------------------------


def test_concurrent_encode_decode_from_many_threads():
    inputs = [DATA["bf16"], DATA["fp32"], DATA["text"], DATA["random"], DATA["zeros"]]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(6):
                raw = inputs[(k + j) % len(inputs)]
                c = CODECS[(k + j) % len(CODECS)]
                assert decode(encode(raw, c, level=1 + (j % 3))) == raw
        except BaseException as e:  # reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("name", ["zeros", "bf16", "random"])
def test_a_huge_declared_length_with_a_valid_checksum_is_a_bad_replica(name, tmp_path):
    """A replica whose header claims 2**40 bytes (checksum resealed, so it looks intact)
    must be refused as corrupt before anything is allocated for it: the store then reads
    the next replica. It used to raise MemoryError out of the read."""
    from chunkstore.ids import chunk_id
    from chunkstore.nodes import NodeInfo
    from chunkstore.nodes.dir import DirNode
    from chunkstore.store import ChunkStore

    raw = DATA[name]
    blob = encode(raw, "auto")
    bad = reseal(blob, raw_len=2**40)
    for check in (decode, verify, header_info):
        with pytest.raises(ChunkFormatError, match="over the chunk limit"):
            check(bad)
    nodes = [DirNode(NodeInfo(f"n{i}", f"dir:{tmp_path}/n{i}", f"n{i}")) for i in range(2)]
    store = ChunkStore(nodes, 2, seed=7)
    cid = chunk_id(raw, 7)
    store.put_encoded(cid, blob)
    first = store.read_order(cid)[0]
    first.plant(cid, bad)  # the replica read first is the bad one
    assert store.get(cid) == raw
    store.close()
