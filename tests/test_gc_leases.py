"""gc against writers in flight (audit 3.1): a file open past the grace period while gc
runs keeps its data readable after its commit, or its commit fails with a clear error;
never an unreadable committed file. See metadata/sql/leases.py."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time

import pytest

from fusefs.client.volume import Volume
from fusefs.maint.gc import gc
from metadata.engine import DURABLE, ROOT_INO, Extent, MetaError, NewChunk

CHUNK = 64 * 1024


def _open_and_store(vol, data: bytes):
    """A writer whose chunks are on the nodes, unsynced then synced, but not committed."""
    w = vol.open_write("/job/f.bin", inline=False)
    w.write(data)
    w.flush_data()
    return w


def test_a_writer_open_past_the_grace_period_keeps_its_chunks(make_volume):
    vol = make_volume(nodes=2, replicas=1, chunk_size=CHUNK)
    data = os.urandom(4 * CHUNK + 17)
    w = _open_and_store(vol, data)
    time.sleep(1.2)  # every object is older than the grace period now
    rep = gc(vol, grace=0.5, progress=False)
    assert rep.objects_deleted == 0, rep
    w.close()
    assert vol.read_file("/job/f.bin") == data


def test_renewed_leases_outlive_their_ttl(make_volume):
    vol = make_volume(nodes=2, replicas=1, chunk_size=CHUNK)
    vol.meta.lease_ttl_s = 0.6
    vol.sink.renew_every = 0.1
    data = os.urandom(3 * CHUNK)
    w = _open_and_store(vol, data)
    time.sleep(1.5)  # past the TTL twice over: only renewals keep the leases
    assert gc(vol, grace=0.5, progress=False).objects_deleted == 0
    w.close()
    assert vol.read_file("/job/f.bin") == data


def test_a_commit_naming_chunks_gc_deleted_is_refused(make_volume):
    vol = make_volume(nodes=2, replicas=1, chunk_size=CHUNK)
    vol.meta.lease_ttl_s = 0.3
    vol.sink.renew_every = 3600.0  # a writer that stopped renewing (stuck, suspended)
    data = os.urandom(3 * CHUNK)
    w = _open_and_store(vol, data)
    time.sleep(1.2)
    assert gc(vol, grace=0.5, progress=False).objects_deleted > 0
    with pytest.raises(MetaError, match="lease") as e:
        w.close()
    assert "\n" not in str(e.value)
    assert vol.resolve("/job/f.bin").size == 0  # nothing committed: nothing unreadable
    # written again, the same content is stored again and reads back
    vol.meta.lease_ttl_s = 600.0
    vol.write_file("/job/f.bin", data, inline=False)
    assert vol.read_file("/job/f.bin") == data


# -- the protocol on both engines (issue 38: refuse only what gc condemned) ---------------
@pytest.fixture(params=["sqlite", "postgres"])
def meta(request, tmp_path):
    db = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    v = Volume.create(str(tmp_path / "vol"), nodes=2, db=db)
    yield v.meta
    v.close()


def _cid(tag: bytes) -> bytes:
    return tag.ljust(16, b".")[:16]


def _rank(tag: str, cids: list[bytes]) -> list[dict]:
    ext = [Extent(i * 4, 4, cid) for i, cid in enumerate(cids)]
    return [{"path": f"{tag}/f", "size": 4 * len(cids), "extents": ext,
             "new_chunks": [NewChunk(cid, 4, 4, DURABLE) for cid in cids]}]  # fmt: skip


def _file(meta, name: str) -> int:
    return meta.create(ROOT_INO, name.encode(), stat.S_IFREG | 0o644, 0, 0).ino


def test_ranks_that_store_the_same_new_chunks_all_commit(meta):
    """Ranks in separate processes store identical new content in one step (LayerNorm
    weights of ones, zero biases): each asked, each was leased, each commits. The first
    commit only journals its chunks; the second was refused when commits ended leases."""
    shared, own = _cid(b"ones"), [_cid(b"r%d" % r) for r in range(3)]
    for r in range(3):
        assert meta.missing_chunks([shared, own[r]]) == {shared, own[r]}
    meta.begin("job", 1, 3)
    for r in range(2):
        res = meta.commit_rank("job", 1, r, _rank(f"rank{r}", [shared, own[r]]))
        assert res["state"] == "open"
    # a group of the last rank with a duplicate of the first (its retry) publishes
    out = meta.commit_group(
        [("job", 1, 2, _rank("rank2", [shared, own[2]]), ""),
         ("job", 1, 0, _rank("rank0", [shared, own[0]]), "")]
    )  # fmt: skip
    assert all(isinstance(o, dict) for o in out), out
    assert out[0]["state"] == "published"
    meta.apply_pending()  # the journalled registrations become rows
    assert not meta.missing_chunks([shared, *own])


def test_a_lease_that_lapsed_without_gc_still_commits(meta):
    """A lapsed lease that gc did not condemn left the object where it was."""
    meta.lease_ttl_s = 0.2
    cid = _cid(b"slow-writer")
    assert meta.missing_chunks([cid]) == {cid}
    time.sleep(0.4)
    assert meta.renew_chunk_leases([cid]) == set()  # renewed: nothing condemned it
    time.sleep(0.4)
    ino = _file(meta, "f")
    meta.commit_file(ino, [Extent(0, 4, cid)], 4, [NewChunk(cid, 4, 4, DURABLE)])
    assert meta.get_extents(ino)[0].chunk_id == cid


def test_gc_condemns_only_unleased_and_commits_on_doomed_chunks_are_refused(meta):
    """gc dooms what has no row and no live lease; a lease granted inside gc's hold keeps
    the doom (the put may race the delete: its commit is refused, in one line); after the
    release a new grant clears it and the content commits again."""
    leased, orphan = _cid(b"leased"), _cid(b"orphan")
    assert meta.missing_chunks([leased]) == {leased}
    assert meta.gc_orphan_objects([leased, orphan], 60.0) == {orphan}
    assert meta.missing_chunks([orphan]) == {orphan}  # granted inside the hold
    assert meta.renew_chunk_leases([orphan, leased]) == {orphan}  # lost, said at renewal
    ino = _file(meta, "f")
    with pytest.raises(MetaError, match="condemned by gc") as e:
        meta.commit_file(ino, [Extent(0, 4, orphan)], 4, [NewChunk(orphan, 4, 4, DURABLE)])
    assert e.value.errno == errno.EIO and "\n" not in str(e.value)
    assert meta.getattr(ino).size == 0  # nothing committed
    meta.begin("job", 1, 1)
    with pytest.raises(MetaError, match="condemned by gc"):
        meta.commit_rank("job", 1, 0, _rank("r0", [orphan]))
    # the leased chunk commits beside the doom
    meta.commit_file(ino, [Extent(0, 4, leased)], 4, [NewChunk(leased, 4, 4, DURABLE)])
    meta.gc_release_objects([orphan])  # gc deleted it
    assert meta.missing_chunks([orphan]) == {orphan}  # this writer's put comes after
    meta.commit_rank("job", 1, 0, _rank("r0", [orphan]))
    meta.apply_pending()
    assert not meta.missing_chunks([orphan])
    assert meta.gc_orphan_objects([orphan, leased], 60.0) == set()  # rows now


def test_condemned_rows_of_an_older_volume_stay_condemned(tmp_path):
    """Before leases were packed, a lease was a chunk_leases row per id (expires > 0 live,
    <= 0 condemned or lapsed): an older volume opened by this version keeps refusing
    commits on the condemned and keeps the live leases, and the old table goes."""
    path = str(tmp_path / "vol")
    vol = Volume.create(path, nodes=2)
    cid = _cid(b"old-doom")
    live = _cid(b"old-lease")
    with vol.meta._tx() as c:
        c.execute("DROP TABLE chunk_doomed")
        c.execute("DROP TABLE lease_grants")
        c.execute("CREATE TABLE chunk_leases (id BLOB PRIMARY KEY, expires INTEGER NOT NULL)")
        c.executemany(
            "INSERT INTO chunk_leases (id, expires) VALUES (?, ?)",
            [(cid, -(time.time_ns() + 60 * 10**9)), (live, time.time_ns() + 600 * 10**9)],
        )
    vol.close()
    vol = Volume.open(path)
    try:
        ino = _file(vol.meta, "f")
        with pytest.raises(MetaError, match="condemned by gc"):
            vol.meta.commit_file(ino, [Extent(0, 4, cid)], 4, [NewChunk(cid, 4, 4, DURABLE)])
        # a live lease of the old table still keeps gc off its object
        assert vol.meta.gc_orphan_objects([live], 60.0) == set()
        with vol.meta._read() as c:
            assert (
                c.execute("SELECT 1 FROM sqlite_master WHERE name = 'chunk_leases'").fetchone()
                is None
            )
    finally:
        vol.close()


def test_gc_racing_small_file_commits_through_a_mount_never_deletes_their_chunks(
    new_volume, mount_factory
):
    """The mount's small-file close (one block, committed in one call) goes through the
    sink like every writer: a new chunk too big to go inline (16-64 KiB) is asked for
    first, which leases it, before it is stored and committed. It used to be stored
    unasked: gc, running with no grace period in another process, condemned and deleted
    objects between their store and their commit, whose close then failed (or its file
    was unreadable). durability=remote: the chunk is on the nodes from its store on."""
    mounted = mount_factory(new_volume(), "mnt", "--durability", "remote")
    payload = bytearray(os.urandom(40 * 1024))  # > INLINE_DATA_MAX: an object on the nodes
    stop = time.monotonic() + 60.0
    done = threading.Event()
    rounds: list[int] = []
    errors: list[str] = []

    def collect() -> None:
        with Volume.open(mounted.volume) as v:
            for node in v.store.nodes:  # with no grace period it would take the temp
                node.sweep_tmp = lambda cutoff: (0, 0)  # files of puts in progress
            while not done.is_set() and time.monotonic() < stop:
                rep = gc(v, grace=0.0, progress=False)
                rounds.append(rep.objects_deleted)
                errors.extend(rep.errors)

    t = threading.Thread(target=collect)
    t.start()
    failed: list[str] = []
    try:
        for i in range(300):
            if time.monotonic() > stop:
                break
            payload[:8] = i.to_bytes(8, "little")
            try:
                with open(mounted.path(f"s{i:03d}"), "wb") as f:
                    f.write(payload)
            except OSError as e:
                failed.append(f"s{i:03d}: {e}")
    finally:
        done.set()
        t.join(90)
    assert not t.is_alive()
    assert len(rounds) >= 5, rounds  # gc did race the writes
    assert not failed, failed[:5]
    assert not errors, errors[:5]
    assert sum(rounds) == 0, rounds  # every object it saw was leased or registered
    for i in range(300):
        payload[:8] = i.to_bytes(8, "little")
        with open(mounted.path(f"s{i:03d}"), "rb") as f:
            assert f.read() == payload, i
