"""`ckptfs agent VOLUME`: this host's one client of a volume, shared by its ranks
(fusefs/agent). Runs in the foreground until SIGTERM or SIGINT, then stops accepting,
lets the requests in flight finish and exits 0; staged chunks stay journaled for the
next agent (nothing is flushed by force). With --idle-exit (an agent a rank started on
demand, fusefs/agent/spawn.py) it also leaves on its own once idle (fusefs/agent/idle.py)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from fusefs.cli.units import parse_seconds, parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def cmd_agent(args: argparse.Namespace) -> int:
    import trio

    from fusefs.agent.paths import socket_path
    from fusefs.agent.server import AgentError, agent_for
    from fusefs.agent.spawn import HostLock, lock_path
    from fusefs.cli.main import UserError
    from fusefs.client.volume import Volume

    remote = args.volume.startswith("ckptfs://")
    spec = args.volume if remote else os.path.abspath(args.volume)
    path = socket_path(spec, args.socket)
    # (taken when idle, released only once the agent is closed: idle.py)
    lock = HostLock(lock_path(path)) if args.idle_exit else None
    vol = Volume.open(spec)  # its own client, never through an agent (it is the agent)
    try:
        if not args.no_tier:
            vol.attach_tier(args.staging, args.staging_size, args.durability)
        agent = agent_for(vol, spec, path, args.durability)
        try:
            trio.run(_run, agent, spec, args.idle_exit, lock)
        except AgentError as e:
            raise UserError(str(e)) from None
    finally:
        vol.close()
        if lock is not None:
            lock.release()
    return 0


async def _run(agent, spec: str, idle_exit: float | None, lock) -> None:
    import trio

    async with trio.open_nursery() as nursery:
        path = await nursery.start(agent.serve)
        print(f"ckptfs agent: serving {spec} on {path} (pid {os.getpid()})", flush=True)
        idle = trio.CancelScope()  # a signal stops the idle watcher, then shuts down
        async with trio.open_nursery() as stop:
            stop.start_soon(_on_signal, agent, idle)
            if idle_exit:
                stop.start_soon(_on_idle, agent, idle_exit, lock, idle, stop.cancel_scope)


async def _on_signal(agent, idle) -> None:
    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _sig in signals:
            print("ckptfs agent: stopping", file=sys.stderr, flush=True)
            idle.cancel()
            await agent.shutdown()
            return


async def _on_idle(agent, seconds: float, lock, idle, done) -> None:
    from fusefs.agent.idle import exit_when_idle

    with idle:
        await exit_when_idle(agent, seconds, lock)
        print(
            f"ckptfs agent: idle for {seconds:g} s (no rank connected, nothing left to "
            "upload): exiting", file=sys.stderr, flush=True,
        )  # fmt: skip
        done.cancel()  # (the signal watcher)


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "agent",
        help="serve this host's ranks of a volume: one service connection, tier and cache",
        description="One client per host and volume: ranks on this host find it on its "
        "Unix socket and use its service connection, write-behind tier and read cache.",
    )
    g.add_argument("volume", help="volume directory or ckptfs://HOST:PORT service URL")
    g.add_argument(
        "--socket",
        help="Unix socket to listen on (default: CKPTFS_AGENT_SOCKET, else "
        "$XDG_RUNTIME_DIR/ckptfs/agent-KEY.sock, else /tmp/ckptfs-UID/agent-KEY.sock)",
    )
    g.add_argument("--staging", help="staging directory of the write-behind tier")
    g.add_argument("--staging-size", type=_size, help="staging budget (default: 10%% free)")
    g.add_argument("--durability", choices=("local", "remote"), default="local")
    g.add_argument(
        "--no-tier", action="store_true", help="no write-behind tier: ranks write to the nodes"
    )
    g.add_argument(
        "--idle-exit",
        type=parse_seconds,
        metavar="SECONDS",
        help="exit once no rank has been connected and the write-behind tier has been drained "
        "for SECONDS (an agent a rank starts on demand, CKPTFS_AGENT=auto; default: run until "
        "stopped)",
    )
    g.set_defaults(func=cmd_agent)
