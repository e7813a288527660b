"""torch DCP save and load by `checkpoint_id="ckptfs://HOST:PORT/job/step-1"` with no
storage writer or reader named: 4 gloo ranks against a real `ckptfs meta serve`, then the
same checkpoint loaded again in this process (after the ranks exited, their staged chunks
drained), resharded into whole tensors. Every tensor must come back bit for bit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fusefs.client.registry import close_volumes
from fusefs.client.volume import Volume, VolumeSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "fsspec_dcp_worker.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from dcp_worker import N_TENSORS, full, key  # noqa: E402
from fsspec_dcp_worker import same_bytes  # noqa: E402

WORLD = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(env: dict, out: str, timeout: float = 300) -> list[dict]:
    """Run WORLD ranks; fail with their logs if any fails or hangs."""
    port = str(free_port())
    procs, logs = [], []
    for r in range(WORLD):
        log = open(os.path.join(out, f"rank{r}.log"), "w")  # noqa: SIM115
        logs.append(log)
        e = dict(env, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r))
        e.update(LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        e.update(CKPT_OUT=out, OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen([sys.executable, WORKER], env=e, stdout=log, stderr=subprocess.STDOUT)
        )
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if any(p.returncode for p in procs):
        tails = []
        for r in range(WORLD):
            with open(os.path.join(out, f"rank{r}.log")) as f:
                tails.append(f"--- rank {r} (exit {procs[r].returncode}):\n" + f.read()[-3000:])
        pytest.fail("ranks failed or timed out\n" + "\n".join(tails))
    results = []
    for r in range(WORLD):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.fixture
def fsspec_env(entry_point_env, tmp_path):
    """The environment of the ranks: this checkout first, the fsspec.specs entry point
    (tests/fixtures/fsspec_entry.py), staging under tmp."""
    return dict(entry_point_env, XDG_CACHE_HOME=str(tmp_path / "cache"))


def test_dcp_save_and_load_by_url_across_four_ranks(tmp_path, meta_server, fsspec_env, monkeypatch):
    vol = str(tmp_path / "vol")
    Volume.create(vol, settings=VolumeSettings(chunk_size=64 * 1024)).close()
    srv = meta_server(vol)
    url = f"ckptfs://127.0.0.1:{srv.port}/job/step-1"
    out = str(tmp_path / "out")
    os.makedirs(out)
    env = dict(fsspec_env, CKPT_URL=url, CKPTFS_TOKEN_FILE=srv.token_file)
    results = launch(env, out)
    for r, res in enumerate(results):
        assert res["filesystem"] == "CkptfsFileSystem", res
        ok, detail = res["exact_load"]
        assert ok, f"rank {r}: {detail}"
        assert res["bytes_item"], f"rank {r}: the bytes item differs"
    files = results[0]["files"]
    assert ".metadata" in files and len([f for f in files if f.endswith(".distcp")]) == WORLD

    # Again in this process, after the ranks exited: whole tensors from the 4 shards.
    monkeypatch.setenv("CKPTFS_TOKEN_FILE", srv.token_file)
    monkeypatch.setenv("XDG_CACHE_HOME", fsspec_env["XDG_CACHE_HOME"])
    target = {"model": {key(i): torch.zeros_like(full(i, 1)) for i in range(N_TENSORS)}}
    try:
        dcp.load(target, checkpoint_id=url, no_dist=True)
    finally:
        close_volumes()
    for i in range(N_TENSORS):
        assert same_bytes(target["model"][key(i)], full(i, 1)), key(i)
