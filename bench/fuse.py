"""FUSE mount benchmark: the mount vs the local disk vs rclone, in one run; one JSON object.

Everything lives under one scratch directory on the same disk. Baselines are
measured in the same run (the machine is shared and noisy), so the ratios are
what to compare:

- 1 GiB sequential write (1 MiB writes, then fsync) and its cold read (page
  cache dropped, root only) through the mount (durability local), directly
  on the disk, and through `rclone mount --vfs-cache-mode writes` of a local
  directory.
- The checkpoint workload: 8 threads each torch.save ~128 MiB of float32
  tensors (1-32 MiB) to their own file and fsync; step 2 changes 10% of the
  tensors and saves to new files. Step-2 speed vs the disk, and stored-bytes
  growth per changed byte.
- The framework's floors (bench/floorfs.py): the same 1 GiB write, and step 2 of the
  checkpoint workload, through a minimal pyfuse3 filesystem that drops the bytes
  (`framework_*`, `ckpt_step2_framework_*`); the write and cold read through one that
  only stores them in files on the same disk (`storing_floor_*`). They show what the
  simplest filesystems on the same framework do on this machine: `storing_floor_write_vs_disk`
  is the best `write_vs_disk` we found for a pyfuse3 filesystem that keeps the bytes, and
  `ckpt_step2_framework_vs_disk` bounds `ckpt_step2_vs_disk` (nothing is stored at all).
- 2,000 files of 4 KiB created, written and closed.
- Peak RSS (VmHWM) of a fresh daemon while 8 GiB are written.

After each write through the mount, the write-behind tier is drained (untimed, reported as
`*_drain_s`) so its background upload to the nodes, which share the disk, slows neither the
next baseline nor the mount's own next phase, and every timed phase starts after a sync(),
so none pays for an earlier one's dirty pages. `daemon_cpu_s_*` is the daemon's CPU time per
phase and `loadavg` the machine's load: on a shared 2-core machine they explain the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import cpu_s, drop_caches  # noqa: E402

MiB = 2**20
GiB = 2**30


def is_mounted(mp: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == mp for line in f)


def wait_mounted(mp: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mount of {mp} exited with {proc.returncode}")
        if is_mounted(mp):
            try:
                os.stat(mp)
                return
            except OSError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"{mp} not mounted after {timeout}s")


def unmount(mp: str, proc: subprocess.Popen | None) -> None:
    if is_mounted(mp):
        subprocess.run(["fusermount3", "-u", mp], capture_output=True)
    if proc is not None:
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    if is_mounted(mp):
        subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True)


def mount_ckptfs(vol: str, mp: str, env: dict, *opts: str) -> subprocess.Popen:
    os.makedirs(mp, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusefs.cli", "mount", vol, mp, *opts], env=env, cwd=ROOT
    )
    wait_mounted(mp, proc)
    return proc


def mount_floor(base: str, env: dict, procs: list, *opts: str) -> tuple[str, subprocess.Popen]:
    """Mount bench/floorfs.py with the read-ahead the mount sets for itself."""
    from fusefs.mount.tuning import tune_readahead

    mp = os.path.join(base, "floor-mnt")
    os.makedirs(mp, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "bench.floorfs", mp, *opts], env=env, cwd=ROOT)
    procs.append((mp, proc))
    wait_mounted(mp, proc)
    tune_readahead(os.stat(mp).st_dev)
    return mp, proc


def seq_write(path: str, data: memoryview) -> float:
    os.sync()  # no earlier phase's dirty pages written back during this one
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(data), MiB):
            os.write(fd, data[off : off + MiB])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def seq_read(path: str) -> float:
    drop_caches()
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    n = 0
    try:
        while True:
            b = os.read(fd, MiB)
            if not b:
                break
            n += len(b)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def drain(mp: str) -> float:
    """Wait until everything the mount staged is on the nodes (untimed housekeeping)."""
    t = time.perf_counter()
    os.setxattr(mp, "user.ckptfs.flush", b"1")
    return round(time.perf_counter() - t, 2)


def mbps(nbytes: int, secs: float) -> float:
    return round(nbytes / MiB / secs, 1)


# -- checkpoint workload ------------------------------------------------------------------
def make_states(threads: int, per_thread: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    states = []
    for _ in range(threads):
        sd, total, i = {}, 0, 0
        while total < per_thread:
            n = min(rng.randint(1, 32) * MiB, per_thread - total) // 4
            sd[f"t{i}"] = torch.randn(max(n, 1), generator=g)
            total += sd[f"t{i}"].numel() * 4
            i += 1
        states.append(sd)
    return states


def change_some(states, frac: float, seed: int) -> int:
    """Replace ~frac of the tensors (by count) with new values; returns the changed bytes."""
    import torch

    rng = random.Random(seed)
    changed = 0
    for sd in states:
        keys = list(sd)
        for k in rng.sample(keys, max(1, round(len(keys) * frac))):
            sd[k] = torch.randn(sd[k].numel())
            changed += sd[k].numel() * 4
    return changed


def save_all(states, directory: str, tag: str) -> float:
    import torch

    os.makedirs(directory, exist_ok=True)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with open(os.path.join(directory, f"{tag}-rank{i}.pt"), "wb") as f:
                torch.save(states[i], f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as e:
            errors.append(e)

    os.sync()
    t = time.perf_counter()
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(states))]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t


def stored_bytes(vol_dir: str) -> int:
    from fusefs.client.volume import Volume

    with Volume.open(vol_dir) as v:
        return v.stats()["stored_bytes"]


def small_files(directory: str, n: int, *, unique: bool = True, fsync: bool = False) -> float:
    """create+write+close of n files of 4 KiB a second. unique: every file's content
    differs (as in a source tree: each close stores a new chunk); else all files hold the
    same bytes, so after the first only the metadata changes (dedup). fsync: each file
    is fsync'd before close (the durability a close has on the mount's local tier)."""
    os.makedirs(directory, exist_ok=True)
    payload = bytearray(os.urandom(4096))
    os.sync()
    t = time.perf_counter()
    for i in range(n):
        if unique:
            payload[:8] = i.to_bytes(8, "little")
        with open(os.path.join(directory, f"s{i:05d}"), "wb") as f:
            f.write(payload)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return n / (time.perf_counter() - t)


def peak_rss_writing(vol: str, mp: str, env: dict, nbytes: int, opts: list[str]) -> float:
    """A fresh daemon's VmHWM (MiB) after writing nbytes of unique data and fsync."""
    proc = mount_ckptfs(vol, mp, env, *opts)
    try:
        pool = bytearray(os.urandom(64 * MiB))
        fd = os.open(os.path.join(mp, "rss.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for i in range(nbytes // MiB):
                p = (i * MiB) % len(pool)
                pool[p : p + 8] = i.to_bytes(8, "little")  # every chunk unique: no dedup
                os.write(fd, memoryview(pool)[p : p + MiB])
            os.fsync(fd)
        finally:
            os.close(fd)
        with open(f"/proc/{proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
        return -1.0
    finally:
        unmount(mp, proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--size", type=int, default=1024, help="sequential test size, MiB")
    ap.add_argument("--ckpt-mib", type=int, default=128, help="per-thread checkpoint MiB")
    ap.add_argument("--rss-gib", type=float, default=8.0, help="GiB written for the RSS test")
    ap.add_argument("--small", type=int, default=2000, help="small files")
    ap.add_argument("--durability", default="local", choices=["local", "remote"])
    ap.add_argument("--no-rclone", action="store_true")
    args = ap.parse_args()

    base = tempfile.mkdtemp(prefix="ckptfs-bench-fuse-", dir=args.dir)
    env = dict(os.environ)
    env["XDG_DATA_HOME"] = os.path.join(base, "xdg")
    env["XDG_CACHE_HOME"] = os.path.join(base, "xdg-cache")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out: dict = {"durability": args.durability, "loadavg": [round(os.getloadavg()[0], 1)]}
    procs: list[tuple[str, subprocess.Popen | None]] = []
    opts = ["--staging", os.path.join(base, "staging"), "--durability", args.durability]
    try:
        from fusefs.client.volume import Volume

        vol = os.path.join(base, "vol")
        Volume.create(vol).close()
        mp = os.path.join(base, "mnt")
        proc = mount_ckptfs(vol, mp, env, *opts)
        procs.append((mp, proc))
        nbytes = args.size * MiB
        data = memoryview(os.urandom(nbytes))
        out["cold_read_dropped_caches"] = drop_caches()

        # 1. sequential write + cold read: disk, mount, rclone
        disk_dir = os.path.join(base, "disk")
        os.makedirs(disk_dir)
        w_disk = seq_write(os.path.join(disk_dir, "seq"), data)
        r_disk = seq_read(os.path.join(disk_dir, "seq"))
        c0 = cpu_s(proc.pid)
        w_fs = seq_write(os.path.join(mp, "seq"), data)
        c1 = cpu_s(proc.pid)
        out["write_drain_s"] = drain(mp)
        c2 = cpu_s(proc.pid)
        r_fs = seq_read(os.path.join(mp, "seq"))
        out["daemon_cpu_s_write"] = round(c1 - c0, 2)
        out["daemon_cpu_s_read"] = round(cpu_s(proc.pid) - c2, 2)
        out.update(
            disk_write_mbps=mbps(nbytes, w_disk),
            disk_read_mbps=mbps(nbytes, r_disk),
            write_mbps=mbps(nbytes, w_fs),
            read_mbps=mbps(nbytes, r_fs),
            write_vs_disk=round(w_disk / w_fs, 3),
            read_vs_disk=round(r_disk / r_fs, 3),
        )
        if not args.no_rclone and shutil.which("rclone"):
            rsrc, rmp = os.path.join(base, "rclone-src"), os.path.join(base, "rclone-mnt")
            os.makedirs(rsrc)
            os.makedirs(rmp)
            rproc = subprocess.Popen(
                [
                    "rclone",
                    "mount",
                    rsrc,
                    rmp,
                    "--vfs-cache-mode",
                    "writes",
                    "--cache-dir",
                    os.path.join(base, "rclone-cache"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append((rmp, rproc))
            wait_mounted(rmp, rproc)
            w_rc = seq_write(os.path.join(rmp, "seq"), data)
            time.sleep(1)
            r_rc = seq_read(os.path.join(rmp, "seq"))
            out.update(
                rclone_write_mbps=mbps(nbytes, w_rc),
                rclone_read_mbps=mbps(nbytes, r_rc),
                write_vs_rclone=round(w_rc / w_fs, 3),
                read_vs_rclone=round(r_rc / r_fs, 3),
            )
            unmount(rmp, rproc)
        # the framework's floors (bench/floorfs.py): the same write through a filesystem that
        # drops the bytes, then the write and cold read through one that only stores them
        fmp, fproc = mount_floor(base, env, procs)
        w_null = seq_write(os.path.join(fmp, "seq"), data)
        unmount(fmp, fproc)
        store = os.path.join(base, "floor-store")
        os.makedirs(store)
        fmp, fproc = mount_floor(base, env, procs, "--store", store)
        w_store = seq_write(os.path.join(fmp, "seq"), data)
        r_store = seq_read(os.path.join(fmp, "seq"))
        unmount(fmp, fproc)
        shutil.rmtree(store)
        out.update(
            framework_write_mbps=mbps(nbytes, w_null),
            write_vs_framework=round(w_null / w_fs, 3),
            storing_floor_write_mbps=mbps(nbytes, w_store),
            storing_floor_read_mbps=mbps(nbytes, r_store),
            storing_floor_write_vs_disk=round(w_disk / w_store, 3),
            storing_floor_read_vs_disk=round(r_disk / r_store, 3),
            write_vs_storing_floor=round(w_store / w_fs, 3),
            read_vs_storing_floor=round(r_store / r_fs, 3),
        )
        del data

        # 2. checkpoint workload
        states = make_states(8, args.ckpt_mib * MiB, seed=1)
        save_all(states, os.path.join(disk_dir, "ckpt"), "step1")
        save_all(states, os.path.join(mp, "ckpt"), "step1")
        out["ckpt_step1_drain_s"] = drain(mp)
        before = stored_bytes(vol)
        changed = change_some(states, 0.10, seed=2)
        t_disk2 = save_all(states, os.path.join(disk_dir, "ckpt"), "step2")
        c0 = cpu_s(proc.pid)
        t_fs2 = save_all(states, os.path.join(mp, "ckpt"), "step2")
        out["daemon_cpu_s_step2"] = round(cpu_s(proc.pid) - c0, 2)
        out["ckpt_step2_drain_s"] = drain(mp)
        growth = stored_bytes(vol) - before
        fmp, fproc = mount_floor(base, env, procs)  # the same saves, bytes dropped
        t_floor2 = save_all(states, fmp, "step2")
        unmount(fmp, fproc)
        out.update(
            ckpt_step2_s=round(t_fs2, 3),
            ckpt_step2_disk_s=round(t_disk2, 3),
            ckpt_step2_vs_disk=round(t_disk2 / t_fs2, 3),
            ckpt_step2_framework_s=round(t_floor2, 3),
            ckpt_step2_framework_vs_disk=round(t_disk2 / t_floor2, 3),
            ckpt_changed_mib=round(changed / MiB, 1),
            ckpt_growth_mib=round(growth / MiB, 1),
            ckpt_step2_growth_vs_changed=round(growth / changed, 3),
        )
        del states

        # 3. small files: unique content (the target), then all-identical (dedup) content;
        # on the disk without and with an fsync per file (a close on the mount is durable)
        c0 = cpu_s(proc.pid)
        out["small_files_per_s"] = round(small_files(os.path.join(mp, "small"), args.small), 1)
        out["daemon_cpu_s_small"] = round(cpu_s(proc.pid) - c0, 2)
        out["small_files_same_content_per_s"] = round(
            small_files(os.path.join(mp, "small-same"), args.small, unique=False), 1
        )
        out["disk_small_files_per_s"] = round(
            small_files(os.path.join(disk_dir, "small"), args.small), 1
        )
        out["disk_small_files_fsync_per_s"] = round(
            small_files(os.path.join(disk_dir, "small-fsync"), args.small, fsync=True), 1
        )
        unmount(mp, proc)
        procs.clear()
        for d in (vol, disk_dir, os.path.join(base, "staging")):  # the disk is shared: free it
            shutil.rmtree(d, ignore_errors=True)

        # 4. peak RSS of a fresh daemon writing 8 GiB
        vol2 = os.path.join(base, "vol-rss")
        Volume.create(vol2).close()
        rss_opts = ["--staging", os.path.join(base, "staging-rss"), "--durability", args.durability]
        out["rss_written_gib"] = args.rss_gib
        out["daemon_peak_rss_mib"] = peak_rss_writing(
            vol2, os.path.join(base, "mnt-rss"), env, int(args.rss_gib * GiB), rss_opts
        )
    finally:
        for m, p in procs:
            unmount(m, p)
        shutil.rmtree(base, ignore_errors=True)
    out["loadavg"].append(round(os.getloadavg()[0], 1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
