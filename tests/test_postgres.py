"""The engine contract on SQLite and on a real PostgreSQL; two services on one database."""

from __future__ import annotations

import errno
import stat

import pytest

from fusefs.volume import Volume
from metadata.client import connect
from metadata.engine import ROOT_INO, Extent, MetaError, NewChunk


@pytest.fixture(params=["sqlite", "postgres"])
def vol(request, tmp_path):
    db = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    v = Volume.create(str(tmp_path / "vol"), nodes=2, db=db)
    yield v
    v.close()


def _cid(tag: bytes) -> bytes:
    return tag.ljust(16, b".")[:16]


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
