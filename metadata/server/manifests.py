"""A step's manifest as the service answers it: encoded once per step (whole, and per
rank) from the commits' own file lists, and a host's ranks' slices joined without
decoding them (thousands of ranks ask at once at a restart)."""

from __future__ import annotations

import os
from typing import Any

import msgspec

from metadata.ckptformat import file_fields, pack_files

_EMPTY = msgspec.Raw(b"\x90")  # an empty msgpack array


def _array_items(raw: msgspec.Raw) -> tuple[int, memoryview]:
    """A msgpack array's length and its encoded items (the bytes after its header)."""
    mv = memoryview(raw)
    b0 = mv[0]
    if b0 & 0xF0 == 0x90:
        return b0 & 0x0F, mv[1:]
    if b0 == 0xDC:
        return int.from_bytes(mv[1:3], "big"), mv[3:]
    if b0 == 0xDD:
        return int.from_bytes(mv[1:5], "big"), mv[5:]
    raise ValueError(f"not a msgpack array (0x{b0:02x})")


def _joined(arrays: list[msgspec.Raw]) -> msgspec.Raw:
    """Encoded arrays joined into one encoded array, without decoding their items: the
    answer to a host's manifest request is its ranks' slices put end to end."""
    parts = [_array_items(a) for a in arrays]
    n = sum(k for k, _ in parts)
    if n < 16:
        head = bytes([0x90 | n])
    elif n < 2**16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return msgspec.Raw(b"".join([head, *(body for _, body in parts)]))


def encode_manifest(head: dict, files: dict[int, list]) -> tuple[dict, Any, dict]:
    """The manifest encodings (whole, per rank) from the commits' own file lists, in
    the order manifest_parts reads them: by rank, then by path bytes."""
    enc = msgspec.msgpack.Encoder()
    by_rank: dict[int, list[dict]] = {}
    for rank in sorted(files):
        rows = []
        for f in pack_files(files[rank]):
            p, size, ext, _ = file_fields(f)
            raw = os.fsencode(p) if isinstance(p, str) else bytes(p)
            rows.append((raw, int(size), bytes(ext)))
        rows.sort(key=lambda r: r[0])
        by_rank[rank] = [
            {"path": os.fsdecode(p), "size": n, "rank": rank, "extents": ext} for p, n, ext in rows
        ]
    full = msgspec.Raw(enc.encode([f for r in by_rank for f in by_rank[r]]))
    per = {r: msgspec.Raw(enc.encode(fs)) for r, fs in by_rank.items()}
    return head, full, per


def manifest_answer(parts: tuple, only: list[int] | None) -> dict:
    """The whole step's files, or those of the ranks in `only` (checked by
    manifest_ranks), from the encodings made once per step."""
    head, full, per = parts
    if only is None:
        return {**head, "files": full}
    if len(only) == 1:
        return {**head, "files": per.get(only[0], _EMPTY)}
    return {**head, "files": _joined([per.get(r, _EMPTY) for r in only])}
