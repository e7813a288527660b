"""Prometheus metrics from the daemons: a real mount and a real `meta serve` with
--metrics, their /metrics pages parsed with prometheus_client's own text parser."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metadata.client import connect
from metadata.engine import Extent, MetaError, NewChunk
from tests.fixtures.mount import ROOT, is_mounted, run_cli

MiB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of http://127.0.0.1:PORT/metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not exported; have {sorted({k[0] for k in samples})}"
    return samples[key]


def test_mount_metrics_count_writes_and_tier_drains_after_flush(new_volume, mount_factory):
    vol = new_volume()
    port = free_port()
    m = mount_factory(vol, "mnt", "--metrics", f"127.0.0.1:{port}")
    n = 24 * MiB + 12345
    payload = os.urandom(n)
    with open(m.path("checkpoint-secret-name.bin"), "wb") as f:
        f.write(payload)
    before = scrape(port)
    assert value(before, "ckptfs_fuse_bytes_total", op="write") >= n
    assert value(before, "ckptfs_fuse_requests_total", op="write") >= 1
    assert value(before, "ckptfs_client_logical_bytes_total") >= n
    assert value(before, "ckptfs_client_chunk_puts_total", where="tier") >= n // (4 * MiB)
    # staged in the tier: pending now, or already uploaded by its background drain
    staged = value(before, "ckptfs_tier_pending_bytes") + value(
        before, "ckptfs_tier_upload_bytes_total"
    )
    assert staged > 0
    with open(m.path("checkpoint-secret-name.bin"), "rb") as f:
        assert f.read() == payload
    m.cli("flush", vol, check=True, timeout=300)
    after = scrape(port)
    assert value(after, "ckptfs_tier_pending_bytes") == 0
    assert value(after, "ckptfs_tier_pending_chunks") == 0
    assert value(after, "ckptfs_tier_uploaded_chunks_total") >= n // (4 * MiB)
    assert value(after, "ckptfs_fuse_bytes_total", op="read") >= n
    hits = value(after, "ckptfs_fuse_read_cache_hits_total")
    misses = value(after, "ckptfs_fuse_read_cache_misses_total")
    assert hits + misses >= n // (4 * MiB)
    assert value(after, "ckptfs_node_errors_total", node="n0") == 0
    assert value(after, "ckptfs_node_breaker_open", node="n0") == 0
    assert any(k[0] == "ckptfs_info" and ("component", "mount") in k[1] for k in after)
    # the endpoint counts what answering cost: a scrape once its reply is sent (the first
    # surely is by now; the second's thread may still be finishing)
    assert value(after, "ckptfs_metrics_scrapes_total") >= 1
    assert 0 < value(after, "ckptfs_metrics_scrape_cpu_seconds_total") < 5
    # bounded labels: no path, no chunk id, nothing but the known label names
    names = {k for (_, labels) in after for k, _ in labels}
    assert names <= {"op", "where", "node", "component", "version", "le"}, names
    for _, labels in after:
        for _, v in labels:
            assert "secret" not in v and len(v) < 40, v


def test_the_endpoint_counts_what_each_scrape_cost_and_refuses_bad_addresses(capfd):
    """The endpoint's own server: one count (and some CPU) per scrape once it is answered,
    nothing logged per request, IPv6 literals bound as IPv6, and an address it cannot
    serve on refused with one line (a name the IDNA codec rejects, an address this host
    does not have: neither sends a packet)."""
    from fusefs.metrics import MetricsError, MetricsServer

    m = MetricsServer("127.0.0.1", 0, "test", [])
    try:
        for n in range(1, 4):
            urllib.request.urlopen(m.url, timeout=10).read()
            deadline = time.monotonic() + 10
            while m.cost.scrapes < n and time.monotonic() < deadline:
                time.sleep(0.005)
            assert m.cost.scrapes == n  # the reply is sent before its thread counts it
        samples = scrape(m.port)
        assert value(samples, "ckptfs_metrics_scrapes_total") == 3
        assert 0 < value(samples, "ckptfs_metrics_scrape_cpu_seconds_total") < 3
    finally:
        m.close()
    assert capfd.readouterr().err == ""  # no access log
    if socket.has_ipv6:
        try:
            m6 = MetricsServer("::1", 0, "test", [])
        except MetricsError:
            pass  # IPv6 disabled on this host
        else:
            assert m6._httpd.address_family == socket.AF_INET6
            assert urllib.request.urlopen(m6.url, timeout=10).read()
            m6.close()
    for host in ("a" * 70 + ".example", "192.0.2.1"):
        with pytest.raises(MetricsError, match="cannot serve metrics on"):
            MetricsServer(host, 0, "test", [])


@pytest.mark.parametrize("background", [False, True])
def test_taken_metrics_port_fails_the_mount(new_volume, mount_env, tmp_path, background):
    vol = new_volume()
    mp = tmp_path / "mnt"
    mp.mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["mount", vol, str(mp), "--metrics", f"127.0.0.1:{port}"]
        res = run_cli(*args, *(["--background"] if background else []), env=mount_env, timeout=60)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "cannot serve metrics on 127.0.0.1:" in lines[0] and "taken" in lines[0]
    assert not is_mounted(str(mp))


def _files(tag: bytes, path: str = "f") -> list[dict]:
    cid = tag.ljust(16, b"_")[:16]
    return [{"path": path, "size": 10, "extents": [Extent(0, 10, cid)],
             "new_chunks": [NewChunk(cid, 10, 10)]}]  # fmt: skip


def test_service_metrics(tmp_path):
    vol = str(tmp_path / "vol")
    run_cli("format", vol, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusefs.cli", "meta", "serve", vol, "--listen", "127.0.0.1:0",
         "--metrics", f"127.0.0.1:{port}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert f"metrics http://127.0.0.1:{port}/metrics" in line, line + proc.stderr.read()
        meta_port = int(line.split(" on ")[1].split()[0].rsplit(":", 1)[1])
        url = f"ckptfs://127.0.0.1:{meta_port}?token_file={vol}/meta.token"
        c = connect(url)
        c.begin("job", 1, 2)
        c.commit_rank("job", 1, 0, _files(b"r0"))
        c.commit_rank("job", 1, 1, _files(b"r1", "g"))
        c.begin("job", 2, 2)
        c.commit_rank("job", 2, 0, _files(b"s0"))
        c.abort("job", 2)
        with pytest.raises(MetaError):
            c.lookup(1, b"no-such-name")
        bad = tmp_path / "bad.token"
        bad.write_text("w" * 32)
        bad.chmod(0o600)  # others may not read a token file
        with pytest.raises(MetaError, match="wrong token"):
            connect(f"ckptfs://127.0.0.1:{meta_port}?token_file={bad}")
        s = scrape(port)
        assert value(s, "ckptfs_meta_requests_total", method="commit_rank", outcome="ok") == 3
        assert value(s, "ckptfs_meta_requests_total", method="lookup", outcome="ENOENT") == 1
        assert value(s, "ckptfs_meta_commit_latency_seconds_count") == 3
        assert value(s, "ckptfs_meta_commit_latency_seconds_bucket", le="+Inf") == 3
        assert value(s, "ckptfs_meta_publish_latency_seconds_count") == 1
        assert value(s, "ckptfs_meta_group_commit_ranks_count") >= 1
        assert value(s, "ckptfs_meta_group_commit_ranks_sum") == 3
        assert value(s, "ckptfs_meta_checkpoints_published_total") == 1
        assert value(s, "ckptfs_meta_steps_aborted_total") == 1
        assert value(s, "ckptfs_meta_bad_clients_total") >= 1
        assert value(s, "ckptfs_meta_connections") >= 1
        c.close()
        deadline = time.monotonic() + 10
        while value(scrape(port), "ckptfs_meta_connections") != 0:
            assert time.monotonic() < deadline, "the closed connection is still counted"
            time.sleep(0.05)
        # a service (of another volume: a SQLite volume runs one) on the same metrics port
        # fails at start, in one line
        vol2 = str(tmp_path / "vol2")
        run_cli("format", vol2, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
        res = run_cli(
            "meta", "serve", vol2, "--listen", "127.0.0.1:0", "--metrics", f"127.0.0.1:{port}",
            env=dict(os.environ, PYTHONPATH=ROOT), timeout=60,
        )  # fmt: skip
        assert res.returncode == 1
        assert res.stderr.strip().count("\n") == 0 and "cannot serve metrics" in res.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()


def _every_family() -> dict[str, str]:
    """Every metric family the collectors export, from stand-ins for the objects they read
    (name -> type), plus the namespaced process metrics."""
    from types import SimpleNamespace

    from chunkstore.health import NodeHealth
    from fusefs.metrics import (
        MountCollector,
        ServiceCollector,
        VolumeCollector,
        _Info,
        _ScrapeCost,
    )
    from metadata.server.stats import ServiceStats

    fs = SimpleNamespace(
        op_counts={"write": 1}, op_errors={"lookup": 1}, bytes_read=0, bytes_written=0,
        handles={}, vol=None,
        cache=SimpleNamespace(dirty_bytes=0, inflight_bytes=0, cache_hits=0, cache_misses=0,
                              _cached_bytes=0),
    )  # fmt: skip
    stats = dict.fromkeys(
        ["pending_chunks", "pending_bytes", "to_upload_chunks", "uploaded_chunks",
         "uploaded_bytes", "upload_rate_bps", "upload_failures", "housekeeping_failures",
         "lost_chunks",
         "writer_waits", "used_bytes", "cached_bytes", "budget_bytes", "cache_hits",
         "cache_misses"], 0,
    )  # fmt: skip
    stats["oldest_pending_ns"] = None
    sink = SimpleNamespace(
        **dict.fromkeys(
            ["chunks_in", "bytes_in", "dedup_hits", "dedup_bytes", "puts_inline", "puts_tier",
             "puts_nodes", "stored_bytes"], 0,
        )
    )  # fmt: skip
    vol = SimpleNamespace(
        sink=sink,
        store=SimpleNamespace(bad_replicas_seen=0, health={"n0": NodeHealth()}),
        tier=SimpleNamespace(stats=lambda: stats),
    )
    counters = ServiceStats()
    counters.reply("lookup", None)
    svc = SimpleNamespace(counters=counters, connections=0,
                          stats={"bad_clients": 0, "hello_evictions": 0, "refused_scope": 0,
                                 "admin_calls": 0})  # fmt: skip
    mount = MountCollector()
    mount.attach(fs)
    out = {}
    collectors = (mount, VolumeCollector(lambda: [vol]), ServiceCollector(svc), _Info("mount"),
                  _ScrapeCost())  # fmt: skip
    for c in collectors:
        for fam in c.collect():
            out[fam.name] = fam.type
    return out


def test_every_metric_is_documented_and_the_dashboard_uses_real_ones():
    import json
    import re

    families = _every_family()
    assert all(name.startswith("ckptfs_") for name in families)
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(ckptfs_\w+)` \|", section, re.M))
    exported = {n + "_total" if t == "counter" else n for n, t in families.items()}
    exported.discard("ckptfs_info")  # described in the section's text
    assert exported <= documented, f"not in the README: {sorted(exported - documented)}"
    assert documented <= exported, f"documented but not exported: {sorted(documented - exported)}"
    with open(os.path.join(ROOT, "docs", "grafana-ckptfs.json")) as f:
        dashboard = json.load(f)
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used.update(re.findall(r"ckptfs_\w+", target["expr"]))
    known = exported | {n + s for n, t in families.items() if t == "histogram"
                        for s in ("_bucket", "_sum", "_count")}  # fmt: skip
    assert used and used <= known, f"dashboard names unknown metrics: {sorted(used - known)}"


def test_a_training_process_can_export_its_volumes(tmp_path, monkeypatch, entry_point_site):
    """serve_process_metrics: the client and tier metrics of what fsspec (or DCP) opened."""
    import fsspec

    from fusefs.client.registry import close_volumes
    from fusefs.client.volume import Volume
    from fusefs.metrics import serve_process_metrics

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    vol = str(tmp_path / "vol")
    Volume.create(vol).close()
    server = serve_process_metrics(("127.0.0.1", 0))
    try:
        n = 9 * MiB
        with fsspec.open("ckptfs:///m/data", "wb", volume=vol) as f:
            f.write(os.urandom(n))
        s = scrape(server.port)
        assert value(s, "ckptfs_client_logical_bytes_total") == n
        assert value(s, "ckptfs_client_chunk_puts_total", where="tier") == 3
        with fsspec.open("ckptfs:///m/copy", "wb", volume=vol) as f:
            f.write(fsspec.filesystem("ckptfs", volume=vol).cat_file("/m/data"))
        s = scrape(server.port)
        assert value(s, "ckptfs_client_dedup_hits_total") == 3
    finally:
        server.close()
        close_volumes()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_stalled_scrapers_hold_no_threads_and_a_real_scrape_is_answered(monkeypatch):
    """Issue 40 (D): 300 connections that never finish their request headers (and one
    that sends too many) hold neither a thread each nor a descriptor for long, and a normal
    scrape among them is answered at once."""
    import threading

    import fusefs.metrics as metrics

    monkeypatch.setattr(metrics, "REQUEST_TIMEOUT_S", 1.5)
    m = metrics.MetricsServer("127.0.0.1", 0, "test", [])
    stalled: list[socket.socket] = []
    try:
        threads0, fds0 = threading.active_count(), _fds()
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", m.port), timeout=5)
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never ends
            stalled.append(s)
        time.sleep(0.3)  # the server took them all
        t0 = time.monotonic()
        body = urllib.request.urlopen(m.url, timeout=5).read()
        assert b"ckptfs_info" in body
        assert time.monotonic() - t0 < 1.0
        # a bounded pool: the selector thread and the workers, however many connect
        assert threading.active_count() - threads0 <= metrics.WORKERS + 1
        # descriptors: ours (300) and at most the server's pending bound on its side
        assert _fds() - fds0 <= 300 + metrics.PENDING_MAX + 8
        # too many header bytes: refused, not read forever
        with socket.create_connection(("127.0.0.1", m.port), timeout=5) as big:
            big.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * (64 << 10))
            assert big.recv(100).startswith(b"HTTP/1.0 431")
        # the slow ones are closed after the timeout (EOF on ours), with no answer
        deadline = time.monotonic() + 10
        s = stalled[-1]
        s.settimeout(max(0.1, deadline - time.monotonic()))
        assert s.recv(100) == b""
        assert urllib.request.urlopen(m.url, timeout=5).read()  # and scrapes go on
    finally:
        for s in stalled:
            s.close()
        m.close()
