"""Where a volume's agent listens: one well-known Unix socket per host, user and volume.

`CKPTFS_AGENT_SOCKET` when set, else `$XDG_RUNTIME_DIR/ckptfs/agent-<key>.sock`, else
`/tmp/ckptfs-<uid>/agent-<key>.sock`, in a directory of mode 0700. The key is the volume's
uuid when its volume.json names one, else a short digest of the normalized spec (the
directory's real path, or a service URL's replica list without its options: the agent and
its ranks may name their token files differently). Both sides compute it without
opening the volume: a rank looks for its agent before it opens anything.

A rank hands its token to whatever listens there, so it trusts a socket only if it and its
directory belong to the rank's user (or root) and no one else may write the directory
(`trusted`); the agent checks its peers in turn (SO_PEERCRED, server.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import stat

from metadata.wire.url import parse_url

ENV_SOCKET = "CKPTFS_AGENT_SOCKET"


def agent_key(spec: str) -> str:
    """The volume's name in its socket path (module docstring)."""
    if spec.startswith("ckptfs://"):
        replicas, _ = parse_url(spec)
        norm = "ckptfs://" + ",".join(f"{h}:{p}" for h, p in replicas)
    else:
        norm = os.path.realpath(spec)
        try:
            with open(os.path.join(norm, "volume.json")) as f:
                uuid = json.load(f).get("uuid")
            if isinstance(uuid, str) and uuid.replace("-", "").isalnum():
                return uuid
        except (OSError, ValueError, AttributeError):
            pass
    return hashlib.sha256(norm.encode()).hexdigest()[:16]


def socket_dir() -> str:
    """The per-user directory of the well-known sockets."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        return os.path.join(run, "ckptfs")
    return f"/tmp/ckptfs-{os.getuid()}"  # noqa: S108 - mode 0700, owner checked (trusted)


def socket_path(spec: str, explicit: str | None = None) -> str:
    """The socket of the volume's agent: `explicit`, else CKPTFS_AGENT_SOCKET, else the
    well-known one."""
    chosen = explicit or os.environ.get(ENV_SOCKET)
    if chosen:
        return os.path.abspath(chosen)
    return os.path.join(socket_dir(), f"agent-{agent_key(spec)}.sock")


def make_socket_dir(path: str) -> None:
    """The socket's directory, made mode 0700 if missing; an existing well-known one must
    be ours and closed to others (someone else's /tmp/ckptfs-UID would see our ranks)."""
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
        return
    why = untrusted_dir(d)
    if why:
        raise PermissionError(f"cannot serve in {d}: {why}")


def untrusted_dir(d: str) -> str | None:
    """Why a socket's directory is not safe to trust, or None."""
    st = os.lstat(d)
    if st.st_uid not in (os.getuid(), 0):
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"writable by others (mode {st.st_mode & 0o777:04o})"
    return None


def trusted(path: str) -> str | None:
    """Why a rank must not talk to the socket at `path`, or None when it may."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return e.strerror
    if not stat.S_ISSOCK(st.st_mode):
        return "not a socket"
    if st.st_uid not in (os.getuid(), 0):
        return f"owned by uid {st.st_uid}"
    return untrusted_dir(os.path.dirname(path))


def listening(path: str) -> bool:
    """Does a process accept connections at this socket path? A refused or missing socket
    is not (a killed agent's); any other failure (a full backlog, a timeout) counts as
    one that is, so a live agent is never replaced nor a second one started beside it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError as e:
            return e.errno not in (errno.ECONNREFUSED, errno.ENOENT)
        return True
