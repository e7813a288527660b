"""The embedded default volume: what `ckptfs mount MOUNTPOINT` uses without a VOLUME.

It lives in the user's data directory so that every command (mount, demo,
bench) that omits a volume finds the same one, and it is formatted with the
default settings on first use.
"""

from __future__ import annotations

import os

from fusefs.client.volume import VOLUME_FILE, Volume, VolumeError


def data_dir() -> str:
    """`$XDG_DATA_HOME/ckptfs`, or `~/.local/share/ckptfs` (the XDG default)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return os.path.join(base, "ckptfs")


def default_volume_path() -> str:
    return os.path.join(data_dir(), "default")


def default_staging_path() -> str:
    return os.path.join(data_dir(), "staging")


def ensure_default_volume() -> str:
    """Format the default volume if it does not exist yet; return its path."""
    path = default_volume_path()
    if not os.path.exists(os.path.join(path, VOLUME_FILE)):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            Volume.create(path).close()
        except VolumeError:  # another process formatted it first
            if not os.path.exists(os.path.join(path, VOLUME_FILE)):
                raise
    return path


def open_default_volume(**kw) -> Volume:
    return Volume.open(ensure_default_volume(), **kw)
