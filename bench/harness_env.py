"""Where the harness runs, and the switches its faults pull.

--embedded: a temporary directory with a volume (local directory nodes, or one SeaweedFS
server per node with --nodes s3; SQLite metadata, or a throwaway PostgreSQL with --db
postgres), `ckptfs meta serve` replicas, per-host staging directories. Attaching: VOLUME is
a volume directory (a `meta serve` is started on it, so the group commit is what gets
measured) or a running service's ckptfs:// URL; only staging directories are temporary then.

Topologies: `loopback` puts every server on 127.0.0.1; `netns` gives every host, replica,
the database and every S3 node a network namespace of its own on one bridge (bench.netns),
the coordinator included, so links can be shaped and cut. Either way everything started
here is stopped and removed by stop(), which is safe after any failure and runs with the
interrupt signals held off.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bench import netns
from bench.common import cpu_s
from bench.harness_config import HarnessConfig, HarnessError
from bench.servers import ServerError
from bench.servers.metaserve import MetaServer
from bench.servers.postgres import PgCluster
from bench.servers.seaweed import WeedServer

META_PORT = 7410  # a replica alone in its namespace
PG_PORT = 5432
NODE_STOP_GRACE = 2.0  # a rolling restart's SIGTERM grace before SIGKILL (weed's own is 15 s)
TEARDOWN_WAIT = 30.0  # how long teardown waits for a running fault action (a restart)
QUICK_WAIT = 1.0  # ... and an interrupted or failed run's (its servers are closed anyway)
QUICK_GRACE = 3.0  # an interrupted run's SIGTERM grace for a server before SIGKILL


class Closing(HarnessError):
    """The environment is being torn down: a fault must not start anything again."""


def client_takes_replica_list() -> bool:
    """Does metadata.client accept `ckptfs://HOST1:PORT,HOST2:PORT?...`? (The failover
    client adds it; until then each host is given one replica's address.)"""
    from metadata.client import parse_url

    try:
        parse_url("ckptfs://198.18.1.1:7410,198.18.1.2:7410?token_file=/nonexistent")
    except Exception:
        return False
    return True


def service_url(addresses: list[str], token_file: str) -> str:
    """The one place a service URL is made: several replicas are one comma-separated list."""
    return f"ckptfs://{','.join(addresses)}?token_file={token_file}"


class Env:
    def __init__(self, cfg: HarnessConfig, chunk: int) -> None:
        cfg.resolve()
        self.cfg = cfg
        self.chunk = chunk
        self.root = tempfile.mkdtemp(prefix="ckptfs-bench-", dir=cfg.workdir)
        self.staging_root = os.path.join(self.root, "staging")
        self.fault_dir = os.path.join(self.root, "faults")
        self.log_dir = os.path.join(self.root, "logs")
        self.url = ""  # the coordinator's
        self.host_urls: dict[int, str] = {}
        self.servers: list[MetaServer] = []
        self.pg: PgCluster | None = None
        self.db_url: str | None = None
        self.weeds: list[WeedServer] = []
        self.node_dirs: list[str] = []
        self.killed: str | None = None
        self.fabric: netns.Fabric | None = None
        self._ctl_old: int | None = None
        self.host_ns: dict[int, str] = {}  # host index -> its namespace's path (netns)
        self.agents: list = []  # one `ckptfs agent` per host (bench.harness_agents)
        self.agents_before_restart: dict = {}  # their counters when a resume restarted them
        self.worker_pids: dict[int, int] = {}  # host index -> worker pid (loopback partition)
        self.stopped_pids: set[int] = set()
        self.stopped_meta: set[int] = set()  # replicas --hang-meta has stopped (SIGSTOP)
        # server processes down on purpose (a fault killed, stopped or is restarting them):
        # the fleet watcher (bench.harness_watch) flags any other exit
        self.on_purpose: set[str] = set()
        self._reported: set[tuple[str, int]] = set()
        self.notes: list[str] = []
        self.problems: list[str] = []  # teardown trouble, reported by the caller
        self.replica_lists = False
        self.closing = False
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # notified when a fault action ends
        self._busy = 0  # fault actions running (teardown waits for them)
        os.makedirs(self.staging_root)
        os.makedirs(self.fault_dir)
        os.makedirs(self.log_dir)

    # -- start ---------------------------------------------------------------------------
    def _check_space(self, path: str) -> None:
        c = self.cfg
        need = c.steps * c.ranks * c.shard_size * (2 + c.replicas)
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
        if need > 0.9 * free:
            raise HarnessError(
                f"this run may need {need / 2**30:.1f} GiB of disk under {path}, "
                f"{free / 2**30:.1f} GiB free: fewer ranks, steps or a smaller --shard-size"
            )

    def member(self, name: str) -> netns.Member | None:
        return self.fabric.members.get(name) if self.fabric else None

    def start(self, say: Callable[[str], None], n_hosts: int) -> None:
        c = self.cfg
        self._check_space(self.root)
        if c.topology == "netns":
            self._start_fabric(say, n_hosts)
        if c.volume is not None and c.volume.startswith("ckptfs://"):
            self.url = c.volume
            return
        if c.volume is not None:
            from fusefs.client.volume import VOLUME_FILE

            vol_dir = os.path.abspath(c.volume)
            if not os.path.exists(os.path.join(vol_dir, VOLUME_FILE)):
                raise HarnessError(
                    f"no volume at {c.volume} (run `ckptfs format {c.volume}` first)"
                )
        else:
            from fusefs.client.volume import Volume, VolumeSettings

            vol_dir = os.path.join(self.root, "vol")
            if c.db == "postgres":
                self._start_pg(say)
            if c.nodes == "s3":
                urls = self._start_weeds(say)
            else:
                urls = [f"dir:nodes/n{i}" for i in range(c.node_count or 4)]
            # backup_interval 0: the service's first automatic backup (60 s after it starts)
            # lists every object of every node and dumps the database, seconds of service
            # CPU that landed in whichever phase ran then (77% of its samples in a resume)
            settings = VolumeSettings(chunk_size=self.chunk, replicas=c.replicas, backup_interval=0)
            try:
                Volume.create(vol_dir, nodes=urls, settings=settings, db=self.db_url).close()
            except Exception as e:
                raise HarnessError(f"cannot create the benchmark volume: {e}") from e
            if c.nodes == "dir":
                self.node_dirs = [
                    os.path.join(vol_dir, "nodes", f"n{i}") for i in range(c.node_count or 4)
                ]
        self._start_meta(vol_dir, say, n_hosts)

    def _start_fabric(self, say: Callable[[str], None], n_hosts: int) -> None:
        c = self.cfg
        netns.sweep_stale(say)
        f = self.fabric = netns.Fabric()
        say(f"building the fleet: network namespaces {f.run}-* on 198.18.0.0/16 ...")
        try:
            f.create()
            ctl = f.add("ctl", netns.CTL_ADDR)
            for i in range(c.meta_replicas):
                f.add(f"m{i}", netns.replica_addr(i))
            if c.db == "postgres":
                f.add("db", netns.DB_ADDR)
            for i in range(c.node_count or 0):
                f.add(f"s{i}", netns.node_addr(i))
            for h in range(n_hosts):
                self.host_ns[h] = f.add(f"h{h}", netns.host_addr(h)).path
            for m in f.members.values():
                netns.check_isolated(m)
            if c.link:
                rate, delay = netns.parse_link(c.link)
                for h in range(n_hosts):
                    note = f.shape(f.members[f"h{h}"], rate, delay)
                    if note and note not in self.notes:
                        self.notes.append(note)
                        say(note)
            # multiprocessing's resource tracker is a process of this one, started on first
            # use: start it here, or it would be born in the coordinator's namespace and
            # killed with it at teardown (a tracker that later processes of this one need)
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
            self._ctl_old = netns.enter(ctl.path)
        except netns.NetnsError as e:
            raise HarnessError(str(e)) from None

    def _start_pg(self, say: Callable[[str], None]) -> None:
        m = self.member("db")
        where = m.addr if m else "127.0.0.1"
        say(f"starting PostgreSQL on {where} ...")
        try:
            self.pg = PgCluster(
                fsync=True,
                host=where,
                port=PG_PORT if m else None,
                prefix=m.prefix if m else (),
                tag=self.fabric.run if self.fabric else f"bench{os.getpid()}",
            )
            self.db_url = self.pg.create_db()
        except Exception as e:
            raise HarnessError(f"PostgreSQL did not start: {e}") from None

    def _start_weeds(self, say: Callable[[str], None]) -> list[str]:
        n = self.cfg.node_count or 0
        where = "their namespaces" if self.fabric else "127.0.0.1"
        say(f"starting {n} SeaweedFS servers on {where} ...")
        for i in range(n):
            d = os.path.join(self.root, f"weed{i}")
            os.makedirs(d)
            log = os.path.join(self.root, f"weed{i}.log")
            m = self.member(f"s{i}")
            if m is None:
                self.weeds.append(WeedServer(d, log))
            else:
                # ports of their own even in a namespace of its own: the filer's gRPC also
                # listens on /tmp/seaweedfs-filer-grpc-PORT.sock, which namespaces share
                self.weeds.append(WeedServer(d, log, ip=m.addr, prefix=m.prefix))
        try:
            for w in self.weeds:
                w.start()
            for w in self.weeds:
                w.wait_ready()
        except RuntimeError as e:
            raise HarnessError(f"SeaweedFS did not start: {e}") from e
        return [f"s3://bench-n{i}/ck?endpoint={w.endpoint}" for i, w in enumerate(self.weeds)]

    def _start_meta(self, vol_dir: str, say: Callable[[str], None], n_hosts: int) -> None:
        c = self.cfg
        n = c.meta_replicas
        for i in range(n):  # one at a time: the first creates the token file
            m = self.member(f"m{i}")
            log = os.path.join(self.root, f"meta{i}.log")
            try:
                s = MetaServer(
                    vol_dir,
                    db=self.db_url,
                    host=m.addr if m else "127.0.0.1",
                    port=META_PORT if m else 0,
                    prefix=m.prefix if m else (),
                    log_path=log,
                    start=False,
                )
                self.servers.append(s)
                s.start()
            except ServerError as e:
                raise HarnessError(f"ckptfs meta serve did not start: {e} (log {log})") from None
        addrs = [s.address for s in self.servers]
        token = self.servers[0].token_file
        self.replica_lists = n > 1 and client_takes_replica_list()
        if n > 1:
            how = (
                "each host lists every replica"
                if self.replica_lists
                else ("this client takes one address: host i uses replica i mod N")
            )
            say(f"{n} service replicas ({how})")
        self.url = service_url(addrs if self.replica_lists else addrs[:1], token)
        for h in range(n_hosts):
            k = h % n
            mine = addrs[k:] + addrs[:k]  # a host starts at its own replica
            self.host_urls[h] = service_url(mine if self.replica_lists else mine[:1], token)

    # -- the hosts' agents (bench.harness_agents) ----------------------------------------------
    def start_agents(self, n_hosts: int, staging_size: int) -> dict[int, str]:
        """One `ckptfs agent` per host, each on a socket of its own; host -> socket."""
        from bench import harness_agents as ha

        d = os.path.join(self.root, "a")  # short: a Unix socket path has 108 bytes
        os.makedirs(d, mode=0o700)
        self.agents = [
            ha.AgentProc(
                h,
                self.host_urls.get(h) or self.url,
                os.path.join(d, f"h{h:03d}.sock"),
                os.path.join(self.staging_root, f"host-{h:03d}"),
                staging_size,
                self.cfg.durability,
                os.path.join(self.root, f"agent{h}.log"),
                self._host_prefix(h),
            )
            for h in range(n_hosts)
        ]
        try:
            ha.start_all(self.agents, self._token())
        except ServerError as e:
            raise HarnessError(str(e)) from None
        return {a.index: a.socket for a in self.agents}

    def _host_prefix(self, h: int) -> list[str]:
        """Command words that run a program in host h's network namespace (netns), else
        none."""
        m = self.member(f"h{h}")
        return m.prefix if m is not None else []

    def restart_agents(self) -> None:
        """Every agent stopped (SIGTERM) and started again on its socket and staging."""
        from bench import harness_agents as ha

        with self._action():
            for a in self.agents:
                self._expect_down(a.name)
            ha.stop_all(self.agents)
            try:
                ha.start_all(self.agents, self._token())
            except ServerError as e:
                raise HarnessError(str(e)) from None
            for a in self.agents:
                self._expect_up(a.name)

    def _token(self) -> str:
        """The token the hosts' ranks present (their service URL's)."""
        from metadata.wire.url import parse_url, resolve_token

        return resolve_token(parse_url(self.url)[1])

    def agent_cpu(self) -> float:
        """CPU seconds used so far by the agent processes now running (client side)."""
        total = 0.0
        for a in self.agents:
            if a.pid is not None and a.exit_status() is None:
                try:
                    total += cpu_s(a.pid)
                except OSError:
                    continue
        return total

    def agent_namespaces(self) -> dict[str, str | None]:
        """Each running agent's network namespace, by host name (None: none of the
        fleet's): read from /proc, so the report says where they really run."""
        by_inode = {}
        for h, path in self.host_ns.items():
            try:
                by_inode[os.stat(path).st_ino] = f"host-{h:03d}"
            except OSError:
                continue
        out: dict[str, str | None] = {}
        for a in self.agents:
            if a.pid is None or a.exit_status() is not None:
                continue
            try:
                ino = os.stat(f"/proc/{a.pid}/ns/net").st_ino
            except OSError:
                continue
            out[f"host-{a.index:03d}"] = by_inode.get(ino)
        return out

    # -- what the report says about it ------------------------------------------------------
    def topology(self) -> dict:
        c = self.cfg
        out: dict = {
            "kind": c.topology,
            "meta_replicas": [s.address for s in self.servers],
            "replica_lists": self.replica_lists,
            "db": c.db if c.volume is None else None,
            "db_address": f"{self.pg.host}:{self.pg.port}" if self.pg else None,
            "nodes": [w.endpoint for w in self.weeds]
            or [f"dir:n{i}" for i in range(len(self.node_dirs))],
        }
        if self.fabric:
            f = self.fabric
            out["namespaces"] = f"{f.run}-*"
            out["segment"] = f"198.18.0.0/{netns.SEGMENT}"
            out["coordinator"] = netns.CTL_ADDR
            out["hosts"] = {f"host-{h:03d}": netns.host_addr(h) for h in self.host_ns}
            if c.link:
                rate, delay = netns.parse_link(c.link)
                out["link"] = {
                    "rate_bits": rate,
                    "delay_ms": delay,
                    "delay_applied": bool(delay) and f.delay_applied is True,
                }
        out["notes"] = list(self.notes)
        return out

    def log_summary(self) -> dict:
        """What the hosts logged (warnings and errors): per log, the count and the last line,
        kept for the report because the logs go with the run's directory."""
        out = {}
        try:
            names = sorted(os.listdir(self.log_dir))
        except OSError:
            return out
        for name in names:
            try:
                with open(os.path.join(self.log_dir, name), errors="replace") as f:
                    lines = [ln.rstrip() for ln in f if ln[:1].isdigit()]
            except OSError:
                continue
            if lines:
                out[name] = {"entries": len(lines), "last": lines[-1][:300]}
        return out

    def service_cpu(self) -> float:
        """CPU seconds used so far by the metadata service processes now running (a
        replica restarted by a fault starts again from 0: its old CPU is lost to the sum).
        The database server's own processes (PostgreSQL) are not counted."""
        total = 0.0
        for s in self.servers:
            proc = s.proc
            if proc is None or proc.poll() is not None:
                continue
            try:
                total += cpu_s(proc.pid)
            except OSError:
                continue
        return total

    # -- the fleet's processes, for the watcher ------------------------------------------------
    def _fleet(self) -> list[tuple[str, str, int | None, object, str]]:
        """Every server process started here: (name, what it is, pid, a function
        returning its exit status or None while it runs, its log). Called with the lock."""
        out: list[tuple[str, str, int | None, object, str]] = []
        for i, s in enumerate(self.servers):
            out.append((f"m{i}", "service replica (ckptfs meta serve)", s.pid, s.exit_status,
                        s.log_path))  # fmt: skip
        for i, w in enumerate(self.weeds):
            out.append((f"n{i}", "S3 node (SeaweedFS weed server)", w.pid, w.exit_status,
                        w.log_path))  # fmt: skip
        for a in self.agents:
            out.append((a.name, "host agent (ckptfs agent)", a.pid, a.exit_status, a.log_path))
        pg = self.pg
        if pg is not None:

            def pg_status() -> int | None:
                return None if pg.running() else -1

            out.append(("db", "database (PostgreSQL)", pg.server_pid, pg_status, pg.log))
        return out

    def fleet_pids(self) -> dict[str, int]:
        """name -> pid of every server process now started here (m0, n1, db)."""
        with self._lock:
            return {name: pid for name, _, pid, _, _ in self._fleet() if pid is not None}

    def check_fleet(self) -> list[dict]:
        """The server processes that exited when no fault asked for it (each reported
        once): name, what, pid, exit status (None: not a child, status unknown), log."""
        out = []
        with self._lock:
            if self.closing:
                return out
            for name, what, pid, status, log in self._fleet():
                if pid is None or name in self.on_purpose or (name, pid) in self._reported:
                    continue
                code = status()  # type: ignore[operator]
                if code is None:
                    continue
                self._reported.add((name, pid))
                out.append({"name": name, "what": what, "pid": pid, "status": code, "log": log})
        return out

    def _expect_down(self, name: str) -> None:
        with self._lock:
            self.on_purpose.add(name)

    def _expect_up(self, name: str) -> None:
        with self._lock:
            self.on_purpose.discard(name)

    # -- faults ---------------------------------------------------------------------------
    def _guard(self) -> None:
        if self.closing:
            raise Closing("the run is being torn down")

    @contextmanager
    def _action(self) -> Iterator[None]:
        """One fault action on one component. Actions on different components run at
        the same time: a replica restarting waits for the database, which another fault
        is restarting, so no action may hold the lock while it waits. Teardown refuses new
        actions and waits (bounded) for the running ones before it stops what they touch."""
        with self._lock:
            self._guard()
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()

    def kill_node(self) -> None:
        """Node n0 dies: its SeaweedFS server is SIGKILLed, or its directory becomes a file."""
        with self._lock:
            self.on_purpose.add("n0")  # for good
            if self.weeds:
                self.weeds[0].kill()
            elif self.node_dirs:
                d = self.node_dirs[0]
                os.rename(d, d + ".dead")
                with open(d, "w") as f:  # every path under the node now fails with ENOTDIR
                    f.write("this node was killed by ckptfs bench --kill-node\n")
            self.killed = "n0"

    def slow_node(self) -> None:
        with open(os.path.join(self.fault_dir, "slow-n0"), "w") as f:
            f.write(f"{self.cfg.slow_node_delay}\n")

    def kill_meta(self, i: int) -> None:
        """SIGKILL service replica i: no cleanup, the crash a service must survive."""
        with self._action():
            self._expect_down(f"m{i}")
            self.servers[i].kill()

    def start_meta(self, i: int) -> None:
        """Replica i serves again, on the same address (waiting for its database if that
        is restarting too)."""
        with self._action():
            try:
                self.servers[i].restart()
            except ServerError as e:  # stays "on purpose": the fault reports it
                raise HarnessError(f"replica {i} did not come back: {e}") from None
            self._expect_up(f"m{i}")

    def hang_meta(self, i: int) -> None:
        """SIGSTOP service replica i: it hangs with its connections open (its kernel still
        ACKs, so nothing breaks and keepalive sees nothing), which only the clients'
        silence probes and deadlines detect. Marked down on purpose until resume_meta."""
        with self._action():
            s = self.servers[i]
            if not s.alive():
                raise HarnessError(f"replica {i} is not running: nothing to stop")
            self._expect_down(f"m{i}")
            assert s.pid is not None
            os.kill(s.pid, signal.SIGSTOP)
            self.stopped_meta.add(i)

    def resume_meta(self, i: int) -> None:
        """SIGCONT replica i (always allowed, like healing: teardown relies on it too)."""
        with self._lock:
            if i not in self.stopped_meta:
                return
            self.stopped_meta.discard(i)
            pid = self.servers[i].pid if i < len(self.servers) else None
            if pid is not None:
                _signal_if_alive(pid, signal.SIGCONT)
            self._expect_up(f"m{i}")

    def replica_first_url(self, i: int) -> str:
        """A service URL listing replica i first, then the others: a client of it talks
        to replica i while it answers (the hang probe's)."""
        addrs = [s.address for s in self.servers]
        return service_url(addrs[i:] + addrs[:i], self.servers[0].token_file)

    def cut_host(self, h: int) -> None:
        """Partition host h: its link down (netns); on loopback, where there is no link to
        cut, its worker process is stopped (SIGSTOP), which is what the rest of the fleet
        sees of a partitioned host."""
        with self._action():
            if self.fabric:
                self.fabric.cut(self.fabric.members[f"h{h}"])
            else:
                pid = self.worker_pids[h]
                os.kill(pid, signal.SIGSTOP)
                self.stopped_pids.add(pid)

    def heal_host(self, h: int) -> None:
        with self._lock:  # no _guard: healing is always allowed
            if self.fabric:
                self.fabric.heal(self.fabric.members[f"h{h}"])
            else:
                pid = self.worker_pids[h]
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                self.stopped_pids.discard(pid)

    def restart_node(self, i: int) -> float:
        """Maintenance of S3 node i: a clean stop (SIGKILL after a short grace), start,
        until it takes writes. Returns when it went down (time.time())."""
        w = self.weeds[i]
        with self._action():
            self._expect_down(f"n{i}")
            down = time.time()
            w.stop(timeout=NODE_STOP_GRACE)
            w.start()
            try:
                w.wait_ready()
            except ServerError as e:  # stays "on purpose": the fault reports it
                raise HarnessError(f"node n{i} did not come back: {e}") from None
            self._expect_up(f"n{i}")
        return down

    def stop_db(self) -> None:
        assert self.pg is not None
        with self._action():
            self._expect_down("db")
            self.pg.stop_server("fast")

    def start_db(self) -> None:
        assert self.pg is not None
        with self._action():
            self.pg.start()
            self._expect_up("db")

    # -- stop -----------------------------------------------------------------------------
    def stop(self, quick: bool = False) -> None:
        """Stop and remove everything started; never raises (trouble goes to `problems`).

        `quick` (an interrupted or failed run): running fault actions get a moment, not
        TEARDOWN_WAIT, and servers a short grace before SIGKILL, so the whole fleet is gone
        within seconds whatever it was doing."""
        wait = QUICK_WAIT if quick else TEARDOWN_WAIT
        with self._lock:
            self.closing = True
            end = time.monotonic() + wait
            while self._busy and time.monotonic() < end:
                self._idle.wait(max(0.01, end - time.monotonic()))
            if self._busy and not quick:
                self.problems.append(f"{self._busy} fault action(s) still running at teardown")

        def step(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as e:
                self.problems.append(f"{what}: {e}")

        for i in list(self.stopped_meta):  # (terminate sends SIGCONT too: this says so first)
            step("resume a stopped replica", lambda i=i: self.resume_meta(i))
        for pid in list(self.stopped_pids):
            step("resume a stopped worker", lambda pid=pid: _signal_if_alive(pid, signal.SIGCONT))
        if self.agents:  # before the service they are clients of
            from bench.harness_agents import stop_all

            step("stop the agents", lambda: stop_all(self.agents, QUICK_GRACE if quick else 10.0))
        for s in self.servers:  # all asked at once, then each waited for
            step("stop a service replica", s.terminate)
        grace = QUICK_GRACE if quick else 10.0
        for s in self.servers:
            step("stop a service replica", lambda s=s: s.close(grace))
        self.servers = []
        if self.pg is not None:
            pg = self.pg
            step("stop PostgreSQL", lambda: pg.stop(timeout=QUICK_GRACE if quick else 120.0))
            self.pg = None
        for w in self.weeds:
            step("stop a SeaweedFS server", w.close)
        self.weeds = []
        if self._ctl_old is not None:
            step("leave the coordinator's namespace", lambda: netns.leave(self._ctl_old))
            self._ctl_old = None
        if self.fabric is not None:
            left = self.fabric.destroy()
            if left:
                self.problems.append(f"namespaces not deleted: {', '.join(left)}")
        shutil.rmtree(self.root, ignore_errors=True)


def _signal_if_alive(pid: int, sig: int) -> None:
    """A worker the teardown already ended (SIGKILL) needs no SIGCONT."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
