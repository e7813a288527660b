"""Issue 40: limits that hold under abuse and over time.

wait_published costs the service nothing while it waits (no query, no task per waiter), is
bounded, and does not lock newcomers out of the connection cap; and the service's
per-step, per-job and per-request structures stay within their bounds over many steps.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bench.servers.metaserve import MetaServer
from fusefs.client.volume import Volume
from metadata.client import connect
from metadata.engine import STAGED, Extent, NewChunk
from metadata.server import service
from metadata.wire.protocol import PROTO_VERSION, FrameDecoder, decode, encode_frame
from tests.fixtures.service import in_process_service


@pytest.fixture
def vol(tmp_path) -> str:
    path = str(tmp_path / "vol")
    Volume.create(path, nodes=2).close()
    return path


def _files(rank: int, step: int) -> list[dict]:
    cid = (b"%06d-%06d" % (step, rank)).ljust(16, b"x")[:16]
    return [{"path": f"model/rank-{rank:04d}.distcp", "size": 100,
             "extents": [Extent(0, 100, cid, 0)],
             "new_chunks": [NewChunk(cid, 100, 60, STAGED)]}]  # fmt: skip


def _authed(port: int, token: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(encode_frame({"proto": PROTO_VERSION, "token": token}))
    assert _frames(s, 1)[0]["ok"] is True
    return s


def _frames(s: socket.socket, n: int, dec: FrameDecoder | None = None) -> list:
    dec = dec or FrameDecoder()
    out: list = []
    while len(out) < n:
        data = s.recv(1 << 20)
        if not data:
            break
        out += [decode(f) for f in dec.feed(data)]
    return out


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _create_latencies(c, tag: str, n: int = 15) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        c.create(1, f"{tag}-{i}".encode(), 0o100644, 0, 0)
        out.append(time.perf_counter() - t0)
    return out


def test_thousands_of_waiters_cost_the_service_almost_nothing(vol):
    """4,000 waiters on one open step (2 connections x 2,000): another client's create
    stays fast, the service's CPU stays low while they wait, and every waiter is answered
    when the step publishes."""
    srv = MetaServer(vol)
    try:
        token = open(srv.token_file).read().strip()
        c = connect(srv.url)
        c.begin("w", 1, 2)
        quiet = _create_latencies(c, "quiet")
        socks = [_authed(srv.port, token) for _ in range(2)]
        per = 2_000
        for k, s in enumerate(socks):
            s.sendall(b"".join(
                encode_frame([k * per + i + 1, "wait_published", ["w", 1], {"timeout": 120}, None])
                for i in range(per)
            ))  # fmt: skip
        time.sleep(1.5)  # every wait read and registered
        assert srv.proc is not None
        pid = srv.proc.pid
        cpu0, t0 = _cpu_s(pid), time.monotonic()
        time.sleep(3.0)
        busy = _create_latencies(c, "busy")
        cpu = (_cpu_s(pid) - cpu0) / (time.monotonic() - t0)
        print(f"quiet create median {statistics.median(quiet) * 1e3:.2f} ms; with "
              f"{2 * per} waiters median {statistics.median(busy) * 1e3:.2f} ms, max "
              f"{max(busy) * 1e3:.2f} ms; service CPU {cpu:.1%}")  # fmt: skip
        assert cpu < 0.15, f"the service used {cpu:.0%} of a core for idle waiters"
        assert max(busy) < max(0.25, 20 * statistics.median(quiet)), (quiet, busy)
        for r in range(2):
            c.commit_rank("w", 1, r, _files(r, 1), host="h")
        for s in socks:
            s.settimeout(60)
            got = _frames(s, per)
            assert len(got) == per and all(g[1] == 0 and g[2]["state"] == "published"
                                           for g in got), got[:3]  # fmt: skip
            s.close()
        c.close()
    finally:
        srv.stop()


TOKEN = "a-token-of-at-least-sixteen-characters"


@contextmanager
def _in_process(vol: str, **kw) -> Iterator[tuple[object, int, str]]:
    """A MetaService in this process (sizes and stats readable), with its token."""
    with in_process_service(vol, TOKEN, **kw) as (svc, port):
        yield svc, port, TOKEN


def test_long_waits_do_not_lock_newcomers_out_of_the_connection_cap(vol):
    """--max-connections 20, 20 connections each waiting for an hour: a new client still
    connects and is answered; a waiting client closed to make room sends its wait again
    and is answered when the step publishes."""
    with _in_process(vol, max_connections=20) as (svc, port, token):
        url = f"ckptfs://127.0.0.1:{port}?retry=10"
        svc.engine.begin("cap", 1, 2)  # type: ignore[attr-defined]
        waiters = [connect(url, token=token) for _ in range(10)]
        answers: list = []
        threads = [
            threading.Thread(target=lambda w=w: answers.append(w.wait_published("cap", 1, 3600)))
            for w in waiters
        ]
        for t in threads:
            t.start()
        # another credential's: a token's waits hold at most half of the connection cap
        other = svc.engine.create_token("raw", "reader", ["cap"])  # type: ignore[attr-defined]
        raw = [_authed(port, other) for _ in range(10)]
        for i, s in enumerate(raw):
            s.sendall(encode_frame([i + 1, "wait_published", ["cap", 1], {"timeout": 3600}, None]))
        time.sleep(3.0)  # the waits are old enough to make room for a newcomer
        t0 = time.monotonic()
        newcomer = connect(url, token=token)
        assert newcomer.getattr(1).is_dir
        took = time.monotonic() - t0
        print(f"a newcomer connected and was answered in {took * 1e3:.0f} ms")
        assert took < 5.0
        for r in range(2):
            newcomer.commit_rank("cap", 1, r, _files(r, 1), host="h")
        for t in threads:
            t.join(60)
        assert len(answers) == 10 and all(a["state"] == "published" for a in answers), answers
        assert svc.stats["evicted_waiting"] >= 1  # type: ignore[attr-defined]
        for s in raw:  # each was answered, or closed to make room
            s.settimeout(10)
            got = _frames(s, 1)
            assert not got or got[0][2]["state"] == "published", got
            s.close()
        for c in (*waiters, newcomer):
            c.close()


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_per_step_state_stays_bounded_over_many_steps(vol, monkeypatch):
    """300 steps of 8 ranks (100 jobs; every fifth step aborted, with waiters on each step):
    every structure stays within its bound (made small here, to be reached), and RSS does
    not grow with the steps."""
    from metadata.server import stats, waiters

    monkeypatch.setattr(service, "IDEM_KEEP", 200)
    monkeypatch.setattr(waiters, "TERMINAL_KEEP", 50)
    monkeypatch.setattr(stats, "STEPS_KEPT", 50)
    bounds = {"idem": 200, "manifests": service.MANIFESTS_KEEP,
              "step_files": service.STEP_FILES_KEEP, "terminal": 50, "first_commit": 50,
              "counted": 50, "watched": 0, "waits": 0, "wait_conns": 0, "authed": 3,
              "hello_waits": 0}  # fmt: skip
    ranks = 8
    with _in_process(vol) as (svc, port, token):
        c = connect(f"ckptfs://127.0.0.1:{port}", token=token)
        w = connect(f"ckptfs://127.0.0.1:{port}", token=token)
        rss = {}
        for n in range(1, 301):
            job, step = f"job{n % 100}", n
            c.begin(job, step, ranks)
            waits = w.submit_many([("wait_published", (job, step, 60), {})] * 4)
            if n % 5 == 0:
                c.commit_rank(job, step, 0, _files(0, step), host="h")
                c.abort(job, step, "test")
            else:
                futs = c.submit_many([
                    ("commit_rank", (job, step, r, _files(r, step)), {"host": "h"})
                    for r in range(ranks)
                ])  # fmt: skip
                for f in futs:
                    f.result(60)
                c.manifest(job, step)
            assert {f.result(60)["state"] for f in waits} <= {"published", "aborted"}
            c.create(1, f"f{n}".encode(), 0o100644, 0, 0)  # a keyed request
            if n in (150, 300):
                import gc

                gc.collect()
                rss[n] = _rss_kb()
        sizes = svc.sizes()  # type: ignore[attr-defined]
        print(f"sizes after 300 steps: {sizes}; RSS {rss[150]} KB at 150 steps, "
              f"{rss[300]} KB at 300")  # fmt: skip
        over = {k: (sizes[k], b) for k, b in bounds.items() if sizes[k] > b}
        assert not over, over
        assert sizes["terminal"] > 10  # kept for later waits, up to the bound
        assert rss[300] - rss[150] < 8_000, rss  # KB: 150 steps, generous
        c.close()
        w.close()


def test_waits_are_bounded_per_connection_and_in_all_and_go_with_their_connection(vol, monkeypatch):
    from metadata.server import waiters

    monkeypatch.setattr(waiters, "WAITS_PER_CONN", 5)
    monkeypatch.setattr(waiters, "WAITS_MAX", 8)
    with _in_process(vol) as (svc, port, token):
        svc.engine.begin("b", 1, 2)  # type: ignore[attr-defined]
        a, b = _authed(port, token), _authed(port, token)
        wait = [None, "wait_published", ["b", 1], {"timeout": 60}, None]
        a.sendall(b"".join(encode_frame([i, *wait[1:]]) for i in range(1, 7)))
        got = _frames(a, 1)  # the sixth is refused at once, the five wait
        assert got[0][0] == 6 and got[0][1] == errno.EAGAIN and "per connection" in got[0][2]
        b.sendall(b"".join(encode_frame([i, *wait[1:]]) for i in range(1, 5)))
        got = _frames(b, 1)
        assert got[0][0] == 4 and got[0][1] == errno.EAGAIN and "maximum of 8" in got[0][2]
        assert svc.sizes()["waits"] == 8  # type: ignore[attr-defined]
        a.close()
        b.close()
        end = time.monotonic() + 10
        while svc.sizes()["waits"] and time.monotonic() < end:  # type: ignore[attr-defined]
            time.sleep(0.05)
        sizes = svc.sizes()  # type: ignore[attr-defined]
        assert sizes["waits"] == 0 and sizes["watched"] == 0 and sizes["wait_conns"] == 0


def test_waits_are_bounded_per_credential_in_number_and_in_connections(vol, monkeypatch):
    """A token's waits are capped (WAITS_PER_CREDENTIAL) and so are the connections its
    waits hold (half of --max-connections): one credential's idle waits can neither
    take every wait nor fill the connection cap; another credential still waits."""
    from metadata.server import waiters

    monkeypatch.setattr(waiters, "WAITS_PER_CREDENTIAL", 6)
    with _in_process(vol, max_connections=5) as (svc, port, token):
        engine = svc.engine  # type: ignore[attr-defined]
        engine.begin("j", 1, 2)
        mine = engine.create_token("leaky", "writer", ["j"])
        other = engine.create_token("other", "writer", ["j"])
        wait = ["wait_published", ["j", 1], {"timeout": 60}, None]
        socks = [_authed(port, mine) for _ in range(3)]
        waits = svc.sizes  # type: ignore[attr-defined]
        socks[0].sendall(b"".join(encode_frame([i, *wait]) for i in range(1, 5)))
        _until(lambda: waits()["waits"] == 4)
        socks[1].sendall(encode_frame([1, *wait]))  # its fifth, on a second connection
        _until(lambda: waits()["waits"] == 5)
        socks[2].sendall(encode_frame([1, *wait]))  # a third connection: past 5 // 2 = 2
        got = _frames(socks[2], 1)
        assert got[0][:2] == [1, errno.EAGAIN] and "connections" in got[0][2], got
        socks[1].sendall(encode_frame([2, *wait]))  # its sixth
        _until(lambda: waits()["waits"] == 6)
        socks[1].sendall(encode_frame([3, *wait]))  # the token's seventh: refused
        got = _frames(socks[1], 1)
        assert got[0][:2] == [3, errno.EAGAIN] and "token leaky" in got[0][2], got
        theirs = _authed(port, other)  # another token is not held back by the first
        theirs.sendall(encode_frame([1, *wait]))
        _until(lambda: waits()["wait_tokens"] == 2)
        c = connect(f"ckptfs://127.0.0.1:{port}", token=token)
        for r in range(2):
            c.commit_rank("j", 1, r, _files(r, 1), host="h")
        assert _frames(theirs, 1)[0][1] == 0  # its wait answered at the publish
        assert sorted(f[0] for f in _frames(socks[0], 4)) == [1, 2, 3, 4]
        assert sorted(f[0] for f in _frames(socks[1], 2)) == [1, 2]
        c.close()
        for s in [*socks, theirs]:
            s.close()


def _until(cond, within: float = 10.0) -> None:
    end = time.monotonic() + within
    while not cond():
        assert time.monotonic() < end, "not in time"
        time.sleep(0.02)
