"""The service's one memory budget (metadata/server/budget.py), against a real `meta serve`:
issue 40's reproductions (clients that never read their answers, frames that stop arriving),
and the accounting itself on a stand-in connection."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from fusefs.client.volume import Volume
from metadata.client import connect
from metadata.server.budget import PARTIAL_STALL_S, Budget
from metadata.wire.protocol import HEADER, MEMORY_BUDGET, PROTO_VERSION, encode_frame
from tests.fixtures.service import ROOT


@pytest.fixture
def served(tmp_path, meta_server):
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    return meta_server(tmp_path / "vol")


def _token(server) -> str:
    with open(server.token_file) as f:
        return f.read().strip()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _authed(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(encode_frame({"proto": PROTO_VERSION, "token": _token(server)}))
    got = b""
    while len(got) < 4 or len(got) < 4 + HEADER.unpack_from(got)[0]:
        got += s.recv(4096)
    return s


def _closed_by_service(s: socket.socket, within: float) -> bool:
    """Whether the service closed `s` within `within` seconds (what it sent is read away)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        s.settimeout(max(0.05, end - time.monotonic()))
        try:
            if not s.recv(1 << 20):
                return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True
    return False


def test_clients_that_never_read_are_held_to_one_budget(served):
    """Issue 40: eight authenticated connections that each send 1000 get_xattr requests
    with 64 KiB answers and never read raised the service's RSS by 503 MiB (each bounded
    only by its own OUT_MAX). Now all of them together stay within the default budget
    (+64 MiB of the process's own): past 3/4 of it their requests are no longer read,
    past it the ones stalled longest are dropped; a client that reads is answered
    throughout."""
    good = connect(served.url)
    good.set_xattr(1, b"user.big", b"x" * 65536)
    pid = served.proc.pid
    base = _rss_mib(pid)
    burst = b"".join(
        encode_frame([i, "get_xattr", [1, b"user.big"], {}, None]) for i in range(1, 1001)
    )
    socks = []
    for _ in range(8):
        s = _authed(served)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(burst)
        socks.append(s)
    peak = base
    end = time.monotonic() + 8
    while time.monotonic() < end:
        peak = max(peak, _rss_mib(pid))
        t0 = time.monotonic()
        assert good.getattr(1).is_dir
        assert time.monotonic() - t0 < 5
        time.sleep(0.05)
    assert peak - base <= (MEMORY_BUDGET >> 20) + 64, f"RSS grew {peak - base:.0f} MiB"
    assert good.get_xattr(1, b"user.big") == b"x" * 65536
    for s in socks:
        s.close()
    good.close()


def test_a_frame_that_stops_arriving_is_dropped_within_seconds(served):
    """Issue 40: three connections that stop 16 bytes short of a 64 MiB frame held 219 MiB
    until the 900 s idle timeout. Now each is dropped PARTIAL_STALL_S after its last byte,
    and the service gives the memory back."""
    pid = served.proc.pid
    base = _rss_mib(pid)
    size = 64 << 20
    socks = []
    for _ in range(3):
        s = _authed(served)
        s.sendall(HEADER.pack(size) + b"\0" * (size - 16))
        socks.append(s)
    t0 = time.monotonic()
    for s in socks:
        assert _closed_by_service(s, PARTIAL_STALL_S + 10), "a stalled frame was kept"
    assert time.monotonic() - t0 < PARTIAL_STALL_S + 10
    time.sleep(0.5)
    assert _rss_mib(pid) - base < 64, "the stalled frames' memory was kept"
    c = connect(served.url)
    assert c.getattr(1).is_dir
    c.close()
    for s in socks:
        s.close()


def test_frames_past_the_budget_drop_the_oldest_at_once(tmp_path, meta_server):
    """With a 100 MiB budget, a second 64 MiB frame received in part drops the first (the
    one stalled longest), without waiting for its stall timeout; the newer stays."""
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    server = meta_server(tmp_path / "vol", args=["--memory-budget", "100MiB"])
    size = 64 << 20
    first = _authed(server)
    first.sendall(HEADER.pack(size) + b"\0" * (size - 16))
    time.sleep(0.3)
    second = _authed(server)
    second.sendall(HEADER.pack(size) + b"\0" * (size - 16))
    assert _closed_by_service(first, 3), "the oldest holder was not dropped"
    assert not _closed_by_service(second, 1)
    first.close()
    second.close()


def test_meta_serve_refuses_a_budget_below_one_mib(tmp_path):
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    cmd = [sys.executable, "-m", "fusefs.cli", "meta", "serve", str(tmp_path / "vol"),
           "--listen", "127.0.0.1:0", "--memory-budget", "4KiB"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode != 0 and "at least 1MiB" in p.stderr and "Traceback" not in p.stderr


class _Holder:
    """A connection as the budget sees it: dropping it releases what it held."""

    def __init__(self, budget: Budget, since: float, full: bool = False) -> None:
        self.budget = budget
        self.out_bytes = self.partial_bytes = 0
        self.out_since = self.in_since = since
        self.full = full
        self.why = ""

    def queue(self, n: int) -> None:
        self.out_bytes += n
        self.budget.charge(self, n)

    def drop(self, why: str) -> None:
        self.why = why
        held, self.out_bytes, self.partial_bytes = self.out_bytes + self.partial_bytes, 0, 0
        self.budget.charge(self, -held)


def test_the_budget_pauses_then_drops_the_holder_stalled_longest():
    b = Budget(4 << 20)
    old, young = _Holder(b, 1.0), _Holder(b, 2.0)
    old.queue(2 << 20)
    assert not b.tight
    young.queue((1 << 20) + 1)
    assert b.tight and not old.why  # past 3/4: readers with queued answers pause
    young.queue(2 << 20)  # past the budget: the one stalled longest goes, and only it
    assert "memory budget" in old.why and not young.why
    assert b.used == (3 << 20) + 1 and list(b.holders) == [young]
    young.out_bytes = 0
    b.charge(young, -((3 << 20) + 1))
    assert b.used == 0 and not b.tight and not b.holders
    with pytest.raises(ValueError):
        Budget(1000)


def test_a_paused_connections_frame_is_not_stalled():
    b = Budget(64 << 20)
    stalled, paused = _Holder(b, 0.0), _Holder(b, 0.0, full=True)
    for h in (stalled, paused):
        h.partial_bytes = 1000
        b.charge(h, 1000)
    b.check_stalled(PARTIAL_STALL_S + 1)
    assert "stopped arriving" in stalled.why and not paused.why
    assert paused.in_since == PARTIAL_STALL_S + 1 and b.used == 1000
