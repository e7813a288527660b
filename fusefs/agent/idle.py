"""An agent started on demand leaves when its host no longer needs it (`ckptfs agent
--idle-exit SECONDS`): no rank connected, no request in flight and its write-behind tier
drained, all of it for SECONDS in a row.

Never with staged chunks not on the nodes: the journal would keep them for the next agent
on this host, but a job that ended expects its checkpoint on the object nodes, and maybe no
agent ever starts here again. Never while a rank is connected: its next request would find
no agent. A rank that connects and leaves between two looks restarts the count.

The last look is taken under the socket's spawn lock (spawn.HostLock), and the lock is kept
until the socket is gone (the CLI releases it after the agent closed): a rank starting an
agent meanwhile waits, finds no socket and starts a new one, instead of connecting to this
one as it closes. Between the last look and the end of accepting there is no checkpoint, so
no new rank is accepted after it.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from fusefs.agent.spawn import HostLock

log = logging.getLogger("ckptfs.agent")

POLL = 1.0  # seconds between looks (less for a short --idle-exit)


def busy(agent: Any) -> str | None:
    """Why the agent is needed now, from what needs no thread (connections, requests)."""
    conns = agent.stats["connections"]
    if conns:
        return f"{conns} connections"
    if agent.inflight:
        return f"{agent.inflight} requests in flight"
    return None


def tier_busy(tier: Any) -> str | None:
    """Why the tier must not be left yet: chunks staged and not yet durable on the nodes.
    Blocking (the tier's lock): call it in a thread."""
    if tier is None:
        return None
    pending = tier.stats().get("pending_chunks", 0)
    if pending:
        return f"{pending} staged chunks not yet uploaded"
    if not tier.drained():
        return "uploads in flight"
    return None


async def wait_idle(agent: Any, seconds: float, lock: HostLock, poll: float = POLL) -> None:
    """Return once the agent has been idle for `seconds`, holding `lock`, with no
    checkpoint after the last look (the caller stops accepting at once)."""
    poll = min(poll, max(0.05, seconds / 4))
    seen = agent.stats["connections_total"]
    quiet_since: float | None = None
    warned = False
    while True:
        await trio.sleep(poll)
        why = await _why_busy(agent, seen)
        seen = agent.stats["connections_total"]
        now = trio.current_time()
        if why is not None:
            quiet_since = None
            continue
        if quiet_since is None:
            quiet_since = now
        if now - quiet_since < seconds:
            continue
        try:
            if not lock.try_acquire():
                continue  # a rank holds it: it is looking for this agent or starting one
        except OSError as e:  # no lock to be had: staying is safe, leaving might not be
            if not warned:
                warned = True
                log.warning("cannot take %s to exit when idle: %s; staying up", lock.path, e)
            continue
        if await _why_busy(agent, seen) is None:
            return
        lock.release()
        quiet_since = None


async def _why_busy(agent: Any, seen: int) -> str | None:
    why = await trio.to_thread.run_sync(tier_busy, agent.vol.tier)
    if why is None and agent.stats["connections_total"] != seen:
        why = "a rank came and went"
    return why or busy(agent)


async def exit_when_idle(agent: Any, seconds: float, lock: HostLock) -> None:
    """Wait until idle (wait_idle), then stop the agent: its serve() returns and removes the
    socket. The caller releases `lock` once the agent has closed."""
    await wait_idle(agent, seconds, lock)
    agent.stats["idle_exit"] = seconds
    await agent.shutdown()
