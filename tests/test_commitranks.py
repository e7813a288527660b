"""commit_ranks: a host's ranks' commits in one request (metadata/server/commitranks.py),
through a real `ckptfs meta serve` on SQLite and on PostgreSQL, in-process for the
service's counters, and embedded (the engines' own commit_ranks)."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from fusefs.client.volume import Volume
from metadata.ckptformat import pack_ranks
from metadata.client import connect
from metadata.engine import (
    COMMIT_RANKS_MAX,
    DURABLE,
    Extent,
    MetaEngine,
    MetaError,
    NewChunk,
)
from metadata.engines.sqlite import SqliteEngine
from metadata.wire.protocol import PROTO_VERSION, FrameDecoder, decode, encode_frame
from tests.fixtures.service import in_process_service


@pytest.fixture(params=["sqlite", "postgres"])
def served(request, tmp_path, meta_server):
    """(server, admin client, {name: scoped client}) on a fresh volume."""
    db = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    path = str(tmp_path / "vol")
    vol = Volume.create(path, nodes=2, db=db)
    tokens = {
        "a": vol.meta.create_token("rank-a", "writer", ["job-a"]),
        "b": vol.meta.create_token("rank-b", "writer", ["job-b"]),
    }
    vol.close()
    server = meta_server(path, db=db)
    admin = connect(server.url)
    clients = {name: connect(server.url, token=t) for name, t in tokens.items()}
    yield server, admin, clients
    for c in [admin, *clients.values()]:
        c.close()


def _files(rank: int, step: int = 1, path: str | None = None) -> list[dict]:
    cid = f"s{step}r{rank}".encode().ljust(16, b"_")[:16]
    return [{"path": path or f"rank-{rank}", "size": 10, "extents": [Extent(0, 10, cid)],
             "new_chunks": [NewChunk(cid, 10, 10)]}]  # fmt: skip


def _ranks(ranks, step: int = 1) -> list[list]:
    return [[r, _files(r, step), f"host{r // 8}"] for r in ranks]


def _errno(entry: dict) -> int | None:
    return entry.get("errno")


def test_eight_ranks_in_one_request_publish_their_step(served):
    _, admin, clients = served
    c = clients["a"]
    c.begin("job-a", 1, 8)
    out = c.commit_ranks("job-a", 1, _ranks(range(8)))
    assert [sorted(e) for e in out] == [["ok"]] * 8, out
    assert {e["ok"]["duplicate"] for e in out} == {False}
    assert out[-1]["ok"]["state"] == "published"
    assert admin.step_state("job-a", 1)["state"] == "published"
    assert admin.latest("job-a") == 1
    man = c.manifest("job-a", 1)
    assert sorted(f["path"] for f in man["files"]) == sorted(f"rank-{r}" for r in range(8))
    # a rank's own manifest request after it, as a restart asks for it
    assert [f["path"] for f in c.manifest("job-a", 1, rank=3)["files"]] == ["rank-3"]


def test_one_bad_rank_gets_its_own_error_and_the_others_commit(served):
    _, admin, clients = served
    c = clients["a"]
    c.begin("job-a", 2, 4)
    ranks = _ranks([0, 1, 9, 1, 2], step=2)
    ranks[4][1] = _files(2, 2, path="../escape")
    out = c.commit_ranks("job-a", 2, ranks)
    assert "ok" in out[0] and out[0]["ok"]["committed"] >= 1, out
    assert _errno(out[1]) == errno.EINVAL and "appears 2 times" in out[1]["error"]
    assert _errno(out[3]) == errno.EINVAL and "appears 2 times" in out[3]["error"]
    assert _errno(out[2]) == errno.EINVAL, out[2]  # out of range: world size 4
    assert _errno(out[4]) == errno.EINVAL and "\n" not in out[4]["error"]
    st = admin.step_state("job-a", 2)
    assert (st["state"], st["committed"]) == ("open", 1)
    # the refused ranks commit on their own later, and the last one publishes
    out = c.commit_ranks("job-a", 2, _ranks([1, 2, 3], step=2))
    assert [e["ok"]["state"] for e in out][-1] == "published", out
    # a rank sent again with the same files: idempotent by content, as for commit_rank
    again = c.commit_ranks("job-a", 2, _ranks([0], step=2))
    assert again[0]["ok"]["duplicate"] is True


def test_a_refused_scope_oversize_or_malformed_request_changes_nothing(served):
    _, admin, clients = served
    a, b = clients["a"], clients["b"]
    admin.begin("job-b", 1, 2)
    admin.begin("job-a", 3, 2)
    before = (admin.step_state("job-b", 1), admin.step_state("job-a", 3), admin.stats())
    with pytest.raises(MetaError) as e:  # a's credential does not cover job-b
        a.commit_ranks("job-b", 1, _ranks([0, 1]))
    assert e.value.errno == errno.EACCES and "token" in str(e.value)
    bad = [
        _ranks(range(COMMIT_RANKS_MAX + 1)),  # over the bound
        "not a list",
        [[0]],  # no files
        [[0, _files(0), "h", "extra"]],
        [[0, _files(0)], 7],
    ]
    for ranks in bad:
        with pytest.raises(MetaError) as e:
            a.commit_ranks("job-a", 3, ranks)
        assert e.value.errno == errno.EINVAL and "\n" not in str(e.value), ranks
    with pytest.raises(MetaError) as e:
        a.commit_ranks("job-a", 3)  # no ranks argument at all
    assert e.value.errno == errno.EINVAL
    assert (admin.step_state("job-b", 1), admin.step_state("job-a", 3), admin.stats()) == before
    # job-b's own writer commits it, host omitted
    out = b.commit_ranks("job-b", 1, [[0, _files(0)], [1, _files(1)]])
    assert out[-1]["ok"]["state"] == "published", out


def _raw(server) -> socket.socket:
    with open(server.token_file) as f:
        token = f.read().strip()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(encode_frame({"proto": PROTO_VERSION, "token": token}))
    assert _recv(s)["ok"] is True
    return s


def _recv(s: socket.socket):
    dec = FrameDecoder()
    for _ in range(10_000):
        frames = dec.feed(s.recv(1 << 20))
        if frames:
            return decode(frames[0])
    raise AssertionError("no frame")


def test_an_idempotent_replay_answers_the_first_outcome(served):
    server, admin, _ = served
    admin.begin("job-r", 1, 3)
    key = os.urandom(16)
    s = _raw(server)
    try:
        req = ["job-r", 1, pack_ranks(_ranks([0, 1, 5]))]  # rank 5: out of range
        s.sendall(encode_frame([1, "commit_ranks", req, {}, key]))
        first = _recv(s)
        s.sendall(encode_frame([2, "commit_ranks", req, {}, key]))  # the client's retry
        second = _recv(s)
        assert first[0] == 1 and second[0] == 2 and first[1] == second[1] == 0
        assert second[2] == first[2]
        assert [sorted(e) for e in first[2]] == [["ok"], ["ok"], ["errno", "error"]]
        assert first[2][1]["ok"]["duplicate"] is False  # the replay did not commit again
        # the same key with other arguments is refused, not answered with the first outcome
        other = ["job-r", 1, pack_ranks(_ranks([2]))]
        s.sendall(encode_frame([3, "commit_ranks", other, {}, key]))
        refused = _recv(s)
        assert refused[1] == errno.EINVAL and "reused" in refused[2]
    finally:
        s.close()
    assert admin.step_state("job-r", 1)["committed"] == 2


def test_each_rank_counts_in_the_services_commit_counters(tmp_path):
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    token = "a-token-of-at-least-sixteen-characters"
    with in_process_service(str(tmp_path / "vol"), token) as (svc, port):
        c = connect(f"ckptfs://127.0.0.1:{port}", token=token)
        try:
            c.begin("cnt", 1, 8)
            out = c.commit_ranks("cnt", 1, _ranks(range(8)))
            assert out[-1]["ok"]["state"] == "published"
            assert svc.counters.commit_latency.count == 8
            assert svc.counters.published == 1
            assert svc.stats["requests"] == 2  # begin, and one commit_ranks
        finally:
            c.close()


def test_embedded_engines_answer_as_the_service(tmp_path):
    """The SQL engines' commit_ranks (one transaction) and MetaEngine's default (one
    commit_rank each) give the same answers."""
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    eng = SqliteEngine(str(tmp_path / "vol" / "meta.db"))
    try:
        answers = []
        for step, commit in (
            (1, eng.commit_ranks),
            (2, lambda *a: MetaEngine.commit_ranks(eng, *a)),
        ):
            eng.begin("emb", step, 3)
            ranks = _ranks([0, 7, 1, 0], step)
            out = commit("emb", step, ranks)
            answers.append([(sorted(e), _errno(e)) for e in out])
            done = commit("emb", step, _ranks([0, 2], step))
            assert done[-1]["ok"]["state"] == "published", done
        assert answers[0] == answers[1] == [
            (["errno", "error"], errno.EINVAL), (["errno", "error"], errno.EINVAL),
            (["ok"], None), (["errno", "error"], errno.EINVAL),
        ]  # fmt: skip
        with pytest.raises(MetaError) as e:
            eng.commit_ranks("emb", 3, _ranks(range(COMMIT_RANKS_MAX + 1)))
        assert e.value.errno == errno.EINVAL
    finally:
        eng.close()


def test_a_scoped_writers_claims_count_for_its_scope_only(served):
    """The service sets each rank's trust domain as for commit_rank (server/access.py
    with_domain): chunk ids job A's writer commits without storing them are not held
    for job B's writer, while the same claim by the trusted admin is."""
    _, admin, clients = served
    a, b = clients["a"], clients["b"]
    durable = [
        [{"path": "x", "size": 10, "extents": [Extent(0, 10, cid)],
          "new_chunks": [NewChunk(cid, 10, 10, DURABLE)]}]
        for cid in (os.urandom(16), os.urandom(16))
    ]  # fmt: skip
    claimed, trusted = (f[0]["new_chunks"][0].chunk_id for f in durable)
    a.begin("job-a", 5, 1)
    assert "ok" in a.commit_ranks("job-a", 5, [[0, durable[0], "h"]])[0]
    admin.begin("job-t", 1, 1)
    assert "ok" in admin.commit_ranks("job-t", 1, [[0, durable[1], "h"]])[0]
    while admin.apply_pending(1000):  # the journal's references, applied
        pass
    assert b.missing_chunks([claimed, trusted]) == {claimed}
    assert a.missing_chunks([claimed]) == set()  # its own scope's claim
