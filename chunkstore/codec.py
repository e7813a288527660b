"""Encoding of one stored chunk object: header + checksum + (maybe compressed) payload.

Every object read back from a node or the write-behind tier goes through :func:`decode`, which
verifies before it returns, so a corrupt replica is never handed to a caller (DESIGN invariant 1).
:func:`verify` does the same checks without decompressing, for scrub/fsck.

Layout (little endian, ``HEADER`` = 22 bytes)::

    magic b"CKC" | version u8 (=1) | codec u8 | elem_width u8 | raw_len u64 | checksum u64 | payload

``codec`` is the codec actually used: 0 raw, 1 zstd (one frame), 2 float byte-grouped.
``elem_width`` is 0 unless codec is 2. ``checksum`` is xxh3_64 of the payload, seeded with
xxh3_64 of the 14 header bytes before it, so a flipped bit in the header fields is caught too.

Float payload: ``elem_width`` x (flag u8, stored_len u64) sub-header, then the streams in order
(stream j = byte j of every element; flag 1 = one zstd frame, 0 = stored raw), then the
``raw_len % elem_width`` tail bytes raw.

GIL (measured on the 2-core dev VM, 64 MiB buffers, with a pure-Python thread spinning alongside):
zstandard compress/decompress and xxhash's one-shot ``xxh3_64``/``xxh3_128`` digests all release
the GIL, so encode/decode/hash from a thread pool run in parallel. Compressor objects are not
thread safe, hence one per thread (``threading.local``).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable

import numpy as np
import xxhash
import zstandard

__all__ = [
    "CODECS",
    "HEADER",
    "ChunkFormatError",
    "encode",
    "decode",
    "verify",
    "header_info",
]

CODECS = ("none", "zstd", "float", "auto")

MAGIC = b"CKC"
VERSION = 1
_HDR = struct.Struct("<3sBBBQQ")
HEADER = _HDR.size  # 22
MAX_RAW_LEN = 64 * 2**20  # no chunk is longer (chunker.MAX_CHUNK); a header saying more is corrupt
_SEEDED = _HDR.size - 8  # header bytes covered by the checksum seed
_STREAM = struct.Struct("<BQ")

RAW, ZSTD, FLOAT = 0, 1, 2
_CODEC_NAMES = {RAW: "none", ZSTD: "zstd", FLOAT: "float"}
_FLOAT_WIDTHS = (2, 4, 8)

_PROBE = 64 * 1024  # bytes per probe sample
_MIN_LEVEL, _MAX_LEVEL = -(1 << 17), zstandard.MAX_COMPRESSION_LEVEL  # ZSTD_minCLevel()
_MIN_GAIN = 0.03  # below 3% saving compression is not worth the CPU on read

_tls = threading.local()


class ChunkFormatError(Exception):
    """Stored object is truncated, corrupt, or in an unknown format."""


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        # our own checksum covers the payload; the content size lets decode preallocate/verify
        cctx = cache[level] = zstandard.ZstdCompressor(
            level=level, write_checksum=False, write_content_size=True
        )
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_tls, "dctx", None)
    if dctx is None:
        dctx = _tls.dctx = zstandard.ZstdDecompressor()
    return dctx


def _as_bytes_view(data: bytes | memoryview) -> memoryview:
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


# -- float byte grouping -----------------------------------------------------------------------


def _streams(mv: memoryview, width: int) -> tuple[np.ndarray, memoryview]:
    """(width x n) array whose row j is byte j of every element, and the raw tail."""
    n = len(mv) // width
    arr = np.frombuffer(mv, dtype=np.uint8, count=n * width)
    return np.ascontiguousarray(arr.reshape(n, width).T), mv[n * width :]


def _float_parts(mv: memoryview, width: int, level: int) -> list[bytes | memoryview]:
    """Payload parts of the float codec (sub-header, streams, tail)."""
    grouped, tail = _streams(mv, width)
    n = grouped.shape[1]
    cctx = _compressor(level)
    sub: list[bytes] = []
    body: list[bytes | memoryview] = []
    for j in range(width):
        row = grouped[j].data  # contiguous memoryview
        packed = cctx.compress(row)
        if len(packed) <= n * (1 - _MIN_GAIN):
            sub.append(_STREAM.pack(1, len(packed)))
            body.append(packed)
        else:
            sub.append(_STREAM.pack(0, n))
            body.append(row)
    return [b"".join(sub), *body, tail]


def _float_probe_size(samples: list[memoryview], width: int) -> int:
    """Estimated float-codec size of the samples: per-stream min(compressed, raw)."""
    cctx = _compressor(1)
    total = 0
    for s in samples:
        grouped, tail = _streams(s, width)
        n = grouped.shape[1]
        for j in range(width):
            c = len(cctx.compress(grouped[j].data))
            total += c if c <= n * (1 - _MIN_GAIN) else n
        total += len(tail) + _STREAM.size * width
    return total


def _samples(mv: memoryview) -> list[memoryview]:
    """A few 64 KiB samples (start, middle, end; 8-byte aligned) or the whole buffer if small."""
    n = len(mv)
    if n <= 3 * _PROBE:
        return [mv]
    mid = (n // 2 - _PROBE // 2) & ~7
    end = (n - _PROBE) & ~7
    return [mv[:_PROBE], mv[mid : mid + _PROBE], mv[end : end + _PROBE]]


def _pick_width(samples: list[memoryview]) -> tuple[int, int]:
    """Better float width (2 or 4) on the samples, with its estimated size."""
    sizes = {w: _float_probe_size(samples, w) for w in (2, 4)}
    w = min(sizes, key=lambda k: sizes[k])
    return w, sizes[w]


# -- encode ------------------------------------------------------------------------------------


def _pack_parts(
    codec: int, width: int, raw_len: int, parts: list[bytes | memoryview]
) -> list[bytes | memoryview]:
    """The object as buffers: its header, then `parts` themselves (not copied)."""
    prefix = _HDR.pack(MAGIC, VERSION, codec, width, raw_len, 0)[:_SEEDED]
    h = xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(prefix))
    for p in parts:
        h.update(p)
    return [prefix + h.intdigest().to_bytes(8, "little"), *parts]


def _pack(codec: int, width: int, raw_len: int, parts: list[bytes | memoryview]) -> bytes:
    return b"".join(_pack_parts(codec, width, raw_len, parts))


def raw_parts(parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """encode(b"".join(parts), "none") as a list of buffers (header, then `parts` themselves),
    for writers that write them out directly instead of copying the payload into one object."""
    return _pack_parts(RAW, 0, sum(memoryview(p).nbytes for p in parts), parts)


def encode(
    raw: bytes | memoryview,
    codec: str,
    *,
    level: int = 1,
    elem_width: int | None = None,
) -> bytes:
    """Encode ``raw`` as a self-verifying chunk object.

    ``codec`` is one of :data:`CODECS`; whatever is asked, the payload is stored raw when
    compression would not make it smaller. ``elem_width`` (2, 4 or 8) fixes the float grouping
    width for "float" (otherwise probed) and restricts "auto"'s float candidate to it.
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}: expected one of {', '.join(CODECS)}")
    if isinstance(level, bool) or not isinstance(level, int):
        raise ValueError(f"zstd level must be an int, got {level!r}")
    if not _MIN_LEVEL <= level <= _MAX_LEVEL:
        raise ValueError(f"zstd level {level} outside [{_MIN_LEVEL}, {_MAX_LEVEL}]")
    if elem_width is not None and elem_width not in _FLOAT_WIDTHS:
        raise ValueError(f"elem_width must be one of {_FLOAT_WIDTHS}, got {elem_width!r}")
    mv = _as_bytes_view(raw)
    n = len(mv)

    if codec == "auto" and n:
        samples = _samples(mv)
        total = sum(len(s) for s in samples)
        zsize = sum(len(_compressor(1).compress(s)) for s in samples)
        if zsize > total * (1 - _MIN_GAIN):
            codec = "none"  # incompressible (random, already compressed): skip work
        else:
            if elem_width is None:
                width, fsize = _pick_width(samples)
            else:
                width, fsize = elem_width, _float_probe_size(samples, elem_width)
            if fsize < zsize:
                codec, elem_width = "float", width
            else:
                codec = "zstd"

    if codec == "zstd" and n:
        packed = _compressor(level).compress(mv)
        if len(packed) < n:
            return _pack(ZSTD, 0, n, [packed])
    elif codec == "float":
        width = elem_width if elem_width is not None else _pick_width(_samples(mv))[0]
        if n >= width:
            parts = _float_parts(mv, width, level)
            if sum(len(p) for p in parts) < n:
                return _pack(FLOAT, width, n, parts)
    return _pack(RAW, 0, n, [mv])


# -- decode / verify ---------------------------------------------------------------------------


def _header(mv: memoryview) -> tuple[int, int, int, int, int]:
    """(version, codec, width, raw_len, checksum) of a chunk object's header, checked as far
    as it can be alone. A declared length over MAX_RAW_LEN is refused here: a replica whose
    header claims gigabytes is a bad replica, not a buffer to allocate."""
    if len(mv) < HEADER:
        raise ChunkFormatError(f"chunk object truncated: {len(mv)} bytes, header needs {HEADER}")
    magic, version, codec, width, raw_len, checksum = _HDR.unpack_from(mv)
    if magic != MAGIC:
        raise ChunkFormatError(f"bad magic {bytes(magic)!r}: not a chunk object")
    if codec not in _CODEC_NAMES:
        raise ChunkFormatError(f"unknown codec byte {codec}")
    if raw_len > MAX_RAW_LEN:
        raise ChunkFormatError(f"declared length {raw_len} is over the chunk limit {MAX_RAW_LEN}")
    return version, codec, width, raw_len, checksum


def _parse(
    blob: bytes | memoryview, *, id_checked: bool = False
) -> tuple[int, int, int, memoryview]:
    """Check header and checksum; return (codec, width, raw_len, payload view).

    id_checked=True: the caller hashes the decoded bytes against the chunk id, so for a
    raw object (whose payload *is* those bytes) the payload checksum is skipped."""
    mv = _as_bytes_view(blob)
    version, codec, width, raw_len, checksum = _header(mv)
    if version != VERSION:
        raise ChunkFormatError(f"unknown chunk format version {version}")
    if (codec == FLOAT) != (width != 0) or (codec == FLOAT and width not in _FLOAT_WIDTHS):
        raise ChunkFormatError(f"invalid element width {width} for codec {_CODEC_NAMES[codec]}")
    payload = mv[HEADER:]
    if id_checked and codec == RAW:
        return codec, width, raw_len, payload
    seed = xxhash.xxh3_64_intdigest(mv[:_SEEDED])
    if xxhash.xxh3_64_intdigest(payload, seed=seed) != checksum:
        raise ChunkFormatError("chunk checksum mismatch: object is corrupt or truncated")
    return codec, width, raw_len, payload


def _frame_size(frame: memoryview, expect: int, what: str) -> None:
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise ChunkFormatError(f"{what}: invalid zstd frame ({e})") from e
    if size != expect:
        raise ChunkFormatError(f"{what}: zstd frame holds {size} bytes, expected {expect}")


def _float_layout(payload: memoryview, width: int, raw_len: int) -> list[tuple[int, memoryview]]:
    """Split a float payload into [(flag, stream)] + the tail (flag -1), checking every length."""
    n, tail = divmod(raw_len, width)
    sub = _STREAM.size * width
    if len(payload) < sub:
        raise ChunkFormatError("float payload truncated in its sub-header")
    out: list[tuple[int, memoryview]] = []
    pos = sub
    for j in range(width):
        flag, size = _STREAM.unpack_from(payload, j * _STREAM.size)
        if flag not in (0, 1) or (flag == 0 and size != n) or pos + size > len(payload):
            raise ChunkFormatError(f"float stream {j}: bad flag {flag} / length {size}")
        out.append((flag, payload[pos : pos + size]))
        pos += size
    if len(payload) - pos != tail:
        raise ChunkFormatError(f"float payload has {len(payload) - pos} tail bytes, want {tail}")
    out.append((-1, payload[pos:]))
    return out


def _check_structure(codec: int, width: int, raw_len: int, payload: memoryview) -> None:
    if codec == RAW:
        if len(payload) != raw_len:
            raise ChunkFormatError(f"raw payload is {len(payload)} bytes, header says {raw_len}")
    elif codec == ZSTD:
        _frame_size(payload, raw_len, "zstd payload")
    else:
        n = raw_len // width
        for j, (flag, stream) in enumerate(_float_layout(payload, width, raw_len)[:-1]):
            if flag == 1:
                _frame_size(stream, n, f"float stream {j}")


def verify(blob: bytes | memoryview) -> None:
    """Check header, checksum and payload structure without decompressing (scrub/fsck)."""
    codec, width, raw_len, payload = _parse(blob)
    _check_structure(codec, width, raw_len, payload)


def header_info(blob: bytes | memoryview) -> tuple[int, str, int]:
    """(format_version, codec actually used, raw_len) from the header alone (not verified)."""
    version, codec, _width, raw_len, _checksum = _header(_as_bytes_view(blob))
    return version, _CODEC_NAMES[codec], raw_len


def _unzstd(frame: memoryview, expect: int, what: str) -> bytes:
    _frame_size(frame, expect, what)
    try:
        out = _decompressor().decompress(frame, max_output_size=expect)
    except zstandard.ZstdError as e:
        raise ChunkFormatError(f"{what}: zstd decompression failed ({e})") from e
    if len(out) != expect:
        raise ChunkFormatError(f"{what}: decompressed to {len(out)} bytes, expected {expect}")
    return out


def decode(blob: bytes | memoryview, *, id_checked: bool = False) -> bytes:
    """Verify and decode a chunk object back to its raw bytes; raise ChunkFormatError if bad.

    id_checked=True only for callers that then compare the content id (see `_parse`)."""
    codec, width, raw_len, payload = _parse(blob, id_checked=id_checked)
    if codec == RAW:
        _check_structure(codec, width, raw_len, payload)
        return bytes(payload)
    if codec == ZSTD:
        return _unzstd(payload, raw_len, "zstd payload")
    n = raw_len // width
    layout = _float_layout(payload, width, raw_len)
    out = np.empty(raw_len, dtype=np.uint8)
    grid = out[: n * width].reshape(n, width)
    for j, (flag, stream) in enumerate(layout[:-1]):
        data = _unzstd(stream, n, f"float stream {j}") if flag == 1 else stream
        grid[:, j] = np.frombuffer(data, dtype=np.uint8)
    out[n * width :] = np.frombuffer(layout[-1][1], dtype=np.uint8)
    return out.tobytes()


def transcoder(compression: str) -> Callable[[bytes, int | None], bytes]:
    """The write-behind tier's upload-time codec for a volume compressing with `compression`.

    Savers stage chunks raw (no compression on the save's critical path: on 2 cores even
    zstd's probe costs more than the disk); the uploader runs each staged object through
    this before it leaves the host. Objects already encoded otherwise pass unchanged."""

    def transcode(blob: bytes, width: int | None) -> bytes:
        if compression == "none" or header_info(blob)[1] != "none":
            return blob
        return encode(decode(blob), compression, elem_width=width)

    return transcode
