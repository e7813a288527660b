"""What a harness run is asked to do: its options, checked, and the one-line error type.

A module of its own (a leaf: nothing of the harness imported) so the coordinator
(bench.harness) and the environment it runs in (bench.harness_env) both use it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness_data import KINDS
from chunkstore.chunker import MAX_CHUNK, MIN_CHUNK


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
    nodes: str = "dir"
    node_count: int = 4
    replicas: int = 2
    chunk_size: int | None = None
    kill_node: bool = False
    kill_rank: bool = False
    slow_rank: int = 0
    slow_node: bool = False
    slow_delay: float = 2.0
    slow_node_delay: float = 0.02
    fault_step: int = 2
    deadline: float | None = None
    procs: int | None = None
    threads_per_host: int = 4
    phase_timeout: float = 900.0
    seed: int = 1
    corrupt: list[int] | None = None  # [step, rank]: flip a byte before writing (tests)
    progress: bool | None = None
    workdir: str | None = None

    def effective_chunk(self) -> int:
        if self.chunk_size:
            return self.chunk_size
        return max(MIN_CHUNK, min(4 * 2**20, self.shard_size // 4))

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise HarnessError(msg)

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
        faults = self.kill_node or self.kill_rank
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
        if self.kill_node:
            need(self.replicas >= 2, "--kill-node needs --replicas >= 2 to keep the data")
        if self.nodes == "s3":
            from bench.servers.seaweed import weed_path

            need(weed_path() is not None, "--nodes s3 needs SeaweedFS (`weed`) installed")

    def layout(self) -> tuple[list[list[int]], list[list[int]]]:
        """(ranks of each host: contiguous, like GPUs of a machine; hosts of each process)."""
        per = -(-self.ranks // self.hosts)
        hosts = [list(range(h * per, min(self.ranks, (h + 1) * per))) for h in range(self.hosts)]
        hosts = [h for h in hosts if h]
        procs = self.procs or min(len(hosts), 4)
        procs = max(1, min(procs, len(hosts)))
        return hosts, [list(range(p, len(hosts), procs)) for p in range(procs)]

    def slow_ranks(self) -> list[int]:
        if not self.slow_rank:
            return []
        stride = max(1, self.ranks // self.slow_rank)
        return [(1 + i * stride) % self.ranks for i in range(self.slow_rank)]

    def victim(self) -> int:
        return self.ranks // 2
