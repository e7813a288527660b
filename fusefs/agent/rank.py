"""A rank's side of the host agent: find it, and open the volume through it.

`agent_volume(spec, ...)` (called by fusefs.client.registry for every frontend) looks for
the volume's agent on its well-known socket (paths.py). When one answers, the Volume's
engine is a RemoteEngine over that socket (the same client and protocol as the service's,
its hello carrying the rank's own token and asking for the volume's config and the agent's
info in its answer: the session's set-up in one round trip, or three with an agent that
does not know `want`), and its tier is the host stager over the agent's
staging directory when the data plane is there (chunkstore.tier.stager: the rank hashes
and stages chunk files itself, on its own cores, and tells the agent to adopt them; only
control crosses the socket). The rank then opens no service connection and starts no
uploader threads. Without an agent the process runs its own client, and says so once.

A connect never hangs: the socket must exist and be trusted (paths.trusted), and the
first connect makes one attempt (a dead agent's stale socket is refused at once). After
that, a request whose agent went away is retried for AGENT_RETRY seconds (a restarted
agent answers it, applied once by its idempotency key), then fails with ETIMEDOUT.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from chunkstore.store import ChunkUnavailable
from fusefs.agent.paths import socket_path, trusted
from metadata.engine import MetaError

log = logging.getLogger("ckptfs.agent")

ENV_SWITCH = "CKPTFS_AGENT"  # "off": never look for an agent
AGENT_RETRY = 30.0  # seconds a request waits for a restarted agent
_said: set[tuple[int, str]] = set()  # (pid, path) told "no agent" already


def agent_wanted() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() not in ("off", "0", "no", "false")


def _no_agent(path: str, why: str) -> None:
    key = (os.getpid(), path)
    if key not in _said:
        _said.add(key)
        log.info("no ckptfs agent at %s: this process runs its own client (%s)", path, why)


def _rank_token(spec: str, token: str | None) -> str:
    """The credential the rank's hello carries: its own, as it would give the service; an
    embedded volume's agent takes any (its directory's readers are its admins)."""
    if token:
        return token
    if spec.startswith("ckptfs://"):
        from metadata.wire.url import parse_url, resolve_token

        return resolve_token(parse_url(spec)[1])
    return os.environ.get("CKPTFS_TOKEN", "").strip()


def connect_agent(spec: str, token: str | None = None) -> Any | None:
    """A RemoteEngine over the volume's agent socket, or None when no agent answers."""
    from metadata.client import RemoteEngine

    path = socket_path(spec)
    why = trusted(path)
    if why is not None:
        _no_agent(path, why)
        return None
    tok = _rank_token(spec, token)
    try:
        eng = RemoteEngine([(path, 0)], tok, retry_for=0, want=("config", "info"))
    except MetaError as e:
        if e.errno in (errno.EACCES, errno.EPROTO):  # the agent refused us: say why
            raise MetaError(e.errno, f"ckptfs agent at {path}: {e}") from None
        _no_agent(path, str(e))
        return None
    eng.retry_for = float(os.environ.get("CKPTFS_AGENT_RETRY", AGENT_RETRY))
    return eng


class AgentLink:
    """The host stager's way to the agent's tier (adopt, fetch, flush) over the rank's
    agent connection."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def adopt(self, entries: list[tuple[bytes, int, int | None]], synced: bool = True) -> None:
        if entries:
            kw = {} if synced else {"synced": False}
            self.engine.call("agent_adopt", [[c, n, w] for c, n, w in entries], **kw)

    def fetch(self, ids: list[bytes]) -> None:
        if ids:
            try:
                self.engine.call("agent_fetch", list(ids))
            except MetaError as e:
                if e.errno == errno.ENODATA:  # no node has one of them (server.py)
                    raise ChunkUnavailable(str(e)) from None
                raise

    def flush(self, timeout: float | None = None) -> None:
        try:
            self.engine.call("agent_flush", timeout)
        except MetaError as e:
            if e.errno == errno.ETIMEDOUT:
                raise TimeoutError(str(e)) from None
            raise


def agent_volume(spec: str, tier: Any = None, *, token: str | None = None, workers: int = 8):
    """The volume through its host agent, or None (no agent, CKPTFS_AGENT=off): the
    caller then opens it on its own. `tier`: the frontend's TierSpec (registry.py); with
    an agent the rank stages into the agent's tier instead of running one."""
    if not agent_wanted():
        return None
    eng = connect_agent(spec, token)
    if eng is None:
        return None
    from fusefs.client.volume import Volume

    try:
        config = eng.hello_answer.get("config")  # an older agent leaves it out: ask
        vol = Volume(eng, config if isinstance(config, dict) else eng.get_config(), workers=workers)
        vol.agent = eng.replicas[0][0]
        if tier is not None:
            _attach_stager(vol, eng, tier)
    except BaseException:
        eng.close()
        raise
    return vol


def _attach_stager(vol: Any, eng: Any, tier: Any) -> None:
    """The host stager over the agent's staging directory, when the data plane exists and
    the agent runs a tier; otherwise chunks go from the rank straight to the nodes
    (durable at their put: no uploader here either)."""
    try:
        from chunkstore.tier.stager import HostStager
    except ImportError:
        return
    info = eng.hello_answer.get("info")  # an older agent leaves it out: ask
    if not isinstance(info, dict):
        info = eng.call("agent_info")
    if not info.get("tier") or not info.get("staging_dir"):
        return
    budget = info.get("budget")  # the agent's staging size: no statvfs here (stager.py)
    vol.tier = HostStager(
        vol.store,
        info["staging_dir"],
        AgentLink(eng),
        durability=tier[1],
        size=budget if isinstance(budget, int) and budget > 0 else None,
    )
