"""The load-test harness: real runs (meta serve, worker processes, tiers) and its verdict."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bench.harness import HarnessConfig, HarnessError, run
from bench.harness_report import format_table, judge, plot
from bench.servers.postgres import pg_available
from bench.servers.seaweed import weed_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(ranks=64, hosts=2, shard_size=64 * 1024, progress=False)


def _cfg(tmp_path, **kw) -> HarnessConfig:
    return HarnessConfig(**{**SMALL, "workdir": str(tmp_path), **kw})


def test_small_run_end_to_end(tmp_path):
    rep = run(  # --no-agent: each simulated host one Volume, its phases timed in sequence
        _cfg(
            tmp_path,
            steps=2,
            change_rate=0.25,
            chunk_size=64 * 1024,
            shard_size=256 * 1024,
            resume=True,
            agent=False,
        )
    )
    assert rep["agents"] is None
    assert rep["verdict"]["ok"], rep["verdict"]
    s1, s2 = rep["steps"]
    for s in (s1, s2):
        assert s["state"] == "published"
        assert s["verified"] == 64 and not s["verify_failures"]
        assert s["ranks_committed"] == 64 and s["publish_ms"] is not None
        assert s["save_p50_s"] <= s["save_p99_s"] <= s["save_max_s"]
        # where the time went: phases timed one by one add up to the measured time
        for b in (s["save_breakdown"], s["load_breakdown"]):  # within 10% (or 50 ms: tiny)
            assert abs(b["gap_s"]) <= max(0.10 * b["measured_s"], 0.05), b
            assert b["sum_s"] == pytest.approx(sum(b["phases_s"].values()), abs=1e-3)
        assert {"generate", "hash", "exist", "store", "sync", "commit", "publish"} <= set(
            s["save_breakdown"]["phases_s"]
        )
        assert {"manifest", "read"} <= set(s["load_breakdown"]["phases_s"])
        for what in ("save", "load"):  # the service's share of a tiny load can be < 1 tick
            assert s[f"cpu_ms_per_rank_{what}_client"] > 0
            assert s[f"cpu_ms_per_rank_{what}_service"] >= 0
        assert s["cpu_ms_per_rank_save"] >= s["cpu_ms_per_rank_save_client"] > 0
    # a restarted job: fresh volumes and connections, latest_durable, every shard verified
    r = rep["resume"]
    assert r["step"] == 2 and r["verified"] == 64 and not r["failures"]
    b = r["breakdown"]
    assert abs(b["gap_s"]) <= max(0.10 * b["measured_s"], 0.05), b
    assert rep["resume_vs_disk"] > 0 and rep["load_vs_disk"] > 0
    assert rep["baseline_disk"]["read_gbps"] > 0
    assert rep["step2_vs_step1"] > 0
    # background uploads seen inside the phases: never more than was stored (each chunk
    # is uploaded once, counted once however many replicas it gets)
    during = sum(s[f"uploaded_mib_during_{w}"] for s in (s1, s2) for w in ("save", "load"))
    assert during * 2**20 <= 1.01 * (s1["stored_bytes"] + s2["stored_bytes"]) + 2**20
    assert s1["stored_ratio"] == pytest.approx(1.0, abs=0.01)  # random data: nothing to save
    assert 0.1 < s2["stored_ratio"] < 0.45  # ~25% of the blocks changed
    assert rep["latest"] == rep["latest_durable"] == 2
    table = format_table(rep)
    assert "verdict: PASS" in table and "published" in table
    paths = plot(rep, str(tmp_path / "plots"))
    assert all(os.path.getsize(p) > 1000 for p in paths)
    assert not os.listdir(tmp_path) or os.listdir(tmp_path) == ["plots"]  # env removed


def test_ranks_through_their_host_agents(tmp_path):
    """The default: a `ckptfs agent` per host, each rank a client of its own (a connection,
    a Volume and a stager each); the service sees one connection per host, not per rank,
    and a resume restarts the agents and reconnects every rank."""
    rep = run(
        _cfg(tmp_path, ranks=16, steps=2, change_rate=0.25, shard_size=256 * 1024, resume=True)
    )
    assert rep["verdict"]["ok"], rep["verdict"]
    before, after = rep["resume"]["agents_before_restart"], rep["agents"]
    for a in (before, after):  # (+2 a host: the coordinator's, warming up and asking stats)
        assert a["agents"] == 2 and not a["errors"], a
        assert a["ranks_served"] == 16 + 2 * 2, a  # each rank its own connection to its agent
        assert a["upstream_connections"] == 2, a  # ... and one to the service per host
        assert a["uploader_threads"] > 0  # the agents upload; the ranks run no uploaders
    # two steps' saves and loads went through the agents: per rank, at least its manifest
    # twice, a commit and a staged chunk's adoption each step
    assert before["requests"] >= 16 * 6, before
    assert after["requests"] >= 16, after  # the resume's manifests, through the new agents
    for s in rep["steps"]:
        assert s["state"] == "published" and s["verified"] == 16
        assert s["cpu_ms_per_rank_save_agents"] > 0  # (a tiny load can be under one tick)
        assert s["cpu_ms_per_rank_save_client"] >= s["cpu_ms_per_rank_save_agents"]
        assert {"generate (rank thread-s)", "exist (rank thread-s)", "sync (rank thread-s)"} <= set(
            s["save_breakdown"]["aside"]
        )
    r = rep["resume"]
    assert r["verified"] == 16 and r["agents_restart_s"] > 0, r
    assert r["cpu_ms_per_rank_service"] >= 0 and r["cpu_ms_per_rank_agents"] >= 0
    assert "cpu_ms_per_rank_save_service" in rep and "cpu_ms_per_rank_load_service" in rep
    assert not os.listdir(tmp_path)  # sockets, staging and logs removed


def test_corrupted_data_fails_the_verdict(tmp_path):
    # rank 5 writes bytes that differ from its seed at step 1: the store is self-consistent,
    # only the harness's verification can notice, and it must fail the run.
    rep = run(_cfg(tmp_path, steps=1, corrupt=[1, 5]))
    assert not rep["verdict"]["ok"]
    s = rep["steps"][0]
    assert s["state"] == "published"
    assert s["verified"] == 63
    assert s["verify_failures"][0].startswith("5: content differs")
    assert "FAIL" in format_table(rep)


def test_killed_rank_aborts_step_and_keeps_previous(tmp_path):
    rep = run(_cfg(tmp_path, steps=3, kill_rank=True, deadline=4.0))
    assert rep["verdict"]["ok"], rep["verdict"]
    s1, s2, s3 = rep["steps"]
    assert s1["state"] == "published" and s3["state"] == "published"
    assert s2["state"] == "aborted" and "missing ranks 32" in s2["reason"]
    assert s2["killed_ranks"] == [32]
    assert s2["loaded_step"] == 1 and s2["latest_after"] == 1 and s2["verified"] == 64


def test_killed_node_mid_save_still_verifies(tmp_path):
    rep = run(_cfg(tmp_path, steps=2, kill_node=True, fault_step=1, durability="remote"))
    assert rep["verdict"]["ok"], rep["verdict"]
    assert rep["killed_node"] == "n0"
    assert any(f.startswith("kill-node n0") for f in rep["steps"][0]["faults"])
    assert all(s["verified"] == 64 for s in rep["steps"])


def _summary(step: int, state: str, *, verified: int = 4, faults=(), loaded=None, latest=None):
    return {
        "step": step,
        "state": state,
        "reason": "",
        "faults": list(faults),
        "verified": verified,
        "verify_failures": [] if verified == 4 else ["1: content differs"],
        "loaded_step": loaded if loaded is not None else step,
        "latest_after": latest if latest is not None else step,
    }


def test_judge_rules():
    ok = [_summary(1, "published"), _summary(2, "published")]
    assert judge(ok, 4, None, 2, 2)["ok"]
    # one rank's bytes wrong after publish
    assert not judge([_summary(1, "published", verified=3)], 4, None, 1, 1)["ok"]
    # an abort nobody caused
    bad = [_summary(1, "published"), _summary(2, "aborted", loaded=1, latest=1)]
    assert not judge(bad, 4, None, 1, 1)["ok"]
    # an abort from a killed rank with the previous step intact
    good = [
        _summary(1, "published"),
        _summary(2, "aborted", faults=["kill-rank 2"], loaded=1, latest=1),
    ]
    assert judge(good, 4, None, 1, 1)["ok"]
    # ... but not if `latest` moved or the previous step no longer verifies
    moved = [
        _summary(1, "published"),
        _summary(2, "aborted", faults=["kill-rank 2"], loaded=1, latest=2),
    ]
    assert not judge(moved, 4, None, 1, 1)["ok"]
    lost = [
        _summary(1, "published"),
        _summary(2, "aborted", faults=["kill-rank 2"], loaded=1, latest=1, verified=2),
    ]
    assert not judge(lost, 4, None, 1, 1)["ok"]
    # staged data that never became durable
    assert not judge(ok, 4, {"ok": False, "s": 1.0, "errors": ["x"]}, 2, 1)["ok"]
    assert not judge([_summary(1, "open")], 4, None, None, None)["ok"]


def test_bad_options_are_one_line_errors(tmp_path):
    with pytest.raises(HarnessError, match="fault-step"):
        _cfg(tmp_path, steps=1, kill_rank=True, fault_step=1).validate()
    with pytest.raises(HarnessError, match="change-rate"):
        _cfg(tmp_path, change_rate=1.5).validate()
    with pytest.raises(HarnessError, match="only with --embedded"):
        _cfg(tmp_path, volume=str(tmp_path), kill_node=True).validate()

    def cli(*args: str):
        return subprocess.run(
            [sys.executable, "-m", "fusefs.cli", "bench", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    res = cli("--ranks", "8")
    assert res.returncode == 1 and "either VOLUME" in res.stderr and "Traceback" not in res.stderr
    res = cli("--embedded", "--hosts", "9", "--ranks", "8")
    assert res.returncode == 1 and "--hosts" in res.stderr and "Traceback" not in res.stderr
    res = cli(
        str(tmp_path / "nothing-here"),
        "--ranks",
        "4",
        "--hosts",
        "1",
        "--steps",
        "1",
        "--workdir",
        str(tmp_path),
    )
    assert res.returncode == 1 and "no volume" in res.stderr and "Traceback" not in res.stderr


def test_cli_json_and_exit_status(tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusefs.cli",
            "bench",
            "--embedded",
            "--ranks",
            "16",
            "--hosts",
            "2",
            "--shard-size",
            "64KiB",
            "--steps",
            "1",
            "--data",
            "bf16",
            "--durability",
            "remote",  # encoded on the way (a local tier stages raw, compresses at upload)
            "--json",
            str(out),
            "--workdir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "verdict: PASS" in res.stdout
    rep = json.loads(out.read_text())
    assert rep["steps"][0]["verified"] == 16
    assert rep["steps"][0]["stored_ratio"] < 0.95  # bf16 weights compress


def test_judge_killed_rank_cannot_publish():
    s = _summary(2, "published", faults=["kill-rank 2"])
    assert not judge([_summary(1, "published"), s], 4, None, 2, 2)["ok"]


# -- the fleet watched: a server gone unasked fails the run; signals end it in seconds ---------
def _fleet_pids(lines: list[str]) -> dict[str, int]:
    """The harness's own record of its processes: its `watching the fleet:` line."""
    line = next(ln for ln in lines if ln.startswith("watching the fleet:"))
    servers, _, workers = line.partition("; workers pids ")
    out = {}
    for part in servers.split(":", 1)[1].split(","):
        words = part.split()
        if len(words) == 3 and words[1] == "pid":
            out[words[0]] = int(words[2])
    for i, pid in enumerate(workers.split(",")):
        out[f"worker{i}"] = int(pid)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _processes_mentioning(text: str) -> list[str]:
    res = subprocess.run(["pgrep", "-af", text], capture_output=True, text=True)
    return [ln for ln in res.stdout.splitlines() if "pgrep" not in ln]


_WEED = pytest.mark.skipif(weed_path() is None, reason="SeaweedFS (`weed`) not installed")
_PG = pytest.mark.skipif(pg_available() is not None, reason=pg_available() or "")


@pytest.mark.parametrize(
    "victim, kw",
    [
        ("m0", {}),
        pytest.param("n1", {"nodes": "s3", "node_count": 2}, marks=_WEED),
        pytest.param("db", {"db": "postgres"}, marks=_PG),
    ],
    ids=["meta-replica", "seaweed-node", "postgres"],
)
def test_a_server_that_exits_unasked_fails_the_run(tmp_path, victim, kw):
    """A service replica, an S3 node or the database killed from outside mid-run (no fault
    asked for it): the run ends within seconds, FAIL, naming the process and its log's end,
    and leaves nothing behind."""
    lines: list[str] = []
    killed: list[float] = []

    def killer() -> None:
        end = time.monotonic() + 90
        while time.monotonic() < end and not any(ln.startswith("step 1:") for ln in lines):
            time.sleep(0.05)
        pids = _fleet_pids(lines)
        killed.append(time.monotonic())
        os.kill(pids[victim], signal.SIGKILL)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    cfg = _cfg(tmp_path, ranks=16, steps=200, phase_timeout=60, **kw)
    rep = run(cfg, log=lines.append)
    ended = time.monotonic()
    t.join(5)
    assert killed, lines
    assert ended - killed[0] < 15, f"the run took {ended - killed[0]:.1f}s to end"
    assert not rep["verdict"]["ok"]
    (ex,) = rep["process_exits"]
    assert ex["name"] == victim and ex["pid"] == _fleet_pids(lines)[victim]
    fail = [ln for ln in rep["verdict"]["lines"] if ln.startswith("FAIL fleet:")]
    assert fail and f" {victim} (pid {ex['pid']})" in fail[0] and "no fault asked" in fail[0]
    if victim == "n1":  # a SeaweedFS log always has lines: the report quotes its end
        assert ex["tail"] and ex["tail"][-1] in fail[0]
    assert len(rep["steps"]) < 200
    assert "verdict: FAIL" in format_table(rep)
    assert not any(_alive(p) for p in _fleet_pids(lines).values())
    assert _processes_mentioning(str(tmp_path)) == []
    assert _processes_mentioning(f"ckptfs-pg-bench{os.getpid()}") == []
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "sig, when",
    [(signal.SIGTERM, "draining"), (signal.SIGINT, "draining"), (signal.SIGINT, "step 1:")],
    ids=["sigterm-mid-drain", "ctrl-c-mid-drain", "ctrl-c-mid-step"],
)
def test_a_signal_ends_the_run_within_15s(tmp_path, sig, when):
    """SIGTERM to the coordinator, or Ctrl-C (SIGINT to its whole process group), while
    its hosts wait on a drain that takes half a minute (node n0 answers each put after
    3 s) or in the middle of the steps: the run ends within 15 s, its fleet gone."""
    steps = "2" if when == "draining" else "100"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusefs.cli", "bench", "--embedded", "--ranks", "16",
         "--hosts", "2", "--shard-size", "256KiB", "--steps", steps, "--slow-node",
         "--slow-node-delay", "3", "--workdir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal's job
    )  # fmt: skip
    lines: list[str] = []
    try:
        end = time.monotonic() + 90
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(when) or time.monotonic() > end:
                break
        assert any(ln.startswith(when) for ln in lines), "".join(lines)
        time.sleep(1.0)  # well inside: the drain has ~30 s to go, the steps many more
        pids = _fleet_pids(lines)
        t0 = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert took < 15, f"the run took {took:.1f}s to end after the signal"
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert pids and not [name for name, p in pids.items() if _alive(p)]
    assert _processes_mentioning(str(tmp_path)) == []
    assert os.listdir(tmp_path) == []


# -- --hang-meta: a replica stopped (SIGSTOP) mid-step, continued later -----------------------
def _hang_fault(step: int = 2, **kw) -> dict:
    return {
        "what": "hang-meta", "target": "m1", "step": step, "at_s": 1.0, "down_s": 10.0,
        "recovered_s": 5.5, "recovered": True, "error": "", "answered_s": 4.3,
        "probe_on": "m1", **kw,
    }  # fmt: skip


def test_hang_meta_options_are_one_line(tmp_path):
    with pytest.raises(HarnessError, match=r"--hang-meta needs --meta-replicas >= 2"):
        _cfg(tmp_path, hang_meta=True).validate()
    with pytest.raises(HarnessError, match="need --embedded"):
        _cfg(tmp_path, volume=str(tmp_path), hang_meta=True).validate()
    with pytest.raises(HarnessError, match="--hang-for"):
        _cfg(tmp_path, hang_meta=True, hang_s=0.0).validate()
    res = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "bench", "--embedded", "--hang-meta",
         "--ranks", "8", "--steps", "2", "--workdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        "ckptfs: error: --hang-meta needs --meta-replicas >= 2 (a client leaves the stopped "
        "replica for another)"
    ]
    assert HarnessConfig(steps=4, hang_meta=True, kill_meta=True).fault_steps() == {
        "kill-meta": 2,
        "hang-meta": 3,
    }


def test_judge_hang_budget():
    def steps(hung_s: float) -> list[dict]:
        out = []
        for n, s in ((1, 3.0), (2, hung_s), (3, 2.0), (4, 2.2)):
            faults = ["hang-meta m1 at 16/64 ranks for 10s"] if n == 2 else []
            if n == 3:
                faults = ["hang-meta m1 still stopped"]  # not a baseline step
            out.append({**_summary(n, "published", faults=faults), "save_s": s})
        return out

    v = judge(steps(7.9), 4, None, 4, 4, faults=[_hang_fault()])
    assert v["ok"], v
    (line,) = [ln for ln in v["lines"] if ln.startswith("hang-meta")]
    assert "published in 7.90s" in line and "3.00s (median of 1)" in line and "+4.90s" in line
    assert "answered by another in 4.3s" in line
    v = judge(steps(8.1), 4, None, 4, 4, faults=[_hang_fault()])  # 5.1 s over: FAIL
    assert not v["ok"] and any("FAIL" in ln and "over the budget" in ln for ln in v["lines"])
    # not published at all, or nothing to compare with
    bad = steps(7.0)
    bad[1]["state"] = "aborted"
    assert not judge(bad, 4, None, 4, 4, faults=[_hang_fault()])["ok"]
    alone = [{**_summary(1, "published", faults=["x"]), "save_s": 1.0}, steps(6.0)[1]]
    v = judge(alone, 4, None, 2, 2, faults=[_hang_fault()])
    assert not v["ok"] and any("no step without faults" in ln for ln in v["lines"])
    # the hang at step 1: the steps without faults after it are the comparison
    later = [{**s, "step": s["step"] - 1} for s in steps(7.0)[1:]]
    v = judge(later, 4, None, 3, 3, faults=[_hang_fault(step=1)])
    assert v["ok"] and any("2.20s (median of 3)" in ln for ln in v["lines"]), v


@_PG
def test_hang_meta_loopback_fleet(tmp_path):
    """2 replicas on PostgreSQL, one SIGSTOPped mid-step for 8 s (longer than a client's ~4 s
    to leave it and the database's 5 s to end its transaction): the clients fail over, the
    step publishes within 5 s of the steps without faults, the replica is continued and
    serves again, and the run passes with the hang in `faults`."""
    t0 = time.monotonic()
    lines: list[str] = []
    cfg = _cfg(
        tmp_path, ranks=64, hosts=2, steps=4, meta_replicas=2, db="postgres", hang_meta=True,
        hang_s=8.0, phase_timeout=40, agent=False,
    )  # fmt: skip
    rep = run(cfg, log=lines.append)  # (no agents: the hosts' own clients count failovers)
    took = time.monotonic() - t0
    assert rep["verdict"]["ok"], [ln for ln in rep["verdict"]["lines"] if "FAIL" in ln] or rep
    (f,) = rep["faults"]
    assert f["what"] == "hang-meta" and f["target"] == "m1" and f["step"] == 2, f
    assert f["recovered"] and f["down_s"] >= 8.0 and f["probe_on"] == "m1", f
    # recovered while the replica was still stopped: a client on it answered by the other
    assert 3.0 < f["answered_s"] < 8.0 and f["recovered_s"] < f["down_s"], f
    pub = f["publish"]
    assert pub["within_budget"] and pub["over_baseline_s"] <= 5.0 and pub["baseline_steps"], pub
    assert rep["hangs"] >= 1 and rep["failovers"] >= 1
    assert all(s["state"] == "published" and s["verified"] == 64 for s in rep["steps"])
    assert any(ln.startswith("hang-meta m1 (step 2") for ln in rep["verdict"]["lines"])
    assert "fault hang-meta m1 step 2" in format_table(rep)
    assert rep["process_exits"] == []  # stopped on purpose, continued: not flagged
    assert os.listdir(tmp_path) == []
    assert took < 60, f"the hang run took {took:.0f}s"
