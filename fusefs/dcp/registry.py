"""The DCP backend's per-process state: one Volume per process and volume spec (a writer
must pickle, so it holds specs, not volumes), the exit-time drain of staged chunks,
checkpoint-path parsing, and the resume helpers."""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
from typing import Any

import chunkstore.tier.tier  # noqa: F401 - imported with this module, not inside the first save
import metadata.sqlite  # noqa: F401 - (the Volume imports them lazily; profiled: ~0.2 s a rank)
from fusefs.client.volume import Volume

log = logging.getLogger("ckptfs.dcp")
EXIT_DRAIN_S = 600.0  # how long a process waits at exit for its staged chunks to drain
METADATA_FILE = ".metadata"

_STEP_RE = re.compile(r"(\d+)$")


class CkptfsError(RuntimeError):
    """A checkpoint-level problem a user can act on (bad path, step already used...)."""


# -- one Volume per process and spec ---------------------------------------------------------
_VOLUMES: dict[tuple, Volume] = {}
_VLOCK = threading.Lock()


TierSpec = (
    tuple[str | None, str, int | None] | None
)  # (staging dir or None=default, durability, size)


def volume_for(spec: str, tier: TierSpec = None) -> Volume:
    """Open the volume once per process (the writer itself never holds one: it must pickle).

    With `tier`, the host write-behind tier is attached: saves return once chunks are
    staged on local disk, and reads go through the host read cache with single-flight.
    """
    key = (os.getpid(), spec, tier)
    with _VLOCK:
        vol = _VOLUMES.get(key)
        if vol is None:
            vol = Volume.open(spec, workers=_pool_size())
            if tier is not None:
                try:
                    vol.attach_tier(tier[0], tier[2], tier[1])
                except BaseException:
                    vol.close()
                    raise
            _VOLUMES[key] = vol
        return vol


def _pool_size() -> int:
    """Chunk threads per rank: the host's cores shared by its ranks (torchrun's
    LOCAL_WORLD_SIZE), at least 2 so hashing overlaps I/O, at most 8. Eight ranks with
    eight threads each on a 2-core host mostly add context switches."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(8, 2 * (cores or 1) // local))


def tier_spec(staging: str | os.PathLike | bool | None, durability: str, size: int | None):
    if staging is None or staging is False:
        return None
    if durability not in ("local", "remote"):
        raise ValueError(f"durability must be local or remote, not {durability!r}")
    where = None if staging is True else os.path.abspath(os.fspath(staging))
    return (where, durability, size)


def drain(timeout: float | None = None) -> None:
    """Wait until every chunk this process staged is on the object nodes (marked durable).

    Saves return once chunks are fsync'd in the host's write-behind tier; a reader on another
    host (or one without the tier, e.g. a plain mount) needs them drained first."""
    with _VLOCK:
        tiers = [v.tier for k, v in _VOLUMES.items() if k[0] == os.getpid() and v.tier]
    for t in tiers:
        t.flush(timeout=timeout)


def close_volumes(drain_timeout: float | None = EXIT_DRAIN_S) -> None:
    """Close every volume this process opened (atexit; tests call it between volumes).

    Staged chunks are drained first (up to `drain_timeout`): a process that exits right after
    a save leaves its checkpoint on the nodes, not only journaled for the next tier on this
    host to adopt (which is still what happens if the drain times out: nothing is lost)."""
    with _VLOCK:
        mine = [k for k in _VOLUMES if k[0] == os.getpid()]
        vols = [_VOLUMES.pop(k) for k in mine]
    for v in vols:
        try:
            if v.tier is not None and drain_timeout:
                v.tier.flush(timeout=drain_timeout)
        except Exception as e:  # the journal keeps what did not drain
            log.warning("write-behind tier not drained at exit: %s", e)
        try:
            v.close()
        except Exception:  # noqa: S110 - best effort at exit
            pass


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


def new_id() -> str:
    import uuid

    return str(uuid.uuid4())


def volume_spec(volume: Any) -> str:
    if isinstance(volume, Volume):
        raise TypeError(
            "pass the volume directory or ckptfs://HOST:PORT, not a Volume object: "
            "the writer must pickle for dcp.async_save"
        )
    if not isinstance(volume, str | os.PathLike):
        raise TypeError(f"volume must be a directory or ckptfs://HOST:PORT, not {volume!r}")
    s = os.fspath(volume)
    return s if s.startswith("ckptfs://") else os.path.abspath(s)


def norm_path(path: Any) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"checkpoint path must be a string, not {path!r}")
    parts = [p for p in os.fspath(path).split("/") if p and p != "."]
    if not parts or ".." in parts:
        raise ValueError(f"bad checkpoint path {path!r}: want e.g. 'job/step-000100'")
    return "/".join(parts)


def parse_ckpt_path(path: str, job: str | None = None, step: int | None = None) -> tuple[str, int]:
    """'a/job/step-000100' -> ('a/job', 100); explicit job/step win over the path."""
    parts = norm_path(path).split("/")
    if step is None:
        m = _STEP_RE.search(parts[-1])
        if m is None:
            raise ValueError(
                f"cannot tell the step from {path!r}: end the path in a number "
                "(e.g. job/step-000100) or pass step="
            )
        step = int(m.group(1))
    if job is None:
        if len(parts) < 2:
            raise ValueError(f"cannot tell the job from {path!r}: use job/step-N or pass job=")
        job = "/".join(parts[:-1])
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, not {step!r}")
    return job, step


def latest_step(volume: str | os.PathLike, job: str, *, durable: bool = False) -> int | None:
    """The newest published step of `job` (with durable=True: whose chunks are all on nodes)."""
    meta = volume_for(volume_spec(volume)).meta
    return meta.latest_durable(job) if durable else meta.latest(job)


def resume_path(volume: str | os.PathLike, job: str, *, durable: bool = False) -> str | None:
    """The volume path to load from to resume `job`, or None when nothing was published."""
    step = latest_step(volume, job, durable=durable)
    if step is None:
        return None
    return volume_for(volume_spec(volume)).meta.step_state(job, step)["path"]
