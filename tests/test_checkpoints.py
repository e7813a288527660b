"""Checkpoint transactions through a real `ckptfs meta serve`: ranks in processes, crashes."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import threading
import time

import pytest

from fusefs.client.volume import Volume
from metadata.client import connect
from metadata.engine import DURABLE, STAGED, Extent, MetaError, NewChunk
from metadata.sql.checkpoints import unpack_extents

FILES = 2


def rank_files(rank: int, salt: bytes = b"", state: int = STAGED) -> list[dict]:
    """Deterministic content per (rank, salt): a retry sends byte-identical files."""
    out = []
    for f in range(FILES):
        cid = (salt + b"%06d-%02d" % (rank, f)).ljust(16, b"x")[:16]
        out.append(
            {
                "path": f"model/rank-{rank:04d}-{f}.distcp",
                "size": 1000 + rank,
                "extents": [Extent(0, 1000 + rank, cid, 0)],
                "new_chunks": [NewChunk(cid, 1000 + rank, 500, state)],
            }
        )
    return out


def _ranks_proc(url: str, job: str, step: int, ranks: list[int], q) -> None:
    """A training process: commits its ranks, then waits for publish and lists the step."""
    try:
        c = connect(url)
        for r in ranks:
            c.commit_rank(job, step, r, rank_files(r), host=f"h{os.getpid()}")
        q.put(("committed", len(ranks)))
        info = c.wait_published(job, step, 60)
        vol = Volume(c, c.get_config())
        names = [n for n, _ in vol.listdir(f"{job}/step-{step:06d}/model")]
        q.put(("seen", info["state"], len(names)))
        vol.close()
    except Exception as e:  # reported to the test, which fails on it
        q.put(("error", repr(e)))


@pytest.fixture
def served(tmp_path, meta_server):
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    return meta_server(tmp_path / "vol")


def test_64_ranks_in_4_processes_invisible_until_last_commit(served):
    url, job, world = served.url, "llm", 64
    main = connect(url)
    main.begin(job, 7, world)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # 63 ranks over 4 processes; the main process holds back rank 63.
    groups = [[r for r in range(63) if r % 4 == i] for i in range(4)]
    procs = [ctx.Process(target=_ranks_proc, args=(url, job, 7, g, q)) for g in groups]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=120) for _ in procs]
        assert all(m[0] == "committed" for m in got), got
        vol = Volume(main, main.get_config())
        assert not vol.exists(f"{job}/step-000007")
        assert main.latest(job) is None
        assert main.step_state(job, 7)["committed"] == 63
        res = main.commit_rank(job, 7, 63, rank_files(63))
        assert res["state"] == "published"
        seen = [q.get(timeout=120) for _ in procs]
        assert seen == [("seen", "published", 64 * FILES)] * 4, seen
        assert main.latest(job) == 7
        assert len(vol.listdir(f"{job}/step-000007/model")) == 64 * FILES
        vol.close()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_rank_that_never_commits_is_aborted_at_deadline(served):
    c = connect(served.url)
    c.begin("j", 1, 2)
    c.commit_rank("j", 1, 0, rank_files(0, b"a"))
    c.commit_rank("j", 1, 1, rank_files(1, b"a"))
    c.begin("j", 2, 2, deadline_s=1.0)
    c.commit_rank("j", 2, 0, rank_files(0, b"b"))
    info = c.wait_published("j", 2, 20)
    assert info["state"] == "aborted"
    assert "missing ranks 1" in info["reason"]
    assert c.latest("j") == 1
    vol = Volume(c, c.get_config())
    assert not vol.exists("j/step-000002")
    assert vol.exists("j/step-000001/model")
    # the aborted rank's chunk references were dropped: its journal entry was never
    # applied (no chunk row), or was applied and then taken back (refcount 0)
    cid = rank_files(0, b"b")[0]["extents"][0].chunk_id
    assert c.chunk_info([cid]).get(cid, (0, 0, 0, 0))[2] == 0
    with pytest.raises(MetaError) as e:
        c.commit_rank("j", 2, 1, rank_files(1, b"b"))
    assert e.value.errno == errno.ESTALE
    vol.close()


def test_sigkill_mid_step_clients_retry_and_files_appear_once(served):
    job, world = "crash", 16
    c = connect(served.url)
    c.begin(job, 3, world)
    for r in range(8):
        c.commit_rank(job, 3, r, rank_files(r))
    served.kill()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            cl = connect(served.url) if r % 2 else c  # reused and fresh connections
            cl.commit_rank(job, 3, r, rank_files(r))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    # ranks 4..7 retry commits that already landed; 8..15 are new. The service is down.
    pending = []
    for r in range(4, 16):
        if r % 2 == 0:
            pending.append(threading.Thread(target=rank, args=(r,)))
    for t in pending:
        t.start()
    time.sleep(0.5)
    served.restart()
    for r in range(4, 16):
        if r % 2:
            rank(r)
    for t in pending:
        t.join(timeout=60)
    assert not errors, errors
    assert c.wait_published(job, 3, 30)["state"] == "published"
    vol = Volume(c, c.get_config())
    names = sorted(n for n, _ in vol.listdir(f"{job}/step-000003/model"))
    assert names == sorted(
        f"rank-{r:04d}-{f}.distcp".encode() for r in range(world) for f in range(2)
    )
    info = c.checkpoint_info(job, 3)
    assert info["committed"] == world and len(info["ranks"]) == world
    assert c.stats().files == world * FILES
    assert c.reconnects >= 1
    vol.close()


def test_manifest_matches_commits_and_serves_many_readers(served):
    c = connect(served.url)
    c.begin("m", 1, 8)
    for r in range(8):
        c.commit_rank("m", 1, r, rank_files(r, b"m"))
    full = c.manifest("m", 1)
    assert full["state"] == "published"
    assert len(full["files"]) == 8 * FILES
    by_path = {f["path"]: f for f in full["files"]}
    for r in range(8):
        for f in rank_files(r, b"m"):
            got = by_path[f["path"]]
            assert got["size"] == f["size"] and got["rank"] == r
            assert unpack_extents(got["extents"]) == f["extents"]
    futs = [c.submit("manifest", "m", 1, rank=r % 8) for r in range(200)]
    for i, fut in enumerate(futs):
        files = fut.result(30)["files"]
        assert [f["path"] for f in files] == [f["path"] for f in rank_files(i % 8, b"m")]
    with pytest.raises(MetaError) as e:
        c.begin("m", 2, 1) and c.manifest("m", 2)
    assert e.value.errno == errno.EAGAIN


def test_latest_durable_follows_mark_durable(volume):
    m = volume.meta
    for step, state in ((1, DURABLE), (2, STAGED)):
        m.begin("d", step, 1)
        m.commit_rank("d", step, 0, rank_files(0, b"%d" % step, state))
    assert m.latest("d") == 2
    assert m.latest_durable("d") == 1
    m.mark_durable([f["extents"][0].chunk_id for f in rank_files(0, b"2")])
    assert m.latest_durable("d") == 2
    # remembered as durable (a restarted job asks once per rank), never past a delete
    assert m.latest_durable("d") == 2
    m.delete_checkpoint("d", 2)
    assert m.latest("d") == m.latest_durable("d") == 1
    # ... nor past a rewrite: a published step's file is an ordinary file, and new content
    # on a chunk still staged makes the step not durable, remembered or not
    attr = volume.resolve("d/step-000001/model/rank-0000-0.distcp")
    cid = b"rewritten".ljust(16, b"x")
    m.commit_file(attr.ino, [Extent(0, 10, cid, 0)], 10, [NewChunk(cid, 10, 10, STAGED)])
    assert m.latest("d") == 1 and m.latest_durable("d") is None
    m.mark_durable([cid])
    assert m.latest_durable("d") == 1


def test_checkpoint_commits_are_fsynced_ordinary_writes_are_not(volume):
    """An acknowledged publish must survive a power cut: SQLite runs checkpoint
    transactions at synchronous=FULL (WAL fsync'd at COMMIT) and fsyncs the WAL after a
    rank commit that publishes; ordinary writes run at NORMAL."""
    m = volume.meta
    if not hasattr(m, "_conn") or not hasattr(m._conn, "set_trace_callback"):
        pytest.skip("SQLite engine only")
    stmts: list[str] = []
    m._conn.set_trace_callback(stmts.append)

    def level_at_last_begin() -> str:
        begin = max(i for i, s in enumerate(stmts) if s.startswith("BEGIN"))
        return [s for s in stmts[:begin] if s.startswith("PRAGMA synchronous")][-1]

    syncs: list[int] = []
    real_sync = m._sync_wal
    m._sync_wal = lambda: (syncs.append(1), real_sync())
    try:
        m.begin("f", 1, 2)
        assert level_at_last_begin() == "PRAGMA synchronous=FULL"
        m.create(1, b"plain", 0o100644, 0, 0)
        assert level_at_last_begin() == "PRAGMA synchronous=NORMAL"
        # A rank commit that does not publish: acknowledged without an fsync (nothing of
        # it is visible until the publish, whose fsync persists it too).
        assert m.commit_rank("f", 1, 0, rank_files(0))["state"] == "open"
        assert level_at_last_begin() == "PRAGMA synchronous=NORMAL" and syncs == []
        # The commit that publishes: the WAL is fsync'd before it is acknowledged.
        assert m.commit_rank("f", 1, 1, rank_files(1))["state"] == "published"
        assert syncs == [1]
    finally:
        m._conn.set_trace_callback(None)
        del m._sync_wal


def test_stragglers_flagged_in_timeline(volume):
    m = volume.meta
    m.begin("s", 1, 6)
    for r in range(5):
        m.commit_rank("s", 1, r, rank_files(r), host="fast")
    time.sleep(1.3)
    m.commit_rank("s", 1, 5, rank_files(5), host="slow")
    info = m.checkpoint_info("s", 1)
    assert info["state"] == "published"
    assert info["stragglers"] == [5]
    slow = info["ranks"][5]
    assert slow["host"] == "slow" and slow["straggler"] and slow["files"] == FILES
    assert slow["bytes"] == FILES * 1005


def test_idempotent_begin_and_conflicting_begin(volume):
    m = volume.meta
    a = m.begin("i", 1, 4)
    assert m.begin("i", 1, 4) == a
    with pytest.raises(MetaError) as e:
        m.begin("i", 1, 8)
    assert e.value.errno == errno.EEXIST
    volume.mkdir("i/taken", parents=True)
    with pytest.raises(MetaError):
        m.begin("i", 2, 1, path="i/taken")
