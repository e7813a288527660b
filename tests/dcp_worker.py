"""One rank of a multi-process DCP scenario (spawned by tests/test_dcp.py).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (gloo on 127.0.0.1),
CKPT_VOL (volume directory), CKPT_OUT (directory for this rank's JSON results),
CKPT_MOUNT (mountpoint, cross-format scenario only). Checks are recorded as
JSON (name -> [ok, detail]) so the test reports what failed; an unexpected
exception exits non-zero with its traceback in the rank's log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from fusefs.dcp import CkptfsReader, CkptfsWriter, drain, latest_step, resume_path  # noqa: E402

N_TENSORS = 20
ROWS, COLS = 256, 512
CHANGED = {2: (3, 12), 3: (5, 6, 7)}  # version -> tensor indices that differ from version 1
JOB = "train"


def sharded(i: int) -> bool:
    return i % 4 in (0, 1)


def full(i: int, version: int) -> torch.Tensor:
    bump = sum(100_000 * v for v, idx in CHANGED.items() if v <= version and i in idx)
    g = torch.Generator().manual_seed(1000 + i + bump)
    t = torch.randn(ROWS, COLS, generator=g)
    return t.to(torch.bfloat16) if i % 2 else t


def key(i: int) -> str:
    return f"model.{'s' if sharded(i) else 'r'}{i}"


def state_dict(mesh, version: int, *, zeros: bool = False) -> dict:
    """Sharded (DTensor, Shard(0)) and replicated tensors of fp32 and bf16, plus a bytes item."""
    rank, world = mesh.get_local_rank(), mesh.size()
    sd: dict = {"model": {}, "extra": {"version": 0 if zeros else version, "note": ""}}
    for i in range(N_TENSORS):
        t = full(i, version)
        if zeros:
            t = torch.zeros_like(t)
        if sharded(i):
            rows = ROWS // world
            local = t[rank * rows : (rank + 1) * rows].clone()
            t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        sd["model"][key(i)] = t
    if not zeros:
        sd["extra"]["note"] = f"saved at version {version}"
    return sd


def compare(sd: dict, version: int, keys: list[str] | None = None) -> tuple[bool, str]:
    """Every (selected) tensor equals version `version`'s value, shard by shard."""
    for i in range(N_TENSORS):
        k = key(i)
        if keys is not None and k not in keys:
            continue
        got = sd["model"][k]
        want = full(i, version)
        if isinstance(got, DTensor):
            mesh = got.device_mesh
            rows = ROWS // mesh.size()
            r = mesh.get_local_rank()
            want = want[r * rows : (r + 1) * rows]
            got = got.to_local()
        if got.dtype != want.dtype or not torch.equal(got, want):
            return False, f"{k} differs from version {version}"
    return True, "equal"


class Results:
    def __init__(self, scenario: str) -> None:
        self.path = os.path.join(
            os.environ["CKPT_OUT"], f"{scenario}.rank{os.environ['RANK']}.json"
        )
        self.data: dict = {}

    def check(self, name: str, ok: bool, detail: object = "") -> None:
        self.data[name] = [bool(ok), str(detail)]

    def put(self, name: str, value: object) -> None:
        self.data[name] = value

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1)


def stats(vol: str) -> dict:
    exe = shutil.which("ckptfs")
    cmd = [exe] if exe else [sys.executable, "-m", "fusefs.cli"]
    out = subprocess.run(
        [*cmd, "stats", "--json", vol], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout)


def path(step: int, job: str = JOB) -> str:
    return f"{job}/step-{step:06d}"


class FailingPlanner(DefaultSavePlanner):
    """Rank `bad` raises while resolving its third tensor: a failure in mid-save."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad
        self.n = 0

    def resolve_data(self, item):
        if dist.get_rank() == self.bad:
            self.n += 1
            if self.n == 3:
                raise RuntimeError("injected failure in the middle of a save")
        return super().resolve_data(item)


# -- scenarios -----------------------------------------------------------------------------
def scenario_save(res: Results, mesh, vol: str) -> None:
    """4 ranks: save, exact load, partial load, step 2 mostly unchanged, a failing step 3."""
    rank = dist.get_rank()
    dcp.save(state_dict(mesh, 1), storage_writer=CkptfsWriter(vol, path(1)))
    dist.barrier()
    if rank == 0:
        res.put("stats_after_1", stats(vol))
    target = state_dict(mesh, 1, zeros=True)
    dcp.load(target, storage_reader=CkptfsReader(vol, path(1)))
    res.check("exact_load", *compare(target, 1))
    res.check("bytes_item", target["extra"] == {"version": 1, "note": "saved at version 1"})

    part_keys = [key(0), key(2), key(7)]
    part = {"model": {k: state_dict(mesh, 1, zeros=True)["model"][k] for k in part_keys}}
    dcp.load(part, storage_reader=CkptfsReader(vol, path(1)))
    res.check("partial_load", *compare(part, 1, part_keys))

    dist.barrier()
    dcp.save(state_dict(mesh, 2), storage_writer=CkptfsWriter(vol, path(2)))
    dist.barrier()
    if rank == 0:
        res.put("stats_after_2", stats(vol))
    target = state_dict(mesh, 2, zeros=True)
    dcp.load(target, storage_reader=CkptfsReader(vol, path(2)))
    res.check("step2_load", *compare(target, 2))

    dist.barrier()
    try:
        dcp.save(
            state_dict(mesh, 3),
            storage_writer=CkptfsWriter(vol, path(3)),
            planner=FailingPlanner(2),
        )
        res.check("failed_save_raised", False, "save with a failing rank returned normally")
    except CheckpointException as e:  # a BaseException, raised on every rank
        res.check("failed_save_raised", "injected failure" in str(e), repr(e)[:300])
    dist.barrier()
    res.put("latest_after_failure", latest_step(vol, JOB))
    res.put("resume_path", resume_path(vol, JOB))


def scenario_reshard_async(res: Results, mesh, vol: str) -> None:
    """2 ranks: load the 4-rank step 1 and 2 (resharding); async saves equal a sync save."""
    target = state_dict(mesh, 1, zeros=True)
    dcp.load(target, storage_reader=CkptfsReader(vol, path(1)))
    res.check("reshard_load_1", *compare(target, 1))
    target = state_dict(mesh, 2, zeros=True)
    dcp.load(target, storage_reader=CkptfsReader(vol, path(2)))
    res.check("reshard_load_2", *compare(target, 2))

    sd = state_dict(mesh, 2)
    dcp.save(sd, storage_writer=CkptfsWriter(vol, path(10, "async")))
    fut = dcp.async_save(
        sd,
        storage_writer=CkptfsWriter(vol, path(11, "async")),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    )
    fut.result(timeout=120)
    fut = dcp.async_save(
        sd,
        storage_writer=CkptfsWriter(vol, path(12, "async")),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    fut.result(timeout=180)
    for step in (11, 12):
        target = state_dict(mesh, 2, zeros=True)
        dcp.load(target, storage_reader=CkptfsReader(vol, path(step, "async")))
        res.check(f"async_load_{step}", *compare(target, 2))

    # DCP's plan caching hands a rank its previous save's plan when nothing changed
    # (storage_data included): each save must still land in its own step
    for version in (1, 2, 3):
        dcp.save(
            state_dict(mesh, version),
            storage_writer=CkptfsWriter(vol, path(version, "cached")),
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
    res.check("cached_plan_latest", latest_step(vol, "cached") == 3, latest_step(vol, "cached"))
    for version in (1, 2, 3):
        target = state_dict(mesh, version, zeros=True)
        dcp.load(target, storage_reader=CkptfsReader(vol, path(version, "cached")))
        res.check(f"cached_plan_load_{version}", *compare(target, version))


def scenario_cross(res: Results, mesh, vol: str) -> None:
    """2 ranks, through the FUSE mount: native save -> FileSystemReader, and the reverse."""
    mnt = os.environ["CKPT_MOUNT"]
    dcp.save(state_dict(mesh, 1), storage_writer=CkptfsWriter(vol, path(1, "native")))
    # the save returned once staged on this host: a reader without the tier (the mount)
    # needs it drained to the nodes, which is what latest_durable reports
    drain(timeout=120)
    dist.barrier()
    res.check("durable_after_drain", latest_step(vol, "native", durable=True) == 1)
    target = state_dict(mesh, 1, zeros=True)
    dcp.load(target, storage_reader=FileSystemReader(os.path.join(mnt, path(1, "native"))))
    res.check("native_to_fsreader", *compare(target, 1))
    dist.barrier()
    dcp.save(
        state_dict(mesh, 2), storage_writer=FileSystemWriter(os.path.join(mnt, path(1, "posix")))
    )
    dist.barrier()
    target = state_dict(mesh, 2, zeros=True)
    dcp.load(target, storage_reader=CkptfsReader(vol, path(1, "posix")))
    res.check("fswriter_to_native", *compare(target, 2))
    res.check("fswriter_bytes_item", target["extra"]["version"] == 2, target["extra"])


SCENARIOS = {
    "save": scenario_save,
    "reshard_async": scenario_reshard_async,
    "cross": scenario_cross,
}


def main() -> int:
    scenario = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    res = Results(scenario)
    try:
        mesh = init_device_mesh("cpu", (world,))
        SCENARIOS[scenario](res, mesh, os.environ["CKPT_VOL"])
        res.put("done", True)
    except BaseException:
        res.put("error", traceback.format_exc())
        res.save()
        raise
    res.save()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
