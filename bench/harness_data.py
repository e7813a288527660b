"""Shard contents for the load-test harness: deterministic, so a load can be verified.

A rank's shard is a row of blocks (one block per chunk, so a changed block is a changed
chunk). Block b of rank r at step s has a *version*: the last step <= s in which it
changed (every block changes at step 1; later, each changes with probability
change_rate, decided by a hash of (seed, step, rank, block)). The bytes of a block are a
pure function of (kind, seed, rank, block, version), so any process can regenerate what a
rank wrote at any step and compare, without keeping the data around.

Random and bf16 blocks are slices of a per-process pool with a unique 8-byte stamp every
4 KiB: generation costs a memcpy, and no two blocks (or 4 KiB pieces) are equal, so dedup
only ever finds what the change rate left unchanged.
"""

from __future__ import annotations

import numpy as np
import xxhash

KINDS = ("random", "bf16", "zeros")
POOL = 16 * 2**20
STAMP_EVERY = 4096


def changed(seed: int, step: int, rank: int, block: int, rate: float) -> bool:
    if step <= 1 or rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    h = xxhash.xxh64_intdigest(f"{seed}/{step}/{rank}/{block}".encode())
    return h / 2**64 < rate


class ShardMaker:
    """Blocks of one kind for every (rank, block, version); one instance per process."""

    def __init__(self, kind: str, seed: int, shard_size: int, block_size: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"data kind must be one of {', '.join(KINDS)}, not {kind!r}")
        self.kind = kind
        self.seed = seed
        self.shard_size = shard_size
        self.block_size = min(block_size, shard_size)
        self.blocks = -(-shard_size // self.block_size)
        rng = np.random.default_rng(seed)
        pool_size = max(POOL, 2 * self.block_size + STAMP_EVERY)
        if kind == "random":
            self.pool = rng.integers(0, 256, pool_size, dtype=np.uint8)
        elif kind == "bf16":
            f32 = rng.normal(0.0, 0.02, pool_size // 2).astype(np.float32)
            self.pool = (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            self.pool = None

    def block_len(self, block: int) -> int:
        return min(self.block_size, self.shard_size - block * self.block_size)

    def block(self, rank: int, block: int, version: int) -> bytes:
        n = self.block_len(block)
        if self.pool is None:
            return bytes(n)
        key = xxhash.xxh64_intdigest(f"{self.seed}/{rank}/{block}/{version}".encode())
        start = (key % (len(self.pool) - n)) & ~7  # 8-aligned: a bf16 pool stays bf16 pairs
        buf = self.pool[start : start + n].copy()
        full = n - n % STAMP_EVERY
        if full:
            stamps = buf[:full].view(np.uint64).reshape(-1, STAMP_EVERY // 8)
            stamps[:, 0] = np.arange(key, key + len(stamps), dtype=np.uint64)
        elif n >= 8:
            buf[:8] = np.frombuffer(key.to_bytes(8, "little"), dtype=np.uint8)
        return buf.tobytes()

    def versions(self, prev: list[int] | None, step: int, rank: int, rate: float) -> list[int]:
        """The block versions of `rank` at `step`, given those of the step before."""
        return [
            step if prev is None or changed(self.seed, step, rank, b, rate) else prev[b]
            for b in range(self.blocks)
        ]

    def shard(self, rank: int, versions: list[int]) -> list[bytes]:
        return [self.block(rank, b, v) for b, v in enumerate(versions)]

    def digest(self, rank: int, versions: list[int]) -> bytes:
        return self.digest_of(self.shard(rank, versions))

    @staticmethod
    def digest_of(blocks: list[bytes]) -> bytes:
        h = xxhash.xxh3_128()
        for blk in blocks:
            h.update(blk)
        return h.digest()
