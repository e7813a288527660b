"""Parallel cold reads through the framework's storing floor against the local disk; one
JSON object.

    python -m bench.floorread [--readers 8] [--size-mib 128] [--rounds 3]

N processes each read their own file (1 MiB reads, page cache dropped first) on the local
disk and through bench/floorfs.py with --store (a minimal pyfuse3 filesystem that preads
its files from the same disk: no chunks, no hashing, no metadata), alternating which goes
first. `floor_vs_disk` is what the framework itself reaches for the load that
bench.trainer's `parallel_load_vs_disk` measures for the mount.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import UniqueBlocks, disk_write, drop_caches  # noqa: E402
from bench.fuse import mount_floor, unmount  # noqa: E402

MiB = 2**20


def _reader(path: str, q: mp.Queue) -> None:
    fd = os.open(path, os.O_RDONLY)
    n = 0
    try:
        while b := os.read(fd, MiB):
            n += len(b)
    finally:
        os.close(fd)
    q.put(n)


def parallel_read(paths: list[str], size: int) -> float:
    """MB/s of every file read at once by its own process, from a dropped page cache."""
    drop_caches()
    q: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_reader, args=(p, q)) for p in paths]
    t = time.perf_counter()
    for p in procs:
        p.start()
    got = [q.get(timeout=600) for _ in procs]
    secs = time.perf_counter() - t
    for p in procs:
        p.join()
    if got != [size] * len(paths):
        raise RuntimeError(f"read {got} bytes, expected {size} each")
    return round(len(paths) * size / MiB / secs, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--size-mib", type=int, default=128, help="MiB per reader's file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    if min(args.readers, args.size_mib, args.rounds) < 1:
        ap.error("--readers, --size-mib and --rounds must be at least 1")
    size = args.size_mib * MiB
    base = tempfile.mkdtemp(prefix="ckptfs-bench-floorread-", dir=args.dir)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    store = os.path.join(base, "store")
    os.makedirs(store)
    fmp, fproc = mount_floor(base, env, [], "--store", store)
    try:
        disk = [os.path.join(base, f"disk-{i}") for i in range(args.readers)]
        floor = [os.path.join(fmp, f"floor-{i}") for i in range(args.readers)]
        blocks = UniqueBlocks()
        for path in disk + floor:
            disk_write(path, blocks.pieces(size))
        out: dict = {"readers": args.readers, "size_mib": args.size_mib, "disk_mbps": [],
                     "floor_mbps": []}  # fmt: skip
        for r in range(args.rounds):
            for kind in ("disk", "floor") if r % 2 == 0 else ("floor", "disk"):
                out[f"{kind}_mbps"].append(parallel_read(disk if kind == "disk" else floor, size))
        ratios = [f / d for f, d in zip(out["floor_mbps"], out["disk_mbps"], strict=True)]
        out["floor_vs_disk_rounds"] = [round(x, 3) for x in ratios]
        out["floor_vs_disk"] = round(statistics.median(ratios), 3)
    finally:
        unmount(fmp, fproc)
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
