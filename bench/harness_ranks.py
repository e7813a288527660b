"""The harness's ranks as a torchrun job runs them: each its own client of its host's agent.

With agents (the default; `--no-agent` keeps one Volume per simulated host), the
coordinator starts one `ckptfs agent` per simulated host (bench.harness_agents) and every
rank in the worker processes is a separate client of its host's agent, as a rank process
is (fusefs/agent/rank.py): its own Unix-socket connection and hello with its token, its own
Volume over that connection, its own HostStager over the agent's staging directory. It
hashes and stages its shard itself, and sends its own missing_chunks, agent_adopt,
commit_rank and manifest requests; the agent groups what the host's ranks send together.
Ranks of one worker process share only what a process may share without speaking for
another rank: the object nodes (for reads straight from them), trio's worker threads
(bounded by one limiter) and the process's CPU.

A rank's connection does one request at a time (a rank's calls are sequential), from its
trio task, or from its staging thread through `RankEngine` (waiting on the socket in that
thread), which is what the Volume, its sink and the HostStager call. The socket outlives
the per-phase trio runs: a plain non-blocking socket, awaited with trio.lowlevel on the
loop and with poll in a thread.

Differences from a rank process, on purpose: a rank's chunk leases are not renewed by a
thread of its own (a harness save lasts seconds, a lease minutes: 4,096 renewer threads
would measure the harness, not the design), and its Volume's pool has one worker (the rank
stages in its own thread; a rank process would use its cores, here the process's threads
are shared by a thousand ranks).
"""

from __future__ import annotations

import errno
import functools
import gc
import os
import select
import socket
import time
from dataclasses import dataclass
from typing import Any

import trio

from chunkstore.nodes import ObjectNode
from chunkstore.tier.stager import HostStager
from fusefs.agent.rank import AgentLink
from fusefs.client.batch import StagedFile, Timings, stage_files
from fusefs.client.volume import Volume
from metadata.ckptformat import pack_args
from metadata.engine import MetaError
from metadata.wire.protocol import (
    MUTATING_METHODS,
    PROTO_VERSION,
    REMOTE_METHODS,
    FrameDecoder,
    decode,
    encode_frame,
)

THREADS = 96  # rank threads of one worker process at once (staging, reading): most wait
CONNECT_TIMEOUT = 30.0  # seconds a rank's connect and hello may take
GC_YOUNG = 70_000  # allocations between young collections in a worker (freeze_heap)
ANSWER_TIMEOUT = 600.0  # ... an answer (an adopt waits for staging room; the phase bounds it)


class RankConn:
    """One rank's connection to its host's agent (module docstring)."""

    def __init__(self, path: str, token: str) -> None:
        self.path = path
        self.token = token
        self.sock: socket.socket | None = None
        self.dec = FrameDecoder()
        self.frames: list[Any] = []
        self.next_id = 1
        self.busy = False

    async def open(self) -> dict:
        """Connect and say hello (the rank's token), asking the volume's config and the
        agent's info in the same round trip; the hello's answer (with "config" and "info"
        from an agent that gives them). MetaError if the agent refuses."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                while True:
                    try:
                        sock.connect(self.path)
                        break
                    except BlockingIOError:  # the agent's backlog is full: retry shortly
                        await trio.sleep(0.005)
                self.sock = sock
                hi = {"proto": PROTO_VERSION, "token": self.token, "want": ["config", "info"]}
                await self._send(encode_frame(hi))
                hello = decode(await self._frame())
        except BaseException:
            sock.close()
            self.sock = None
            raise
        if not isinstance(hello, dict) or not hello.get("ok"):
            self.close()
            why = hello.get("error") if isinstance(hello, dict) else hello
            raise MetaError(int(hello.get("errno") or errno.EPROTO), f"agent refused: {why}")
        return hello

    def _request(self, method: str, args: tuple, kwargs: dict) -> tuple[int, bytes]:
        if self.sock is None:
            raise MetaError(errno.EBADF, "rank connection closed")
        if self.busy:
            raise RuntimeError("a rank's connection does one request at a time")
        self.busy = True
        rid = self.next_id
        self.next_id += 1
        key = os.urandom(16) if method in MUTATING_METHODS else None
        return rid, encode_frame([rid, method, list(pack_args(method, args)), kwargs, key])

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One request and its answer, from the rank's trio task."""
        rid, req = self._request(method, args, kwargs)
        try:
            await self._send(req)
            msg = decode(await self._frame())
        finally:
            self.busy = False
        return self._result(method, rid, msg)

    def call_blocking(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One request and its answer, from the rank's own thread (its staging): the
        thread waits on the socket itself, with no hop through the trio loop (two hops a
        call, 40% of a worker's busy samples in a save when they went through it)."""
        rid, req = self._request(method, args, kwargs)
        try:
            view = memoryview(req)
            while view:
                try:
                    view = view[self.sock.send(view) :]  # type: ignore[union-attr]
                except BlockingIOError:
                    _wait(self.sock, select.POLLOUT, CONNECT_TIMEOUT)
            while not self.frames:
                try:
                    data = self.sock.recv(1 << 20)  # type: ignore[union-attr]
                except BlockingIOError:
                    _wait(self.sock, select.POLLIN, ANSWER_TIMEOUT)
                    continue
                if not data:
                    raise MetaError(errno.ECONNRESET, "the agent closed the connection")
                self.frames = [bytes(f) for f in self.dec.feed(data)]
            msg = decode(self.frames.pop(0))
        finally:
            self.busy = False
        return self._result(method, rid, msg)

    @staticmethod
    def _result(method: str, rid: int, msg: Any) -> Any:
        if not isinstance(msg, list) or len(msg) != 3 or msg[0] != rid:
            raise MetaError(errno.EPROTO, f"{method}: unexpected answer {msg!r:.80}")
        if msg[1]:
            raise MetaError(msg[1], str(msg[2]))
        return msg[2]

    async def _send(self, data: bytes) -> None:
        assert self.sock is not None
        view = memoryview(data)
        while view:
            try:
                n = self.sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            view = view[n:]

    async def _frame(self) -> Any:
        assert self.sock is not None
        while not self.frames:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            if not data:
                raise MetaError(errno.ECONNRESET, "the agent closed the connection")
            self.frames = [bytes(f) for f in self.dec.feed(data)]
        return self.frames.pop(0)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _wait(sock: Any, event: int, timeout: float) -> None:
    """Block this thread until the socket is ready (poll: a worker's ranks hold more than
    1,024 descriptors, past what select takes); MetaError after `timeout` seconds."""
    p = select.poll()
    p.register(sock, event | select.POLLERR | select.POLLHUP)
    if not p.poll(timeout * 1000):
        raise MetaError(errno.ETIMEDOUT, "the agent did not answer in time")


class RankEngine:
    """The rank's connection as the blocking engine a Volume, its sink and the HostStager
    call from the rank's staging thread (RankConn.call_blocking)."""

    def __init__(self, conn: RankConn) -> None:
        self.conn = conn

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.conn.call_blocking(method, *args, **kwargs)

    def missing_chunks(self, ids: list[bytes]) -> set[bytes]:
        return set(self.call("missing_chunks", list(ids)))

    def __getattr__(self, name: str) -> Any:
        if name in REMOTE_METHODS:
            return functools.partial(self.call, name)
        raise AttributeError(name)

    def close(self) -> None:
        self.conn.close()


@dataclass
class Rank:
    """One rank: its connection to its agent and its own Volume over it."""

    rank: int
    conn: RankConn
    vol: Volume

    def close(self) -> None:
        if self.vol.tier is not None:
            self.vol.tier.close()
        self.vol.pool.shutdown(wait=False)
        self.conn.close()


async def connect_rank(rank: int, path: str, token: str, nodes: Any, durability: str) -> Rank:
    """What a rank process does to open the volume through its agent: connect, say hello
    (the volume's config and the agent's info come with its answer: one round trip; asked
    apart from an agent that does not give them), open its Volume and stager. `nodes`:
    the object nodes for a config (NodesOnce)."""
    conn = RankConn(path, token)
    try:
        hello = await conn.open()
        config = hello.get("config") or await conn.call("get_config")
        info = hello.get("info") or await conn.call("agent_info")
    except BaseException:
        conn.close()
        raise
    return await open_rank(rank, conn, config, nodes(config), durability, info)


async def open_rank(
    rank: int,
    conn: RankConn,
    config: dict,
    nodes: list[ObjectNode],
    durability: str,
    info: dict | None = None,
) -> Rank:
    """What a rank process does to open the volume through its agent (rank.agent_volume),
    once connected and given the volume's config: stage in the agent's staging directory
    (`info`: the agent's, asked when not given). Closes `conn` on failure."""
    try:
        if info is None:
            info = await conn.call("agent_info")
        eng = RankEngine(conn)
        vol = Volume(eng, config, nodes=nodes, workers=1)  # type: ignore[arg-type]
        vol.agent = conn.path
        vol.sink._lease = lambda _ids: None  # type: ignore[method-assign]  # (docstring)
        if info.get("tier") and info.get("staging_dir"):
            vol.tier = HostStager(
                vol.store,
                info["staging_dir"],
                AgentLink(eng),
                durability=durability,
                size=info.get("budget"),
            )
    except BaseException:
        conn.close()
        raise
    return Rank(rank, conn, vol)


def stage_rank(rk: Rank, blocks: list[bytes], timings: Timings) -> StagedFile:
    """The rank's shard hashed, stored through its stager and adopted by the agent (in the
    rank's thread; its missing_chunks and agent_adopt go over its own connection)."""
    try:
        return stage_files(rk.vol, [blocks], timings)[0]
    except BaseException:
        rk.vol.sink.discard_unsynced()
        raise


def add_timings(into: Timings, more: Timings, suffix: str = " (rank thread-s)") -> None:
    """A rank's stage times, summed over the host's ranks as thread-seconds: ranks stage
    side by side, so their sums are set aside from the wall-clock breakdown."""
    for k, v in more.items():
        if not k.startswith("_"):
            name = k.replace(" (thread-s)", "") + suffix
            into[name] = into.get(name, 0.0) + v


# -- a simulated host's ranks, each through its agent ------------------------------------
def freeze_heap() -> None:
    """Keep the collector off what the worker holds already (gc.freeze): the ranks' Volumes,
    stagers and connections, and the shards' seeds and digests. A rank process holds one
    rank's; a worker holds a thousand ranks', and each collection of the older generations
    walked all of them: 46% of a worker's CPU in a run through agents (py-spy --gil).
    Called as a phase starts; what a phase leaves is frozen at the next (cheap: a splice).
    The youngest generation's threshold is scaled the same way (a rank process collects
    after 700 of its own allocations; a worker's thousand ranks allocate together, and the
    phase's live tasks were walked again at each collection of the older generations)."""
    gc.freeze()
    if gc.get_threshold()[0] < GC_YOUNG:
        gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])


def rank_token(url: str) -> str:
    """The credential a rank's hello carries: the host's service URL's token."""
    from metadata.wire.url import parse_url, resolve_token

    return resolve_token(parse_url(url)[1])


class NodesOnce:
    """The object nodes a worker's ranks share for reads straight from them, opened once
    from the first config an agent gave (FaultNode-wrapped, as the hosts' are)."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.nodes: list[ObjectNode] | None = None

    def __call__(self, config: dict) -> list[ObjectNode]:
        if self.nodes is None:
            from bench.harness_worker import FaultNode
            from chunkstore.nodes import NodeInfo, open_node

            self.nodes = [
                FaultNode(
                    open_node(NodeInfo(n["name"], n["url"], n["domain"])),
                    self.cfg["fault_dir"],
                    self.cfg["slow_node_delay"],
                )
                for n in config["nodes"]
            ]
        return self.nodes


async def open_ranks(st_cfg: dict, host: Any, nodes: NodesOnce) -> None:
    """Every rank of the host opens the volume through its agent, all at once (as the
    processes of a starting job do)."""
    path = st_cfg["agent_sockets"][host.index]
    token = rank_token(st_cfg.get("urls", {}).get(host.index) or st_cfg["url"])
    opened: dict[int, Rank] = {}

    async def one(rank: int) -> None:
        opened[rank] = await connect_rank(rank, path, token, nodes, st_cfg["durability"])

    try:
        async with trio.open_nursery() as n:
            for rank in host.ranks:
                n.start_soon(one, rank)
    except BaseException:
        for rk in opened.values():
            rk.close()
        raise
    host.clients = opened
    freeze_heap()


def close_ranks(host: Any) -> None:
    for rk in (host.clients or {}).values():
        try:
            rk.close()
        except Exception:  # noqa: S110 - closing at a restart or exit: nothing to report
            pass
    host.clients = {}


async def save_host(st: Any, host: Any, step: int, start: float, out: list, info: list) -> None:
    """Every rank of one host at once: its shard generated, hashed, staged through its own
    stager and adopted, then its commit_rank sent on its own connection (the agent groups
    the host's commits into commit_ranks)."""
    freeze_heap()
    cfg = st.cfg
    victim = cfg["kill_rank"][1] if cfg["kill_rank"] and cfg["kill_rank"][0] == step else None
    slow = set(cfg["slow_ranks"])
    phases: Timings = {}
    began = time.time()
    staged_at: list[float] = []
    done_at: list[float] = []

    def work(rank: int) -> tuple[StagedFile, Timings]:
        t0 = time.perf_counter()
        versions = st.versions[step][rank]
        blocks = st.maker.shard(rank, versions)
        st.digests[(rank, tuple(versions))] = st.maker.digest_of(blocks)
        if cfg["corrupt"] == [step, rank]:  # test hook: what is written differs from the seed's
            blocks[0] = bytes([blocks[0][0] ^ 0xFF]) + blocks[0][1:]
        if rank == victim:
            blocks = [b"".join(blocks)[: st.maker.shard_size // 2]]
        tm: Timings = {"generate": time.perf_counter() - t0}
        return stage_rank(host.clients[rank], blocks, tm), tm

    async def one(rank: int) -> None:
        r = {"rank": rank, "host": host.name, "start": start, "logical": st.maker.shard_size,
             "stored": 0, "error": "", "killed": False}  # fmt: skip
        if rank in slow:
            await trio.sleep(cfg["slow_delay"])
        try:
            sf, tm = await trio.to_thread.run_sync(work, rank, limiter=st.limiter)
        except Exception as e:  # recorded: the verdict decides what a rank failure means
            r["error"] = f"{type(e).__name__}: {e}"
            out.append(r)
            return
        add_timings(phases, tm)
        r["stored"], r["written"] = sf.stored, time.time()
        staged_at.append(r["written"])
        if rank == victim:
            r["error"], r["killed"] = f"rank {rank} killed mid-save (injected)", True
            out.append(r)
            return
        path = f"rank-{rank:06d}.shard"
        r["sent"] = time.time()
        try:
            await host.clients[rank].conn.call(
                "commit_rank", cfg["job"], step, rank, [sf.record(path)], host=host.name
            )
            r["done"] = time.time()
            done_at.append(r["done"])
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"
        out.append(r)

    async with trio.open_nursery() as n:
        for rank in host.ranks:
            n.start_soon(one, rank)
    if staged_at:
        last = max(done_at, default=max(staged_at))
        phases["ranks staged (wall)"] = max(staged_at) - began
        phases["commit"] = max(0.0, last - max(staged_at))
        info.append({"host": host.name, "began": began, "last": last, "phases": phases})


async def _read_rank(
    st: Any, host: Any, rk: Rank, step: int | None, start: float, out: list, phases: Timings
) -> float | None:
    """One rank's manifest from its agent (step None: the latest durable), then its shard
    read through its stager and verified in a thread. Returns when it finished."""
    from bench.harness_worker import _load_rec, read_wave

    t0 = time.perf_counter()
    try:
        man = await rk.conn.call("manifest", st.cfg["job"], step, rank=rk.rank)
        got_step = man["step"] if step is None else step
        if got_step is None or got_step not in st.versions:
            raise ValueError(f"latest_durable is {got_step}")
        phases["manifest (rank thread-s)"] = phases.get("manifest (rank thread-s)", 0.0) + (
            time.perf_counter() - t0
        )
        got, tm = await trio.to_thread.run_sync(
            read_wave, st, rk.vol, got_step, [rk.rank], [man], limiter=st.limiter
        )
    except Exception as e:
        out.append(_load_rec(host, rk.rank, start, error=f"{type(e).__name__}: {e}"))
        return None
    add_timings(phases, tm)
    ok, why = got[0]
    r = _load_rec(host, rk.rank, start, error=why)
    r["ok"], r["done"], r["step"] = ok, time.time(), got_step
    r["bytes"] = st.maker.shard_size if ok else 0
    out.append(r)
    return r["done"]


async def load_host(st: Any, host: Any, step: int, start: float, out: list, info: list) -> None:
    """Every rank of one host at once: its manifest asked on its own connection (the agent
    sends the host's as one manifest(ranks=[...])), its shard read and verified."""
    freeze_heap()
    phases: Timings = {}
    began = time.time()
    ends: list[float] = []

    async def one(rk: Rank) -> None:
        end = await _read_rank(st, host, rk, step, start, out, phases)
        if end is not None:
            ends.append(end)

    async with trio.open_nursery() as n:
        for rank in host.ranks:
            n.start_soon(one, host.clients[rank])
    if ends:
        phases["ranks: manifest, read, verify (wall)"] = max(ends) - began
        info.append({"host": host.name, "began": began, "last": max(ends), "phases": phases})


async def resume_host(st: Any, host: Any, _s: int, start: float, out: list, info: list) -> None:
    """A restarted job on this host (its agent restarted by the coordinator before the
    clock): the old ranks' connections and stagers closed, then every rank at once
    connecting to the agent afresh, asking its part of the latest durable step's manifest
    and reading its shard."""
    freeze_heap()
    from bench.harness_worker import _load_rec

    cfg = st.cfg
    phases: Timings = {}
    began = time.time()
    t0 = time.perf_counter()
    close_ranks(host)
    phases["close the old ranks"] = time.perf_counter() - t0
    path = cfg["agent_sockets"][host.index]
    token = rank_token(cfg.get("urls", {}).get(host.index) or cfg["url"])
    ends: list[float] = []

    async def one(rank: int) -> None:
        t = time.perf_counter()
        try:
            rk = await connect_rank(rank, path, token, st.nodes, cfg["durability"])
        except Exception as e:
            out.append(_load_rec(host, rank, start, error=f"reconnecting: {e}"))
            return
        host.clients[rank] = rk
        phases["connect (rank thread-s)"] = phases.get("connect (rank thread-s)", 0.0) + (
            time.perf_counter() - t
        )
        end = await _read_rank(st, host, rk, None, start, out, phases)
        if end is not None:
            ends.append(end)

    async with trio.open_nursery() as n:
        for rank in host.ranks:
            n.start_soon(one, rank)
    if ends:
        phases["ranks: connect, manifest, read, verify (wall)"] = (
            max(ends) - began - phases["close the old ranks"]
        )
        info.append({"host": host.name, "began": began, "last": max(ends), "phases": phases})


async def flush(host: Any, seconds: float) -> None:
    """Wait until the host's agent has drained its tier (asked by one of its ranks)."""
    rk = next(iter(host.clients.values()))
    await rk.conn.call("agent_flush", seconds)
