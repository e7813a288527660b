"""One rank of the end-to-end training test (spawned by tests/test_training.py).

What a user runs: a small GPT-like model trained on CPU ranks over gloo, wrapped with FSDP2
(`fully_shard`) or DDP, AdamW plus an LR scheduler, checkpointed after EVERY step through
`CkptfsWriter` (model and optimizer by `get_state_dict`, the scheduler's state, the step).

Phases (argv[1]):
- save: train STEPS steps; after each, save `job/step-N` (step 2 by `dcp.async_save` on a
  process group of its own, overlapping the next training step; its future is awaited
  before the next save). Rank 0 also writes the gathered full state of every step to a
  plain local file (torch.save) for the load phase to compare against.
- load: load every saved step (resharding to this world size), compare every tensor of
  the model and optimizer state bit for bit with the full-state file, the scheduler state
  and the step exactly; then train one more step from the last one (the loss must change).

Environment: RANK, WORLD_SIZE, MASTER_PORT (gloo on 127.0.0.1), CKPT_VOL (volume directory
or ckptfs:// URL), CKPT_OUT (this rank's JSON results and the full-state files),
TRAIN_WRAP (fsdp or ddp), TRAIN_ASYNC (1: step 2 saved by dcp.async_save). A failure is
recorded as the exception's text in the rank's JSON ("error") and its traceback printed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402

from fusefs.dcp import CkptfsReader, CkptfsWriter, latest_step  # noqa: E402

JOB = "job"
STEPS = 3
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 96, 64, 4, 2, 16, 4
LR = 3e-3


# -- the model: embedding, pre-norm transformer blocks (LayerNorm: weights of ones, zero
# biases), MLP, a final norm and an untied head -------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.out = nn.Linear(4 * DIM, DIM)
        for lin in (self.qkv, self.proj, self.fc, self.out):
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(DIM, dim=2)
        q, k, v = (z.view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build(wrap: str, world: int):
    """The same initial weights on every rank, wrapped; AdamW and a warmup-cosine schedule."""
    torch.manual_seed(0)
    model = GPT()
    if wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        raise ValueError(wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)

    def warmup_cosine(i: int) -> float:
        return min(1.0, (i + 1) / 2) * 0.5 * (1 + math.cos(math.pi * min(i, 10) / 10))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    return model, opt, sched


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_of(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def train_step(model, opt, sched, step: int, rank: int) -> float:
    x, y = batch(step, rank)
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return float(loss.detach())


def app_state(model, opt, sched, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": step}


def full_state(model, opt) -> dict:
    """Collective: the whole unsharded model and optimizer state, on rank 0 (CPU)."""
    msd, osd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"model": msd, "optim": osd}


def ckpt(step: int) -> str:
    return f"{JOB}/step-{step}"


# -- comparison ---------------------------------------------------------------------------
def same_bits(a: object, b: object) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def differences(got: object, want: object, where: str = "") -> list[str]:
    """Every leaf that differs: tensors bit for bit (dtype and shape too), others by ==."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{where}: {type(got).__name__} instead of a dict"]
        out = [f"{where}.{k}: missing" for k in want.keys() - got.keys()]
        out += [f"{where}.{k}: unexpected" for k in got.keys() - want.keys()]
        for k in sorted(want.keys() & got.keys(), key=str):
            out += differences(got[k], want[k], f"{where}.{k}")
        return out
    if isinstance(want, list | tuple):
        if not isinstance(got, list | tuple) or len(got) != len(want):
            return [f"{where}: {got!r:.80} != {want!r:.80}"]
        pairs = enumerate(zip(got, want, strict=True))
        return [d for i, (g, w) in pairs for d in differences(g, w, f"{where}[{i}]")]
    if isinstance(want, torch.Tensor):
        if same_bits(got, want):
            return []
        return [f"{where}: tensor differs ({getattr(got, 'dtype', type(got))} vs {want.dtype})"]
    return [] if got == want else [f"{where}: {got!r:.80} != {want!r:.80}"]


def count_tensors(x: object) -> int:
    if isinstance(x, dict):
        return sum(count_tensors(v) for v in x.values())
    if isinstance(x, list | tuple):
        return sum(count_tensors(v) for v in x)
    return int(isinstance(x, torch.Tensor))


# -- phases -------------------------------------------------------------------------------
def phase_save(res: dict, vol: str, wrap: str, rank: int, world: int) -> None:
    out = os.environ["CKPT_OUT"]
    use_async = os.environ.get("TRAIN_ASYNC", "1") == "1"
    model, opt, sched = build(wrap, world)
    ckpt_pg = dist.new_group(backend="gloo")  # async saves' collectives, off the training PG
    pending = None
    res["losses"], res["save_s"] = [], {}
    for step in range(1, STEPS + 1):
        res["losses"].append(train_step(model, opt, sched, step, rank))
        if pending is not None:  # the previous step's async save, before this step's save
            pending.result(timeout=180)
            pending = None
        full = full_state(model, opt)
        if rank == 0:
            full["sched"], full["step"] = sched.state_dict(), step
            torch.save(full, os.path.join(out, f"full-step-{step}.pt"))
        state = app_state(model, opt, sched, step)
        t0 = time.monotonic()
        res["phase"] = f"saving step {step}"
        if use_async and step == 2:
            pending = dcp.async_save(
                state,
                storage_writer=CkptfsWriter(vol, ckpt(step)),
                process_group=ckpt_pg,
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
            )
        else:
            dcp.save(state, storage_writer=CkptfsWriter(vol, ckpt(step)))
        res["save_s"][step] = round(time.monotonic() - t0, 3)
    if pending is not None:
        pending.result(timeout=180)
    dist.barrier()
    res["phase"] = "done"
    res["latest"] = latest_step(vol, JOB)


def phase_load(res: dict, vol: str, wrap: str, rank: int, world: int) -> None:
    out = os.environ["CKPT_OUT"]
    model, opt, sched = build(wrap, world)
    res["compared"] = {}
    for step in range(1, STEPS + 1):
        res["phase"] = f"loading step {step}"
        state = app_state(model, opt, sched, 0)
        dcp.load(state, storage_reader=CkptfsReader(vol, ckpt(step)))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        full = full_state(model, opt)
        if rank == 0:
            want = torch.load(os.path.join(out, f"full-step-{step}.pt"), weights_only=False)
            full["sched"], full["step"] = sched.state_dict(), state["step"]
            diffs = differences(full, want)
            res["compared"][step] = count_tensors(want)
            if diffs:
                raise AssertionError(
                    f"step {step} loaded on {world} ranks differs from what was saved "
                    f"({len(diffs)} difference(s)): " + "; ".join(diffs[:8])
                )
    # one more step from the last checkpoint: it runs, and the loss on its batch changes
    res["phase"] = "training after the load"
    x, y = batch(STEPS + 1, rank)
    with torch.no_grad():
        before = float(loss_of(model, x, y))
    during = train_step(model, opt, sched, STEPS + 1, rank)
    with torch.no_grad():
        after = float(loss_of(model, x, y))
    res["loss_before"], res["loss_during"], res["loss_after"] = before, during, after
    if not (math.isfinite(after) and after != before):
        raise AssertionError(f"training after the load did not change the loss: {before}, {after}")
    res["phase"] = "done"


PHASES = {"save": phase_save, "load": phase_load}


def describe(e: BaseException) -> str:
    """One line per failure: a CheckpointException names each failing rank's exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for r, f in sorted(failures.items()):
            exc = f[0] if isinstance(f, tuple) else f
            parts.append(f"[rank {r}] {type(exc).__name__}: {exc}")
        return f"{type(e).__name__}: " + " | ".join(parts)
    return f"{type(e).__name__}: {e}"


def main() -> int:
    phase = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wrap = os.environ.get("TRAIN_WRAP", "fsdp")
    torch.set_num_threads(1)
    res: dict = {"phase": "init"}
    path = os.path.join(os.environ["CKPT_OUT"], f"{phase}.rank{rank}.json")
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        PHASES[phase](res, os.environ["CKPT_VOL"], wrap, rank, world)
    except BaseException as e:  # noqa: BLE001 (recorded for the test's message, then exit 1)
        traceback.print_exc()
        res["error"] = describe(e)
        code = 1
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    sys.stdout.flush()
    if code == 0:
        dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
