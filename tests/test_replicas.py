"""Service replicas on one PostgreSQL database: failover, requests applied once, locking.

Real `ckptfs meta serve` processes and a real PostgreSQL (tests/fixtures); the
client is the real one, its URL listing the replicas.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time

import pytest

from fusefs.client.volume import Volume
from metadata.ckptformat import unpack_extents
from metadata.client import RemoteEngine, connect
from metadata.engine import ROOT_INO, Extent, MetaError, NewChunk
from metadata.wire.url import resolve_token
from tests.fixtures.postgres import free_port
from tests.fixtures.service import ROOT
from tests.fixtures.service import replica_url as _url
from tests.test_checkpoints import FILES, rank_files

DIR = stat.S_IFDIR | 0o755
REG = stat.S_IFREG | 0o644


def _engine(pg_url: str):
    from metadata.engines.postgres import PostgresEngine

    return PostgresEngine(pg_url)


def _exact_refcounts(pg_url: str) -> None:
    """Every chunk's refcount is the number of extents naming it: nothing applied twice."""
    eng = _engine(pg_url)
    try:
        rows, true = eng.chunk_rows(), eng.true_refcounts()
        assert {cid: r.refcount for cid, r in rows.items() if r.refcount} == true
    finally:
        eng.close()


class LosesAnswers(RemoteEngine):
    """A client whose network loses the answers of chosen requests: the service applied
    the request and answered, the answer never arrives, the connection breaks. The
    request stays pending and is sent again, to the next replica (client.py)."""

    def __init__(self, url: str, lose: dict[str, int]) -> None:
        from metadata.wire.url import parse_url

        replicas, params = parse_url(url)
        self.lose = dict(lose)
        self.lost: list[str] = []
        super().__init__(replicas, resolve_token(params))

    def _on_answer(self, rid: int, code: int, payload) -> None:
        with self._lock:
            p = self._pending.get(rid)
        if p is not None and not code and self.lose.get(p.method, 0) > 0:
            self.lose[p.method] -= 1
            self.lost.append(p.method)
            raise ConnectionResetError(f"test: the answer to {p.method} was lost")
        super()._on_answer(rid, code, payload)


def test_a_replica_killed_while_commits_are_in_flight_applies_each_once(replicas):
    """Ranks commit one by one from threads, half through each replica; one replica is
    SIGKILLed mid-step. Every commit is answered without an error, the step publishes,
    and every rank's commit is applied exactly once (rank records, files, refcounts)."""
    a, b, pg_url = replicas
    job, world = "kill", 96
    boss = connect(_url(b, a))
    boss.begin(job, 1, world, deadline_s=300)
    via_a, via_b = connect(_url(a, b)), connect(_url(b, a))
    answered = threading.Semaphore(0)
    errors: list[BaseException] = []

    def ranks(client, mine: list[int]) -> None:
        for r in mine:
            try:
                client.commit_rank(job, 1, r, rank_files(r), host=f"h{r % 2}")
                answered.release()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

    threads = [
        threading.Thread(target=ranks, args=(via_a if k % 2 == 0 else via_b,
                                             list(range(k, world, 8))))
        for k in range(8)
    ]  # fmt: skip
    for t in threads:
        t.start()
    for _ in range(world // 4):  # a quarter answered: the rest is in flight or to come
        assert answered.acquire(timeout=60)
    a.kill()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert via_a.failovers >= 1, "the client on the killed replica never failed over"
    info = boss.wait_published(job, 1, 60)
    assert info["state"] == "published"
    detail = boss.checkpoint_info(job, 1)
    assert detail["committed"] == world and len(detail["ranks"]) == world
    files = boss.manifest(job, 1)["files"]
    assert len(files) == world * FILES and len({f["path"] for f in files}) == world * FILES
    assert boss.stats().files == world * FILES
    _exact_refcounts(pg_url)
    for c in (boss, via_a, via_b):
        c.close()


def test_lost_answers_are_applied_once_by_the_other_replica(replicas):
    """A request applied by one replica whose answer is lost is sent again to the other,
    which has never seen it: it answers with the first outcome, from the database, and
    applies nothing twice. (A create retried so used to fail with EEXIST, a rename or an
    unlink with ENOENT, a gc pass forgot the rows it deleted.)"""
    a, b, pg_url = replicas
    lose = {"create": 1, "rename": 1, "unlink": 1, "commit_file": 1, "gc_chunk_rows": 1,
            "commit_rank": 2}  # fmt: skip
    c = LosesAnswers(_url(a, b), lose)
    d = c.create(ROOT_INO, b"d", DIR, 0, 0)
    assert c.lost == ["create"] and c.failovers == 1
    assert c.lookup(ROOT_INO, b"d").ino == d.ino
    assert [e.name for e in c.readdir(ROOT_INO, 0)] == [b"d"]

    f = c.create(d.ino, b"f", REG, 0, 0)
    cid = b"lost-answer-1".ljust(16, b".")
    got = c.commit_file(f.ino, [Extent(0, 8, cid)], 8, [NewChunk(cid, 8, 8)])
    assert c.lost[-1] == "commit_file" and c.failovers == 2
    assert got.generation == 1 and c.getattr(f.ino).generation == 1  # not committed twice
    assert c.chunk_info([cid])[cid][2] == 1

    assert c.rename(d.ino, b"f", ROOT_INO, b"g") is None
    assert c.lost[-1] == "rename" and c.lookup(ROOT_INO, b"g").ino == f.ino
    gone = c.unlink(ROOT_INO, b"g")
    assert c.lost[-1] == "unlink" and gone.ino == f.ino and gone.nlink == 0
    c.forget_orphan(f.ino)
    rows = c.gc_chunk_rows(0.0)
    assert c.lost[-1] == "gc_chunk_rows"
    assert [(bytes(r[0]), r[1]) for r in rows] == [(cid, 8)]  # the deleted rows, once

    c.begin("j", 1, 2)
    first = c.commit_rank("j", 1, 0, rank_files(0))
    assert c.lost[-1] == "commit_rank" and first["committed"] == 1
    last = c.commit_rank("j", 1, 1, rank_files(1))  # publishes; its answer is lost too
    assert c.lost == ["create", "commit_file", "rename", "unlink", "gc_chunk_rows",
                      "commit_rank", "commit_rank"]  # fmt: skip
    assert last["state"] == "published" and last["committed"] == 2
    assert c.failovers == 7
    info = c.checkpoint_info("j", 1)
    assert info["committed"] == 2 and [r["rank"] for r in info["ranks"]] == [0, 1]
    assert [s["state"] for s in c.list_checkpoints("j")] == ["published"]
    vol = Volume(c, c.get_config())
    assert len(vol.listdir("j/step-000001/model")) == 2 * FILES
    vol.close()
    _exact_refcounts(pg_url)


def test_two_jobs_commit_at_once_through_two_replicas(replicas):
    """Writers of different checkpoints and of unrelated directories do not wait for each
    other: while a transaction holds job A's step and a directory open, job B commits and
    publishes through the other replica, and a create elsewhere goes through; a commit of
    job A's step and a create in that directory wait for it. Then both jobs commit at
    once through both replicas: both publish, each with exactly its own files."""
    a, b, pg_url = replicas
    world = 32
    via_a, via_b = connect(_url(a, b)), connect(_url(b, a))
    for job in ("jobA", "jobB"):
        for step in (1, 2):
            via_a.begin(job, step, world)
    held_dir = via_a.create(ROOT_INO, b"busy", DIR, 0, 0)
    free_dir = via_a.create(ROOT_INO, b"free", DIR, 0, 0)

    def files(job: str, r: int) -> list[dict]:
        return rank_files(r, salt=job.encode())

    eng = _engine(pg_url)
    try:
        with eng._tx():  # a writer of job A's step, and of /busy, in an open transaction
            eng.commit_rank("jobA", 1, 0, files("jobA", 0))
            eng.create(held_dir.ino, b"mine", REG, 0, 0)
            t0 = time.monotonic()
            futs = via_b.submit_many(
                [("commit_rank", ("jobB", 1, r, files("jobB", r)), {}) for r in range(world)]
            )
            assert [f.result(20)["state"] for f in futs][-1] == "published"
            assert via_b.create(free_dir.ino, b"x", REG, 0, 0).ino > 0
            assert time.monotonic() - t0 < 20
            same_step = via_a.submit("commit_rank", "jobA", 1, 1, files("jobA", 1))
            same_dir = via_b.submit("create", held_dir.ino, b"theirs", REG, 0, 0)
            time.sleep(1.0)
            assert not same_step.done() and not same_dir.done()
        assert same_step.result(30)["committed"] == 2
        assert same_dir.result(30).ino > 0
    finally:
        eng.close()
    assert via_a.step_state("jobA", 1)["committed"] == 2

    # Both jobs at once, each rank from its own thread, job A through A and B through B.
    errors: list[BaseException] = []

    def commit(client, job: str, step: int, r: int) -> None:
        try:
            client.commit_rank(job, step, r, files(job, r), host=job)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=commit, args=(via_a, "jobA", 1, r))
               for r in range(2, world)]  # fmt: skip
    threads += [threading.Thread(target=commit, args=(via_b, "jobB", 2, r)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    vol = Volume(via_a, via_a.get_config())
    for job, step in (("jobA", 1), ("jobB", 1), ("jobB", 2)):
        assert via_a.wait_published(job, step, 30)["state"] == "published"
        want = sorted(f["path"] for r in range(world) for f in files(job, r))
        man = via_b.manifest(job, step)["files"]
        assert sorted(f["path"] for f in man) == want, (job, step)
        mine = {cid for r in range(world) for f in files(job, r) for cid in
                [e.chunk_id for e in f["extents"]]}  # fmt: skip
        used = {e.chunk_id for f in man for e in unpack_extents(f["extents"])}
        assert used == mine, (job, step)  # nothing of the other job's
        names = sorted(n for n, _ in vol.listdir(f"{job}/step-{step:06d}/model"))
        assert names == sorted(p.split("/")[-1].encode() for p in want)
    assert sorted(n for n, _ in vol.listdir("busy")) == [b"mine", b"theirs"]
    vol.close()
    _exact_refcounts(pg_url)


def test_a_url_whose_first_replica_is_down_still_works(tmp_path, meta_server):
    """The first listed replica refuses connections: the client goes on with the next at
    once (a failover, counted), and works; a URL of no live replica fails after its
    retry window with an error naming them; bad URLs fail at once, clearly."""
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    live = meta_server(tmp_path / "vol")
    dead = free_port()
    url = f"ckptfs://127.0.0.1:{dead},127.0.0.1:{live.port}?token_file={live.token_file}"
    t0 = time.monotonic()
    c = connect(url)
    assert time.monotonic() - t0 < 5
    assert c.failovers == 1 and c.port == live.port
    d = c.create(ROOT_INO, b"d", DIR, 0, 0)
    assert c.lookup(ROOT_INO, b"d").ino == d.ino
    c.close()
    vol = Volume.open(url)
    vol.write_file("/d/x", b"through the second replica")
    assert vol.read_file("/d/x") == b"through the second replica"
    vol.close()

    other = free_port()
    t0 = time.monotonic()
    with pytest.raises(MetaError) as e:
        connect(f"ckptfs://127.0.0.1:{dead},127.0.0.1:{other}?token_file={live.token_file}"
                "&retry=1")  # fmt: skip
    assert e.value.errno == errno.ECONNREFUSED and 1 <= time.monotonic() - t0 < 10
    assert f":{dead}" in str(e.value) and f":{other}" in str(e.value)

    tok = f"?token_file={live.token_file}"
    for bad in (
        "ckptfs://",
        "ckptfs://127.0.0.1",
        "ckptfs://127.0.0.1:x",
        "ckptfs://127.0.0.1:0",
        "ckptfs://127.0.0.1:70000",
        f"ckptfs://127.0.0.1:{live.port},",
        f"ckptfs://127.0.0.1:{live.port},,127.0.0.1:1",
        f"ckptfs://127.0.0.1:{live.port},127.0.0.1:{live.port}",
        f"ckptfs://user@127.0.0.1:{live.port}",
        f"ckptfs://127.0.0.1:{live.port}/path",
        f"ckptfs://::1:{live.port}",
        f"http://127.0.0.1:{live.port}",
        f"ckptfs://127.0.0.1:{live.port}{tok}&retry=-1",
        f"ckptfs://127.0.0.1:{live.port}{tok}&retry=1e9",
        f"ckptfs://127.0.0.1:{live.port}{tok}&retry=soon",
    ):
        t0 = time.monotonic()
        with pytest.raises(MetaError) as e:
            connect(bad if "token_file" in bad else bad + ("" if "?" in bad else tok))
        assert e.value.errno == errno.EINVAL, (bad, e.value)
        assert "\n" not in str(e.value) and time.monotonic() - t0 < 1, bad


def test_a_client_started_while_the_service_restarts_waits_for_it(tmp_path, meta_server):
    """A `ckptfs put` (a new client) started while the only service is down used to fail
    at once with ECONNREFUSED; it waits for it within the retry window instead."""
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    server = meta_server(tmp_path / "vol")
    server.kill()
    got: list = []
    t = threading.Thread(target=lambda: got.append(connect(server.url)))
    t.start()
    time.sleep(1.5)
    assert not got  # still waiting: nothing listens
    server.restart()
    t.join(30)
    (c,) = got
    assert c.create(ROOT_INO, b"after", REG, 0, 0).ino > 0
    assert c.failovers == 0
    c.close()


def test_a_second_meta_serve_on_a_sqlite_volume_is_refused(tmp_path, meta_server):
    """SQLite volumes run one service: a second `meta serve` exits at once with a one-line
    error naming the first; once the first is gone (even SIGKILLed), a new one starts."""
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    first = meta_server(tmp_path / "vol")
    cmd = [sys.executable, "-m", "fusefs.cli", "meta", "serve", str(tmp_path / "vol"),
           "--listen", "127.0.0.1:0"]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "serving" not in p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "already served" in lines[0] and f"pid {first.proc.pid}" in lines[0], lines[0]
    assert "EBUSY" in lines[0] and "PostgreSQL" in lines[0]
    first.kill()
    again = meta_server(tmp_path / "vol")  # the flock went with the killed process
    c = connect(again.url)
    assert c.getattr(ROOT_INO).ino == ROOT_INO
    c.close()


def test_gc_waits_for_a_commit_that_references_an_unreferenced_chunk(tmp_path, pg_url):
    """A chunk with no reference left, past its grace period, is what gc deletes. A commit
    that dedups against it in another transaction at that moment keeps it: gc waits for
    the commit (the chunk gate), then sees the reference. Without the gate, gc saw neither
    the uncommitted reference nor the uncommitted extents and deleted the row the commit
    then referenced."""
    vol = Volume.create(str(tmp_path / "vol"), nodes=2, db=pg_url)
    e1, e2 = vol.meta, _engine(pg_url)
    try:
        cid = b"gate-chunk".ljust(16, b".")
        f = e1.create(ROOT_INO, b"f", REG, 0, 0)
        e1.commit_file(f.ino, [Extent(0, 4, cid)], 4, [NewChunk(cid, 4, 4)])
        e1.setattr(f.ino, size=0)
        assert e1.chunk_info([cid])[cid][2] == 0
        g = e1.create(ROOT_INO, b"g", REG, 0, 0)
        result: list = []
        with e1._tx():
            e1.commit_file(g.ino, [Extent(0, 4, cid)], 4, [])  # not committed yet
            gc = threading.Thread(target=lambda: result.append(e2.gc_chunk_rows(0.0)))
            gc.start()
            gc.join(1.0)
            assert gc.is_alive(), "gc did not wait for the commit in flight"
        gc.join(30)
        assert result == [[]]
        assert e1.chunk_info([cid])[cid][2] == 1 and e1.get_extents(g.ino)[0].chunk_id == cid
    finally:
        e2.close()
        vol.close()


def test_a_deadlock_reruns_one_transaction_and_both_finish(tmp_path, pg_url):
    """Two transactions locking two inodes in opposite orders: PostgreSQL rolls one back
    (deadlock), `retried` runs it again from the start, and both finish."""
    from metadata.sql.txlocks import retried

    vol = Volume.create(str(tmp_path / "vol"), nodes=2, db=pg_url)
    e1, e2 = vol.meta, _engine(pg_url)
    x = e1.create(ROOT_INO, b"x", DIR, 0, 0).ino
    y = e1.create(ROOT_INO, b"y", DIR, 0, 0).ino
    both = threading.Barrier(2)
    runs: list[str] = []

    @retried
    def cross(eng, first: int, second: int, name: bytes) -> None:
        with eng._tx() as c:
            runs.append(name.decode())
            eng._lock_inodes(c, [first])
            if runs.count(name.decode()) == 1:
                both.wait(10)
            eng._lock_inodes(c, [second])
            eng.create(second, name, REG, 0, 0)

    errors: list[BaseException] = []

    def run(*args) -> None:
        try:
            cross(*args)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(e1, x, y, b"a")),
          threading.Thread(target=run, args=(e2, y, x, b"b"))]  # fmt: skip
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors
        assert sorted(runs) in (["a", "a", "b"], ["a", "b", "b"]), runs
        assert e1.lookup(y, b"a") and e1.lookup(x, b"b")
    finally:
        e2.close()
        vol.close()


def _serve(vol: str, db: str, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "fusefs.cli", "meta", "serve", vol, "--db", db,
           "--listen", "127.0.0.1:0", *extra]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - t0


def test_a_replica_started_while_its_database_restarts_waits_for_it(tmp_path):
    """A replica started while PostgreSQL is down (a fleet brought up in any order, a
    replica restarted during the database's restart) waits for the database and serves,
    saying once what it waits for; --db-wait 0 and a database that does not exist fail
    at once, in one line."""
    from bench.servers.metaserve import DB_WAIT, MetaServer
    from tests.fixtures.postgres import PgCluster

    cluster = PgCluster(tag="dbwait")
    server = None
    try:
        url = cluster.create_db()
        vol = str(tmp_path / "vol")
        Volume.create(vol, nodes=2, db=url).close()
        cluster.stop_server()

        done, took = _serve(vol, url, "--db-wait", "0")
        assert done.returncode != 0 and took < 30, (done, took)
        err = done.stderr.strip().splitlines()
        assert len(err) == 1 and "cannot connect to PostgreSQL" in err[0], done.stderr
        assert "Traceback" not in done.stderr

        log = str(tmp_path / "meta.log")
        said = threading.Event()

        def back_once_waiting() -> None:
            """The database comes back once the replica says it waits (its start-up,
            imports included, may take longer than any fixed delay)."""
            end = time.monotonic() + 60
            while time.monotonic() < end:
                if os.path.exists(log) and "waiting up to" in open(log).read():
                    said.set()
                    break
                time.sleep(0.1)
            time.sleep(1.0)
            cluster.start()

        back = threading.Thread(target=back_once_waiting)
        back.start()
        server = MetaServer(vol, db=url, log_path=log)  # waits for the "serving" line
        back.join()
        assert said.is_set()
        with open(log) as f:
            assert f"waiting up to {DB_WAIT:g} s for PostgreSQL" in f.read()
        eng = connect(server.url)
        try:
            d = eng.create(ROOT_INO, b"d", DIR, 0, 0)
            assert eng.lookup(ROOT_INO, b"d").ino == d.ino
        finally:
            eng.close()

        missing = url.rsplit("/", 1)[0] + "/no_such_database"
        done, took = _serve(vol, missing)  # the default wait: not spent on a lasting error
        assert done.returncode != 0 and took < 30, (done, took)
        assert "no_such_database" in done.stderr and "Traceback" not in done.stderr
    finally:
        if server is not None:
            server.stop()
        cluster.stop()


def test_only_errors_that_waiting_cures_are_waited_for():
    """What a replica waits for at start and after a lost connection (libpq gives these
    without a SQLSTATE): no answer, a server starting or full; not a missing database,
    a wrong password or a TLS mismatch, which fail at once."""
    import psycopg

    from metadata.engines.postgres import _transient

    def err(text: str) -> psycopg.OperationalError:
        return psycopg.OperationalError(
            f'connection failed: connection to server at "h" failed: {text}'
        )

    waits = [
        "Connection refused\n\tIs the server running on that host and accepting TCP/IP?",
        "FATAL:  the database system is starting up",
        "FATAL:  the database system is shutting down",
        "FATAL:  sorry, too many clients already",
        "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute",
        "server closed the connection unexpectedly",
    ]
    fails = [
        'FATAL:  database "nope" does not exist',
        'FATAL:  password authentication failed for user "ckpt"',
        "fe_sendauth: no password supplied",
        "server does not support SSL, but SSL was required",
        "SSL error: certificate verify failed",
    ]
    assert [_transient(err(t)) for t in waits] == [True] * len(waits)
    assert [_transient(err(t)) for t in fails] == [False] * len(fails)
