"""HostStager (a rank stages its own chunk files) and the tier's side of it (adopt,
fill_cache, tidy): real volumes, real staging directories, real processes for the kills."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from chunkstore import codec
from chunkstore.ids import chunk_id
from chunkstore.store import ChunkUnavailable
from chunkstore.tier import recover
from chunkstore.tier import tier as tiermod
from chunkstore.tier.journal import KIND_PENDING, SEGMENT_SUFFIX, parse_segment, read_segment
from chunkstore.tier.ranks import AdoptError
from chunkstore.tier.stager import HostStager
from chunkstore.tier.tier import WriteBehindTier
from fusefs.client.volume import Volume, VolumeSettings

MiB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _wait(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class DirectLink:
    """The agent's side called in-process (the agent's socket does this across processes)."""

    def __init__(self, tier: WriteBehindTier) -> None:
        self.tier = tier
        self.adopted: list[list[tuple[bytes, int, int | None]]] = []
        self.fetched: list[bytes] = []

    def adopt(self, entries, synced=True):
        self.adopted.append(list(entries))
        self.tier.adopt(entries, synced=synced)

    def fetch(self, ids):
        self.fetched += ids
        self.tier.fill_cache(ids)

    def flush(self, timeout):
        self.tier.flush(timeout=timeout)


@pytest.fixture
def vol_path(tmp_path):
    path = str(tmp_path / "vol")
    Volume.create(path, nodes=4, settings=VolumeSettings(chunk_size=1 * MiB, replicas=2)).close()
    return path


@pytest.fixture
def agent(vol_path, tmp_path):
    """The agent's volume and tier (nothing uploads until flushed: idle_s=600)."""
    vol = Volume.open(vol_path)
    vol.attach_tier(str(tmp_path / "staging"), size=256 * MiB, idle_s=600)
    yield vol
    vol.close()


def _stager(vol_path: str, agent: Volume, link=None) -> tuple[Volume, HostStager]:
    """A rank's volume whose tier is a HostStager on the agent's staging directory."""
    rank = Volume.open(vol_path)
    rank.tier = HostStager(rank.store, agent.tier.root, link or DirectLink(agent.tier))
    return rank, rank.tier


def _chunks(id_seed: int, seed: int, sizes: list[int]) -> list[tuple[bytes, bytes]]:
    """(chunk id under the volume's `id_seed`, raw bytes) of random chunks of `sizes`."""
    out = []
    for i, n in enumerate(sizes):
        raw = _data(n, seed + i)
        out.append((chunk_id(raw, id_seed), raw))
    return out


def _pending_records(staging: str) -> dict[bytes, int]:
    """chunk -> P records naming it, over every journal segment."""
    out: dict[bytes, int] = {}
    jdir = os.path.join(staging, "journal")
    for name in os.listdir(jdir):
        if name.endswith(SEGMENT_SUFFIX):
            for cid in read_segment(os.path.join(jdir, name)).pending:
                out[cid] = out.get(cid, 0) + 1
    return out


def _staged(staging: str) -> set[str]:
    return set(os.listdir(os.path.join(staging, "staged")))


def test_rank_puts_are_adopted_then_uploaded_and_marked_durable(vol_path, tmp_path):
    """put(sync=False) writes only temp files; sync_staged renames them into staged/ and
    returns once the agent's tier journaled them; its uploaders then drain them and call
    on_durable, as for chunks it staged itself."""
    staging = str(tmp_path / "staging")
    marked: list[bytes] = []
    with Volume.open(vol_path) as store_vol:
        tier = WriteBehindTier(
            store_vol.store,
            staging,
            size=256 * MiB,
            idle_s=600,
            on_durable=lambda ids, _lens: marked.extend(ids) and [],
        )
        link = DirectLink(tier)
        stager = HostStager(store_vol.store, staging, link)
        try:
            chunks = _chunks(store_vol.seed, 1, [300_000] * 5 + [3000])
            for cid, raw in chunks:
                parts = codec.raw_parts([raw[:1000], memoryview(raw)[1000:]])
                assert stager.put(cid, parts, sync=False, width=4) == tiermod.STAGED
            assert not _staged(staging) and not link.adopted
            assert len(os.listdir(os.path.join(staging, "tmp"))) == 6
            fsyncs = tier.seg.fsyncs
            assert stager.sync_staged() == 6
            assert tier.seg.fsyncs == fsyncs + 1  # one journal fsync for the batch
            assert [(c, n) for c, n, _ in link.adopted[0]] == [
                (cid, len(raw) + codec.HEADER) for cid, raw in chunks
            ]
            assert {w for _, _, w in link.adopted[0]} == {4}
            assert _staged(staging) == {cid.hex() for cid, _ in chunks}
            assert not [n for n in os.listdir(os.path.join(staging, "tmp")) if n[0] == "s"]
            assert set(_pending_records(staging)) == {cid for cid, _ in chunks}
            st = tier.stats()
            assert st["pending_chunks"] == 6
            assert st["pending_bytes"] == sum(len(r) + codec.HEADER for _, r in chunks)
            assert stager.sync_staged() == 0
            stager.flush(timeout=60)  # the agent's uploaders drain, on_durable is called
            assert set(marked) == {cid for cid, _ in chunks}
            assert tier.stats()["pending_chunks"] == 0 and not _staged(staging)
            for cid, raw in chunks:
                assert store_vol.store.get(cid) == raw
            assert stager.drained()
            assert set(tier.stats()) <= set(stager.stats())  # what metrics sums over tiers
        finally:
            stager.close()
            tier.close()


def test_reads_staged_then_uploaded_and_fetched_into_the_cache(vol_path, agent):
    rank, stager = _stager(vol_path, agent)
    try:
        (cid, raw), (cid2, raw2) = _chunks(rank.seed, 10, [400_000, 200_000])
        stager.put(cid, codec.encode(raw, "none"), sync=True)
        stager.put(cid2, codec.encode(raw2, "none"), sync=True)
        assert stager.get(cid) == raw  # staged, not uploaded (idle_s=600)
        buf = bytearray(len(raw))
        assert stager.read_into(cid, [memoryview(buf)]) and buf == raw
        assert stager.fetches == 0
        stager.flush(timeout=60)
        assert not _staged(agent.tier.root)
        agent.tier.cache.evict(10**12)  # uploaded, and evicted from the host cache
        assert not os.listdir(agent.tier.cache.dir)
        assert not stager.read_into(cid, [memoryview(bytearray(len(raw)))])
        assert bytes(stager.get(cid, view=True)) == raw  # the agent fetched it into cache/
        assert stager.fetches == 1 and os.path.exists(agent.tier.cache.path(cid))
        buf = bytearray(len(raw))
        assert stager.read_into(cid, [memoryview(buf)]) and buf == raw  # now local
        assert stager.get(cid2) == raw2 and stager.fetches == 2
        with open(agent.tier.cache.path(cid2), "r+b") as f:  # a damaged cached copy
            f.seek(1000)
            f.write(b"\xff" * 8)
        assert stager.get(cid2) == raw2 and stager.fetches == 3  # dropped, fetched again
        missing = chunk_id(b"never stored", rank.seed)
        with pytest.raises(ChunkUnavailable):
            stager.get(missing)
        assert stager.direct_reads == 0

        class Gone(DirectLink):
            def fetch(self, ids):
                raise ConnectionError("agent gone")

        stager.link = Gone(agent.tier)
        agent.tier.cache.evict(10**12)
        assert stager.get(cid) == raw  # read from the nodes by the rank itself
        assert stager.direct_reads == 1
        with pytest.raises(ChunkUnavailable):
            stager.get(missing)
    finally:
        rank.close()


def test_adopt_refuses_a_missing_or_short_file_and_adopts_nothing(agent):
    tier = agent.tier
    (good, raw), (short, sraw), (absent, _) = _chunks(agent.seed, 20, [100_000, 100_000, 100_000])
    for cid, r, cut in ((good, raw, 0), (short, sraw, 1)):
        blob = codec.encode(r, "none")
        with open(os.path.join(tier.staged_dir, cid.hex()), "wb") as f:
            f.write(blob[: len(blob) - cut])
    n = 100_000 + codec.HEADER
    size0 = tier.seg.size
    with pytest.raises(AdoptError, match=absent.hex()):
        tier.adopt([(good, n, None), (absent, n, None)])
    with pytest.raises(AdoptError, match=f"{short.hex()}.*{n - 1} bytes"):
        tier.adopt([(good, n, None), (short, n, None)])
    assert tier.seg.size == size0 and tier.stats()["pending_chunks"] == 0  # nothing half-done
    assert tier.adopt([(good, n, None)]) == 1
    assert tier.adopt([(good, n, None), (good, n, None)]) == 0  # idempotent
    assert tier.seg.size == size0 + len(_rec(good, n))
    st = tier.stats()
    assert st["pending_chunks"] == 1 and st["pending_bytes"] == n


def _rec(cid: bytes, n: int) -> bytes:
    from chunkstore.tier.journal import pack_record

    return pack_record(KIND_PENDING, cid, n, 0)


def test_a_refused_adopt_fails_the_save_and_acknowledges_nothing(vol_path, agent):
    class Refusing(DirectLink):
        def adopt(self, entries, synced=True):
            raise AdoptError("refused for the test")

    rank, stager = _stager(vol_path, agent, Refusing(agent.tier))
    try:
        with pytest.raises(AdoptError):
            rank.write_file("/f", _data(3 * MiB, 1))
        assert stager.sync_staged() == 0  # nothing left to acknowledge
        assert not [n for n in os.listdir(os.path.join(stager.root, "tmp")) if n[0] == "s"]
        assert _pending_records(stager.root) == {}
        assert rank.resolve("/f").size == 0  # created empty by the open; no data committed
    finally:
        rank.close()


def test_ranks_unsynced_adopts_share_the_agents_syncfs(agent):
    """A rank renames its files unsynced and the agent makes them durable before it
    journals them: one syncfs for every rank adopting at that moment (GroupSync), not a
    file and a directory fsync per rank; a synced adopt (a tier's own) syncs nothing more."""
    tier = agent.tier
    if tier._syncfs_fd is None:
        pytest.skip("no syncfs on this filesystem: an fdatasync each instead")
    chunks = _chunks(agent.seed, 31, [100_000] * 12)
    for cid, raw in chunks:
        with open(os.path.join(tier.staged_dir, cid.hex()), "wb") as f:
            f.write(codec.encode(raw, "none"))
    entries = [(cid, len(raw) + codec.HEADER, None) for cid, raw in chunks]
    before = tier._fs_sync.fsyncs
    tier.adopt(entries[:1], synced=False)
    assert tier._fs_sync.fsyncs == before + 1  # synced before its journal record
    tier.adopt(entries[1:2])
    assert tier._fs_sync.fsyncs == before + 1
    go = threading.Barrier(10)

    def one(e):
        go.wait()
        tier.adopt([e], synced=False)

    threads = [threading.Thread(target=one, args=(e,)) for e in entries[2:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    with open(tier.seg.path, "rb") as f:
        assert set(parse_segment(f.read()).pending) == {c for c, _ in chunks}
    assert before + 2 <= tier._fs_sync.fsyncs <= before + 11  # shared when they overlap


def test_concurrent_adopts_of_one_chunk_journal_and_count_it_once(agent):
    tier = agent.tier
    chunks = _chunks(agent.seed, 30, [200_000] * 4)
    for cid, raw in chunks:
        with open(os.path.join(tier.staged_dir, cid.hex()), "wb") as f:
            f.write(codec.encode(raw, "none"))
    entries = [(cid, len(raw) + codec.HEADER, None) for cid, raw in chunks]
    go = threading.Barrier(6)
    errors: list[BaseException] = []

    def one():
        go.wait()
        try:
            tier.adopt(entries)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    with open(tier.seg.path, "rb") as f:
        st = parse_segment(f.read())
    assert st.records == 4 and set(st.pending) == {c for c, _ in chunks}
    s = tier.stats()
    assert s["pending_chunks"] == 4 and s["pending_bytes"] == sum(n for _, n, _ in entries)
    assert s["to_upload_chunks"] == 4


def test_a_file_renamed_but_not_yet_adopted_is_neither_removed_nor_counted_twice(
    vol_path, agent, monkeypatch
):
    """The housekeeping pass (tidy) may run between a rank's rename and its adopt: a young
    file is left to its rank; an old one is taken, and the rank's adopt is then a no-op."""
    tier = agent.tier

    class TidyFirst(DirectLink):
        def adopt(self, entries, synced=True):
            self.tier.tidy()  # the agent's periodic pass, in the window
            self.tier.adopt(entries, synced=synced)

    rank, stager = _stager(vol_path, agent, TidyFirst(tier))
    try:
        chunks = _chunks(rank.seed, 40, [200_000, 300_000])
        for cid, raw in chunks[:1]:
            stager.put(cid, codec.encode(raw, "none"), sync=True)
        st = tier.stats()
        assert st["pending_chunks"] == 1 and st["pending_bytes"] == 200_000 + codec.HEADER
        assert _pending_records(tier.root) == {chunks[0][0]: 1}
        monkeypatch.setattr(recover, "RECONCILE_AGE_S", 0.0)  # every file counts as old
        for cid, raw in chunks[1:]:
            stager.put(cid, codec.encode(raw, "none"), sync=True)
        st = tier.stats()
        assert st["pending_chunks"] == 2
        assert st["pending_bytes"] == 500_000 + 2 * codec.HEADER
        assert _staged(tier.root) == {c.hex() for c, _ in chunks}
        tier.flush(timeout=60)
        for cid, raw in chunks:
            assert tier.store.get(cid) == raw
    finally:
        rank.close()


def test_a_volume_writes_and_reads_through_the_stager(vol_path, agent):
    """The client's writers and readers (sink, FileWriter, FileReader) on a HostStager."""
    rank, _ = _stager(vol_path, agent)
    try:
        datas = [_data(3 * MiB + 777 * i, 50 + i) for i in range(3)]
        for i, d in enumerate(datas):
            rank.write_file(f"/f{i}", d)
        assert rank.stats()["staged_chunks"] > 0
        assert rank.read_file("/f1") == datas[1]
        rank.tier.flush(timeout=60)
        assert rank.stats()["staged_chunks"] == 0  # the agent's on_durable marked them
        agent.tier.cache.evict(10**12)
        assert rank.read_file("/f2") == datas[2]
        assert rank.tier.fetches > 0
    finally:
        rank.close()
    with Volume.open(vol_path) as plain:
        for i, d in enumerate(datas):
            assert plain.read_file(f"/f{i}") == d


def test_a_full_staging_holds_the_ranks_back_and_fails_them_when_nothing_drains(
    vol_path, tmp_path, caplog
):
    """adopt waits for room as the tier's own writers do: ENOSPC only when nothing drains
    for stall_timeout (nodes down); with the nodes back, saves go through again."""
    from bench.throttle import throttle_volume

    agent = Volume.open(vol_path)
    nodes = throttle_volume(agent)
    agent.attach_tier(str(tmp_path / "staging"), size=3 * MiB, stall_timeout=1.0)
    rank = Volume.open(vol_path)
    rank.tier = HostStager(rank.store, agent.tier.root, DirectLink(agent.tier), size=3 * MiB)
    try:
        nodes.down = True
        with pytest.raises(OSError) as ei:
            rank.write_file("/x", _data(8 * MiB, 3))
        assert ei.value.errno == errno.ENOSPC and "nothing drained" in caplog.text
        nodes.down = False
        agent.tier.flush(timeout=60)
        data = _data(8 * MiB, 4)
        rank.write_file("/y", data)  # waits for the uploads to make room, then goes on
        agent.tier.flush(timeout=60)
        assert agent.tier.stats()["writer_waits"] > 0
        assert rank.read_file("/y") == data
    finally:
        rank.close()
        agent.close()


# -- real processes: an agent process, rank processes killed -------------------------------

AGENT = r"""
import json, sys
from fusefs.client.volume import Volume
vol = Volume.open(sys.argv[1])
tier = vol.attach_tier(sys.argv[2], size=256 * 2**20, idle_s=600)
print("ready", flush=True)
for line in sys.stdin:
    op, arg = json.loads(line)
    try:
        if op == "adopt":
            tier.adopt([(bytes.fromhex(c), n, w) for c, n, w in arg], synced=False)
        elif op == "fetch":
            tier.fill_cache([bytes.fromhex(c) for c in arg])
        else:
            tier.flush(timeout=arg)
        out = ["ok", ""]
    except Exception as e:
        out = [type(e).__name__, str(e)]
    print(json.dumps(out), flush=True)
"""


class PipeLink:
    """AgentLink to the AGENT process above, one JSON line each way per call."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lock = threading.Lock()

    def _call(self, op: str, arg) -> None:
        with self.lock:
            self.proc.stdin.write(json.dumps([op, arg]) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise ConnectionError("agent gone")
        kind, msg = json.loads(line)
        if kind == "ChunkUnavailable":
            raise ChunkUnavailable(msg)
        if kind == "TimeoutError":
            raise TimeoutError(msg)
        if kind != "ok":
            raise RuntimeError(f"agent: {kind}: {msg}")

    def adopt(self, entries, synced=True):
        self._call("adopt", [(c.hex(), n, w) for c, n, w in entries])

    def fetch(self, ids):
        self._call("fetch", [c.hex() for c in ids])

    def flush(self, timeout):
        self._call("flush", timeout)


def _agent_process(vol_path: str, staging: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", AGENT, vol_path, staging],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_env(),
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_an_agent_process_then_its_kill_after_adopt_loses_nothing(vol_path, tmp_path):
    """A rank (this process) and an agent (another): saves, a drain, reads fetched by the
    agent; then the agent is killed -9 after acknowledging a save: the next tier to open
    the directory adopts its journal and uploads that save."""
    staging = str(tmp_path / "staging")
    proc = _agent_process(vol_path, staging)
    rank = Volume.open(vol_path)
    try:
        rank.tier = HostStager(rank.store, staging, PipeLink(proc))
        first, second = _data(5 * MiB, 1), _data(4 * MiB + 1234, 2)
        rank.write_file("/first", first)
        rank.tier.flush(timeout=60)  # uploaded by the agent process
        assert rank.stats()["staged_chunks"] == 0
        for name in os.listdir(os.path.join(staging, "cache")):
            os.unlink(os.path.join(staging, "cache", name))
        assert rank.read_file("/first") == first  # fetched into cache/ by the agent
        assert rank.tier.fetches > 0 and rank.tier.direct_reads == 0
        rank.write_file("/second", second)  # acknowledged by the agent's journal
        assert rank.stats()["staged_chunks"] > 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        rank.close()
    pending = _pending_records(staging)
    assert pending, "the killed agent's journal should name the second save's chunks"
    with Volume.open(vol_path) as vol:
        tier = vol.attach_tier(staging, size=256 * MiB)
        assert tier.stats()["pending_chunks"] == len(pending)  # its journal was adopted
        tier.flush(timeout=60)
        assert vol.stats()["staged_chunks"] == 0
    with Volume.open(vol_path) as plain:
        assert plain.read_file("/second") == second
        assert plain.read_file("/first") == first


RANK = r"""
import sys, time
from chunkstore import codec
from chunkstore.ids import chunk_id
from chunkstore.tier.stager import HostStager
from fusefs.client.volume import Volume

class Stuck:
    def adopt(self, entries, synced=True):
        print("adopting", flush=True)
        time.sleep(600)
    def fetch(self, ids):
        raise ConnectionError("no agent")
    def flush(self, timeout):
        pass

vol = Volume.open(sys.argv[1])
stager = HostStager(vol.store, sys.argv[2], Stuck())
for s in range(3):
    raw = bytes([s + 1]) * 300_000
    stager.put(chunk_id(raw, vol.seed), codec.encode(raw, "none"), sync=False)
if sys.argv[3] == "written":
    print("written", flush=True)
    time.sleep(600)
stager.sync_staged()
"""


def _rank_killed_at(vol_path: str, staging: str, point: str) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", RANK, vol_path, staging, point],
        stdout=subprocess.PIPE,
        env=_env(),
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == ("written" if point == "written" else "adopting")
    finally:
        p.kill()
        p.wait(10)


def test_a_rank_killed_after_writing_leaves_temp_files_the_agent_removes(
    vol_path, agent, monkeypatch
):
    staging = agent.tier.root
    _rank_killed_at(vol_path, staging, "written")
    tmp = [n for n in os.listdir(os.path.join(staging, "tmp")) if n[0] == "s"]
    assert len(tmp) == 3 and not _staged(staging)
    agent.tier.tidy()  # a dead pid's temp files younger than the grace: left for now
    assert len([n for n in os.listdir(os.path.join(staging, "tmp")) if n[0] == "s"]) == 3
    monkeypatch.setattr(recover, "RECONCILE_AGE_S", 0.0)
    agent.tier.tidy()
    assert not [n for n in os.listdir(os.path.join(staging, "tmp")) if n[0] == "s"]
    assert _pending_records(staging) == {} and agent.tier.stats()["pending_chunks"] == 0


def test_a_rank_killed_between_rename_and_adopt_leaves_a_file_the_agent_adopts(
    vol_path, tmp_path, monkeypatch
):
    """Nothing was acknowledged; the staged files are whole (fsync'd before the rename):
    the agent's periodic pass takes them once they are older than its grace."""
    monkeypatch.setattr(recover, "RECONCILE_AGE_S", 1.0)
    monkeypatch.setattr(tiermod, "RECONCILE_AGE_S", 1.0)
    with Volume.open(vol_path) as vol:
        tier = vol.attach_tier(str(tmp_path / "staging"), size=256 * MiB, idle_s=600)
        _rank_killed_at(vol_path, tier.root, "renamed")
        assert len(_staged(tier.root)) == 3 and _pending_records(tier.root) == {}
        assert tier.stats()["pending_chunks"] == 0
        _wait(lambda: tier.stats()["pending_chunks"] == 3, 30, "the housekeeping's tidy")
        tier.flush(timeout=60)
        for s in range(3):
            raw = bytes([s + 1]) * 300_000
            assert vol.store.get(chunk_id(raw, vol.seed)) == raw
        assert not _staged(tier.root)


def test_a_read_asks_the_agent_once_for_all_the_chunks_its_host_lacks(vol_path, agent):
    """read_whole of a file whose chunks left the host (uploaded, evicted): one fetch of
    them all, then each read from the host cache; with the agent failing, one try and the
    rank reads the nodes itself (no fetch per chunk)."""
    from fusefs.client.batch import read_whole

    rank, stager = _stager(vol_path, agent)
    try:
        data = _data(4 * MiB + 300_000, 70)  # five chunks, none small enough to be inline
        rank.write_file("/f", data)
        stager.flush(timeout=60)
        agent.tier.cache.evict(10**12)
        extents = rank.meta.get_extents(rank.resolve("/f").ino)
        assert len(extents) == 5
        link = stager.link
        before = stager.fetches
        assert bytes(read_whole(rank, extents, len(data))) == data
        assert stager.fetches == before + 1  # one request for the five
        assert sorted(link.fetched[-5:]) == sorted(e.chunk_id for e in extents)
        assert bytes(read_whole(rank, extents, len(data))) == data  # now local: no request
        assert stager.fetches == before + 1

        class Gone(DirectLink):
            def fetch(self, ids):
                self.fetched += ids
                raise ConnectionError("agent gone")

        stager.link = gone = Gone(agent.tier)
        agent.tier.cache.evict(10**12)
        assert bytes(read_whole(rank, extents, len(data))) == data
        assert len(gone.fetched) == 5 and stager.direct_reads == 5  # asked once, then nodes
    finally:
        rank.close()
