"""Scoped credentials through a real `ckptfs meta serve` (metadata/server/access.py):
every remote method declares a permission; writers and readers stay in their scope; the
maintenance methods are the administrator's; idempotency keys answer only their caller;
a revoked token is refused at its next request. SQLite and PostgreSQL volumes."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from chunkstore.ids import chunk_id
from fusefs.client.volume import Volume
from metadata.client import connect
from metadata.engine import DURABLE, ROOT_INO, MetaError, NewChunk
from metadata.wire.protocol import (
    PERMISSIONS,
    PROTO_VERSION,
    REMOTE_METHODS,
    FrameDecoder,
    decode,
    encode_frame,
)

ROLES = ("read", "write", "admin")
SCOPES = ("", "job", "ino", "ino2")


def test_every_remote_method_declares_one_permission():
    assert set(PERMISSIONS) == set(REMOTE_METHODS), set(PERMISSIONS) ^ set(REMOTE_METHODS)
    for m, (need, scope) in PERMISSIONS.items():
        assert need in ROLES and scope in SCOPES, m
    for m in ("gc_chunk_rows", "register_chunk_rows", "gc_orphan_objects", "purge_orphans",
              "fix_refcounts", "drop_chunk_rows", "gc_release_objects"):  # fmt: skip
        assert PERMISSIONS[m][0] == "admin", m


@pytest.fixture(params=["sqlite", "postgres"])
def served(request, tmp_path, meta_server):
    db = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    path = str(tmp_path / "vol")
    vol = Volume.create(path, nodes=2, db=db)
    tokens = {
        "writer": vol.meta.create_token("rank-a", "writer", ["job-a"], ["/data-a"]),
        "reader": vol.meta.create_token("read-a", "reader", ["job-a"], ["/data-a"]),
        "other": vol.meta.create_token("rank-b", "writer", ["job-b"]),
        "ops": vol.meta.create_token("ops", "admin"),  # another administrator
    }
    vol.close()
    server = meta_server(path, db=db)
    admin = connect(server.url)
    clients = {name: connect(server.url, token=t) for name, t in tokens.items()}
    yield server, admin, clients, path
    for c in [admin, *clients.values()]:
        c.close()


def _refused(fn, *args, **kw) -> MetaError:
    with pytest.raises(MetaError) as e:
        fn(*args, **kw)
    assert e.value.errno == errno.EACCES, e.value
    assert "\n" not in str(e.value) and "token" in str(e.value)
    return e.value


def _mkdirs(meta, *names: bytes) -> int:
    ino = ROOT_INO
    for n in names:
        ino = meta.create(ino, n, stat.S_IFDIR | 0o755, 0, 0).ino
    return ino


def test_each_role_and_method_class(served):
    _server, admin, c, _path = served
    w, r, other = c["writer"], c["reader"], c["other"]
    # job B's published checkpoint and files, made by the administrator
    admin.begin("job-b", 1, 1)
    b_dir = _mkdirs(admin, b"job-b-files")
    b_file = admin.create(b_dir, b"f", stat.S_IFREG | 0o644, 0, 0).ino
    # a writer: its own job and prefix, nothing else
    assert w.begin("job-a", 1, 1)["state"] == "open"
    assert "outside" in str(_refused(w.begin, "job-b", 2, 1))
    _refused(w.abort, "job-b", 1)
    _refused(w.delete_checkpoint, "job-b")
    _refused(w.retain, "job-b", 1)
    a_dir = w.create(ROOT_INO, b"data-a", stat.S_IFDIR | 0o755, 0, 0).ino  # mkdir on the way
    f = w.create(a_dir, b"x", stat.S_IFREG | 0o644, 0, 0).ino
    w.setattr(f, size=0)
    _refused(w.create, ROOT_INO, b"elsewhere", stat.S_IFREG | 0o644, 0, 0)
    _refused(w.unlink, b_dir, b"f")
    _refused(w.rename, a_dir, b"x", b_dir, b"stolen")
    _refused(w.getattr, b_file)
    _refused(w.lookup, ROOT_INO, b"job-b-files")
    assert w.lookup(ROOT_INO, b"data-a").ino == a_dir
    assert sorted(e.name for e in w.readdir(ROOT_INO, 0)) == [b"data-a"]  # the way only
    for m, args in [("gc_chunk_rows", (0,)), ("register_chunk_rows", ([], {})),
                    ("gc_orphan_objects", ([], 60.0)), ("purge_orphans", ()),
                    ("fix_refcounts", ({},)), ("chunk_rows", ())]:  # fmt: skip
        assert "admin" in str(_refused(getattr(w, m), *args)), m
    # a reader: reads its scope, writes nothing
    assert r.latest("job-a") is None
    assert r.getattr(f).ino == f
    _refused(r.begin, "job-a", 2, 1)
    _refused(r.create, a_dir, b"y", stat.S_IFREG | 0o644, 0, 0)
    _refused(r.unlink, a_dir, b"x")
    _refused(r.latest, "job-b")
    # list_checkpoints shows a scoped credential its own jobs only
    assert {x["job"] for x in admin.list_checkpoints()} == {"job-a", "job-b"}
    assert {x["job"] for x in w.list_checkpoints()} == {"job-a"}
    # another job's writer cannot touch job A
    _refused(other.delete_checkpoint, "job-a")
    _refused(other.unlink, a_dir, b"x")
    # the administrator still can, and nothing refused changed anything
    assert admin.getattr(b_file).ino == b_file
    assert admin.step_state("job-b", 1)["state"] == "open"
    admin.unlink(a_dir, b"x")


def test_dedup_poisoning_and_condemning_content_are_refused(served, tmp_path):
    """The reproductions of issue 39: a writer registers a chunk row for content it expects
    another user to write (never storing it), and condemns content for 31 years. Both
    refused; an honest put of that content then reads back."""
    server, admin, c, path = served
    w = c["writer"]
    data = os.urandom(300_000)  # one chunk (the default chunk size is larger)
    cid = chunk_id(data, int(w.get_config()["seed"]))  # what any writer can compute
    _refused(w.register_chunk_rows, [NewChunk(cid, len(data), len(data), DURABLE)], {cid: 0})
    _refused(w.gc_orphan_objects, [cid], 1e9)
    with pytest.raises(MetaError) as e:
        admin.gc_orphan_objects([cid], 1e9)  # bounded even for the administrator
    assert e.value.errno == errno.EINVAL
    src = tmp_path / "src"
    src.write_bytes(data)
    env = {**os.environ, "CKPTFS_TOKEN_FILE": os.path.join(path, "meta.token")}
    cli = [sys.executable, "-m", "fusefs.cli"]
    subprocess.run([*cli, "put", server.url, str(src), "/p.bin"], env=env, check=True)
    out = tmp_path / "out"
    subprocess.run([*cli, "get", server.url, "/p.bin", str(out)], env=env, check=True)
    assert out.read_bytes() == data


def _raw(server, token: str) -> tuple[socket.socket, FrameDecoder]:
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.sendall(encode_frame({"proto": PROTO_VERSION, "token": token}))
    dec = FrameDecoder()
    assert _recv(s, dec)["ok"]
    return s, dec


def _recv(s: socket.socket, dec: FrameDecoder):
    while True:
        frames = dec.feed(s.recv(65536))
        if frames:
            return decode(frames[0])


def test_idempotency_keys_answer_only_their_caller(served):
    """Client A creates with key K; client B sends unlink with K: refused (EINVAL), not
    answered with A's create, and not applied. The same caller with K and other arguments
    is refused too. Checked in the service's memory and, after a restart, in the database."""
    server, admin, c, path = served
    admin_token = open(os.path.join(path, "meta.token")).read().strip()
    w_token = c["ops"]._token  # allowed to unlink anywhere: only the key can refuse it
    key = os.urandom(16)
    a, adec = _raw(server, admin_token)
    a.sendall(encode_frame([1, "create", [ROOT_INO, b"k", stat.S_IFREG | 0o644, 0, 0], {}, key]))
    rid, err, made = _recv(a, adec)
    assert err == 0 and made.ino > 0
    for rounds in range(2):  # the service's memory, then the database's record
        b, bdec = _raw(server, w_token)
        b.sendall(encode_frame([7, "unlink", [ROOT_INO, b"k"], {}, key]))
        assert _recv(b, bdec)[1] == errno.EINVAL
        b.close()
        a, adec = _raw(server, admin_token)
        a.sendall(encode_frame([2, "create", [ROOT_INO, b"k2", stat.S_IFREG | 0o644, 0, 0], {},
                               key]))  # fmt: skip
        assert _recv(a, adec)[1] == errno.EINVAL
        # the retry itself is still answered with the first outcome
        a.sendall(encode_frame([3, "create", [ROOT_INO, b"k", stat.S_IFREG | 0o644, 0, 0], {},
                               key]))  # fmt: skip
        rid, err, again = _recv(a, adec)
        assert err == 0 and again.ino == made.ino
        a.close()
        assert admin.lookup(ROOT_INO, b"k").ino == made.ino  # not unlinked
        with pytest.raises(MetaError):
            admin.lookup(ROOT_INO, b"k2")
        if rounds == 0:
            server.restart()


def test_a_revoked_or_expired_token_is_refused_at_its_next_request(served, tmp_path):
    server, admin, c, path = served
    w = c["writer"]
    w.ping()
    res = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "token", "revoke", path, "rank-a"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    deadline = time.monotonic() + 3
    while True:
        try:
            w.ping()
        except MetaError as e:
            assert e.errno == errno.EACCES and "revoked" in str(e)
            break
        assert time.monotonic() < deadline, "a revoked token still answered after 3 s"
        time.sleep(0.1)
    vol = Volume.open(path)
    short = vol.meta.create_token("brief", "reader", ["job-a"], expires_s=1.0)
    vol.close()
    r = connect(server.url, token=short)
    r.ping()
    time.sleep(1.2)
    with pytest.raises(MetaError) as e:
        r.ping()
    assert e.value.errno == errno.EACCES
    r.close()


def test_token_cli_creates_lists_and_refuses_bad_input(tmp_path):
    path = str(tmp_path / "vol")
    Volume.create(path, nodes=2).close()
    cli = [sys.executable, "-m", "fusefs.cli", "token"]
    made = subprocess.run([*cli, "create", path, "--name", "ci", "--role", "writer",
                           "--job", "train", "--expires", "7d"],
                          capture_output=True, text=True)  # fmt: skip
    assert made.returncode == 0 and made.stdout.startswith("ckt_"), made.stderr
    listed = subprocess.run([*cli, "list", path], capture_output=True, text=True).stdout
    assert "ci" in listed and "writer" in listed and made.stdout.strip() not in listed
    with open(os.path.join(path, "meta.db"), "rb") as f:
        assert made.stdout.strip().encode() not in f.read()  # kept hashed
    for bad in (["--name", "x y", "--role", "writer", "--job", "j"],
                ["--name", "n", "--role", "root", "--job", "j"],
                ["--name", "n", "--role", "writer"],
                ["--name", "n", "--role", "writer", "--prefix", "rel/path"],
                ["--name", "ci", "--role", "reader", "--job", "j"]):  # fmt: skip
        res = subprocess.run([*cli, "create", path, *bad], capture_output=True, text=True)
        assert res.returncode != 0 and "Traceback" not in res.stderr, (bad, res.stderr)
    res = subprocess.run([*cli, "revoke", path, "nobody"], capture_output=True, text=True)
    assert res.returncode != 0 and "no token named nobody" in res.stderr


def test_a_writer_token_saves_and_loads_its_jobs_dcp_checkpoint(tmp_path, meta_server):
    """Through the service with scoped tokens: a writer of job A saves and loads a DCP
    checkpoint of job A, and cannot save into job B (PermissionError, nothing published);
    a reader of job A loads it and cannot save."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from fusefs.client.registry import close_volumes
    from fusefs.dcp import CkptfsReader, CkptfsWriter

    path = str(tmp_path / "vol")
    vol = Volume.create(path, nodes=2)
    urls = {}
    for name, role in (("writer", "writer"), ("reader", "reader")):
        tok = tmp_path / f"{name}.token"
        tok.write_text(vol.meta.create_token(f"{name}-a", role, ["job-a"]) + "\n")
        tok.chmod(0o600)
        urls[name] = tok
    vol.close()
    server = meta_server(path)
    url = {k: f"ckptfs://{server.address}?token_file={v}" for k, v in urls.items()}
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7)}
    try:
        dcp.save(state, storage_writer=CkptfsWriter(url["writer"], "job-a/step-1", staging=False))
        for who in ("writer", "reader"):
            out = {"w": torch.zeros(4096), "b": torch.zeros(7)}
            dcp.load(out, storage_reader=CkptfsReader(url[who], "job-a/step-1"))
            assert all(torch.equal(out[k], state[k]) for k in state), who
        for who, target in (("writer", "job-b/step-1"), ("reader", "job-a/step-2")):
            with pytest.raises(BaseException) as e:  # DCP's CheckpointException is one
                dcp.save(state, storage_writer=CkptfsWriter(url[who], target, staging=False))
            text = str(e.value)
            assert "PermissionError" in text and "(token " in text, (who, text[-400:])
    finally:
        close_volumes()
    admin = connect(server.url)
    assert admin.latest("job-a") == 1
    assert admin.latest("job-b") is None and admin.step_state("job-a", 1)["state"] == "published"
    admin.close()


def test_requests_on_behalf_of_other_credentials_share_one_connection(served):
    """A host's client carries many ranks on one connection, each request with its own
    token (wire/protocol.py): the request's token decides, not the connection's."""
    server, admin, c, path = served
    reader = c["reader"]  # a connection that may only read job A
    as_writer = reader.behalf(c["writer"]._token)
    as_other = reader.behalf(c["other"]._token)
    assert as_writer.begin("job-a", 5, 1)["state"] == "open"  # the writer's scope
    _refused(as_writer.begin, "job-b", 5, 1)
    assert as_other.begin("job-b", 5, 1)["state"] == "open"
    _refused(as_other.abort, "job-a", 5)
    _refused(reader.begin, "job-a", 6, 1)  # the connection's own token is still a reader's
    a_dir = as_writer.create(ROOT_INO, b"data-a", stat.S_IFDIR | 0o755, 0, 0).ino
    assert as_writer.create(a_dir, b"f", stat.S_IFREG | 0o644, 0, 0).ino > 0
    with pytest.raises(MetaError) as e:
        reader.behalf("ckt_not-a-token-of-this-volume").ping()
    assert e.value.errno == errno.EACCES
    assert admin.step_state("job-a", 5)["state"] == "open"
    assert admin.step_state("job-b", 5)["state"] == "open"


def test_a_token_made_a_moment_ago_works_at_once_as_a_requests_own_token(served):
    """`ckptfs token create` (another process, straight into the database) and at once a
    rank through its host's agent: the service reloads its tokens for an unknown request
    token before refusing it, as it does for a hello (it used to wait for its 0.5 s poll)."""
    server, admin, c, path = served
    with Volume.open(path) as vol:
        fresh = vol.meta.create_token("rank-c", "writer", ["job-c"])
    as_fresh = c["reader"].behalf(fresh)
    assert as_fresh.begin("job-c", 1, 1)["state"] == "open"
    _refused(as_fresh.begin, "job-a", 1, 1)  # and its scope holds
    with Volume.open(path) as vol:
        vol.meta.revoke_token("rank-c")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # revoked: refused within the poll period
        try:
            as_fresh.ping()
        except MetaError as e:
            assert e.errno == errno.EACCES
            break
        time.sleep(0.05)
    else:
        pytest.fail("a revoked token was still accepted after 10 s")
