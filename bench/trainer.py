"""The mount as trainers use it, against the local disk in the same run; one JSON object.

Issue 30's workload, every phase on the mount and on the disk it lives on (the machine is
shared and noisy, so only ratios measured in one run compare):

- `torch.save` by 8 ranks (processes), each a state dict of 20 fp32 tensors of 1 to
  32 MiB (about 128 MiB a rank) to its own file, with fsync. Step 2 changes 2 of each
  rank's 20 tensors (same shapes, new values) and saves to new files; the volume's stored
  bytes grow by `torchsave_growth_vs_changed` times the changed bytes (stored bytes are
  counted once per chunk, i.e. per replica; `torchsave_raw_growth_vs_changed` before
  compression).
- An 8-rank parallel cold `torch.load` of the step-2 files (page cache dropped, and a
  freshly started daemon, so nothing is warm in its memory): `parallel_load_vs_disk`.
  Each round loads from the disk and from the mount; the order alternates per round.
- `stat` of 2,000 files: warm (every file stat'ed once, then timed passes `--warm-gap`
  seconds later) and cold (kernel caches dropped): `stat_warm_per_s`, `stat_cold_per_s`,
  each beside the disk's.
- Today's sequential figures in the same run: a 1 GiB write (1 MiB writes, fsync) and
  its cold read, `write_vs_disk` and `read_vs_disk` (as bench.fuse measures them).

`--code DIR` runs the mount daemon from another checkout (its PYTHONPATH), so old and new
code can be compared with the same benchmark; phases can be picked with `--phases`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import cpu_s, drop_caches  # noqa: E402
from bench.fuse import (  # noqa: E402
    drain,
    mbps,
    seq_read,
    seq_write,
    unmount,
    wait_mounted,
)

MiB = 2**20
GiB = 2**30
PHASES = ("seq", "ckpt", "load", "stat")


# -- ranks: one process each, holding its state dict across steps ---------------------
def tensor_sizes(rank: int, n: int, total: int) -> list[int]:
    """n sizes of 1 to 32 MiB summing to about `total` bytes (multiples of 4 bytes)."""
    rng = random.Random(1000 + rank)
    raw = [rng.uniform(1, 32) for _ in range(n)]
    scale = total / MiB / sum(raw)
    return [int(min(32.0, max(1.0, r * scale)) * MiB) // 4 * 4 for r in raw]


def _rank_main(rank: int, n: int, total: int, conn: Connection) -> None:
    """A rank: builds its state dict, then runs the parent's commands until told to stop."""
    import torch

    sizes = tensor_sizes(rank, n, total)
    g = torch.Generator().manual_seed(rank)
    sd = {f"layer{i}.weight": torch.randn(s // 4, generator=g) for i, s in enumerate(sizes)}
    conn.send(("ready", sum(sizes)))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            return
        try:
            if cmd == "save":
                with open(args[0], "wb") as f:
                    torch.save(sd, f)
                    f.flush()
                    os.fsync(f.fileno())
                conn.send(("ok", None))
            elif cmd == "change":  # k tensors get new values: the bytes that changed
                keys = random.Random(2000 + rank).sample(sorted(sd), args[0])
                for k in keys:
                    sd[k] = torch.randn(sd[k].numel(), generator=g)
                conn.send(("ok", sum(sd[k].numel() * 4 for k in keys)))
            elif cmd == "load":
                back = torch.load(args[0], weights_only=True)
                conn.send(("ok", sum(t.numel() * 4 for t in back.values())))
            elif cmd == "check":  # every byte as saved (not timed)
                back = torch.load(args[0], weights_only=True)
                same = back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
                conn.send(("ok", same))
        except BaseException as e:  # reported by the parent
            conn.send(("error", f"rank {rank} {cmd}: {type(e).__name__}: {e}"))


class Ranks:
    """The rank processes; `run` sends one command to each and times until all answer."""

    def __init__(self, ranks: int, tensors: int, total: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for r in range(ranks):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, tensors, total, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.bytes = sum(self._answers())

    def _answers(self) -> list:
        out = []
        for c in self.conns:
            status, value = c.recv()
            if status == "error":
                raise RuntimeError(value)
            out.append(value)
        return out

    def run(self, cmd: str, arg_of_rank=lambda r: ()) -> tuple[float, list]:
        t = time.perf_counter()
        for r, c in enumerate(self.conns):
            c.send((cmd, *arg_of_rank(r)))
        out = self._answers()
        return time.perf_counter() - t, out

    def stop(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def mount_ckptfs(code: str, vol: str, mp: str, env: dict, *opts: str) -> subprocess.Popen:
    """`ckptfs mount` from the checkout `code`: run from there, since `python -m` puts the
    working directory ahead of PYTHONPATH (bench.fuse's helper runs this checkout's)."""
    os.makedirs(mp, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusefs.cli", "mount", vol, mp, *opts], env=env, cwd=code
    )
    wait_mounted(mp, proc)
    return proc


# -- stat ----------------------------------------------------------------------------
def make_files(directory: str, n: int) -> None:
    os.makedirs(directory, exist_ok=True)
    payload = bytearray(os.urandom(4096))
    for i in range(n):
        payload[:8] = i.to_bytes(8, "little")
        with open(os.path.join(directory, f"f{i:05d}"), "wb") as f:
            f.write(payload)


def stat_rate(paths: list[str], gap: float) -> float:
    """Stats a second over one pass of `paths`, `gap` seconds after a first pass looked
    every file up: recently used, not within a second (a 1 s kernel cache has expired by
    then; a second timed pass would find what the first one looked up again)."""
    for p in paths:
        os.stat(p)
    time.sleep(gap)
    t = time.perf_counter()
    for p in paths:
        os.stat(p)
    return len(paths) / (time.perf_counter() - t)


def cold_stat_rate(paths: list[str]) -> float:
    """One pass of stats after the kernel's dentries and inodes are dropped."""
    drop_caches()
    time.sleep(0.5)  # the kernel's FORGETs reach the daemon first
    t = time.perf_counter()
    for p in paths:
        os.stat(p)
    return len(paths) / (time.perf_counter() - t)


def stored(code: str, vol: str, env: dict) -> tuple[int, int]:
    """(stored, raw) bytes of the volume's chunks, read by the code under test (a newer
    checkout would upgrade an older volume's schema under the running daemon)."""
    res = subprocess.run(
        [sys.executable, "-c", "import json, sys; from fusefs.client.volume import Volume; "
         "v = Volume.open(sys.argv[1]); print(json.dumps(v.stats())); v.close()", vol],
        env=env, cwd=code, check=True, capture_output=True, text=True,
    )  # fmt: skip
    s = json.loads(res.stdout)
    return s["stored_bytes"], s["raw_unique_bytes"]


# -- the run -------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--code", default=ROOT, help="checkout the mount daemon runs from")
    ap.add_argument("--phases", default=",".join(PHASES), help="any of " + ",".join(PHASES))
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rank-mib", type=int, default=128, help="state dict size per rank")
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--changed", type=int, default=2, help="tensors changed per rank in step 2")
    ap.add_argument("--load-rounds", type=int, default=2)
    ap.add_argument("--files", type=int, default=2000, help="files for the stat phase")
    ap.add_argument("--warm-gap", type=float, default=2.0, help="seconds before warm stats")
    ap.add_argument("--seq-mib", type=int, default=1024, help="sequential write/read size")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    if "load" in phases:
        phases.add("ckpt")  # the load reads step 2's files

    base = tempfile.mkdtemp(prefix="ckptfs-bench-trainer-", dir=args.dir)
    env = dict(os.environ)
    env["XDG_DATA_HOME"] = os.path.join(base, "xdg")
    env["XDG_CACHE_HOME"] = os.path.join(base, "xdg-cache")
    code = os.path.abspath(args.code)
    env["PYTHONPATH"] = code
    out: dict = {"code": code, "loadavg": [round(os.getloadavg()[0], 1)]}
    opts = ["--staging", os.path.join(base, "staging")]
    vol, mnt, disk = (os.path.join(base, d) for d in ("vol", "mnt", "disk"))
    os.makedirs(disk)
    proc = None
    ranks: Ranks | None = None
    try:
        subprocess.run(
            [sys.executable, "-m", "fusefs.cli", "format", vol],
            env=env, cwd=code, check=True, capture_output=True,
        )  # fmt: skip
        proc = mount_ckptfs(code, vol, mnt, env, *opts)
        out["dropped_caches"] = drop_caches()

        if "seq" in phases:
            data = memoryview(os.urandom(args.seq_mib * MiB))
            w_disk = seq_write(os.path.join(disk, "seq"), data)
            r_disk = seq_read(os.path.join(disk, "seq"))
            w_fs = seq_write(os.path.join(mnt, "seq"), data)
            out["seq_drain_s"] = drain(mnt)
            r_fs = seq_read(os.path.join(mnt, "seq"))
            n = len(data)
            del data
            out.update(
                disk_write_mbps=mbps(n, w_disk),
                disk_read_mbps=mbps(n, r_disk),
                write_mbps=mbps(n, w_fs),
                read_mbps=mbps(n, r_fs),
                write_vs_disk=round(w_disk / w_fs, 3),
                read_vs_disk=round(r_disk / r_fs, 3),
            )
            os.unlink(os.path.join(disk, "seq"))
            os.unlink(os.path.join(mnt, "seq"))

        if "ckpt" in phases:
            ranks = Ranks(args.ranks, args.tensors, args.rank_mib * MiB)
            out["ckpt_bytes"] = ranks.bytes

            def path(d: str, step: int):
                return lambda r: (os.path.join(d, f"step{step}-rank{r}.pt"),)

            os.sync()
            out["ckpt_step1_disk_s"] = round(ranks.run("save", path(disk, 1))[0], 3)
            os.sync()
            out["ckpt_step1_s"] = round(ranks.run("save", path(mnt, 1))[0], 3)
            out["ckpt_step1_drain_s"] = drain(mnt)
            before = stored(code, vol, env)
            _, changed = ranks.run("change", lambda r: (args.changed,))
            changed_bytes = sum(changed)
            os.sync()
            out["ckpt_step2_disk_s"] = round(ranks.run("save", path(disk, 2))[0], 3)
            os.sync()
            c0 = cpu_s(proc.pid)
            out["ckpt_step2_s"] = round(ranks.run("save", path(mnt, 2))[0], 3)
            out["daemon_cpu_s_step2"] = round(cpu_s(proc.pid) - c0, 2)
            out["ckpt_step2_drain_s"] = drain(mnt)
            after = stored(code, vol, env)
            out.update(
                ckpt_step2_vs_disk=round(out["ckpt_step2_disk_s"] / out["ckpt_step2_s"], 3),
                changed_mib=round(changed_bytes / MiB, 1),
                growth_mib=round((after[0] - before[0]) / MiB, 1),
                torchsave_growth_vs_changed=round((after[0] - before[0]) / changed_bytes, 3),
                torchsave_raw_growth_vs_changed=round((after[1] - before[1]) / changed_bytes, 3),
            )
            _, same = ranks.run("check", path(mnt, 2))
            out["ckpt_step2_read_back_ok"] = all(same)

        if "load" in phases and ranks is not None:
            disk_s, mount_s = [], []
            for rnd in range(args.load_rounds):
                for where in ("disk", "mount") if rnd % 2 == 0 else ("mount", "disk"):
                    if where == "mount":  # a fresh daemon: nothing warm in its memory
                        unmount(mnt, proc)
                        proc = mount_ckptfs(code, vol, mnt, env, *opts)
                    d = disk if where == "disk" else mnt
                    drop_caches()
                    c0 = cpu_s(proc.pid)
                    t, got = ranks.run(
                        "load", lambda r, d=d: (os.path.join(d, f"step2-rank{r}.pt"),)
                    )
                    assert sum(got) == ranks.bytes, (sum(got), ranks.bytes)
                    if where == "mount":
                        mount_s.append(t)
                        out.setdefault("daemon_cpu_s_load", []).append(
                            round(cpu_s(proc.pid) - c0, 2)
                        )
                    else:
                        disk_s.append(t)
            n = ranks.bytes
            out.update(
                load_disk_mbps=[mbps(n, t) for t in disk_s],
                load_mount_mbps=[mbps(n, t) for t in mount_s],
                load_disk_s=[round(t, 3) for t in disk_s],
                load_mount_s=[round(t, 3) for t in mount_s],
                # each round's ratio, and the ratio of the medians
                parallel_load_rounds=[
                    round(a / b, 3) for a, b in zip(disk_s, mount_s, strict=True)
                ],
                parallel_load_vs_disk=round(_median(disk_s) / _median(mount_s), 3),
            )
        if ranks is not None:
            ranks.stop()
            ranks = None

        if "stat" in phases:
            res: dict = {}
            for where, d in (("disk", disk), ("mount", mnt)):
                top = os.path.join(d, "many")
                t = time.perf_counter()
                make_files(top, args.files)
                res[f"{where}_create"] = args.files / (time.perf_counter() - t)
                paths = [os.path.join(top, f"f{i:05d}") for i in range(args.files)]
                res[f"{where}_warm"] = stat_rate(paths, args.warm_gap)
                res[f"{where}_cold"] = cold_stat_rate(paths)
            out.update(
                stat_files=args.files,
                create_per_s=round(res["mount_create"], 1),
                disk_create_per_s=round(res["disk_create"], 1),
                stat_warm_per_s=round(res["mount_warm"], 1),
                stat_cold_per_s=round(res["mount_cold"], 1),
                disk_stat_warm_per_s=round(res["disk_warm"], 1),
                disk_stat_cold_per_s=round(res["disk_cold"], 1),
            )
    finally:
        if ranks is not None:
            ranks.stop()
        unmount(mnt, proc)
        shutil.rmtree(base, ignore_errors=True)
    out["loadavg"].append(round(os.getloadavg()[0], 1))
    print(json.dumps(out))
    return 0


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


if __name__ == "__main__":
    sys.exit(main())
