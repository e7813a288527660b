"""Faults as a fleet has them, injected while the harness saves and loads.

Point faults each hit one step (HarnessConfig.fault_steps): `kill-meta` SIGKILLs a service
replica once a quarter of the step's ranks have committed and restarts it `fault_hold`
seconds later; `hang-meta` SIGSTOPs the same replica as its step's save starts and SIGCONTs
it `hang_s` seconds later (HANG_S, 10 s: it hangs with its connections open, so only the
clients' silence probes and deadlines take the fleet elsewhere; at the start, because a
save's commits come in one burst at its end, which a quarter-of-the-ranks trigger misses
in a quick step: this way every commit of the step meets the stopped replica);
`partition-host` cuts one host's link once an eighth have committed (in the middle of that
host's save) and heals it after `fault_hold`; `restart-db` stops PostgreSQL
(a clean, client-disconnecting shutdown) at a quarter and starts it after `fault_hold`. A
step too quick for a progress report gets its fault when its writes are done. The rolling
restart ("daily maintenance") starts with its step's save and restarts every S3 node, one
after another, for as many steps as that takes.

Each fault runs in a thread of its own, so the coordinator keeps driving the step while a
component is down, and records what it did, when, how long the component was gone, and
when the system recovered: the component back AND the step it hit finished (published or
aborted). A hang is the exception: the fleet must recover while the replica is still
stopped, so its recovery is the step finished AND a client that was talking to the stopped
replica answered by another (a probe client the fault opens on it before the stop and
sends one quick call through after it: `answered_s`); the resume is still required for
the fault to count as undone. `finish` waits for every fault to be undone before the run
drains and checks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.harness_config import HarnessConfig, HarnessError
from bench.harness_env import Env
from metadata.engine import MetaError

PROBE_JOB = "bench-hang-probe"  # the hang probe asks `latest` of a job nobody writes
REPLICA_BACK_S = 120.0  # how long a hang waits for its replica to be serving first
BETWEEN_NODES = 1.0  # a rolling restart's pause between one node back and the next down
FINISH_TIMEOUT = 300.0


@dataclass
class FaultRecord:
    what: str  # kill-meta, hang-meta, partition-host, restart-db, rolling-restart
    target: str  # m1, host-002, db, n0
    step: int  # the step in flight when it was injected
    at: float  # time.time() of the injection
    back_at: float | None = None  # the component serving again
    step_done_at: float | None = None
    error: str = ""
    answered_at: float | None = None  # hang-meta: the probe's call answered by another replica
    probe: str = ""  # hang-meta: which replica the probe client was on before the stop

    def recovered_at(self) -> float | None:
        if self.back_at is None or self.step_done_at is None:
            return None
        if self.what == "hang-meta":  # recovered without waiting for the resume
            if self.answered_at is None:
                return None
            return max(self.answered_at, self.step_done_at)
        return max(self.back_at, self.step_done_at)

    def as_dict(self, t0: float) -> dict:
        rec = self.recovered_at()
        extra = {}
        if self.what == "hang-meta":
            extra = {
                "answered_s": round(self.answered_at - self.at, 3) if self.answered_at else None,
                "probe_on": self.probe,
            }
        return {
            "what": self.what,
            "target": self.target,
            "step": self.step,
            "at_s": round(self.at - t0, 3),
            "down_s": round(self.back_at - self.at, 3) if self.back_at else None,
            "recovered_s": round(rec - self.at, 3) if rec else None,
            "recovered": rec is not None and not self.error,
            "error": self.error,
            **extra,
        }


class FaultRunner:
    """Injects the fleet faults of a run; called by the coordinator at step events."""

    def __init__(self, cfg: HarnessConfig, env: Env, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.env = env
        self.say = say
        self.plan = cfg.fault_steps()
        self.records: list[FaultRecord] = []
        self.fired: set[str] = set()
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()
        self.step_ends: dict[int, float] = {}
        self._lock = threading.Lock()
        self.rec = None  # the StepRecord in flight
        self.hanging: FaultRecord | None = None  # a hang-meta whose replica is stopped now

    # -- events from the coordinator ----------------------------------------------------------
    def step_started(self, rec) -> None:
        self.rec = rec
        hang = self.hanging
        if hang is not None:  # not a step without faults: its replica is still stopped
            self._note(rec, f"hang-meta {hang.target} still stopped")
        if self.plan.get("rolling-restart") == rec.step:
            self._fire("rolling-restart", self._rolling)
        if self.plan.get("hang-meta") == rec.step:
            self._fire("hang-meta", self._point, "hang-meta", None)

    def save_progress(self, rec, n: int) -> None:
        ranks = self.cfg.ranks
        for name, frac in (("kill-meta", 4), ("partition-host", 8), ("restart-db", 4)):
            if self.plan.get(name) == rec.step and n >= max(1, ranks // frac):
                self._fire(name, self._point, name, n)

    def save_done(self, rec) -> None:
        for name in ("kill-meta", "partition-host", "restart-db"):
            if self.plan.get(name) == rec.step:
                self._fire(name, self._point, name, None)

    def step_done(self, rec) -> None:
        now = time.time()
        with self._lock:
            self.step_ends[rec.step] = now
            for r in self.records:
                if r.step == rec.step and r.step_done_at is None:
                    r.step_done_at = now

    # -- the faults -------------------------------------------------------------------------
    def _fire(self, name: str, fn, *args) -> None:
        with self._lock:
            if name in self.fired:
                return
            self.fired.add(name)
        t = threading.Thread(target=self._guarded, args=(name, fn, *args), daemon=True)
        t.name = f"fault-{name}"
        self.threads.append(t)
        t.start()

    def _guarded(self, name: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # recorded: the verdict fails a fault that did not recover
            with self._lock:
                open_ = [r for r in self.records if r.what == name and r.back_at is None]
                for r in open_:
                    r.error = r.error or f"{type(e).__name__}: {e}"
                if not open_:
                    step = self.rec.step if self.rec else 0
                    self.records.append(FaultRecord(name, "?", step, time.time(), error=f"{e}"))

    def _record(self, what: str, target: str) -> FaultRecord:
        rec = self.rec
        r = FaultRecord(what, target, rec.step if rec else 0, time.time())
        with self._lock:
            if r.step in self.step_ends:  # the step ended before the fault came
                r.step_done_at = self.step_ends[r.step]
            self.records.append(r)
        return r

    def _hold(self) -> None:
        self.stop.wait(self.cfg.fault_hold)

    def _point(self, name: str, n: int | None) -> None:
        env, cfg, rec = self.env, self.cfg, self.rec
        when = f"at {n}/{cfg.ranks} ranks" if n is not None else "after the writes"
        if name == "kill-meta":
            i = cfg.meta_victim()
            r = self._record(name, f"m{i}")
            env.kill_meta(i)
            self._note(rec, f"kill-meta m{i} {when}")
            self._hold()
            env.start_meta(i)
        elif name == "hang-meta":
            r = self._hang("as the save starts")
        elif name == "partition-host":
            h = cfg.partition_victim()
            r = self._record(name, f"host-{h:03d}")
            env.cut_host(h)
            self._note(rec, f"partition-host host-{h:03d} {when}")
            try:
                self._hold()
            finally:
                env.heal_host(h)
        elif name == "restart-db":
            r = self._record(name, "db")
            env.stop_db()
            self._note(rec, f"restart-db {when}")
            self._hold()
            env.start_db()
        else:
            raise HarnessError(f"unknown fault {name}")
        r.back_at = time.time()
        self.say(f"  {name} {r.target}: back after {r.back_at - r.at:.1f}s")

    def _hang(self, when: str) -> FaultRecord:
        """SIGSTOP the victim replica for cfg.hang_s; meanwhile time how long a client that
        was talking to it takes to be answered by another replica."""
        from metadata.client import connect

        env, cfg, rec = self.env, self.cfg, self.rec
        i = cfg.meta_victim()
        end = time.monotonic() + REPLICA_BACK_S  # a --kill-meta of the step before: its restart
        while f"m{i}" in env.on_purpose and time.monotonic() < end and not self.stop.is_set():
            time.sleep(0.1)
        probe = connect(env.replica_first_url(i))  # before the stop: on replica i
        try:
            probe.latest(PROBE_JOB)
            if rec is not None:  # the moment every rank starts its save
                self.stop.wait(max(0.0, rec.start - time.time()))
            on = f"{probe.host}:{probe.port}"
            where = {s.address: f"m{k}" for k, s in enumerate(env.servers)}.get(on, on)
            r = self._record("hang-meta", f"m{i}")
            r.probe = where
            env.hang_meta(i)
            self.hanging = r
            self._note(rec, f"hang-meta m{i} {when} for {cfg.hang_s:g}s")
            try:
                try:
                    probe.latest(PROBE_JOB)
                    r.answered_at = time.time()
                except MetaError as e:
                    r.error = f"a client on the stopped replica got no answer: {e}"
                self.say(
                    f"  hang-meta m{i}: a client on it answered after "
                    f"{(r.answered_at or time.time()) - r.at:.1f}s (probe on {where})"
                )
                self.stop.wait(max(0.0, r.at + cfg.hang_s - time.time()))
            finally:
                env.resume_meta(i)
                self.hanging = None
            return r
        finally:
            _close_soon(probe)

    def _rolling(self) -> None:
        env = self.env
        for i in range(len(env.weeds)):
            if self.stop.is_set():
                return
            if env.killed == f"n{i}":
                continue
            rec = self.rec
            r = self._record("rolling-restart", f"n{i}")
            self._note(rec, f"rolling-restart n{i}")
            r.at = env.restart_node(i)
            r.back_at = time.time()
            self.say(f"  rolling-restart n{i}: back after {r.back_at - r.at:.1f}s")
            self.stop.wait(BETWEEN_NODES)

    @staticmethod
    def _note(rec, text: str) -> None:
        if rec is not None:
            rec.faults.append(text)

    # -- end ----------------------------------------------------------------------------------
    def finish(self, timeout: float = FINISH_TIMEOUT) -> None:
        """Wait until every fault has been undone (bounded); a fault still running then is
        recorded as not recovered."""
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, end - time.monotonic()))
        with self._lock:
            for r in self.records:
                if r.back_at is None and not r.error:
                    r.error = f"not back after {timeout:.0f}s"

    def abort(self, timeout: float = 90.0) -> None:
        """Teardown: cut every hold short, and give running restarts a bounded while (an
        interrupted run gives them a moment: the servers they restart are closed next, and
        a restart racing that fails instead of starting anything)."""
        self.stop.set()
        self.finish(timeout=timeout)

    def as_list(self, t0: float) -> list[dict]:
        with self._lock:
            return [r.as_dict(t0) for r in sorted(self.records, key=lambda r: r.at)]

    def outage_end(self, step: int) -> float:
        """When the last fault that hit `step` was undone (inf if one never was)."""
        ends = [r.back_at or float("inf") for r in self.records if r.step == step]
        return max(ends, default=0.0)


def _close_soon(client) -> None:
    """Close a client in the background (one that last talked to a stopped replica may
    take its time; nothing waits for it)."""

    def close() -> None:
        try:
            client.close()
        except Exception:  # noqa: S110 - closing a probe client
            pass

    threading.Thread(target=close, name="close-hang-probe", daemon=True).start()
