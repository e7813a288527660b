"""One rank of a DCP save and load by fsspec URL (spawned by tests/test_fsspec_dcp.py).

`dcp.save(state_dict, checkpoint_id="ckptfs://HOST:PORT/...")` names no storage writer:
torch picks its FsspecWriter because fsspec knows the protocol (the entry point), and the
bytes go through the ckptfs fsspec filesystem. Environment: RANK, WORLD_SIZE, MASTER_PORT
(gloo on 127.0.0.1), CKPT_URL, CKPT_OUT (this rank's JSON results), CKPTFS_TOKEN_FILE.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import fsspec  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from dcp_worker import N_TENSORS, ROWS, full, key, state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (torch.equal compares values: -0.0 == 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(torch.uint8).numpy()
    )


def exact(sd: dict, version: int) -> tuple[bool, str]:
    for i in range(N_TENSORS):
        got, want = sd["model"][key(i)], full(i, version)
        if isinstance(got, DTensor):
            rows = ROWS // got.device_mesh.size()
            r = got.device_mesh.get_local_rank()
            want, got = want[r * rows : (r + 1) * rows], got.to_local()
        if not same_bytes(got, want):
            return False, f"{key(i)} differs"
    return True, "bit-exact"


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = os.path.join(os.environ["CKPT_OUT"], f"rank{rank}.json")
    url = os.environ["CKPT_URL"]
    results: dict = {}
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        fs, path = fsspec.core.url_to_fs(url)
        results["filesystem"] = type(fs).__name__
        dcp.save(state_dict(mesh, 1), checkpoint_id=url)
        dist.barrier()
        target = state_dict(mesh, 1, zeros=True)
        dcp.load(target, checkpoint_id=url)
        results["exact_load"] = exact(target, 1)
        results["bytes_item"] = target["extra"] == {"version": 1, "note": "saved at version 1"}
        if rank == 0:
            results["files"] = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
        results["done"] = True
    except BaseException:
        results["error"] = traceback.format_exc()
        raise
    finally:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
