"""The fleet test bed: network namespaces, links, fleet faults, teardown.

Every address used here is inside 198.18.0.0/15, in namespaces these tests make and delete
themselves, or on loopback; every run is bounded in steps and time. Tests that need to make
namespaces skip where that is not allowed (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bench import netns
from bench.harness import HarnessConfig, HarnessError, run
from bench.harness_report import judge, latency_split
from bench.servers.postgres import pg_available
from bench.servers.seaweed import weed_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_rights = netns.rights()
needs_netns = pytest.mark.skipif(_rights is not None, reason=_rights or "")
needs_weed = pytest.mark.skipif(weed_path() is None, reason="SeaweedFS (`weed`) not installed")
needs_pg = pytest.mark.skipif(pg_available() is not None, reason=pg_available() or "")


# -- what is left behind -----------------------------------------------------------------------
def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def _leftovers(ns_prefix: str, markers: list[str], links_before: set[str]) -> list[str]:
    """Namespaces, root-namespace links, processes and mounts a run left behind."""
    left = []
    names = [n for n in netns.list_namespaces() if n.startswith(ns_prefix)]
    if names:
        left.append(f"namespaces {names}")
    new_links = _root_links() - links_before
    if new_links:
        left.append(f"links {sorted(new_links)}")
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmd for m in markers):
            left.append(f"process {pid}: {cmd[:160]}")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if ns_prefix in line or any(m in line for m in markers):
                left.append(f"mount {line.split()[4]}")
    return left


def _netns_of_this_thread() -> str:
    return os.readlink("/proc/thread-self/ns/net")


# -- pure parts --------------------------------------------------------------------------------
def test_parse_link():
    assert netns.parse_link("1gbit") == (10**9, None)
    assert netns.parse_link("200mbit/2ms") == (200 * 10**6, 2.0)
    assert netns.parse_link("100mbps/500us") == (800 * 10**6, 0.5)
    for bad in ("fast", "1gbit/soon", "1bit", "-5mbit"):
        with pytest.raises(netns.NetnsError):
            netns.parse_link(bad)


def test_fleet_options_are_checked_in_one_line(tmp_path):
    def cfg(**kw) -> HarnessConfig:
        return HarnessConfig(ranks=8, hosts=2, steps=3, workdir=str(tmp_path), **kw)

    cases = [
        (dict(meta_replicas=2), "needs --db postgres"),
        (dict(restart_db=True), "--restart-db needs --db postgres"),
        (dict(link="1gbit"), "needs --topology netns"),
        (dict(topology="netns", nodes="dir"), "directory nodes have no network"),
        (dict(rolling_restart=True), "needs --nodes s3"),
        (dict(topology="netns", link="fast"), "bad --link rate"),
        (dict(volume=str(tmp_path), kill_meta=True), "need --embedded"),
        (dict(fault_hold=0), "--fault-hold"),
    ]
    for kw, says in cases:
        with pytest.raises(HarnessError, match=says):
            cfg(**kw).validate()
    c = cfg(topology="netns")
    c.validate()
    assert c.nodes == "s3" and c.node_count == 3  # the netns defaults


def test_fault_steps_one_each_after_a_killed_rank():
    c = HarnessConfig(
        steps=6, kill_rank=True, kill_meta=True, partition_host=True, restart_db=True,
        rolling_restart=True, db="postgres", nodes="s3",
    )  # fmt: skip
    assert c.fault_steps() == {
        "kill-meta": 3,
        "partition-host": 4,
        "restart-db": 5,
        "rolling-restart": 2,
    }
    short = HarnessConfig(steps=2, kill_meta=True, partition_host=True, rolling_restart=True)
    assert short.fault_steps() == {"kill-meta": 2, "partition-host": 2, "rolling-restart": 1}


def test_loopback_partition_victim_has_a_process_of_its_own():
    hosts, groups = HarnessConfig(ranks=20, hosts=5, partition_host=True).layout()
    assert groups[-1] == [4] and sorted(h for g in groups for h in g) == list(range(5))
    _, groups = HarnessConfig(ranks=16, hosts=3, topology="netns").layout()
    assert groups == [[0], [1], [2]]


def _summary(step, state, faults=(), may_abort=None, verified=4, loaded=None, latest=None):
    s = {
        "step": step,
        "state": state,
        "reason": "",
        "faults": list(faults),
        "verified": verified,
        "verify_failures": [],
        "loaded_step": loaded if loaded is not None else step,
        "latest_after": latest if latest is not None else step,
        "save_s": 1.0 + step,
        "commit_latency_s": [0.1 * step],
    }
    if may_abort is not None:
        s["may_abort"] = may_abort
    return s


def test_judge_fleet_rules():
    ok = [_summary(1, "published"), _summary(2, "published", faults=["kill-meta m1"])]
    final_ok = {"ok": True, "steps": [{"step": 2, "verified": 4, "failures": []}]}
    fault = {
        "what": "kill-meta", "target": "m1", "step": 2, "at_s": 1.0, "down_s": 3.0,
        "recovered_s": 3.5, "recovered": True, "error": "",
    }  # fmt: skip
    assert judge(ok, 4, None, 2, 2, final_ok, [fault])["ok"]
    # a fleet fault is no excuse to abort, unless its outage outlasted the deadline
    aborted = [
        _summary(1, "published"),
        _summary(2, "aborted", ["kill-meta m1"], loaded=1, latest=1),
    ]
    assert not judge(aborted, 4, None, 1, 1)["ok"]
    aborted[1]["may_abort"] = True
    assert judge(aborted, 4, None, 1, 1)["ok"]
    # a write acknowledged, then lost
    lost = {"ok": False, "steps": [{"step": 2, "verified": 3, "failures": ["1: x"]}]}
    assert not judge(ok, 4, None, 2, 2, lost)["ok"]
    # a fault never undone
    stuck = dict(fault, recovered=False, recovered_s=None, error="not back after 300s")
    v = judge(ok, 4, None, 2, 2, final_ok, [stuck])
    assert not v["ok"] and any("did not recover" in line for line in v["lines"])
    # a metadata call that failed at the end
    assert not judge(ok, 4, None, 2, 2, final_ok, [], ["latest: EIO"])["ok"]
    split = latency_split(ok)
    assert split["without_faults"]["steps"] == [1] and split["with_faults"]["steps"] == [2]
    assert split["with_faults"]["publish_p50_s"] == 3.0


# -- namespaces for real -----------------------------------------------------------------------
@needs_netns
def test_fabric_shapes_cuts_heals_and_leaves_nothing():
    before = _root_links()
    f = netns.Fabric()
    server = None
    try:
        f.create()
        a = f.add("h0", netns.host_addr(0))
        b = f.add("m0", netns.replica_addr(0))
        for m in (a, b):
            netns.check_isolated(m)
        note = f.shape(a, 100 * 10**6, 1.0)
        assert note is None or "not applied" in note  # no netem: said, not fatal
        server = subprocess.Popen(
            b.prefix + [sys.executable, "-c",
                        "import socket,time\n"
                        f"s=socket.create_server(('{b.addr}', 7999))\n"
                        "end=time.time()+30\n"
                        "s.settimeout(1)\n"
                        "while time.time()<end:\n"
                        "    try: s.accept()[0].close()\n"
                        "    except OSError: pass\n"],
        )  # fmt: skip
        connect = f"import socket; socket.create_connection(('{b.addr}', 7999), timeout=1.5)"
        probe = [sys.executable, "-c", connect]

        def reach() -> bool:
            return subprocess.run(a.prefix + probe, capture_output=True, timeout=20).returncode == 0

        def reached_within(seconds: float) -> bool:
            end = time.monotonic() + seconds
            while not reach():
                if time.monotonic() > end:
                    return False
                time.sleep(0.2)
            return True

        assert reached_within(10), "the server never became reachable"
        f.cut(a)
        assert not reach()
        f.heal(a)
        # a link brought back up takes a moment (carrier, the bridge port) before it forwards
        assert reached_within(10), "the healed link never forwarded again"
        qd = subprocess.run(["tc", "-n", a.ns, "qdisc", "show", "dev", "eth0"],
                            capture_output=True, text=True).stdout  # fmt: skip
        assert "tbf" in qd
    finally:
        if server is not None:
            server.kill()
            server.wait()
        assert f.destroy() == []
    assert _leftovers(f.run, [f.run], before) == []


@needs_netns
def test_namespaces_of_a_killed_run_are_swept():
    """A coordinator SIGKILLed cannot tear down: the next run removes what it left."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process has now
    ns = f"{netns.NAME_PREFIX}{dead.pid}x0000-h0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "60"])
    try:
        time.sleep(0.3)
        assert ns in netns.list_namespaces()
        assert ns in netns.sweep_stale()
        assert ns not in netns.list_namespaces()
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@needs_netns
@needs_weed
def test_a_failed_netns_run_leaves_nothing(tmp_path):
    before, mine = _root_links(), _netns_of_this_thread()
    cfg = HarnessConfig(
        ranks=8, hosts=2, shard_size=64 * 1024, steps=3, topology="netns", node_count=2,
        workdir=str(tmp_path), progress=False, fail_after_step=1,
    )  # fmt: skip
    with pytest.raises(HarnessError, match="injected failure after step 1"):
        run(cfg, log=lambda _m: None)
    assert _netns_of_this_thread() == mine  # the coordinator left its namespace
    assert _leftovers(f"ckb{os.getpid()}x", [str(tmp_path), f"ckb{os.getpid()}x"], before) == []
    assert os.listdir(tmp_path) == []


@needs_netns
@needs_weed
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_tears_the_fleet_down(tmp_path, sig):
    before = _root_links()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusefs.cli", "bench", "--embedded", "--topology", "netns",
         "--ranks", "8", "--hosts", "2", "--shard-size", "64KiB", "--steps", "200",
         "--node-count", "2", "--workdir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )  # fmt: skip
    lines = []
    try:
        end = time.monotonic() + 120
        for line in proc.stderr:  # interrupted in the middle of the steps
            lines.append(line)
            if line.startswith("step 1:") or time.monotonic() > end:
                break
        assert any(line.startswith("step 1:") for line in lines), "".join(lines)
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert took < 15, f"the fleet took {took:.1f}s to go after the signal"
    assert "interrupted" in err and "Traceback" not in err
    prefix = f"ckb{proc.pid}x"
    assert _leftovers(prefix, [str(tmp_path), prefix], before) == []
    assert os.listdir(tmp_path) == []


@needs_netns
@needs_weed
@needs_pg
def test_netns_replica_gone_unasked_fails_the_run(tmp_path):
    """The fleet of the issue, small: 2 replicas on PostgreSQL, each in its namespace. One
    replica killed from outside (no fault asked for it): the run ends FAIL within seconds,
    naming it, and the fleet (namespaces, servers, files) is gone."""
    before = _root_links()
    lines: list[str] = []
    killed: list[float] = []

    def killer() -> None:
        end = time.monotonic() + 120
        while time.monotonic() < end and not any(ln.startswith("step 1:") for ln in lines):
            time.sleep(0.05)
        line = next(ln for ln in lines if ln.startswith("watching the fleet:"))
        pid = int(line.split("m1 pid ")[1].split(",")[0].split(";")[0])
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    cfg = HarnessConfig(
        ranks=16, hosts=2, shard_size=64 * 1024, steps=200, topology="netns", node_count=2,
        meta_replicas=2, db="postgres", workdir=str(tmp_path), progress=False,
        phase_timeout=60,
    )  # fmt: skip
    rep = run(cfg, log=lines.append)
    ended = time.monotonic()
    t.join(5)
    assert killed, lines
    assert ended - killed[0] < 20, f"the run took {ended - killed[0]:.1f}s to end"
    assert not rep["verdict"]["ok"]
    assert [e["name"] for e in rep["process_exits"]] == ["m1"]
    assert any(ln.startswith("FAIL fleet: service replica") and " m1 " in ln
               for ln in rep["verdict"]["lines"])  # fmt: skip
    prefix = f"ckb{os.getpid()}x"
    assert _leftovers(prefix, [str(tmp_path), prefix], before) == []
    assert os.listdir(tmp_path) == []


def test_without_rights_one_line_and_non_zero(tmp_path):
    """As root without CAP_SYS_ADMIN/CAP_NET_ADMIN (or as any other user)."""
    cmd = [sys.executable, "-m", "fusefs.cli", "bench", "--embedded", "--topology", "netns",
           "--ranks", "8", "--steps", "1", "--workdir", str(tmp_path)]  # fmt: skip
    if os.geteuid() == 0:
        if not os.path.exists("/usr/bin/setpriv"):
            pytest.skip("setpriv (util-linux) is needed to drop capabilities")
        drop = "-sys_admin,-net_admin"
        cmd = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *cmd]
    res = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert "namespace" in res.stderr or "root" in res.stderr
    assert os.listdir(tmp_path) == []


# -- fleet faults ------------------------------------------------------------------------------
def _faults_by(rep: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in rep["faults"]:
        out.setdefault(f["what"], []).append(f)
    return out


def _failed_lines(rep: dict) -> list[str]:
    """The verdict's FAIL lines only: pytest cuts a long message, and the whole list of a
    fleet run hides the one line that matters behind the passing ones."""
    return [ln for ln in rep["verdict"]["lines"] if "FAIL" in ln] or rep["verdict"]["lines"]


def _check_fault_report(rep: dict, want: dict[str, int]) -> None:
    by = _faults_by(rep)
    assert {k: len(v) for k, v in by.items()} == want, rep["faults"]
    for f in rep["faults"]:
        assert f["recovered"] and f["down_s"] > 0 and f["recovered_s"] >= f["down_s"], f
    assert isinstance(rep["failovers"], int) and rep["failovers"] >= 0
    lat = rep["publish_latency"]
    assert lat["with_faults"]["publish_p50_s"] is not None
    assert rep["final_check"]["ok"]
    json.dumps(rep)  # the report is JSON


@needs_netns
@needs_weed
@needs_pg
def test_netns_fleet_run_with_every_fault(tmp_path):
    """The CI-size fleet: 3 hosts, 2 replicas on PostgreSQL, 3 S3 nodes, 64 ranks, links
    shaped, a replica killed, a host cut off, every node restarted, the database
    restarted: every step published and read back whole, every fault undone."""
    t0 = time.monotonic()
    before = _root_links()
    cfg = HarnessConfig(
        ranks=64, hosts=3, shard_size=256 * 1024, steps=5, topology="netns", link="1gbit/1ms",
        meta_replicas=2, db="postgres", kill_meta=True, partition_host=True,
        rolling_restart=True, restart_db=True, fault_hold=2.0, workdir=str(tmp_path),
        progress=False, phase_timeout=120,
    )  # fmt: skip
    rep = run(cfg, log=lambda _m: None)
    assert rep["verdict"]["ok"], _failed_lines(rep)
    assert all(s["state"] == "published" and s["verified"] == 64 for s in rep["steps"])
    _check_fault_report(
        rep, {"kill-meta": 1, "partition-host": 1, "rolling-restart": 3, "restart-db": 1}
    )
    topo = rep["topology"]
    assert topo["kind"] == "netns" and len(topo["meta_replicas"]) == 2
    assert all(a.startswith("198.18.") for a in topo["hosts"].values())
    assert topo["link"]["rate_bits"] == 10**9
    assert topo["link"]["delay_applied"] or any("netem" in n for n in topo["notes"])
    assert _leftovers(f"ckb{os.getpid()}x", [str(tmp_path), f"ckb{os.getpid()}x"], before) == []
    assert time.monotonic() - t0 < 110, "the CI-size fleet run must stay well under 2 minutes"


@needs_netns
@needs_weed
def test_netns_keeps_the_old_faults(tmp_path):
    """--kill-rank, --kill-node, --slow-rank and --slow-node on the fleet, every rank through
    its host's agent (run in the host's namespace): the killed rank's step aborts with the
    previous one intact, the dead node's replicas serve."""
    cfg = HarnessConfig(
        ranks=16, hosts=2, shard_size=64 * 1024, steps=3, topology="netns", kill_rank=True,
        kill_node=True, slow_rank=1, slow_node=True, slow_delay=0.5,
        durability="remote", workdir=str(tmp_path), progress=False, phase_timeout=120,
    )  # fmt: skip
    rep = run(cfg, log=lambda _m: None)
    assert rep["verdict"]["ok"], _failed_lines(rep)
    s1, s2, s3 = rep["steps"]
    assert s1["state"] == s3["state"] == "published" and s2["state"] == "aborted"
    assert s2["killed_ranks"] == [8] and rep["killed_node"] == "n0"
    assert all(s["verified"] == 16 for s in rep["steps"])
    # the ranks went through their hosts' agents, each run in its host's namespace
    agents = rep["agents"]
    assert agents["agents"] == 2 and agents["errors"] == [] and agents["ranks_served"] >= 16
    assert agents["commits_grouped"] + agents["commits_single"] >= 16
    assert rep["topology"]["agents_in"] == {"host-000": "host-000", "host-001": "host-001"}
    assert os.listdir(tmp_path) == []


@needs_weed
def test_loopback_fleet_faults(tmp_path):
    """The same faults on 127.0.0.1: a replica killed and restarted, a host's process
    stopped (its partition), every S3 node restarted."""
    cfg = HarnessConfig(
        ranks=32, hosts=3, shard_size=128 * 1024, steps=3, nodes="s3", kill_meta=True,
        partition_host=True, rolling_restart=True, fault_hold=2.0, workdir=str(tmp_path),
        progress=False, phase_timeout=120,
    )  # fmt: skip
    rep = run(cfg, log=lambda _m: None)
    assert rep["verdict"]["ok"], _failed_lines(rep)
    _check_fault_report(rep, {"kill-meta": 1, "partition-host": 1, "rolling-restart": 3})
    assert rep["topology"]["kind"] == "loopback"
    assert os.listdir(tmp_path) == []


@needs_pg
def test_restart_db_mid_step(tmp_path):
    """PostgreSQL restarted mid-step: the fault is injected and undone, and the run passes:
    the service's engine opens its connection again and reruns the lost transaction."""
    cfg = HarnessConfig(
        ranks=16, hosts=2, shard_size=64 * 1024, steps=2, db="postgres", restart_db=True,
        fault_hold=1.0, workdir=str(tmp_path), progress=False, phase_timeout=20,
    )  # fmt: skip
    rep = run(cfg, log=lambda _m: None)
    (f,) = rep["faults"]
    assert f["what"] == "restart-db" and f["step"] == 2 and f["down_s"] >= 1.0
    assert rep["steps"][0]["state"] == "published" and rep["steps"][0]["verified"] == 16
    assert os.listdir(tmp_path) == []
    assert rep["verdict"]["ok"], (rep["verdict"]["lines"], rep["errors"])


@needs_netns
@needs_weed
@needs_pg
def test_netns_hang_meta(tmp_path):
    """The fleet with a replica hung: 2 replicas on PostgreSQL in namespaces of their own,
    the second SIGSTOPped as step 2's save starts and continued 8 s later. Its hosts'
    clients leave it on silence, the step publishes within 5 s of the steps without
    faults, every step reads back whole, and the fleet is gone afterwards."""
    t0 = time.monotonic()
    before = _root_links()
    cfg = HarnessConfig(
        ranks=32, hosts=2, shard_size=256 * 1024, steps=4, topology="netns", node_count=2,
        meta_replicas=2, db="postgres", hang_meta=True, hang_s=8.0, workdir=str(tmp_path),
        progress=False, phase_timeout=60,
    )  # fmt: skip
    rep = run(cfg, log=lambda _m: None)
    assert rep["verdict"]["ok"], _failed_lines(rep)
    (f,) = rep["faults"]
    assert f["what"] == "hang-meta" and f["step"] == 2 and f["probe_on"] == "m1", f
    assert f["recovered"] and f["recovered_s"] < f["down_s"] and f["down_s"] >= 8.0, f
    assert f["publish"]["within_budget"], f
    assert rep["hangs"] >= 1 and rep["failovers"] >= 1 and rep["process_exits"] == []
    assert all(s["state"] == "published" and s["verified"] == 32 for s in rep["steps"])
    assert _leftovers(f"ckb{os.getpid()}x", [str(tmp_path), f"ckb{os.getpid()}x"], before) == []
    assert time.monotonic() - t0 < 90
