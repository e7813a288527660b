"""The engine contract on SQLite and on a real PostgreSQL; two services on one database."""

from __future__ import annotations

import errno
import os
import stat
import time

import pytest

from chunkstore.store import ChunkUnavailable
from fusefs.client.volume import Volume
from metadata.client import connect
from metadata.engine import ROOT_INO, Extent, MetaError, NewChunk


@pytest.fixture(params=["sqlite", "postgres"])
def vol(request, tmp_path):
    db = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    v = Volume.create(str(tmp_path / "vol"), nodes=2, db=db)
    yield v
    v.close()


BIG_BATCH = 16  # ranks: a group commit of many, checked together


def _cid(tag: bytes) -> bytes:
    return tag.ljust(16, b".")[:16]


def test_inode_numbers_are_never_reused(vol):
    """A freed number, even the highest, is never handed out again (the kernel would take
    the new inode for the old one), and a directory replaced by a rename takes its xattrs
    with it."""
    m = vol.meta
    a = m.create(ROOT_INO, b"a", stat.S_IFDIR | 0o755, 0, 0)
    b = m.create(ROOT_INO, b"b", stat.S_IFDIR | 0o755, 0, 0)
    m.set_xattr(b.ino, b"user.k", b"v")
    m.rename(ROOT_INO, b"a", ROOT_INO, b"b")  # the highest inode (b) is replaced
    f = m.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
    g = m.create(ROOT_INO, b"g", stat.S_IFDIR | 0o755, 0, 0)
    m.rmdir(ROOT_INO, b"g")  # the highest inode is removed
    h = m.create(ROOT_INO, b"h", stat.S_IFDIR | 0o755, 0, 0)
    seen = [a.ino, b.ino, f.ino, g.ino, h.ino]
    assert seen == sorted(set(seen)), f"an inode number came back: {seen}"
    assert m.list_xattr(f.ino) == [] and m.list_xattr(h.ino) == []
    assert m.list_xattr(b.ino) == [], "the replaced directory's xattrs stayed behind"


def test_connections_reserve_inode_numbers_apart(vol, tmp_path):
    """Each connection takes creates' numbers from a block it reserved; a block whose
    reservation was rolled back is dropped, never handed out beside another's."""
    others = [Volume.open(str(tmp_path / "vol")) for _ in range(2)]
    try:
        m1, m2, m3 = vol.meta, others[0].meta, others[1].meta
        inos = [m1.create(ROOT_INO, b"a", stat.S_IFREG | 0o644, 0, 0).ino]
        with pytest.raises(RuntimeError), m2._tx():
            m2.create(ROOT_INO, b"gone", stat.S_IFREG | 0o644, 0, 0)
            raise RuntimeError("roll the reservation back")
        with pytest.raises(MetaError):
            m2.lookup(ROOT_INO, b"gone")
        inos.append(m3.create(ROOT_INO, b"c", stat.S_IFREG | 0o644, 0, 0).ino)
        for i in range(3):
            for k, m in enumerate((m1, m2, m3)):
                inos.append(m.create(ROOT_INO, b"f%d%d" % (k, i), stat.S_IFDIR | 0o755, 0, 0).ino)
        assert len(set(inos)) == len(inos), inos
        names = {e.name for e in m1.readdir(ROOT_INO, 0)}
        assert b"gone" not in names and len(names) == len(inos)
    finally:
        for v in others:
            v.close()


def test_namespace_data_and_refcounts(vol):
    m = vol.meta
    d = m.create(ROOT_INO, b"dir", stat.S_IFDIR | 0o755, 0, 0)
    f = m.create(d.ino, b"f", stat.S_IFREG | 0o644, 0, 0)
    with pytest.raises(MetaError) as e:
        m.create(d.ino, b"f", stat.S_IFREG | 0o644, 0, 0)
    assert e.value.errno == errno.EEXIST
    a, b = _cid(b"a"), _cid(b"b")
    m.commit_file(
        f.ino, [Extent(0, 10, a), Extent(10, 5, b)], 15, [NewChunk(a, 10, 8), NewChunk(b, 5, 5)]
    )
    assert m.get_extents(f.ino) == [Extent(0, 10, a), Extent(10, 5, b)]
    assert m.chunk_info([a, b]) == {a: (10, 8, 1, 1), b: (5, 5, 1, 1)}
    assert m.missing_chunks([a, _cid(b"z")]) == {_cid(b"z")}
    m.setattr(f.ino, size=4)
    assert m.get_extents(f.ino) == [Extent(0, 4, a)]
    assert m.chunk_info([b])[b][2] == 0
    with pytest.raises(MetaError) as e:
        m.commit_file(f.ino, [Extent(0, 1, _cid(b"unknown"))], 1, [])
    assert e.value.errno == errno.EIO
    m.set_xattr(f.ino, b"user.k", b"v")
    assert m.get_xattr(f.ino, b"user.k") == b"v"
    m.rename(d.ino, b"f", ROOT_INO, b"g")
    assert [e.name for e in m.readdir(ROOT_INO, 0)] == [b"dir", b"g"]
    gone = m.unlink(ROOT_INO, b"g")
    assert gone.nlink == 0
    m.forget_orphan(gone.ino)
    assert m.chunk_info([a])[a][2] == 0
    st = m.stats()
    assert st.files == 0 and st.inodes == 2
    vol.write_file("/x/y.bin", b"hello" * 1000)
    assert vol.read_file("/x/y.bin") == b"hello" * 1000


def test_checkpoint_flow(vol):
    m = vol.meta
    m.begin("job", 1, 3)
    for r in range(3):
        cid = _cid(b"c%d" % r)
        files = [{"path": f"sub/r{r}", "size": 7, "extents": [Extent(0, 7, cid)],
                  "new_chunks": [NewChunk(cid, 7, 7)]}]  # fmt: skip
        assert not vol.exists("job/step-000001")
        res = m.commit_rank("job", 1, r, files, host="h")
        assert m.commit_rank("job", 1, r, files, host="h")["duplicate"] is True
    assert res["state"] == "published"
    assert sorted(n for n, _ in vol.listdir("job/step-000001/sub")) == [b"r0", b"r1", b"r2"]
    assert m.latest("job") == 1 and m.latest_durable("job") == 1
    assert len(m.manifest("job", 1)["files"]) == 3
    m.begin("job", 2, 2)
    m.abort("job", 2)
    assert m.step_state("job", 2)["state"] == "aborted"
    assert [c["state"] for c in m.list_checkpoints("job")] == ["published", "aborted"]
    assert m.checkpoint_info("job", 1)["committed"] == 3


def test_two_services_on_one_postgres_share_namespace_and_checkpoints(
    tmp_path, pg_url, meta_server
):
    Volume.create(str(tmp_path / "vol"), nodes=2, db=pg_url).close()
    s1 = meta_server(tmp_path / "vol", db=pg_url)
    s2 = meta_server(tmp_path / "vol", db=pg_url)
    c1, c2 = connect(s1.url), connect(s2.url)
    v1, v2 = Volume(c1, c1.get_config()), Volume(c2, c2.get_config())
    v1.write_file("/shared/a.txt", b"from service one")
    assert v2.read_file("/shared/a.txt") == b"from service one"
    c1.begin("j", 5, 2)
    assert c2.begin("j", 5, 2)["state"] == "open"  # idempotent across services
    for r, c in ((0, c1), (1, c2)):
        cid = _cid(b"s%d" % r)
        c.commit_rank("j", 5, r, [{"path": f"r{r}", "size": 3, "extents": [Extent(0, 3, cid)],
                                   "new_chunks": [NewChunk(cid, 3, 3)]}])  # fmt: skip
    # service one learns of a publish done by service two through the database
    assert c1.wait_published("j", 5, 10)["state"] == "published"
    assert c1.latest("j") == c2.latest("j") == 5
    assert sorted(n for n, _ in v1.listdir("j/step-000005")) == [b"r0", b"r1"]
    v1.close()
    v2.close()


def _files(tag: str, cids: list[bytes], new: list[bytes], state: int = 1) -> list[dict]:
    ext = [Extent(i * 4, 4, cid) for i, cid in enumerate(cids)]
    return [{"path": f"{tag}/f", "size": 4 * len(cids), "extents": ext,
             "new_chunks": [NewChunk(cid, 4, 4, state) for cid in new]}]  # fmt: skip


def test_pending_refs_never_let_gc_or_fsck_lose_a_chunk(vol):
    """Checkpoint commits leave their chunk references in a journal; every reader of chunk
    rows (gc, fsck, chunk_info, mark_durable, truncate) sees them as if applied."""
    m = vol.meta
    old = _cid(b"old")
    f = m.create(ROOT_INO, b"tmp", stat.S_IFREG | 0o644, 0, 0)
    m.commit_file(f.ino, [Extent(0, 4, old)], 4, [NewChunk(old, 4, 4)])
    m.setattr(f.ino, size=0)  # `old` is now unreferenced, a gc candidate
    assert m.chunk_info([old])[old][2] == 0
    a, b = _cid(b"new-a"), _cid(b"new-b")
    m.begin("j", 1, 2)
    m.commit_rank("j", 1, 0, _files("r0", [a, old, a], [a]))
    m.commit_rank("j", 1, 1, _files("r1", [b], [b], state=0))
    assert m.pending_refs() == 2  # nothing applied on the commit path
    assert m.missing_chunks([a]) == {a}  # journal-only: "missing" costs a duplicate upload
    # gc applies pending references first, in its own transaction: nothing used goes
    assert m.gc_chunk_rows(0) == []
    assert m.pending_refs() == 0
    info = m.chunk_info([a, b, old])
    assert (info[a][2], info[b][2], info[old][2]) == (2, 1, 1)
    rows = m.chunk_rows()
    assert all(rows[cid].refcount == n for cid, n in m.true_refcounts().items())
    # a staged chunk only in the journal can be marked durable (its row is made first)
    m.begin("j", 2, 1)
    c = _cid(b"staged")
    m.commit_rank("j", 2, 0, _files("s", [c], [c], state=0))
    assert m.pending_refs() == 1
    m.mark_durable([c])
    assert m.chunk_info([c])[c][3] == 1 and m.latest_durable("j") == 2
    # truncating a published file whose references are still journalled drops them
    m.begin("j", 3, 1)
    d = _cid(b"trunc")
    m.commit_rank("j", 3, 0, _files("t", [d], [d]))
    assert m.pending_refs() == 1
    ino = vol.resolve("j/step-000003/t/f").ino
    m.setattr(ino, size=0)
    assert m.chunk_info([d])[d][2] == 0
    assert m.get_extents(ino) == []


def test_abort_drops_pending_refs_and_takes_back_applied_ones(vol):
    m = vol.meta
    m.begin("j", 1, 3)
    e, f = _cid(b"abort-e"), _cid(b"abort-f")
    m.commit_rank("j", 1, 0, _files("r0", [e], [e]))
    assert m.chunk_info([e])[e][2] == 1  # rank 0's references applied (chunk_info settles)
    m.commit_rank("j", 1, 1, _files("r1", [f], [f]))  # ... rank 1's still journalled
    assert m.pending_refs() == 1
    m.abort("j", 1)
    assert m.pending_refs() == 0
    assert m.chunk_info([e])[e][2] == 0  # taken back
    assert f not in m.chunk_info([f])  # never registered: gc removes its object later
    assert m.true_refcounts().get(e, 0) == 0


def test_group_commit_isolates_conflicting_ranks(vol):
    """One bulk transaction for the batch; a conflict redoes it rank by rank."""
    m = vol.meta
    m.begin("g", 1, 4)
    ids = [_cid(b"g%d" % r) for r in range(4)]

    def one(path: str, cid: bytes) -> list[dict]:
        return [{"path": path, "size": 4, "extents": [Extent(0, 4, cid)],
                 "new_chunks": [NewChunk(cid, 4, 4)]}]  # fmt: skip

    out = m.commit_group(
        [
            ("g", 1, 0, one("a/x", ids[0]), "h"),
            ("g", 1, 1, one("a/x", ids[1]), "h"),  # same path as rank 0
            ("g", 1, 2, one("a", ids[2]), "h"),  # a file where rank 0 has a directory
            ("g", 1, 3, one("b/y", ids[3]), "h"),
            ("g", 1, 3, one("b/y", ids[3]), "h"),  # the same rank twice: a duplicate
            ("g", 1, 9, one("c", ids[3]), "h"),  # out of range
        ]
    )
    assert out[0]["state"] == "open" and out[3]["duplicate"] is False
    assert out[4]["duplicate"] is True
    assert isinstance(out[1], MetaError) and out[1].errno == errno.EEXIST
    assert isinstance(out[2], MetaError) and out[2].errno in (errno.EEXIST, errno.ENOTDIR)
    assert isinstance(out[5], MetaError) and out[5].errno == errno.EINVAL
    assert m.step_state("g", 1)["committed"] == 2
    m.apply_pending()
    info = m.chunk_info(ids)
    assert set(info) == {ids[0], ids[3]}  # the refused ranks registered nothing
    m.commit_rank("g", 1, 1, one("a/z", ids[1]))
    res = m.commit_rank("g", 1, 2, one("d", ids[2]))
    assert res["state"] == "published"
    man = m.manifest("g", 1)
    assert sorted(f["path"] for f in man["files"]) == ["a/x", "a/z", "b/y", "d"]


def _spoilt(cids: list[bytes], how: str = "") -> tuple[int, bytes, bytes]:
    """(size, packed extents, packed new chunks) of a file made of `cids`, 10 bytes each,
    spoilt as `how` says ("" leaves it good)."""
    from metadata.sql.checkpoints import CHK, EXT

    ext = [(10 * i, 10, 0, cid) for i, cid in enumerate(cids)]
    chk = [(cid, 10, 5, 1) for cid in cids]
    size = 10 * len(cids)
    last = len(cids) - 1
    if how == "overlap":
        ext[1] = (5, 10, 0, cids[1])
    elif how == "backwards":
        ext = ext[::-1]
    elif how == "past_end":
        size -= 5
    elif how == "zero_len":
        ext[last] = (10 * last, 0, 0, cids[last])
    elif how == "bad_state":
        chk[0] = (cids[0], 10, 5, 7)
    elif how == "zero_chunk":
        chk[1] = (cids[1], 0, 5, 1)
    elif how == "zero_stored":
        chk[1] = (cids[1], 10, 0, 1)
    elif how == "huge_chunk":
        chk[1] = (cids[1], 2**40, 5, 1)
    elif how == "unknown":  # references a chunk nobody registered
        chk[last] = (_cid(b"declared-not-used"), 10, 5, 1)
    elif how == "known":  # references the first rank's chunk without declaring it: fine
        ext[last] = (10 * last, 10, 0, _cid(b"v0-0"))
    return size, b"".join(EXT.pack(*e) for e in ext), b"".join(CHK.pack(*c) for c in chk)


def test_vectorized_batch_checks_refuse_exactly_the_bad_ranks(vol):
    """A big group commit checks extents and chunk records for all ranks at once; each bad
    rank gets the same error as alone, and the good ones commit."""
    m = vol.meta
    n = BIG_BATCH + 8
    m.begin("v", 1, n)

    def rank(r: int, how: str = "") -> list[dict]:
        size, ext, chk = _spoilt([_cid(b"v%d-%d" % (r, i)) for i in range(3)], how)
        return [{"path": f"r{r}", "size": size, "extents": ext, "new_chunks": chk}]

    m.commit_rank("v", 1, 0, rank(0))
    m.apply_pending()
    bad = {3: "overlap", 5: "past_end", 8: "zero_len", 13: "bad_state", 17: "zero_chunk"}
    how = {**bad, 19: "unknown", 21: "known"}
    out = m.commit_group([("v", 1, r, rank(r, how.get(r, "")), "h") for r in range(1, n)])
    assert isinstance(out[18], MetaError) and out[18].errno == errno.EIO
    for r, res in enumerate(out, start=1):
        if r == 19:
            continue
        if r in bad:
            assert isinstance(res, MetaError) and res.errno == errno.EINVAL, (r, res)
            with pytest.raises(MetaError) as alone:
                m.commit_rank("v", 1, r, rank(r, bad[r]))
            assert str(alone.value) == str(res)
        else:
            assert isinstance(res, dict) and res["state"] == "open", (r, res)
    info = m.checkpoint_info("v", 1)
    assert info["committed"] == n - len(bad) - 1
    assert info["new_bytes"] == 30 * (n - len(bad) - 1)


def test_column_checks_refuse_each_bad_rank_alone(vol):
    """The column path (typed files) must not let any bad rank through: a batch with one
    bad rank of each kind gives that rank the error it gets alone and commits the rest;
    a batch with a rank of no files stays on the column path."""
    from metadata.ckptcheck import prepare_commits
    from metadata.sql.checkpoints import WireFile

    m = vol.meta
    n = BIG_BATCH + 4

    def rank(step: int, r: int, how: str = "") -> list:
        if how == "empty":
            return []
        size, ext, chk = _spoilt([_cid(b"t%d-%d-%d" % (step, r, i)) for i in range(2)], how)
        return [WireFile(f"d{r}/f", size, ext, chk)]

    kinds = ["overlap", "backwards", "past_end", "zero_len", "bad_state", "zero_stored",
             "huge_chunk"]  # fmt: skip
    for step, how in enumerate(kinds, start=1):
        m.begin("t", step, n)
        out = m.commit_group([("t", step, r, rank(step, r, how if r == 5 else ""), "h")
                              for r in range(n - 1)])  # fmt: skip
        for r, res in enumerate(out):
            if r == 5:
                assert isinstance(res, MetaError) and res.errno == errno.EINVAL, (how, res)
                with pytest.raises(MetaError) as alone:
                    m.commit_rank("t", step, 5, rank(step, 5, how))
                assert str(alone.value) == str(res), how
            else:
                assert isinstance(res, dict) and res["state"] == "open", (how, r, res)
    items = [("t", 99, r, rank(99, r, "empty" if r % 3 == 0 else ""), "h") for r in range(n)]
    out, todo = prepare_commits(items)  # ranks with no files are commits like any other
    assert out == [None] * n
    for t in todo:
        out, (alone,) = m.prepare_commits([items[t[0]]])[:2]
        assert t[:8] == (t[0], *alone[1:8]), t[0]
        assert (*t[9][:3], *t[9][4:]) == (*alone[9][:3], *alone[9][4:]), t[0]


def test_grouped_journal_rows_apply_and_abort_per_rank(vol):
    """A group commit journals up to JOURNAL_GROUP ranks per row, and a rank whose extents
    are exactly its new chunks only once (`owned`). Applied, every refcount is the true
    one; an abort drops the rows still pending and takes back what was applied."""
    from metadata.sql.checkpoints import JOURNAL_GROUP

    m = vol.meta
    n = max(BIG_BATCH, JOURNAL_GROUP) + 5

    def rank(step: int, r: int) -> list[dict]:
        ids = [_cid(b"q%d-%d-%d" % (step, r, i)) for i in range(2)]
        return _files(f"r{r}", ids, ids)

    m.begin("q", 1, n)
    m.commit_rank("q", 1, 0, _files("r0", [_cid(b"q0")], [_cid(b"q0")]))  # not closed
    out = m.commit_group([("q", 1, r, rank(1, r), "h") for r in range(1, n)])
    assert all(o["state"] for o in out[:-1]) and out[-1]["state"] == "published"
    assert m.pending_refs() == 1 + -(-(n - 1) // JOURNAL_GROUP)
    m.apply_pending()
    rows = m.chunk_rows()
    true = m.true_refcounts()
    assert len(true) == 1 + 2 * (n - 1)
    assert all(rows[cid].refcount == k == 1 for cid, k in true.items())
    # abort: the grouped rows applied, a later row still pending
    m.begin("q", 2, n + 2)
    m.commit_group([("q", 2, r, rank(2, r), "h") for r in range(n)])
    first = _cid(b"q2-0-0")
    assert m.chunk_info([first])[first][2] == 1  # chunk_info applied everything
    m.commit_group([("q", 2, n, rank(2, n), "h")])
    assert m.pending_refs() == 1
    m.abort("q", 2)
    assert m.pending_refs() == 0
    assert m.chunk_info([first])[first][2] == 0  # taken back
    last = _cid(b"q2-%d-0" % n)
    assert last not in m.chunk_info([last])  # never registered
    # abort with grouped rows pending: none of their ranks' chunks is ever registered
    m.begin("q", 3, n + 1)
    m.commit_group([("q", 3, r, rank(3, r), "h") for r in range(n)])
    assert m.pending_refs() == -(-n // JOURNAL_GROUP)
    m.abort("q", 3)
    ids = [_cid(b"q3-%d-%d" % (r, i)) for r in range(n) for i in range(2)]
    assert m.pending_refs() == 0 and m.chunk_info(ids) == {}
    rows = m.chunk_rows()
    assert all(rows[cid].refcount == k for cid, k in m.true_refcounts().items())


def test_batch_path_checks_refuse_exactly_the_bad_ranks(vol):
    """A big group commit checks all its paths at once; a batch with a bad one is checked
    again path by path, so each bad rank gets the error it gets alone."""
    m = vol.meta
    n = BIG_BATCH + 8
    bad = {1: "../x", 3: "/abs", 5: "a//b", 7: "a/./b", 9: "a/", 11: "", 13: "a\0b",
           15: "x" * 300, 17: "a/" + "n" * 256, 19: "a/..", 21: b"./a"}  # fmt: skip
    m.begin("p", 1, n)

    def files(r: int, path: str | bytes) -> list[dict]:
        cid = _cid(b"p%d" % r)
        return [{"path": path, "size": 4, "extents": [Extent(0, 4, cid)],
                 "new_chunks": [NewChunk(cid, 4, 4)]}]  # fmt: skip

    good = m.commit_group([("p", 1, r, files(r, f"d{r}/f"), "h") for r in range(n) if r not in bad])
    assert all(isinstance(g, dict) for g in good)
    m.begin("p", 2, n)
    out = m.commit_group([("p", 2, r, files(r, bad.get(r, f"d{r}/f")), "h") for r in range(n)])
    for r, res in enumerate(out):
        if r in bad:
            assert isinstance(res, MetaError), (r, res)
            with pytest.raises(MetaError) as alone:
                m.commit_rank("p", 3 + r, 0, files(r, bad[r])) if m.begin("p", 3 + r, 1) else None
            assert str(alone.value) == str(res) and alone.value.errno == res.errno
        else:
            assert isinstance(res, dict) and res["state"] == "open", (r, res)


def test_typed_wire_commits_get_the_errors_of_dict_commits(vol):
    """The service decodes a well-typed commit_rank into WireFiles (protocol.parse_commit)
    and checks a big batch of them on a fast path; every rank must get exactly what the
    same files as dicts get: the good ones commit, each bad one its own error."""
    from metadata.sql.checkpoints import CHK, EXT, WireFile
    from metadata.wire.protocol import encode, parse_commit

    m = vol.meta
    n = BIG_BATCH + 8

    def rank(r: int, how: str = "") -> list[dict]:
        cid = _cid(b"w%d" % r)
        f = {"path": f"d{r}/f", "size": 8, "extents": EXT.pack(0, 8, 0, cid),
             "new_chunks": CHK.pack(cid, 8, 8, 1)}  # fmt: skip
        if how == "dup":
            return [f, dict(f)]
        if how == "huge":
            f["size"] = 2**62
        elif how == "ragged":
            f["extents"] += b"x"
        elif how == "escape":
            f["path"] = "../x"
        elif how == "past_end":
            f["size"] = 4
        elif how == "surrogate":
            f["path"] = "a\udcff/\ud800"
        return [f]

    bad = {2: "dup", 5: "huge", 7: "ragged", 11: "escape", 13: "past_end", 17: "surrogate"}

    def wire(step: int, r: int) -> tuple:
        files = rank(r, bad.get(r, ""))
        if bad.get(r) == "surrogate":  # cannot travel as a msgpack str; built in-process
            return ("w", step, r, [WireFile(**f) for f in files], "h")
        frame = encode([r + 1, "commit_rank", ["w", step, r, files], {"host": "h"}, None])
        req = parse_commit(frame)
        assert req is not None and all(type(f) is WireFile for f in req[2][3])
        return (*req[2], req[3]["host"])

    m.begin("w", 1, n)
    typed = m.commit_group([wire(1, r) for r in range(n)])
    m.begin("w", 2, n)
    plain = m.commit_group([("w", 2, r, rank(r, bad.get(r, "")), "h") for r in range(n)])
    for r, (a, b) in enumerate(zip(typed, plain, strict=True)):
        if r in bad:
            assert isinstance(a, MetaError) and isinstance(b, MetaError), (r, a, b)
            assert (a.errno, str(a)) == (b.errno, str(b)), r
        else:
            assert isinstance(a, dict) and a["state"] == "open", (r, a)
    assert m.checkpoint_info("w", 1)["committed"] == n - len(bad)
    m.begin("w", 3, n)  # an all-good typed batch: the fast path end to end
    bad.clear()
    done = m.commit_group([wire(3, r) for r in range(n)])
    assert [d["state"] for d in done] == ["published"] * n  # one answer per batch
    assert sorted(f["path"] for f in m.manifest("w", 3)["files"]) == sorted(
        f"d{r}/f" for r in range(n)
    )


def test_column_checks_match_the_rank_by_rank_checks(tmp_path):
    """A big batch of typed commits is validated column by column; each rank must come out
    exactly as it does checked alone: same digest (a retry is recognised either way),
    files in path order, sizes, new bytes, journal blobs and directories."""
    from metadata.ckptcheck import prepare_commits
    from metadata.sql.checkpoints import CHK, EXT, WireFile

    v = Volume.create(str(tmp_path / "vol"), nodes=2)

    def rank(r: int) -> list:
        files = []
        for f in range(1 + r % 4):
            cids = [_cid(b"c%d-%d-%d" % (r, f, i)) for i in range(1 + (r + f) % 3)]
            ext = [EXT.pack(i * 10, 10, 0, c) for i, c in enumerate(cids)]
            if r % 5 == 1:  # refers to another rank's chunk: not self-contained
                ext.append(EXT.pack(len(cids) * 10, 10, 0, _cid(b"c0-0-0")))
            path = [f"r{r}/f{f}", f"f{f}", f"r{r}/d/e/f{f}"][r % 3]
            chk = b"".join(CHK.pack(c, 10, 7, 1) for c in cids)
            files.append(WireFile(path, 10 * len(ext) + r, b"".join(ext), chk))
        return files[::-1] if r % 2 else files  # some ranks send them out of order

    n = BIG_BATCH + 24
    items = [("j", 1, r, rank(r), f"h{r}") for r in range(n)]
    out, cols = prepare_commits(items)
    assert out == [None] * n and len(cols) == n
    for r, t in enumerate(cols):
        out, (alone,) = v.meta.prepare_commits([items[r]])[:2]
        assert out == [None]
        assert t[:8] == (r, *alone[1:8]), r  # index, job, step, rank, files, host, digest, bytes
        assert t[8] == (r % 5 != 1), r  # self-contained
        size, paths, chunks, exts, dirs, alloc = t[9]
        assert (size, paths, chunks, dirs, alloc) == (*alone[9][:3], *alone[9][4:]), r
        assert exts == (b"" if t[8] else alone[9][3]), r
        assert alloc == [10 * (len(f[3]) // EXT.size) for f in t[4]], r  # holes excluded
        assert [f[0] for f in t[4]] == sorted(f[0] for f in t[4])
    v.close()


def test_inline_sqlite_connection_never_waits_nor_applies_the_journal(tmp_path):
    """The mount's inline connection (`SqliteEngine(inline=True)`) refuses at once, with
    nothing done, what would make its event loop wait: another writer's lock, or a change
    that would first apply the checkpoint reference journal. Inode numbers stay unique
    across a reopen."""
    import sqlite3
    import time

    from metadata.engines.sqlite import SqliteEngine

    path = str(tmp_path / "vol")
    v = Volume.create(path, nodes=2)
    m = v.meta
    f = m.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
    a = _cid(b"a")
    m.commit_file(f.ino, [Extent(0, 4, a)], 4, [NewChunk(a, 4, 4)])
    m.begin("job", 1, 1)
    m.commit_rank("job", 1, 0, _files("r0", [_cid(b"j")], [_cid(b"j")]), host="h")
    inline = SqliteEngine(m.path, inline=True)
    with pytest.raises(sqlite3.OperationalError):  # drops a's reference: journal first
        inline.commit_file(f.ino, [], 0, [])
    assert m.get_extents(f.ino) == [Extent(0, 4, a)]
    other = sqlite3.connect(m.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    t0 = time.monotonic()
    with pytest.raises(sqlite3.OperationalError):
        inline.create(ROOT_INO, b"g", stat.S_IFREG | 0o644, 0, 0)
    assert time.monotonic() - t0 < 0.5
    other.execute("ROLLBACK")
    other.close()
    d = inline.create(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
    inline.rmdir(ROOT_INO, b"d")  # the highest number is freed...
    inline.close()
    v.close()
    with Volume.open(path) as v2:  # ...and not handed out again after a reopen
        assert v2.meta.create(ROOT_INO, b"e", stat.S_IFDIR | 0o755, 0, 0).ino > d.ino


def test_metadata_checks_inline_ids_as_the_data_plane_makes_them():
    """metadata.engine computes chunk ids itself (metadata and chunkstore do not import
    each other): it must agree with chunkstore.ids, or every inline chunk is refused."""
    from chunkstore.ids import chunk_id
    from metadata.engine import inline_chunk_id

    for data, seed in ((b"", 0), (b"x", 1), (os.urandom(16384), 2**63 - 1)):
        assert inline_chunk_id(data, seed) == chunk_id(data, seed)


def test_special_files_keep_type_and_device_number(vol):
    """FIFOs, sockets and device nodes are inodes without data; a device node keeps its
    number, other types none; a type no file can have is refused and nothing is made."""
    m = vol.meta
    fifo = m.create(ROOT_INO, b"fifo", stat.S_IFIFO | 0o640, 0, 0, rdev=7)
    dev = m.create(ROOT_INO, b"dev", stat.S_IFBLK | 0o600, 0, 0, rdev=os.makedev(8, 1))
    sock = m.create(ROOT_INO, b"sock", stat.S_IFSOCK | 0o755, 0, 0)
    assert (stat.S_IFMT(fifo.mode), fifo.rdev, fifo.size) == (stat.S_IFIFO, 0, 0)
    assert m.getattr(dev.ino).rdev == os.makedev(8, 1)
    assert stat.S_ISSOCK(m.getattr(sock.ino).mode)
    for mode, rdev in ((0o170000, 0), (stat.S_IFCHR, -1)):
        with pytest.raises(MetaError) as e:
            m.create(ROOT_INO, b"bad", mode | 0o600, 0, 0, rdev=rdev)
        assert e.value.errno == errno.EINVAL
    assert sorted(d.name for d in m.readdir(ROOT_INO, 0)) == [b"dev", b"fifo", b"sock"]


def test_blocks_count_stored_bytes_not_holes(vol):
    """st_blocks (Attr.blocks) counts the bytes a file's extents cover: a sparse file's
    holes take none, whether written by a file commit, cut by a truncate, grown by one,
    or committed by a checkpoint rank."""
    from metadata.sql.checkpoints import CHK, EXT

    m = vol.meta
    f = m.create(ROOT_INO, b"sparse", stat.S_IFREG | 0o644, 0, 0)
    assert (f.alloc, f.blocks) == (0, 0)
    a, b = _cid(b"blk-a"), _cid(b"blk-b")
    g = 2**30
    m.commit_file(f.ino, [Extent(0, 4096, a), Extent(g, 1000, b)], g + 1000,
                  [NewChunk(a, 4096, 10), NewChunk(b, 1000, 10)])  # fmt: skip
    assert (m.getattr(f.ino).alloc, m.getattr(f.ino).blocks) == (5096, 10)
    assert m.setattr(f.ino, size=2**40).blocks == 10  # a huge truncate up: all hole
    assert m.setattr(f.ino, size=100).alloc == 100  # cut inside the first extent
    d = m.create(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
    assert d.alloc == -1 and d.blocks == 0  # not kept for directories: from the size
    m.begin("blk", 1, 1)
    c = _cid(b"blk-c")
    m.commit_rank("blk", 1, 0, [{"path": "holey", "size": 3 * g,
                                 "extents": EXT.pack(g, 512, 0, c),
                                 "new_chunks": CHK.pack(c, 512, 10, 1)}])  # fmt: skip
    root = m.lookup(ROOT_INO, b"blk")
    step = m.lookup(root.ino, m.readdir(root.ino, 0)[0].name)
    holey = m.lookup(step.ino, b"holey")
    assert (holey.size, holey.alloc, holey.blocks) == (3 * g, 512, 1)


def _made_older(v: Volume, ddl: str) -> str:
    """Close `v` and undo a schema change in its SQLite database, as a volume made before
    it; returns the database path."""
    import sqlite3

    path = v.meta.path
    v.close()
    db = sqlite3.connect(path)
    db.execute(ddl)
    db.commit()
    db.close()
    return path


def test_an_older_volume_gets_the_alloc_column_at_open(tmp_path):
    """A volume made before inodes.alloc: opening it adds the column; its files report
    st_blocks from their size until they are written again."""
    from metadata.engines.sqlite import SqliteEngine

    v = Volume.create(str(tmp_path / "vol"), nodes=2)
    f = v.meta.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
    v.meta.setattr(f.ino, size=10_000)
    path = _made_older(v, "ALTER TABLE inodes DROP COLUMN alloc")
    m = SqliteEngine(path)
    a = m.getattr(f.ino)
    assert (a.size, a.alloc, a.blocks) == (10_000, -1, 20)
    m.setattr(f.ino, size=0)
    assert m.getattr(f.ino).blocks == 0
    m.close()


def test_removed_directory_kept_until_forgotten(vol):
    """rmdir and rename-over with keep=True (the mount) leave the directory's inode, with
    no links, until forget_orphan; without keep it goes at once."""
    m = vol.meta
    a = m.create(ROOT_INO, b"a", stat.S_IFDIR | 0o755, 0, 0)
    sub = m.create(a.ino, b"sub", stat.S_IFDIR | 0o755, 0, 0)
    assert (m.parent(sub.ino), m.parent(a.ino), m.parent(ROOT_INO)) == (a.ino, ROOT_INO, ROOT_INO)
    m.rmdir(a.ino, b"sub")
    m.set_xattr(a.ino, b"user.k", b"v")
    gone = m.rmdir(ROOT_INO, b"a", keep=True)
    assert gone.is_dir and gone.nlink == 0 and m.getattr(a.ino).nlink == 0
    with pytest.raises(MetaError):
        m.parent(a.ino)  # no name any more
    # another mount's kernel may not know it is gone: nothing goes into it (it would be
    # lost with it), as Linux answers for a dead directory
    keep = m.create(ROOT_INO, b"keep", stat.S_IFREG | 0o644, 0, 0)
    for make in (
        lambda: m.create(a.ino, b"x", stat.S_IFREG | 0o644, 0, 0),
        lambda: m.create(a.ino, b"y", stat.S_IFDIR | 0o755, 0, 0),
        lambda: m.rename(ROOT_INO, b"keep", a.ino, b"keep"),
        lambda: m.link(keep.ino, a.ino, b"keep2"),
        lambda: m.readdir(a.ino, 0),
    ):
        with pytest.raises(MetaError) as e:
            make()
        assert e.value.errno == errno.ENOENT
    assert m.lookup(ROOT_INO, b"keep").ino == keep.ino
    with pytest.raises(MetaError):
        m.lookup(ROOT_INO, b"a")
    assert m.getattr(ROOT_INO).nlink == 2
    m.forget_orphan(a.ino)
    with pytest.raises(MetaError) as e:
        m.getattr(a.ino)
    assert e.value.errno == errno.ENOENT
    b = m.create(ROOT_INO, b"b", stat.S_IFDIR | 0o755, 0, 0)
    m.rmdir(ROOT_INO, b"b")
    with pytest.raises(MetaError):
        m.getattr(b.ino)
    src = m.create(ROOT_INO, b"src", stat.S_IFDIR | 0o755, 0, 0)
    dst = m.create(ROOT_INO, b"dst", stat.S_IFDIR | 0o755, 0, 0)
    replaced = m.rename(ROOT_INO, b"src", ROOT_INO, b"dst", keep=True)
    assert replaced.ino == dst.ino and replaced.nlink == 0
    assert m.lookup(ROOT_INO, b"dst").ino == src.ino
    assert m.purge_orphans() == 1


def test_inline_chunks_keep_their_bytes_in_the_metadata(vol):
    """A small chunk committed inline: its bytes come back from inline_data, it counts as
    stored and not as staged, a chunk row already there is kept, bad records change
    nothing, and gc drops the bytes with the row."""
    from chunkstore.ids import chunk_id
    from metadata.engine import DURABLE, INLINE, INLINE_DATA_MAX

    m = vol.meta
    f = m.create(ROOT_INO, b"small", stat.S_IFREG | 0o644, 0, 0)
    data = os.urandom(3000)
    cid = chunk_id(data, vol.seed)
    m.commit_file(f.ino, [Extent(0, 3000, cid)], 3000, [NewChunk.inline(cid, data)])
    assert m.chunk_info([cid]) == {cid: (3000, 3000, 1, INLINE)}
    assert m.inline_data([cid, _cid(b"none")]) == {cid: data}
    st = m.stats()
    assert (st.stored_bytes, st.staged_chunks) == (3000, 0)
    assert vol.read_file("/small") == data

    # the same bytes committed again (another file): one row, two references
    g = m.create(ROOT_INO, b"copy", stat.S_IFREG | 0o644, 0, 0)
    m.commit_file(g.ino, [Extent(0, 3000, cid)], 3000, [NewChunk.inline(cid, data)])
    assert m.chunk_info([cid])[cid][2] == 2

    # bad records: refused with EINVAL, nothing changed
    h = m.create(ROOT_INO, b"bad", stat.S_IFREG | 0o644, 0, 0)
    big = os.urandom(INLINE_DATA_MAX + 1)
    bad_records = [
        NewChunk.inline(chunk_id(big, vol.seed), big),  # over INLINE_DATA_MAX
        NewChunk(_cid(b"x"), 10, 10, INLINE, b"123"),  # bytes shorter than raw_len
        NewChunk(_cid(b"y"), 3, 3, DURABLE, b"123"),  # bytes on a chunk that is not inline
        NewChunk(_cid(b"z"), 3, 3, 7),  # no such state
    ]
    for rec in bad_records:
        with pytest.raises(MetaError) as e:
            m.commit_file(h.ino, [Extent(0, rec.raw_len, rec.chunk_id)], rec.raw_len, [rec])
        assert e.value.errno == errno.EINVAL
    assert m.getattr(h.ino).size == 0 and m.get_extents(h.ino) == []
    assert m.missing_chunks([r.chunk_id for r in bad_records]) == {r.chunk_id for r in bad_records}

    # gc: the bytes go with the last reference's row, not before
    m.unlink(ROOT_INO, b"small")
    m.forget_orphan(f.ino)
    assert m.gc_chunk_rows(0.0) == []
    assert m.inline_data([cid]) == {cid: data}
    m.unlink(ROOT_INO, b"copy")
    m.forget_orphan(g.ino)
    assert m.gc_chunk_rows(0.0) == [(cid, 3000)]
    assert m.inline_data([cid]) == {} and m.chunk_info([cid]) == {}


def test_inline_bytes_are_checked_and_kept_only_for_inline_rows(vol):
    """The metadata is an inline chunk's only copy, and a row keeps the first bytes it
    got: bytes that do not hash to their id, or records of the wrong types, are refused
    with nothing changed (they hid the chunk from every file naming it, fsck saw nothing).
    Content matching a chunk already on the nodes is a reference to it, with no second
    copy in the metadata; content only staged so far becomes inline; an inline row never
    turns durable."""
    from chunkstore.ids import chunk_id
    from metadata.engine import DURABLE, INLINE, STAGED

    m = vol.meta
    h = m.create(ROOT_INO, b"h", stat.S_IFREG | 0o644, 0, 0)
    data = os.urandom(100)
    cid = chunk_id(data, vol.seed)
    wrong = [
        NewChunk.inline(cid, os.urandom(100)),  # bytes that are not the id's
        NewChunk(cid, 3, 3, INLINE, "abc"),  # text, not bytes
        NewChunk(cid.hex()[:16], 100, 100, INLINE, data),  # an id that is text
        NewChunk(cid, "100", 100, INLINE, data),  # a length that is text
    ]
    for rec in wrong:
        with pytest.raises(MetaError) as e:
            m.commit_file(h.ino, [Extent(0, 100, cid)], 100, [rec])
        assert e.value.errno == errno.EINVAL
        with pytest.raises(MetaError) as e:
            m.register_chunk_rows([rec], {})
        assert e.value.errno == errno.EINVAL
    assert m.getattr(h.ino).size == 0 and m.missing_chunks([cid]) == {cid}
    assert m.inline_data([cid]) == {}

    # a chunk already on the nodes: the small file's record only adds a reference
    on_nodes = os.urandom(200)
    dcid = chunk_id(on_nodes, vol.seed)
    m.commit_file(h.ino, [Extent(0, 200, dcid)], 200, [NewChunk(dcid, 200, 200, DURABLE)])
    g = m.create(ROOT_INO, b"g", stat.S_IFREG | 0o644, 0, 0)
    m.commit_file(g.ino, [Extent(0, 200, dcid)], 200, [NewChunk.inline(dcid, on_nodes)])
    assert m.chunk_info([dcid]) == {dcid: (200, 200, 2, DURABLE)}
    assert m.inline_data([dcid]) == {}

    # content only staged so far (one host's tier): the bytes make it INLINE at once, so
    # this file does not depend on that host's tier (it was lost with the host's disk)
    staged = os.urandom(300)
    tcid = chunk_id(staged, vol.seed)
    t = m.create(ROOT_INO, b"t", stat.S_IFREG | 0o644, 0, 0)
    m.commit_file(t.ino, [Extent(0, 300, tcid)], 300, [NewChunk(tcid, 300, 332, STAGED)])
    u = m.create(ROOT_INO, b"u", stat.S_IFREG | 0o644, 0, 0)
    m.commit_file(u.ino, [Extent(0, 300, tcid)], 300, [NewChunk.inline(tcid, staged)])
    assert m.chunk_info([tcid]) == {tcid: (300, 300, 2, INLINE)}
    assert m.inline_data([tcid]) == {tcid: staged}

    # staged, then durable; an inline row stays inline whatever says it is durable
    s = m.create(ROOT_INO, b"s", stat.S_IFREG | 0o644, 0, 0)
    scid = _cid(b"staged")
    m.commit_file(s.ino, [Extent(0, 50, scid)], 50, [NewChunk(scid, 50, 50, STAGED)])
    i = m.create(ROOT_INO, b"i", stat.S_IFREG | 0o644, 0, 0)
    m.commit_file(i.ino, [Extent(0, 100, cid)], 100, [NewChunk.inline(cid, data)])
    m.mark_durable([scid, cid], [40, 60])
    assert m.chunk_info([scid, cid]) == {scid: (50, 40, 1, DURABLE), cid: (100, 100, 1, INLINE)}
    m.commit_file(g.ino, [Extent(0, 100, cid)], 100, [NewChunk(cid, 100, 100, DURABLE)])
    assert m.chunk_info([cid])[cid][3] == INLINE and m.inline_data([cid]) == {cid: data}


def test_a_bad_inline_copy_does_not_hide_the_chunk_on_the_nodes(vol):
    """A copy in `inline_data` beside a chunk on the nodes (as an earlier version kept for
    small files whose content was already stored) whose bytes went bad: readers of small
    extents asked the metadata first and failed on it, though two good replicas were on
    the nodes. They read the nodes instead. A bad copy of an inline chunk, which has no
    other, is an error that names the metadata."""
    from fusefs.client.volume import FileWriter
    from metadata.engine import INLINE

    data = os.urandom(3000)
    w = FileWriter(vol, 0, inline=False)  # stored on the nodes, as DCP ranks do
    w.write(data)
    w.close(commit=False)
    f = vol.meta.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
    vol.meta.commit_file(f.ino, w.extents, w.size, list(w.new_chunks.values()))
    (cid,) = w.new_chunks
    with vol.meta._tx() as c:  # the stray copy, damaged
        vol.meta._x(c, "INSERT INTO inline_data (id, data) VALUES (?, ?)", (cid, b"x" * 3000))
    assert vol.inline_chunks([cid]) == {}
    assert bytes(vol.fetch_chunk(cid, small=True)) == data
    assert vol.read_file("/f") == data

    g = vol.meta.create(ROOT_INO, b"g", stat.S_IFREG | 0o644, 0, 0)
    tiny = os.urandom(100)
    t = NewChunk.inline(vol.sink.ids([tiny])[0], tiny)
    vol.meta.commit_file(g.ino, [Extent(0, 100, t.chunk_id)], 100, [t])
    assert vol.meta.chunk_info([t.chunk_id])[t.chunk_id][3] == INLINE
    with vol.meta._tx() as c:
        vol.meta._x(c, "UPDATE inline_data SET data = ? WHERE id = ?", (b"y" * 100, t.chunk_id))
    with pytest.raises(ChunkUnavailable, match="inline chunk .* corrupt in the metadata"):
        vol.fetch_chunk(t.chunk_id, small=True)


def test_an_older_volume_gets_the_inline_table_at_open(vol):
    """A volume made before inline chunks: opening it makes the table, and a small file
    written then is stored inline."""
    with vol.meta._tx() as c:
        vol.meta._x(c, "DROP TABLE inline_data")
    v = Volume.open(vol.base_dir)
    try:
        v.write_file("/f", b"tiny")
        cid = v.meta.get_extents(v.resolve("/f").ino)[0].chunk_id
        assert v.meta.inline_data([cid]) == {cid: b"tiny"}
        assert v.read_file("/f") == b"tiny"
    finally:
        v.close()


def test_sync_makes_lazy_commits_durable(vol, monkeypatch):
    """A file commit is lazy on SQLite (the WAL is not fsync'd: it survives a killed
    process); sync(), which the mount's fsync calls, fsyncs the WAL, and the first time
    for a WAL file its directory too (SQLite syncs the directory of a WAL it made only at
    its own first sync of it). PostgreSQL commits are durable already: sync changes
    nothing there. Either way another connection sees the commit."""
    import metadata.engines.sqlite

    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(metadata.engines.sqlite.os, "fsync", spy)
    f = vol.meta.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
    vol.meta.commit_file(f.ino, [], 10, [])
    lazy = list(synced)
    vol.meta.sync()
    first = synced[len(lazy) :]
    vol.meta.commit_file(f.ino, [], 20, [])
    mark = len(synced)
    vol.meta.sync()
    again = synced[mark:]
    if vol.meta.__class__.__name__ == "SqliteEngine":
        wal = vol.meta.path + "-wal"
        assert wal not in lazy, lazy
        assert first == [wal, os.path.dirname(wal)]
        assert again == [wal]
    else:
        assert first == again == []
    other = Volume.open(vol.base_dir)
    try:
        assert other.meta.getattr(f.ino).size == 20
    finally:
        other.close()


def test_values_a_mount_reads_back_are_checked_before_they_are_stored(vol):
    """uid, gid and mode must be integers in [0, 2**32), a symlink target and an xattr
    value bytes: a client of the service stored `gid="x"` or `uid=2**40` as given, and
    every mount of the volume then failed stat of that inode (EIO) until someone edited
    the database by hand."""
    m = vol.meta
    f = m.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
    m.set_xattr(f.ino, b"user.a", b"1")
    before = (m.getattr(f.ino), m.readdir(ROOT_INO, 0), m.get_xattr(f.ino, b"user.a"))
    bad = [
        lambda: m.create(ROOT_INO, b"g", stat.S_IFREG | 0o644, -5, 0),
        lambda: m.create(ROOT_INO, b"g", stat.S_IFREG | 0o644, "root", 0),
        lambda: m.create(ROOT_INO, b"g", stat.S_IFREG | 0o644, 0, 2**40),
        lambda: m.create(ROOT_INO, b"g", (stat.S_IFREG | 0o644) + 2**40, 0, 0),
        lambda: m.create(ROOT_INO, b"g", stat.S_IFREG | 0o644, True, 0),
        lambda: m.create(ROOT_INO, b"l", stat.S_IFLNK | 0o777, 0, 0, target="text"),
        lambda: m.setattr(f.ino, gid="x"),
        lambda: m.setattr(f.ino, uid=-1),
        lambda: m.setattr(f.ino, mode=1.5),
        lambda: m.setattr(f.ino, mtime_ns="now"),
        lambda: m.setattr(f.ino, size="10"),
        lambda: m.set_xattr(f.ino, b"user.a", "text"),
        lambda: m.set_xattr(f.ino, "user.b", b"1"),
    ]
    for fn in bad:
        with pytest.raises(MetaError) as e:
            fn()
        assert e.value.errno == errno.EINVAL, fn
    assert (m.getattr(f.ino), m.readdir(ROOT_INO, 0), m.get_xattr(f.ino, b"user.a")) == before
    assert m.setattr(f.ino, uid=2**32 - 1, gid=7).uid == 2**32 - 1


def test_the_database_is_closed_to_other_users(tmp_path):
    """Small files' bytes live in the metadata, so a 0644 database let any local user read
    a 0600 file the mount refused them. New volumes make it (and its WAL) 0660 less the
    umask; an older one loses its bits for others when opened, and keeps its group's (a
    volume shared through a group still works for it). volume.json likewise (a PostgreSQL
    URL may hold a password)."""
    old_umask = os.umask(0o002)
    try:
        v = Volume.create(str(tmp_path / "vol"), nodes=2)
    finally:
        os.umask(old_umask)
    v.write_file("/secret", b"tiny secret")
    path = v.meta.path
    for p in (path, path + "-wal", os.path.join(str(tmp_path / "vol"), "volume.json")):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o660, p
    v.close()
    for p in (path, path + "-wal", path + "-shm"):
        if os.path.exists(p):
            os.chmod(p, 0o664)
    v = Volume.open(str(tmp_path / "vol"))
    try:
        assert v.read_file("/secret") == b"tiny secret"
        for p in (path, path + "-wal", path + "-shm"):
            if os.path.exists(p):
                assert stat.S_IMODE(os.stat(p).st_mode) == 0o660, p
    finally:
        v.close()


def test_a_reader_waiting_for_a_staged_chunk_gets_it_when_it_turns_inline(vol):
    """A reader waits while a chunk is only staged (another host's tier, not uploaded).
    A commit of the same small content elsewhere makes the row INLINE meanwhile: the
    reader gets the bytes from the metadata. It used to read the nodes once the state
    was no longer STAGED, which never get the chunk, and failed."""
    import threading

    from chunkstore.ids import chunk_id
    from metadata.engine import STAGED

    data = os.urandom(4096)
    cid = chunk_id(data, vol.seed)
    a = vol.meta.create(ROOT_INO, b"a", stat.S_IFREG | 0o644, 0, 0)
    vol.meta.commit_file(a.ino, [Extent(0, 4096, cid)], 4096, [NewChunk(cid, 4096, 4128, STAGED)])
    got: dict = {}

    def read(small: bool) -> None:
        try:
            got[small] = bytes(vol.fetch_chunk(cid, small=small))
        except Exception as e:  # noqa: BLE001 - reported below
            got[small] = e

    readers = [threading.Thread(target=read, args=(small,)) for small in (False, True)]
    for t in readers:
        t.start()
    time.sleep(0.5)
    b = vol.meta.create(ROOT_INO, b"b", stat.S_IFREG | 0o644, 0, 0)
    vol.meta.commit_file(b.ino, [Extent(0, 4096, cid)], 4096, [NewChunk.inline(cid, data)])
    for t in readers:
        t.join(30)
    assert got == {False: data, True: data}


def _oracle(files: list) -> tuple[list, int, bytes] | MetaError:
    """The commit checks as a plain per-file reading of the rules, in the order the
    files were sent (the rank-by-rank code the vectorized one replaced): (files in path
    order, new bytes, digest) or the first error."""
    import struct

    import xxhash

    from metadata.ckptcheck import check_int, split_rel
    from metadata.engine import DURABLE, chunk_lengths_ok
    from metadata.sql.checkpoints import CHK, EXT

    out, seen, new = [], set(), 0
    try:
        for f in files:
            p, size, blob, chk = f["path"], f["size"], f["extents"], f["new_chunks"]
            parts = split_rel(p)
            path = b"/".join(parts)
            if path in seen:
                raise MetaError(errno.EINVAL, f"file {path!r} listed twice")
            seen.add(path)
            size = check_int(size, "size")
            if not isinstance(blob, bytes | bytearray) or not isinstance(chk, bytes | bytearray):
                raise MetaError(errno.EINVAL, f"{path!r}: extents/new_chunks are not packed lists")
            blob, chk = bytes(blob), bytes(chk)
            if len(blob) % EXT.size or len(chk) % CHK.size:
                raise MetaError(errno.EINVAL, f"{path!r}: extents/new_chunks are not packed lists")
            end = 0
            for off, n, _, _ in EXT.iter_unpack(blob):
                if n <= 0 or off < end:
                    raise MetaError(errno.EINVAL, f"{path!r}: bad extent list at offset {off}")
                end = off + n
            if end > size:
                raise MetaError(errno.EINVAL, f"{path!r}: extents end at {end}, past size {size}")
            for _, raw, stored, st in CHK.iter_unpack(chk):
                if not chunk_lengths_ok(raw, stored) or st > DURABLE:
                    raise MetaError(errno.EINVAL, f"{path!r}: bad new chunk record")
                new += raw
            out.append((path, parts, size, blob, chk))
    except MetaError as e:
        return e
    out.sort(key=lambda r: r[0])
    head = struct.Struct("<QQQQ")
    h = xxhash.xxh3_128(
        b"".join(
            head.pack(len(r[0]), r[2], len(r[3]) // EXT.size, len(r[4]) // CHK.size) for r in out
        )  # fmt: skip
    )
    for col in (b"\0".join(r[0] for r in out), b"".join(r[3] for r in out),
                b"".join(r[4] for r in out)):  # fmt: skip
        h.update(col)
    return out, new, h.digest()


def test_commit_checks_agree_with_the_rules_read_file_by_file():
    """prepare_commits checks a batch column by column (numpy over every file's records);
    every rank must come out as a plain reading of the rules, file by file in the order
    sent, says: the same first error, or the same files, new bytes and digest. Random
    batches with faults of every kind, several per rank, values past 2**62 and 2**64."""
    import random

    from metadata.ckptcheck import prepare_commits
    from metadata.sql.checkpoints import CHK, EXT, WireFile

    rnd = random.Random(1234)
    big = [0, 1, 2**40, 2**62 - 1, 2**62, 2**63, 2**64 - 1]

    def blob_ext(faulty: bool) -> bytes:
        recs, off = [], rnd.choice([0, 0, 5])
        for _ in range(rnd.randint(0, 4)):
            n = rnd.choice([10, 10, 1]) if not faulty else rnd.choice([0, 10, *big])
            recs.append(EXT.pack(off, n, 0, _cid(b"%d" % rnd.randint(0, 5))))
            off = (off + n if not faulty else rnd.choice([off, off + n, off - 1, *big])) % 2**64
        return b"".join(recs)

    def blob_chk(faulty: bool) -> bytes:
        return b"".join(
            CHK.pack(_cid(b"%d" % rnd.randint(0, 5)),
                     rnd.choice([10, 4] if not faulty else [0, 10, 2**40, 2**64 - 1]),
                     rnd.choice([10, 4] if not faulty else [0, 7, 2**40]),
                     rnd.choice([0, 1] if not faulty else [0, 1, 2, 9]))
            for _ in range(rnd.randint(0, 3))
        )  # fmt: skip

    def one_file(faulty: bool) -> dict:
        f = {"path": rnd.choice(["a", "b", "d/c", "d/e/f", "z"]), "size": 100,
             "extents": blob_ext(faulty and rnd.random() < 0.5),
             "new_chunks": blob_chk(faulty and rnd.random() < 0.3)}  # fmt: skip
        if faulty and rnd.random() < 0.3:
            f["path"] = rnd.choice(["", "/abs", "a//b", "../x", "a/.", "x" * 300, "a\0b"])
        if faulty and rnd.random() < 0.2:
            f["size"] = rnd.choice([-1, 2**62, "7", None, True, 3.0, 0, 2**64])
        if faulty and rnd.random() < 0.1:
            f[rnd.choice(["extents", "new_chunks"])] = rnd.choice(["x", b"abc", bytearray(40)])
        if not faulty:
            end = max([o + n for o, n, _, _ in EXT.iter_unpack(f["extents"])], default=0)
            f["size"] = end + rnd.choice([0, 3])
        return f

    for _round in range(60):
        items, sent = [], []
        for r in range(rnd.randint(1, 24)):
            faulty = rnd.random() < 0.5
            files = [one_file(faulty) for _ in range(rnd.randint(0, 4))]
            if not faulty:  # distinct paths
                files = list({f["path"]: f for f in files}.values())
            typed = all(isinstance(f["extents"], bytes) and isinstance(f["new_chunks"], bytes)
                        and isinstance(f["path"], str) and type(f["size"]) is int
                        for f in files) and rnd.random() < 0.5  # fmt: skip
            items.append(("j", 1, r, [WireFile(**f) for f in files] if typed else files, "h"))
            sent.append(files)
        out, todo = prepare_commits(items)
        done = {t[0]: t for t in todo}
        for i, files in enumerate(sent):
            want = _oracle(files)
            if isinstance(want, MetaError):
                assert isinstance(out[i], MetaError) and i not in done, (i, files, want)
                assert (out[i].errno, str(out[i])) == (want.errno, str(want)), (i, files)
            else:
                assert out[i] is None, (i, files, out[i])
                t = done[i]
                assert [(r[0], list(r[1]), r[2]) for r in t[4]] == [r[:3] for r in want[0]]
                assert [bytes(r[3]) for r in t[4]] == [r[3] for r in want[0]]
                assert (t[7], t[6]) == (want[1], want[2]), (i, files)
                assert t[9][5] == [sum(n for _, n, _, _ in EXT.iter_unpack(r[3]))
                                   for r in want[0]]  # fmt: skip
