"""Retention: deleting published steps, keep-last (by command and as a policy), then gc."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import numpy as np
import pytest

from fusefs.maint.fsck import check_volume
from fusefs.maint.gc import gc
from metadata.engine import MetaError

KiB = 1024


def _save_step(vol, job: str, step: int, *, ranks: int = 2, size: int = 192 * KiB) -> None:
    """A real checkpoint step: chunks stored on the nodes, one commit per rank."""
    vol.meta.begin(job, step, ranks)
    rng = np.random.default_rng(step)
    for rank in range(ranks):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        chunker = vol.make_chunker()
        stream = vol.sink.stream(inline=False)  # the chunk path every writer takes
        for raw in chunker.feed(data) + chunker.finish():
            stream.add([raw], len(raw))
        stream.finish()
        vol.sink.sync()
        files = [stream.record(f"rank{rank}.bin")]
        vol.meta.commit_rank(job, step, rank, files, host="test")


def _published(vol, job: str) -> list[int]:
    return [r["step"] for r in vol.meta.list_checkpoints(job) if r["state"] == "published"]


def test_delete_frees_chunks_and_keeps_others(make_volume):
    vol = make_volume(chunk_size=64 * KiB, compression="none")
    for step in (1, 2):
        _save_step(vol, "job", step)
    one_step = vol.stats()["stored_bytes"] / 2
    res = vol.meta.delete_checkpoint("job", 1)
    assert res["state"] == "deleted"
    assert _published(vol, "job") == [2]
    assert vol.meta.latest("job") == 2
    assert not vol.exists("job/step-000001")
    assert vol.stats()["stored_bytes"] == pytest.approx(one_step, rel=0.01)
    rep = gc(vol, grace=0)
    assert rep.rows_deleted > 0 and rep.objects_deleted > 0
    assert check_volume(vol).as_dict()["problems"] == []
    assert len(vol.read_file("job/step-000002/rank1.bin")) == 192 * KiB
    # idempotent; an open step is refused
    assert vol.meta.delete_checkpoint("job", 1)["state"] == "deleted"
    vol.meta.begin("job", 3, 2)
    with pytest.raises(MetaError) as ei:
        vol.meta.delete_checkpoint("job", 3)
    assert ei.value.errno == errno.EBUSY


def test_hard_link_outside_the_step_survives_delete(make_volume):
    vol = make_volume(chunk_size=64 * KiB)
    _save_step(vol, "job", 1)
    keep = vol.resolve("job/step-000001/rank0.bin")
    want = vol.read_file("job/step-000001/rank0.bin")
    vol.meta.link(keep.ino, vol.resolve("/").ino, b"kept.bin")
    vol.meta.delete_checkpoint("job", 1)
    gc(vol, grace=0)
    assert vol.read_file("kept.bin") == want
    assert vol.resolve("kept.bin").nlink == 1
    assert check_volume(vol).as_dict()["problems"] == []


def test_fifty_steps_keep_last_three_policy_then_gc(make_volume):
    vol = make_volume(chunk_size=64 * KiB, compression="none")
    vol.meta.set_retention("train", 3)
    assert vol.meta.get_retention("train") == 3
    for step in range(1, 51):
        _save_step(vol, "train", step, size=128 * KiB)
    assert _published(vol, "train") == [48, 49, 50]
    gc(vol, grace=0)
    st = vol.stats()
    kept = [vol.resolve(f"train/step-{s:06d}/rank{r}.bin") for s in (48, 49, 50) for r in range(2)]
    kept_ids = {e.chunk_id for a in kept for e in vol.meta.get_extents(a.ino)}
    kept_bytes = sum(a.size for a in kept)
    info = vol.meta.chunk_info(list(kept_ids))
    assert st["stored_bytes"] == sum(stored for _, stored, _, _ in info.values())
    assert st["unique_chunks"] == len(kept_ids)
    assert st["raw_unique_bytes"] == kept_bytes  # random data: nothing shared between steps
    on_nodes = sum(size for n in vol.store.nodes for _, size, _ in n.list())
    assert on_nodes < kept_bytes * vol.settings.replicas * 1.01  # headers only
    assert check_volume(vol).as_dict()["problems"] == []
    assert [n for n, _ in vol.listdir("train")] == [
        b"step-000048",
        b"step-000049",
        b"step-000050",
    ]


def test_cli_delete_and_retain(tmp_path, make_volume):
    vol = make_volume(chunk_size=64 * KiB)
    for step in range(1, 6):
        _save_step(vol, "j", step, ranks=1, size=64 * KiB)
    path = vol.base_dir

    def ckptfs(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "fusefs.cli", "checkpoints", path, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = ckptfs("delete", "j", "1")
    assert out.returncode == 0, out.stderr
    out = ckptfs("retain", "j", "--keep-last", "2")
    assert out.returncode == 0, out.stderr
    listing = json.loads(ckptfs("list", "j", "--json").stdout)
    assert {r["step"]: r["state"] for r in listing} == {
        1: "deleted",
        2: "deleted",
        3: "deleted",
        4: "published",
        5: "published",
    }
    bad = ckptfs("delete", "j", "99")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "no checkpoint" in bad.stderr
    bad = ckptfs("retain", "j", "--keep-last", "0")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert len(_published(vol, "j")) == 2


def test_policy_and_delete_through_the_service(tmp_path, meta_server, monkeypatch):
    from fusefs.client.volume import Volume

    Volume.create(str(tmp_path / "vol"), nodes=2, settings=None).close()
    server = meta_server(tmp_path / "vol")
    with open(server.token_file) as f:
        monkeypatch.setenv("CKPTFS_TOKEN", f.read().strip())
    vol = Volume.open(server.url)
    try:
        vol.meta.set_retention("svc", 2)
        for step in (1, 2, 3):
            _save_step(vol, "svc", step, ranks=2, size=64 * KiB)
            vol.meta.wait_published("svc", step, timeout=30)
            assert vol.meta.manifest("svc", step)["files"]
        assert _published(vol, "svc") == [2, 3]
        # the service's cached manifest of the deleted step is gone with it
        with pytest.raises(MetaError):
            vol.meta.manifest("svc", 1)
        vol.meta.delete_checkpoint("svc", 2)
        with pytest.raises(MetaError):
            vol.meta.manifest("svc", 2)
        assert vol.meta.latest("svc") == 3
        assert gc(vol, grace=0).rows_deleted > 0
        assert check_volume(vol).as_dict()["problems"] == []
    finally:
        vol.close()
