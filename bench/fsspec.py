"""fsspec benchmark: the ckptfs fsspec filesystem vs the mount vs the local disk, in one
run; one JSON object.

- Sequential write (1 MiB writes, then close/fsync) and cold read (1 MiB reads, page
  cache dropped when root) of `--size` MiB (1 GiB by default) through `fsspec.open`, the
  same through a `ckptfs mount` of the same volume, and directly on the disk. Both ckptfs
  frontends stage in the same write-behind directory (durability local); after each
  write the tier is drained (untimed) so its upload slows no later phase, and each timed
  phase starts after a sync(). Every phase writes different bytes (dedup would skip them).
- Where the tier stages (`--tier`, both by default, one after the other): `ram` stages
  on a RAM disk (/dev/shm), standing in for the host-local NVMe the tier is built for,
  which takes writes faster than either frontend makes them: what the frontends
  themselves cost then decides the ratios (NVMe itself is not measured: on tmpfs an
  fsync is free and the tier's read cache is RAM, so those reads are not cold). `disk`
  stages on this VM's disk (230-450 MB/s with fsync), slower than either frontend: both
  wait on it, and the ratio mostly follows its minute-to-minute swings. The object nodes
  are on the disk either way. The top-level `write_vs_mount` and `read_vs_mount` are the
  worse of the tiers' medians; `tiers` has each tier's medians and every round. The
  tier's read cache is emptied between rounds, so every round starts alike.
- `--pairs` rounds (4 by default), each measuring the disk, the mount and fsspec back to
  back, alternating whether the mount or fsspec goes first, so no frontend always gets
  the quieter minute. A tier's ratios are the medians of its rounds' ratios.
  `*_cpu_s_per_gib` is the CPU the work cost (fsspec: its process; the mount: its daemon
  plus the writing or reading process).
  Targets: write_vs_mount >= 1.0 and read_vs_mount >= 1.0 (fsspec throughput over the
  mount's: no FUSE crossing in the way).
- metrics_overhead: what serving `--metrics` costs the mount's writes (measured with the
  tier on RAM when that tier runs: the disk's swings are 10-20% a round). The counters
  are kept whether or not the endpoint runs (an integer add on the hot paths), so the
  endpoint's cost is its scrapes: while a mount with `--metrics` writes `--overhead-size`
  MiB, /metrics is scraped every `--scrape-interval` s (1 s; Prometheus' default is 15).
  The daemon counts the CPU time its endpoint's request threads spent
  (`ckptfs_metrics_scrape_cpu_seconds_total`); `metrics_overhead_cpu_share` is that CPU
  time over the write's time, the worst of `--rounds` writes. That is an estimate, not a
  bound (a thread can hold the GIL, or a lock, while descheduled; the accept loop and the
  scraper's own CPU are not counted), so it is calibrated where a loss is big enough to
  measure: `amplified` repeats the with/without writes scraping every
  `--amplified-interval` s (0.02), and compares the measured loss (1 - median(with) /
  median(without), alternating) with the CPU share there (`loss_over_cpu_share`).
  `metrics_overhead` = the CPU share at the normal rate times that ratio (never less
  than the share itself). Target <= 0.03. `metrics_overhead_ab` is the direct comparison
  at the normal rate, within its rounds' noise.

The machine is shared and noisy: the baselines are measured in the same run, and
`loadavg` says how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
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
        self.scrape_s: list[float] = []  # each scrape's wall time, request to last byte
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while True:  # at least one scrape, however short the write
                t = time.perf_counter()
                with urllib.request.urlopen(self.url, timeout=10) as r:
                    r.read()
                self.scrape_s.append(time.perf_counter() - t)
                if self.stop.wait(self.interval):
                    return
        except BaseException as e:  # noqa: BLE001 - re-raised by finish()
            self.error = e

    def finish(self) -> str:
        """Stop, and return /metrics once the daemon counted every scrape before it (it
        counts one after sending its reply; the tries here count too)."""
        self.stop.set()
        self.join()
        if self.error is not None:
            raise RuntimeError(f"scraping {self.url} failed: {self.error}")
        for attempt in range(100):
            with urllib.request.urlopen(self.url, timeout=10) as r:
                page = r.read().decode()
            if sample(page, "ckptfs_metrics_scrapes_total") >= len(self.scrape_s) + attempt:
                return page
            time.sleep(0.01)
        raise RuntimeError("the metrics endpoint did not count its scrapes")


def sample(page: str, name: str, **labels: str) -> float:
    """The value of sample `name` with `labels` on a /metrics page, -1 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return -1.0


def tier_opts(args, staging: str) -> list[str]:
    """The mount options that stage in `staging` (the fsspec side gets the same values)."""
    return ["--staging", staging, "--staging-size", args.staging_size, "--durability", "local"]


def overhead_rounds(
    args, vol: str, base: str, env: dict, staging: str, data: Data, interval: float
) -> dict:
    """`--rounds` pairs of mount writes, with --metrics scraped every `interval` s and
    without, alternating which goes first: throughputs, and the endpoint's CPU share."""
    nbytes = args.overhead_size * MiB
    runs: dict[str, list[float]] = {"with": [], "without": []}
    shares: list[float] = []  # the endpoint's CPU over the write's time, per round
    scrape_s: list[float] = []  # each scrape's wall time (GIL waits included)
    cpu_s: list[float] = []  # CPU per scrape in the daemon, per round
    counted = 0.0
    for r in range(args.rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        for kind in order:
            mp = os.path.join(base, f"mnt-{kind}")
            port = free_port()
            extra = ["--metrics", f"127.0.0.1:{port}"] if kind == "with" else []
            clear_cache(staging)
            proc = mount_ckptfs(vol, mp, env, *tier_opts(args, staging), *extra)
            try:
                scraper = Scraper(port, interval) if kind == "with" else None
                if scraper is not None:
                    scraper.start()
                secs = seq_write(os.path.join(mp, f"ovh-{r}-{kind}"), data.next()[:nbytes])
                runs[kind].append(mbps(nbytes, secs))
                if scraper is not None:
                    page = scraper.finish()
                    counted = sample(page, "ckptfs_fuse_bytes_total", op="write")
                    cpu = sample(page, "ckptfs_metrics_scrape_cpu_seconds_total")
                    shares.append(cpu / secs)
                    cpu_s.append(cpu / len(scraper.scrape_s))
                    scrape_s += scraper.scrape_s
                drain(mp)
            finally:
                unmount(mp, proc)
    return {
        "interval_s": interval,
        "cpu_share_rounds": [round(x, 4) for x in shares],
        "loss_ab": round(
            1 - statistics.median(runs["with"]) / statistics.median(runs["without"]), 4
        ),
        "write_mbps": runs,
        "scrapes": len(scrape_s),
        "scrape_ms": {
            "median": round(statistics.median(scrape_s) * 1e3, 2),
            "max": round(max(scrape_s) * 1e3, 2),
        },
        "scrape_cpu_ms": round(statistics.median(cpu_s) * 1e3, 2),
        "scraped_written_bytes": counted,
    }


def overhead(args, vol: str, base: str, env: dict, staging: str, data: Data) -> dict:
    """The endpoint's cost at the normal scrape rate, and the amplified check of the
    estimate (module docstring)."""
    normal = overhead_rounds(args, vol, base, env, staging, data, args.scrape_interval)
    amp = overhead_rounds(args, vol, base, env, staging, data, args.amplified_interval)
    amp["cpu_share"] = round(statistics.median(amp["cpu_share_rounds"]), 4)
    # How far the CPU share fell short of the loss where the loss is measurable; the
    # estimate at the normal rate is scaled up by that, never down.
    amp["loss_over_cpu_share"] = round(amp["loss_ab"] / amp["cpu_share"], 3)
    share = max(normal["cpu_share_rounds"])
    return {
        "metrics_overhead": round(share * max(1.0, amp["loss_over_cpu_share"]), 4),
        "metrics_overhead_cpu_share": share,
        "metrics_overhead_ab": normal["loss_ab"],
        "overhead_size_mib": args.overhead_size,
        "overhead": normal,
        "amplified": amp,
    }


def clear_cache(staging: str) -> None:
    """Empty the tier's read cache (no process has the tier open): every round starts with
    the same free space, whatever the rounds before it left there."""
    cache = os.path.join(staging, "cache")
    if os.path.isdir(cache):
        for name in os.listdir(cache):
            os.unlink(os.path.join(cache, name))


RAM_PREFIX = "ckptfs-bench-fsspec-tier-"


def ram_check(args) -> None:
    """A scratch directory on /dev/shm for the tier, refused (one line) when there is no
    such tmpfs or it has no room for a round (two writes: the cache is emptied between)."""
    need = 2 * max(args.size, args.overhead_size) * MiB + 256 * MiB
    if fs_type("/dev/shm") != "tmpfs":
        sys.exit("bench.fsspec: no tmpfs at /dev/shm for the RAM tier; use --tier disk")
    st = os.statvfs("/dev/shm")
    if st.f_bavail * st.f_frsize < need:
        sys.exit(f"bench.fsspec: /dev/shm has under {need >> 20} MiB free; use --tier disk")


def fs_type(path: str) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mp = fields[1].replace("\\040", " ")
            if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
                best, kind = mp, fields[2]
    return kind


def timed_cpu(fn: Callable[[], T], *pids: int) -> tuple[T, float]:
    """fn()'s result and the CPU seconds it cost this process and `pids`."""

    def cpu() -> float:
        return time.process_time() + sum(cpu_s(p) for p in pids)

    c = cpu()
    got = fn()
    return got, cpu() - c


def one_round(args, r: int, vol: str, base: str, env: dict, staging: str, data: Data) -> dict:
    """The disk, then the mount and fsspec (which first alternates with r): one sample of
    each, written, drained (untimed) and read cold."""
    from fusefs.cli.units import parse_size
    from fusefs.client.registry import close_volumes
    from fusefs.fsspec import CkptfsFileSystem

    nbytes = args.size * MiB
    res: dict = {}
    disk = os.path.join(base, "disk.bin")
    res["disk_write_mbps"] = mbps(nbytes, seq_write(disk, data.next()[:nbytes]))
    res["disk_read_mbps"] = mbps(nbytes, seq_read(disk))
    os.unlink(disk)

    def mount() -> None:
        mp = os.path.join(base, "mnt")
        proc = mount_ckptfs(vol, mp, env, *tier_opts(args, staging))
        try:
            path = os.path.join(mp, f"seq-{r}.bin")
            view = data.next()[:nbytes]
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
            staging=staging,
            staging_size=parse_size(args.staging_size),
        )
        try:
            path = f"/seq-fsspec-{r}.bin"
            view = data.next()[:nbytes]
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

    clear_cache(staging)
    for fn in (mount, fsspec) if r % 2 == 0 else (fsspec, mount):
        fn()
    for k in ("write", "read"):
        res[f"{k}_vs_mount"] = round(res[f"fsspec_{k}_mbps"] / res[f"mount_{k}_mbps"], 3)
        res[f"{k}_vs_disk"] = round(res[f"fsspec_{k}_mbps"] / res[f"disk_{k}_mbps"], 3)
    return res


def tier_rounds(args, name: str, tier_base: str, vol: str, base: str, env: dict, data: Data):
    """`--pairs` rounds with the tier staging under `tier_base`: medians and every round."""
    staging = os.path.join(tier_base, f"staging-{name}")
    rounds = [one_round(args, r, vol, base, env, staging, data) for r in range(args.pairs)]
    res: dict = {"staging_fs": fs_type(tier_base)}
    gib = args.size / 1024
    for key in rounds[0]:
        res[key] = round(statistics.median(rd[key] for rd in rounds), 3)
        if key.endswith("_cpu_s"):
            res[key.removesuffix("_s") + "_s_per_gib"] = round(res.pop(key) / gib, 2)
    res["rounds"] = rounds
    return res, staging


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--size", type=int, default=1024, help="sequential test size, MiB")
    ap.add_argument("--pairs", type=int, default=4, help="rounds of disk, mount and fsspec")
    ap.add_argument("--overhead-size", type=int, default=1024, help="MiB per overhead write")
    ap.add_argument("--rounds", type=int, default=4, help="overhead rounds (each: with, without)")
    ap.add_argument("--scrape-interval", type=float, default=1.0, metavar="SECONDS")
    ap.add_argument("--amplified-interval", type=float, default=0.02, metavar="SECONDS")
    ap.add_argument("--staging-size", default="16GiB")
    ap.add_argument("--tier", choices=("both", "ram", "disk"), default="both")
    ap.add_argument("--no-overhead", action="store_true")
    args = ap.parse_args()
    if args.pairs < 1 or args.size < 1 or args.rounds < 1 or args.overhead_size < 1:
        ap.error("--pairs, --size, --rounds and --overhead-size must be at least 1")
    tiers = ("ram", "disk") if args.tier == "both" else (args.tier,)
    if "ram" in tiers:
        ram_check(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the scratch goes too

    out: dict = {"size_mib": args.size, "loadavg": [round(os.getloadavg()[0], 1)]}
    base = ram = None
    try:
        base = tempfile.mkdtemp(prefix="ckptfs-bench-fsspec-", dir=args.dir)
        if "ram" in tiers:
            ram = tempfile.mkdtemp(prefix=RAM_PREFIX, dir="/dev/shm")
        env = dict(os.environ)
        env["XDG_DATA_HOME"] = os.path.join(base, "xdg")
        env["XDG_CACHE_HOME"] = os.path.join(base, "xdg-cache")
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        os.environ.update(XDG_DATA_HOME=env["XDG_DATA_HOME"], XDG_CACHE_HOME=env["XDG_CACHE_HOME"])
        from fusefs.client.volume import Volume

        vol = os.path.join(base, "vol")
        Volume.create(vol).close()
        data = Data(max(args.size, args.overhead_size) * MiB)
        out["cold_read_dropped_caches"] = drop_caches()
        out["tiers"] = {}
        stagings = []
        for name in tiers:
            res, staging = tier_rounds(
                args, name, ram if name == "ram" else base, vol, base, env, data
            )
            out["tiers"][name] = res
            stagings.append(staging)
        for key in ("write_vs_mount", "read_vs_mount"):
            out[key] = min(t[key] for t in out["tiers"].values())
        if not args.no_overhead:
            out["overhead_tier"] = tiers[0]
            out.update(overhead(args, vol, base, env, stagings[0], data))
        out["loadavg"].append(round(os.getloadavg()[0], 1))
        out["targets"] = {
            "write_vs_mount": ">= 1.0",
            "read_vs_mount": ">= 1.0",
            "metrics_overhead": "<= 0.03",
        }
    finally:
        for d in (base, ram):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
