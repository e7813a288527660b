"""On-demand start of a volume's agent (`CKPTFS_AGENT=auto`): the first rank of a host that
finds no live agent starts `ckptfs agent VOLUME --idle-exit N`, detached, and every rank of
the host then connects to it (rank.py).

Why a lock: torchrun starts a host's ranks together; each would look, find nothing and
start its own agent. They serialize on an flock of a file beside the socket (0600, in the
socket's 0700 directory): the holder looks again, starts an agent only if none answers, and
waits for it to serve (START_TIMEOUT); the others, once they hold the lock, find it. An
agent leaving at idle takes the same lock for its last look and keeps it until its socket is
gone (idle.py), so a rank never connects to a socket about to close: it waits, then starts
a new agent.

Why detached, with a log file: the agent outlives the rank that started it and must not die
with the job's process group or terminal, so it runs in its own session with its output in
`agent-KEY.log` beside the socket; a start that fails names that file.

Credentials: the command line carries the volume and staging options only (every user can
read argv with ps); the agent reads its own token as `ckptfs agent` always does: the URL's
token_file=, else CKPTFS_TOKEN or CKPTFS_TOKEN_FILE of the environment it inherits. A token
the rank was handed in code (and neither names) goes to the agent's environment, never argv.

A start that fails is said once per process and remembered in the lock file for FAIL_HOLD
seconds, so a host's other ranks run their own clients at once instead of each retrying it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from fusefs.agent.paths import listening, make_socket_dir, socket_path, trusted

log = logging.getLogger("ckptfs.agent")

ENV_SWITCH = "CKPTFS_AGENT"  # "auto": start an agent when none answers (rank.py reads "off")
ENV_IDLE = "CKPTFS_AGENT_IDLE_EXIT"  # seconds an agent started on demand stays idle
IDLE_EXIT = 60.0
START_TIMEOUT = 30.0  # seconds a started agent has to serve
LOCK_WAIT = START_TIMEOUT + 15.0  # a rank waits this long for another one's start
FAIL_HOLD = 30.0  # seconds a failed start stands for the host's other ranks
LOG_KEEP = 1 << 20  # the log is moved to .log.old past this size at a start
_said: set[tuple[int, str]] = set()  # (pid, socket) told "could not start" already


def auto_wanted() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() == "auto"


def idle_exit() -> float:
    """The --idle-exit an agent started on demand gets (CKPTFS_AGENT_IDLE_EXIT, else 60)."""
    try:
        value = float(os.environ.get(ENV_IDLE, IDLE_EXIT))
    except ValueError:
        return IDLE_EXIT
    return value if value > 0 else IDLE_EXIT


def _beside(sock: str, suffix: str) -> str:
    base = sock[: -len(".sock")] if sock.endswith(".sock") else sock
    return base + suffix


def lock_path(sock: str) -> str:
    return _beside(sock, ".lock")


def log_path(sock: str) -> str:
    return _beside(sock, ".log")


def alive(path: str) -> bool:
    """Does a trusted agent accept connections at `path` (a killed one's socket does not)?"""
    return trusted(path) is None and listening(path)


class HostLock:
    """The flock that serializes starting (spawn) and leaving (idle.py) of one socket's agent;
    the file also holds the note of the last failed start."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None

    def _open(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        owner = os.fstat(fd).st_uid
        if owner not in (os.getuid(), 0):  # someone else's file: not our lock to trust
            os.close(fd)
            raise PermissionError(f"{self.path} is owned by uid {owner}")
        return fd

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it (never blocks: the agent calls it from trio)."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def acquire(self, timeout: float) -> bool:
        """Take the lock within `timeout` seconds (polled: an flock wait has no timeout)."""
        end = time.monotonic() + timeout
        while not self.try_acquire():
            if time.monotonic() > end:
                return False
            time.sleep(0.02)
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def read_failure(self) -> str | None:
        """The last failed start's reason while it is recent (FAIL_HOLD), else None."""
        assert self.fd is not None
        try:
            note = json.loads(os.pread(self.fd, 4096, 0) or b"{}")
            if time.time() - float(note.get("failed", 0)) < FAIL_HOLD:
                return str(note.get("why", "an earlier start failed"))
        except (ValueError, TypeError, AttributeError, OSError):
            pass
        return None

    def write_failure(self, why: str | None) -> None:
        assert self.fd is not None
        os.ftruncate(self.fd, 0)
        if why is not None:
            os.pwrite(self.fd, json.dumps({"failed": time.time(), "why": why}).encode(), 0)


def ensure_agent(spec: str, tier: Any = None, *, token: str | None = None) -> bool:
    """True when an agent serves `spec` on its socket (found, or started here); False when
    none could be started, said once in this process's log (the caller runs its own client).
    `tier`: the frontend's TierSpec (registry.py), whose staging options the agent gets."""
    try:
        path = socket_path(spec)
    except Exception:  # noqa: BLE001 - a malformed spec: the rank's own open says why
        return False
    if not spec.startswith("ckptfs://") and not os.path.isfile(os.path.join(spec, "volume.json")):
        return False  # no volume here: no agent to start (the rank's own open says so)
    try:
        if alive(path):
            return True
        why = _start_under_lock(spec, path, tier, token)
    except OSError as e:  # the socket directory or lock file: not ours, not writable
        why = f"{e.strerror or e}: {e.filename or path}"
    if why is None:
        return True
    key = (os.getpid(), path)
    if key not in _said:
        _said.add(key)
        log.warning(
            "could not start a ckptfs agent for %s: %s (log: %s); this process runs its own "
            "client",
            spec, why, log_path(path),
        )  # fmt: skip
    return False


def _start_under_lock(spec: str, path: str, tier: Any, token: str | None) -> str | None:
    make_socket_dir(path)
    lock = HostLock(lock_path(path))
    if not lock.acquire(LOCK_WAIT):
        return f"another process held {lock.path} for {LOCK_WAIT:.0f} s"
    try:
        if alive(path):  # another rank started it while we waited
            return None
        why = lock.read_failure()
        if why is not None:
            return f"{why} (a start failed moments ago)"
        why = _start(spec, path, tier, token)
        lock.write_failure(why)
        return why
    finally:
        lock.release()


def _start(spec: str, path: str, tier: Any, token: str | None) -> str | None:
    """Start the agent and wait until it serves: None, or why it did not."""
    logfile = log_path(path)
    _rotate(logfile)
    fd = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    start = os.fstat(fd).st_size
    try:
        proc = subprocess.Popen(
            _command(spec, path, tier),
            stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=_environment(spec, token),
            start_new_session=True, close_fds=True,
        )  # fmt: skip
    finally:
        os.close(fd)
    # the agent outlives us in its own session; while we live it is our child: reap it
    threading.Thread(target=proc.wait, name="ckptfs-agent-reaper", daemon=True).start()
    end = time.monotonic() + START_TIMEOUT
    while time.monotonic() < end:
        if alive(path):
            log.info("started a ckptfs agent (pid %d) for %s; log: %s", proc.pid, spec, logfile)
            return None
        if proc.poll() is not None:
            return _last_line(logfile, start) or f"the agent exited with status {proc.returncode}"
        time.sleep(0.05)
    proc.kill()  # half started: it must not serve later beside the next rank's start
    return f"the agent did not serve within {START_TIMEOUT:.0f} s"


def _command(spec: str, path: str, tier: Any) -> list[str]:
    target = spec if spec.startswith("ckptfs://") else os.path.abspath(spec)
    cmd = [sys.executable, "-m", "fusefs.cli", "agent", target, "--socket", path]
    cmd += ["--idle-exit", f"{idle_exit():g}"]
    if tier is not None:
        staging, durability, size = tier
        if staging:
            cmd += ["--staging", staging]
        if size:
            cmd += ["--staging-size", str(size)]
        cmd += ["--durability", durability]
    return cmd


def _environment(spec: str, token: str | None) -> dict[str, str]:
    """The rank's environment, the same ckptfs code first on the path, and a token handed
    in code where neither the URL nor the environment names one (module docstring)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.pop(ENV_SWITCH, None)  # the agent opens its volume itself, never through an agent
    named = "token_file=" in spec or env.get("CKPTFS_TOKEN") or env.get("CKPTFS_TOKEN_FILE")
    if token and spec.startswith("ckptfs://") and not named:
        env["CKPTFS_TOKEN"] = token
    return env


def _rotate(logfile: str) -> None:
    try:
        if os.path.getsize(logfile) > LOG_KEEP:
            os.replace(logfile, logfile + ".old")
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise


def _last_line(logfile: str, start: int) -> str | None:
    """The agent's last words since `start` (its one-line error, when it had one)."""
    try:
        with open(logfile, "rb") as f:
            f.seek(start)
            lines = [ln.strip() for ln in f.read(1 << 16).decode(errors="replace").splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln]
    return lines[-1].removeprefix("ckptfs: error: ")[:300] if lines else None
