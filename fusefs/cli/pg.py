"""`ckptfs meta postgres DIR`: a private PostgreSQL cluster for a volume's metadata, on one
machine, with no database administration.

Replicas (`ckptfs meta serve` several times) need PostgreSQL. On a fresh machine this makes
one: `initdb` in DIR (as the `postgres` system user when run as root: PostgreSQL refuses to
run as root), `pg_ctl start` if it is not running, a `ckptfs` database, and the URL on
standard output (messages go to standard error), so that

    ckptfs format /data/vol --db "$(ckptfs meta postgres /var/tmp/ckptfs-pg)"

works as written. Run again, it starts the cluster if it stopped (after a reboot) and prints
the same URL; `--stop` stops it. The server listens on 127.0.0.1 only, with trust
authentication from there: every local user can connect, nobody else can. That is meant for
one machine (tests, a workstation, trying replicas out); a shared deployment uses a managed
PostgreSQL with passwords or certificates.
"""

from __future__ import annotations

import argparse
import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys

CONF = "ckptfs.conf"  # what we chose at initdb: the port (read back at every start)
DB_NAME = "ckptfs"


class PgError(Exception):
    """A problem the user can fix, printed as one line."""


def pg_bin() -> str | None:
    """The directory of the system's initdb/pg_ctl (Debian keeps them out of PATH)."""
    if os.environ.get("CKPTFS_PG_BIN"):
        return os.environ["CKPTFS_PG_BIN"]
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0,
    )
    if found:
        return os.path.dirname(found[-1])
    which = shutil.which("initdb")
    return os.path.dirname(which) if which else None


def _free_port() -> int:
    for port in range(5433, 5533):  # the first free one above the system cluster's 5432
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise PgError("no free port in 5433..5532 on 127.0.0.1 (use --port)")


class Cluster:
    def __init__(self, path: str) -> None:
        self.dir = os.path.abspath(path)
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "postgresql.log")
        bindir = pg_bin()
        if not bindir or not os.path.exists(os.path.join(bindir, "initdb")):
            raise PgError(
                "PostgreSQL is not installed (no initdb): apt-get install postgresql, "
                "or set CKPTFS_PG_BIN to the directory of initdb and pg_ctl"
            )
        self.bin = bindir
        self.runas: list[str] = []
        if os.geteuid() == 0:
            try:
                self.owner = pwd.getpwnam("postgres")
            except KeyError:
                raise PgError(
                    "PostgreSQL does not run as root and there is no 'postgres' user to run "
                    "it as: run this as an ordinary user"
                ) from None
            self.runas = ["runuser", "-u", "postgres", "--"]

    # -- state ----------------------------------------------------------------------------
    def initialized(self) -> bool:
        return os.path.exists(os.path.join(self.data, "PG_VERSION"))

    def port(self) -> int:
        try:
            with open(os.path.join(self.dir, CONF)) as f:
                return int(f.read().split("=", 1)[1])
        except (OSError, ValueError, IndexError):
            raise PgError(f"{self.dir} holds no cluster made by `ckptfs meta postgres`") from None

    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port()}/{DB_NAME}"

    def running(self) -> bool:
        res = subprocess.run(
            [*self.runas, f"{self.bin}/pg_ctl", "-D", self.data, "status"],
            capture_output=True,
            text=True,
        )
        return res.returncode == 0

    # -- actions --------------------------------------------------------------------------
    def _run(self, cmd: list[str], what: str, timeout: float = 120) -> None:
        try:
            res = subprocess.run(
                [*self.runas, *cmd], capture_output=True, text=True, timeout=timeout, cwd="/"
            )
        except subprocess.TimeoutExpired:
            raise PgError(f"{what} timed out (log {self.log})") from None
        if res.returncode != 0:
            lines = (res.stderr or res.stdout).strip().splitlines()
            why = lines[-1] if lines else f"exit status {res.returncode}"
            raise PgError(f"{what} failed: {why} (log {self.log})")

    def init(self, port: int | None) -> None:
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise PgError(f"{self.dir} exists and is not a directory")
        if os.path.isdir(self.dir) and os.listdir(self.dir):
            raise PgError(
                f"{self.dir} is not empty and holds no cluster made by `ckptfs meta postgres`: "
                "pick a new or empty directory"
            )
        port = port or _free_port()
        made = not os.path.exists(self.dir)
        os.makedirs(self.dir, exist_ok=True)
        try:
            os.chmod(self.dir, 0o700)
            if self.runas:
                os.chown(self.dir, self.owner.pw_uid, self.owner.pw_gid)
                self._check_reachable()
            self._run(
                [f"{self.bin}/initdb", "-D", self.data, "-A", "trust", "-U", "postgres",
                 "-E", "UTF8"],
                "initdb",
            )  # fmt: skip
            with open(os.path.join(self.data, "postgresql.auto.conf"), "a") as f:
                f.write(
                    f"port = {port}\nlisten_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = '{self.dir}'\nmax_connections = 200\n"
                )
            with open(os.path.join(self.dir, CONF), "w") as f:
                f.write(f"port={port}\n")
            if self.runas:
                os.chown(os.path.join(self.dir, CONF), self.owner.pw_uid, self.owner.pw_gid)
        except BaseException:
            if made:
                shutil.rmtree(self.dir, ignore_errors=True)
            else:
                for name in os.listdir(self.dir):
                    p = os.path.join(self.dir, name)
                    shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)
            raise

    def _check_reachable(self) -> None:
        res = subprocess.run([*self.runas, "test", "-w", self.dir], capture_output=True)
        if res.returncode != 0:
            raise PgError(
                f"the 'postgres' user cannot reach {self.dir} (a parent directory is closed "
                "to it): pick a directory such as /var/tmp/ckptfs-pg"
            )

    def start(self) -> None:
        self._run(
            [f"{self.bin}/pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "60", "start"],
            "starting PostgreSQL",
        )

    def stop(self) -> None:
        self._run([f"{self.bin}/pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop"], "stop")

    def ensure_db(self) -> None:
        from metadata.engine import MetaError
        from metadata.engines.postgres import ensure_database

        try:
            ensure_database(f"postgresql://postgres@127.0.0.1:{self.port()}/postgres", DB_NAME)
        except MetaError as e:
            raise PgError(str(e)) from None


def cmd_postgres(args: argparse.Namespace) -> int:
    try:
        return _postgres(args)
    except PgError as e:
        print(f"ckptfs: error: {e}", file=sys.stderr)
        return 1


def _postgres(args: argparse.Namespace) -> int:
    c = Cluster(args.dir)
    if args.stop:
        if not c.initialized():
            raise PgError(f"{c.dir} holds no cluster made by `ckptfs meta postgres`")
        if c.running():
            c.stop()
            print(f"ckptfs: stopped PostgreSQL in {c.dir}", file=sys.stderr)
        else:
            print(f"ckptfs: PostgreSQL in {c.dir} is not running", file=sys.stderr)
        return 0
    if not c.initialized():
        if args.port is not None and not 1 <= args.port <= 65535:
            raise PgError(f"--port must be 1..65535, not {args.port}")
        c.init(args.port)
        print(f"ckptfs: made a PostgreSQL cluster in {c.dir}", file=sys.stderr)
    elif args.port is not None and args.port != c.port():
        raise PgError(f"the cluster in {c.dir} listens on port {c.port()}, not {args.port}")
    if not c.running():
        c.start()
        print(
            f"ckptfs: PostgreSQL running on 127.0.0.1:{c.port()} (log {c.log}; "
            f"stop: ckptfs meta postgres {c.dir} --stop)",
            file=sys.stderr,
        )
    c.ensure_db()
    print(c.url())
    return 0


def register(msub: argparse._SubParsersAction) -> None:
    p = msub.add_parser(
        "postgres",
        help="make and start a private PostgreSQL for volume metadata; print its URL",
        description="Make a PostgreSQL cluster in DIR (initdb) if there is none, start it if "
        "it is not running, create the 'ckptfs' database, and print its postgresql:// URL "
        "(for `ckptfs format VOL --db URL`). It listens on 127.0.0.1 only, trusting local "
        "users: for one machine. As root it runs as the 'postgres' user.",
    )
    p.add_argument("dir", metavar="DIR", help="the cluster's directory (made if missing)")
    p.add_argument("--port", type=int, default=None, help="at creation (default: free, 5433+)")
    p.add_argument("--stop", action="store_true", help="stop the cluster (the data stays)")
    p.set_defaults(func=cmd_postgres)
