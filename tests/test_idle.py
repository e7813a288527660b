"""fusefs/agent/idle.py: a real agent (agent_for over a real volume and write-behind tier,
serving its Unix socket in trio) with its idle exit, and a real rank (a Volume through the
agent, in a thread): it stays while a rank is connected, while a rank holds the spawn lock
and while staged chunks are not on the nodes (nodes made unusable); once idle for its
seconds it leaves, removes its socket and holds the lock until released.
"""

from __future__ import annotations

import os
import time

import pytest
import trio

from fusefs.agent.idle import exit_when_idle
from fusefs.agent.paths import ENV_SOCKET
from fusefs.agent.rank import agent_volume
from fusefs.agent.server import agent_for
from fusefs.agent.spawn import HostLock, alive, lock_path
from fusefs.client.volume import Volume, VolumeSettings

CHUNK = 64 * 1024
TIER = (None, "local", None)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    vol = str(tmp_path / "vol")
    Volume.create(vol, nodes=2, settings=VolumeSettings(chunk_size=CHUNK, replicas=1)).close()
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    sock = str(run / "agent.sock")
    monkeypatch.setenv(ENV_SOCKET, sock)
    monkeypatch.setenv("CKPTFS_AGENT_RETRY", "1")
    v = Volume.open(vol)
    v.attach_tier(str(tmp_path / "staging"), None, "local")
    agent = agent_for(v, vol, sock, "local")
    lock = HostLock(lock_path(sock))
    yield vol, sock, agent, lock
    lock.release()
    v.close()


def run(agent, seconds: float, lock: HostLock, rank, limit: float = 60) -> dict:
    """Serve with the idle exit while `rank(when)` runs in a thread (`when()`: seconds
    since serving began, or None while the agent is up); when the agent left, relative to
    the rank's end."""
    out: dict = {}

    async def main() -> None:
        with trio.fail_after(limit):
            async with trio.open_nursery() as n:
                await n.start(agent.serve)
                t0 = trio.current_time()
                left = trio.Event()

                async def idle() -> None:
                    await exit_when_idle(agent, seconds, lock)
                    out["left"] = trio.current_time() - t0
                    left.set()

                n.start_soon(idle)

                def when() -> float | None:
                    return out.get("left")

                await trio.to_thread.run_sync(rank, when)
                out["rank_done"] = trio.current_time() - t0
                await left.wait()

    trio.run(main)
    return out


def _write(spec: str, name: str, data: bytes) -> None:
    vol = agent_volume(spec, TIER)
    assert vol is not None and vol.agent is not None, "the rank did not go through the agent"
    try:
        with vol.open_write(name) as w:
            w.write(data)
    finally:
        vol.close()


def _read(spec: str, name: str) -> bytes:
    vol = Volume.open(spec)  # no agent: straight from the nodes
    try:
        with vol.open_read(name) as r:
            return r.pread(0, r.size)
    finally:
        vol.close()


def test_it_stays_while_a_rank_is_connected_then_leaves_and_removes_its_socket(setup):
    vol, sock, agent, lock = setup
    data = os.urandom(3 * CHUNK)

    def rank(when) -> None:
        v = agent_volume(vol, TIER)
        assert v is not None and v.agent == sock
        with v.open_write("/a") as w:
            w.write(data)
        time.sleep(2.0)  # connected and quiet, four times the idle seconds
        assert when() is None, "left while a rank was connected"
        assert alive(sock)
        v.close()

    out = run(agent, 0.5, lock, rank)
    assert out["left"] - out["rank_done"] < 0.5 + 3.0, out
    assert not os.path.exists(sock)
    assert lock.fd is not None, "the agent leaves holding the spawn lock"
    assert not HostLock(lock.path).try_acquire()
    lock.release()
    probe = HostLock(lock.path)
    assert probe.try_acquire()
    probe.release()
    assert _read(vol, "/a") == data


def test_it_stays_while_a_rank_holds_the_spawn_lock(setup):
    vol, sock, agent, lock = setup
    rank_lock = HostLock(lock.path)

    def rank(when) -> None:
        assert rank_lock.try_acquire()  # a rank looking for its agent, or starting one
        try:
            time.sleep(2.0)
            assert when() is None, "left under a rank's lock"
        finally:
            rank_lock.release()

    out = run(agent, 0.3, lock, rank)
    assert out["left"] >= out["rank_done"], out
    assert out["left"] - out["rank_done"] < 3.0, out


def test_staged_chunks_not_on_the_nodes_keep_it_up(setup):
    """Nodes made unusable (each node directory swapped for a file): the rank's chunks are
    staged in the agent's tier and cannot upload; the agent stays far past its idle
    seconds, then drains and leaves once the nodes are back, and the data is on them."""
    vol, sock, agent, lock = setup
    nodes = [os.path.join(vol + ".nodes", n) for n in ("n0", "n1")]
    data = os.urandom(4 * CHUNK)

    def rank(when) -> None:
        for n in nodes:
            os.rename(n, n + ".away")
            with open(n, "w"):
                pass
        try:
            _write(vol, "/staged", data)
            assert agent.vol.tier.stats()["pending_chunks"] >= 4
            time.sleep(4.0)  # eight times the idle seconds
            assert when() is None, "left with staged chunks not on the nodes"
            assert agent.vol.tier.stats()["pending_chunks"] >= 4
        finally:
            for n in nodes:
                os.unlink(n)
                os.rename(n + ".away", n)

    out = run(agent, 0.5, lock, rank)
    # the uploads retry with backoff (at most 10 s), then the idle seconds
    assert out["left"] - out["rank_done"] < 10.0 + 0.5 + 5.0, out
    assert agent.vol.tier.stats()["pending_chunks"] == 0
    assert _read(vol, "/staged") == data


def test_a_by_hand_agent_has_no_idle_exit():
    """`ckptfs agent` without --idle-exit keeps no lock and runs until stopped (cli/agent.py
    passes no seconds: no watcher); the option refuses what is not a positive number."""
    from fusefs.cli.main import build_parser

    p = build_parser()
    assert p.parse_args(["agent", "VOL"]).idle_exit is None
    assert p.parse_args(["agent", "VOL", "--idle-exit", "2.5"]).idle_exit == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            p.parse_args(["agent", "VOL", "--idle-exit", bad])
