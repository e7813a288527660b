"""The load-test harness behind `ckptfs bench`: thousands of ranks save and load in lockstep.

The coordinator (this module) owns the environment and the clock; worker processes
(bench.harness_worker) own the simulated hosts and their ranks. One step:

  begin(job, step, world)  ->  every rank, at one start time: generate its shard, write it
  through the chunk pipeline into its host's write-behind tier, commit_rank (through its
  host's `ckptfs agent`, each rank its own client of it: bench.harness_agents and
  bench.harness_ranks; with --no-agent, one Volume per host speaks for its ranks)
  ->  the service publishes when the last rank commits (wait_published)  ->  every rank, at
  one start time: fetch its manifest, read its shard back, compare with the seed's bytes.

Faults are injected at `fault_step`: a node dies once a quarter of the ranks have committed
(its directory replaced by a file, or its SeaweedFS server SIGKILLed), one rank dies halfway
through its shard (the step must then be aborted at its deadline), ranks or a node are slowed.
Fleet faults (bench.harness_faults) take one step each from there: a service replica killed
and restarted, a replica hung (SIGSTOP, then SIGCONT), a host's link cut and healed,
PostgreSQL restarted, and a rolling restart of every S3 node across steps.

The verdict (bench.harness_report.judge): every step either published with every byte
verified, or (only where an injected fault made publishing impossible in time) was aborted
with the previous step still the latest and still verified; every staged chunk drained; no
acknowledged write lost (after the faults are undone, the first and last published steps
read back whole); every fault undone; the step a replica hung in published within
HANG_BUDGET_S (5 s) of the steps without faults. Anything else fails the run.

Where it runs (bench.harness_env): on 127.0.0.1 (`loopback`), or with every host, replica,
the database and every node in a network namespace of its own on 198.18.0.0/16 (`netns`,
bench.netns). Every wait has a time bound; everything started is torn down at the end, on
failure and on Ctrl-C or SIGTERM (within seconds: workers and servers still busy then, in a
drain say, are SIGKILLed after a short grace). The fleet is watched (bench.harness_watch): a
replica, S3 node or the database that exits when no fault asked for it ends the run at
once with verdict FAIL, naming it and quoting the end of its log.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.common import disk_read_cold, disk_write, drop_caches
from bench.harness_config import HarnessConfig, HarnessError
from bench.harness_data import ShardMaker
from bench.harness_env import Env
from bench.harness_faults import FaultRunner
from bench.harness_report import breakdown, per_rank_ms
from bench.harness_watch import FleetDown, Watcher
from fusefs.cli.progress import Progress
from metadata.engine import MetaError

READY_TIMEOUT = 180.0
QUICK_STOP = 2.0  # an interrupted or failed run's grace for its workers before SIGKILL


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
    deadline: float = 3600.0
    may_abort: bool = False  # an injected fault may make publishing impossible in time
    save_hosts: list[dict] = field(default_factory=list)  # each host's phase times
    load_hosts: list[dict] = field(default_factory=list)
    cpu: dict = field(default_factory=dict)  # CPU seconds: save/load x client/service
    uploaded: dict = field(default_factory=dict)  # bytes the tiers uploaded during save/load


class Workers:
    """The worker processes and the pipe protocol to them; every wait is bounded.

    `netns`: host index -> network namespace path; a process of one such host enters it
    before it opens anything (bench.netns.enter), so every connection it makes is the
    host's own."""

    def __init__(
        self,
        cfg: HarnessConfig,
        wcfg: dict,
        hosts: list[list[int]],
        groups,
        netns: dict[int, str] | None = None,
        abort: Callable[[], bool] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self.abort = abort  # polled while waiting: the fleet watcher found a server gone
        self.groups = [list(g) for g in groups]
        from bench.harness_worker import worker_main

        try:
            for g in groups:
                parent, child = ctx.Pipe()
                ns = (netns or {}).get(g[0]) if len(g) == 1 else None
                p = ctx.Process(
                    target=worker_main,
                    args=(child, wcfg, [(h, hosts[h]) for h in g], ns),
                    daemon=True,
                )
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self.gather("ready", READY_TIMEOUT, None)
        except BaseException:
            self.stop(grace=QUICK_STOP)
            raise

    def host_pids(self) -> dict[int, int]:
        return {h: p.pid for g, p in zip(self.groups, self.procs, strict=True) for h in g}

    def send(self, msg: tuple) -> None:
        for c in self.conns:
            c.send(msg)

    def gather(self, want: str, timeout: float, on_progress) -> list:
        """One answer per worker (progress messages along the way go to on_progress)."""
        answers: dict[int, object] = {}
        counts = [0] * len(self.conns)
        end = time.monotonic() + timeout
        while len(answers) < len(self.conns):
            if self.abort is not None and self.abort():
                raise FleetDown
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
                        last = msg[1].strip().splitlines()[-1:] or ["?"]
                        raise HarnessError(f"worker {i} failed: {last[0]}")
                    elif msg[0] in ("result", "ready"):
                        answers[i] = msg[1]
                else:
                    i = [p.sentinel for p in self.procs].index(obj)
                    if i not in answers and not self.conns[i].poll():
                        raise HarnessError(f"worker {i} died (exit {self.procs[i].exitcode})")
        return [answers[i] for i in range(len(self.conns))]

    def stop(self, grace: float = 120.0, hurry: threading.Event | None = None) -> None:
        """Ask every worker to close its hosts and exit; SIGKILL those still running after
        `grace` seconds (an interrupted run gives them QUICK_STOP: a worker in the middle
        of a drain or a phase would otherwise finish it first, for up to its timeout)."""
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        end = time.monotonic() + grace
        hurried = False
        for p in self.procs:  # `hurry` set (Ctrl-C during a teardown): QUICK_STOP at most
            while p.is_alive() and time.monotonic() < end:
                if hurry is not None and hurry.is_set() and not hurried:
                    hurried = True
                    end = min(end, time.monotonic() + QUICK_STOP)
                p.join(max(0.01, min(0.2, end - time.monotonic())))
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(10)
        for c in self.conns:
            c.close()
        self.conns = []


def _percentile(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def run(cfg: HarnessConfig, log=None) -> dict:
    """Run the whole benchmark; returns the report dict (see bench.harness_report).

    Whatever happens (an error, Ctrl-C, SIGTERM), everything the run started is stopped
    and removed before this returns or raises: faults undone, workers, servers, the
    namespaces and their links, temporary files."""
    from metadata.client import connect

    cfg.validate()
    if cfg.topology == "netns":  # before anything is made: one line, nothing to undo
        from bench.netns import rights

        reason = rights()
        if reason:
            raise HarnessError(reason)
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    show = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    chunk = cfg.effective_chunk()
    hosts, groups = cfg.layout()
    env = Env(cfg, chunk)
    workers = None
    meta = None
    faults = FaultRunner(cfg, env, say)
    steps: list[StepRecord] = []
    errors: list[str] = []
    t_run = time.time()
    topology: dict = {}
    flush = final = resume = agents = None
    latest = durable = None
    stats: dict = {}
    counters = {"failovers": 0, "reconnects": 0, "hangs": 0}
    baseline: dict = {}
    job = f"bench-{int(t_run)}-{os.getpid()}"
    signals = _Signals()
    watch = Watcher(env.check_fleet, say, signals.wake)
    completed = False
    try:
        env.start(say, len(hosts))
        watch.start()
        topology = env.topology()
        meta = connect(env.url)
        step_bytes = cfg.ranks * cfg.shard_size
        per_host = max(len(h) for h in hosts) * cfg.shard_size
        wcfg = {
            "url": env.url,
            "urls": dict(env.host_urls),
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
            "log_dir": env.log_dir,
        }
        if cfg.agent:
            wcfg["agent_sockets"] = env.start_agents(len(hosts), wcfg["staging_size"])
            if env.fabric:  # where they run, read from /proc
                topology["agents_in"] = env.agent_namespaces()
        say(
            f"ckptfs bench: {cfg.ranks} ranks on {len(hosts)} hosts in {len(groups)} processes, "
            f"{cfg.steps} steps of {step_bytes / 2**20:.0f} MiB ({cfg.data}, change rate "
            f"{cfg.change_rate}, chunks {chunk // 1024} KiB, durability {cfg.durability}, "
            f"topology {cfg.topology}, "
            f"{'each rank a client of its host agent' if cfg.agent else 'no agents'})"
        )
        if faults.plan:
            plan = ", ".join(f"{k} at step {v}" for k, v in faults.plan.items())
            holds = [f"the hang {cfg.hang_s:g}s"] if cfg.hang_meta else []
            if set(faults.plan) - {"hang-meta"}:
                holds.insert(0, f"each down {cfg.fault_hold:g}s")
            say(f"faults: {plan} ({'; '.join(holds)})")
        baseline = _disk_baseline(env.root, min(step_bytes, 2**30), cfg)
        workers = Workers(cfg, wcfg, hosts, groups, env.host_ns, abort=watch.failed.is_set)
        env.worker_pids = workers.host_pids()
        say(_fleet_line(env, workers))
        if cfg.slow_node:
            env.slow_node()
        prev_published: int | None = None
        for step in range(1, cfg.steps + 1):
            rec = _save_step(cfg, env, workers, meta, job, step, show, steps, faults)
            if rec.state == "published":
                rec.loaded_step = step
            else:
                rec.loaded_step = prev_published
            rec.latest_after = _try(errors, "latest", meta.latest, job)
            if rec.loaded_step is not None:
                _load_step(cfg, env, workers, rec, show)
            if rec.state == "published":
                prev_published = step
            steps.append(rec)
            say(_step_line(rec, cfg))
            if cfg.fail_after_step == step:
                raise HarnessError(f"injected failure after step {step} (test hook)")
        faults.finish()
        for r in steps:  # an outage longer than the step's deadline may abort it
            if faults.outage_end(r.step) > r.start + r.deadline:
                r.may_abort = True
        alive = _try(errors, "latest before the drain", meta.latest, job) is not None or not any(
            r.state == "published" for r in steps
        )
        if cfg.durability == "local" and not alive:  # nothing can be marked durable
            flush = {"ok": False, "s": 0.0, "errors": ["the service cannot read its database"]}
        elif cfg.durability == "local":
            t0 = time.time()
            drain = _drain_timeout(cfg)
            say(f"draining the hosts' write-behind tiers (at most {drain:.0f}s) ...")
            workers.send(("flush", drain))
            res = [r for part in workers.gather("flush", drain + 60, None) for r in part]
            flush = {
                "ok": all(r["ok"] for r in res),
                "s": round(time.time() - t0, 3),
                "errors": [f"{r['host']}: {r['error']}" for r in res if not r["ok"]][:5],
            }
        if cfg.resume and any(r.state == "published" for r in steps):
            try:
                resume = _resume(cfg, env, workers, show)
            except HarnessError as e:  # a finding of the run (the verdict fails), not a crash
                resume = {"error": str(e), "verified": 0, "failures": []}
        final = _final_check(cfg, env, workers, meta, job, steps, show, errors)
        workers.send(("counters",))
        for part in workers.gather("counters", 60, None):
            for k in counters:
                counters[k] += int(part.get(k, 0))
        for k in ("failovers", "hangs"):
            counters[k] += int(getattr(meta, k, 0) or 0)
        if env.agents:
            agents = _agents_summary(env)
            # the ranks' connections to the service are their agents': count theirs, the
            # ones a resume restarted too
            earlier = env.agents_before_restart  # (kept even if the resume then failed)
            for k in counters:
                counters[k] += int(agents.get(k, 0)) + int(earlier.get(k, 0))
        latest = _try(errors, "latest", meta.latest, job)
        durable = _try(errors, "latest_durable", meta.latest_durable, job)
        got = _try(errors, "stats", meta.stats)
        stats = got.as_dict() if got is not None else {}
        completed = True
    except FleetDown:  # a server exited unasked: the watcher's finding fails the run
        pass
    finally:
        for _ in range(3):  # a signal that came just as the teardown began: it is begun
            try:
                signals.hold()
                break
            except (KeyboardInterrupt, FleetDown):
                continue
        watch.stop()
        quick = not completed  # interrupted, failed, or a server gone: no waiting on them
        worker_logs = env.log_summary()
        faults.abort(timeout=QUICK_STOP if quick else 90.0)
        if workers is not None:
            workers.stop(grace=QUICK_STOP if quick else 120.0, hurry=signals.hurry)
        if meta is not None:
            _close_bounded(meta, QUICK_STOP)
        env.stop(quick=quick or signals.hurry.is_set())
        signals.restore()
        if env.problems:
            say(f"teardown: {'; '.join(env.problems)}")
    from bench.harness_report import build_report

    return build_report(
        cfg,
        job,
        chunk,
        steps,
        baseline,
        flush,
        latest,
        durable,
        stats,
        env.killed,
        t_run,
        topology=topology,
        faults=faults.as_list(t_run),
        counters=counters,
        final=final,
        errors=watch.findings() + errors + env.problems,
        worker_logs=worker_logs,
        resume=resume,
        process_exits=watch.as_list(),
        agents=agents,
    )


def _agents_summary(env: Env) -> dict:
    """What the hosts' agents counted since they started (bench.harness_agents.summary)."""
    from bench.harness_agents import summary
    from metadata.wire.url import parse_url, resolve_token

    return summary(env.agents, resolve_token(parse_url(env.url)[1]))


def _fleet_line(env: Env, workers: Workers) -> str:
    """Which processes the run watches (and tests find by pid)."""
    servers = ", ".join(f"{name} pid {pid}" for name, pid in env.fleet_pids().items())
    pids = ", ".join(str(p.pid) for p in workers.procs)
    return f"watching the fleet: {servers or 'no servers of its own'}; workers pids {pids}"


def _close_bounded(meta, timeout: float) -> None:
    """Close the coordinator's client, waiting at most `timeout` (a client whose service
    is gone or stopped may take its time; the process exits anyway)."""

    def close() -> None:
        try:
            meta.close()
        except Exception:  # noqa: S110 - closing a client whose service is gone
            pass

    t = threading.Thread(target=close, name="close-meta-client", daemon=True)
    t.start()
    t.join(timeout)


def _drain_timeout(cfg: HarnessConfig) -> float:
    """How long the final drain may take: every byte of the run at a slow 20 MB/s per
    replica, at least 5 minutes, at most --phase-timeout (a drain that cannot finish, as
    against a service that lost its database, ends the run in minutes, not in hours)."""
    total = cfg.steps * cfg.ranks * cfg.shard_size * cfg.replicas
    return min(cfg.phase_timeout, max(300.0, total / 20e6))


class _Signals:
    """SIGTERM ends a run as Ctrl-C does (KeyboardInterrupt, so the teardown runs); the
    fleet watcher ends it with FleetDown (SIGUSR1 sent to the main thread, so whatever the
    coordinator waits on is interrupted); and nothing cuts the teardown short (`hold`).
    Only in the main thread (the only one Python delivers signals to); elsewhere a no-op,
    and the coordinator's waits poll the watcher instead."""

    def __init__(self) -> None:
        self.saved: dict[int, object] = {}
        self._lock = threading.Lock()
        self.armed = False
        self.hurry = threading.Event()  # a signal during the teardown
        if threading.current_thread() is not threading.main_thread():
            return
        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
        self.saved = {s: signal.getsignal(s) for s in sigs}
        signal.signal(signal.SIGTERM, self._interrupt)
        signal.signal(signal.SIGUSR1, self._fleet_down)
        self.armed = True

    @staticmethod
    def _interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    def _fleet_down(self, signum, frame) -> None:
        if self.armed:
            raise FleetDown

    def wake(self) -> None:
        """From the watcher's thread: interrupt the main thread where it waits."""
        with self._lock:
            if self.armed:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)  # type: ignore[arg-type]

    def hold(self) -> None:
        """The teardown begins: from now on no signal interrupts it; Ctrl-C or SIGTERM
        only hurries it (`hurry`: what it still waits for is cut short)."""
        with self._lock:
            self.armed = False
        for s in self.saved:
            handler = signal.SIG_IGN if s == signal.SIGUSR1 else self._hurry
            signal.signal(s, handler)

    def _hurry(self, signum, frame) -> None:
        self.hurry.set()

    def restore(self) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self.saved = {}


def _try(errors: list[str], what: str, fn, *args):
    """A metadata call after the steps: a failure is a finding of the run, not a crash."""
    try:
        return fn(*args)
    except MetaError as e:
        errors.append(f"{what}: {e}")
        return None


def _final_check(cfg, env, workers, meta, job, steps, show, errors) -> dict:
    """No acknowledged write lost: after every fault was undone and the tiers drained,
    every step the run saw published is still published, and the first and the last of
    them read back whole (every rank, every byte compared)."""
    published = [r.step for r in steps if r.state == "published"]
    out: dict = {"ok": True, "steps": [], "not_published_any_more": []}
    if not published:
        return out
    rows = _try(errors, "list_checkpoints", meta.list_checkpoints, job)
    if rows is None:
        out["ok"] = False
        out["error"] = "the service could not list the job's steps"
        return out
    state = {int(r["step"]): r["state"] for r in rows}
    out["not_published_any_more"] = [s for s in published if state.get(s) != "published"]
    for step in sorted({published[0], published[-1]}):
        rec = StepRecord(step)
        rec.loaded_step = step
        _load_step(cfg, env, workers, rec, show, label="final check")
        ok = sum(1 for r in rec.load if r.get("ok"))
        bad = [f"{r['rank']}: {r['error']}" for r in rec.load if not r.get("ok")]
        out["steps"].append({"step": step, "verified": ok, "failures": bad[:5]})
    out["ok"] = not out["not_published_any_more"] and all(
        s["verified"] == cfg.ranks for s in out["steps"]
    )
    return out


def _disk_baseline(root: str, nbytes: int, cfg: HarnessConfig) -> dict:
    """Plain write + fsync of the same kind of bytes to the same disk, then a plain cold read
    of them (bench.common.disk_read_cold): the ratios' bases."""
    maker = ShardMaker(cfg.data, cfg.seed, 4 * 2**20, 4 * 2**20)
    n = max(1, nbytes // (4 * 2**20))
    path = os.path.join(root, "baseline.bin")
    try:
        secs, written = disk_write(path, (maker.block(0, 0, i + 1) for i in range(n)))
        r_secs, read, dropped = disk_read_cold(path)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return {
        "bytes": written,
        "s": round(secs, 4),
        "gbps": round(written / 1e9 / secs, 3),
        "read_s": round(r_secs, 4),
        "read_gbps": round(read / 1e9 / r_secs, 3),
        "read_cold": "page cache dropped" if dropped else "file's pages evicted (fadvise)",
    }


def _save_step(cfg, env, workers, meta, job, step, show, steps, faults) -> StepRecord:
    rec = StepRecord(step)
    faulty = step == cfg.fault_step
    deadline = cfg.deadline
    if deadline is None:
        deadline = 3600.0
        if faulty and cfg.kill_rank:  # the abort comes at the deadline: keep it short
            prev = max((_save_seconds(s) or 0 for s in steps), default=0)
            deadline = max(10.0, 3 * prev)
    rec.deadline = deadline
    try:
        meta.begin(job, step, cfg.ranks, deadline_s=deadline)
    except MetaError as e:  # the service cannot take the step: a finding, not a crash
        rec.state, rec.reason = "not begun", str(e)
        return rec
    if faulty and cfg.kill_rank:
        rec.faults.append(f"kill-rank {cfg.victim()}")
        rec.may_abort = True
    if cfg.slow_node:
        rec.faults.append("slow-node n0")
    if cfg.slow_rank:
        rec.faults.append(f"slow-rank x{cfg.slow_rank}")
    rec.start = time.time() + 0.3
    faults.step_started(rec)

    def progress(n: int) -> None:
        if faulty and cfg.kill_node and not env.killed and n >= max(1, cfg.ranks // 4):
            env.kill_node()
            rec.faults.append(f"kill-node {env.killed} at {n}/{cfg.ranks} ranks")
            rec.may_abort = True
        faults.save_progress(rec, n)

    parts, svc0 = _phase(
        cfg, env, workers, ("save", step, rec.start), f"step {step} save", show, progress
    )
    if faulty and cfg.kill_node and not env.killed:  # a tiny run finished before a report
        env.kill_node()
        rec.faults.append(f"kill-node {env.killed} after the writes")
        rec.may_abort = True
    faults.save_done(rec)
    rec.save = sorted((r for p in parts for r in p["ranks"]), key=lambda r: r["rank"])
    rec.save_hosts = [h for p in parts for h in p["hosts"]]
    rec.cpu["save_client_s"] = sum(p["cpu_s"] for p in parts)
    rec.cpu["save_agents_s"] = sum(p.get("agent_cpu_s", 0.0) for p in parts)
    rec.uploaded["save"] = sum(p.get("uploaded_bytes", 0) for p in parts)
    wait = deadline + 60
    if any(r.get("error") and not r.get("killed") for r in rec.save):
        wait = min(wait, 10.0)  # a rank that failed never commits: the step cannot publish
    try:
        info = meta.wait_published(job, step, timeout=wait)
        rec.state, rec.reason = info["state"], info.get("reason", "")
    except MetaError as e:
        rec.state, rec.reason = "open", f"not published: {e}"
    rec.cpu["save_service_s"] = env.service_cpu() - svc0
    faults.step_done(rec)
    try:
        rec.info = meta.checkpoint_info(job, step)
    except MetaError:
        rec.info = {}
    rec.published = rec.info.get("published")
    return rec


def _load_step(cfg, env, workers, rec: StepRecord, show: bool, label: str = "") -> None:
    rec.load_start = time.time() + 0.3
    what = label or f"step {rec.step} load"
    parts, svc0 = _phase(cfg, env, workers, ("load", rec.loaded_step, rec.load_start), what, show)
    rec.load = sorted((r for p in parts for r in p["ranks"]), key=lambda r: r["rank"])
    rec.load_hosts = [h for p in parts for h in p["hosts"]]
    rec.cpu["load_client_s"] = sum(p["cpu_s"] for p in parts)
    rec.cpu["load_agents_s"] = sum(p.get("agent_cpu_s", 0.0) for p in parts)
    rec.uploaded["load"] = sum(p.get("uploaded_bytes", 0) for p in parts)
    rec.cpu["load_service_s"] = env.service_cpu() - svc0


def _resume(cfg: HarnessConfig, env: Env, workers: Workers, show: bool) -> dict:
    """Restart as a new job: page cache dropped where allowed (root), every host's volume
    opened afresh, every rank on a fresh connection resolving latest_durable, reading its
    shard and verifying it. Timed from the start to the last rank verified."""
    cold = drop_caches()
    svc_before, restart_s = env.service_cpu(), None
    before = None
    if env.agents:  # the host agents restart, their tiers adopting the journals they left
        before = _agents_summary(env)  # what they did until now: the steps' saves and loads
        env.agents_before_restart = before
        t0 = time.time()
        env.restart_agents()
        restart_s = round(time.time() - t0, 3)
    start = time.time() + 0.3
    parts, _ = _phase(cfg, env, workers, ("resume", start), "resume", show)
    svc0 = svc_before  # the agents' reconnects count for the service
    ranks = [r for p in parts for r in p["ranks"]]
    done = [r["done"] for r in ranks if "done" in r]
    secs = max(done) - start if done else None
    ok = [r for r in ranks if r.get("ok")]
    nbytes = sum(r["bytes"] for r in ranks)
    client, service = sum(p["cpu_s"] for p in parts), env.service_cpu() - svc0
    steps = sorted({r["step"] for r in ranks if "step" in r})
    return {
        "step": steps[0] if len(steps) == 1 else steps,
        "s": round(secs, 4) if secs else None,
        "gbps": round(nbytes / 1e9 / secs, 3) if secs else None,
        "verified": len(ok),
        "failures": [f"{r['rank']}: {r['error']}" for r in ranks if not r.get("ok")][:10],
        "cold": cold,
        "agents_restart_s": restart_s,  # before the clock (bench.harness_agents)
        "agents_before_restart": before,
        "cpu_ms_per_rank_agents": round(
            sum(p.get("agent_cpu_s", 0.0) for p in parts) / max(1, len(ranks)) * 1e3, 3
        ),  # fmt: skip
        **per_rank_ms(client, service, max(1, len(ranks))),
        "breakdown": breakdown([h for p in parts for h in p["hosts"]], start, secs),
    }


def _phase(
    cfg: HarnessConfig,
    env: Env,
    workers: Workers,
    msg: tuple,
    label: str,
    show: bool,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[list, float]:
    """Send one phase to every worker and gather their answers under a progress bar
    (`on_progress(ranks done)` too). Returns the answers and the service's CPU seconds
    at the start, for the caller to take the difference when its phase ends."""
    svc0, ag0 = env.service_cpu(), env.agent_cpu()
    workers.send(msg)
    bar = Progress(cfg.ranks, label, enabled=show, unit="ranks")
    seen = [0]

    def progress(n: int) -> None:
        bar.update(n - seen[0])
        seen[0] = n
        if on_progress is not None:
            on_progress(n)

    try:
        parts = workers.gather(msg[0], cfg.phase_timeout + 60, progress)
    finally:
        bar.close()
    if env.agents:  # the agents are the ranks' side: their CPU is client CPU
        ag = env.agent_cpu() - ag0
        parts.append({"ranks": [], "hosts": [], "cpu_s": ag, "agent_cpu_s": ag})
    return parts, svc0


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
