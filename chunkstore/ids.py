"""Chunk ids: xxh3-128 of the raw bytes, seeded with the volume's secret.

The seed is a per-volume secret so that an outsider cannot precompute the id of
a chunk and probe a shared volume for whether it holds some content. xxh3 is
not a cryptographic hash; ids are trusted only within one volume.
"""

from __future__ import annotations

import re

import xxhash

ID_LEN = 16
_HEX_RE = re.compile(r"[0-9a-f]{32}")  # fullmatch: "$" would let a trailing newline in


def chunk_id(data: bytes | memoryview, seed: int) -> bytes:
    return xxhash.xxh3_128_digest(data, seed=seed)


def id_hasher(seed: int) -> xxhash.xxh3_128:
    """A chunk_id computed in steps: update() with the bytes in order, digest() is the id."""
    return xxhash.xxh3_128(seed=seed)


def pieces_id(pieces: list[bytes | memoryview], seed: int) -> bytes:
    """chunk_id of the concatenated pieces, without concatenating them."""
    if len(pieces) == 1:
        return chunk_id(pieces[0], seed)
    h = id_hasher(seed)
    for p in pieces:
        h.update(p)
    return h.digest()


def to_hex(cid: bytes) -> str:
    return cid.hex()


def from_hex(text: str) -> bytes:
    """Parse a hex chunk id; the only way a key from outside becomes an id."""
    if not isinstance(text, str) or not _HEX_RE.fullmatch(text):
        raise ValueError(f"not a chunk id: {str(text)[:64]!r}")
    return bytes.fromhex(text)


def check_id(cid: bytes) -> bytes:
    if not isinstance(cid, bytes | bytearray) or len(cid) != ID_LEN:
        raise ValueError(f"chunk id must be {ID_LEN} bytes, got {cid!r:.60}")
    return bytes(cid)
