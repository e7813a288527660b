"""Periodic tasks never take their daemon down (issue 37): a real `ckptfs meta serve` (on
SQLite and on PostgreSQL) and a real `ckptfs mount` run many rounds of every periodic task
they have, and still serve; a step that raises is logged, counted and retried.

CKPTFS_PERIODIC_MAX_S (metadata.periodic) caps every periodic wait, so a minute's worth
of rounds (request-id pruning, backup checks) runs in seconds."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fusefs.client.volume import Volume
from fusefs.maint.backup import list_backups, open_nodes
from metadata.client import connect
from tests.fixtures.mount import ROOT, run_cli

CAP = "0.5"  # CKPTFS_PERIODIC_MAX_S for the daemons under test
NODES = 4  # `ckptfs format`'s default: VOL.nodes/n0 .. n3, beside the volume directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg-data")
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg-cache")
    env["CKPTFS_PERIODIC_MAX_S"] = CAP
    return env


def _node_urls(vol: str) -> list[str]:
    return [f"dir:{vol}.nodes/n{i}" for i in range(NODES)]


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _failures(samples: dict) -> dict[str, float]:
    """ckptfs_periodic_failures_total by task."""
    return {
        dict(labels)["task"]: v
        for (name, labels), v in samples.items()
        if name == "ckptfs_periodic_failures_total"
    }


def _backups(vol: str) -> list[dict]:
    return list_backups(open_nodes(_node_urls(vol)))


def _wait(what: str, cond, timeout: float, every: float = 0.2):
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


class Serve:
    """`ckptfs meta serve VOL` with extra options, its stderr in a file."""

    def __init__(self, vol: str, env: dict, log: str, *options: str) -> None:
        self.vol, self.env, self.log = vol, env, log
        with open(log, "ab") as lf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fusefs.cli", "meta", "serve", vol,
                 "--listen", "127.0.0.1:0", *options],
                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=lf,
            )  # fmt: skip
        line = b""
        end = time.monotonic() + 60
        while not line.endswith(b"\n") and time.monotonic() < end:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                got = os.read(self.proc.stdout.fileno(), 4096)
                if not got:
                    break
                line += got
        text = line.decode(errors="replace")
        if "serving" not in text:
            self.stop()
            raise AssertionError(f"meta serve did not start: {text} {self.log_text()}")
        self.port = int(text.split(" on ")[1].split()[0].rsplit(":", 1)[1])
        self.url = f"ckptfs://127.0.0.1:{self.port}?token_file={vol}/meta.token"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.proc.stdout.close()


@pytest.fixture
def serve(tmp_path) -> Iterator:
    made: list[Serve] = []

    def start(vol: str, *options: str) -> Serve:
        s = Serve(vol, _env(tmp_path), str(tmp_path / f"serve-{len(made)}.log"), *options)
        made.append(s)
        return s

    yield start
    for s in made:
        s.stop()


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, env=env, check=True, timeout=60)


def _put_get(env: dict, where: str, tmp_path, name: str) -> None:
    """A `ckptfs put` and `ckptfs get` round trip through `where` (a volume or URL)."""
    data = os.urandom(300_000)
    src, back = tmp_path / f"{name}.in", tmp_path / f"{name}.out"
    src.write_bytes(data)
    _cli(env, "put", where, str(src), f"/{name}")
    _cli(env, "get", where, f"/{name}", str(back))
    assert back.read_bytes() == data


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_meta_serve_runs_rounds_of_every_periodic_task_and_still_serves(
    request, tmp_path, serve, db
):
    env = _env(tmp_path)
    vol = str(tmp_path / "vol")
    pg = ["--db", request.getfixturevalue("pg_url")] if db == "postgres" else []
    _cli(env, "format", vol, *pg, "--backup-interval", "1", "--backup-keep", "3")
    mport = _free_port()
    srv = serve(vol, "--idle-timeout", "1", "--metrics", f"127.0.0.1:{mport}")
    t0 = time.monotonic()
    c = connect(srv.url)
    try:
        v = Volume(c, c.get_config())
        v.write_file("/before.bin", b"x" * 100_000)
        c.begin("job", 1, 2, deadline_s=1.0)  # for the expirer: no rank ever commits
        # the idle reaper closes the quiet connection; the client's next call reconnects
        time.sleep(2.0)
        assert c.checkpoint_info("job", 1)["state"] == "aborted"  # expired by the service
        assert c.reconnects >= 1, "the idle connection was not closed"
        # backups every second, kept 3: several taken, older ones dropped
        seen = _wait("3 automatic backups", lambda: len(_backups(vol)) >= 3 and _backups(vol), 30)
        ids = {b["id"] for b in seen}
        _wait("a backup dropped", lambda: not ids <= {b["id"] for b in _backups(vol)}, 30)
        # minutes' worth of rounds of the minute-long tasks (pruning, backup checks)
        time.sleep(max(0.0, 7.0 - (time.monotonic() - t0)))
        assert srv.alive(), srv.log_text()
        assert v.read_file("/before.bin") == b"x" * 100_000
        v.close()
    finally:
        c.close()
    _put_get(env, srv.url, tmp_path, "after")
    nodes = [a for u in _node_urls(vol) for a in ("--node", u)]
    listed = json.loads(_cli(env, "meta", "backups", *nodes, "--json").stdout)
    assert 1 <= len(listed) <= 3 and all(b["files"] >= 1 for b in listed)
    samples = _scrape(mport)
    assert samples[("ckptfs_meta_steps_aborted_total", ())] >= 1
    assert not any(_failures(samples).values()), _failures(samples)
    assert "periodic task" not in srv.log_text()
    assert srv.alive()


def test_a_mount_runs_rounds_of_every_periodic_task_and_still_serves(
    tmp_path, mount_env, new_volume, mount_factory
):
    mount_env["CKPTFS_PERIODIC_MAX_S"] = CAP
    vol = new_volume("vol", "--backup-interval", "1", "--backup-keep", "3")
    mport = _free_port()
    m = mount_factory(vol, "mnt", "--metrics", f"127.0.0.1:{mport}")
    t0 = time.monotonic()
    data = os.urandom(5 << 20)  # more than a chunk: staged in the tier, then uploaded
    with open(m.path("through-mount.bin"), "wb") as f:
        f.write(data)
    # the change feed: a file put by another process shows through the mount
    other = tmp_path / "other.in"
    other.write_bytes(b"from the cli")
    _cli(mount_env, "put", vol, str(other), "/from-cli.bin")
    _wait("the change feed", lambda: os.path.exists(m.path("from-cli.bin")), 10)
    seen = _wait("3 automatic backups", lambda: len(_backups(vol)) >= 3 and _backups(vol), 30)
    ids = {b["id"] for b in seen}
    _wait("a backup dropped", lambda: not ids <= {b["id"] for b in _backups(vol)}, 30)
    time.sleep(max(0.0, 7.0 - (time.monotonic() - t0)))  # tier rescans every second
    assert m.proc.poll() is None, m.log_text()
    with open(m.path("through-mount.bin"), "rb") as f:
        assert f.read() == data
    with open(m.path("from-cli.bin"), "rb") as f:
        assert f.read() == b"from the cli"
    _put_get(mount_env, vol, tmp_path, "after")
    _wait("the put through the feed", lambda: os.path.exists(m.path("after")), 10)
    samples = _scrape(mport)
    assert samples[("ckptfs_tier_uploaded_chunks_total", ())] >= 1
    assert not any(_failures(samples).values()), _failures(samples)
    assert "periodic task" not in m.log_text()
    assert m.proc.poll() is None


def _break_nodes(vol: str) -> None:
    """Every node's tmp/ replaced by a plain file: writing an object fails (ENOTDIR), even
    for root, whom a chmod would not stop; listing and reading still work."""
    for i in range(NODES):
        tmp = os.path.join(vol + ".nodes", f"n{i}", "tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with open(tmp, "w") as f:
            f.write("not a directory\n")


def _mend_nodes(vol: str) -> None:
    for i in range(NODES):
        tmp = os.path.join(vol + ".nodes", f"n{i}", "tmp")
        os.unlink(tmp)
        os.mkdir(tmp)


def test_a_failing_backup_is_logged_counted_and_retried_and_the_service_stays_up(tmp_path, serve):
    env = _env(tmp_path)
    vol = str(tmp_path / "vol")
    _cli(env, "format", vol, "--backup-interval", "1", "--backup-keep", "3")
    src = tmp_path / "before.in"
    src.write_bytes(os.urandom(100_000))
    _cli(env, "put", vol, str(src), "/before")
    mport = _free_port()
    _break_nodes(vol)  # before the first tick: every attempt fails until mended
    srv = serve(vol, "--metrics", f"127.0.0.1:{mport}")
    _wait(
        "two failed backups",
        lambda: _failures(_scrape(mport)).get("backup", 0) >= 2,
        30,
    )
    assert srv.alive(), srv.log_text()
    assert _backups(vol) == []
    lines = [ln for ln in srv.log_text().splitlines() if "periodic task backup failed" in ln]
    assert lines, srv.log_text()
    # one line, naming the task and what failed
    assert "in a row" in lines[0] and ("Error" in lines[0] or "error" in lines[0]), lines[0]
    # the service serves meanwhile (metadata only: the nodes take no object now)
    assert "before" in _cli(env, "ls", srv.url, "/").stdout
    _mend_nodes(vol)
    got = _wait("a backup after the nodes are mended", lambda: _backups(vol), 30)
    assert got[-1]["files"] >= 1
    _wait("the recovery line", lambda: "periodic task backup works again" in srv.log_text(), 10)
    failed = _failures(_scrape(mport))["backup"]
    assert failed >= 2
    time.sleep(2.0)  # more rounds: no new failure
    assert _failures(_scrape(mport))["backup"] == failed
    assert srv.alive(), srv.log_text()
    _put_get(env, srv.url, tmp_path, "after")


def test_backup_interval_0_takes_no_backup_in_a_mount(
    tmp_path, mount_env, new_volume, mount_factory
):
    """`ckptfs format --backup-interval 0` ("0 for none", issue 37 item 11): a mount of the
    volume runs no backup task (no tick lists a node or takes a backup)."""
    mount_env["CKPTFS_PERIODIC_MAX_S"] = CAP
    vol = new_volume("vol", "--backup-interval", "0")
    m = mount_factory(vol, "mnt")
    with open(m.path("f.bin"), "wb") as f:
        f.write(b"y" * 100_000)
    time.sleep(3.0)  # six backup checks, were there a task
    assert _backups(vol) == []
    assert m.proc.poll() is None, m.log_text()
    with open(m.path("f.bin"), "rb") as f:
        assert f.read() == b"y" * 100_000
