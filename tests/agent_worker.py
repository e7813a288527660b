"""One rank of a multi-process DCP scenario through a host agent (spawned by
tests/test_agent.py; the state dicts and checks are tests/dcp_worker.py's).

Environment: RANK, WORLD_SIZE, MASTER_PORT, CKPT_VOL (volume directory or ckptfs:// URL),
CKPT_OUT (where this rank's JSON goes), and the agent's: XDG_RUNTIME_DIR (its socket) or
CKPTFS_AGENT=off. Logging at INFO, so the rank's "no ckptfs agent" line is in its log.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from dcp_worker import Results, compare, state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from fusefs.client.registry import volume_for  # noqa: E402
from fusefs.dcp import CkptfsReader, CkptfsWriter  # noqa: E402


def path(step: int) -> str:
    return f"{os.environ.get('JOB', 'train')}/step-{step:06d}"


def _threads() -> list[str]:
    return sorted({t.name.rstrip("0123456789_-") for t in threading.enumerate()})


def _describe(res: Results, vol: str) -> None:
    v = volume_for(vol, (None, "local", None))  # the writer's default tier spec
    res.put("agent", v.agent)
    res.put("engine", type(v.meta).__name__)
    res.put("replicas", [list(r) for r in getattr(v.meta, "replicas", [])])
    res.put("tier", type(v.tier).__name__ if v.tier is not None else None)
    res.put(
        "uploader_threads", sum(t.name.startswith("ckptfs-upload") for t in threading.enumerate())
    )
    res.put("threads", _threads())


def scenario_save_load(res: Results, mesh, vol: str) -> None:
    """Save step 1, load it back exactly; time both (rank 0 records the times)."""
    dist.barrier()
    t0 = time.monotonic()
    dcp.save(state_dict(mesh, 1), storage_writer=CkptfsWriter(vol, path(1)))
    dist.barrier()
    t1 = time.monotonic()
    target = state_dict(mesh, 1, zeros=True)
    dcp.load(target, storage_reader=CkptfsReader(vol, path(1)))
    dist.barrier()
    t2 = time.monotonic()
    res.check("exact_load", *compare(target, 1))
    res.put("save_s", t1 - t0)
    res.put("load_s", t2 - t1)
    _describe(res, vol)


def scenario_kill(res: Results, mesh, vol: str) -> None:
    """Step 1 saved, then saves of steps 2.. until SAVE_UNTIL (the test kills and restarts
    the agent meanwhile); each step's outcome and time recorded."""
    dcp.save(state_dict(mesh, 1), storage_writer=CkptfsWriter(vol, path(1)))
    dist.barrier()
    if dist.get_rank() == 0:
        open(os.path.join(os.environ["CKPT_OUT"], "saved1"), "w").close()
    end = time.monotonic() + float(os.environ.get("SAVE_FOR", "8"))
    steps: dict[str, list] = {}
    step = 2
    while time.monotonic() < end and step < 40:
        t0 = time.monotonic()
        try:
            dcp.save(state_dict(mesh, 2 + step % 2), storage_writer=CkptfsWriter(vol, path(step)))
            steps[str(step)] = ["ok", time.monotonic() - t0]
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            steps[str(step)] = [f"{type(e).__name__}: {e}"[:2000], time.monotonic() - t0]
        dist.barrier()
        step += 1
    res.put("steps", steps)


def scenario_verify(res: Results, mesh, vol: str) -> None:
    """Load step 1 and the steps in STEPS (as scenario_kill saved them) and compare."""
    for step in [1, *(int(s) for s in os.environ.get("STEPS", "").split(",") if s)]:
        version = 1 if step == 1 else 2 + step % 2
        target = state_dict(mesh, version, zeros=True)
        dcp.load(target, storage_reader=CkptfsReader(vol, path(step), staging=False))
        res.check(f"step{step}", *compare(target, version))
    res.put("agent", volume_for(vol).agent)


SCENARIOS = {"save_load": scenario_save_load, "kill": scenario_kill, "verify": scenario_verify}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s: %(message)s")
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
