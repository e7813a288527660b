"""Issue 40's attacks on one `ckptfs meta serve` with its defaults, while a client times it.

`python -m bench.hostile [--quick]` starts a real service process (SQLite volume in a temp
dir, 127.0.0.1 only, metrics on), then, one kind at a time and then all together:

  nonreaders  N authenticated connections each send R get_xattr requests with 64 KiB
              answers and never read (issue: 8 x 1000 raised RSS by 503 MiB)
  stalled     N connections stop 16 bytes short of a 64 MiB frame (issue: 219 MiB held
              for the 900 s idle timeout); the time until the service dropped all of them
  waiters     20,000 idle wait_published on one open step, 2,000 a connection over four
              reader tokens (a token may hold 8,192; issue: 5 x 4,000 took 107% CPU)
  long_waits  200 connections with one wait_published(timeout=3600) each
  scrapers    300 metrics connections that never finish their request headers

while a well-behaved client (its own connection, the admin token) alternates getattr and
create, timed, and a thread samples the service's RSS (/proc/PID/status VmRSS) every 50 ms.
Then a soak, no abuse: `ckptfs bench ckptfs://...` (256 ranks, 4 hosts, 64 KiB shards,
change rate 0.1), --soak-runs runs of --soak-steps steps one after another (a new job
each), against a second service whose bounded caches are sized down (idempotency slots,
finished steps' states) so that the first run fills them; RSS after the last run minus
after the middle one.

One JSON object: rss_growth_mib (largest RSS during the attacks minus before; target <=
the budget + 64), legit_p99_vs_quiet (the client's p99 under attack / in the quiet phase
of the same run; <= 5), legit_refused (its errors; = 0), service_cpu_waiters (the service's
CPU share over a few seconds with the waiters held and nothing else; <= 0.10),
soak_rss_growth_mib (<= 10), each phase's figures, "targets" and "pass". Every loop is
bounded in count and in time; a run with the defaults takes a few minutes, --quick well
under one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.servers.metaserve import MetaServer
from fusefs.cli.units import parse_size
from metadata.wire.protocol import HEADER, MEMORY_BUDGET, PROTO_VERSION, encode_frame

JOB = "hostile"
SAMPLE_S = 0.05  # RSS sampling period
STALL_WAIT_S = 20.0  # at most this long for the service to drop the stalled frames
SOAK_CACHES = {"IDEM_KEEP": 256, "TERMINAL_KEEP": 8}  # sized down for the soak's service


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} for {pid}")


def rss_mib(pid: int) -> float:
    return _status(pid, "VmRSS") / 1024


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """The service's RSS every SAMPLE_S in a thread; `peak` since the last `reset`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except (OSError, RuntimeError):
                return

    def reset(self) -> None:
        self.peak = rss_mib(self.pid)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


class Legit:
    """A well-behaved client: getattr and create alternately, each timed; errors counted."""

    def __init__(self, url: str) -> None:
        from metadata.client import connect

        self.client = connect(url)
        self.dir = self.client.create(1, b"legit", 0o40755, 0, 0).ino
        self.n = 0
        self.errors: list[str] = []

    def run(self, seconds: float, max_ops: int) -> dict[str, list[float]]:
        """Seconds each call took, by method."""
        out: dict[str, list[float]] = {"getattr": [], "create": []}
        end = time.monotonic() + seconds
        for _ in range(max_ops):
            if time.monotonic() >= end:
                break
            self.n += 1
            method = "getattr" if self.n % 2 else "create"
            t0 = time.perf_counter()
            try:
                if method == "getattr":
                    self.client.getattr(1)
                else:
                    self.client.create(self.dir, b"f%07d" % self.n, 0o100644, 0, 0)
            except Exception as e:  # noqa: BLE001 - counted: a refusal is the finding
                self.errors.append(f"{type(e).__name__}: {e}")
                continue
            out[method].append(time.perf_counter() - t0)
            time.sleep(0.002)  # a client that works, not a flood
        return out


def _authed(port: int, token: str, rcvbuf: int | None = None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.sendall(encode_frame({"proto": PROTO_VERSION, "token": token}))
    got = b""
    while len(got) < 4 or len(got) < 4 + HEADER.unpack_from(got)[0]:
        more = s.recv(4096)
        if not more:
            raise RuntimeError("the service closed a new connection")
        got += more
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the service closed `s` (reads away what it sent, without waiting)."""
    s.setblocking(False)
    try:
        for _ in range(64):
            if not s.recv(1 << 20):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    return False


class Attacks:
    """Each attack opens its connections and returns them, held (closed by `close`)."""

    def __init__(self, args: argparse.Namespace, port: int, metrics_port: int, tokens: dict):
        self.a = args
        self.port = port
        self.metrics_port = metrics_port
        self.tokens = tokens
        self.socks: list[socket.socket] = []
        self.stalled: list[socket.socket] = []
        self.held_waits = 0

    def nonreaders(self) -> None:
        burst = b"".join(
            encode_frame([i, "get_xattr", [1, b"user.hostile"], {}, None])
            for i in range(1, self.a.requests + 1)
        )
        for _ in range(self.a.nonreaders):
            s = _authed(self.port, self.tokens["admin"], rcvbuf=4096)
            s.sendall(burst)
            self.socks.append(s)

    def stalled_frames(self) -> None:
        body = memoryview(bytes(self.a.frame - 16))
        for _ in range(self.a.stalled):
            s = _authed(self.port, self.tokens["admin"])
            s.sendall(HEADER.pack(self.a.frame))
            try:
                s.sendall(body)
            except OSError:  # dropped for the budget before it was all sent
                pass
            self.stalled.append(s)
            self.socks.append(s)

    def waiters(self) -> None:
        per = 2000
        readers = [v for k, v in self.tokens.items() if k.startswith("reader")]
        left = self.a.waiters
        k = 0
        while left > 0:
            n = min(per, left)
            s = _authed(self.port, readers[k % len(readers)])
            s.sendall(b"".join(
                encode_frame([i + 1, "wait_published", [JOB, 1], {"timeout": 600}, None])
                for i in range(n)
            ))  # fmt: skip
            self.socks.append(s)
            left -= n
            k += 1
        self.held_waits += self.a.waiters

    def long_waits(self) -> None:
        frame = encode_frame([1, "wait_published", [JOB, 1], {"timeout": 3600}, None])
        for _ in range(self.a.long_waits):
            s = _authed(self.port, self.tokens["admin"])
            s.sendall(frame)
            self.socks.append(s)
        self.held_waits += self.a.long_waits

    def scrapers(self) -> None:
        for _ in range(self.a.scrapers):
            s = socket.create_connection(("127.0.0.1", self.metrics_port), timeout=10)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line
            self.socks.append(s)

    def stalled_dropped_s(self, t0: float) -> float | None:
        """Seconds from t0 until the service dropped every stalled frame (None: not in
        STALL_WAIT_S)."""
        end = t0 + STALL_WAIT_S
        while time.monotonic() < end:
            if all(_closed(s) for s in self.stalled):
                return round(time.monotonic() - t0, 1)
            time.sleep(0.2)
        return None

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks, self.stalled, self.held_waits = [], [], 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _volume(root: str) -> tuple[str, dict]:
    """A SQLite volume, and tokens: four readers of JOB for the waiters."""
    from fusefs.cli.service import open_meta
    from fusefs.client.volume import Volume

    vol = os.path.join(root, "vol")
    Volume.create(vol, nodes=2).close()
    tokens = {}
    with open_meta(vol) as meta:
        for i in range(4):
            tokens[f"reader{i}"] = meta.create_token(f"hostile-{i}", "reader", [JOB])
    return vol, tokens


def attack_phases(args: argparse.Namespace, root: str) -> dict[str, Any]:
    vol, tokens = _volume(root)
    metrics_port = _free_port()
    server = MetaServer(vol, args=["--metrics", f"127.0.0.1:{metrics_port}"])
    out: dict[str, Any] = {"memory_budget_mib": MEMORY_BUDGET >> 20}
    try:
        assert server.pid is not None
        pid = server.pid
        with open(server.token_file) as f:
            tokens["admin"] = f.read().strip()
        legit = Legit(server.url)
        legit.client.set_xattr(1, b"user.hostile", b"x" * args.answer_size)
        legit.client.begin(JOB, 1, 2)  # the waiters' step: open for the whole run
        legit.run(0.5, 100)  # warm
        sampler = Sampler(pid)
        quiet = legit.run(args.phase_s, args.max_ops)
        out["rss_before_mib"] = before = round(rss_mib(pid), 1)
        out["legit_quiet_p99_ms"] = {m: round(p99(v) * 1e3, 3) for m, v in quiet.items()}
        att = Attacks(args, server.port, metrics_port, tokens)
        kinds: dict[str, list[Callable[[], None]]] = {
            "nonreaders": [att.nonreaders],
            "stalled": [att.stalled_frames],
            "waiters": [att.waiters],
            "long_waits": [att.long_waits],
            "scrapers": [att.scrapers],
        }
        kinds["all"] = [fn for fns in list(kinds.values()) for fn in fns]
        phases: dict[str, dict] = {}
        under: dict[str, list[float]] = {"getattr": [], "create": []}
        peak = before
        for name, fns in kinds.items():
            sampler.reset()
            errors0 = len(legit.errors)
            t0 = time.monotonic()
            for fn in fns:
                fn()
            rec: dict[str, Any] = {"setup_s": round(time.monotonic() - t0, 2)}
            if att.held_waits >= args.waiters and name == "waiters":
                time.sleep(1.0)  # every wait read and registered
                c0, w0 = cpu_s(pid), time.monotonic()
                time.sleep(args.cpu_s)
                out["service_cpu_waiters"] = round((cpu_s(pid) - c0) / (time.monotonic() - w0), 4)
            lat = legit.run(args.phase_s, args.max_ops)
            for m, v in lat.items():
                under[m] += v
            if att.stalled:
                rec["stalled_dropped_s"] = att.stalled_dropped_s(t0)
            rec.update(
                ops=sum(len(v) for v in lat.values()),
                p99_ms={m: round(p99(v) * 1e3, 3) for m, v in lat.items()},
                errors=len(legit.errors) - errors0,
                rss_peak_mib=round(sampler.peak, 1),
            )
            peak = max(peak, sampler.peak)
            att.close()
            phases[name] = rec
            time.sleep(1.0)  # closed connections leave before the next kind
        sampler.stop()
        out["phases"] = phases
        out["rss_growth_mib"] = round(peak - before, 1)
        # by method (a create waits for its commit, a getattr for nothing): the worse ratio
        out["legit_p99_ms"] = {m: round(p99(v) * 1e3, 3) for m, v in under.items()}
        ratios = {m: round(p99(under[m]) / p99(quiet[m]), 2) for m in under}
        out["legit_p99_vs_quiet_by_method"] = ratios
        out["legit_p99_vs_quiet"] = max(ratios.values())
        out["legit_refused"] = len(legit.errors)
        out["legit_errors"] = legit.errors[:5]
        legit.client.close()
    finally:
        server.stop()
    return out


def soak(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Harness runs one after another (a new job each) against a service with its caches
    sized down: RSS after the last minus after the middle one (the first fills every
    bounded cache)."""
    from fusefs.client.volume import Volume

    vol = os.path.join(root, "soakvol")
    Volume.create(vol, nodes=2).close()
    prefix = [sys.executable, "-m", "bench.hostile", "--serve-small-caches", "--"]
    server = MetaServer(vol, prefix=prefix)
    out: dict[str, Any] = {}
    try:
        assert server.pid is not None
        cmd = [sys.executable, "-m", "fusefs.cli", "bench", server.url,
               "--ranks", str(args.soak_ranks), "--hosts", str(args.soak_hosts),
               "--shard-size", "64KiB", "--change-rate", "0.1",
               "--steps", str(args.soak_steps)]  # fmt: skip
        rss = []
        for _ in range(args.soak_runs):
            t0 = time.monotonic()
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.soak_timeout)
            if p.returncode != 0:
                raise RuntimeError(f"the harness failed: {(p.stdout + p.stderr)[-600:]}")
            rss.append(rss_mib(server.pid))
            out.setdefault("soak_run_s", []).append(round(time.monotonic() - t0, 1))
        mid = rss[(len(rss) - 1) // 2]
        out["soak_rss_after_each_run_mib"] = [round(r, 1) for r in rss]
        out["soak_rss_mid_mib"], out["soak_rss_end_mib"] = round(mid, 1), round(rss[-1], 1)
        out["soak_rss_growth_mib"] = round(rss[-1] - mid, 1)
        out["soak_steps"] = args.soak_runs * args.soak_steps
        out["soak_ranks"] = args.soak_ranks
        out["soak_caches"] = SOAK_CACHES
    finally:
        server.stop()
    return out


def judge(rep: dict[str, Any]) -> None:
    budget = rep.setdefault("memory_budget_mib", MEMORY_BUDGET >> 20)
    targets = {
        "rss_growth_mib": (f"<= {budget + 64}", rep.get("rss_growth_mib", 1e9) <= budget + 64),
        "legit_p99_vs_quiet": ("<= 5", rep.get("legit_p99_vs_quiet", 1e9) <= 5),
        "legit_refused": ("= 0", rep.get("legit_refused") == 0),
        "service_cpu_waiters": ("<= 0.10", rep.get("service_cpu_waiters", 1e9) <= 0.10),
        "soak_rss_growth_mib": ("<= 10", rep.get("soak_rss_growth_mib", 1e9) <= 10),
        "stalled_dropped_s": (
            "not None",
            all(p.get("stalled_dropped_s", 0) is not None for p in rep.get("phases", {}).values()),
        ),
    }
    rep["targets"] = {k: {"target": t, "ok": ok} for k, (t, ok) in targets.items()}
    rep["pass"] = all(ok for _t, ok in targets.values())


def serve_small_caches(argv: list[str]) -> int:
    """`meta serve` (argv: `python -m fusefs.cli meta serve ...`) with the soak's caches
    sized down (SOAK_CACHES), so that a short run fills them."""
    from fusefs.cli.main import main
    from metadata.server import service, waiters

    service.IDEM_KEEP = SOAK_CACHES["IDEM_KEEP"]
    waiters.TERMINAL_KEEP = SOAK_CACHES["TERMINAL_KEEP"]
    return main(argv[argv.index("fusefs.cli") + 1 :])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-small-caches"]:
        return serve_small_caches(argv)
    ap = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes, for the tests")
    ap.add_argument("--nonreaders", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1000, help="get_xattr per non-reader")
    ap.add_argument("--answer-size", type=parse_size, default=64 << 10)
    ap.add_argument("--stalled", type=int, default=3)
    ap.add_argument("--frame", type=parse_size, default=64 << 20)
    ap.add_argument("--waiters", type=int, default=20_000)
    ap.add_argument("--long-waits", type=int, default=200)
    ap.add_argument("--scrapers", type=int, default=300)
    ap.add_argument("--phase-s", type=float, default=4.0, help="the legit client's timing")
    ap.add_argument("--max-ops", type=int, default=2000, help="its operations per phase")
    ap.add_argument("--cpu-s", type=float, default=3.0, help="the waiters' CPU window")
    ap.add_argument("--soak-ranks", type=int, default=256)
    ap.add_argument("--soak-hosts", type=int, default=4)
    ap.add_argument("--soak-steps", type=int, default=15, help="steps per harness run")
    ap.add_argument("--soak-runs", type=int, default=3, help="harness runs, one after another")
    ap.add_argument("--soak-timeout", type=float, default=600.0)
    ap.add_argument("--no-soak", action="store_true")
    ap.add_argument("--soak-only", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.nonreaders, args.requests, args.stalled, args.frame = 4, 200, 2, 8 << 20
        args.waiters, args.long_waits, args.scrapers = 4000, 20, 30
        args.phase_s, args.max_ops, args.cpu_s = 1.0, 300, 1.5
        args.soak_ranks, args.soak_hosts, args.soak_steps = 32, 2, 3
    rep: dict[str, Any] = {"quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="ckptfs-hostile-") as root:
        if not args.soak_only:
            rep.update(attack_phases(args, root))
        if not args.no_soak:
            rep.update(soak(args, root))
    judge(rep)
    print(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
