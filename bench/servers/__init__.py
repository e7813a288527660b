"""Servers the product starts for itself: SeaweedFS object nodes, a throwaway PostgreSQL,
`ckptfs meta serve` replicas.

`ckptfs bench --embedded`, the benchmarks and the test suite all start the same servers, so
the launchers ship with the package (a wheel has no tests/). Each launcher can put its
server in a Linux network namespace (`prefix`, the words that run a command inside it, such
as `ip netns exec NAME`) and on a given address, which is how `ckptfs bench --topology
netns` gives every server a network stack of its own.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time


class ServerError(RuntimeError):
    """A server did not start or stop: one line for the user, with where its log is."""


def package_root() -> str:
    """The directory holding the `fusefs` package this process runs (a source tree or
    site-packages)."""
    import fusefs

    return os.path.dirname(os.path.dirname(os.path.abspath(fusefs.__file__)))


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a `python -m fusefs.cli ...` child: the same code as this process.

    Without it a child started from a source tree would import whatever `ckptfs` is
    installed (an editable install of another checkout, say) instead of the tree's."""
    env = dict(os.environ)
    root = package_root()
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    installed = os.path.basename(root) in ("site-packages", "dist-packages")
    if not installed and root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([root, *parts])
    env.update(extra or {})
    return env


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1", below: int = 65536) -> int:
    """A free port on `host` below `below`, never one this process handed out before (the
    kernel may offer a just-closed port again, and two servers would then collide)."""
    for _ in range(500):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port < below and port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise ServerError(f"no free port below {below} on {host}")


def kill_group(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    """Signal a server started with start_new_session=True and everything it started (the
    `weed` on PATH may be a pyenv shim that does not forward signals)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def first_line(proc: subprocess.Popen, timeout: float) -> bytes:
    """What a started server printed on stdout up to its first newline (its "serving ..."
    line), waiting at most `timeout`; less if it exited or the time ran out."""
    assert proc.stdout is not None
    line = b""
    end = time.monotonic() + timeout
    while not line.endswith(b"\n") and time.monotonic() < end:
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r:
            got = os.read(proc.stdout.fileno(), 4096)
            if not got:
                break
            line += got
    return line


def tail(path: str, n: int = 400) -> str:
    """The end of a log file, for an error message (empty when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""
