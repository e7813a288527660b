"""How checkpoint commits travel and are stored: packed extents and chunk records.

Extents and new-chunk records travel packed (40 and 33 bytes each), so thousands
of ranks do not cost millions of Python objects on the service; `inodes.extents`
holds the same EXT records. `WireFile` is one file of a commit_rank as the
service decodes it (typed by msgspec).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import msgspec

from metadata.engine import (
    Extent,
    NewChunk,
)

EXT = struct.Struct("<QQQ16s")  # offset, length, chunk_off, chunk id (also inodes.extents)
CHK = struct.Struct("<16sQQB")  # chunk id, raw_len, stored_len, state
INO = struct.Struct("<Q")  # ckpt_ranks.inos: the rank's file inodes, in path order
RANK = struct.Struct("<Q")  # ref_journal.ranks: the rank commits a journal row holds


def pack_extents(extents: Iterable[Extent]) -> bytes:
    return b"".join(EXT.pack(e.offset, e.length, e.chunk_off, e.chunk_id) for e in extents)


def unpack_extents(data: bytes) -> list[Extent]:
    return [Extent(o, n, bytes(c), co) for o, n, co, c in EXT.iter_unpack(data)]


def blob_chunk_ids(data: bytes) -> list[bytes]:
    """The chunk id of every extent in a packed list, without building Extent objects."""
    return [data[i : i + 16] for i in range(24, len(data), EXT.size)]


def pack_chunks(chunks: Iterable[NewChunk]) -> bytes:
    return b"".join(CHK.pack(c.chunk_id, c.raw_len, c.stored_len, c.state) for c in chunks)


def pack_files(files: list[dict]) -> list[dict]:
    """Files with Extent/NewChunk lists -> the packed form commit_rank sends.

    Anything malformed passes through unchanged, for the engine to reject.
    """
    if not isinstance(files, list):
        return files
    out = []
    for f in files:
        if not isinstance(f, dict):
            out.append(f)
            continue
        g = dict(f)
        if isinstance(g.get("extents"), list) and all(isinstance(e, Extent) for e in g["extents"]):
            g["extents"] = pack_extents(g["extents"])
        chunks = g.get("new_chunks")
        if isinstance(chunks, list) and all(isinstance(c, NewChunk) for c in chunks):
            g["new_chunks"] = pack_chunks(chunks)
        out.append(g)
    return out


def pack_ranks(ranks: list) -> list:
    """A commit_ranks' [rank, files(, host)] entries -> [rank, packed files, host], the
    form the service decodes typed (wire/protocol.py). Anything malformed passes
    through unchanged, for the engine to reject."""
    if not isinstance(ranks, list | tuple):
        return ranks
    out = []
    for r in ranks:
        if isinstance(r, list | tuple) and 2 <= len(r) <= 3:
            r = [r[0], pack_files(r[1]), r[2] if len(r) > 2 else ""]
        out.append(r)
    return out


def pack_args(method: str, args: tuple) -> tuple:
    """A request's arguments as a client sends them: a commit_rank's files, or each
    rank's of a commit_ranks, packed (the rest as they are)."""
    if method == "commit_rank" and len(args) >= 4:
        return (*args[:3], pack_files(args[3]), *args[4:])
    if method == "commit_ranks" and len(args) >= 3:
        return (*args[:2], pack_ranks(args[2]), *args[3:])
    return args


class WireFile(msgspec.Struct):
    """One file of a commit_rank as clients send it (`pack_files`), decoded with its types
    checked by msgspec (protocol.parse_commit): a 4096-rank burst spent ~14 ms per 1024
    ranks decoding these as dicts and checking each field in Python, ~9 ms as structs."""

    path: str
    size: int
    extents: bytes = b""
    new_chunks: bytes = b""


def file_fields(f: WireFile | dict) -> tuple[Any, Any, Any, Any]:
    """(path, size, extents, new_chunks) of a commit's file, a WireFile or a dict."""
    if type(f) is WireFile:
        return f.path, f.size, f.extents, f.new_chunks
    return f.get("path", b""), f.get("size"), f.get("extents", b""), f.get("new_chunks", b"")


def chk_ids(data: bytes) -> list[bytes]:
    return [data[i : i + 16] for i in range(0, len(data), CHK.size)]
