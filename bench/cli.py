"""`ckptfs bench`: the load-test harness, registered as a ckptfs command (entry point
`ckptfs.commands`), so the CLI in fusefs never imports bench."""

from __future__ import annotations

import argparse
import sys


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    return v


def cmd_bench(args: argparse.Namespace) -> int:
    from bench.harness import HarnessConfig, HarnessError, run
    from bench.harness_report import format_table, plot, write_json

    if args.volume and args.embedded:
        raise HarnessError(
            "give either VOLUME (a volume directory or ckptfs://HOST:PORT) or --embedded"
        )
    if not args.volume and not args.embedded:
        # a fleet of its own (netns, or a throwaway PostgreSQL) has no volume to be given
        if args.topology != "netns" and args.db != "postgres":
            raise HarnessError(
                "give either VOLUME (a volume directory or ckptfs://HOST:PORT) or --embedded"
            )
        args.embedded = True
    cfg = HarnessConfig(
        volume=None if args.embedded else args.volume,
        ranks=args.ranks,
        hosts=args.hosts,
        shard_size=args.shard_size,
        steps=args.steps,
        change_rate=args.change_rate,
        data=args.data,
        durability=args.durability,
        nodes=args.nodes,
        node_count=args.node_count,
        replicas=args.replicas,
        chunk_size=args.chunk_size,
        topology=args.topology,
        link=args.link,
        meta_replicas=args.meta_replicas,
        db=args.db,
        kill_meta=args.kill_meta,
        hang_meta=args.hang_meta,
        hang_s=args.hang_for,
        partition_host=args.partition_host,
        rolling_restart=args.rolling_restart,
        restart_db=args.restart_db,
        fault_hold=args.fault_hold,
        kill_node=args.kill_node,
        kill_rank=args.kill_rank,
        slow_rank=args.slow_rank,
        slow_node=args.slow_node,
        slow_delay=args.slow_delay,
        slow_node_delay=args.slow_node_delay,
        fault_step=args.fault_step,
        deadline=args.deadline,
        procs=args.procs,
        threads_per_host=args.threads_per_host,
        phase_timeout=args.phase_timeout,
        seed=args.seed,
        workdir=args.workdir,
        resume=args.resume,
        agent=not args.no_agent,
    )
    rep = run(cfg)
    print(format_table(rep))
    if args.json:
        write_json(rep, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        for p in plot(rep, args.plot):
            print(f"wrote {p}", file=sys.stderr)
    return 0 if rep["verdict"]["ok"] else 2


def register(sub: argparse._SubParsersAction) -> None:
    from bench.harness_config import HANG_S
    from fusefs.cli.main import size_arg

    b = sub.add_parser(
        "bench",
        help="load-test harness: N simulated ranks save and load in lockstep",
        description="Simulate RANKS ranks on HOSTS hosts (trio tasks in worker processes, one "
        "write-behind tier per host) saving and loading checkpoints through the metadata "
        "service; every loaded byte is verified. Exit status 2 when the verdict is FAIL.",
    )
    b.add_argument(
        "volume",
        nargs="?",
        metavar="VOLUME",
        help="volume directory or ckptfs://HOST:PORT to attach to",
    )
    b.add_argument(
        "--embedded",
        action="store_true",
        help="throwaway volume, nodes and `meta serve` on 127.0.0.1",
    )
    b.add_argument("--ranks", type=int, default=64)
    b.add_argument("--hosts", type=int, default=2, help="simulated hosts (one tier each)")
    b.add_argument("--shard-size", type=size_arg, default=2**20, metavar="SIZE")
    b.add_argument("--steps", type=int, default=3)
    b.add_argument(
        "--change-rate",
        type=_rate,
        default=1.0,
        metavar="FRACTION",
        help="fraction of each shard that changes between steps (default 1)",
    )
    b.add_argument("--data", choices=["random", "bf16", "zeros"], default="random")
    b.add_argument("--durability", choices=["local", "remote"], default="local")
    b.add_argument(
        "--nodes",
        choices=["dir", "s3"],
        default=None,
        help="--embedded node kind (s3 = SeaweedFS servers started here; default dir, "
        "s3 with --topology netns)",
    )
    b.add_argument("--node-count", type=int, default=None, help="default 4 (dir), 3 (s3)")
    b.add_argument(
        "--topology",
        choices=["loopback", "netns"],
        default="loopback",
        help="loopback: every server on 127.0.0.1; netns: every host, service replica, the "
        "database and every S3 node in a network namespace of its own on one bridge "
        "(198.18.0.0/16; needs root)",
    )
    b.add_argument(
        "--link",
        metavar="RATE[/DELAY]",
        default=None,
        help="netns: shape every host's link with tc, e.g. 1gbit or 1gbit/2ms (the delay "
        "needs netem in the kernel)",
    )
    b.add_argument(
        "--meta-replicas",
        type=int,
        default=1,
        metavar="N",
        help="service replicas sharing the volume's database (N > 1 needs --db postgres)",
    )
    b.add_argument(
        "--db",
        choices=["sqlite", "postgres"],
        default="sqlite",
        help="--embedded metadata engine (postgres: a throwaway PostgreSQL started here)",
    )
    b.add_argument("--replicas", type=int, default=2)
    b.add_argument(
        "--chunk-size", type=size_arg, default=None, help="default: shard/4 within 64KiB..4MiB"
    )
    b.add_argument(
        "--no-agent",
        action="store_true",
        help="no `ckptfs agent` per host: each simulated host is one Volume speaking for its "
        "ranks (the mode before agents; default: each rank its own client of its host's agent)",
    )
    b.add_argument("--kill-node", action="store_true", help="node n0 dies mid-save")
    b.add_argument("--kill-rank", action="store_true", help="one rank dies mid-save")
    b.add_argument(
        "--resume",
        action="store_true",
        help="after the last step, restart as a new job: fresh volumes and one connection "
        "per rank resolve latest_durable and read every shard back (cold where allowed)",
    )
    b.add_argument(
        "--slow-rank",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="N ranks (default 1) wait --slow-delay before saving",
    )
    b.add_argument("--slow-node", action="store_true", help="node n0 adds --slow-node-delay")
    b.add_argument(
        "--kill-meta",
        action="store_true",
        help="SIGKILL a service replica mid-step, restart it --fault-hold later",
    )
    b.add_argument(
        "--hang-meta",
        action="store_true",
        help="SIGSTOP a service replica mid-step, SIGCONT it --hang-for later (needs "
        "--meta-replicas >= 2); its step must publish within 5 s of a step without faults",
    )
    b.add_argument(
        "--hang-for",
        type=float,
        default=HANG_S,
        metavar="S",
        help=f"how long --hang-meta keeps the replica stopped (default {HANG_S:g})",
    )
    b.add_argument(
        "--partition-host",
        action="store_true",
        help="cut one host's link mid-save for --fault-hold (loopback: its process stops)",
    )
    b.add_argument(
        "--rolling-restart",
        action="store_true",
        help="restart every S3 node, one after another, during the run",
    )
    b.add_argument(
        "--restart-db", action="store_true", help="restart PostgreSQL mid-step (--db postgres)"
    )
    b.add_argument(
        "--fault-hold",
        type=float,
        default=3.0,
        metavar="S",
        help="how long a killed replica, a cut link or a stopped database stays down",
    )
    b.add_argument("--slow-delay", type=float, default=2.0, metavar="S")
    b.add_argument("--slow-node-delay", type=float, default=0.02, metavar="S")
    b.add_argument(
        "--fault-step",
        type=int,
        default=2,
        help="step the kill faults hit; the fleet faults take one step each from here",
    )
    b.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="S",
        help="step deadline (default 1h; 3x the last save at a --kill-rank step)",
    )
    b.add_argument("--procs", type=int, default=None, help="worker processes (default <= 4)")
    b.add_argument("--threads-per-host", type=int, default=4)
    b.add_argument("--phase-timeout", type=float, default=900.0, metavar="S")
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--workdir", default=None, help="where temporary directories go")
    b.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    b.add_argument("--plot", metavar="DIR", help="write PNG plots (matplotlib)")
    b.set_defaults(func=cmd_bench)
