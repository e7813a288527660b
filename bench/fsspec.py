"""fsspec benchmark: the ckptfs fsspec filesystem vs the mount vs the local disk, in one
run; one JSON object.

- Sequential write (1 MiB writes, then close/fsync) and cold read (1 MiB reads, page
  cache dropped when root) of `--size` MiB (1 GiB by default) through `fsspec.open`, the
  same through a `ckptfs mount` of the same volume, and directly on the disk. Both ckptfs
  frontends stage in the same write-behind directory (durability local); after each
  write the tier is drained (untimed) so its upload slows no later phase, and each timed
  phase starts after a sync(). Every phase writes different bytes (dedup would skip them).
- `--pairs` rounds (3 by default), each measuring the disk, the mount and fsspec back to
  back, alternating whether the mount or fsspec goes first: the disk's speed swings from
  minute to minute and both frontends are bound by it at 1 GiB, so one sample each says
  more about the minute than about the frontend. The ratios are the medians of the
  rounds' ratios; every round is in `rounds`. `*_cpu_s_per_gib` is the CPU the work cost
  (fsspec: its process; the mount: its daemon plus the writing or reading process), the
  figure a FUSE crossing adds to whatever the disk allows.
  Targets: write_vs_mount >= 1.0 and read_vs_mount >= 1.0 (fsspec throughput over the
  mount's: no FUSE crossing in the way).
- metrics_overhead: the mount's write throughput with `--metrics` being scraped (every
  `--scrape-interval` s, Prometheus' default is 15) against a mount without it, over
  `--rounds` rounds alternating which goes first; 1 - best_with / best_without. Target
  <= 0.03. On a shared machine this is at the noise level: `overhead_write_mbps` has
  every round.

The machine is shared and noisy: the baselines are measured in the same run, and
`loadavg` says how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import cpu_s, drop_caches  # noqa: E402
from bench.fuse import drain, mbps, mount_ckptfs, seq_read, seq_write, unmount  # noqa: E402
from bench.servers import free_port  # noqa: E402

MiB = 2**20
T = TypeVar("T")


class Data:
    """One buffer of incompressible bytes, re-stamped for every phase: a counter in each
    64 KiB, so no chunk of one phase equals a chunk of another (nor of the same phase)."""

    def __init__(self, nbytes: int) -> None:
        self.buf = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
        self.view = memoryview(self.buf).cast("B")
        self.phase = 0

    def next(self) -> memoryview:
        self.phase += 1
        n = len(self.buf) - len(self.buf) % 65536
        stamps = self.buf[:n].view(np.uint64).reshape(-1, 8192)
        stamps[:, 0] = np.arange(len(stamps), dtype=np.uint64) + (self.phase << 40)
        return self.view


def fsspec_write(fs, path: str, data: memoryview) -> float:
    os.sync()
    t = time.perf_counter()
    with fs.open(path, "wb") as f:
        for off in range(0, len(data), MiB):
            f.write(data[off : off + MiB])
    return time.perf_counter() - t


def fsspec_read(fs, path: str) -> tuple[float, int]:
    drop_caches()
    t = time.perf_counter()
    n = 0
    with fs.open(path, "rb") as f:
        while b := f.read(MiB):
            n += len(b)
    return time.perf_counter() - t, n


class Scraper(threading.Thread):
    """GET /metrics every `interval` seconds while running (as Prometheus would)."""

    def __init__(self, port: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.interval = interval
        self.stop = threading.Event()
        self.scrapes = 0
        self.last = ""

    def run(self) -> None:
        while not self.stop.is_set():
            with urllib.request.urlopen(self.url, timeout=10) as r:
                self.last = r.read().decode()
            self.scrapes += 1
            self.stop.wait(self.interval)


def written_bytes(page: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            if s.name == "ckptfs_fuse_bytes_total" and s.labels.get("op") == "write":
                return s.value
    return -1.0


def overhead(args, vol: str, base: str, env: dict, opts: list[str], data: Data) -> dict:
    """The mount's write throughput with a scraped --metrics endpoint and without."""
    nbytes = args.overhead_size * MiB
    runs: dict[str, list[float]] = {"with": [], "without": []}
    scrapes, counted = 0, 0.0
    for r in range(args.rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        for kind in order:
            mp = os.path.join(base, f"mnt-{kind}")
            port = free_port()
            extra = ["--metrics", f"127.0.0.1:{port}"] if kind == "with" else []
            proc = mount_ckptfs(vol, mp, env, *opts, *extra)
            scraper = None
            try:
                if kind == "with":
                    scraper = Scraper(port, args.scrape_interval)
                    scraper.start()
                secs = seq_write(os.path.join(mp, f"ovh-{r}-{kind}"), data.next()[:nbytes])
                runs[kind].append(mbps(nbytes, secs))
                if scraper is not None:
                    scraper.stop.set()
                    scraper.join()
                    scrapes += scraper.scrapes
                    with urllib.request.urlopen(scraper.url, timeout=10) as resp:
                        counted = written_bytes(resp.read().decode())
                drain(mp)
            finally:
                unmount(mp, proc)
    best_with, best_without = max(runs["with"]), max(runs["without"])
    return {
        "metrics_overhead": round(1 - best_with / best_without, 4),
        "overhead_write_mbps": runs,
        "overhead_size_mib": args.overhead_size,
        "overhead_scrapes": scrapes,
        "overhead_scraped_written_bytes": counted,
    }


def timed_cpu(fn: Callable[[], T], *pids: int) -> tuple[T, float]:
    """fn()'s result and the CPU seconds it cost this process and `pids`."""

    def cpu() -> float:
        return time.process_time() + sum(cpu_s(p) for p in pids)

    c = cpu()
    got = fn()
    return got, cpu() - c


def one_round(args, r: int, vol: str, base: str, env: dict, opts: list[str], data: Data) -> dict:
    """The disk, then the mount and fsspec (which first alternates with r): one sample of
    each, written, drained (untimed) and read cold."""
    from fusefs.cli.units import parse_size
    from fusefs.client.registry import close_volumes
    from fusefs.fsspec import CkptfsFileSystem

    nbytes = args.size * MiB
    res: dict = {}
    disk = os.path.join(base, "disk.bin")
    res["disk_write_mbps"] = mbps(nbytes, seq_write(disk, data.next()))
    res["disk_read_mbps"] = mbps(nbytes, seq_read(disk))
    os.unlink(disk)

    def mount() -> None:
        mp = os.path.join(base, "mnt")
        proc = mount_ckptfs(vol, mp, env, *opts)
        try:
            path = os.path.join(mp, f"seq-{r}.bin")
            view = data.next()
            w, wc = timed_cpu(lambda: seq_write(path, view), proc.pid)
            res["mount_drain_s"] = drain(mp)
            rd, rc = timed_cpu(lambda: seq_read(path), proc.pid)
        finally:
            unmount(mp, proc)
        res.update(mount_write_mbps=mbps(nbytes, w), mount_read_mbps=mbps(nbytes, rd))
        res.update(mount_write_cpu_s=round(wc, 2), mount_read_cpu_s=round(rc, 2))

    def fsspec() -> None:
        fs = CkptfsFileSystem(
            volume=vol,
            staging=os.path.join(base, "staging"),
            staging_size=parse_size(args.staging_size),
        )
        try:
            path = f"/seq-fsspec-{r}.bin"
            view = data.next()
            w, wc = timed_cpu(lambda: fsspec_write(fs, path, view))
            t = time.perf_counter()
            fs.volume.tier.flush()
            res["fsspec_drain_s"] = round(time.perf_counter() - t, 2)
            (rd, n), rc = timed_cpu(lambda: fsspec_read(fs, path))
        finally:
            close_volumes()
        assert n == nbytes, f"read {n} of {nbytes} bytes"
        res.update(fsspec_write_mbps=mbps(nbytes, w), fsspec_read_mbps=mbps(nbytes, rd))
        res.update(fsspec_write_cpu_s=round(wc, 2), fsspec_read_cpu_s=round(rc, 2))

    for fn in (mount, fsspec) if r % 2 == 0 else (fsspec, mount):
        fn()
    for k in ("write", "read"):
        res[f"{k}_vs_mount"] = round(res[f"fsspec_{k}_mbps"] / res[f"mount_{k}_mbps"], 3)
        res[f"{k}_vs_disk"] = round(res[f"fsspec_{k}_mbps"] / res[f"disk_{k}_mbps"], 3)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--size", type=int, default=1024, help="sequential test size, MiB")
    ap.add_argument("--pairs", type=int, default=3, help="rounds of disk, mount and fsspec")
    ap.add_argument("--overhead-size", type=int, default=1024, help="MiB per overhead write")
    ap.add_argument("--rounds", type=int, default=3, help="overhead rounds (each: with, without)")
    ap.add_argument("--scrape-interval", type=float, default=1.0, metavar="SECONDS")
    ap.add_argument("--staging-size", default="16GiB")
    ap.add_argument("--no-overhead", action="store_true")
    args = ap.parse_args()
    if args.pairs < 1 or args.size < 1:
        ap.error("--pairs and --size must be at least 1")

    base = tempfile.mkdtemp(prefix="ckptfs-bench-fsspec-", dir=args.dir)
    env = dict(os.environ)
    env["XDG_DATA_HOME"] = os.path.join(base, "xdg")
    env["XDG_CACHE_HOME"] = os.path.join(base, "xdg-cache")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    os.environ.update(XDG_DATA_HOME=env["XDG_DATA_HOME"], XDG_CACHE_HOME=env["XDG_CACHE_HOME"])
    staging = os.path.join(base, "staging")
    opts = ["--staging", staging, "--staging-size", args.staging_size, "--durability", "local"]
    out: dict = {"size_mib": args.size, "loadavg": [round(os.getloadavg()[0], 1)]}
    try:
        from fusefs.client.volume import Volume

        vol = os.path.join(base, "vol")
        Volume.create(vol).close()
        data = Data(args.size * MiB)
        out["cold_read_dropped_caches"] = drop_caches()
        rounds = [one_round(args, r, vol, base, env, opts, data) for r in range(args.pairs)]
        out["rounds"] = rounds
        gib = args.size / 1024
        for key in rounds[0]:
            vals = [rd[key] for rd in rounds]
            out[key] = round(statistics.median(vals), 3)
            if key.endswith("_cpu_s"):
                out[key.removesuffix("_s") + "_s_per_gib"] = round(out.pop(key) / gib, 2)
        if not args.no_overhead:
            out.update(overhead(args, vol, base, env, opts, data))
        out["loadavg"].append(round(os.getloadavg()[0], 1))
        out["targets"] = {
            "write_vs_mount": ">= 1.0",
            "read_vs_mount": ">= 1.0",
            "metrics_overhead": "<= 0.03",
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
