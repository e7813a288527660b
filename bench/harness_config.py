"""What a harness run is asked to do: its options, checked, and the one-line error type.

A module of its own (a leaf: nothing of the harness imported) so the coordinator
(bench.harness) and the environment it runs in (bench.harness_env) both use it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness_data import KINDS
from chunkstore.chunker import MAX_CHUNK, MIN_CHUNK

TOPOLOGIES = ("loopback", "netns")
MAX_NETNS_HOSTS = 64  # a worker process and an agent per host: memory, not addresses, is the limit
MAX_REPLICAS = 8
# --hang-meta: how long a replica stays stopped (SIGSTOP .. SIGCONT). Longer than what a
# client takes to leave a silent replica (1 s of silence, then a ping unanswered for 3 s:
# ~4 s, metadata/client.py) and than PostgreSQL takes to end the stopped replica's idle
# transaction and release its locks (5 s, IDLE_IN_TX_S), so only failover can publish the
# step in time: a fleet that waited for the resume instead would be >= 10 s late, twice
# the verdict's budget (HANG_BUDGET_S, bench.harness_report).
HANG_S = 10.0


class HarnessError(ValueError):
    """The harness could not run (bad options, environment failure): one line for the user.

    A ValueError, so `ckptfs` prints it as one line however the CLI module was imported."""


@dataclass
class HarnessConfig:
    volume: str | None = None  # None: --embedded
    ranks: int = 64
    hosts: int = 2
    shard_size: int = 2**20
    steps: int = 3
    change_rate: float = 1.0
    data: str = "random"
    durability: str = "local"
    nodes: str | None = None  # None: dir on loopback, s3 on netns
    node_count: int | None = None  # None: 4 dir nodes, 3 s3 nodes
    replicas: int = 2
    chunk_size: int | None = None
    topology: str = "loopback"
    link: str | None = None  # RATE[/DELAY], netns only
    meta_replicas: int = 1
    db: str = "sqlite"
    kill_node: bool = False
    kill_rank: bool = False
    slow_rank: int = 0
    slow_node: bool = False
    slow_delay: float = 2.0
    slow_node_delay: float = 0.02
    kill_meta: bool = False
    hang_meta: bool = False
    hang_s: float = HANG_S  # how long --hang-meta keeps the replica stopped
    partition_host: bool = False
    rolling_restart: bool = False
    restart_db: bool = False
    fault_hold: float = 3.0  # how long a killed replica, cut link or stopped DB stays down
    fault_step: int = 2
    deadline: float | None = None
    procs: int | None = None
    threads_per_host: int = 4
    phase_timeout: float = 900.0
    seed: int = 1
    corrupt: list[int] | None = None  # [step, rank]: flip a byte before writing (tests)
    progress: bool | None = None
    workdir: str | None = None
    fail_after_step: int | None = None  # test hook: raise once this step is saved
    resume: bool = False  # after the drain: every rank reads latest_durable back, fresh
    agent: bool = True  # ranks through a `ckptfs agent` per host (on netns: in the host's)

    def resolve(self) -> None:
        """Fill the defaults that depend on other options (idempotent)."""
        if self.nodes is None:
            self.nodes = "s3" if self.topology == "netns" else "dir"
        if self.node_count is None:
            self.node_count = 3 if self.nodes == "s3" else 4

    def effective_chunk(self) -> int:
        if self.chunk_size:
            return self.chunk_size
        return max(MIN_CHUNK, min(4 * 2**20, self.shard_size // 4))

    def new_faults(self) -> list[str]:
        """The fleet faults asked for, in the order their steps are assigned."""
        names = ("kill_meta", "hang_meta", "partition_host", "restart_db")
        return [n.replace("_", "-") for n in names if getattr(self, n)]

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise HarnessError(msg)

        self.resolve()
        assert self.node_count is not None
        need(self.topology in TOPOLOGIES, f"--topology must be one of {', '.join(TOPOLOGIES)}")
        need(1 <= self.ranks <= 1 << 20, "--ranks must be 1..1048576")
        need(1 <= self.hosts <= self.ranks, "--hosts must be 1..ranks")
        need(4096 <= self.shard_size <= 2**30, "--shard-size must be 4KiB..1GiB")
        need(1 <= self.steps <= 1000, "--steps must be 1..1000")
        need(0.0 <= self.change_rate <= 1.0, "--change-rate must be in [0, 1]")
        need(self.data in KINDS, f"--data must be one of {', '.join(KINDS)}")
        need(self.durability in ("local", "remote"), "--durability must be local or remote")
        need(self.nodes in ("dir", "s3"), "--nodes must be dir or s3")
        need(1 <= self.replicas <= self.node_count <= 64, "need 1 <= replicas <= nodes <= 64")
        need(MIN_CHUNK <= self.effective_chunk() <= MAX_CHUNK, "--chunk-size must be 64KiB..64MiB")
        need(0 <= self.slow_rank <= self.ranks, "--slow-rank must be 0..ranks")
        need(1 <= self.threads_per_host <= 64, "--threads-per-host must be 1..64")
        need(self.phase_timeout > 0, "--phase-timeout must be positive")
        need(0.1 <= self.fault_hold <= 600, "--fault-hold must be 0.1..600 seconds")
        need(0.5 <= self.hang_s <= 600, "--hang-for must be 0.5..600 seconds")
        need(self.db in ("sqlite", "postgres"), "--db must be sqlite or postgres")
        need(1 <= self.meta_replicas <= MAX_REPLICAS, f"--meta-replicas must be 1..{MAX_REPLICAS}")
        if self.meta_replicas > 1:
            need(
                self.db == "postgres",
                "--meta-replicas > 1 needs --db postgres (an SQLite volume has one service)",
            )
        faults = self.kill_node or self.kill_rank or bool(self.new_faults())
        if faults:
            need(1 <= self.fault_step <= self.steps, "--fault-step must be within --steps")
        if self.kill_rank:
            need(
                self.fault_step >= 2,
                "--kill-rank needs --fault-step >= 2 (a previous step to keep)",
            )
        if self.volume is not None:
            need(not self.kill_node, "--kill-node destroys a node: only with --embedded")
            need(self.nodes == "dir", "--nodes applies to --embedded only")
            need(self.topology == "loopback", "--topology netns builds its fleet: --embedded only")
            need(
                self.db == "sqlite" and self.meta_replicas == 1,
                "--db and --meta-replicas apply to --embedded only",
            )
            need(
                not (self.kill_meta or self.hang_meta or self.restart_db or self.rolling_restart),
                "--kill-meta, --hang-meta, --restart-db and --rolling-restart need --embedded "
                "(the harness restarts only what it started)",
            )
        if self.kill_node:
            need(self.replicas >= 2, "--kill-node needs --replicas >= 2 to keep the data")
        if self.hang_meta:
            need(
                self.meta_replicas >= 2,
                "--hang-meta needs --meta-replicas >= 2 (a client leaves the stopped replica "
                "for another)",
            )
            need(
                self.steps >= 2,
                "--hang-meta is judged against a step without faults: needs --steps >= 2",
            )
        if self.restart_db:
            need(self.db == "postgres", "--restart-db needs --db postgres")
        if self.rolling_restart:
            need(self.nodes == "s3", "--rolling-restart restarts S3 nodes: needs --nodes s3")
            need(self.steps >= 2, "--rolling-restart runs during a multi-step run: --steps >= 2")
            need(self.replicas >= 2, "--rolling-restart needs --replicas >= 2 to keep the data")
            if self.kill_node:
                need(
                    self.replicas >= 3,
                    "--kill-node with --rolling-restart has two nodes down at once: "
                    "needs --replicas >= 3",
                )
        if self.topology == "netns":
            need(
                self.nodes == "s3",
                "--topology netns needs --nodes s3 (directory nodes have no network)",
            )
            need(
                self.hosts <= MAX_NETNS_HOSTS,
                f"--topology netns runs a process per host: --hosts must be <= {MAX_NETNS_HOSTS}",
            )
        else:
            need(self.link is None, "--link shapes namespace links: needs --topology netns")
        if self.link is not None:
            from bench.netns import NetnsError, parse_link

            try:
                parse_link(self.link)
            except NetnsError as e:
                raise HarnessError(str(e)) from None
        if self.nodes == "s3":
            from bench.servers.seaweed import weed_path

            need(weed_path() is not None, "--nodes s3 needs SeaweedFS (`weed`) installed")
        if self.db == "postgres":
            from bench.servers.postgres import pg_available

            reason = pg_available()
            need(reason is None, f"--db postgres: {reason}")

    def layout(self) -> tuple[list[list[int]], list[list[int]]]:
        """(ranks of each host: contiguous, like GPUs of a machine; hosts of each process).

        On netns every host is a process of its own (a process lives in one namespace). On
        loopback with --partition-host, the victim host gets a process of its own, since
        its partition there is its process stopped."""
        per = -(-self.ranks // self.hosts)
        hosts = [list(range(h * per, min(self.ranks, (h + 1) * per))) for h in range(self.hosts)]
        hosts = [h for h in hosts if h]
        if self.topology == "netns":
            return hosts, [[h] for h in range(len(hosts))]
        procs = self.procs or min(len(hosts), 4)
        procs = max(1, min(procs, len(hosts)))
        if self.partition_host and len(hosts) > 1:
            victim = len(hosts) - 1
            others = list(range(victim))
            n = max(1, min(procs - 1, len(others)))
            return hosts, [others[p::n] for p in range(n)] + [[victim]]
        return hosts, [list(range(p, len(hosts), procs)) for p in range(procs)]

    def partition_victim(self) -> int:
        """The host whose link is cut: the last one."""
        return len(self.layout()[0]) - 1

    def meta_victim(self) -> int:
        """The replica killed by --kill-meta or stopped by --hang-meta: the last one (the
        coordinator uses the first)."""
        return self.meta_replicas - 1

    def slow_ranks(self) -> list[int]:
        if not self.slow_rank:
            return []
        stride = max(1, self.ranks // self.slow_rank)
        return [(1 + i * stride) % self.ranks for i in range(self.slow_rank)]

    def victim(self) -> int:
        return self.ranks // 2

    def fault_steps(self) -> dict[str, int]:
        """Which step each fleet fault hits: one step each from --fault-step on (after a
        --kill-rank step, whose abort would hide them), the last step when steps run out;
        a rolling restart starts at --fault-step and goes on across steps."""
        out: dict[str, int] = {}
        step = self.fault_step
        for name in self.new_faults():
            if self.kill_rank and step == self.fault_step and step < self.steps:
                step += 1
            out[name] = min(step, self.steps)
            step += 1
        if self.rolling_restart:
            out["rolling-restart"] = max(1, min(self.fault_step, self.steps - 1))
        return out
