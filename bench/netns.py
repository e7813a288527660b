"""A fleet on one machine: Linux network namespaces joined by veth links to one bridge.

`ckptfs bench --topology netns` puts every simulated host, service replica, the database
and every S3 node in a network namespace of its own, so each has its own network stack,
its own address and its own link: a link can be shaped (tc tbf, plus netem delay where the
kernel has it) and cut (the link taken down), as a fleet's links are.

Layout of one run (RUN is `ckb<pid>x<random>`, so runs never share a name):

    RUN-br    the bridge `br0`, and the switch side of every link (port `h0`, `m0`, `s0`,
              `db`, `ctl`); it has no address and no route
    RUN-ctl   the coordinator (198.18.0.1): it enters this namespace for the run
    RUN-m<i>  service replica i (198.18.1.<i+1>)     RUN-db   PostgreSQL (198.18.2.1)
    RUN-s<i>  S3 node i (198.18.3.<i+1>)             RUN-h<i> host i (198.18.10+i/250.*)

Every address is in 198.18.0.0/15 (RFC 2544, reserved for network benchmarks) and no
namespace has a route anywhere else: traffic cannot leave the machine. The root namespace
is not touched: no interface, address or route is added there. Deleting the namespaces
deletes every link with them; `Fabric.destroy` first kills whatever still runs inside.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
NAME_PREFIX = "ckb"
NETWORK = ipaddress.ip_network("198.18.0.0/15")
SEGMENT = 16  # every interface of a run: 198.18.0.0/16, one broadcast domain
CTL_ADDR = "198.18.0.1"
MAX_HOSTS = 250 * 20


def host_addr(i: int) -> str:
    return f"198.18.{10 + i // 250}.{i % 250 + 1}"


def replica_addr(i: int) -> str:
    return f"198.18.1.{i + 1}"


def node_addr(i: int) -> str:
    return f"198.18.3.{i + 1}"


DB_ADDR = "198.18.2.1"


class NetnsError(ValueError):
    """The namespaces could not be made or driven: one line for the user."""


def _ip(*args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check, timeout=timeout)


def _run(cmd: list[str], *, check: bool = True, timeout: float = 30.0):
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise NetnsError(f"`{cmd[0]}` not found (iproute2)") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(cmd)}` timed out") from None
    if check and res.returncode != 0:
        why = (res.stderr or res.stdout).strip().splitlines()
        raise NetnsError(f"`{' '.join(cmd)}` failed: {why[-1] if why else res.returncode}")
    return res


def rights() -> str | None:
    """None when this process can make network namespaces, else why not (one line)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"--topology netns needs `{tool}` (iproute2) on PATH"
    if os.geteuid() != 0:
        return "--topology netns needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to make namespaces"
    probe = f"{NAME_PREFIX}{os.getpid()}probe"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        why = res.stderr.strip().splitlines()
        return f"cannot make a network namespace: {why[-1] if why else 'ip netns add failed'}"
    _ip("netns", "del", probe, check=False)
    return None


def list_namespaces() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def ns_pids(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in res.stdout.split() if x.isdigit()]


def _kill_inside(ns: str) -> None:
    """SIGKILL everything in `ns`, until nothing is left (bounded)."""
    for _ in range(50):
        pids = [p for p in ns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _delete(ns: str) -> None:
    _kill_inside(ns)
    for _ in range(20):
        if _ip("netns", "del", ns, check=False).returncode == 0 or ns not in list_namespaces():
            return
        time.sleep(0.1)


def sweep_stale(say=None) -> list[str]:
    """Delete the namespaces of runs whose coordinator is gone (killed with SIGKILL, say,
    which no teardown survives). Returns the names removed."""
    gone = []
    for ns in list_namespaces():
        m = re.match(rf"^{NAME_PREFIX}(\d+)x[0-9a-f]+-", ns)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # its run is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        gone.append(ns)
    # hosts and servers first, the bridge last (deleting it deletes every link)
    for ns in sorted(gone, key=lambda n: n.endswith("-br")):
        _delete(ns)
    if gone and say:
        say(f"removed {len(gone)} namespaces left by a run that did not finish")
    return gone


def enter(path: str) -> int:
    """Move the calling thread into the network namespace at `path` (setns(2)); returns a
    descriptor of the namespace it was in, for `leave`. Threads and processes started
    from this thread afterwards are born in the new namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    old = os.open(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            os.close(old)
            raise NetnsError(f"cannot enter network namespace {path}: {os.strerror(e)}")
    finally:
        os.close(fd)
    return old


def leave(old: int) -> None:
    """Back to the namespace `enter` returned."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if libc.setns(old, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise NetnsError(f"cannot return to the original network namespace: {os.strerror(e)}")
    finally:
        os.close(old)


@dataclass
class Member:
    """One namespace on the bridge: a host, a replica, the database, a node or the
    coordinator."""

    name: str  # short: h0, m1, s2, db, ctl (also its switch port's name)
    ns: str
    addr: str

    @property
    def path(self) -> str:
        return os.path.join(NETNS_DIR, self.ns)

    @property
    def prefix(self) -> list[str]:
        """Command words that run a program inside this namespace."""
        return ["ip", "netns", "exec", self.ns]


def parse_link(text: str) -> tuple[int, float | None]:
    """`RATE[/DELAY]` -> (bits per second, delay in ms or None). RATE in tc's units
    (`1gbit`, `200mbit`, `500kbit`, `100mbps` = bytes), DELAY like `2ms` or `500us`."""
    rate_s, _, delay_s = text.partition("/")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?", rate_s.strip().lower())
    if not m:
        raise NetnsError(f"bad --link rate {rate_s!r}: expected e.g. 1gbit, 200mbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    bits = float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)
    if not 8e3 <= bits <= 1e12:
        raise NetnsError(f"--link rate {rate_s!r} is out of range (8kbit..1tbit)")
    delay = None
    if delay_s:
        d = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|us|s)?", delay_s.strip().lower())
        if not d:
            raise NetnsError(f"bad --link delay {delay_s!r}: expected e.g. 2ms")
        delay = float(d.group(1)) * {"ms": 1.0, "us": 1e-3, "s": 1e3, None: 1.0}[d.group(2)]
    return int(bits), delay


class Fabric:
    """The namespaces and links of one run. Every method is bounded in time; `destroy` is
    safe to call at any point, more than once, and from a signal-interrupted teardown."""

    def __init__(self) -> None:
        self.run = f"{NAME_PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.bridge_ns = f"{self.run}-br"
        self.members: dict[str, Member] = {}
        self.created: list[str] = []
        self._lock = threading.Lock()
        self.delay_applied: bool | None = None

    def create(self) -> None:
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")

    def _add_ns(self, ns: str) -> None:
        with self._lock:
            self.created.append(ns)
        _ip("netns", "add", ns)

    def add(self, name: str, addr: str) -> Member:
        """A namespace `RUN-name` with `eth0` at `addr`, linked to the bridge by port `name`."""
        ip = ipaddress.ip_address(addr)
        if ip not in NETWORK:
            raise NetnsError(f"{addr} is outside {NETWORK}")
        m = Member(name, f"{self.run}-{name}", addr)
        self._add_ns(m.ns)
        # IPv4 only: no IPv6 link-local addresses, router solicitations or DAD on the bridge
        _run(["ip", "netns", "exec", m.ns, "sysctl", "-q", "-w",
              "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
             check=False)  # fmt: skip
        _ip("-n", self.bridge_ns, "link", "add", name, "type", "veth", "peer", "name", "eth0",
            "netns", m.ns)  # fmt: skip
        _ip("-n", self.bridge_ns, "link", "set", name, "master", "br0")
        _ip("-n", self.bridge_ns, "link", "set", name, "up")
        _ip("-n", m.ns, "link", "set", "lo", "up")
        _ip("-n", m.ns, "addr", "add", f"{addr}/{SEGMENT}", "dev", "eth0")
        _ip("-n", m.ns, "link", "set", "eth0", "up")
        self.members[name] = m
        return m

    def shape(self, m: Member, rate_bits: int, delay_ms: float | None) -> str | None:
        """Cap the member's link at `rate_bits` each way (tbf on both ends of the veth);
        add `delay_ms` with netem where the kernel has it. Returns a one-line note when the
        delay could not be applied (no netem), else None."""
        burst = max(64 * 1024, rate_bits // 8 // 100)  # 10 ms at the rate, >= one GSO segment
        note = None
        for ns, dev in ((m.ns, "eth0"), (self.bridge_ns, m.name)):
            parent = ["root"]
            if delay_ms and self.delay_applied is not False:
                res = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                            "netem", "delay", f"{delay_ms}ms"], check=False)  # fmt: skip
                if res.returncode == 0:
                    self.delay_applied = True
                    parent = ["parent", "1:"]
                else:
                    self.delay_applied = False
                    note = (
                        f"--link delay {delay_ms:g}ms not applied: this kernel has no netem "
                        f"({res.stderr.strip() or 'tc failed'}); links are rate-limited only"
                    )
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate",
                  str(rate_bits), "burst", str(burst), "latency", "100ms"])  # fmt: skip
        return note

    def cut(self, m: Member) -> None:
        """Partition: the member's link goes down at the switch (the cable pulled)."""
        _ip("-n", self.bridge_ns, "link", "set", m.name, "down")

    def heal(self, m: Member) -> None:
        _ip("-n", self.bridge_ns, "link", "set", m.name, "up")

    def destroy(self) -> list[str]:
        """Kill what runs inside, delete every namespace (the bridge last: its deletion
        takes every link). Returns the names that could not be deleted."""
        with self._lock:
            names = list(self.created)
        for ns in names:
            if ns != self.bridge_ns:
                _kill_inside(ns)
        for ns in sorted(names, key=lambda n: n == self.bridge_ns):
            _delete(ns)
        left = [ns for ns in names if ns in list_namespaces()]
        with self._lock:
            self.created = left
        return left


def check_isolated(m: Member) -> None:
    """Refuse to go on if a member could route outside the run's segment."""
    res = _ip("-n", m.ns, "-4", "route", "show", check=False)
    for line in res.stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest == "default":
            raise NetnsError(f"namespace {m.ns} has a default route: refusing to run")
        try:
            net = ipaddress.ip_network(dest, strict=False)
        except ValueError:
            continue
        if not net.subnet_of(NETWORK):
            raise NetnsError(f"namespace {m.ns} routes {dest}, outside {NETWORK}: refusing")
