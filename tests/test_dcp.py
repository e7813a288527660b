"""The DCP backend with real multi-process gloo saves and loads (tests/dcp_worker.py ranks).

Each scenario starts its ranks once (torch import dominates the cost) and several
tests read the checks the ranks recorded, plus what the volume holds afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fusefs.client.volume import Volume, VolumeSettings
from fusefs.dcp import (
    CkptfsReader,
    CkptfsWriter,
    close_volumes,
    drain,
    latest_step,
    parse_ckpt_path,
)
from metadata.engine import MetaError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dcp_worker.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
import dcp_worker as W  # noqa: E402

CHUNK = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    scenario: str, world: int, vol: str, out: str, timeout: float = 300, **env: str
) -> list[dict]:
    """Run `world` ranks of a scenario; fail with the logs if any rank fails or hangs."""
    os.makedirs(out, exist_ok=True)
    port = str(free_port())
    procs, logs = [], []
    for r in range(world):
        log = open(os.path.join(out, f"{scenario}.rank{r}.log"), "w")  # noqa: SIM115
        logs.append(log)
        e = dict(os.environ)
        e.update(
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            CKPT_VOL=vol,
            CKPT_OUT=out,
            PYTHONPATH=ROOT,
            OMP_NUM_THREADS="1",
            **env,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, scenario], env=e, stdout=log, stderr=subprocess.STDOUT
            )
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
    codes = [p.returncode for p in procs]
    if any(codes):
        tails = []
        for r in range(world):
            with open(os.path.join(out, f"{scenario}.rank{r}.log")) as f:
                tails.append(f"--- rank {r} (exit {codes[r]}):\n" + f.read()[-3000:])
        pytest.fail(f"{scenario}: ranks failed or timed out\n" + "\n".join(tails))
    results = []
    for r in range(world):
        with open(os.path.join(out, f"{scenario}.rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def assert_checks(results: list[dict], *names: str) -> None:
    for r, res in enumerate(results):
        for name in names:
            assert name in res, f"rank {r} did not record {name}"
            ok, detail = res[name]
            assert ok, f"rank {r}: {name}: {detail}"


@pytest.fixture(autouse=True, scope="module")
def _staging_home(tmp_path_factory):
    """The DCP backend stages in the default per-host directory: keep it in tmp. Ranks and
    mounts inherit it, so they share one staging directory per volume, as on a real host."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A volume after the 4-rank 'save' scenario (steps 1, 2 published; 3 failed)."""
    base = tmp_path_factory.mktemp("dcp")
    vol = str(base / "vol")
    Volume.create(vol, settings=VolumeSettings(chunk_size=CHUNK)).close()
    results = launch("save", 4, vol, str(base / "out"))
    yield vol, results, base
    close_volumes()


def test_four_ranks_save_and_load_exactly(saved):
    _, results, _ = saved
    assert_checks(results, "exact_load", "bytes_item", "partial_load", "step2_load")


def test_layout_matches_filesystem_writer(saved, tmp_path):
    """Same files and same bytes as FileSystemWriter for the same plan (single process).

    By default the zip CRC32 torch.save computes is skipped (our chunks carry their own
    checksums): the bytes then equal FileSystemWriter's with torch's CRC option off, and
    FileSystemReader loads them; zip_crc32=True gives FileSystemWriter's exact bytes."""
    vol, _, _ = saved
    sd = {f"t{i}": W.full(i, 1) for i in range(4)} | {"meta": {"a": 1}}
    dcp.save(sd, storage_writer=CkptfsWriter(vol, "layout/step-1"), no_dist=True)
    dcp.save(sd, storage_writer=CkptfsWriter(vol, "layout/step-2", zip_crc32=True), no_dist=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")), no_dist=True)
    assert torch.serialization.get_crc32_options()  # nothing process-global was changed
    drain(timeout=120)  # read back below by a Volume without the host tier
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "nocrc")), no_dist=True)
    finally:
        torch.serialization.set_crc32_options(True)
    with Volume.open(vol) as v:
        names = sorted(n.decode() for n, _ in v.listdir("layout/step-1"))
        assert names == sorted(os.listdir(tmp_path / "fs"))
        theirs = dcp.FileSystemReader(str(tmp_path / "fs")).read_metadata()
        for n in names:
            if n == ".metadata":
                continue
            mine = v.read_file(f"layout/step-1/{n}")
            fs, nocrc = (tmp_path / "fs" / n).read_bytes(), (tmp_path / "nocrc" / n).read_bytes()
            assert len(mine) == len(fs) == len(nocrc)
            assert v.read_file(f"layout/step-2/{n}") == fs
            # tensors equal torch.save's with CRC off; byte items (pickled by DCP's planner
            # with the process setting, CRC on) equal FileSystemWriter's own
            items = [s for s in theirs.storage_data.values() if s.relative_path == n]
            assert sum(s.length for s in items) == len(fs) and len(items) >= 4
            for s in items:
                got = mine[s.offset : s.offset + s.length]
                ref = got == fs[s.offset : s.offset + s.length]
                assert ref or got == nocrc[s.offset : s.offset + s.length], s
            (tmp_path / "nocrc" / n).write_bytes(mine)  # FileSystemReader on our bytes
    mine_md = CkptfsReader(vol, "layout/step-1").read_metadata()
    assert mine_md.storage_data == theirs.storage_data
    assert mine_md.state_dict_metadata == theirs.state_dict_metadata
    out = {f"t{i}": torch.zeros_like(W.full(i, 1)) for i in range(4)} | {"meta": {"a": 0}}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "nocrc")), no_dist=True)
    assert all(torch.equal(out[f"t{i}"], W.full(i, 1)) for i in range(4)) and out["meta"]["a"] == 1


def test_step2_mostly_unchanged_stores_little(saved):
    """10% of tensors changed: <= 15% new bytes (ckptfs stats --json, before and after)."""
    _, results, _ = saved
    s1, s2 = results[0]["stats_after_1"], results[0]["stats_after_2"]
    logical = s2["logical_bytes"] - s1["logical_bytes"]
    new_raw = s2["raw_unique_bytes"] - s1["raw_unique_bytes"]
    new_stored = s2["stored_bytes"] - s1["stored_bytes"]
    assert logical >= s1["logical_bytes"] * 0.95  # step 2 is a full-size checkpoint
    assert new_raw <= 0.15 * logical, (new_raw, logical)
    assert new_stored <= 0.15 * s1["stored_bytes"], (new_stored, s1["stored_bytes"])
    assert new_raw >= 0.05 * logical  # the changed tensors were stored, not lost


def test_failing_rank_leaves_previous_step(saved):
    vol, results, _ = saved
    assert_checks(results, "failed_save_raised")
    assert all(r["latest_after_failure"] == 2 for r in results)
    assert all(r["resume_path"] == "train/step-000002" for r in results)
    with Volume.open(vol) as v:
        assert sorted(n for n, _ in v.listdir("train")) == [b"step-000001", b"step-000002"]
        assert not v.exists("train/step-000003")
        state = v.meta.step_state("train", 3)
        assert state["state"] == "aborted", state
        assert latest_step(vol, "train") == 2


def test_failed_step_chunks_are_collected_by_gc(saved, tmp_path):
    """Chunks written for the failed step belong to nothing: gc removes them, step 2 intact."""
    from fusefs.maint.gc import gc

    vol, _, _ = saved
    with Volume.open(vol) as v:
        before = {cid for n in v.store.nodes for cid, _, _ in n.list()}
        rep = gc(v, grace=0, progress=False)
        after = {cid for n in v.store.nodes for cid, _, _ in n.list()}
        assert rep.rows_deleted + rep.objects_deleted > 0, rep
        assert after < before
        assert v.meta.known_chunks(sorted(after)) == after  # no orphan object left
    # step 2 still loads exactly (in one process, into full unsharded tensors)
    target = {"model": {W.key(i): torch.zeros_like(W.full(i, 2)) for i in range(W.N_TENSORS)}}
    close_volumes()
    dcp.load(target, storage_reader=CkptfsReader(vol, "train/step-000002"), no_dist=True)
    for i in range(W.N_TENSORS):
        assert torch.equal(target["model"][W.key(i)], W.full(i, 2)), i


def test_reshard_to_two_ranks_and_async_saves(saved):
    vol, _, base = saved
    results = launch("reshard_async", 2, vol, str(base / "out2"))
    assert_checks(results, "reshard_load_1", "reshard_load_2", "async_load_11", "async_load_12")
    assert_checks(results, "cached_plan_latest", *(f"cached_plan_load_{v}" for v in (1, 2, 3)))
    with Volume.open(vol) as v:
        readers = {s: CkptfsReader(vol, f"async/step-{s:06d}") for s in (10, 11, 12)}
        metas = {s: r.read_metadata() for s, r in readers.items()}
        for s in (11, 12):
            assert metas[s].storage_data == metas[10].storage_data
            assert metas[s].state_dict_metadata == metas[10].state_dict_metadata
            names = sorted(n for n, _ in v.listdir(f"async/step-{s:06d}"))
            assert names == sorted(n for n, _ in v.listdir("async/step-000010"))
            for n in names:
                if n == b".metadata":
                    continue
                a = v.resolve(f"async/step-000010/{n.decode()}")
                b = v.resolve(f"async/step-{s:06d}/{n.decode()}")
                assert a.size == b.size
                assert v.meta.get_extents(a.ino) == v.meta.get_extents(b.ino), (s, n)


@pytest.fixture
def mounted(tmp_path):
    """A fresh volume mounted with `ckptfs mount` (foreground daemon, unmounted at teardown)."""
    vol, mnt = str(tmp_path / "vol"), tmp_path / "mnt"
    Volume.create(vol, settings=VolumeSettings(chunk_size=CHUNK)).close()
    mnt.mkdir()
    exe = shutil.which("ckptfs")
    cmd = [exe] if exe else [sys.executable, "-m", "fusefs.cli"]
    log = open(tmp_path / "mount.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([*cmd, "mount", vol, str(mnt)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mount failed: {(tmp_path / 'mount.log').read_text()}")
            time.sleep(0.1)
        yield vol, str(mnt)
    finally:
        subprocess.run([*cmd, "umount", str(mnt)], capture_output=True, timeout=60)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        close_volumes()


def test_cross_format_through_the_mount(mounted, tmp_path):
    vol, mnt = mounted
    results = launch("cross", 2, vol, str(tmp_path / "out"), CKPT_MOUNT=mnt)
    assert_checks(
        results,
        "durable_after_drain",
        "native_to_fsreader",
        "fswriter_to_native",
        "fswriter_bytes_item",
    )


# -- single-process checks: argument errors, unpublished steps -----------------------------
def test_path_parsing_and_bad_arguments(volume):
    assert parse_ckpt_path("job/step-000100") == ("job", 100)
    assert parse_ckpt_path("a/b/ckpt7") == ("a/b", 7)
    assert parse_ckpt_path("x", job="j", step=3) == ("j", 3)
    for bad in ("step-1", "job/latest", "", "../x/step-1"):
        with pytest.raises(ValueError):
            parse_ckpt_path(bad)
    with pytest.raises(TypeError):
        CkptfsWriter(volume, "job/step-1")  # a Volume object would not pickle
    with pytest.raises(ValueError):
        CkptfsWriter(volume.base_dir, "job/step-1", thread_count=0)


def test_step_number_reuse_is_refused(volume):
    vol = volume.base_dir
    sd = {"t": torch.arange(10)}
    dcp.save(sd, storage_writer=CkptfsWriter(vol, "j/step-1"), no_dist=True)
    with pytest.raises(CheckpointException, match="already exists|is published"):
        dcp.save(sd, storage_writer=CkptfsWriter(vol, "j/step-1"), no_dist=True)
    assert latest_step(vol, "j") == 1
    close_volumes()


def test_unpublished_step_is_not_loadable(volume):
    """An open (uncommitted) step is invisible to readers and to latest."""
    vol = volume.base_dir
    volume.meta.begin("k", 5, 2)
    with pytest.raises(CheckpointException, match="is the step published"):
        dcp.load(
            {"t": torch.zeros(3)}, storage_reader=CkptfsReader(vol, "k/step-000005"), no_dist=True
        )
    assert latest_step(vol, "k") is None
    with pytest.raises(MetaError):
        volume.meta.commit_rank("k", 5, 7, [])
    close_volumes()


def test_writer_pickles_without_a_volume(volume):
    import pickle

    w = CkptfsWriter(volume.base_dir, "p/step-3", thread_count=2)
    w2 = pickle.loads(pickle.dumps(w))
    assert (w2.volume, w2.job, w2.step, w2.thread_count) == (volume.base_dir, "p", 3, 2)


def test_save_and_load_through_the_write_behind_tier(volume, tmp_path):
    """staging=DIR: chunks are staged on local disk first; the reader finds them via the tier."""
    vol, staging = volume.base_dir, str(tmp_path / "staging")
    sd = {f"t{i}": W.full(i, 1) for i in range(3)} | {"meta": {"k": "v"}}
    dcp.save(sd, storage_writer=CkptfsWriter(vol, "tier/step-1", staging=staging), no_dist=True)
    out = {f"t{i}": torch.zeros_like(W.full(i, 1)) for i in range(3)} | {"meta": {"k": ""}}
    rd = CkptfsReader(vol, "tier/step-1", staging=staging)
    dcp.load(out, storage_reader=rd, no_dist=True)
    assert all(torch.equal(out[f"t{i}"], W.full(i, 1)) for i in range(3))
    assert out["meta"] == {"k": "v"}
    assert latest_step(vol, "tier") == 1
    with pytest.raises(ValueError):
        CkptfsWriter(vol, "tier/step-2", staging=staging, durability="sometimes")
    close_volumes()


@pytest.fixture
def slow_items(monkeypatch) -> list[str]:
    """The names of the items a CkptfsReader loads the ordinary way (not direct)."""
    slow: list[str] = []
    real = CkptfsReader._load_item

    def spy(self, req, *args, **kwargs):
        slow.append(req.storage_index.fqn)
        return real(self, req, *args, **kwargs)

    monkeypatch.setattr(CkptfsReader, "_load_item", spy)
    return slow


def test_tensors_load_straight_into_their_targets(volume, tmp_path, slow_items):
    """The load's direct path: a tensor stored as whole raw chunks on this host, whose bytes
    around the tensor are torch.save's envelope for the target's dtype and shape, is read by
    the kernel into the target (no torch.load). Anything else takes the ordinary path and
    still loads exactly: a non-contiguous target, a target of another dtype (the envelope
    differs), and a cached copy that is corrupt (dropped and fetched again from a node)."""
    import glob

    from chunkstore import codec
    from fusefs.dcp import envelope as d

    vol, staging = volume.base_dir, str(tmp_path / "staging")
    sd = {
        "a": torch.randn(300, 700),  # several 64 KiB chunks
        "b": torch.randn(40, 50).to(torch.bfloat16),
        "c": torch.tensor(2.5),  # 0-dim
        "d": torch.randn(64, 32),
        "e": torch.randn(20, 30).to(torch.bfloat16),
        "meta": {"k": "v"},
    }
    dcp.save(sd, storage_writer=CkptfsWriter(vol, "direct/step-1", staging=staging), no_dist=True)
    slow = slow_items

    def load(out: dict) -> dict:
        slow.clear()
        rd = CkptfsReader(vol, "direct/step-1", staging=staging)
        dcp.load(out, storage_reader=rd, no_dist=True)
        return out

    out = load({k: torch.zeros_like(v) for k, v in sd.items() if k != "meta"} | {"meta": {"k": ""}})
    assert all(torch.equal(out[k], sd[k]) for k in "abcde") and out["meta"] == {"k": "v"}
    assert sorted(slow) == ["meta.k"]  # staged (not yet uploaded): every tensor went direct

    drain()  # now on the nodes, the local copies in the host cache
    odd = {
        "a": torch.zeros(700, 300).t(),  # not contiguous
        "b": torch.zeros(40, 50, dtype=torch.float16),  # stored as bfloat16
        "c": torch.zeros(()),
        "d": torch.zeros(64, 32),
        "e": torch.zeros(20, 30, dtype=torch.bfloat16),
    }
    cached = glob.glob(os.path.join(staging, "**", "cache", "*"), recursive=True)
    d_id = CkptfsReader(vol, "direct/step-1", staging=staging)._file("__0_0.distcp")[1]
    d_off = next(md.offset for idx, md in _storage(vol, staging).items() if idx.fqn == "d")
    d_chunk = next(e.chunk_id for e in d_id if e.offset <= d_off < e.offset + e.length)
    victim = next(p for p in cached if os.path.basename(p) == d_chunk.hex())
    env = d.ENVELOPES[(torch.float32, (64, 32), (32, 1))]  # captured by the save
    with open(victim, "r+b") as f:  # flip a byte of the tensor data in the cached copy of "d"
        good = f.read()
        at = codec.HEADER + len(env.head) + 1000
        assert at < len(good) - len(env.tail)
        f.seek(at)
        f.write(bytes([good[at] ^ 0xFF]))
    out = load(odd)
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["d"], sd["d"])
    assert torch.equal(out["b"], sd["b"].to(torch.float16))
    assert torch.equal(out["c"], sd["c"]) and torch.equal(out["e"], sd["e"])
    assert sorted(slow) == ["a", "b", "d"]
    with open(victim, "rb") as f:  # the bad copy was replaced by a good one (as the node
        assert codec.decode(f.read()) == codec.decode(good)  # encodes it: maybe compressed)
    d.ENVELOPES.clear()  # forms not seen by this process's saves are captured on demand
    out = load({k: torch.zeros_like(v) for k, v in sd.items() if k != "meta"} | {"meta": {"k": ""}})
    assert all(torch.equal(out[k], sd[k]) for k in "abcde")
    assert not {"a", "b", "c", "e"} & set(slow)
    close_volumes()


def test_targets_sharing_memory_load_one_at_a_time(volume, tmp_path, slow_items):
    """Direct reads fill their targets concurrently, so items whose targets share memory go
    the ordinary way, one after the other: tied weights get one stored tensor whole (not a
    mix of two), and a planner that hands out one scratch buffer per shape and copies it
    out in commit_tensor gets every tensor right."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    vol, staging = volume.base_dir, str(tmp_path / "staging")
    sd = {f"p{i}": torch.full((256, 64), float(i)) for i in range(4)}
    dcp.save(sd, storage_writer=CkptfsWriter(vol, "tied/step-1", staging=staging), no_dist=True)
    slow = slow_items
    tied = torch.zeros(256, 64)
    out = {"p0": tied, "p1": tied, "p2": torch.zeros(256, 64), "p3": torch.zeros(256, 64)}
    dcp.load(out, storage_reader=CkptfsReader(vol, "tied/step-1", staging=staging), no_dist=True)
    assert sorted(slow) == ["p0", "p1"]
    assert torch.equal(tied, sd["p0"]) or torch.equal(tied, sd["p1"])
    assert torch.equal(out["p2"], sd["p2"]) and torch.equal(out["p3"], sd["p3"])

    class Scratch(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            real = super().resolve_tensor(read_item)
            key = (tuple(real.shape), real.dtype)
            return self.__dict__.setdefault("bufs", {}).setdefault(key, torch.empty_like(real))

        def commit_tensor(self, read_item, tensor):
            super().resolve_tensor(read_item).copy_(tensor)

    slow.clear()
    out = {k: torch.zeros(256, 64) for k in sd}
    rd = CkptfsReader(vol, "tied/step-1", staging=staging)
    dcp.load(out, storage_reader=rd, planner=Scratch(), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd) and sorted(slow) == sorted(sd)
    close_volumes()


def _storage(vol: str, staging: str) -> dict:
    rd = CkptfsReader(vol, "direct/step-1", staging=staging)
    return rd.read_metadata().storage_data


def test_mapped_cache_object_loads_in_place(tmp_path):
    """The load fast path: a raw cached object is mapped (not read) and the tensor's storage
    is the mapping itself, so the item's only copy is into the target; anything else (small,
    compressed, torn) takes the ordinary path or fails with a format error."""
    import ctypes
    import io

    from chunkstore import codec
    from chunkstore.cache import MAP_MIN, read_object
    from fusefs.dcp.envelope import load_in_place as _load_in_place

    t = torch.randn(MAP_MIN // 2)  # 2x MAP_MIN bytes of float32
    buf = io.BytesIO()
    torch.save(t, buf)
    path = tmp_path / "obj"
    path.write_bytes(codec.encode(buf.getvalue(), "none"))
    view = read_object(str(path), fast=True)
    assert isinstance(view, memoryview) and not view.readonly
    assert bytes(view) == buf.getvalue()
    out = _load_in_place(view)
    assert out is not None and torch.equal(out, t)
    base = ctypes.addressof(ctypes.c_char.from_buffer(view))
    assert base <= out.data_ptr() < base + len(view)  # no copy was made
    # compressed and small objects: plain bytes, decoded and checked as before
    path.write_bytes(codec.encode(buf.getvalue(), "zstd"))
    assert read_object(str(path), fast=True) == buf.getvalue()
    path.write_bytes(codec.encode(b"tiny", "none"))
    assert read_object(str(path), fast=True) == b"tiny"
    # a torn raw object is a format error, never a short view
    whole = codec.encode(buf.getvalue(), "none")
    path.write_bytes(whole[:-5])
    with pytest.raises(codec.ChunkFormatError):
        read_object(str(path), fast=True)


def test_saved_tensor_bytes_equal_torch_save_from_the_envelope_cache():
    """_save_tensor writes a repeated tensor form from its captured envelope: the bytes must
    be torch.save's (CRC off) for every form, cached or not, and load back exactly."""
    import io
    import pickle

    from fusefs.dcp import envelope as d

    def torch_bytes(t: torch.Tensor) -> bytes:
        buf = io.BytesIO()
        w = torch._C.PyTorchFileWriter(buf, False, d.NO_CRC_SAVE)
        torch.serialization._save(t, w, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        w.write_end_of_file()
        return buf.getvalue()

    def ours(t: torch.Tensor) -> bytes:
        buf = io.BytesIO()
        d.save_tensor(t, buf)
        return buf.getvalue()

    assert d.NO_CRC_SAVE is not None, "this torch's serialization internals changed"
    d.ENVELOPES.clear()
    plain = [
        lambda k: torch.randn(1000) + k,
        lambda k: (torch.randn(10, 30) + k).to(torch.bfloat16),
        lambda k: torch.tensor(3.5 + k),  # 0-dim
        lambda k: torch.arange(10, dtype=torch.int64) + k,
    ]
    other = [
        lambda k: torch.randn(7, 5).t(),  # not contiguous
        lambda k: torch.randn(20)[5:],  # a view into a larger storage
        lambda k: torch.zeros(0),
        lambda k: torch.randn(8, requires_grad=True),
        lambda k: torch.nn.Parameter(torch.randn(8)),
    ]
    for make in plain + other:
        for k in range(3):
            t = make(k)
            got = ours(t)
            assert got == torch_bytes(t), (t.dtype, tuple(t.shape), k)
            back = torch.load(io.BytesIO(got), weights_only=True)
            assert torch.equal(back.detach(), t.detach())
    assert len(d.ENVELOPES) == len(plain)  # one envelope per plain form, none for the rest
    # a tensor with Python attributes is not a plain form, even with a cached envelope
    t = torch.randn(1000)
    t.note = "x"
    assert d.envelope_key(t) is None


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_batch_hashing_keeps_each_chunk_with_its_id(tmp_path, workers):
    """ChunkSink.ids spreads a batch over the pool interleaved; every id must come back in
    its chunk's place, whatever the batch and pool sizes (an id in the wrong place would
    commit one chunk's extent under another's content)."""
    from chunkstore.ids import pieces_id

    Volume.create(str(tmp_path / "v")).close()
    with Volume.open(str(tmp_path / "v"), workers=workers) as vol:
        for n in (0, 1, 2, 3, 5, 17):
            chunks = [[os.urandom(100 + 37 * i), memoryview(os.urandom(i))] for i in range(n)]
            want = [pieces_id(p, vol.seed) for p in chunks]
            assert vol.sink.ids(chunks) == want
            assert len(set(want)) == n
