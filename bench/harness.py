"""The load-test harness behind `ckptfs bench`: thousands of ranks save and load in lockstep.

The coordinator (this module) owns the environment and the clock; worker processes
(bench.harness_worker) own the simulated hosts and their ranks. One step:

  begin(job, step, world)  ->  every rank, at one start time: generate its shard, write it
  through the chunk pipeline into its host's write-behind tier, commit_rank over ckptfs://
  ->  the service publishes when the last rank commits (wait_published)  ->  every rank, at
  one start time: fetch its manifest, read its shard back, compare with the seed's bytes.

Faults are injected at `fault_step`: a node dies once a quarter of the ranks have committed
(its directory replaced by a file, or its SeaweedFS server SIGKILLed), one rank dies halfway
through its shard (the step must then be aborted at its deadline), ranks or a node are slowed.
The verdict: every step either published with every byte verified, or (only where a fault was
injected) was aborted with the previous step still the latest and still verified. Anything else
fails the run. Everything listens on 127.0.0.1 only; every wait has a time bound.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import sys
import time
from dataclasses import dataclass, field

from bench.common import disk_write
from bench.harness_config import HarnessConfig, HarnessError
from bench.harness_data import ShardMaker
from bench.harness_env import Env
from fusefs.progress import Progress

READY_TIMEOUT = 180.0


@dataclass
class StepRecord:
    step: int
    state: str = "?"
    reason: str = ""
    faults: list[str] = field(default_factory=list)
    save: list[dict] = field(default_factory=list)
    load: list[dict] = field(default_factory=list)
    loaded_step: int | None = None
    latest_after: int | None = None
    start: float = 0.0
    published: float | None = None
    load_start: float = 0.0
    info: dict = field(default_factory=dict)


class Workers:
    """The worker processes and the pipe protocol to them; every wait is bounded."""

    def __init__(self, cfg: HarnessConfig, wcfg: dict, hosts: list[list[int]], groups) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        from bench.harness_worker import worker_main

        for g in groups:
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=worker_main, args=(child, wcfg, [(h, hosts[h]) for h in g]), daemon=True
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.gather("ready", READY_TIMEOUT, None)

    def send(self, msg: tuple) -> None:
        for c in self.conns:
            c.send(msg)

    def gather(self, want: str, timeout: float, on_progress) -> list:
        """One answer per worker (progress messages along the way go to on_progress)."""
        answers: dict[int, object] = {}
        counts = [0] * len(self.conns)
        end = time.monotonic() + timeout
        while len(answers) < len(self.conns):
            left = end - time.monotonic()
            if left <= 0:
                raise HarnessError(f"workers did not answer {want!r} in {timeout:.0f}s")
            ready = mpc.wait(
                [c for i, c in enumerate(self.conns) if i not in answers]
                + [p.sentinel for i, p in enumerate(self.procs) if i not in answers],
                timeout=min(left, 0.5),
            )
            for obj in ready:
                if obj in self.conns:
                    i = self.conns.index(obj)
                    try:
                        msg = obj.recv()
                    except EOFError:
                        raise HarnessError(f"worker {i} exited during {want!r}") from None
                    if msg[0] == "progress":
                        counts[i] = msg[2]
                        if on_progress:
                            on_progress(sum(counts))
                    elif msg[0] == "error":
                        raise HarnessError(f"worker {i} failed:\n{msg[1]}")
                    elif msg[0] in ("result", "ready"):
                        answers[i] = msg[1]
                else:
                    i = [p.sentinel for p in self.procs].index(obj)
                    if i not in answers and not self.conns[i].poll():
                        raise HarnessError(f"worker {i} died (exit {self.procs[i].exitcode})")
        return [answers[i] for i in range(len(self.conns))]

    def stop(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        end = time.monotonic() + 120
        for p in self.procs:
            p.join(max(0.1, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(10)
        for c in self.conns:
            c.close()


def _percentile(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def run(cfg: HarnessConfig, log=None) -> dict:
    """Run the whole benchmark; returns the report dict (see bench.harness_report)."""
    from metadata.client import connect

    cfg.validate()
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    show = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    chunk = cfg.effective_chunk()
    hosts, groups = cfg.layout()
    env = Env(cfg, chunk)
    workers = None
    meta = None
    steps: list[StepRecord] = []
    t_run = time.time()
    try:
        env.start(say)
        meta = connect(env.url)
        job = f"bench-{int(t_run)}-{os.getpid()}"
        step_bytes = cfg.ranks * cfg.shard_size
        per_host = max(len(h) for h in hosts) * cfg.shard_size
        wcfg = {
            "url": env.url,
            "job": job,
            "staging_root": env.staging_root,
            "staging_size": max(256 * 2**20, 4 * per_host),
            "durability": cfg.durability,
            "kind": cfg.data,
            "seed": cfg.seed,
            "shard_size": cfg.shard_size,
            "block_size": chunk,
            "change_rate": cfg.change_rate,
            "threads_per_host": cfg.threads_per_host,
            "fault_dir": env.fault_dir,
            "slow_node_delay": cfg.slow_node_delay,
            "slow_ranks": cfg.slow_ranks(),
            "slow_delay": cfg.slow_delay,
            "kill_rank": [cfg.fault_step, cfg.victim()] if cfg.kill_rank else None,
            "corrupt": list(cfg.corrupt) if cfg.corrupt else None,
            "phase_timeout": cfg.phase_timeout,
        }
        say(
            f"ckptfs bench: {cfg.ranks} ranks on {len(hosts)} hosts in {len(groups)} processes, "
            f"{cfg.steps} steps of {step_bytes / 2**20:.0f} MiB ({cfg.data}, change rate "
            f"{cfg.change_rate}, chunks {chunk // 1024} KiB, durability {cfg.durability})"
        )
        baseline = _disk_baseline(env.root, min(step_bytes, 256 * 2**20), cfg)
        workers = Workers(cfg, wcfg, hosts, groups)
        if cfg.slow_node:
            env.slow_node()
        prev_published: int | None = None
        for step in range(1, cfg.steps + 1):
            rec = _save_step(cfg, env, workers, meta, job, step, show, steps)
            if rec.state == "published":
                rec.loaded_step = step
            else:
                rec.loaded_step = prev_published
            rec.latest_after = meta.latest(job)
            if rec.loaded_step is not None:
                _load_step(cfg, workers, rec, show)
            if rec.state == "published":
                prev_published = step
            steps.append(rec)
            say(_step_line(rec, cfg))
        flush = None
        if cfg.durability == "local":
            t0 = time.time()
            workers.send(("flush", cfg.phase_timeout))
            res = [
                r for part in workers.gather("flush", cfg.phase_timeout + 60, None) for r in part
            ]
            flush = {
                "ok": all(r["ok"] for r in res),
                "s": round(time.time() - t0, 3),
                "errors": [f"{r['host']}: {r['error']}" for r in res if not r["ok"]][:5],
            }
        latest, durable = meta.latest(job), meta.latest_durable(job)
        stats = meta.stats().as_dict()
    finally:
        if workers is not None:
            workers.stop()
        if meta is not None:
            meta.close()
        env.stop()
    from bench.harness_report import build_report

    return build_report(
        cfg, job, chunk, steps, baseline, flush, latest, durable, stats, env.killed, t_run
    )


def _disk_baseline(root: str, nbytes: int, cfg: HarnessConfig) -> dict:
    """Plain write + fsync of the same kind of bytes to the same disk: the ratio's base."""
    maker = ShardMaker(cfg.data, cfg.seed, 4 * 2**20, 4 * 2**20)
    n = max(1, nbytes // (4 * 2**20))
    path = os.path.join(root, "baseline.bin")
    try:
        secs, written = disk_write(path, (maker.block(0, 0, i + 1) for i in range(n)))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return {"bytes": written, "s": round(secs, 4), "gbps": round(written / 1e9 / secs, 3)}


def _save_step(cfg, env, workers, meta, job, step, show, steps) -> StepRecord:
    rec = StepRecord(step)
    faulty = step == cfg.fault_step
    deadline = cfg.deadline
    if deadline is None:
        deadline = 3600.0
        if faulty and cfg.kill_rank:  # the abort comes at the deadline: keep it short
            prev = max((_save_seconds(s) or 0 for s in steps), default=0)
            deadline = max(10.0, 3 * prev)
    meta.begin(job, step, cfg.ranks, deadline_s=deadline)
    if faulty and cfg.kill_rank:
        rec.faults.append(f"kill-rank {cfg.victim()}")
    if cfg.slow_node:
        rec.faults.append("slow-node n0")
    if cfg.slow_rank:
        rec.faults.append(f"slow-rank x{cfg.slow_rank}")
    rec.start = time.time() + 0.3
    workers.send(("save", step, rec.start))
    bar = Progress(cfg.ranks, f"step {step} save", enabled=show, unit="ranks")
    seen = [0]

    def progress(n: int) -> None:
        bar.update(n - seen[0])
        seen[0] = n
        if faulty and cfg.kill_node and not env.killed and n >= max(1, cfg.ranks // 4):
            env.kill_node()
            rec.faults.append(f"kill-node {env.killed} at {n}/{cfg.ranks} ranks")

    try:
        parts = workers.gather("save", cfg.phase_timeout + 60, progress)
    finally:
        bar.close()
    if faulty and cfg.kill_node and not env.killed:  # a tiny run finished before a report
        env.kill_node()
        rec.faults.append(f"kill-node {env.killed} after the writes")
    rec.save = sorted((r for p in parts for r in p), key=lambda r: r["rank"])
    info = meta.wait_published(job, step, timeout=deadline + 60)
    rec.state, rec.reason = info["state"], info.get("reason", "")
    rec.info = meta.checkpoint_info(job, step)
    rec.published = rec.info.get("published")
    return rec


def _load_step(cfg, workers, rec: StepRecord, show: bool) -> None:
    rec.load_start = time.time() + 0.3
    workers.send(("load", rec.loaded_step, rec.load_start))
    bar = Progress(cfg.ranks, f"step {rec.step} load", enabled=show, unit="ranks")
    seen = [0]

    def progress(n: int) -> None:
        bar.update(n - seen[0])
        seen[0] = n

    try:
        parts = workers.gather("load", cfg.phase_timeout + 60, progress)
    finally:
        bar.close()
    rec.load = sorted((r for p in parts for r in p), key=lambda r: r["rank"])


def _save_seconds(rec: StepRecord) -> float | None:
    if rec.published:
        return rec.published - rec.start
    done = [r["done"] for r in rec.save if "done" in r]
    return max(done) - rec.start if done else None


def _step_line(rec: StepRecord, cfg: HarnessConfig) -> str:
    s = _save_seconds(rec)
    ok = sum(1 for r in rec.load if r.get("ok"))
    what = f"step {rec.step}: {rec.state}"
    if s is not None:
        what += f" in {s:.2f}s"
    if rec.loaded_step is not None:
        what += f"; load of step {rec.loaded_step}: {ok}/{cfg.ranks} ranks verified"
    if rec.faults:
        what += f"  [{'; '.join(rec.faults)}]"
    return what
