"""`ckptfs mount` and `ckptfs umount`.

`mount` returns (with --background) or reports readiness only once a stat
through the mountpoint answers, so a script can use the mount on the next
line. The daemon records its pid under the data directory, so `umount` can
wait until it has published every open file and closed the volume.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import logging
import os
import subprocess
import sys
import time

from chunkstore.tier.status import pid_alive
from fusefs.cli.service import listen_arg
from fusefs.cli.units import parse_size
from fusefs.client.defaults import data_dir, ensure_default_volume

log = logging.getLogger("ckptfs.mount")

CONTROL_FLUSH = "user.ckptfs.flush"
READY_TIMEOUT = 60.0
EXIT_TIMEOUT = 300.0


class MountError(Exception):
    """A mount/umount problem the user can fix (printed as one line)."""


# -- mount table ---------------------------------------------------------------------
def _unescape(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_fstype(mountpoint: str) -> str | None:
    """The filesystem type mounted exactly at mountpoint (last one wins), if any."""
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts = left.split()
                if len(parts) >= 5 and _unescape(parts[4]) == mountpoint:
                    found = right.split()[0] if right else "?"
    except OSError:
        return None
    return found


def mount_state(mountpoint: str) -> str:
    """'none', 'mounted' or 'disconnected' (the daemon died; the kernel mount remains)."""
    try:
        os.stat(mountpoint)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            return "disconnected"
        if mount_fstype(mountpoint):
            return "disconnected"
        raise MountError(f"cannot access {mountpoint}: {e.strerror}") from None
    return "mounted" if mount_fstype(mountpoint) else "none"


def _pidfile(mountpoint: str) -> str:
    h = hashlib.sha1(mountpoint.encode()).hexdigest()[:16]
    return os.path.join(data_dir(), "run", f"mount-{h}.pid")


def default_log(mountpoint: str) -> str:
    """Where a --background daemon logs without --log: beside the pid files, under the
    user's data directory, one file per mountpoint (appended to by each mount there)."""
    h = hashlib.sha1(mountpoint.encode()).hexdigest()[:8]
    name = os.path.basename(mountpoint.rstrip("/")) or "root"
    return os.path.join(data_dir(), "log", f"mount-{name}-{h}.log")


def volume_key(spec: str) -> str:
    """A volume as mount records name it: a service URL as given, a directory absolute."""
    return spec if spec.startswith("ckptfs://") else os.path.abspath(spec)


def _read_record(path: str) -> dict | None:
    """A mount record (pid file): pid, mountpoint, and (since the daemon logs by default)
    its log file ('' in the foreground) and volume."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
        lines += [""] * (4 - len(lines))
        return {"pid": int(lines[0]), "mountpoint": lines[1], "log": lines[2], "volume": lines[3]}
    except (OSError, ValueError):
        return None


def _read_pid(mountpoint: str) -> int | None:
    rec = _read_record(_pidfile(mountpoint))
    return rec["pid"] if rec and rec["mountpoint"] == mountpoint else None


def mounts_of(spec: str) -> list[dict]:
    """This user's mounts of a volume on this host, from their records: pid, mountpoint,
    log, and whether the daemon is alive (`ckptfs status`)."""
    run = os.path.join(data_dir(), "run")
    try:
        names = sorted(os.listdir(run))
    except OSError:
        return []
    out = []
    key = volume_key(spec)
    for name in names:
        rec = _read_record(os.path.join(run, name)) if name.startswith("mount-") else None
        if rec and rec["volume"] == key:
            rec["live"] = pid_alive(rec["pid"])
            out.append(rec)
    return out


# -- mount -----------------------------------------------------------------------------
def _check_mountpoint(mp: str, nonempty: bool = False) -> None:
    state = "none" if not mount_fstype(mp) and not os.path.lexists(mp) else mount_state(mp)
    if state == "none" and not os.path.lexists(mp):
        raise MountError(f"mountpoint {mp} does not exist")
    if state == "disconnected":
        raise MountError(
            f"{mp} is a disconnected mount (its daemon died): run `ckptfs umount {mp}` first"
        )
    if state == "mounted":
        raise MountError(f"{mp} is already a mount point (busy)")
    if not os.path.isdir(mp):
        raise MountError(f"mountpoint {mp} is not a directory")
    if not nonempty:
        # The mount would hide these files until it is unmounted (as `mount` without
        # `-o nonempty` refuses); the user may mean another directory.
        try:
            with os.scandir(mp) as it:
                first = next(it, None)
        except OSError as e:
            raise MountError(f"cannot read mountpoint {mp}: {e.strerror}") from None
        if first is not None:
            raise MountError(
                f"mountpoint {mp} is not empty (e.g. {first.name!r}): the mount would hide "
                "its files; pick an empty directory, or pass --nonempty to mount over them"
            )


def attach_tier(vol, staging: str | None, staging_size: int | None, durability: str | None):
    """Put the host's write-behind tier in front of the nodes (durability local by default)."""
    return vol.attach_tier(staging, staging_size, durability or "local")


def _start_metrics(args: argparse.Namespace):
    """The --metrics endpoint, bound before anything is mounted: a taken port fails the
    mount at start, in one line. (server, collector) or (None, None)."""
    if not args.metrics:
        return None, None
    from fusefs.metrics import MetricsError, serve_mount_metrics

    try:
        server, collector = serve_mount_metrics(args.metrics)
    except MetricsError as e:
        raise MountError(f"{e} (--metrics)") from None
    log.info("metrics at %s", server.url)
    return server, collector


def _serve(
    args: argparse.Namespace, spec: str, mp: str, on_ready, logfile: str | None = None
) -> None:
    from fusefs.client.volume import Volume
    from fusefs.mount.fs import serve

    metrics, collector = _start_metrics(args)
    try:
        vol = Volume.open(spec)
        try:
            attach_tier(vol, args.staging, args.staging_size, args.durability)
            agent = None
            if args.agent:  # this host's ranks use the mount's client (fusefs/agent)
                from fusefs.agent.paths import socket_path
                from fusefs.agent.server import agent_for

                agent = agent_for(vol, spec, socket_path(spec), args.durability or "local")
            pidfile = _pidfile(mp)
            os.makedirs(os.path.dirname(pidfile), exist_ok=True)
            with open(pidfile, "w") as f:
                f.write(f"{os.getpid()}\n{mp}\n{logfile or ''}\n{volume_key(spec)}\n")
            try:
                serve(
                    vol,
                    mp,
                    allow_other=args.allow_other,
                    on_ready=on_ready,
                    on_start=collector.attach if collector is not None else None,
                    agent=agent,
                )
            finally:
                try:
                    os.unlink(pidfile)
                except OSError:
                    pass
        finally:
            vol.close()
    finally:
        if metrics is not None:
            metrics.close()


def cmd_mount(args: argparse.Namespace) -> int:
    mp = os.path.abspath(args.mountpoint)
    spec = args.volume
    if spec and not spec.startswith("ckptfs://"):  # the volume named first: the basic mistake
        from fusefs.client.volume import VOLUME_FILE

        if not os.path.exists(os.path.join(spec, VOLUME_FILE)):
            raise MountError(f"no volume at {spec} (run `ckptfs format {spec}` first)")
    _check_mountpoint(mp, args.nonempty)
    spec = spec or ensure_default_volume()  # made only once the mountpoint is fine
    if args.background:
        return _background(args, spec, mp, os.path.abspath(args.log or default_log(mp)))

    def ready() -> None:
        where = f"; metrics on {args.metrics[0]}:{args.metrics[1]}" if args.metrics else ""
        print(
            f"ckptfs: {spec} mounted at {mp} (Ctrl-C or `ckptfs umount {mp}` to unmount{where})",
            file=sys.stderr,
            flush=True,
        )

    _serve(args, spec, mp, ready)
    return 0


def _background(args: argparse.Namespace, spec: str, mp: str, logfile: str) -> int:
    """Fork a daemon logging to `logfile`; return once it reports the mount answering (or
    its error). A daemon that dies later leaves its last words there."""
    try:
        os.makedirs(os.path.dirname(logfile), exist_ok=True)
        os.close(os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    except OSError as e:
        raise MountError(f"cannot write the daemon log {logfile}: {e.strerror}") from None
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(rfd)
        code = 1
        try:
            os.setsid()
            _redirect(logfile)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            print(f"ckptfs mount: {stamp}: pid {os.getpid()}: {spec} at {mp}", flush=True)

            def ready() -> None:
                os.write(wfd, b"ok\n")

            _serve(args, spec, mp, ready, logfile)
            code = 0
        except BaseException as e:  # reported to the parent, never a traceback on its tty
            msg = str(e) or type(e).__name__
            log.exception("mount failed")
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            print(f"ckptfs mount: {stamp}: pid {os.getpid()} exited: {msg}", flush=True)
            try:
                os.write(wfd, f"error: {msg}\n".encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(wfd)
    deadline = time.monotonic() + READY_TIMEOUT
    buf = b""
    import select

    while time.monotonic() < deadline and not buf.endswith(b"\n"):
        r, _, _ = select.select([rfd], [], [], 0.5)
        if r:
            chunk = os.read(rfd, 4096)
            if not chunk:
                break
            buf += chunk
    os.close(rfd)
    text = buf.decode(errors="replace").strip()
    if text == "ok":
        print(f"ckptfs: {spec} mounted at {mp} (daemon pid {pid}, log {logfile})", file=sys.stderr)
        return 0
    if not text:
        text = f"the mount daemon exited or did not answer in time (log {logfile})"
    raise MountError(text.removeprefix("error: "))


def _redirect(logfile: str) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    out = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.StreamHandler):
            h.setStream(sys.stderr)


# -- umount ---------------------------------------------------------------------------
def cmd_umount(args: argparse.Namespace) -> int:
    mp = os.path.abspath(args.mountpoint)
    state = mount_state(mp)
    if state == "none":
        raise MountError(f"{mp} is not mounted")
    fstype = mount_fstype(mp) or ""
    if state == "mounted" and not fstype.startswith("fuse"):
        raise MountError(f"{mp} is a {fstype} mount, not ckptfs")
    pid = _read_pid(mp)
    rec = _read_record(_pidfile(mp)) if pid is not None else None
    logfile = rec["log"] if rec else ""
    # a kernel that still answers from its cache may not show ENOTCONN yet
    died = state == "disconnected" or (pid is not None and not pid_alive(pid))
    if args.flush and state == "mounted":
        try:
            os.setxattr(mp, CONTROL_FLUSH, b"1")
        except OSError as e:
            raise MountError(f"flush of {mp} failed: {e.strerror}") from None
    lazy = args.lazy or state == "disconnected"
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [mp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 and mount_fstype(mp):
        err = res.stderr.strip()
        if os.geteuid() == 0:  # fusermount3 may refuse a mount it does not know of
            res2 = subprocess.run(
                ["umount"] + (["-l"] if lazy else []) + [mp], capture_output=True, text=True
            )
            if res2.returncode == 0 or not mount_fstype(mp):
                err = ""
            else:
                err = res2.stderr.strip() or err
        if err:
            if "busy" in err.lower():
                raise MountError(
                    f"{mp} is busy (files open or a process inside): close them, or use --lazy"
                )
            raise MountError(f"cannot unmount {mp}: {err}")
    if pid is not None and state == "mounted":
        deadline = time.monotonic() + EXIT_TIMEOUT
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            raise MountError(f"unmounted {mp}, but daemon {pid} is still finishing")
    if died:
        where = f"; why it died may be in its log {logfile}" if logfile else ""
        print(f"ckptfs: cleaned up disconnected mount {mp} (its daemon died{where})",
              file=sys.stderr)  # fmt: skip
        try:
            os.unlink(_pidfile(mp))  # the dead daemon's record
        except OSError:
            pass
    else:
        where = f" (daemon log {logfile})" if logfile else ""
        print(f"ckptfs: unmounted {mp}{where}", file=sys.stderr)
    return 0


# -- registration --------------------------------------------------------------------
def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _run(fn):
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except MountError as e:
            print(f"ckptfs: error: {e}", file=sys.stderr)
            return 1

    return wrapped


def register(sub) -> None:
    m = sub.add_parser(
        "mount",
        help="mount a volume (default: the embedded default volume)",
        description="Mount VOLUME (a volume directory or ckptfs://HOST:PORT) at MOUNTPOINT. "
        "Without VOLUME, the embedded default volume under the user's data directory.",
    )
    m.add_argument("volume", nargs="?", default=None, metavar="VOLUME")
    m.add_argument("mountpoint", metavar="MOUNTPOINT")
    m.add_argument("--staging", metavar="DIR", help="write-behind staging directory (local NVMe)")
    m.add_argument("--staging-size", type=_size, metavar="SIZE", help="staging budget, e.g. 64GiB")
    m.add_argument(
        "--durability",
        choices=["local", "remote"],
        default=None,
        help="acknowledge fsync once staged locally, or once on the object nodes",
    )
    m.add_argument("--background", "-b", action="store_true", help="daemonize once mounted")
    m.add_argument("--allow-other", action="store_true", help="let other users in (modes apply)")
    m.add_argument(
        "--nonempty",
        action="store_true",
        help="mount over a directory that has files (hidden until unmount; refused otherwise)",
    )
    m.add_argument(
        "--log",
        metavar="FILE",
        help="daemon log file with --background (default: under the data directory, "
        "~/.local/share/ckptfs/log/mount-NAME-HASH.log; printed at mount)",
    )
    m.add_argument(
        "--metrics",
        type=listen_arg,
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics",
    )
    m.add_argument(
        "--agent",
        action="store_true",
        help="also serve this host's ranks as their ckptfs agent (see `ckptfs agent`)",
    )
    m.set_defaults(func=_run(cmd_mount))

    u = sub.add_parser("umount", help="unmount (also cleans up a mount whose daemon died)")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.add_argument("--flush", action="store_true", help="wait until staged data is on the nodes")
    u.add_argument("--lazy", "-l", action="store_true", help="detach now even if busy")
    u.set_defaults(func=_run(cmd_umount))
