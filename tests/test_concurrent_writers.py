"""Separate processes writing the same new content at once, through each frontend (issue 38).

Every writer is told the same new chunks are missing, leases them, stores them and commits;
all must commit, and every file must read back bit for bit. The first lease design refused
the commit of the second of two processes that stored the same new content ("N new chunk(s)
... were stored under a lease that lapsed or gc condemned"). DCP's checkpoint commits are
covered by tests/test_training.py; here: `ckptfs put` (a volume directory, and a service),
fsspec writers (with and without the host's write-behind tier) and two FUSE mounts of one
volume through one service (a mount always has a tier: as one host, and as two hosts).

The writers start together: each child imports what it needs, says it is ready and waits
for a "go" file. And they race for real: a hook (a sitecustomize on the children's
PYTHONPATH, written below) holds each writer's first answer of `ChunkSink.missing` that
names new chunks until every writer has had one, so no writer commits before every writer
has been told its first chunks are missing (for `put` and fsspec, the first shared ones: a
writer asks in file order). The hook records every id each writer was told is missing, and
the tests check some were told to all of them (so all stored them under the same lease). It
changes nothing but timing.

Content per writer: 1 MiB shared (16 chunks of 64 KiB), 2 chunks of its own, 3 more shared
chunks, and an unaligned tail of its own (a partial last chunk).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from fusefs.client.volume import Volume
from tests.fixtures.mount import ROOT, have, run_cli

CHUNK = 64 * 1024
WAIT_S = 60.0  # bound of every wait on a child (start, rendezvous, run)

HOOK = r'''
"""Test hook (tests/test_concurrent_writers.py): a start line and a rendezvous."""
import os
import sys
import threading
import time

_RV = os.environ.get("CW_RENDEZVOUS")
_WAIT = float(os.environ.get("CW_WAIT_S", "60"))


def _count(d, prefix):
    return sum(1 for n in os.listdir(d) if n.startswith(prefix))


if _RV:
    from fusefs.client import sink as _sink

    _parties = int(os.environ["CW_PARTIES"])
    _orig = _sink.ChunkSink.missing
    _lock = threading.Lock()
    _first = []

    def missing(self, ids):
        got = _orig(self, ids)
        if got:
            with _lock:
                mine = not _first
                _first.append(1)
                with open(os.path.join(_RV, f"all-{os.getpid()}"), "a") as f:
                    f.write("".join(c.hex() + "\n" for c in got))
            if mine:  # this process's first answer naming new chunks
                open(os.path.join(_RV, f"told-{os.getpid()}"), "w").close()
            end = time.monotonic() + _WAIT  # every writer told before any goes on
            while _count(_RV, "told-") < _parties and time.monotonic() < end:
                time.sleep(0.002)
        return got

    _sink.ChunkSink.missing = missing

_GO = os.environ.get("CW_GO")
if _GO:
    import importlib

    for _m in os.environ.get("CW_PREIMPORT", "").split(","):
        if _m:
            importlib.import_module(_m)  # the slow part of starting, before the start line
    open(os.path.join(os.path.dirname(_GO), f"ready-{os.getpid()}"), "w").close()
    _end = time.monotonic() + _WAIT
    while not os.path.exists(_GO):
        if time.monotonic() > _end:
            sys.exit("concurrent-writers hook: no go")
        time.sleep(0.001)
'''

FSSPEC_WRITER = r"""
import sys

import fsspec

url, src, staging, volume = sys.argv[1:5]
opts = {} if staging == "on" else {"staging": False}
if volume:
    opts["volume"] = volume
with open(src, "rb") as f:
    data = f.read()
with fsspec.open(url, "wb", **opts) as out:
    step = 100_000  # not chunk-aligned
    for i in range(0, len(data), step):
        out.write(data[i : i + step])
"""


def contents(n: int) -> list[bytes]:
    """n files: the same 16 + 3 chunks in each, 2 chunks and a tail of its own between."""
    head, mid = os.urandom(16 * CHUNK), os.urandom(3 * CHUNK)
    return [head + os.urandom(2 * CHUNK) + mid + os.urandom(777 + 1000 * i) for i in range(n)]


class Race:
    """The hook's directory and the environment that turns it on in a child."""

    def __init__(self, tmp_path, parties: int, preimport: str = "fusefs.cli.main") -> None:
        self.dir = tmp_path / "race"
        self.hook = tmp_path / "race-hook"
        self.dir.mkdir()
        self.hook.mkdir()
        (self.hook / "sitecustomize.py").write_text(HOOK)
        self.parties = parties
        self.go = self.dir / "go"
        self.preimport = preimport

    def env(self, base: dict, *, start_line: bool = True) -> dict:
        env = dict(base)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.hook), ROOT, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        )
        env.update(CW_RENDEZVOUS=str(self.dir), CW_PARTIES=str(self.parties), CW_WAIT_S=str(WAIT_S))
        if start_line:
            env.update(CW_GO=str(self.go), CW_PREIMPORT=self.preimport)
        return env

    def run(self, cmds: list[list[str]], env: dict) -> list[subprocess.CompletedProcess]:
        """Start every command, release them together once all are ready, wait for all."""
        assert len(cmds) == self.parties
        procs = [
            subprocess.Popen(
                cmd, env=self.env(env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for cmd in cmds
        ]
        try:
            end = time.monotonic() + WAIT_S
            while self.count("ready-") < len(procs):
                dead = [p for p in procs if p.poll() is not None]
                assert not dead, f"a writer exited before the start: {dead[0].stderr.read()}"
                assert time.monotonic() < end, "writers not ready"
                time.sleep(0.01)
            self.go.touch()
            out = []
            for cmd, p in zip(cmds, procs, strict=True):
                so, se = p.communicate(timeout=max(1.0, end + WAIT_S - time.monotonic()))
                out.append(subprocess.CompletedProcess(cmd, p.returncode, so, se))
            return out
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)

    def count(self, prefix: str) -> int:
        return sum(1 for n in os.listdir(self.dir) if n.startswith(prefix))

    def told(self) -> list[set[str]]:
        """The ids each writer was told are missing (every answer of `missing`)."""
        return [
            set((self.dir / n).read_text().split())
            for n in sorted(os.listdir(self.dir))
            if n.startswith("all-")
        ]

    def check_raced(self) -> None:
        told = self.told()
        assert len(told) == self.parties, f"{len(told)} of {self.parties} writers asked"
        both = set.intersection(*told)
        assert both, "no chunk was told missing to every writer: they did not race"
        self.raced = len(both)  # ids every writer was told are missing (and stored)


def check_ok(results: list[subprocess.CompletedProcess]) -> None:
    bad = [(r.args[-1], r.returncode, r.stderr.decode(errors="replace")[-2000:]) for r in results]
    bad = [b for b in bad if b[1] != 0]
    assert not bad, f"{len(bad)} of {len(results)} writers failed: {bad}"


def read_all(spec: str, paths: list[str]) -> list[bytes]:
    with Volume.open(spec) as vol:
        out = []
        for p in paths:
            with vol.open_read(p) as r:
                out.append(r.pread(0, r.size) if r.size else b"")
        return out


def fsck(spec: str, env: dict) -> None:
    res = run_cli("fsck", spec, "--json", env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture
def race_volume(new_volume, meta_server):
    """(spec a writer opens, volume directory): the directory, or ckptfs:// of a service."""

    def make(via: str) -> tuple[str, str]:
        vol = new_volume("vol", "--chunk-size", str(CHUNK))
        return (vol if via == "directory" else meta_server(vol).url), vol

    return make


@pytest.mark.parametrize("via", ["directory", "service"])
def test_put_processes_store_the_same_new_content(race_volume, mount_env, tmp_path, via):
    """4 `ckptfs put` processes, the same new chunks, different paths of one volume: all
    commit, every file reads back. (`put` has no write-behind tier: straight to the nodes.)"""
    n = 4
    spec, vol_dir = race_volume(via)
    datas = contents(n)
    cmds = []
    for i, data in enumerate(datas):
        src = tmp_path / f"src{i}.bin"
        src.write_bytes(data)
        cmds.append([sys.executable, "-m", "fusefs.cli", "put", spec, str(src), f"/job/f{i}"])
    race = Race(tmp_path, n)
    check_ok(race.run(cmds, mount_env))
    race.check_raced()
    assert read_all(spec, [f"/job/f{i}" for i in range(n)]) == datas
    out = tmp_path / "got0.bin"
    run_cli("get", spec, "/job/f0", str(out), env=mount_env, check=True)
    assert out.read_bytes() == datas[0]
    fsck(vol_dir, mount_env)


@pytest.mark.parametrize("staging", ["on", "off"])
@pytest.mark.parametrize("via", ["directory", "service"])
def test_fsspec_processes_store_the_same_new_content(
    race_volume, mount_env, entry_point_env, tmp_path, via, staging
):
    """3 processes, each `fsspec.open("ckptfs://...", "wb")` of the same new chunks, with the
    host's write-behind tier (the default; drained at exit) and without (staging=False)."""
    n = 3
    spec, vol_dir = race_volume(via)
    datas = contents(n)
    script = tmp_path / "fsspec_writer.py"
    script.write_text(FSSPEC_WRITER)
    cmds = []
    for i, data in enumerate(datas):
        src = tmp_path / f"src{i}.bin"
        src.write_bytes(data)
        if via == "directory":
            url, volume = f"ckptfs:///job/f{i}", vol_dir
        else:
            base, _, query = spec.partition("?")
            url, volume = f"{base}/job/f{i}?{query}", ""
        cmds.append([sys.executable, str(script), url, str(src), staging, volume])
    env = dict(entry_point_env, XDG_CACHE_HOME=mount_env["XDG_CACHE_HOME"])
    env["XDG_DATA_HOME"] = mount_env["XDG_DATA_HOME"]
    race = Race(tmp_path, n, preimport="fsspec,fusefs.fsspec,fusefs.client.registry")
    check_ok(race.run(cmds, env))
    race.check_raced()
    assert read_all(spec, [f"/job/f{i}" for i in range(n)]) == datas
    fsck(vol_dir, mount_env)


@pytest.mark.skipif(not (os.path.exists("/dev/fuse") and have("fusermount3")), reason="no FUSE")
@pytest.mark.parametrize("hosts", ["one-host", "two-hosts"])
def test_two_mounts_store_the_same_new_content(
    race_volume, mount_factory, mount_env, tmp_path, hosts
):
    """Two mounts of one volume through one service, each writing the same new chunks into
    two files of its own at once (four writer threads released together): every file
    commits and reads back through both mounts and with `ckptfs get`. one-host: both
    mounts share the host's staging directory; two-hosts: each has its own."""
    spec, vol_dir = race_volume("service")
    race = Race(tmp_path, 2)  # the mount daemons are the parties
    mount_env.update(race.env(mount_env, start_line=False))  # every child sees the hook
    mounts = []
    for name in ("a", "b"):
        tier = ["--staging", str(tmp_path / f"st-{name}")] if hosts == "two-hosts" else []
        mounts.append(mount_factory(spec, name, *tier))
    a, b = mounts
    os.mkdir(a.path("job"))
    datas = contents(4)
    files = [(a, "f0"), (b, "f1"), (a, "f2"), (b, "f3")]
    go = threading.Event()
    errors: list[BaseException] = []

    def write(m, name: str, data: bytes) -> None:
        try:
            if not go.wait(WAIT_S):
                raise TimeoutError("no go")
            with open(m.path("job", name), "wb") as f:
                for i in range(0, len(data), 100_000):
                    f.write(data[i : i + 100_000])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=write, args=(m, name, data), daemon=True)
        for (m, name), data in zip(files, datas, strict=True)
    ]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(2 * WAIT_S)
    assert not any(t.is_alive() for t in threads), "a writer hung"
    assert not errors, errors
    race.check_raced()
    for m in mounts:
        for (_, name), data in zip(files, datas, strict=True):
            path = m.path("job", name)
            deadline = time.monotonic() + 10  # the other mount's attribute cache
            while os.path.getsize(path) != len(data) and time.monotonic() < deadline:
                time.sleep(0.1)
            with open(path, "rb") as f:
                assert f.read() == data, f"{name} through mount {os.path.basename(m.mp)}"
    assert read_all(spec, [f"/job/{name}" for _, name in files]) == datas
    for (_, name), data in zip(files[:2], datas[:2], strict=True):  # one through each mount
        out = tmp_path / f"got-{name}"
        run_cli("get", spec, f"/job/{name}", str(out), env=mount_env, check=True, timeout=120)
        assert out.read_bytes() == data
    for m in mounts:  # bounded: the daemon drains its tier before it exits
        m.unmount(timeout=WAIT_S)
    fsck(vol_dir, mount_env)
