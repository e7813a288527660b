"""The chunk sink (fusefs.client.sink) decides, once for every writer, what happens to a
chunk: inline, staged raw in a local tier, or encoded onto the nodes; acknowledged in one
batch before the commit; unacknowledged bytes bounded. These tests hold each rule against
a real volume (directory nodes, a real tier) through the writers that use it."""

from __future__ import annotations

import os

import pytest

from chunkstore import codec
from fusefs.client.sink import UNSYNCED_MAX
from fusefs.client.volume import Volume, VolumeSettings
from metadata.engine import DURABLE, INLINE, STAGED

MiB = 2**20


@pytest.fixture
def vol(tmp_path):
    v = Volume.create(
        str(tmp_path / "vol"), nodes=3, settings=VolumeSettings(chunk_size=1 * MiB, replicas=2)
    )
    yield v
    v.close()


def _staged_codec(v: Volume, cid: bytes) -> str:
    with open(os.path.join(v.tier.staged_dir, cid.hex()), "rb") as f:
        return codec.header_info(f.read(codec.HEADER))[1]


def test_local_tier_stages_raw_and_acknowledges_before_the_commit(vol, tmp_path):
    vol.attach_tier(str(tmp_path / "staging"), durability="local")
    data = bytes(3 * MiB)  # compressible: staged raw all the same, compressed at upload
    syncs = []
    real = vol.tier.sync_staged
    vol.tier.sync_staged = lambda: syncs.append(1) or real()
    with vol.open_write("/z") as w:
        w.write(data)
    recs = list(w.new_chunks.values())
    assert recs and all(r.state == STAGED for r in recs)
    assert all(_staged_codec(vol, r.chunk_id) == "none" for r in recs)
    assert not any(vol.sink.is_unsynced(r.chunk_id) for r in recs)
    assert syncs == [1]  # one batch of fsyncs for the whole file
    assert vol.read_file("/z") == data


def test_without_a_tier_chunks_are_encoded_and_synced_once(vol):
    calls = []
    real = vol.store.sync
    vol.store.sync = lambda: calls.append(1) or real()
    data = bytes(2 * MiB) + os.urandom(MiB)
    with vol.open_write("/f") as w:
        w.write(data)
    recs = {r.chunk_id: r for r in w.new_chunks.values()}
    zero = next(r for r in recs.values() if r.raw_len == MiB and r.stored_len < MiB // 10)
    assert zero.state == DURABLE  # the zeros compressed on the way to the nodes
    assert calls == [1]
    assert vol.read_file("/f") == data


def test_small_chunks_go_inline_only_into_file_commits(vol):
    with vol.open_write("/small") as w:
        w.write(b"tiny")
    (rec,) = w.new_chunks.values()
    assert rec.state == INLINE and rec.data == b"tiny"
    stream = vol.sink.stream(inline=False)  # a checkpoint rank's file: no inline chunks
    stream.add([b"tin", b"y!"], 5)
    stream.finish()
    vol.sink.sync()
    (rec,) = stream.new_chunks.values()
    assert rec.state == DURABLE and rec.data == b""
    assert stream.record("r")["extents"][0].length == 5


def test_unacknowledged_bytes_stay_under_the_cap(vol, tmp_path):
    """A long write syncs as it goes: a quarter of a small staging budget here."""
    vol.attach_tier(str(tmp_path / "staging"), size=16 * MiB, durability="local")
    cap = vol.sink.unsynced_cap
    assert cap == 4 * MiB < UNSYNCED_MAX
    peak = []
    real_put = vol.tier.put

    def put(cid, blob, **kw):
        out = real_put(cid, blob, **kw)
        peak.append(vol.sink._unsynced_bytes + vol.sink._reserved)  # this put counted
        return out

    vol.tier.put = put
    data = os.urandom(12 * MiB)
    with vol.open_write("/long") as w:
        w.write(data)
    assert len(peak) == 12
    assert max(peak) <= cap  # never more unacknowledged than the cap, with 8 workers
    assert vol.read_file("/long") == data


def test_the_mount_path_dedups_against_a_file_writer(vol):
    """hash_and_store (the mount's per-block call) finds a chunk a FileWriter stored."""
    block = os.urandom(MiB)
    vol.write_file("/a", block)
    cid, rec = vol.sink.hash_and_store([block[:100], block[100:]], MiB)
    assert rec is None
    (e,) = vol.meta.get_extents(vol.resolve("/a").ino)
    assert e.chunk_id == cid


def test_a_failed_store_fails_the_close_and_commits_nothing(vol):
    def broken(*a, **kw):
        raise OSError(5, "disk on fire")

    vol.store.put_encoded = broken
    w = vol.open_write("/bad")
    w.write(os.urandom(2 * MiB))
    with pytest.raises(OSError, match="disk on fire"):
        w.close()
    assert vol.resolve("/bad").size == 0


def test_a_batch_of_files_is_one_pass_with_the_records_a_file_writer_makes(vol, tmp_path):
    """fusefs.client.batch: many files staged in one pass (one existence query, one sync)
    give the extents and new-chunk records FileWriter gives for the same bytes; a chunk
    two files share is new in both commits' records but stored once; commit_rank takes
    the records and the files read back whole through read_many."""
    from fusefs.client.batch import read_many, stage_files
    from metadata.sql.checkpoints import unpack_extents

    vol.attach_tier(str(tmp_path / "staging"), durability="local")
    rng = __import__("random").Random(7)
    shared = rng.randbytes(MiB)
    files = [[rng.randbytes(MiB), shared, rng.randbytes(300_000)] for _ in range(3)]
    asked, synced = [], []
    real_missing, real_sync = vol.meta.missing_chunks, vol.tier.sync_staged
    vol.meta.missing_chunks = lambda ids: asked.append(len(ids)) or real_missing(ids)
    vol.tier.sync_staged = lambda: synced.append(1) or real_sync()
    timings: dict[str, float] = {}
    staged = stage_files(vol, files, timings)
    assert asked == [7] and synced == [1]  # 3 x 2 own chunks + the shared one, asked once
    assert {"chunk", "hash", "exist", "store", "sync"} <= set(timings)
    with vol.open_write("/ref") as w:  # the one write path, for comparison
        for buf in files[0]:
            w.write(buf)
            w.cut()
    assert [e.chunk_id for e in staged[0].extents] == [e.chunk_id for e in w.extents]
    assert staged[0].size == w.size == 2 * MiB + 300_000
    shared_id = staged[0].extents[1].chunk_id
    assert all(f.extents[1].chunk_id == shared_id for f in staged)
    for f in staged:
        assert shared_id in {c.chunk_id for c in f.new_chunks}
    assert (
        sum(f.stored for f in staged)
        == sum(c.stored_len for f in staged for c in f.new_chunks if c.chunk_id != shared_id)
        + staged[0].new_chunks[1].stored_len
    )  # the shared chunk is stored (counted) once
    vol.meta.begin("job", 1, 3, deadline_s=60)
    for rank, f in enumerate(staged):
        vol.meta.commit_rank("job", 1, rank, [f.record(f"r{rank}")], host="h")
    assert vol.meta.step_state("job", 1)["state"] == "published"
    man = vol.meta.manifest("job", 1)["files"]
    got = read_many(
        vol,
        [(unpack_extents(m["extents"]), m["size"]) for m in man],
        lambda i, buf: bytes(buf),
    )
    assert got == [b"".join(f) for f in files]
    # a second batch of the same bytes stores nothing new
    again = stage_files(vol, files[:1])
    assert again[0].new_chunks == [] and again[0].stored == 0


def test_read_many_reads_what_is_in_memory_on_its_own_thread(vol, tmp_path):
    """read_many reads files whose chunks are all in the page cache on the calling thread
    (no GIL hand-offs for warm loads), and from the first one that is not, hands the rest
    to the pool's workers: the same bytes either way."""
    import threading

    from bench.common import evict
    from fusefs.client.batch import read_many, stage_files

    vol.attach_tier(str(tmp_path / "staging"), durability="local")
    rng = __import__("random").Random(3)
    files = [[rng.randbytes(3 * MiB + 1000)] for _ in range(8)]
    staged = stage_files(vol, files)
    want = [b"".join(f) for f in files]
    me = threading.get_ident()

    def read() -> list[tuple[bytes, int]]:
        return read_many(vol, [(f.extents, f.size) for f in staged],
                         lambda i, buf: (bytes(buf), threading.get_ident()))  # fmt: skip

    got = read()  # big chunks are staged with O_DIRECT: not in memory until read once
    assert [b for b, _ in got] == want and me not in {t for _, t in got}
    got = read()
    assert [b for b, _ in got] == want and {t for _, t in got} == {me}
    # files 5..7 leave memory (the kernel's refusal simulated: a refused RWF_NOWAIT read
    # starts the read-ahead, which may finish before the check): 0..4 stay on this thread
    cold = {e.chunk_id for f in staged[5:] for e in f.extents}
    real = vol.read_chunk_into

    def probe(cid, views, *, nowait=False):
        if nowait and cid in cold:
            raise BlockingIOError(11, "not in memory")
        return real(cid, views, nowait=nowait)

    vol.read_chunk_into = probe
    got = read()
    assert [b for b, _ in got] == want
    assert {t for _, t in got[:5]} == {me} and me not in {t for _, t in got[5:]}
    vol.read_chunk_into = real
    for f in staged:  # the real kernel, every page evicted: the same bytes
        for e in f.extents:
            evict(os.path.join(vol.tier.staged_dir, e.chunk_id.hex()))
    assert [b for b, _ in read()] == want


def test_one_existence_policy_for_every_writer(vol, tmp_path):
    """ChunkSink.plan is the one "which exist?" rule: a batch's distinct ids are asked in one
    query, less the ids its writer already stores and less chunks that go inline; a FileWriter's
    stream, the mount's per-block call and stage_files all ask through it."""
    from fusefs.client.batch import stage_files

    asked: list[list[bytes]] = []
    real = vol.meta.missing_chunks

    def missing_chunks(ids):
        asked.append(list(ids))
        return real(ids)

    vol.meta.missing_chunks = missing_chunks
    a, b = os.urandom(MiB), os.urandom(MiB)
    stream = vol.sink.stream(inline=True, batch=4)
    for piece in (a, b, a, b"tiny"):  # one batch: a twice, an inline-sized chunk
        stream.add([piece], len(piece))
    stream.add([a], MiB)  # the next batch: a is this writer's already
    stream.finish()
    assert [len(q) for q in asked] == [2]  # a and b, once each; nothing for the rest
    assert sorted(r.state == INLINE for r in stream.new_chunks.values()) == [False, False, True]
    assert vol.sink.dedup_hits == 2  # a repeated twice within the stream
    asked.clear()
    assert vol.sink.hash_and_store([b"tiny"], 4)[1].state == INLINE  # inline: not asked
    assert asked == []
    assert vol.sink.hash_and_store([b[:10], b[10:]], MiB)[1] is not None  # b: not committed
    assert len(asked) == 1
    asked.clear()
    c = os.urandom(3 * MiB)
    staged = stage_files(vol, [[c], [c], [b"x" * 100]])  # one pass: one query, small asked too
    assert [len(q) for q in asked] == [4]  # c's three chunks and the small one, once
    assert [len(f.new_chunks) for f in staged] == [3, 3, 1]
    assert staged[0].stored > 0 and staged[1].stored == 0
