"""DCP benchmark (issue 6): CkptfsWriter vs FileSystemWriter, 8 gloo ranks, ~1 GiB bf16+fp32.

Run: python -m bench.dcp [--dir DIR] [--ranks 8] [--size 1GiB] [--rounds 3] [--no-mount]
       [--no-staging]
Prints one JSON object. All three backends run in the same process group, one after
the other, on the same disk: FileSystemWriter to a local directory (the baseline),
FileSystemWriter into a `ckptfs mount` of a second volume, and CkptfsWriter. Then step 2
with 90% of the tensors unchanged. Ratios are against the baseline of this run.

The run is `--rounds` rounds of the same work: each saves the same state dict to a fresh
disk directory and a fresh volume with its own staging, every volume closed at the round's
end. They differ in that only the first round runs the mount phase and pays the process's
one-time costs (imports, thread pools, the torch.save envelopes `fusefs.dcp` captures
once), and the first round's files stay on disk for the stats. Each phase of 0.2-1 s on a
small host swings 10-20% from scheduling alone, so the JSON reports each phase's median
over the rounds (`*_s`), every round's value (`rounds_detail`), and each ratio as the median
of its per-round ratios (both sides of a ratio come from the same round), with its worst
round (`worst`). Stored, dedup and new-byte counts are the first round's volume's; the
`mount_*` values are single samples from the first round. `loads_exact` is true only if
every load of every round gave back every rank's tensors exactly.
Loads read what was just written (page cache warm for every backend alike). Every timed
phase starts after a sync(), so no phase pays for an earlier one's dirty pages.
CkptfsWriter saves through the host write-behind tier (durability=local, its default):
`native_save_s` ends when every rank's chunks are fsync'd in staging and the step is
published; `native_drain_s` (upload to the nodes, compression, R replicas) is timed after
it, separately, and is not part of the save ratio; `native_save_plus_drain_vs_disk` is.
`dcp_null_save_s` is the same save into a writer that stores nothing (DCP's planning and
collectives alone, best of 2); `step2_speedup_ceiling` is step 1 over it, the speedup a
step 2 that cost nothing but DCP would show in this run. `dcp_hash_save_s` is a writer that
also hashes every byte (xxh3-128 on two threads, as the volume does) and stores nothing:
about the least a backend that finds the unchanged tensors by hashing their content pays,
so `step2_speedup_hash_floor` (step 1 over it) is about the most such a step 2 can reach
on this host (best of 2, where step 2 is a single save).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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
    from fusefs.dcp import CkptfsReader, CkptfsWriter, close_volumes, drain

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
        """Every rank's shards equal what was saved (rank 0 reports for all of them)."""
        want = state(version)["model"]
        ok = all(torch.equal(target["model"][k].to_local(), want[k].to_local()) for k in want)
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def record(name: str, value) -> None:
        out.setdefault(name, []).append(value)

    def run_round(rnd: int, paths: dict) -> None:
        """One round: the baseline, the mount (first round), CkptfsWriter steps 1 and 2."""
        # 1. FileSystemWriter to the local disk: the baseline
        disk = paths["disk"]
        record(
            "disk_save_s", timed(lambda: dcp.save(sd1, storage_writer=dcp.FileSystemWriter(disk)))
        )
        tgt = zeros()
        record(
            "disk_load_s", timed(lambda: dcp.load(tgt, storage_reader=dcp.FileSystemReader(disk)))
        )
        record("disk_load_ok", check(tgt, 1))

        # 2. FileSystemWriter into the mount (first round only: it is not a target)
        if rnd == 0 and cfg.get("mount"):
            mp = os.path.join(cfg["mount"], "fsw", "step-000001")
            out["mount_save_s"] = timed(
                lambda: dcp.save(sd1, storage_writer=dcp.FileSystemWriter(mp))
            )

            def mount_flush() -> None:  # the mount's tier drains now, not during the next runs
                if rank == 0:
                    os.setxattr(cfg["mount"], "user.ckptfs.flush", b"1")

            out["mount_drain_s"] = timed(mount_flush)
            tgt = zeros()
            out["mount_load_s"] = timed(
                lambda: dcp.load(tgt, storage_reader=dcp.FileSystemReader(mp))
            )
            record("mount_load_ok", check(tgt, 1))

        # 3. CkptfsWriter, step 1 then step 2 (90% unchanged), into this round's fresh volume
        vol = paths["volume"]
        tier = {"staging": paths.get("staging") or False}

        def native_step(step: int, sd: dict, key: str) -> None:
            # the save returns once staged (fsync'd on this host); the drain to the object
            # nodes (compression + R replicas) runs after it, timed on its own, before the load
            path = f"job/step-{step:06d}"
            record(
                f"{key}_save_s",
                timed(lambda: dcp.save(sd, storage_writer=CkptfsWriter(vol, path, **tier))),
            )
            record(f"{key}_drain_s", timed(drain))
            tgt = zeros()
            record(
                f"{key}_load_s",
                timed(lambda: dcp.load(tgt, storage_reader=CkptfsReader(vol, path, **tier))),
            )
            record(f"{key}_load_ok", check(tgt, step))

        native_step(1, sd1, "native")
        sd2 = state(2)
        native_step(2, sd2, "native_step2")
        # DCP's own cost for this state dict: the same save into a writer that stores nothing
        # (planning, the collectives, the item walk). No backend's save can be faster.
        record(
            "dcp_null_save_s",
            min(timed(lambda: dcp.save(sd2, storage_writer=_null_writer())) for _ in range(2)),
        )
        # ... and into one that only hashes every byte with the volume's xxh3-128 on two
        # threads: what any backend that finds unchanged tensors by content pays at least
        record(
            "dcp_hash_save_s",
            min(
                timed(lambda: dcp.save(sd2, storage_writer=_null_writer(hash_bytes=True)))
                for _ in range(2)
            ),
        )
        close_volumes()  # the next round opens its volume afresh, as this one did
        dist.barrier()
        if rank == 0 and rnd > 0:  # keep the first round's files for the stats
            for d in (os.path.dirname(disk), vol, paths.get("staging")):
                if d:
                    shutil.rmtree(d, ignore_errors=True)
        dist.barrier()

    for rnd, paths in enumerate(cfg["rounds"]):
        run_round(rnd, paths)
    if rank == 0:
        print("BENCH " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _null_writer(hash_bytes: bool = False):
    """A StorageWriter that stores nothing: the floor of a dcp.save of this state dict.
    hash_bytes: it resolves every item and hashes its bytes (xxh3-128, 4 MiB pieces, two
    threads, as CkptfsWriter does), then stores nothing: the floor of a save that has to
    find out, by content, which tensors are unchanged."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.distributed.checkpoint as dcp
    import xxhash
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
            if hash_bytes:
                views = []
                for item in plan.items:
                    data = planner.resolve_data(item)
                    if isinstance(data, torch.Tensor):
                        t = data.detach().contiguous().reshape(-1).view(torch.uint8)
                        mv = memoryview(t.numpy())
                        views += [mv[i : i + 4 * 2**20] for i in range(0, mv.nbytes, 4 * 2**20)]
                with ThreadPoolExecutor(2) as pool:
                    list(pool.map(xxhash.xxh3_128_digest, views))
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument(
        "--rounds", type=int, default=3, help="identical rounds; medians are reported (1-9)"
    )
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
    if not 1 <= args.rounds <= 9:
        ap.error("--rounds must be 1..9")
    sys.path.insert(0, ROOT)
    from bench.servers import free_port
    from fusefs.cli.units import parse_size
    from fusefs.client.volume import Volume

    size = parse_size(args.size)
    work = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
    cli = [sys.executable, "-m", "fusefs.cli"]
    mnt = None
    mproc = None
    try:
        rounds = []
        for rnd in range(args.rounds):
            paths = {
                "disk": os.path.join(work, f"disk-{rnd}", "step-000001"),
                "volume": os.path.join(work, f"vol-{rnd}"),
            }
            Volume.create(paths["volume"]).close()
            if not args.no_staging:
                paths["staging"] = os.path.join(work, f"staging-{rnd}")
            rounds.append(paths)
        cfg: dict = {"rounds": rounds}
        vol = rounds[0]["volume"]  # kept for the stats
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
        port = str(free_port())
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

        def med(name: str) -> float:
            return round(statistics.median(r[name]), 3)

        def ratios(num: str, den: str | tuple[str, str]) -> list[float]:
            dens = [r[den]] if isinstance(den, str) else [r[den[0]], r[den[1]]]
            return [round(a / sum(b), 3) for a, *b in zip(r[num], *dens, strict=True)]

        per_round = {
            "native_vs_disk_save": ratios("disk_save_s", "native_save_s"),
            "native_vs_disk_load": ratios("disk_load_s", "native_load_s"),
            "step2_speedup": ratios("native_save_s", "native_step2_save_s"),
            "native_save_plus_drain_vs_disk": ratios(
                "disk_save_s", ("native_save_s", "native_drain_s")
            ),
            "step2_speedup_ceiling": ratios("native_save_s", "dcp_null_save_s"),
            "step2_speedup_hash_floor": ratios("native_save_s", "dcp_hash_save_s"),
        }
        phases = [k for k in r if k.endswith("_s") and isinstance(r[k], list)]
        res = {
            "ranks": args.ranks,
            "rounds": args.rounds,
            "state_bytes": r["state_bytes"],
            "replicas": 2,
            "staging": not args.no_staging,
            **{k: med(k) for k in phases},
            "disk_stored_bytes": _du(os.path.dirname(rounds[0]["disk"])),
            "native_stored_bytes_total": st["stored_bytes"],
            "native_step1_stored_bytes": step1[0].get("stored") if step1 else None,
            "native_dedup_ratio": st["dedup_ratio"],
            "native_compression_ratio": st["compression_ratio"],
            "loads_exact": all(all(r[k]) for k in r if k.endswith("_ok")),
        }
        for name in ("new_bytes", "bytes"):
            for c in _checkpoints(vol):
                res[f"native_step{c['step']}_{name}"] = c.get(name)
        if "mount_save_s" in r:
            mst = _stats(os.path.join(work, "mvol"))
            d_save, d_load = r["disk_save_s"][0], r["disk_load_s"][0]  # the same round's
            res.update(
                mount_save_s=round(r["mount_save_s"], 3),
                mount_load_s=round(r["mount_load_s"], 3),
                mount_drain_s=round(r["mount_drain_s"], 3),
                mount_stored_bytes=mst["stored_bytes"],
                mount_vs_disk_save=round(d_save / r["mount_save_s"], 3),
                mount_vs_disk_load=round(d_load / r["mount_load_s"], 3),
            )
        else:
            res["mount"] = "not available"
        for k, v in per_round.items():
            res[k] = round(statistics.median(v), 3)
        res["worst"] = {k: min(v) for k, v in per_round.items()}
        res["rounds_detail"] = {**per_round, **{k: [round(x, 3) for x in r[k]] for k in phases}}
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
    from fusefs.client.volume import Volume

    with Volume.open(vol) as v:
        return [v.meta.checkpoint_info(c["job"], c["step"]) for c in v.meta.list_checkpoints("job")]


if __name__ == "__main__":
    sys.exit(main())
