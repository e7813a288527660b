"""The host agent (fusefs/agent, `ckptfs agent`): real `meta serve`, real agent and rank
processes (torch DCP over gloo, tests/agent_worker.py).

Eight ranks save and load through one agent: the service sees one connection, the ranks
start no uploaders; the same ranks without an agent run their own clients and say so once;
an agent killed -9 mid-save fails or finishes the ranks' saves in bounded time and loses
nothing; a peer of another uid and a hello without a token are refused; a rank's scoped
token still decides what it may do through the agent.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from fusefs.agent import batch
from fusefs.agent.paths import agent_key, socket_path, trusted
from fusefs.agent.rank import connect_agent
from fusefs.client.volume import Volume, VolumeSettings
from metadata.client import connect
from metadata.engine import MetaError
from metadata.wire.protocol import PROTO_VERSION, FrameDecoder, decode, encode_frame

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "agent_worker.py")
CHUNK = 64 * 1024
NO_AGENT = "no ckptfs agent at"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_line(proc: subprocess.Popen, want: str, timeout: float = 60) -> str:
    """The first stdout line of `proc` containing `want` (or fail with what it said)."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    got = ""
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        got += line
        if want in line:
            return line
    proc.kill()
    pytest.fail(f"no {want!r} from {proc.args}: {got}")


class Service:
    """`ckptfs meta serve` with a metrics endpoint (its open connections are a gauge)."""

    def __init__(self, vol: str, log: str) -> None:
        self.metrics_port = free_port()
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fusefs.cli", "meta", "serve", vol, "--listen",
             "127.0.0.1:0", "--metrics", f"127.0.0.1:{self.metrics_port}"],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=_env(),
        )  # fmt: skip
        line = _read_line(self.proc, "serving")
        self.port = int(re.search(r" on [\d.]+:(\d+)", line).group(1))
        self.token_file = os.path.join(vol, "meta.token")
        self.url = f"ckptfs://127.0.0.1:{self.port}?token_file={self.token_file}"

    def connections(self) -> int:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - loopback
            text = r.read().decode()
        return int(float(re.search(r"^ckptfs_meta_connections (\S+)$", text, re.M).group(1)))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class AgentProc:
    """`ckptfs agent SPEC` in the foreground of a child process."""

    def __init__(self, spec: str, env: dict, log: str, *extra: str) -> None:
        self.spec, self.env, self.log_path, self.extra = spec, env, log, extra
        self.start()

    def start(self) -> None:
        self.err = open(self.log_path, "a")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fusefs.cli", "-v", "agent", self.spec, *self.extra],
            stdout=subprocess.PIPE, stderr=self.err, text=True, env=self.env,
        )  # fmt: skip
        line = _read_line(self.proc, "serving")
        self.socket = line.split(" on ")[1].split(" (pid")[0]

    def signal(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.wait()

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.err.close()

    def log_text(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def agent_call(path: str, url: str, method: str, *args: object) -> object:
    """One call to the agent at `path` from this process, as a rank makes it."""
    old = os.environ.get("CKPTFS_AGENT_SOCKET")
    os.environ["CKPTFS_AGENT_SOCKET"] = path
    try:
        eng = connect_agent(url)
    finally:
        if old is None:
            del os.environ["CKPTFS_AGENT_SOCKET"]
        else:
            os.environ["CKPTFS_AGENT_SOCKET"] = old
    assert eng is not None, f"no agent at {path}"
    try:
        return eng.call(method, *args)
    finally:
        eng.close()


def _env(**extra: str) -> dict:
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    e.pop("CKPTFS_AGENT_SOCKET", None)
    e.update(extra)
    return e


def start_ranks(scenario: str, world: int, vol: str, out: str, env: dict) -> list:
    os.makedirs(out, exist_ok=True)
    port = str(free_port())
    ranks = []
    for r in range(world):
        log = open(os.path.join(out, f"{scenario}.rank{r}.log"), "w")  # noqa: SIM115
        e = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                 CKPT_VOL=vol, CKPT_OUT=out)  # fmt: skip
        p = subprocess.Popen([sys.executable, WORKER, scenario], env=e, stdout=log, stderr=log)
        ranks.append((p, log))
    return ranks


def wait_ranks(scenario: str, ranks: list, out: str, timeout: float = 300) -> list[dict]:
    """Every rank's results; fail with the logs if one failed or outlived `timeout`."""
    end = time.monotonic() + timeout
    for p, _log_file in ranks:
        try:
            p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p, log in ranks:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    if any(p.returncode for p, _ in ranks):
        tails = [f"--- rank {r} (exit {p.returncode}):\n{_log(out, scenario, r)[-3000:]}"
                 for r, (p, _) in enumerate(ranks)]  # fmt: skip
        pytest.fail(f"{scenario}: ranks failed or timed out\n" + "\n".join(tails))
    out_ = []
    for r in range(len(ranks)):
        with open(os.path.join(out, f"{scenario}.rank{r}.json")) as f:
            out_.append(json.load(f))
    return out_


def _log(out: str, scenario: str, r: int) -> str:
    with open(os.path.join(out, f"{scenario}.rank{r}.log")) as f:
        return f.read()


def run_ranks(scenario: str, world: int, vol: str, out: str, env: dict, **kw) -> list[dict]:
    return wait_ranks(scenario, start_ranks(scenario, world, vol, out, env), out, **kw)


class Sampler:
    """The service's open connections, sampled every 20 ms while ranks run: the most."""

    def __init__(self, svc: Service) -> None:
        self.svc, self.most, self.stop = svc, 0, threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.most = max(self.most, self.svc.connections())

    def done(self) -> int:
        self.stop.set()
        self.t.join(10)
        return self.most


def new_volume(base) -> str:
    vol = str(base / "vol")
    Volume.create(vol, nodes=2, settings=VolumeSettings(chunk_size=CHUNK, replicas=1)).close()
    return vol


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """Eight ranks save and load on one service: first without an agent (each its own
    client), then through one agent."""
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("agent8")
    vol = new_volume(base)
    run = base / "run"
    run.mkdir(mode=0o700)
    env = _env(XDG_RUNTIME_DIR=str(run), XDG_CACHE_HOME=str(base / "cache"))
    svc = Service(vol, str(base / "meta.log"))
    try:
        s = Sampler(svc)
        alone = run_ranks("save_load", 8, svc.url, str(base / "alone"), dict(env, JOB="alone"))
        alone_conns = s.done()
        agent = AgentProc(svc.url, env, str(base / "agent.log"))
        try:
            s = Sampler(svc)
            shared = run_ranks("save_load", 8, svc.url, str(base / "agent"), dict(env, JOB="a"))
            shared_conns = s.done()
            stats = agent_call(agent.socket, svc.url, "agent_stats")
            assert agent.signal(signal.SIGTERM) == 0, agent.log_text()
        finally:
            if agent.proc.poll() is None:
                agent.proc.kill()
        print(json.dumps({  # the numbers for the closing note (pytest -s)
            "save_s_alone": alone[0]["save_s"], "load_s_alone": alone[0]["load_s"],
            "save_s_agent": shared[0]["save_s"], "load_s_agent": shared[0]["load_s"],
            "service_conns_alone": alone_conns, "service_conns_agent": shared_conns,
            "agent_stats": stats,
        }))  # fmt: skip
        yield {"base": base, "alone": alone, "shared": shared, "alone_conns": alone_conns,
               "shared_conns": shared_conns, "stats": stats, "socket": agent.socket}  # fmt: skip
    finally:
        svc.stop()


def test_eight_ranks_share_one_agent_and_its_one_service_connection(eight):
    shared, stats = eight["shared"], eight["stats"]
    for r, res in enumerate(shared):
        assert res["exact_load"][0], (r, res["exact_load"])
        assert res["agent"] == eight["socket"], (r, res["agent"])
        assert res["replicas"] == [[eight["socket"], 0]], res["replicas"]
        assert res["uploader_threads"] == 0, (r, res["threads"])
        assert res["tier"] == "HostStager", res["tier"]  # staging into the agent's tier
    # the service saw the agent's connection and no rank's (without it: one per rank)
    assert eight["shared_conns"] == 1, eight["shared_conns"]
    assert eight["alone_conns"] > 1, eight["alone_conns"]
    assert stats["upstream_connections"] == 1, stats
    assert stats["ranks_served"] >= 8, stats
    assert stats["commits_grouped"] >= 2 and stats["commit_groups"] >= 1, stats


def test_a_rank_without_an_agent_runs_its_own_client_and_says_so_once(eight):
    base = eight["base"]
    for r, res in enumerate(eight["alone"]):
        assert res["exact_load"][0], (r, res["exact_load"])
        assert res["agent"] is None and res["engine"] == "RemoteEngine"
        assert res["uploader_threads"] > 0, res["threads"]  # its own tier
        text = _log(str(base / "alone"), "save_load", r)
        assert text.count(NO_AGENT) == 1, text[-2000:]
        assert "this process runs its own client" in text
    for r in range(8):  # through the agent: not said
        assert NO_AGENT not in _log(str(base / "agent"), "save_load", r)


@pytest.fixture
def service(tmp_path):
    vol = new_volume(tmp_path)
    svc = Service(vol, str(tmp_path / "meta.log"))
    yield vol, svc
    svc.stop()


@pytest.mark.parametrize("back_after", [1.0, None], ids=["restarted", "gone"])
def test_an_agent_killed_mid_save_loses_nothing_acknowledged(service, tmp_path, back_after):
    """kill -9 while ranks save step after step: each save finishes through the agent
    restarted a second later, or (no agent within the ranks' retry window) fails with an
    error in bounded time; step 1 and every step saved stay readable by a process without
    an agent once an agent flushed."""
    pytest.importorskip("torch")
    vol, svc = service
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    retry = 20.0 if back_after else 3.0
    env = _env(XDG_RUNTIME_DIR=str(run), XDG_CACHE_HOME=str(tmp_path / "cache"),
               SAVE_FOR="10", CKPTFS_AGENT_RETRY=str(retry))  # fmt: skip
    agent = AgentProc(svc.url, env, str(tmp_path / "agent.log"))
    out = str(tmp_path / "out")
    try:
        ranks = start_ranks("kill", 4, svc.url, out, env)
        end = time.monotonic() + 180
        while not os.path.exists(os.path.join(out, "saved1")):
            assert time.monotonic() < end, "step 1 never saved"
            assert all(p.poll() is None for p, _ in ranks), "a rank exited early"
            time.sleep(0.05)
        time.sleep(0.4)  # into step 2's save
        agent.proc.kill()
        assert agent.wait() == -signal.SIGKILL
        if back_after:
            time.sleep(back_after)
            agent.start()  # its socket is stale: replaced
        results = wait_ranks("kill", ranks, out, timeout=300)
        ok_steps = []
        for step in sorted(results[0]["steps"], key=int):
            outcomes = [r["steps"].get(step) for r in results]
            for what, took in filter(None, outcomes):
                assert took < retry + 60, (step, what, took)  # failed or not: bounded
                assert what == "ok" or "Error" in what or "Exception" in what, what
            if all(o and o[0] == "ok" for o in outcomes):
                ok_steps.append(step)
        print(json.dumps({"kill_steps": results[0]["steps"], "back_after": back_after}))
        if back_after:
            assert int(ok_steps[-1]) >= 3, ok_steps  # the restarted agent saved steps
        else:
            failed = [o for o in results[0]["steps"].values() if o[0] != "ok"]
            assert failed, results[0]["steps"]
            assert f"ckptfs agent at {agent.socket}" in failed[-1][0], failed
            agent.start()  # then the journal's chunks upload
        agent_call(agent.socket, svc.url, "agent_flush", 120.0)
        assert agent.signal(signal.SIGTERM) == 0, agent.log_text()[-3000:]
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
    alone = dict(env, CKPTFS_AGENT="off", STEPS=",".join(ok_steps))
    (res,) = run_ranks("verify", 1, svc.url, str(tmp_path / "verify"), alone)
    assert res["agent"] is None
    for step in [1, *map(int, ok_steps)]:
        assert res[f"step{step}"][0], (step, res[f"step{step}"])


def _connect_as(uid: int, path: str, hello: dict) -> str:
    """In a forked child with `uid` (the interpreter under /root is not another user's to
    run): connect to the agent, say `hello`, and report the answer ("EACCES at connect"
    when the socket's permissions stop it first, "error: ..." for anything else)."""
    frame = encode_frame(hello)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain system calls only, and never back into pytest
        said = b"error: ?"
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            try:
                s.connect(path)
            except PermissionError:
                said = b"EACCES at connect"
            else:
                try:
                    s.sendall(frame)
                except BrokenPipeError:  # refused before the hello: its answer is there
                    pass
                said = b""
                while len(said) < 4 or len(said) < 4 + int.from_bytes(said[:4], "big"):
                    data = s.recv(65536)  # one frame: the hello's answer
                    if not data:
                        break
                    said += data
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            said = f"error: {e!r}".encode()
        finally:
            os.write(w, said)
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read()
    os.waitpid(pid, 0)
    if said.startswith((b"EACCES", b"error")):
        return said.decode()
    frames = FrameDecoder().feed(said)
    return json.dumps(decode(frames[0])) if frames else "closed"


def _hello(path: str, hello: dict) -> dict:
    said = _connect_as(os.getuid(), path, hello)
    assert said.startswith("{"), said
    return json.loads(said)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_another_uid_and_a_hello_without_a_token_are_refused(service, tmp_path):
    import tempfile

    vol, svc = service
    where = tempfile.mkdtemp(prefix="ckptfs-agent-test-")  # /tmp: reachable by nobody
    os.chmod(where, 0o700)
    path = os.path.join(where, "agent.sock")
    agent = AgentProc(svc.url, _env(), str(tmp_path / "agent.log"), "--socket", path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        token = open(svc.token_file).read().strip()
        good = {"proto": PROTO_VERSION, "token": token}
        nobody = 65534
        assert _connect_as(nobody, path, good) == "EACCES at connect"  # the directory's 0700
        os.chmod(where, 0o755)  # opened up by mistake: the agent still checks who it is
        os.chmod(path, 0o666)
        said = _connect_as(nobody, path, good)
        assert said.startswith("{"), said
        said = json.loads(said)
        assert said["ok"] is False and said["errno"] == errno.EACCES, said
        assert "refused a connection from pid" in agent.log_text()
        assert f"uid {nobody}" in agent.log_text()
        for bad in ({"proto": PROTO_VERSION}, {"proto": PROTO_VERSION, "token": ""}):
            said = _hello(path, bad)
            assert said["ok"] is False and said["errno"] == errno.EACCES, said
            assert "without a token" in said["error"]
        said = _hello(path, {"proto": PROTO_VERSION, "token": "ckt_not-a-token"})
        assert said["ok"] is False and said["errno"] == errno.EACCES, said
        assert _hello(path, good)["ok"] is True
        assert trusted(path) is None
        os.environ["CKPTFS_AGENT_SOCKET"] = path
        try:
            stats = agent_call(agent.socket, svc.url, "agent_stats")
        finally:
            del os.environ["CKPTFS_AGENT_SOCKET"]
        assert stats["refused_peer"] == 1 and stats["refused_hello"] == 3, stats
    finally:
        assert agent.signal(signal.SIGTERM) == 0
        shutil.rmtree(where, ignore_errors=True)
    assert not os.path.exists(path)  # removed at a clean exit


def test_a_scoped_token_through_the_agent_cannot_commit_into_another_job(
    service, tmp_path, monkeypatch
):
    """The rank's own token decides through the agent: a writer of job A commits into job
    A and gets EACCES for job B, as PermissionError through the DCP writer."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from fusefs.client.registry import close_volumes, volume_for
    from fusefs.dcp import CkptfsReader, CkptfsWriter

    vol, svc = service
    with Volume.open(vol) as v:  # (the service's volume: its engine is safe to share)
        writer = v.meta.create_token("rank-a", "writer", ["job-a"])
    tok = tmp_path / "writer.token"
    tok.write_text(writer + "\n")
    tok.chmod(0o600)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    agent = AgentProc(svc.url, _env(XDG_RUNTIME_DIR=str(run)), str(tmp_path / "agent.log"))
    url = f"ckptfs://127.0.0.1:{svc.port}?token_file={tok}"
    try:
        eng = connect_agent(url)
        assert eng is not None and eng.replicas == [(agent.socket, 0)]
        assert eng.begin("job-a", 1, 1)["state"] == "open"
        with pytest.raises(MetaError) as e:
            eng.begin("job-b", 1, 1)
        assert e.value.errno == errno.EACCES and "token" in str(e.value)
        with pytest.raises(MetaError) as e:
            eng.commit_rank("job-b", 1, 0, [])
        assert e.value.errno == errno.EACCES
        eng.abort("job-a", 1, "test")
        eng.close()
        state = {"w": torch.arange(4096, dtype=torch.float32)}
        dcp.save(state, storage_writer=CkptfsWriter(url, "job-a/step-2"))
        assert volume_for(url, (None, "local", None)).agent == agent.socket
        out = {"w": torch.zeros(4096)}
        dcp.load(out, storage_reader=CkptfsReader(url, "job-a/step-2"))
        assert torch.equal(out["w"], state["w"])
        with pytest.raises(BaseException) as e:  # DCP's CheckpointException is one
            dcp.save(state, storage_writer=CkptfsWriter(url, "job-b/step-1"))
        assert "PermissionError" in str(e.value), str(e.value)[-400:]
    finally:
        close_volumes()
        agent.signal(signal.SIGTERM)
    admin = connect(svc.url)  # the service itself, not through an agent
    assert admin.latest("job-a") == 2 and admin.latest("job-b") is None
    admin.close()


def test_socket_path_and_key(tmp_path, monkeypatch):
    """One socket per volume: the key ignores a URL's options (ranks name their own token
    files), CKPTFS_AGENT_SOCKET wins, and a socket someone else could have planted is not
    trusted."""
    monkeypatch.delenv("CKPTFS_AGENT_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    a = socket_path("ckptfs://h:1,g:2?token_file=/x")
    assert a == socket_path("ckptfs://h:1,g:2?token_file=/y&retry=5")
    assert a != socket_path("ckptfs://h:1")
    assert a.startswith(str(tmp_path / "ckptfs") + "/agent-")
    vol = tmp_path / "v"
    vol.mkdir()
    assert agent_key(str(vol)) == agent_key(str(vol) + "/")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert socket_path(str(vol)).startswith(f"/tmp/ckptfs-{os.getuid()}/")
    monkeypatch.setenv("CKPTFS_AGENT_SOCKET", str(tmp_path / "s.sock"))
    assert socket_path(str(vol)) == str(tmp_path / "s.sock")
    assert trusted(str(tmp_path / "s.sock")) is not None  # nothing there
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(d / "a.sock"))
        assert "writable by others" in trusted(str(d / "a.sock"))
        d.chmod(0o700)
        assert trusted(str(d / "a.sock")) is None


def test_no_agent_lookup_with_ckptfs_agent_off(tmp_path, monkeypatch, caplog):
    """CKPTFS_AGENT=off: no lookup and no line; otherwise one line per process."""
    from fusefs.agent import rank

    vol = new_volume(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(rank, "_said", set())
    caplog.set_level("INFO", logger="ckptfs.agent")
    monkeypatch.setenv("CKPTFS_AGENT", "off")
    assert rank.agent_volume(vol) is None
    assert NO_AGENT not in caplog.text
    monkeypatch.delenv("CKPTFS_AGENT")
    assert rank.agent_volume(vol) is None and rank.agent_volume(vol) is None
    assert caplog.text.count(NO_AGENT) == 1


class _Upstream:
    """Records what the batcher sends; `grouped=False` answers commit_ranks as an older
    service does (ENOSYS)."""

    def __init__(self, grouped: bool) -> None:
        self.grouped = grouped
        self.calls: list[tuple] = []

    async def call(self, token, method, args, kwargs, key=None):
        import trio

        self.calls.append((token, method, args, kwargs, key))
        await trio.sleep(0.001)
        if method == "commit_ranks":
            if not self.grouped:
                raise MetaError(errno.ENOSYS, "unknown method 'commit_ranks'")
            return [{"ok": {"rank": r}} if r != 3 else {"errno": 13, "error": "no"}
                    for r, _f, _h in args[2]]  # fmt: skip
        if method == "commit_rank":
            return {"rank": args[2]}
        if method == "manifest":
            want = kwargs.get("ranks") or [kwargs["rank"]]
            return {"step": 1, "files": [{"rank": r, "path": f"f{r}"} for r in want]}
        if method == "missing_chunks":
            return {i for i in args[0] if i[1] % 2}
        raise AssertionError(method)


@pytest.mark.parametrize("grouped", [True, False])
def test_the_batcher_groups_a_hosts_requests_and_answers_each_rank(grouped):
    """Eight ranks' commits within the window are one commit_ranks (each rank its own
    outcome); an older service's ENOSYS falls back to one commit_rank per rank with the
    rank's own key; manifests are one request split by rank; missing_chunks merged."""
    import trio

    up = _Upstream(grouped)
    got: dict = {}

    async def main() -> None:
        async with trio.open_nursery() as n:
            b = batch.Batcher(n, up.call)

            async def commit(r: int) -> None:
                try:
                    got[r] = await b.commit_rank("t", bytes([r]) * 16, ["j", 1, r, []], {})
                except MetaError as e:
                    got[r] = e.errno

            async def manifest(r: int) -> None:
                got[f"m{r}"] = await b.manifest("t", ["j", 1], {"rank": r})

            async def missing(r: int) -> None:
                got[f"x{r}"] = await b.missing_chunks("t", [bytes([r, k]) for k in range(3)])

            for r in range(8):
                n.start_soon(commit, r)
                n.start_soon(manifest, r)
                n.start_soon(missing, r)
            got["stats"] = b.stats
        assert not b.commits.groups and not b.manifests.queued and not b.missing.busy

    trio.run(main)
    methods = [c[1] for c in up.calls]
    if grouped:
        assert methods.count("commit_ranks") == 1 and "commit_rank" not in methods
        assert got[3] == 13 and got[5] == {"rank": 5}
        assert got["stats"]["commits_grouped"] == 8
    else:
        assert methods.count("commit_ranks") == 1 and methods.count("commit_rank") == 8
        keys = {c[4] for c in up.calls if c[1] == "commit_rank"}
        assert keys == {bytes([r]) * 16 for r in range(8)}  # each rank's own key
        assert got[3] == {"rank": 3}
    assert methods.count("manifest") == 1 and methods.count("missing_chunks") == 1
    assert got["m4"]["files"] == [{"rank": 4, "path": "f4"}] and got["m4"]["step"] == 1
    assert got["x5"] == {bytes([5, 1])}  # its own ids, of those missing


def test_what_arrives_while_a_question_is_upstream_goes_as_one_request():
    """Natural batching of "which exist?": a lone rank's question goes at once (no window
    to wait), and the 40 asked while it is upstream go together when it returns; a rank
    asking again after its answer is not held behind anyone's window."""
    import trio

    up = _Upstream(True)
    lone: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            b = batch.Batcher(n, up.call)
            t0 = trio.current_time()
            await b.missing_chunks("t", [b"\x01\x01"])
            lone.append(trio.current_time() - t0)

            async def ask(r: int) -> None:
                got = await b.missing_chunks("t", [bytes([r, 1]), bytes([r, 2])])
                assert got == {bytes([r, 1])}

            n.start_soon(ask, 0)
            await trio.sleep(0.0002)  # the first is sent; the rest come while it is upstream
            for r in range(1, 41):
                n.start_soon(ask, r)
        assert not b.missing.queued and not b.missing.busy

    trio.run(main)
    sizes = [len(c[2][0]) for c in up.calls]
    assert sizes == [1, 2, 80], sizes
    assert lone[0] < 0.5  # its round trip (1 ms here), no settle window on top


def test_put_get_through_the_agent_of_a_volume_directory_and_bad_clients(tmp_path):
    """An embedded volume's agent: `ckptfs put/get` go through it (its engine, its tier);
    a malformed request or a reset connection drops that connection, not the agent."""
    vol = new_volume(tmp_path)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = _env(XDG_RUNTIME_DIR=str(run), XDG_CACHE_HOME=str(tmp_path / "cache"))
    agent = AgentProc(vol, env, str(tmp_path / "agent.log"))
    try:
        data = os.urandom(300_000)
        (tmp_path / "f").write_bytes(data)
        cli = [sys.executable, "-m", "fusefs.cli", "-v"]
        for args in (["put", vol, str(tmp_path / "f"), "/a/f"],
                     ["get", vol, "/a/f", str(tmp_path / "g")]):  # fmt: skip
            res = subprocess.run([*cli, *args], env=env, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr
            assert NO_AGENT not in res.stderr
        assert (tmp_path / "g").read_bytes() == data
        with socket.socket(socket.AF_UNIX) as s:  # garbage after a good hello
            s.settimeout(10)
            s.connect(agent.socket)
            s.sendall(encode_frame({"proto": PROTO_VERSION, "token": ""}))
            s.sendall(encode_frame({"not": "a request"}))
            frames, dec = [], FrameDecoder()
            while len(frames) < 2 and (got := s.recv(65536)):
                frames += dec.feed(got)
            assert decode(frames[0])["ok"] is True
            assert decode(frames[1])[:2] == [0, errno.EPROTO], decode(frames[1])
        with socket.socket(socket.AF_UNIX) as s:  # a rank killed mid-request: a reset
            s.connect(agent.socket)
            s.sendall(encode_frame({"proto": PROTO_VERSION, "token": ""}))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        stats = agent_call(agent.socket, vol, "agent_stats")
        assert stats["ranks_served"] >= 4 and stats["upstream_connections"] == 0, stats
        assert stats["uploader_threads"] > 0, stats  # the agent's own tier
        assert agent.proc.poll() is None
    finally:
        assert agent.signal(signal.SIGTERM) == 0, agent.log_text()[-2000:]


def test_a_mount_with_agent_serves_the_hosts_ranks(tmp_path, mount_env, mount_factory):
    """`ckptfs mount --agent`: the mount daemon is the host's agent; a `ckptfs put` goes
    through it and the file reads back through the mountpoint; the socket goes with the
    unmount."""
    vol = new_volume(tmp_path)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    mount_env["XDG_RUNTIME_DIR"] = str(run)  # (the factory starts the mount with this env)
    m = mount_factory(vol, "mnt", "--agent")
    sock = str(run / "ckptfs" / f"agent-{agent_key(vol)}.sock")
    end = time.monotonic() + 30
    while not os.path.exists(sock):
        assert time.monotonic() < end, m.log_text()
        time.sleep(0.05)
    data = os.urandom(200_000)
    (tmp_path / "f").write_bytes(data)
    res = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "-v", "put", vol, str(tmp_path / "f"), "/a/f"],
        env=mount_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0 and NO_AGENT not in res.stderr, res.stderr
    stats = agent_call(sock, vol, "agent_stats")
    assert stats["ranks_served"] >= 1 and stats["pid"] == m.pid, stats
    end = time.monotonic() + 30
    while True:  # the mount learns of the file from its change feed
        try:
            with open(m.path("a", "f"), "rb") as f:
                assert f.read() == data
            break
        except FileNotFoundError:
            assert time.monotonic() < end
            time.sleep(0.2)
    m.unmount()
    assert not os.path.exists(sock)


def test_a_burst_of_hellos_is_set_up_in_one_round_trip_and_checked_once(service, tmp_path):
    """A restarted job's ranks say hello at once with the same token: the agent asks the
    service about it once, and each hello that asks gets the volume's config and the
    agent's info in its answer (no get_config, no agent_info round trips). A wrong token in
    the same burst is refused and gets neither."""
    vol, svc = service
    agent = AgentProc(svc.url, _env(), str(tmp_path / "agent.log"))
    try:
        token = open(svc.token_file).read().strip()
        want = {"proto": PROTO_VERSION, "token": token, "want": ["config", "info"]}
        said: list[dict] = [{} for _ in range(24)]

        def one(i: int) -> None:
            said[i] = _hello(agent.socket, want if i else {**want, "token": "ckt_nope"})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(said))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        refused, good = said[0], said[1:]
        assert refused["ok"] is False and refused["errno"] == errno.EACCES, refused
        assert "config" not in refused and "info" not in refused
        uuid = Volume.open(vol).config["uuid"]
        for s in good:
            assert s["ok"] is True, s
            assert s["config"]["uuid"] == uuid and s["info"]["staging_dir"], s
            assert s["info"]["budget"] > 0, s
        plain = _hello(agent.socket, {"proto": PROTO_VERSION, "token": token})
        assert plain["ok"] is True and "config" not in plain  # not asked: not sent
        stats = agent_call(agent.socket, svc.url, "agent_stats")
        assert stats["ranks_served"] == len(good) + 2, stats  # and agent_call's own
        assert stats["token_checks"] == 2, stats  # the good token once, the bad one once
    finally:
        assert agent.signal(signal.SIGTERM) == 0


def test_the_upstream_sends_what_queued_meanwhile_in_one_write():
    """RemoteUpstream: one sender thread; the requests queued while it sends go in its next
    submit together, each caller gets its own answer (or the error), and after close a
    call is refused."""
    from concurrent.futures import Future

    import trio

    from fusefs.agent.upstream import RemoteUpstream

    class Engine:
        def __init__(self) -> None:
            self.batches: list[list[str]] = []
            self.first = threading.Event()
            self.release = threading.Event()

        def encode_many(self, calls, *, token=None, keys=None):
            ((method, args, _kw),) = calls
            return [(0, method, (token, args[0]))]

        def submit_encoded(self, encoded):
            self.batches.append([e[2][1] for e in encoded])
            if len(self.batches) == 1:
                self.first.set()
                self.release.wait(10)
            if any(e[1] == "fail" for e in encoded):
                raise MetaError(errno.ECONNRESET, "gone")
            out = []
            for _rid, _m, (token, arg) in encoded:
                f: Future = Future()
                f.set_result(f"{token}:{arg}")
                out.append(f)
            return out

    eng = Engine()
    up = RemoteUpstream(eng)
    got: dict[int, str] = {}

    async def main() -> None:
        async def one(i: int) -> None:
            got[i] = await up.call(f"t{i}", "ping", [i], {})

        async with trio.open_nursery() as n:
            n.start_soon(one, 0)
            await trio.to_thread.run_sync(eng.first.wait, 10)  # the first is being sent
            for i in range(1, 41):
                n.start_soon(one, i)
            await trio.sleep(0.2)
            eng.release.set()
        with pytest.raises(MetaError) as e:
            await up.call("t", "fail", ["x"], {})
        assert e.value.errno == errno.ECONNRESET

    trio.run(main)
    assert got == {i: f"t{i}:{i}" for i in range(41)}
    assert [len(b) for b in eng.batches] == [1, 40, 1], eng.batches
    up.close()
    with pytest.raises(MetaError) as e:
        trio.run(up.call, "t", "ping", [1], {})
    assert e.value.errno == errno.EBADF


@pytest.mark.parametrize("older", [False, True])
def test_a_rank_process_sets_up_its_session_in_one_hello(service, tmp_path, monkeypatch, older):
    """A rank process (registry.py -> rank.agent_volume) asks for the volume's config and
    the agent's info in its hello: the agent sees the hello and no request for its set-up.
    Against an agent whose answer leaves them out (an older one: simulated by dropping
    them from the answer as the rank reads it), it asks get_config and agent_info."""
    from chunkstore.tier.stager import HostStager
    from fusefs.agent import rank
    from metadata.wire import dial

    vol, svc = service
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    agent = AgentProc(svc.url, _env(XDG_RUNTIME_DIR=str(run)), str(tmp_path / "agent.log"))
    try:
        if older:
            plain = dial.check_hello
            monkeypatch.setattr(
                dial, "check_hello", lambda b: {k: v for k, v in plain(b).items() if k == "ok"}
            )
        before = agent_call(agent.socket, svc.url, "agent_stats")
        monkeypatch.setenv("CKPTFS_AGENT_SOCKET", agent.socket)
        v = rank.agent_volume(svc.url, (None, "local", None))
        assert v is not None and v.agent == agent.socket
        try:
            assert v.config["uuid"] == Volume.open(vol).config["uuid"]
            assert isinstance(v.tier, HostStager) and v.tier.budget > 0
        finally:
            v.close()
        after = agent_call(agent.socket, svc.url, "agent_stats")
        assert after["ranks_served"] - before["ranks_served"] == 2, after  # v's, agent_call's
        # before's agent_stats was counted in it; after's own is the 1
        assert after["requests"] - before["requests"] == 1 + (2 if older else 0), after
    finally:
        agent.signal(signal.SIGTERM)


def test_a_restarts_manifests_by_the_remembered_latest_step_group_and_stay_per_token():
    """Ranks asking manifest(job, None) a few ms apart (a restart's connects trickle in):
    the first asks by None, the next by the step its answer named, grouped in the burst
    window, each rank its own files. Another token asks by None itself; a commit through
    the agent forgets the number; a remembered step that is gone is asked again by None."""
    import trio

    up = _Upstream(True)
    got: dict = {}
    gone: set[int] = set()
    plain = up.call

    async def call(token, method, args, kwargs, key=None):
        if method == "manifest" and args[1] in gone:
            up.calls.append((token, method, args, kwargs, key))
            raise MetaError(errno.ENOENT, f"no step {args[1]}")
        return await plain(token, method, args, kwargs, key)

    async def main() -> None:
        async with trio.open_nursery() as n:
            b = batch.Batcher(n, call)

            async def ask(r: int, token: str = "t") -> None:
                got[(token, r)] = await b.manifest(token, ["j", None], {"rank": r})

            async with trio.open_nursery() as ranks:
                for r in range(40):
                    ranks.start_soon(ask, r)
                    await trio.sleep(0.005)
            got["stats"] = dict(b.stats)
            await ask(0, "u")  # another token: not the first token's number
            await b.commit_rank("t", b"k" * 16, ["j", 2, 0, []], {})
            await ask(1)  # a commit through the agent: asked by None again
            gone.add(1)
            await ask(2)  # remembered 1, which is gone now: asked again by None

    trio.run(main)
    mans = [c for c in up.calls if c[1] == "manifest"]
    first = [c for c in mans if c[0] == "t"][:40]
    by_none = [c for c in first if c[2][1] is None]
    assert 1 <= len(by_none) <= 3, by_none  # the first, and any asked before it returned
    assert len({id(c) for c in first if c[2][1] == 1}) <= 12  # 40 ranks in a few groups
    assert len([c for c in mans if c[0] == "t"]) <= 15, mans
    assert all(got[("t", r)]["files"] == [{"rank": r, "path": f"f{r}"}] for r in range(40))
    assert got["stats"]["latest_reused"] >= 30, got["stats"]
    u = [c for c in mans if c[0] == "u"]
    assert len(u) == 1 and u[0][2][1] is None
    after = [c for c in mans if c[0] == "t"][-3:]  # ask(1) by None; ask(2) by 1, then None
    assert [c[2][1] for c in after] == [None, 1, None], after
