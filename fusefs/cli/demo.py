"""`ckptfs demo`: what ckptfs does for a training job, end to end, in about a minute.

Four gloo ranks (CPU, 127.0.0.1) fine-tune a small model: a frozen backbone and a frozen
embedding table sharded across the ranks (DTensor), a trainable head. Every step is saved
with the DCP backend (CkptfsWriter: ranks write the volume directly, the step publishes
atomically); once, every rank also torch.saves its state through a FUSE mount of the same
volume. Both are loaded back and compared with the model in memory. The table shows save and
load times, logical and stored bytes and the dedup the frozen tensors buy from step 2 on,
then the per-rank commit timeline the metadata service recorded.

It runs on the embedded default volume (the one `ckptfs mount MOUNTPOINT` uses), mounted on
a temporary mountpoint that is always unmounted; the demo's files are removed afterwards
unless --keep (their checkpoint records stay listed by `ckptfs checkpoints`), and gc
reclaims the chunks. --temp-volume runs on a throwaway volume instead.
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
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 4
EMB_ROWS, EMB_DIM = 8192, 64  # per rank
IN, HID, OUT = 512, 1024, 16


class DemoError(ValueError):
    """The demo could not run (no FUSE, mount failed...): one line for the user (the CLI
    prints ValueErrors as one line)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fusefs.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _mounted(mp: str) -> bool:
    from fusefs.cli.mount import mount_fstype

    return bool(mount_fstype(mp))


# -- one rank ---------------------------------------------------------------------------------
def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.ModuleDict(
        {
            "backbone": nn.Sequential(nn.Linear(IN, HID), nn.GELU(), nn.Linear(HID, HID)),
            "head": nn.Linear(HID, OUT),
        }
    )
    for p in net["backbone"].parameters():
        p.requires_grad_(False)  # fine-tuning: the backbone is frozen, so it dedups
    return net


def _state(net, emb_dt, step: int) -> dict:
    return {"model": net.state_dict(), "emb": emb_dt, "extra": {"step": step}}


def _same(a: dict, b: dict) -> bool:
    import torch

    for k, v in a["model"].items():
        if not torch.equal(v, b["model"][k]):
            return False
    la = a["emb"].to_local() if hasattr(a["emb"], "to_local") else a["emb"]
    lb = b["emb"].to_local() if hasattr(b["emb"], "to_local") else b["emb"]
    return torch.equal(la, lb) and a["extra"]["step"] == b["extra"]["step"]


def rank_main(rank: int, port: int, spec: str, mnt: str, job: str, steps: int, out: str) -> None:
    """One rank (spawned): train, save every step with DCP, once with torch.save; reload."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fusefs.cli.mount import CONTROL_FLUSH
    from fusefs.dcp import CkptfsReader, CkptfsWriter, volume_for

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        net = _model()
        opt = torch.optim.Adam(net["head"].parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(100 + rank)
        emb = torch.randn(EMB_ROWS, EMB_DIM, generator=g)  # this rank's shard, frozen
        emb_dt = DTensor.from_local(emb, mesh, [Shard(0)], run_check=False)
        proj = torch.randn(EMB_DIM, IN, generator=torch.Generator().manual_seed(7))
        rows: list[dict] = []
        meta = volume_for(spec).meta if rank == 0 else None

        def timed(fn) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())

        for step in range(1, steps + 1):
            for _ in range(4):  # a few optimizer steps per checkpoint
                idx = torch.randint(0, EMB_ROWS, (64,), generator=g)
                x = emb[idx] @ proj
                loss = net["head"](net["backbone"](x)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                for p in net["head"].parameters():  # DDP-style gradient averaging over gloo
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
                opt.step()
            before = meta.stats().as_dict() if meta else None
            path = f"{job}/step-{step:06d}"
            sd = _state(net, emb_dt, step)
            writer = CkptfsWriter(spec, path)
            t_save = timed(lambda sd=sd, writer=writer: dcp.save(sd, storage_writer=writer))
            # Untimed: wait until the tier has uploaded (and so compressed) the new chunks, so
            # STORED is what the nodes hold, not the raw staged bytes.
            _drain(volume_for(spec, writer.tier))
            dist.barrier()
            if meta:
                info = meta.checkpoint_info(job, step)
                after = meta.stats().as_dict()
                rows.append(
                    {
                        "what": f"DCP step {step}",
                        "save_s": t_save,
                        "logical": info["bytes"],
                        "new": info["new_bytes"],
                        "stored": after["stored_bytes"] - before["stored_bytes"],
                        "dedup": info["dedup_ratio"],
                        "state": info["state"],
                    }
                )
        # reload the last step into zeroed tensors, through the DCP reader
        fresh = {
            "model": {k: torch.zeros_like(v) for k, v in net.state_dict().items()},
            "emb": DTensor.from_local(torch.zeros_like(emb), mesh, [Shard(0)], run_check=False),
            "extra": {"step": -1},
        }
        path = f"{job}/step-{steps:06d}"
        t_load = timed(lambda: dcp.load(fresh, storage_reader=CkptfsReader(spec, path)))
        dcp_ok = _same(fresh, _state(net, emb_dt, steps))
        # once through the mount: plain torch.save / torch.load of this rank's state
        tdir = os.path.join(mnt, job, "torch-save")
        os.makedirs(tdir, exist_ok=True)
        fname = os.path.join(tdir, f"rank-{rank}.pt")
        local = {"model": net.state_dict(), "emb": emb, "extra": {"step": steps}}
        before = meta.stats().as_dict() if meta else None

        def save_mount() -> None:
            with open(fname, "wb") as f:
                torch.save(local, f)
                f.flush()
                os.fsync(f.fileno())

        t_tsave = timed(save_mount)
        if rank == 0:  # untimed, as above: the mount's tier uploads what it staged
            os.setxattr(mnt, CONTROL_FLUSH, b"1")
        dist.barrier()
        loaded: dict = {}
        t_tload = timed(lambda: loaded.update(torch.load(fname, weights_only=True)))
        mount_ok = _same(loaded, local)
        oks = torch.tensor([int(dcp_ok), int(mount_ok)])
        dist.all_reduce(oks, op=dist.ReduceOp.MIN)
        if meta:
            after = meta.stats().as_dict()
            size = sum(os.path.getsize(os.path.join(tdir, f)) for f in os.listdir(tdir))
            new = after["raw_unique_bytes"] - before["raw_unique_bytes"]
            rows.append(
                {
                    "what": "torch.save (mount)",
                    "save_s": t_tsave,
                    "load_s": t_tload,
                    "logical": size,
                    "new": new,
                    "stored": after["stored_bytes"] - before["stored_bytes"],
                    "dedup": round(size / new, 4) if new else None,
                    "state": "files",
                }
            )
            rows[-2]["load_s"] = t_load
            result = {
                "rows": rows,
                "dcp_ok": bool(oks[0]),
                "mount_ok": bool(oks[1]),
                "timeline": meta.checkpoint_info(job, steps),
                "volume": after,
            }
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _drain(vol) -> None:
    """Wait until this process's write-behind tier has its staged chunks on the nodes."""
    if vol.tier is not None:
        vol.tier.flush(timeout=300)


# -- the driver -------------------------------------------------------------------------------
def _spawn_ranks(port: int, spec: str, mnt: str, job: str, steps: int, out: str) -> None:
    import torch.multiprocessing as tmp

    tmp.start_processes(
        rank_main,
        args=(port, spec, mnt, job, steps, out),
        nprocs=WORLD,
        join=True,
        start_method="spawn",
    )


def _table(res: dict, spec: str, mnt: str, elapsed: float) -> str:
    from fusefs.cli.units import format_size

    def f(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    out = [
        f"ckptfs demo: {WORLD} ranks (gloo, CPU), volume {spec}, mount {mnt}",
        f"{'WHAT':20} {'SAVE_S':>7} {'LOAD_S':>7} {'LOGICAL':>10} {'NEW':>10} {'STORED':>10} "
        f"{'DEDUP':>6}  STATE",
    ]
    for r in res["rows"]:
        out.append(
            f"{r['what']:20} {f(r['save_s'], '.2f'):>7} {f(r.get('load_s'), '.2f'):>7} "
            f"{format_size(r['logical']):>10} {format_size(r['new']):>10} "
            f"{format_size(r['stored']):>10} {f(r['dedup'], '.2f'):>6}  {r['state']}"
        )
    out.append(
        "NEW: bytes no earlier save had; STORED: what they take on the nodes once the tier "
        "has compressed and uploaded them (one replica)"
    )
    out.append(
        "reload: DCP (CkptfsReader) "
        + ("== trained model" if res["dcp_ok"] else "DIFFERS from the trained model")
        + "; torch.load through the mount "
        + ("== saved state" if res["mount_ok"] else "DIFFERS from the saved state")
    )
    tl = res["timeline"]
    out.append(
        f"timeline of {tl['job']} step {tl['step']}: {tl['state']}, {tl['committed']}/"
        f"{tl['world_size']} ranks, published {tl['published'] - tl['created']:.3f}s after "
        f"begin, stragglers: {', '.join(map(str, tl['stragglers'])) or 'none'}"
    )
    out.append(f"  {'RANK':>4} {'COMMIT_S':>9} {'FILES':>5} {'BYTES':>10}  HOST")
    for r in tl["ranks"]:
        out.append(
            f"  {r['rank']:>4} {r['commit_s']:>9.3f} {r['files']:>5} "
            f"{format_size(r['bytes']):>10}  {r['host']}"
        )
    out.append(f"done in {elapsed:.1f}s")
    return "\n".join(out)


def _remove_job(spec: str, job: str) -> None:
    from fusefs.client.volume import Volume

    with Volume.open(spec) as vol:
        if not vol.exists(job):
            return
        for path, _ in sorted(vol.walk(job), key=lambda t: -t[0].count("/")):
            vol.unlink(path)
        vol.unlink(job)


def run_demo(steps: int = 3, keep: bool = False, temp_volume: bool = False) -> int:
    from fusefs.client.defaults import ensure_default_volume

    if not 1 <= steps <= 20:
        raise DemoError("--steps must be 1..20")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise DemoError("the demo needs torch: pip install 'ckptfs[torch]'") from None
    if not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"):
        raise DemoError("the demo needs FUSE 3 (/dev/fuse, fusermount3): run `make install`")
    t0 = time.time()
    work = tempfile.mkdtemp(prefix="ckptfs-demo-")
    spec = os.path.join(work, "vol") if temp_volume else ensure_default_volume()
    if temp_volume:
        res = _cli("format", spec)
        if res.returncode:
            raise DemoError(f"cannot format {spec}: {res.stderr.strip()}")
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt)
    job = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    out = os.path.join(work, "result.json")
    mounted = False
    try:
        print(f"ckptfs demo: mounting {spec} at {mnt} ...", file=sys.stderr, flush=True)
        res = _cli("mount", spec, mnt, "--background", "--log", os.path.join(work, "mount.log"))
        if res.returncode or not _mounted(mnt):
            raise DemoError(f"mount failed: {res.stderr.strip()}")
        mounted = True
        print(f"ckptfs demo: {WORLD} ranks train {steps} steps ...", file=sys.stderr, flush=True)
        try:
            _spawn_ranks(_free_port(), spec, mnt, job, steps, out)
        except Exception as e:
            raise DemoError(f"a demo rank failed: {e}") from None
        with open(out) as f:
            result = json.load(f)
    finally:
        if mounted or _mounted(mnt):
            r = _cli("umount", mnt)
            if r.returncode and _mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True, timeout=30)
        if not keep and not temp_volume:
            try:
                _remove_job(spec, job)
            except Exception as e:  # the table still stands; say what is left behind
                print(f"ckptfs demo: could not remove /{job}: {e}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    print(_table(result, spec, mnt, time.time() - t0))
    if keep and not temp_volume:
        print(f"kept: /{job} in {spec} (ckptfs checkpoints {spec} list {job})")
    return 0 if result["dcp_ok"] and result["mount_ok"] else 1


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(steps=args.steps, keep=args.keep, temp_volume=args.temp_volume)


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo",
        help="train a small model on 4 ranks, checkpoint it, reload and compare",
        description="4 gloo ranks (CPU, 127.0.0.1) train a small model, save every step with "
        "the DCP backend and once with torch.save through a temporary FUSE mount of the "
        "embedded default volume, reload, compare, and print sizes, dedup and the timeline.",
    )
    d.add_argument("--steps", type=int, default=3, help="training steps (1..20)")
    d.add_argument(
        "--temp-volume",
        action="store_true",
        help="use a throwaway volume instead of the embedded default",
    )
    d.add_argument("--keep", action="store_true", help="keep the demo's checkpoints")
    d.set_defaults(func=cmd_demo)
