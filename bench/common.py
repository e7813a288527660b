"""Helpers every benchmark shares: data generators, the local-disk baseline, timing."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator

import numpy as np

MiB = 2**20
GiB = 2**30


class UniqueBlocks:
    """Incompressible, non-repeating data at memcpy speed.

    A 64 MiB random pool is reused, with a counter stamped into every 64 KiB,
    so no two chunks (of any size >= 64 KiB) are equal and nothing compresses,
    without paying for random generation of every byte.
    """

    def __init__(self, seed: int = 0, pool: int = 64 * MiB) -> None:
        self.pool = np.random.default_rng(seed).integers(0, 256, pool, dtype=np.uint8)
        self.seed = seed
        self.n = 0

    def pieces(self, total: int, piece: int = 4 * MiB) -> Iterator[bytes]:
        done = 0
        while done < total:
            size = min(piece, total - done)
            start = (self.n * piece) % (len(self.pool) - piece)
            buf = self.pool[start : start + size].copy()
            stamps = buf[: size - size % 65536].view(np.uint64).reshape(-1, 8192)
            base = (self.seed << 40) + self.n * 1024
            stamps[:, 0] = np.arange(base, base + len(stamps), dtype=np.uint64)
            self.n += 1
            done += size
            yield buf.tobytes()


def bf16_weights(total: int, seed: int = 0, piece: int = 4 * MiB) -> Iterator[bytes]:
    """bf16 normal(0, 0.02) values, the bytes of typical transformer weights."""
    rng = np.random.default_rng(seed)
    done = 0
    while done < total:
        size = min(piece, total - done)
        f32 = rng.normal(0.0, 0.02, size // 2).astype(np.float32)
        yield (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        done += size


def disk_write(path: str, pieces: Iterator[bytes]) -> tuple[float, int]:
    """The baseline: plain write + fsync of the same bytes to the same disk."""
    t0 = time.perf_counter()
    n = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for p in pieces:
            os.write(fd, p)
            n += len(p)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0, n


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drop_caches() -> bool:
    """Write back and drop the page cache (root only): the next read comes from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(path: str) -> None:
    """Write back one file and drop its pages from the page cache (POSIX_FADV_DONTNEED):
    what a user who may not drop the whole cache can do."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_cold(path: str, piece: int = 4 * 2**20) -> tuple[float, int, bool]:
    """The read baseline: the file read whole from the disk, not the page cache (the cache
    dropped, or where that is not allowed, the file's pages evicted with fadvise).
    Returns (seconds, bytes, whether the whole page cache was dropped)."""
    dropped = drop_caches()
    if not dropped:
        evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(piece)
        t0 = time.perf_counter()
        n = 0
        while got := os.readv(fd, [buf]):
            n += got
        return time.perf_counter() - t0, n, dropped
    finally:
        os.close(fd)


def peak_rss_mib(pid: int | str = "self") -> float:
    """VmHWM of a process: unlike ru_maxrss, it is not inherited across fork+exec."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mbps(nbytes: int, seconds: float) -> float:
    """Decimal MB/s, the unit the targets are stated in."""
    return round(nbytes / 1e6 / seconds, 1) if seconds > 0 else float("inf")
