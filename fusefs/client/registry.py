"""One Volume per process and volume spec, shared by every in-process frontend (the DCP
writer and reader, the fsspec filesystem), and drained and closed at exit.

Why shared: a volume holds a worker pool, an engine connection and (with the write-behind
tier) a journal segment, which a process should pay for once, however many writers,
readers and filesystem objects it makes; and those objects must pickle (dcp.async_save,
fsspec instances sent to workers), so they hold specs and come here for the volume.
Why drained at exit: a process that exits right after a save should leave its data on
the object nodes, not only journaled for the next tier on this host to adopt.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from fusefs.client.volume import Volume

log = logging.getLogger("ckptfs.volume")
EXIT_DRAIN_S = 600.0  # how long a process waits at exit for its staged chunks to drain

# (staging dir or None = the default per-volume one, durability, staging size)
TierSpec = tuple[str | None, str, int | None] | None

_VOLUMES: dict[tuple, Volume] = {}
_VLOCK = threading.Lock()


def volume_for(spec: str, tier: TierSpec = None, *, token: str | None = None) -> Volume:
    """Open the volume once per process (callers hold specs, not volumes: they must pickle).

    With `tier`, the host write-behind tier is attached: writes return once chunks are
    staged on local disk, and reads go through the host read cache with single-flight.
    `token` authenticates to a `ckptfs://` service when the URL and environment do not."""
    key = (os.getpid(), spec, tier, token)
    with _VLOCK:
        vol = _VOLUMES.get(key)
        if vol is None:
            vol = _VOLUMES[key] = open_volume(spec, tier, token=token)
        return vol


def open_volume(spec: str, tier: TierSpec = None, *, token: str | None = None) -> Volume:
    """A volume for this process (the caller closes it): through the host's agent when one
    answers on the volume's socket (fusefs.agent: its service connection, uploaders and
    cache are the host's), else its own, with its own tier when `tier` asks for one.
    With CKPTFS_AGENT=auto a host with no agent gets one, started by its first rank
    (fusefs.agent.spawn); if it cannot start, this process says why once and runs its own."""
    from fusefs.agent.rank import agent_volume
    from fusefs.agent.spawn import auto_wanted, ensure_agent

    # (twice with auto: an agent that left idle as this rank connected is started anew)
    for _ in range(2 if auto_wanted() else 1):
        if auto_wanted() and not ensure_agent(spec, tier, token=token):
            break
        vol = agent_volume(spec, tier, token=token, workers=_pool_size())
        if vol is not None:
            return vol
    vol = Volume.open(spec, workers=_pool_size(), token=token)
    if tier is not None:
        try:
            vol.attach_tier(tier[0], tier[2], tier[1])
        except BaseException:
            vol.close()
            raise
    return vol


def _pool_size() -> int:
    """Chunk threads per process: the host's cores shared by its ranks (torchrun's
    LOCAL_WORLD_SIZE), at least 2 so hashing overlaps I/O, at most 8. Eight ranks with
    eight threads each on a 2-core host mostly add context switches."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(8, 2 * (cores or 1) // local))


def tier_spec(staging: str | os.PathLike | bool | None, durability: str, size: int | None):
    """The TierSpec of a frontend's options: staging True = the default directory, a path =
    that directory, None/False = no tier (chunks go straight to the object nodes)."""
    if staging is None or staging is False:
        return None
    if durability not in ("local", "remote"):
        raise ValueError(f"durability must be local or remote, not {durability!r}")
    where = None if staging is True else os.path.abspath(os.fspath(staging))
    return (where, durability, size)


def drain(timeout: float | None = None) -> None:
    """Wait until every chunk this process staged is on the object nodes (marked durable).

    Writes return once chunks are fsync'd in the host's write-behind tier; a reader on
    another host (or one without the tier, e.g. a plain mount) needs them drained first."""
    with _VLOCK:
        tiers = [v.tier for k, v in _VOLUMES.items() if k[0] == os.getpid() and v.tier]
    for t in tiers:
        t.flush(timeout=timeout)


def close_volumes(drain_timeout: float | None = EXIT_DRAIN_S) -> None:
    """Close every volume this process opened (atexit; tests call it between volumes).

    Staged chunks are drained first (up to `drain_timeout`): a process that exits right
    after a save leaves its data on the nodes, not only journaled for the next tier on this
    host to adopt (which is still what happens if the drain times out: nothing is lost)."""
    with _VLOCK:
        mine = [k for k in _VOLUMES if k[0] == os.getpid()]
        vols = [_VOLUMES.pop(k) for k in mine]
    for v in vols:
        try:  # (a volume through the host's agent leaves its chunks to the agent)
            if v.tier is not None and drain_timeout and v.agent is None:
                v.tier.flush(timeout=drain_timeout)
        except Exception as e:  # the journal keeps what did not drain
            log.warning("write-behind tier not drained at exit: %s", e)
        try:
            v.close()
        except Exception:  # noqa: S110 - best effort at exit
            pass


def open_volumes() -> list[Volume]:
    """The volumes this process holds open (for metrics)."""
    with _VLOCK:
        return [v for k, v in _VOLUMES.items() if k[0] == os.getpid()]


def _register_exit_drain() -> None:
    """Drain and close at exit *before* concurrent.futures stops accepting work (its hook
    runs at threading shutdown, ahead of plain atexit; the tier's uploads need the pools).
    threading._register_atexit hooks run last-registered first; atexit stays as a fallback."""
    hook = getattr(threading, "_register_atexit", None)
    if hook is not None:
        try:
            hook(close_volumes)
        except RuntimeError:  # already shutting down
            pass
    atexit.register(close_volumes)


_register_exit_drain()
