"""The DCP backend's checkpoint-path parsing and resume helpers. The per-process volumes
and their exit-time drain are fusefs.client.registry's (shared with the fsspec filesystem)."""

from __future__ import annotations

import errno
import logging
import os
import re
from typing import Any

import chunkstore.tier.tier  # noqa: F401 - imported with this module, not inside the first save
import metadata.engines.sqlite  # noqa: F401 - (the Volume imports them lazily; profiled: ~0.2 s a rank)
from fusefs.client.registry import volume_for
from fusefs.client.volume import Volume

log = logging.getLogger("ckptfs.dcp")
METADATA_FILE = ".metadata"

_STEP_RE = re.compile(r"(\d+)$")


class CkptfsError(RuntimeError):
    """A checkpoint-level problem a user can act on (bad path, step already used...)."""


def meta_failure(text: str, e: Exception) -> Exception:
    """A metadata refusal as the DCP backend raises it (MetaError does not unpickle, and
    DCP gathers errors across ranks): what a credential's scope does not allow (EACCES)
    as PermissionError, anything else as CkptfsError."""
    if getattr(e, "errno", None) == errno.EACCES:
        return PermissionError(errno.EACCES, text)
    return CkptfsError(text)


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
