"""fusefs/agent/spawn.py: `CKPTFS_AGENT=auto` starts the host's agent on demand, with real
processes (torch DCP ranks over gloo, `ckptfs put`, `ckptfs meta serve`, and the agent the
first rank starts).

Ranks that ask at once start exactly one agent and all go through it; it leaves on its own
once they are gone (its idle seconds, socket removed). An agent that cannot start leaves
the rank on its own client with one line naming the agent's log, and a volume that is not
there starts nothing. A token handed to the rank never reaches the agent's command line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from fusefs.agent.paths import agent_key
from fusefs.agent.spawn import lock_path, log_path
from tests.test_agent import CHUNK, Service, _log, agent_call, new_volume, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTED = "started a ckptfs agent"
FAILED = "could not start a ckptfs agent"
SERVING = "ckptfs agent: serving"


def _env(tmp_path, **extra: str) -> dict:
    run = tmp_path / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CKPTFS_AGENT="auto",
             XDG_RUNTIME_DIR=str(run), XDG_CACHE_HOME=str(tmp_path / "cache"))  # fmt: skip
    for k in ("CKPTFS_AGENT_SOCKET", "CKPTFS_TOKEN", "CKPTFS_TOKEN_FILE"):
        e.pop(k, None)
    e.update(extra)
    return e


def _socket(env: dict, spec: str) -> str:
    return os.path.join(env["XDG_RUNTIME_DIR"], "ckptfs", f"agent-{agent_key(spec)}.sock")


def _agent_pids(sock: str) -> list[int]:
    with open(log_path(sock)) as f:
        return [int(p) for p in re.findall(rf"{re.escape(SERVING)} .* \(pid (\d+)\)", f.read())]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout: float) -> float:
    t0 = time.monotonic()
    while not _gone(pid):
        if time.monotonic() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"agent pid {pid} still up after {timeout} s")
        time.sleep(0.1)
    return time.monotonic() - t0


def _put(env: dict, vol: str, src: str, dst: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fusefs.cli", "-v", "put", vol, src, dst],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _get(vol: str, path: str, out: str, env: dict) -> bytes:
    """The file's bytes read by a process without an agent (straight from the nodes)."""
    subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "get", vol, path, out],
        env=dict(env, CKPTFS_AGENT="off"), check=True, timeout=120,
    )  # fmt: skip
    with open(out, "rb") as f:
        return f.read()


def _said(text: str, what: str) -> list[str]:
    return [ln for ln in text.splitlines() if what in ln]


def test_dcp_ranks_at_once_start_one_agent_which_leaves_when_they_are_gone(tmp_path):
    pytest.importorskip("torch")
    vol = new_volume(tmp_path)
    idle = 3.0
    env = _env(tmp_path, CKPTFS_AGENT_IDLE_EXIT=str(idle), JOB="auto")
    sock = _socket(env, vol)
    out = str(tmp_path / "ranks")
    results = run_ranks("save_load", 4, vol, out, env, timeout=240)
    logs = [_log(out, "save_load", r) for r in range(4)]
    for r, res in enumerate(results):
        assert res["exact_load"][0], (r, res["exact_load"])
        assert res["agent"] == sock, (r, res["agent"])  # every rank through the one agent
        assert res["tier"] == "HostStager" and res["uploader_threads"] == 0, res
    started = [ln for text in logs for ln in _said(text, STARTED)]
    assert len(started) == 1, started  # one rank started it; the others found it
    assert not any(_said(t, FAILED) or _said(t, "no ckptfs agent at") for t in logs)
    (pid,) = _agent_pids(sock)  # exactly one agent process served
    assert f"(pid {pid})" in started[0]
    took = _wait_gone(pid, idle + 30)
    with open(log_path(sock)) as f:
        text = f.read()
    assert f"idle for {idle:g} s" in text, text
    assert "Traceback" not in text, text
    assert not os.path.exists(sock)
    assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700
    for p in (lock_path(sock), log_path(sock)):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    print(json.dumps({"agent_left_after_ranks_s": took, "idle_exit": idle}))


def test_puts_at_once_share_one_agent_and_read_back(tmp_path):
    vol = new_volume(tmp_path)
    env = _env(tmp_path, CKPTFS_AGENT_IDLE_EXIT="60")
    sock = _socket(env, vol)
    datas = [os.urandom(3 * CHUNK + i) for i in range(4)]
    for i, d in enumerate(datas):
        (tmp_path / f"src{i}").write_bytes(d)
    procs = [_put(env, vol, str(tmp_path / f"src{i}"), f"/f{i}") for i in range(4)]
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        errs.append(err)
    (pid,) = _agent_pids(sock)
    try:
        assert len([ln for e in errs for ln in _said(e, STARTED)]) == 1, errs
        assert not any(_said(e, FAILED) or _said(e, "no ckptfs agent at") for e in errs), errs
        stats = agent_call(sock, vol, "agent_stats")
        assert stats["pid"] == pid
        assert stats["ranks_served"] >= 4 + 1, stats  # the four puts and this call
        for i, d in enumerate(datas):
            assert _get(vol, f"/f{i}", str(tmp_path / f"out{i}"), env) == d
    finally:
        os.kill(pid, signal.SIGTERM)  # its idle seconds are long: stopped as by hand
    _wait_gone(pid, 30)
    assert not os.path.exists(sock)


def test_an_agent_that_cannot_start_leaves_the_rank_its_own_client_with_one_line(tmp_path):
    """The agent's default staging directory is unusable (under a regular file, which stops
    root too): the agent exits with its error; `ckptfs put` (no tier of its own) saves with
    its own client and says once why, naming the log. A second put within FAIL_HOLD does
    not try again. A volume that is not there starts no agent: the put's own error only."""
    vol = new_volume(tmp_path)
    (tmp_path / "file").write_bytes(b"")
    env = _env(tmp_path, XDG_CACHE_HOME=str(tmp_path / "file" / "cache"))
    sock = _socket(env, vol)
    data = os.urandom(2 * CHUNK)
    (tmp_path / "src").write_bytes(data)
    for name in ("/a", "/b"):
        p = _put(env, vol, str(tmp_path / "src"), name)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        (line,) = _said(err, FAILED)
        assert log_path(sock) in line and "Not a directory" in line, line
        assert "own client" in line and "Traceback" not in err, err
        assert not _said(err, "no ckptfs agent at"), err  # one line, not two
        assert not os.path.exists(sock)
        assert _get(vol, name, str(tmp_path / "out"), env) == data
    assert "moments ago" in line  # the second put did not start one again
    with open(log_path(sock)) as f:
        assert f.read().count("Not a directory") == 1
    missing = str(tmp_path / "missing")
    p = _put(env, missing, str(tmp_path / "src"), "/x")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and "no volume at" in err, err
    assert FAILED not in err and "Traceback" not in err, err
    assert not os.path.exists(log_path(_socket(env, missing)))


def test_a_token_handed_to_the_rank_reaches_the_agent_by_environment_not_argv(tmp_path):
    """A service URL without token_file=, the token in the rank's CKPTFS_TOKEN: the agent
    started for it serves (it has the token) and its command line does not hold it."""
    vol = new_volume(tmp_path)
    svc = Service(vol, str(tmp_path / "meta.log"))
    try:
        with open(svc.token_file) as f:
            token = f.read().strip()
        url = f"ckptfs://127.0.0.1:{svc.port}"
        env = _env(tmp_path, CKPTFS_TOKEN=token, CKPTFS_AGENT_IDLE_EXIT="60")
        sock = _socket(env, url)
        data = os.urandom(2 * CHUNK)
        (tmp_path / "src").write_bytes(data)
        p = _put(env, url, str(tmp_path / "src"), "/t")
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0 and _said(err, STARTED), err
        (pid,) = _agent_pids(sock)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            assert token.encode() not in b" ".join(argv), argv
            assert url.encode() in argv and b"--idle-exit" in argv, argv
            assert _get(url, "/t", str(tmp_path / "out"), env) == data
        finally:
            os.kill(pid, signal.SIGTERM)
        _wait_gone(pid, 30)
    finally:
        svc.stop()


RANK = """
import sys
from fusefs.client.registry import close_volumes, volume_for
v = volume_for(sys.argv[1], (None, "local", None))  # the DCP writer's default tier spec
print("agent", v.agent, type(v.tier).__name__, flush=True)
sys.stdin.readline()  # the test makes the nodes unusable meanwhile
with v.open_write("/staged") as w:
    w.write(open(sys.argv[2], "rb").read())
close_volumes()  # through an agent: its chunks are the agent's to upload
print("written", flush=True)
"""


def test_an_agent_started_on_demand_stays_up_while_its_chunks_cannot_upload(tmp_path):
    """A rank starts the agent, then saves while the object nodes are unusable (each node
    directory swapped for a file) and exits: its chunks are staged in the agent's tier and
    cannot upload, so the agent stays far past its idle seconds; once the nodes are back it
    uploads them, leaves, and the data reads back from the nodes."""
    vol = new_volume(tmp_path)
    idle = 1.0
    env = _env(tmp_path, CKPTFS_AGENT_IDLE_EXIT=str(idle))
    sock = _socket(env, vol)
    data = os.urandom(4 * CHUNK)
    (tmp_path / "src").write_bytes(data)
    nodes = [os.path.join(vol + ".nodes", n) for n in ("n0", "n1")]
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, vol, str(tmp_path / "src")], env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    line = rank.stdout.readline()
    assert line.split() == ["agent", sock, "HostStager"], (line, rank.stderr.read())
    (pid,) = _agent_pids(sock)
    try:
        for n in nodes:
            os.rename(n, n + ".away")
            with open(n, "w"):
                pass
        out, err = rank.communicate("go\n", timeout=120)
        assert rank.returncode == 0 and "written" in out, err
        time.sleep(idle + 6.0)
        assert not _gone(pid), "the agent left with chunks not on the nodes"
        stats = agent_call(sock, vol, "agent_stats")  # (a connection: the count restarts)
        assert stats["pid"] == pid
    finally:
        for n in nodes:
            os.unlink(n)
            os.rename(n + ".away", n)
    took = _wait_gone(pid, 10.0 + idle + 20)  # the uploads' backoff is 10 s at most
    assert not os.path.exists(sock)
    with open(log_path(sock)) as f:
        assert f"idle for {idle:g} s" in f.read()
    assert _get(vol, "/staged", str(tmp_path / "out"), env) == data
    print(json.dumps({"agent_left_after_nodes_back_s": took}))


def test_the_agent_command_carries_no_token_and_its_environment_gets_a_handed_one(
    monkeypatch,
):
    """spawn's command and environment for a token handed in code: in the environment only
    where neither the URL nor the rank's environment names one (the agent's own resolution
    then finds the same token the rank's would)."""
    from fusefs.agent.spawn import _command, _environment

    for k in ("CKPTFS_TOKEN", "CKPTFS_TOKEN_FILE", "CKPTFS_AGENT_IDLE_EXIT"):
        monkeypatch.delenv(k, raising=False)
    url = "ckptfs://127.0.0.1:7410"
    cmd = _command(url, "/run/a.sock", ("/nvme/st", "remote", 1 << 30))
    want = [url, "--socket", "/run/a.sock", "--idle-exit", "60", "--staging", "/nvme/st"]
    assert cmd[-11:] == [*want, "--staging-size", str(1 << 30), "--durability", "remote"]
    assert _environment(url, "secret")["CKPTFS_TOKEN"] == "secret"
    assert "CKPTFS_TOKEN" not in _environment(url + "?token_file=/t", "secret")
    monkeypatch.setenv("CKPTFS_TOKEN_FILE", "/etc/t")
    assert "CKPTFS_TOKEN" not in _environment(url, "secret")
    assert "CKPTFS_AGENT" not in _environment(url, None)
