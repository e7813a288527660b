"""Trust domains and the verifier (metadata/sql/chunkrefs.py, fusefs/maint/verify.py),
through a real `ckptfs meta serve` on SQLite and PostgreSQL volumes: a writer of job A
that commits chunk ids it never stored (by commit_file and by commit_rank) cannot make a
writer of job B skip storing that content; same-scope deduplication still works; the
verifier vouches for whole chunks only, and then every scope deduplicates against them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from chunkstore.ids import chunk_id
from fusefs.client.volume import Volume
from fusefs.maint.gc import gc
from fusefs.maint.verify import verify_chunks
from metadata.client import connect
from metadata.engine import DURABLE, ROOT_INO, Extent, MetaError, NewChunk

CLI = [sys.executable, "-m", "fusefs.cli"]


@pytest.fixture(params=["sqlite", "postgres"])
def served(request, tmp_path, meta_server):
    db = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    path = str(tmp_path / "vol")
    vol = Volume.create(path, nodes=2, db=db)
    files = {}
    for name, job in (("a", "job-a"), ("a2", "job-a"), ("b", "job-b")):
        tok = tmp_path / f"{name}.token"
        scope = [f"/data-{job[-1]}"]
        tok.write_text(vol.meta.create_token(f"rank-{name}", "writer", [job], scope) + "\n")
        tok.chmod(0o600)
        files[name] = str(tok)
    vol.close()
    server = meta_server(path, db=db)
    clients = {n: connect(server.url, token=open(f).read().strip()) for n, f in files.items()}
    yield server, clients, files, path
    for c in clients.values():
        c.close()


def _cli(server, token_file: str, *args: str) -> subprocess.CompletedProcess:
    """A CLI command as the holder of `token_file` (server.url names the admin's)."""
    url = f"ckptfs://{server.address}?token_file={token_file}"
    return subprocess.run([*CLI, *args[:1], url, *args[1:]], capture_output=True, text=True)


def _objects(path: str) -> int:
    n = 0
    for root, _dirs, names in os.walk(os.path.join(path, "nodes")):
        if os.sep + "objects" in root:
            n += len(names)
    return n


def _poison(w, cid: bytes, size: int, step: int = 1) -> None:
    """Job A's writer commits a file and a rank naming `cid` as a chunk it stored."""
    try:
        d = w.lookup(ROOT_INO, b"data-a").ino
    except MetaError:
        d = w.create(ROOT_INO, b"data-a", stat.S_IFDIR | 0o755, 0, 0).ino
    f = w.create(d, b"claim-%d" % step, stat.S_IFREG | 0o644, 0, 0).ino
    w.commit_file(f, [Extent(0, size, cid)], size, [NewChunk(cid, size, size, DURABLE)])
    w.begin("job-a", step, 1)
    files = [{"path": "x", "size": size, "extents": [Extent(0, size, cid)],
              "new_chunks": [NewChunk(cid, size, size, DURABLE)]}]  # fmt: skip
    assert w.commit_rank("job-a", step, 0, files)["state"] == "published"


def test_another_scopes_claim_never_makes_a_write_skip_its_data(served, tmp_path):
    """The dedup-poisoning reproduction of issue 39 through commits (a writer may commit
    new chunks, so this never needed register_chunk_rows): on the old code B's put
    deduplicated against A's claim, exited 0, and its get failed (chunk unreadable)."""
    server, c, files, path = served
    data = os.urandom(300_000)  # one chunk
    seed = int(c["a"].get_config()["seed"])
    cid = chunk_id(data, seed)  # what any writer can compute
    cid_rank = chunk_id(data[:200_000], seed)
    _poison(c["a"], cid, len(data))
    assert c["a"].missing_chunks([cid]) == set()  # its own claim: it can only poison itself
    assert c["a2"].missing_chunks([cid]) == set()  # another token of the same scope too
    assert c["b"].missing_chunks([cid]) == {cid}  # another scope's: not proven
    src = tmp_path / "src"
    src.write_bytes(data)
    put = _cli(server, files["b"], "put", str(src), "/data-b/p.bin")
    assert put.returncode == 0, put.stderr
    out = tmp_path / "out"
    got = _cli(server, files["b"], "get", "/data-b/p.bin", str(out))
    assert got.returncode == 0, got.stderr
    assert out.read_bytes() == data
    # the commit_rank path (the journal): a rank's claim, then B's write of that content
    w = c["a"]
    w.begin("job-a", 2, 1)
    files_a = [{"path": "y", "size": 200_000, "extents": [Extent(0, 200_000, cid_rank)],
                "new_chunks": [NewChunk(cid_rank, 200_000, 200_000, DURABLE)]}]  # fmt: skip
    w.commit_rank("job-a", 2, 0, files_a)
    src.write_bytes(data[:200_000])
    assert _cli(server, files["b"], "put", str(src), "/data-b/q.bin").returncode == 0
    assert _cli(server, files["b"], "get", "/data-b/q.bin", str(out)).returncode == 0
    assert out.read_bytes() == data[:200_000]


def test_same_scope_dedup_and_the_verifier(served, tmp_path):
    """A second write of the same content in job A stores nothing new; another scope
    stores it again until the verifier vouches for it, then deduplicates. The verifier
    marks whole chunks only: an absent one (a false claim) and a corrupt one stay."""
    server, c, files, path = served
    data = os.urandom(300_000)
    src = tmp_path / "src"
    src.write_bytes(data)
    assert _cli(server, files["a"], "put", str(src), "/data-a/one").returncode == 0
    seed = int(c["a"].get_config()["seed"])
    cid = chunk_id(data, seed)
    before = _objects(path)
    assert _cli(server, files["a2"], "put", str(src), "/data-a/two").returncode == 0
    assert _objects(path) == before  # the same scope: deduplicated, nothing stored
    assert c["b"].missing_chunks([cid]) == {cid}
    # a false claim (no object) and a corrupt object, both job A's
    fake = os.urandom(100_000)
    fake_id = chunk_id(fake, seed)
    _poison(c["a"], fake_id, len(fake), step=7)
    bad = os.urandom(250_000)
    src.write_bytes(bad)
    assert _cli(server, files["a"], "put", str(src), "/data-a/bad").returncode == 0
    bad_id = chunk_id(bad, seed)
    stored = _objects(path)
    vol = Volume.open(server.url)
    try:
        for node in vol.store.placement(bad_id):
            blob = bytearray(node.get(bad_id))
            blob[-1] ^= 1
            node.plant(bad_id, bytes(blob))
        rep = verify_chunks(vol)
        assert rep.verified == 1 and rep.unproven == 2, rep
        assert vol.meta.unverified_chunks() == sorted([fake_id, bad_id])
        assert c["b"].missing_chunks([cid, fake_id, bad_id]) == {fake_id, bad_id}
        assert _objects(path) == stored  # the verifier only reads
        # gc runs the verifier first (nothing new to vouch for: the same two refused)
        assert gc(vol, grace=3600).chunks_unproven == 2
    finally:
        vol.close()


def test_an_older_volume_gets_the_domain_columns_at_open(tmp_path):
    """A volume made before trust domains: opening it adds chunks.domain (its rows trusted,
    NULL), ref_journal.domain and the index of unverified rows; scoped claims then work."""
    import sqlite3

    from metadata.engines.sqlite import SqliteEngine

    v = Volume.create(str(tmp_path / "vol"), nodes=2)
    seed = v.seed
    old, new = os.urandom(300_000), os.urandom(1000)  # old: a chunk on the nodes
    v.write_file("/old", old)
    path = v.meta.path
    v.close()
    db = sqlite3.connect(path)
    for ddl in ("DROP INDEX chunks_unverified", "ALTER TABLE chunks DROP COLUMN domain",
                "ALTER TABLE ref_journal DROP COLUMN domain"):  # fmt: skip
        db.execute(ddl)
    db.commit()
    db.close()
    m = SqliteEngine(path)
    try:
        assert m.missing_chunks([chunk_id(old, seed)], domain=5) == set()  # trusted
        f = m.create(ROOT_INO, b"new", stat.S_IFREG | 0o644, 0, 0).ino
        cid = chunk_id(new, seed)
        m.commit_file(f, [Extent(0, 1000, cid)], 1000, [NewChunk(cid, 1000, 1000)], domain=5)
        assert m.missing_chunks([cid], domain=6) == {cid}
        assert m.unverified_chunks() == [cid]
    finally:
        m.close()
