"""One worker process of the load-test harness: a few simulated hosts, their ranks as trio tasks.

Each simulated host is a Volume of its own (its own ckptfs:// connection, chunk store and
write-behind tier in its own staging directory), as it would be on a real machine. Each
rank is a trio task; the blocking part of its work (generate, chunk, hash, encode, stage;
or fetch and verify) runs in a worker thread bounded by the host's CapacityLimiter, and its
metadata calls are pipelined on the host's connection (RemoteEngine.submit) and awaited
without holding a thread, so thousands of commits can be in flight for the service to
group-commit.

The coordinator drives the worker over a multiprocessing Pipe: ("save", step, start_at),
("load", step, start_at), ("flush", timeout), ("counters",), ("stop",). Every phase is
bounded in time. On --topology netns the process is one host and lives in its namespace.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import trio
import xxhash

from bench.harness_data import ShardMaker
from chunkstore.nodes import NodeInfo, ObjectNode, open_node
from fusefs.client.extents import maybe_inline
from fusefs.client.volume import FileWriter, Volume
from metadata.checkpoints import unpack_extents

PROGRESS_EVERY = 0.25


class RankKilled(Exception):
    """The injected death of a rank in the middle of its save."""


class FaultNode(ObjectNode):
    """A real node that turns slow while the flag file `slow-<name>` exists in the fault dir.

    The flag is a file so the coordinator can slow a node in every worker process at once."""

    def __init__(self, inner: ObjectNode, fault_dir: str, delay: float) -> None:
        self.inner = inner
        self.info = inner.info
        self.flag = os.path.join(fault_dir, f"slow-{inner.name}")
        self.delay = delay
        self._checked = 0.0
        self._slow = False

    def _maybe_wait(self) -> None:
        now = time.monotonic()
        if now - self._checked > 0.2:
            self._checked = now
            self._slow = os.path.exists(self.flag)
        if self._slow:
            time.sleep(self.delay)

    def put(self, cid: bytes, blob: bytes | memoryview) -> None:
        self._maybe_wait()
        self.inner.put(cid, blob)

    def get(self, cid: bytes) -> bytes:
        self._maybe_wait()
        return self.inner.get(cid)

    def exists(self, cid: bytes) -> bool:
        return self.inner.exists(cid)

    def delete(self, cid: bytes) -> None:
        self.inner.delete(cid)

    def list(self):
        return self.inner.list()

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def capacity(self) -> tuple[int, int]:
        return self.inner.capacity()

    def close(self) -> None:
        self.inner.close()


@dataclass
class Host:
    index: int
    name: str
    ranks: list[int]
    vol: Volume
    limiter: trio.CapacityLimiter | None = None


@dataclass
class WorkerState:
    cfg: dict
    hosts: list[Host]
    maker: ShardMaker
    versions: dict[int, dict[int, list[int]]] = field(default_factory=dict)  # step -> rank ->


async def wait_future(fut: Future) -> Any:
    """Await a concurrent Future (a pipelined RPC) without tying up a thread."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_f: Future) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    fut.add_done_callback(wake)
    await done.wait()
    return fut.result()


def open_host(cfg: dict, index: int, ranks: list[int]) -> Host:
    from metadata.client import connect

    meta = connect(cfg.get("urls", {}).get(index) or cfg["url"])
    config = meta.get_config()
    nodes: list[ObjectNode] = [
        FaultNode(
            open_node(NodeInfo(n["name"], n["url"], n["domain"])),
            cfg["fault_dir"],
            cfg["slow_node_delay"],
        )
        for n in config["nodes"]
    ]
    vol = Volume(meta, config, nodes=nodes, workers=cfg["threads_per_host"] * 2)
    name = f"host-{index:03d}"
    vol.attach_tier(
        os.path.join(cfg["staging_root"], name),
        size=cfg["staging_size"],
        durability=cfg["durability"],
    )
    return Host(index, name, ranks, vol)


# -- save ------------------------------------------------------------------------------------
def write_shard(st: WorkerState, host: Host, step: int, rank: int, kill: bool) -> tuple:
    """Chunk, hash, encode and stage one shard (blocking). Returns (file record, new stored)."""
    cfg = st.cfg
    blocks = st.maker.shard(rank, st.versions[step][rank])
    if cfg["corrupt"] == [step, rank]:  # test hook: what is written differs from the seed's
        blocks[0] = bytes([blocks[0][0] ^ 0xFF]) + blocks[0][1:]
    w = FileWriter(host.vol, 0, inline=False)
    try:
        half = st.maker.shard_size // 2
        for blk in blocks:
            if kill and w.size + len(blk) > half:
                w.write(blk[: half - w.size])
                w.flush_data()  # half the shard is staged when the rank dies
                raise RankKilled(f"rank {rank} killed mid-save (injected)")
            w.write(blk)
            w.cut()
        w.close(commit=False)
    except BaseException:
        w.abort()
        raise
    rec = {
        "path": f"rank-{rank:06d}.shard",
        "size": w.size,
        "extents": w.extents,
        "new_chunks": list(w.new_chunks.values()),
    }
    return rec, sum(c.stored_len for c in w.new_chunks.values())


async def save_rank(st: WorkerState, host: Host, step: int, rank: int, start: float, out: list):
    cfg = st.cfg
    r = {
        "rank": rank,
        "host": host.name,
        "start": start,
        "logical": st.maker.shard_size,
        "stored": 0,
        "error": "",
        "killed": False,
    }
    kill = cfg["kill_rank"] == [step, rank]
    try:
        if rank in cfg["slow_ranks"]:
            await trio.sleep(cfg["slow_delay"])
        rec, stored = await trio.to_thread.run_sync(
            write_shard, st, host, step, rank, kill, limiter=host.limiter
        )
        r["stored"] = stored
        r["written"] = time.time()
        fut = host.vol.meta.submit("commit_rank", cfg["job"], step, rank, [rec], host=host.name)
        r["sent"] = time.time()
        await wait_future(fut)
        r["done"] = time.time()
    except RankKilled as e:
        r["error"], r["killed"] = str(e), True
    except Exception as e:  # recorded: the verdict decides what a rank failure means
        r["error"] = f"{type(e).__name__}: {e}"
    out.append(r)


# -- load ------------------------------------------------------------------------------------
def read_shard(st: WorkerState, host: Host, step: int, rank: int, files: list) -> tuple[bool, str]:
    """Fetch the rank's extents through the host tier and compare with the seed's bytes."""
    if len(files) != 1:
        return False, f"manifest lists {len(files)} files for rank {rank}, expected 1"
    f = files[0]
    size = int(f["size"])
    if size != st.maker.shard_size:
        return False, f"size {size}, expected {st.maker.shard_size}"
    buf = bytearray(size)
    covered = 0
    for e in unpack_extents(f["extents"]):
        raw = host.vol.fetch_chunk(e.chunk_id, small=maybe_inline(e))
        buf[e.offset : e.offset + e.length] = raw[e.chunk_off : e.chunk_off + e.length]
        covered += e.length
    if covered != size:
        return False, f"extents cover {covered} of {size} bytes"
    want = st.maker.digest(rank, st.versions[step][rank])
    if xxhash.xxh3_128_digest(bytes(buf)) != want:
        return False, "content differs from what the rank wrote"
    return True, ""


async def load_rank(st: WorkerState, host: Host, step: int, rank: int, start: float, out: list):
    r = {"rank": rank, "host": host.name, "start": start, "bytes": 0, "ok": False, "error": ""}
    try:
        man = await wait_future(host.vol.meta.submit("manifest", st.cfg["job"], step, rank=rank))
        r["manifest"] = time.time()
        ok, why = await trio.to_thread.run_sync(
            read_shard, st, host, step, rank, man["files"], limiter=host.limiter
        )
        r["ok"], r["error"] = ok, why
        r["bytes"] = st.maker.shard_size if ok else 0
        r["done"] = time.time()
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
    out.append(r)


# -- phases ----------------------------------------------------------------------------------
async def run_phase(st: WorkerState, conn, what: str, step: int, start: float) -> list[dict]:
    out: list[dict] = []
    fn = save_rank if what == "save" else load_rank
    total = sum(len(h.ranks) for h in st.hosts)
    for h in st.hosts:
        h.limiter = trio.CapacityLimiter(st.cfg["threads_per_host"])

    async def progress(cancel: trio.CancelScope) -> None:
        sent = -1
        while True:
            n = len(out)
            if n != sent:
                sent = n
                await trio.to_thread.run_sync(conn.send, ("progress", what, n))
            if n >= total:
                cancel.cancel()
                return
            await trio.sleep(PROGRESS_EVERY)

    with trio.move_on_after(max(1.0, start - time.time()) + st.cfg["phase_timeout"]):
        await trio.sleep(max(0.0, start - time.time()))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(progress, nursery.cancel_scope)
            async with trio.open_nursery() as ranks:
                for h in st.hosts:
                    for rank in h.ranks:
                        ranks.start_soon(fn, st, h, step, rank, start, out)
            await trio.sleep(10)  # the progress task ends the scope after its last report
    done = {r["rank"] for r in out}
    for h in st.hosts:  # a rank still running at the phase timeout is a failure, recorded
        for rank in h.ranks:
            if rank not in done:
                out.append(
                    {
                        "rank": rank,
                        "host": h.name,
                        "start": start,
                        "error": "timed out",
                        "killed": False,
                        "ok": False,
                        "logical": 0,
                        "stored": 0,
                        "bytes": 0,
                    }
                )
    return out


def flush_all(st: WorkerState, timeout: float) -> list[dict]:
    out = []
    for h in st.hosts:
        t0 = time.time()
        try:
            h.vol.tier.flush(timeout=timeout)
            out.append({"host": h.name, "ok": True, "s": time.time() - t0, "error": ""})
        except Exception as e:
            out.append({"host": h.name, "ok": False, "s": time.time() - t0, "error": str(e)})
    return out


def counters(st: WorkerState) -> dict:
    """Client failovers (to another service replica) and reconnects, over this process's
    hosts. `failovers` is what the failover client counts; 0 from a client without it."""
    out = {"failovers": 0, "reconnects": 0}
    for h in st.hosts:
        for k in out:
            out[k] += int(getattr(h.vol.meta, k, 0) or 0)
    return out


def worker_main(
    conn, cfg: dict, hosts: list[tuple[int, list[int]]], netns: str | None = None
) -> None:
    """Process entry point (spawned): enter the host's network namespace (--topology
    netns), open the hosts, then obey the coordinator."""
    opened: list[Host] = []
    if cfg.get("log_dir"):  # warnings (a node down, a retry) go to a file, not the terminal
        name = "-".join(f"host-{i:03d}" for i, _ in hosts[:4])
        logging.basicConfig(
            filename=os.path.join(cfg["log_dir"], f"{name}.log"),
            level=logging.WARNING,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        if netns:
            from bench.netns import enter

            os.close(enter(netns))  # for good: this process is the host
        for index, ranks in hosts:
            opened.append(open_host(cfg, index, ranks))
        maker = ShardMaker(cfg["kind"], cfg["seed"], cfg["shard_size"], cfg["block_size"])
        st = WorkerState(cfg, opened, maker)
        conn.send(("ready", os.getpid()))
        while True:
            msg = conn.recv()
            if msg[0] == "save":
                _, step, start = msg
                prev = st.versions.get(step - 1, {})
                st.versions[step] = {
                    r: maker.versions(prev.get(r), step, r, cfg["change_rate"])
                    for h in opened
                    for r in h.ranks
                }
                conn.send(("result", trio.run(run_phase, st, conn, "save", step, start)))
            elif msg[0] == "load":
                _, step, start = msg
                conn.send(("result", trio.run(run_phase, st, conn, "load", step, start)))
            elif msg[0] == "flush":
                conn.send(("result", flush_all(st, msg[1])))
            elif msg[0] == "counters":
                conn.send(("result", counters(st)))
            else:
                break
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        for h in opened:
            try:
                h.vol.close()
            except Exception:  # noqa: S110 - closing at exit; the run's verdict is already out
                pass
        try:
            conn.send(("closed", os.getpid()))
        except OSError:
            pass
