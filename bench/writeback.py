"""Write-behind tier benchmark: a save at local-disk speed while the object nodes are slow.

2 GiB (incompressible, unique) is saved through the Volume API with durability=local while
every object node together is capped at 50 MB/s; the baseline is a plain write + fsync of
the same bytes to the same disk in the same run (measured before and after, averaged).
Reports save_vs_disk (disk time / save time, target >= 0.9), drain_s (save end until every
chunk is durable) and the same save with durability=remote for contrast. One JSON object.

    python -m bench.writeback [--size 2GiB] [--rate 50e6] [--dir DIR] [--mount]

With --mount, the same saves also go through a real FUSE mount (`ckptfs mount --durability`),
its nodes throttled inside the daemon; the drain is `user.ckptfs.flush` (umount --flush).

With --warm, a long-running host's case too: saves into a staging dir whose read cache
already fills the budget (every put evicts), against the same saves into an empty one, nodes
unthrottled (`warm.warm_vs_cold_save`: below 1 by what unlinking the evicted objects costs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench.common import MiB, UniqueBlocks, disk_write, mbps, peak_rss_mib
from bench.throttle import throttle_volume
from fusefs.cli.units import parse_size
from fusefs.client.volume import Volume, VolumeSettings


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


MOUNT_WRAPPER = r"""
import sys
import fusefs.cli.mount as cm
from bench.throttle import throttle_volume

rate, orig = float(sys.argv[1]), cm.attach_tier


def throttled(vol, *a):
    throttle_volume(vol, rate)
    return orig(vol, *a)


cm.attach_tier = throttled
from fusefs.cli.main import main

sys.exit(main(sys.argv[2:]))
"""


def _mounted(mp: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == mp for line in f)


def _mount_save(base: str, vol_dir: str, total: int, rate: float, mode: str, seed: int) -> dict:
    """The same save through a real FUSE mount (nodes throttled inside the daemon)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mp = os.path.join(base, f"mnt-{mode}")
    os.makedirs(mp, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=root, XDG_DATA_HOME=os.path.join(base, "xdg"))
    cmd = [sys.executable, "-c", MOUNT_WRAPPER, str(rate), "mount", vol_dir, mp]
    cmd += ["--staging", os.path.join(base, "staging"), "--staging-size", str(2 * total)]
    cmd += ["--durability", mode]
    log = open(os.path.join(base, f"mount-{mode}.log"), "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    out: dict = {}
    try:
        end = time.monotonic() + 30
        while not _mounted(mp):
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"mount did not come up (see {log.name})")
            time.sleep(0.1)
        t0 = time.perf_counter()
        with open(os.path.join(mp, f"{mode}.bin"), "wb", buffering=0) as f:
            for piece in UniqueBlocks(seed).pieces(total):
                f.write(piece)
            os.fsync(f.fileno())
        out["save_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        os.setxattr(mp, "user.ckptfs.flush", b"1")
        out["drain_s"] = round(time.perf_counter() - t0, 2)
    finally:
        if _mounted(mp):
            subprocess.run(
                [sys.executable, "-m", "fusefs.cli", "umount", mp], env=env, capture_output=True
            )
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return out


def run(total: int, rate: float, base: str, mount: bool = False) -> dict:
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
    if mount:
        try:
            loc = _mount_save(base, vol_dir, total, rate, "local", 5)
            rem = _mount_save(base, vol_dir, total, rate, "remote", 6)
            out["mount"] = {
                "local_save_s": loc["save_s"],
                "save_vs_disk": round(disk_s / loc["save_s"], 3),
                "drain_s": loc["drain_s"],
                "remote_save_s": rem["save_s"],
                "local_vs_remote_speedup": round(rem["save_s"] / loc["save_s"], 2),
            }
        except (OSError, RuntimeError) as e:
            out["mount"] = {"error": str(e)}
    return out


def warm(total: int, base: str, rounds: int = 3) -> dict:
    """Saves of `total` bytes into a tier of budget 2 x total: the first into an empty staging
    dir, then, once earlier saves were drained into the read cache and fill the budget, more.
    Each save is drained before the next and followed by a 2 s pause (untimed), so every
    warm save evicts as many cached bytes as it stages."""
    vol_dir = os.path.join(base, "vol-warm")
    Volume.create(vol_dir, nodes=4, settings=VolumeSettings(chunk_size=4 * MiB, replicas=2)).close()
    vol = Volume.open(vol_dir)
    tier = vol.attach_tier(os.path.join(base, "staging-warm"), size=2 * total, durability="local")
    secs = []
    try:
        for k in range(2 + rounds):
            secs.append(_save(vol, f"/warm-{k}.bin", total, 100 + k))
            tier.flush()
            time.sleep(2.0)
        cached = tier.stats()["cached_bytes"]
    finally:
        vol.close()
    cold, hot = secs[0], secs[2:]
    return {
        "cold_save_s": round(cold, 2),
        "warm_save_s": [round(x, 2) for x in hot],
        "cached_bytes_after": cached,
        "warm_vs_cold_save": round(cold / (sum(hot) / len(hot)), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2GiB")
    p.add_argument("--rate", type=float, default=50e6, help="aggregate node cap, bytes/s")
    p.add_argument("--dir", default=None, help="scratch directory (on the disk to measure)")
    p.add_argument("--mount", action="store_true", help="also save through a FUSE mount")
    p.add_argument("--warm", action="store_true", help="also save into a full read cache")
    args = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="ckptfs-bench-wb-", dir=args.dir)
    try:
        out = run(parse_size(args.size), args.rate, base, args.mount)
        if args.warm:
            out["warm"] = warm(parse_size(args.size) // 2, base)
        print(json.dumps(out))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
