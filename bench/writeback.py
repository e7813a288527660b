"""Write-behind tier benchmark: a save at local-disk speed while the object nodes are slow.

2 GiB (incompressible, unique) is saved through the Volume API with durability=local while
every object node together is capped at 50 MB/s; the baseline is a plain write + fsync of
the same bytes to the same disk in the same run (measured before and after, averaged).
Reports save_vs_disk (disk time / save time, target >= 0.9), drain_s (save end until every
chunk is durable) and the same save with durability=remote for contrast. One JSON object.

    python -m bench.writeback [--size 2GiB] [--rate 50e6] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from bench.common import MiB, UniqueBlocks, disk_write, mbps, peak_rss_mib
from fusefs.units import parse_size
from fusefs.volume import Volume, VolumeSettings
from tests.fixtures.throttle import throttle_volume


def _save(vol: Volume, path: str, total: int, seed: int) -> float:
    t0 = time.perf_counter()
    with vol.open_write(path) as w:
        for piece in UniqueBlocks(seed).pieces(total):
            w.write(piece)
    return time.perf_counter() - t0


def _disk(base: str, total: int, seed: int) -> float:
    path = os.path.join(base, f"baseline-{seed}.bin")
    try:
        secs, _ = disk_write(path, UniqueBlocks(seed).pieces(total))
    finally:
        os.unlink(path)
    return secs


def run(total: int, rate: float, base: str) -> dict:
    vol_dir = os.path.join(base, "vol")
    Volume.create(vol_dir, nodes=4, settings=VolumeSettings(chunk_size=4 * MiB, replicas=2)).close()
    out: dict = {"bytes": total, "node_cap_MBps": rate / 1e6, "replicas": 2}

    disk_a = _disk(base, total, 1)

    vol = Volume.open(vol_dir)
    throttle_volume(vol, rate)
    tier = vol.attach_tier(os.path.join(base, "staging"), size=2 * total, durability="local")
    try:
        save_s = _save(vol, "/local.bin", total, 2)
        staged_after_save = vol.stats()["staged_chunks"]
        t0 = time.perf_counter()
        tier.flush()
        drain_s = time.perf_counter() - t0
        st = tier.stats()
    finally:
        vol.close()

    disk_b = _disk(base, total, 3)
    disk_s = (disk_a + disk_b) / 2

    vol = Volume.open(vol_dir)
    throttle_volume(vol, rate)
    vol.attach_tier(os.path.join(base, "staging"), size=2 * total, durability="remote")
    try:
        remote_s = _save(vol, "/remote.bin", total, 4)
    finally:
        vol.close()

    out.update(
        {
            "disk_s": round(disk_s, 2),
            "disk_s_before_after": [round(disk_a, 2), round(disk_b, 2)],
            "disk_MBps": mbps(total, disk_s),
            "local_save_s": round(save_s, 2),
            "local_save_MBps": mbps(total, save_s),
            "save_vs_disk": round(disk_s / save_s, 3),
            "staged_chunks_after_save": staged_after_save,
            "drain_s": round(drain_s, 2),
            "drain_MBps": mbps(total, drain_s),
            "uploaded_MBps_during_whole_run": mbps(st["uploaded_bytes"], save_s + drain_s),
            "journal_fsyncs": st["journal_fsyncs"],
            "remote_save_s": round(remote_s, 2),
            "remote_save_MBps": mbps(total, remote_s),
            "local_vs_remote_speedup": round(remote_s / save_s, 2),
            "peak_rss_mib": round(peak_rss_mib(), 1),
        }
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2GiB")
    p.add_argument("--rate", type=float, default=50e6, help="aggregate node cap, bytes/s")
    p.add_argument("--dir", default=None, help="scratch directory (on the disk to measure)")
    args = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="ckptfs-bench-wb-", dir=args.dir)
    try:
        print(json.dumps(run(parse_size(args.size), args.rate, base)))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
