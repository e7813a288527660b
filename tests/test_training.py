"""End to end, what users run: a small GPT-like model trained by 4 real gloo ranks (FSDP2
`fully_shard`, or DDP), model + optimizer + LR scheduler checkpointed after every step
through `CkptfsWriter` (one step by `dcp.async_save`), on a volume freshly made by
`ckptfs format` with default options (the write-behind tier on), directly or through
`ckptfs meta serve`. Then 2 ranks load every step (resharding 4 -> 2), every tensor of the
model and optimizer state must equal what was saved bit for bit (the 4-rank run dumped the
gathered full state to plain files), and one more training step must run and change the
loss. The ranks are tests/train_worker.py; each rank's log is kept and quoted on failure.

Ranks of one step store identical new chunks at once (LayerNorm weights of ones, zero
biases, optimizer step counters): every save must still publish.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from bench.servers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "train_worker.py")
STEPS = 3
PHASE_TIMEOUT = 240.0  # one phase's ranks, start to exit (each imports torch: ~10 s on 2 cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(phase: str, world: int, vol: str, out: str, env: dict) -> list[dict]:
    """Run `world` ranks of a phase; fail, quoting every rank's error and log, if any rank
    fails or they outlive PHASE_TIMEOUT."""
    port = str(free_port())
    procs, logs = [], []
    for r in range(world):
        log = open(os.path.join(out, f"{phase}.rank{r}.log"), "w")  # noqa: SIM115
        logs.append(log)
        e = dict(os.environ, **env)
        e.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        e.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        e.update(CKPT_VOL=vol, CKPT_OUT=out, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, phase], env=e, stdout=log, stderr=subprocess.STDOUT
            )
        )
    deadline = time.monotonic() + PHASE_TIMEOUT
    timed_out = False
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    results: list[dict] = []
    for r in range(world):
        try:
            with open(os.path.join(out, f"{phase}.rank{r}.json")) as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            results.append({"error": "no result (killed or crashed before writing one)"})
    codes = [p.returncode for p in procs]
    if timed_out or any(codes) or any("error" in res for res in results):
        why = f"timed out after {PHASE_TIMEOUT:g} s" if timed_out else f"exit codes {codes}"
        errors = "\n".join(
            f"  rank {r} ({res.get('phase', '?')}): {res.get('error', 'no error recorded')}"
            for r, res in enumerate(results)
        )
        tails = []
        for r in range(world):
            with open(os.path.join(out, f"{phase}.rank{r}.log")) as f:
                tails.append(f"--- rank {r} log (exit {codes[r]}), last lines:\n{f.read()[-2500:]}")
        pytest.fail(
            f"{world}-rank {phase} phase failed ({why}); the ranks' errors:\n{errors}\n\n"
            + "\n".join(tails),
            pytrace=False,
        )
    return results


def train_save_load(tmp_path, vol: str, wrap: str, env: dict | None = None) -> dict:
    """4 ranks train and save every step; 2 ranks load and compare each, then train on."""
    out = str(tmp_path / "out")
    os.makedirs(out, exist_ok=True)
    env = dict(env or {}, TRAIN_WRAP=wrap)
    # the tier stages in the default per-host directory: one for both phases, as on a host
    env.setdefault("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    t0 = time.monotonic()
    saved = run_ranks("save", 4, vol, out, env)
    t1 = time.monotonic()
    loaded = run_ranks("load", 2, vol, out, env)
    t2 = time.monotonic()
    for r, res in enumerate(saved):
        assert res["latest"] == STEPS, f"rank {r}: latest step {res['latest']}, not {STEPS}"
        assert len(res["losses"]) == STEPS
    compared = loaded[0]["compared"]
    assert sorted(int(s) for s in compared) == list(range(1, STEPS + 1)), compared
    assert all(n > 20 for n in compared.values()), compared  # model and optimizer tensors
    for r, res in enumerate(loaded):
        assert res["loss_after"] != res["loss_before"], f"rank {r}: {res}"
    print(f"{wrap}: save {t1 - t0:.1f} s, load {t2 - t1:.1f} s; save times {saved[0]['save_s']}")
    return {"saved": saved, "loaded": loaded}


def format_volume(path: str) -> str:
    """`ckptfs format DIR`, default options: what a user does first (this tree's code)."""
    cmd = [sys.executable, "-m", "fusefs.cli", "format", path]
    subprocess.run(cmd, env=child_env(), check=True, capture_output=True, timeout=60)
    return path


def test_fsdp2_every_step_on_a_fresh_volume(tmp_path):
    """FSDP2, 4 -> 2 ranks, on the volume directory (default options, the tier on)."""
    vol = format_volume(str(tmp_path / "vol"))
    train_save_load(tmp_path, vol, "fsdp")


def test_fsdp2_every_step_through_the_service(tmp_path, meta_server):
    """FSDP2, 4 -> 2 ranks, through `ckptfs meta serve` by its ckptfs:// URL."""
    vol = format_volume(str(tmp_path / "vol"))
    srv = meta_server(vol)
    train_save_load(tmp_path, srv.url, "fsdp", {"CKPTFS_TOKEN_FILE": srv.token_file})


def test_ddp_every_step_on_a_fresh_volume(tmp_path):
    """DDP (every rank holds the whole model), 4 -> 2 ranks, on the volume directory."""
    vol = format_volume(str(tmp_path / "vol"))
    train_save_load(tmp_path, vol, "ddp")
