"""A replica that hangs (SIGSTOP) does not stall its clients (issue 41).

Real `ckptfs meta serve` replicas on a real PostgreSQL; the replica process is stopped
and continued with signals. A client fails over on silence (an unanswered ping) or a
missed deadline, new clients race their connection attempts, and the database lets go
of a stopped replica's transaction (idle_in_transaction_session_timeout), so the request
sent again is applied once, on time.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from contextlib import contextmanager

import psycopg

from metadata import client as client_mod
from metadata.client import connect
from metadata.engine import ROOT_INO
from metadata.engines.postgres import IDLE_IN_TX_S
from tests.fixtures.service import replica_url as _url

DIR = stat.S_IFDIR | 0o755
REG = stat.S_IFREG | 0o644
# a stopped replica is found within PROBE_AFTER + PING_TIMEOUT (+ a watchdog tick and
# DIRECT_WAIT before the I/O thread takes over); CI machines are slow: a margin
DETECT_S = client_mod.DIRECT_WAIT + client_mod.PROBE_AFTER + client_mod.PING_TIMEOUT + 1.5


@contextmanager
def stopped(server):
    """The replica's process stopped (SIGSTOP) for the block; continued after it."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def _names(client, ino: int) -> list[bytes]:
    return sorted(e.name for e in client.readdir(ino, 0))


def test_a_call_to_a_stopped_replica_is_answered_by_the_other_once(replicas):
    """The client's replica stops with requests in flight: the calls are answered by the
    other replica within the detection time, each applied once; when the stopped replica
    resumes it applies nothing again (it reads the same requests, keys already applied),
    answers nobody twice, and serves again."""
    a, b, _pg = replicas
    c = connect(_url(a, b))
    d = c.create(ROOT_INO, b"d", DIR, 0, 0)
    with stopped(a):
        t0 = time.monotonic()
        f = c.create(d.ino, b"f", REG, 0, 0)  # sent to the stopped replica
        took = time.monotonic() - t0
        assert took < DETECT_S, f"failover took {took:.1f} s"
        assert c.failovers == 1 and c.hangs == 1
        g = c.create(d.ino, b"g", REG, 0, 0)  # on the other replica now: at once
        c.setattr(f.ino, size=7)
        assert time.monotonic() - t0 - took < 1.0
    # a resumes and reads what was sent to it (the create of f): applied already
    time.sleep(1.0)
    assert _names(c, d.ino) == [b"f", b"g"]
    assert c.lookup(d.ino, b"f").ino == f.ino and c.getattr(f.ino).size == 7
    assert c.getattr(d.ino).nlink >= 2 and g.ino != f.ino
    assert c.failovers == 1 and not c._pending
    only_a = connect(_url(a))
    h = only_a.create(d.ino, b"h", REG, 0, 0)
    assert only_a.lookup(d.ino, b"h").ino == h.ino
    assert _names(only_a, d.ino) == [b"f", b"g", b"h"]
    for x in (c, only_a):
        x.close()
    print(f"failover of a call to a stopped replica: {took:.2f} s")


def test_new_clients_with_a_stopped_first_replica_answer_within_a_second(replicas):
    """The first listed replica is stopped (its kernel accepts, it never says hello):
    a new client's attempts are raced, and its first answer comes from the other
    replica within a second, every time."""
    a, b, _pg = replicas
    connect(_url(a, b)).close()
    times = []
    with stopped(a):
        for k in range(5):
            t0 = time.monotonic()
            c = connect(_url(a, b))
            c.create(ROOT_INO, f"n{k}".encode(), REG, 0, 0)
            times.append(time.monotonic() - t0)
            assert c.failovers == 1
            c.close()
    assert max(times) <= 1.0, times
    c = connect(_url(a, b))
    assert len(c.readdir(ROOT_INO, 0)) == 5 and c.failovers == 0
    c.close()
    print("first answers with a stopped first replica: " + ", ".join(f"{t:.3f}" for t in times))


def _waiting_on_lock(pg_url: str, timeout: float = 20.0) -> int:
    """The pid of a backend (a replica's) waiting for a lock, once there is one."""
    end = time.monotonic() + timeout
    with psycopg.connect(pg_url, autocommit=True) as conn:
        while time.monotonic() < end:
            row = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND pid <> pg_backend_pid()"
            ).fetchone()
            if row:
                return row[0]
            time.sleep(0.02)
    raise AssertionError("no replica waited for the lock")


def test_a_replica_stopped_inside_a_transaction_does_not_block_the_retry(replicas):
    """Replica a is stopped inside a create's transaction (its key claimed, the
    directory's row locked): the test holds the directory's row until a's transaction
    waits for it, stops a, then lets go; a's transaction is left idle holding both. The
    database ends it after IDLE_IN_TX_S, so the create sent again to b, which waits on
    the key, goes through then: applied once, within IDLE_IN_TX_S plus detection. a
    resumes, finds its connection gone, runs the request again (the key answers), and
    serves again."""
    a, b, pg_url = replicas
    c = connect(_url(a, b))
    d = c.create(ROOT_INO, b"d", DIR, 0, 0)
    got: list = []

    holder = psycopg.connect(pg_url)  # a transaction holding the directory's row
    holder.execute("SELECT ino FROM inodes WHERE ino = %s FOR UPDATE", (d.ino,)).fetchall()
    caller = threading.Thread(target=lambda: got.append(c.create(d.ino, b"f", REG, 0, 0)))
    caller.start()
    backend = _waiting_on_lock(pg_url)
    with stopped(a):
        holder.commit()  # a's statement completes; a, stopped, sends nothing more
        released = time.monotonic()
        with psycopg.connect(pg_url, autocommit=True) as watch:
            state = None
            for _ in range(100):
                state = watch.execute(
                    "SELECT state FROM pg_stat_activity WHERE pid = %s", (backend,)
                ).fetchone()
                if state and state[0] == "idle in transaction":
                    break
                time.sleep(0.02)
            assert state and state[0] == "idle in transaction", state
        caller.join(timeout=IDLE_IN_TX_S + DETECT_S + 10)
        took = time.monotonic() - released
        assert got, "the create was not answered while the replica was stopped"
        assert took < IDLE_IN_TX_S + DETECT_S, f"answered {took:.1f} s after the release"
        assert c.failovers == 1
    holder.close()
    f = got[0]
    assert c.lookup(d.ino, b"f").ino == f.ino and _names(c, d.ino) == [b"f"]
    # a resumes: its transaction is gone; it serves again, and applied nothing twice
    only_a = connect(_url(a))
    assert only_a.lookup(d.ino, b"f").ino == f.ino
    g = only_a.create(d.ino, b"g", REG, 0, 0)
    assert _names(only_a, d.ino) == [b"f", b"g"] and g.ino != f.ino
    assert only_a.getattr(f.ino).nlink == 1
    for x in (c, only_a):
        x.close()
    print(f"answer after a stopped replica's transaction was released: {took:.2f} s")


def test_a_replica_stopped_mid_copy_is_ended_by_the_others(replicas):
    """A replica stopped in the middle of a COPY (a group commit's bulk insert) is not idle
    in its transaction: its backend waits for data that never comes, holding its locks.
    Every replica ends such a backend after SILENT_COPY_S (engines/postgres.py), so a
    request needing those locks goes through within seconds, not at the resume."""
    from metadata.engines.postgres import SILENT_COPY_S

    a, _b, pg_url = replicas
    cl = connect(_url(a))
    target = cl.create(ROOT_INO, b"locked", REG, 0, 0).ino
    holding, resume = threading.Event(), threading.Event()
    pid: list[int] = []
    ended: list[BaseException] = []

    def stuck_copy() -> None:
        """What a stopped replica's connection looks like: a row locked, a COPY begun and
        never finished (the process would be stopped here; this thread just waits)."""
        try:
            with psycopg.connect(pg_url) as conn, conn.cursor() as cur:
                pid.append(conn.info.backend_pid)
                cur.execute("SELECT 1 FROM inodes WHERE ino = %s FOR UPDATE", (target,))
                with cur.copy("COPY xattrs (ino, name, value) FROM STDIN") as cp:
                    cp.write_row((target, b"user.half", b"written"))
                    holding.set()
                    resume.wait(60)  # "continued": finishing the COPY finds it ended
        except BaseException as e:  # noqa: BLE001 - the termination is the expected end
            ended.append(e)

    t = threading.Thread(target=stuck_copy, daemon=True)
    t.start()
    assert holding.wait(10)
    t0 = time.monotonic()
    cl.setattr(target, mode=stat.S_IFREG | 0o600)  # needs the row the stuck COPY locked
    took = time.monotonic() - t0
    assert took < SILENT_COPY_S + 8, took
    with psycopg.connect(pg_url) as conn:
        alive = conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid[0],))
        assert alive.fetchone() is None  # the stuck backend was ended
    resume.set()
    t.join(20)
    assert ended and isinstance(ended[0], psycopg.Error), ended  # its transaction is gone
    assert stat.S_IMODE(cl.getattr(target).mode) == 0o600
    assert cl.list_xattr(target) == []  # the stuck transaction rolled back
    cl.close()
