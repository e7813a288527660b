"""One worker process of the load-test harness: a few simulated hosts, their ranks.

With agents (the default) each rank is a client of its host's `ckptfs agent` of its own:
bench.harness_ranks. The rest of this docstring is `--no-agent`, the mode before agents:
each simulated host is a Volume of its own (its own ckptfs:// connection, chunk store and
write-behind tier in its own staging directory), as it would be on a real machine, and it
speaks for its ranks as a host agent would: a trio task per host stages its ranks' shards
in waves through one pass of the chunk sink each (fusefs.client.batch: one hashing task per
pool worker, one "which exist?" query, one sync), sends each wave's commit_rank requests
pipelined on the host's connection (RemoteEngine.submit_many) and awaits their answers
without holding a thread, so thousands of commits can be in flight for the service to
group-commit while the next wave is staged. Loads ask for the manifests of all the host's
ranks in one request (`manifest(job, step, ranks=...)`) and read the shards wave by wave,
the thread that read each verifying it. A resume does not: there each rank is a process
of a restarted job, with a connection and a manifest request of its own.

Every host reports the wall time of its phases (generate, chunk, hash, exist, store, sync,
submit, commit; manifest, read, verify) and every process its CPU seconds, so the report can
say where a rank's time goes (bench.harness_report.breakdown).

The coordinator drives the worker over a multiprocessing Pipe: ("save", step, start_at),
("load", step, start_at), ("resume", start_at), ("flush", timeout), ("counters",),
("stop",). Every phase is bounded in time. On --topology netns the process is one host and
lives in its namespace.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import trio
import xxhash

from bench.harness_data import ShardMaker
from chunkstore.nodes import NodeInfo, ObjectNode, open_node
from fusefs.client.batch import StagedFile, Timings, read_many, stage_files
from fusefs.client.volume import Volume
from metadata.sql.checkpoints import unpack_extents

PROGRESS_EVERY = 0.25


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
    vol: Volume | None  # None with agents: each rank has its own (bench.harness_ranks)
    counted: dict[str, int] = field(
        default_factory=lambda: {"failovers": 0, "reconnects": 0, "hangs": 0}
    )
    uploaded_before: int = 0  # what the tiers this host closed (a resume reopens it) uploaded
    clients: dict[int, Any] = field(default_factory=dict)  # with agents: rank -> its Rank


@dataclass
class WorkerState:
    cfg: dict
    hosts: list[Host]
    maker: ShardMaker
    versions: dict[int, dict[int, list[int]]] = field(default_factory=dict)  # step -> rank ->
    # digests of the seed's bytes for (rank, block versions), taken as the save generated
    # them (before any test-hook corruption): a load compares with these instead of
    # generating every shard a second time
    digests: dict[tuple[int, tuple[int, ...]], bytes] = field(default_factory=dict)
    limiter: Any = None  # with agents: the ranks' threads at once (set in each phase's run)
    nodes: Any = None  # with agents: the nodes the ranks share (harness_ranks.NodesOnce)

    def expected(self, rank: int, step: int) -> bytes:
        """The digest of what `rank` wrote at `step`, by the seed."""
        versions = self.versions[step][rank]
        got = self.digests.get((rank, tuple(versions)))
        return got if got is not None else self.maker.digest(rank, versions)


def open_host(cfg: dict, index: int, ranks: list[int]) -> Host:
    from metadata.client import connect

    if cfg.get("agent_sockets"):  # its ranks open the volume through its agent (open_ranks)
        return Host(index, f"host-{index:03d}", ranks, None)
    meta = connect(cfg.get("urls", {}).get(index) or cfg["url"])
    try:
        config = meta.get_config()
        nodes: list[ObjectNode] = [
            FaultNode(
                open_node(NodeInfo(n["name"], n["url"], n["domain"])),
                cfg["fault_dir"],
                cfg["slow_node_delay"],
            )
            for n in config["nodes"]
        ]
    except BaseException:
        meta.close()
        raise
    vol = Volume(meta, config, nodes=nodes, workers=cfg["threads_per_host"] * 2)
    name = f"host-{index:03d}"
    try:
        vol.attach_tier(
            os.path.join(cfg["staging_root"], name),
            size=cfg["staging_size"],
            durability=cfg["durability"],
        )
    except BaseException:
        vol.close()
        raise
    return Host(index, name, ranks, vol)


# -- save ------------------------------------------------------------------------------------
WAVE_BYTES = 32 * 2**20  # a host stages its ranks in waves of at most this many bytes
WAVE_RANKS = 256  # and at most this many ranks


def waves_of(ranks: list[int], shard_size: int) -> list[list[int]]:
    n = max(1, min(WAVE_RANKS, WAVE_BYTES // max(1, shard_size)))
    return [ranks[i : i + n] for i in range(0, len(ranks), n)]


def _add(into: Timings, more: Timings) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + v


def stage_wave(
    st: WorkerState, host: Host, step: int, ranks: list[int], victim: int | None
) -> tuple[list[StagedFile], Timings]:
    """Generate a wave of the host's shards and stage them through the volume in one pass
    (fusefs.client.batch.stage_files): stored in the host's tier and acknowledged, not
    committed. The killed rank's shard stops halfway (its half is staged, then it dies)."""
    t0 = time.perf_counter()
    if host.vol.tier is not None:  # a save starts now: the host's uploaders hold off
        host.vol.tier.foreground()
    cfg = st.cfg
    shards = []
    for rank in ranks:
        versions = st.versions[step][rank]
        blocks = st.maker.shard(rank, versions)
        st.digests[(rank, tuple(versions))] = st.maker.digest_of(blocks)
        if cfg["corrupt"] == [step, rank]:  # test hook: what is written differs from the seed's
            blocks[0] = bytes([blocks[0][0] ^ 0xFF]) + blocks[0][1:]
        if rank == victim:
            blocks = [b"".join(blocks)[: st.maker.shard_size // 2]]
        shards.append(blocks)
    timings: Timings = {"generate": time.perf_counter() - t0, "_began": t0}
    return stage_files(host.vol, shards, timings), timings


class Answers:
    """Pipelined requests' answers, awaited together: each answer's arrival time is taken in
    the client's I/O thread as it lands, and the trio task wakes once, when the last has."""

    def __init__(self, futs: list[Future]) -> None:
        self.futs = futs
        self.at: list[float] = [0.0] * len(futs)
        self._left = len(futs)
        self._lock = threading.Lock()
        self._done = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        for i, f in enumerate(futs):
            f.add_done_callback(functools.partial(self._arrived, i))

    def _arrived(self, i: int, _f: Future) -> None:
        self.at[i] = time.time()
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            try:
                self._token.run_sync_soon(self._done.set)
            except trio.RunFinishedError:
                pass

    async def wait(self) -> None:
        if self.futs:
            await self._done.wait()


async def save_host(
    st: WorkerState, host: Host, step: int, start: float, out: list, info: list
) -> None:
    """Every rank of one host: its waves staged one after the other, each wave's commits
    sent pipelined (one commit_rank per rank, group-committed by the service) while the
    next wave is staged. The host's phase times go to `info` (bench.harness_report)."""
    cfg = st.cfg
    victim = cfg["kill_rank"][1] if cfg["kill_rank"] and cfg["kill_rank"][0] == step else None
    slow = set(cfg["slow_ranks"]) & set(host.ranks)
    phases: Timings = {}
    waits: list[tuple[Answers, list[dict], float]] = []
    began = time.time()

    def rec(rank: int) -> dict:
        return {
            "rank": rank,
            "host": host.name,
            "start": start,
            "logical": st.maker.shard_size,
            "stored": 0,
            "error": "",
            "killed": False,
        }

    async def run(ranks: list[int], delay: float, nursery: trio.Nursery) -> None:
        if delay:
            await trio.sleep(delay)
            _add(phases, {"injected delay": delay})
        for wave in waves_of(ranks, st.maker.shard_size):
            t_call = time.perf_counter()
            try:
                staged, tm = await trio.to_thread.run_sync(stage_wave, st, host, step, wave, victim)
            except Exception as e:  # recorded: the verdict decides what a rank failure means
                for rank in wave:
                    r = rec(rank)
                    r["error"] = f"{type(e).__name__}: {e}"
                    out.append(r)
                continue
            _add(phases, {"queue": tm.pop("_began") - t_call, **tm})
            t = time.perf_counter()
            written = time.time()
            calls, recs = [], []
            for rank, sf in zip(wave, staged, strict=True):
                r = rec(rank)
                r["stored"], r["written"] = sf.stored, written
                if rank == victim:
                    r["error"], r["killed"] = f"rank {rank} killed mid-save (injected)", True
                    out.append(r)
                    continue
                path = f"rank-{rank:06d}.shard"
                args = (cfg["job"], step, rank, [sf.record(path)])
                calls.append(("commit_rank", args, {"host": host.name}))
                recs.append(r)
            sent = time.time()  # before: an answer may land before submit_many returns
            for r in recs:
                r["sent"] = sent
            try:  # a blocking send (a full socket, a reconnect's resend): not on the loop
                futs = await trio.to_thread.run_sync(host.vol.meta.submit_many, calls)
            except Exception as e:  # the client is closed or failed: these ranks failed
                for r in recs:
                    r["error"] = f"{type(e).__name__}: {e}"
                    out.append(r)
                continue
            answers = Answers(futs)
            _add(phases, {"submit": time.perf_counter() - t})
            waits.append((answers, recs, time.time()))
            nursery.start_soon(acknowledged, answers, recs)

    async def acknowledged(answers: Answers, recs: list[dict]) -> None:
        await answers.wait()
        for r, f, at in zip(recs, answers.futs, answers.at, strict=True):
            try:
                f.result()
                r["done"] = at
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"
            out.append(r)

    async with trio.open_nursery() as nursery:
        fast = [r for r in host.ranks if r not in slow]
        nursery.start_soon(run, fast, 0.0, nursery)
        if slow:
            nursery.start_soon(run, sorted(slow), cfg["slow_delay"], nursery)
    if waits:  # commit: from the last wave's send returning to the last answer of any wave
        submitted = max(w[2] for w in waits)
        last = max(max(a.at, default=t) for a, _, t in waits)
        phases["commit"] = max(0.0, last - submitted)
        info.append(
            {"host": host.name, "began": began, "last": last, "waves": len(waits), "phases": phases}
        )


# -- load ------------------------------------------------------------------------------------
def read_wave(
    st: WorkerState, vol: Volume, step: int, ranks: list[int], mans: list
) -> tuple[list[tuple[bool, str]], Timings]:
    """Read a wave of shards (fusefs.client.batch.read_many: warm ones on this thread, the
    rest on the pool, each read straight into a buffer and verified against the seed's
    bytes by the thread that read it)."""
    t0 = time.perf_counter()
    verify = [0.0]
    lock = threading.Lock()
    files: list[tuple[list, int]] = []
    why: dict[int, str] = {}
    for i, (rank, man) in enumerate(zip(ranks, mans, strict=True)):
        fs = man["files"]
        if len(fs) != 1:
            why[i] = f"manifest lists {len(fs)} files for rank {rank}, expected 1"
            files.append(([], 0))
            continue
        size = int(fs[0]["size"])
        if size != st.maker.shard_size:
            why[i] = f"size {size}, expected {st.maker.shard_size}"
            files.append(([], 0))
            continue
        files.append((unpack_extents(fs[0]["extents"]), size))

    def check(i: int, buf: bytearray) -> tuple[bool, str]:
        if i in why:
            return False, why[i]
        t = time.perf_counter()
        rank = ranks[i]
        covered = sum(e.length for e in files[i][0])
        if covered != len(buf):
            ok, msg = False, f"extents cover {covered} of {len(buf)} bytes"
        elif xxhash.xxh3_128_digest(buf) != st.expected(rank, step):
            ok, msg = False, "content differs from what the rank wrote"
        else:
            ok, msg = True, ""
        with lock:
            verify[0] += time.perf_counter() - t
        return ok, msg

    got = read_many(vol, files, check)
    return got, {"read": time.perf_counter() - t0, "verify (thread-s)": verify[0], "_began": t0}


async def load_host(
    st: WorkerState, host: Host, step: int, start: float, out: list, info: list
) -> None:
    """Every rank of one host: the manifests of all its ranks in one request (the service
    joins its ranks' slices of the step's one encoding), then the shards read and verified
    wave by wave."""
    cfg = st.cfg
    phases: Timings = {}
    began = time.time()
    t = time.perf_counter()
    ask = functools.partial(host.vol.meta.manifest, cfg["job"], step, ranks=host.ranks)
    mans: dict[int, Any] = {rank: {"files": []} for rank in host.ranks}
    try:  # a blocking call: not on the loop
        answer = await trio.to_thread.run_sync(ask)
        for f in answer["files"]:
            if f["rank"] not in mans:
                raise ValueError(f"the manifest lists rank {f['rank']}, not one of this host's")
            mans[f["rank"]]["files"].append(f)
    except Exception as e:
        for rank in host.ranks:
            out.append(_load_rec(host, rank, start, error=f"{type(e).__name__}: {e}"))
        return
    phases["manifest"] = time.perf_counter() - t
    steps = {r: (step, mans[r]) for r in host.ranks}
    await _read_waves(st, host, host.ranks, steps, start, out, phases)
    info.append({"host": host.name, "began": began, "last": time.time(), "phases": phases})


async def _read_waves(
    st: WorkerState,
    host: Host,
    ranks: list[int],
    mans: dict[int, tuple[int, Any]],
    start: float,
    out: list,
    phases: Timings,
) -> None:
    """Read and verify these ranks' shards (rank -> (step, manifest)), wave by wave."""
    for wave in waves_of(ranks, st.maker.shard_size):
        t_call = time.perf_counter()
        steps = {mans[r][0] for r in wave}
        try:
            if len(steps) != 1:
                raise ValueError(f"ranks of one host resolved different steps: {sorted(steps)}")
            got, tm = await trio.to_thread.run_sync(
                read_wave, st, host.vol, steps.pop(), wave, [mans[r][1] for r in wave]
            )
        except Exception as e:
            for rank in wave:
                out.append(_load_rec(host, rank, start, error=f"{type(e).__name__}: {e}"))
            continue
        done = time.time()
        _add(phases, {"queue": tm.pop("_began") - t_call, **tm})
        for rank, (ok, why) in zip(wave, got, strict=True):
            r = _load_rec(host, rank, start, error=why)
            r["ok"], r["done"], r["step"] = ok, done, mans[rank][0]
            r["bytes"] = st.maker.shard_size if ok else 0
            out.append(r)


def _load_rec(host: Host, rank: int, start: float, *, error: str = "") -> dict:
    return {
        "rank": rank,
        "host": host.name,
        "start": start,
        "bytes": 0,
        "ok": False,
        "error": error,
    }


# -- resume ----------------------------------------------------------------------------------
def resolve(url: str, job: str, rank: int, retry_for: float) -> tuple[int | None, Any]:
    """What one rank of a restarted job does first, on a connection of its own: its part of
    the manifest of the latest durable step, in one request (step None)."""
    from metadata.client import connect

    meta = connect(url, retry_for=retry_for)
    try:  # no durable step: ENOENT, recorded for the rank as any error is
        man = meta.manifest(job, None, rank=rank)
        return man["step"], man
    finally:
        meta.close()


async def resume_host(
    st: WorkerState, host: Host, _step: int, start: float, out: list, info: list
) -> None:
    """A restarted job on this host: every rank resolving its part of the latest durable
    step's manifest on a connection of its own (as many at once as the pool has workers),
    beside the host's volume opening afresh (its tier adopting the staging directory it
    left: a rank does not wait for it to ask), then the shards read and verified wave by
    wave. (Reading each wave as soon as it resolved, beside the next ones' resolving, was
    tried: on 2 cores the extra threads cost more than the overlap won, 2.80 s against
    1.93 s for 2,048 ranks.)"""
    cfg = st.cfg
    phases: Timings = {}
    began = time.time()
    for k in host.counted:  # what the old connection counted stays in the report
        host.counted[k] += int(getattr(host.vol.meta, k, 0) or 0)
    workers = host.vol.workers
    t0 = time.perf_counter()
    await trio.to_thread.run_sync(host.vol.close)  # the old process is gone first: the new
    if host.vol.tier is not None:  # tier adopts its journal, as after a real restart
        host.uploaded_before += host.vol.tier.uploaded_bytes  # (its close's uploads included)
    phases["close the old volume"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    url = cfg.get("urls", {}).get(host.index) or cfg["url"]
    deadline = time.monotonic() + cfg["phase_timeout"]
    failed: list[Exception] = []  # the volume did not open

    def one(rank: int) -> tuple[int | None, Any] | Exception:
        left = deadline - time.monotonic()  # a thread cannot be cancelled: bound it here
        if left <= 0:
            return TimeoutError("no time left in the phase")
        try:
            return resolve(url, cfg["job"], rank, retry_for=min(60.0, left))
        except Exception as e:  # noqa: BLE001 - recorded per rank
            return e

    def resolve_all() -> list[tuple[int | None, Any] | Exception]:
        with ThreadPoolExecutor(workers, "resolve") as pool:
            return list(pool.map(one, host.ranks))

    async def open_volume() -> None:
        try:
            host.vol = await trio.to_thread.run_sync(
                lambda: open_host(cfg, host.index, host.ranks).vol
            )
        except Exception as e:  # recorded for every rank of the host: the verdict fails
            failed.append(e)
        phases["open volume (beside, s)"] = time.perf_counter() - t0

    got: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(open_volume)
        got = await trio.to_thread.run_sync(resolve_all)
        phases["connect+resolve"] = time.perf_counter() - t0
    if failed:
        for rank in host.ranks:
            out.append(_load_rec(host, rank, start, error=f"reopening the host: {failed[0]}"))
        return
    phases["open volume (after the resolves)"] = (
        time.perf_counter() - t0 - phases["connect+resolve"]
    )
    found: dict[int, tuple[int, Any]] = {}
    for rank, res in zip(host.ranks, got, strict=True):
        if isinstance(res, Exception):
            out.append(_load_rec(host, rank, start, error=f"{type(res).__name__}: {res}"))
        elif res[0] is None or res[0] not in st.versions:
            out.append(_load_rec(host, rank, start, error=f"latest_durable is {res[0]}"))
        else:
            found[rank] = (res[0], res[1])
    await _read_waves(st, host, [r for r in host.ranks if r in found], found, start, out, phases)
    info.append({"host": host.name, "began": began, "last": time.time(), "phases": phases})


# -- phases ----------------------------------------------------------------------------------
async def run_phase(st: WorkerState, conn, what: str, step: int, start: float) -> dict:
    """One save, load or resume phase of every host of this process. Returns the rank
    records, the hosts' phase times and the process's CPU seconds over the phase."""
    out: list[dict] = []
    hosts: list[dict] = []
    fn = {"save": save_host, "load": load_host, "resume": resume_host}[what]
    if st.cfg.get("agent_sockets"):
        from bench import harness_ranks as hr

        fn = {"save": hr.save_host, "load": hr.load_host, "resume": hr.resume_host}[what]
        st.limiter = trio.CapacityLimiter(hr.THREADS)
    total = sum(len(h.ranks) for h in st.hosts)

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

    cpu0, up0 = _cpu(), _uploaded(st)
    with trio.move_on_after(max(1.0, start - time.time()) + st.cfg["phase_timeout"]):
        await trio.sleep(max(0.0, start - time.time()))
        cpu0, up0 = _cpu(), _uploaded(st)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(progress, nursery.cancel_scope)
            async with trio.open_nursery() as ranks:
                for h in st.hosts:
                    ranks.start_soon(fn, st, h, step, start, out, hosts)
            await trio.sleep(10)  # the progress task ends the scope after its last report
    cpu, uploaded = _cpu() - cpu0, _uploaded(st) - up0
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
    return {"ranks": out, "hosts": hosts, "cpu_s": cpu, "uploaded_bytes": uploaded}


def _uploaded(st: WorkerState) -> int:
    """Bytes this process's tiers uploaded so far: uploads during a phase share its CPU."""
    return sum(
        h.uploaded_before + (h.vol.tier.uploaded_bytes if h.vol and h.vol.tier else 0)
        for h in st.hosts
    )


def _cpu() -> float:
    """CPU seconds of this process so far, every thread (the tier's uploaders too), to the
    nanosecond (CLOCK_PROCESS_CPUTIME_ID): os.times() counts 10 ms ticks, and a small
    run's whole load, once it got cheap, fell under one tick and read as 0."""
    return time.process_time()


def flush_all(st: WorkerState, timeout: float) -> list[dict]:
    out = []
    for h in st.hosts:
        t0 = time.time()
        try:
            if h.vol is None:  # with agents: the host's agent drains its tier
                from bench.harness_ranks import flush

                trio.run(flush, h, timeout)
            else:
                h.vol.tier.flush(timeout=timeout)
            out.append({"host": h.name, "ok": True, "s": time.time() - t0, "error": ""})
        except Exception as e:
            out.append({"host": h.name, "ok": False, "s": time.time() - t0, "error": str(e)})
    return out


def counters(st: WorkerState) -> dict:
    """Client failovers (to another service replica), reconnects and hangs (connections
    left for silence or a missed deadline), over this process's hosts: what the failover
    client counts; 0 from a client without them."""
    out = {"failovers": 0, "reconnects": 0, "hangs": 0}
    for h in st.hosts:
        for k in out:
            out[k] += h.counted[k] + int(getattr(getattr(h.vol, "meta", None), k, 0) or 0)
    return out


def _tie_to_coordinator() -> None:
    """The coordinator ends this process: Ctrl-C at a terminal (SIGINT to the whole
    process group) is the coordinator's to act on, and its teardown stops or SIGKILLs the
    workers; and should the coordinator die without one (SIGKILL), the kernel kills this
    process too (PR_SET_PDEATHSIG) instead of leaving it draining for many minutes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the tie was made
        os._exit(1)


def _open_agent_ranks(st: WorkerState) -> None:
    """Every rank of this process's hosts connects to its host's agent (all at once)."""
    from bench.harness_ranks import NodesOnce, open_ranks

    st.nodes = NodesOnce(st.cfg)

    async def all_hosts() -> None:
        async with trio.open_nursery() as n:
            for h in st.hosts:
                n.start_soon(open_ranks, st.cfg, h, st.nodes)

    trio.run(all_hosts)


def worker_main(
    conn, cfg: dict, hosts: list[tuple[int, list[int]]], netns: str | None = None
) -> None:
    """Process entry point (spawned): enter the host's network namespace (--topology
    netns), open the hosts, then obey the coordinator."""
    opened: list[Host] = []
    _tie_to_coordinator()
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
        if cfg.get("agent_sockets"):
            _open_agent_ranks(st)
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
            elif msg[0] == "resume":
                conn.send(("result", trio.run(run_phase, st, conn, "resume", 0, msg[1])))
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
                if h.vol is None:
                    from bench.harness_ranks import close_ranks

                    close_ranks(h)
                else:
                    h.vol.close()
            except Exception:  # noqa: S110 - closing at exit; the run's verdict is already out
                pass
        try:
            conn.send(("closed", os.getpid()))
        except OSError:
            pass
