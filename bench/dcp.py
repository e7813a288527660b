"""DCP benchmark (issue 6): CkptfsWriter vs FileSystemWriter, 8 gloo ranks, ~1 GiB bf16+fp32.

Run: python -m bench.dcp [--dir DIR] [--ranks 8] [--size 1GiB] [--no-mount] [--no-staging]
Prints one JSON object. All three backends run in the same process group, one after
the other, on the same disk: FileSystemWriter to a local directory (the baseline),
FileSystemWriter into a `ckptfs mount` of a second volume, and CkptfsWriter. Then step 2
with 90% of the tensors unchanged. Ratios are against the baseline of this run.
Loads read what was just written (page cache warm for every backend alike). Every timed
phase starts after a sync(), so no phase pays for an earlier one's dirty pages.
CkptfsWriter saves through the host write-behind tier (durability=local, its default):
`native_save_s` ends when every rank's chunks are fsync'd in staging and the step is
published; `native_drain_s` (upload to the nodes, compression, R replicas) is timed after
it, separately, and is not part of the save ratio; `native_save_plus_drain_vs_disk` is.
`dcp_null_save_s` is the same save into a writer that stores nothing (DCP's planning and
collectives alone, best of 2); `step2_speedup_ceiling` is step 1 over it, the speedup a
step 2 that cost nothing but DCP would show in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_TENSORS = 40  # per rank, alternately fp32 and bf16, each sharded over all ranks
CHANGED = (3, 14, 25, 36)  # 10% of the tensors differ at step 2


def _du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _worker() -> None:
    """One rank: every phase timed between barriers; rank 0 prints a JSON line."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    sys.path.insert(0, ROOT)
    from fusefs.dcp import CkptfsReader, CkptfsWriter, drain

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
    )
    mesh = init_device_mesh("cpu", (world,))
    per_rank = int(os.environ["BENCH_BYTES"]) // world
    elems = per_rank // N_TENSORS  # bytes per tensor shard, as elements of 1 byte
    cfg = json.loads(os.environ["BENCH_CFG"])
    torch.manual_seed(1234 + rank)

    def tensor(i: int, version: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(rank * 1000 + i + (10**6 if version > 1 else 0))
        if i % 2:
            return (torch.randn(elems // 2, generator=g) * 0.02).to(torch.bfloat16)
        return torch.randn(elems // 4, generator=g) * 0.02

    def state(version: int) -> dict:
        sd = {}
        for i in range(N_TENSORS):
            v = version if i in CHANGED else 1
            local = tensor(i, v).reshape(1, -1)
            sd[f"layer{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        return {"model": sd, "step": version}

    def zeros() -> dict:
        sd = state(1)
        for k, v in sd["model"].items():
            sd["model"][k] = DTensor.from_local(
                torch.zeros_like(v.to_local()), mesh, [Shard(0)], run_check=False
            )
        return sd

    def timed(fn) -> float:
        # Every phase starts with no dirty data of an earlier phase left to write back: the
        # baseline runs first on a quiet disk, so the later phases get the same start.
        if rank == 0:
            os.sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    out: dict = {}
    sd1 = state(1)
    nbytes = sum(v.to_local().nbytes for v in sd1["model"].values())
    total = torch.tensor([nbytes])
    dist.all_reduce(total)
    out["state_bytes"] = int(total.item())

    def check(target: dict, version: int) -> bool:
        want = state(version)["model"]
        return all(torch.equal(target["model"][k].to_local(), want[k].to_local()) for k in want)

    # 1. FileSystemWriter to the local disk: the baseline
    disk = cfg["disk"]
    out["disk_save_s"] = timed(lambda: dcp.save(sd1, storage_writer=dcp.FileSystemWriter(disk)))
    tgt = zeros()
    out["disk_load_s"] = timed(lambda: dcp.load(tgt, storage_reader=dcp.FileSystemReader(disk)))
    out["disk_load_ok"] = check(tgt, 1)

    # 2. FileSystemWriter into the mount
    if cfg.get("mount"):
        mp = os.path.join(cfg["mount"], "fsw", "step-000001")
        out["mount_save_s"] = timed(lambda: dcp.save(sd1, storage_writer=dcp.FileSystemWriter(mp)))

        def mount_flush() -> None:  # the mount's own tier drains now, not during the next runs
            if rank == 0:
                os.setxattr(cfg["mount"], "user.ckptfs.flush", b"1")

        out["mount_drain_s"] = timed(mount_flush)
        tgt = zeros()
        out["mount_load_s"] = timed(lambda: dcp.load(tgt, storage_reader=dcp.FileSystemReader(mp)))
        out["mount_load_ok"] = check(tgt, 1)

    # 3. CkptfsWriter, step 1 then step 2 (90% unchanged)
    vol = cfg["volume"]
    tier = {"staging": cfg.get("staging") or False}
    out["native_save_s"] = timed(
        lambda: dcp.save(sd1, storage_writer=CkptfsWriter(vol, "job/step-000001", **tier))
    )
    # the save returned once staged (fsync'd on this host); the drain to the object nodes
    # (compression + R replicas) runs after it, timed on its own, before the load
    out["native_drain_s"] = timed(drain)
    tgt = zeros()
    out["native_load_s"] = timed(
        lambda: dcp.load(tgt, storage_reader=CkptfsReader(vol, "job/step-000001", **tier))
    )
    out["native_load_ok"] = check(tgt, 1)
    sd2 = state(2)
    out["native_step2_save_s"] = timed(
        lambda: dcp.save(sd2, storage_writer=CkptfsWriter(vol, "job/step-000002", **tier))
    )
    out["native_step2_drain_s"] = timed(drain)
    tgt = zeros()
    out["native_step2_load_s"] = timed(
        lambda: dcp.load(tgt, storage_reader=CkptfsReader(vol, "job/step-000002", **tier))
    )
    out["native_step2_load_ok"] = check(tgt, 2)
    # DCP's own cost for this state dict: the same save into a writer that stores nothing
    # (planning, the collectives, the item walk). No backend's save can be faster.
    out["dcp_null_save_s"] = min(
        timed(lambda: dcp.save(sd2, storage_writer=_null_writer())) for _ in range(2)
    )
    if rank == 0:
        print("BENCH " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _null_writer():
    """A StorageWriter that stores nothing: the floor of a dcp.save of this state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class NullWriter(dcp.StorageWriter):
        def reset(self, checkpoint_id=None) -> None:
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            return False

        def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
            pass

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            return plans

        def write_data(self, plan, planner):
            none = _StorageInfo("-", 0, 0)
            fut: Future = Future()
            fut.set_result([WriteResult(i.index, 0, none) for i in plan.items])
            return fut

        def finish(self, metadata, results) -> None:
            pass

    return NullWriter()


def _stats(vol: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "stats", "--json", vol],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=300,
    )
    return json.loads(out.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--no-mount", action="store_true", help="skip FileSystemWriter into the mount")
    ap.add_argument(
        "--no-staging",
        action="store_true",
        help="CkptfsWriter straight to the nodes (no write-behind tier, durability=remote)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker()
        return 0
    sys.path.insert(0, ROOT)
    from fusefs.units import parse_size
    from fusefs.volume import Volume

    size = parse_size(args.size)
    work = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
    cli = [sys.executable, "-m", "fusefs.cli"]
    mnt = None
    mproc = None
    try:
        vol = os.path.join(work, "vol")
        Volume.create(vol).close()
        cfg: dict = {"disk": os.path.join(work, "disk", "step-000001"), "volume": vol}
        if not args.no_staging:
            cfg["staging"] = os.path.join(work, "staging")
        if not args.no_mount:
            mvol, mnt = os.path.join(work, "mvol"), os.path.join(work, "mnt")
            Volume.create(mvol).close()
            os.makedirs(mnt)
            mproc = subprocess.Popen(  # its staging inside work/: removed with it
                [*cli, "mount", mvol, mnt, "--staging", os.path.join(work, "mstaging")],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 30
            while not os.path.ismount(mnt) and time.monotonic() < deadline:
                if mproc.poll() is not None:
                    break
                time.sleep(0.1)
            if os.path.ismount(mnt):
                cfg["mount"] = mnt
        port = str(_free_port())
        env = dict(
            os.environ,
            WORLD_SIZE=str(args.ranks),
            LOCAL_WORLD_SIZE=str(args.ranks),  # as torchrun sets it: all ranks on this host
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            BENCH_BYTES=str(size),
            BENCH_CFG=json.dumps(cfg),
            PYTHONPATH=ROOT,
            OMP_NUM_THREADS="1",
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.dcp", "--worker"],
                cwd=ROOT,
                env=dict(env, RANK=str(r)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(args.ranks)
        ]
        outs = [p.communicate(timeout=1800) for p in procs]
        if any(p.returncode for p in procs):
            bad = next(i for i, p in enumerate(procs) if p.returncode)
            print(json.dumps({"error": f"rank {bad} failed", "stderr": outs[bad][1][-3000:]}))
            return 1
        line = next(ln for ln in outs[0][0].splitlines() if ln.startswith("BENCH "))
        r = json.loads(line[len("BENCH ") :])
        st = _stats(vol)
        step1 = [c for c in _checkpoints(vol) if c["step"] == 1]
        res = {
            "ranks": args.ranks,
            "state_bytes": r["state_bytes"],
            "replicas": 2,
            "staging": not args.no_staging,
            "disk_save_s": round(r["disk_save_s"], 3),
            "disk_load_s": round(r["disk_load_s"], 3),
            "disk_stored_bytes": _du(os.path.dirname(cfg["disk"])),
            "native_save_s": round(r["native_save_s"], 3),
            "native_load_s": round(r["native_load_s"], 3),
            "native_step2_save_s": round(r["native_step2_save_s"], 3),
            "native_step2_load_s": round(r["native_step2_load_s"], 3),
            "native_drain_s": round(r["native_drain_s"], 3),
            "native_step2_drain_s": round(r["native_step2_drain_s"], 3),
            "native_save_plus_drain_vs_disk": round(
                r["disk_save_s"] / (r["native_save_s"] + r["native_drain_s"]), 3
            ),
            "native_stored_bytes_total": st["stored_bytes"],
            "native_step1_stored_bytes": step1[0].get("stored") if step1 else None,
            "native_dedup_ratio": st["dedup_ratio"],
            "native_compression_ratio": st["compression_ratio"],
            "loads_exact": all(r[k] for k in r if k.endswith("_ok")),
        }
        for name in ("new_bytes", "bytes"):
            for c in _checkpoints(vol):
                res[f"native_step{c['step']}_{name}"] = c.get(name)
        if "mount_save_s" in r:
            mst = _stats(os.path.join(work, "mvol"))
            res.update(
                mount_save_s=round(r["mount_save_s"], 3),
                mount_load_s=round(r["mount_load_s"], 3),
                mount_drain_s=round(r["mount_drain_s"], 3),
                mount_stored_bytes=mst["stored_bytes"],
                mount_vs_disk_save=round(r["disk_save_s"] / r["mount_save_s"], 3),
                mount_vs_disk_load=round(r["disk_load_s"] / r["mount_load_s"], 3),
            )
        else:
            res["mount"] = "not available"
        res["native_vs_disk_save"] = round(r["disk_save_s"] / r["native_save_s"], 3)
        res["native_vs_disk_load"] = round(r["disk_load_s"] / r["native_load_s"], 3)
        res["step2_speedup"] = round(r["native_save_s"] / r["native_step2_save_s"], 3)
        # the same ratio if step 2 cost nothing but DCP itself: this run's ceiling
        res["dcp_null_save_s"] = round(r["dcp_null_save_s"], 3)
        res["step2_speedup_ceiling"] = round(r["native_save_s"] / r["dcp_null_save_s"], 3)
        res["targets"] = {
            "native_vs_disk_save": 1.0,
            "step2_speedup": 4.0,
            "native_vs_disk_load": 1.0,
        }
        print(json.dumps(res))
        return 0
    finally:
        if mnt is not None and mproc is not None:
            subprocess.run([*cli, "umount", mnt], cwd=ROOT, capture_output=True, timeout=120)
            try:
                mproc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                mproc.kill()
                mproc.wait()
        shutil.rmtree(work, ignore_errors=True)


def _checkpoints(vol: str) -> list[dict]:
    from fusefs.volume import Volume

    with Volume.open(vol) as v:
        return [v.meta.checkpoint_info(c["job"], c["step"]) for c in v.meta.list_checkpoints("job")]


if __name__ == "__main__":
    sys.exit(main())
