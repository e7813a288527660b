"""A throwaway PostgreSQL cluster: for `ckptfs bench --db postgres`, benchmarks and tests.

initdb + pg_ctl from the system's PostgreSQL (Debian's postgresql package), in a temporary
directory removed by `stop()`. As root the cluster runs as the `postgres` user (PostgreSQL
refuses to run as root). It listens on one address (127.0.0.1 by default, or a network
namespace's address) with trust authentication from that address's network only: it holds
nothing but throwaway test data, and nobody outside the machine can reach it.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence

from bench.servers import ServerError, free_port
from fusefs.cli.pg import pg_bin

PG_BIN = pg_bin() or "/usr/lib/postgresql/15/bin"  # where initdb and pg_ctl are (fusefs.cli.pg)


def pg_available() -> str | None:
    """None if a cluster can be started here, else the reason it cannot (one line)."""
    if not os.path.exists(os.path.join(PG_BIN, "initdb")):
        return f"PostgreSQL binaries not found in {PG_BIN} (run scripts/install-system.sh)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "no 'postgres' system user to run the cluster as"
    return None


class PgCluster:
    """initdb + pg_ctl start in a temp dir; `url(db)` for connections; stop() removes it.

    `host`/`port`: where it listens (default 127.0.0.1 and a free port); `prefix` runs the
    server elsewhere (`ip netns exec NS`); `parent`: where its directory goes (the postgres
    user must be able to reach it; default the system's temp dir); `restart()` stops and
    starts the same cluster."""

    def __init__(
        self,
        *,
        fsync: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
        prefix: Sequence[str] = (),
        parent: str | None = None,
        tag: str = "",
    ) -> None:
        reason = pg_available()
        if reason:
            raise ServerError(reason)
        self.host = host
        self.port = port or free_port(host)
        self.prefix = list(prefix)
        self.fsync = fsync
        # `tag` names the owner in the directory (and so in the server's command line)
        self.dir = tempfile.mkdtemp(prefix=f"ckptfs-pg-{tag + '-' if tag else ''}", dir=parent)
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "log")
        self._n = itertools.count()
        self._as_root = os.geteuid() == 0
        self.server_pid: int | None = None  # the postmaster's, once started
        self.closed = False  # stop(): never started again (a restart racing a teardown)
        self._lock = threading.Lock()
        try:
            if self._as_root:
                pw = pwd.getpwnam("postgres")
                os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            os.chmod(self.dir, 0o700)
            self._pg(
                [f"{PG_BIN}/initdb", "-D", self.data, "-A", "trust", "-U", "postgres",
                 "-E", "UTF8", "--no-sync"]
            )  # fmt: skip
            if host not in ("127.0.0.1", "localhost"):
                net = ipaddress.ip_network(f"{host}/16", strict=False)
                with open(os.path.join(self.data, "pg_hba.conf"), "a") as f:
                    f.write(f"host all all {net} trust\n")
            self.start()
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _pg(self, cmd: list[str], timeout: float = 120.0) -> None:
        runas = ["runuser", "-u", "postgres", "--"] if self._as_root else []
        try:
            subprocess.run(
                [*self.prefix, *runas, *cmd],
                check=True,
                capture_output=True,
                timeout=timeout,
                cwd=self.dir,
            )
        except subprocess.CalledProcessError as e:
            err = (e.stderr or b"").decode(errors="replace").strip().splitlines()
            why = err[-1] if err else f"exit {e.returncode}"
            name = os.path.basename(cmd[0])
            raise ServerError(f"{name} failed: {why} (log {self.log})") from None
        except subprocess.TimeoutExpired:
            raise ServerError(f"{os.path.basename(cmd[0])} timed out (log {self.log})") from None

    def start(self) -> None:
        with self._lock:
            if self.closed:
                raise ServerError("PostgreSQL: stopped for good (the run is being torn down)")
        opts = (
            f"-p {self.port} -k {self.dir} -c listen_addresses={self.host} "
            f"-c max_connections=200 -c fsync={'on' if self.fsync else 'off'} "
            "-c shared_buffers=128MB"
        )
        self._pg(
            [f"{PG_BIN}/pg_ctl", "-D", self.data, "-o", opts, "-l", self.log,
             "-w", "-t", "60", "start"]
        )  # fmt: skip
        self.server_pid = self._read_pid()

    def _read_pid(self) -> int | None:
        """The postmaster's pid, from its lock file (None if there is none)."""
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                return int(f.readline().strip())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        """Is the postmaster started last still running? (It is not a child of this
        process: pg_ctl starts it in the background, so /proc is asked.)"""
        return self._is_postmaster(self.server_pid)

    def _is_postmaster(self, pid: int | None) -> bool:
        """Is `pid` a live process running this cluster's data directory?"""
        if pid is None:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X") and self.data.encode() in cmd

    def stop_server(self, mode: str = "fast", timeout: float = 120.0) -> None:
        """Stop the server, keep the data (`fast`: a clean shutdown that disconnects every
        client, as maintenance does; `immediate`: a crash)."""
        self._pg([f"{PG_BIN}/pg_ctl", "-D", self.data, "-m", mode, "-w", "stop"], timeout)

    def restart(self, mode: str = "fast") -> None:
        self.stop_server(mode)
        self.start()

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{db}"

    def create_db(self) -> str:
        import psycopg

        name = f"t{os.getpid()}_{next(self._n)}"
        with psycopg.connect(self.url(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def drop_db(self, url: str) -> None:
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def ready(self) -> bool:
        """Does it answer a query now?"""
        import psycopg

        try:
            with psycopg.connect(self.url(), autocommit=True, connect_timeout=2) as c:
                c.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def stop(self, timeout: float = 120.0) -> None:
        """Stop the server for good (a start racing this one fails) and remove the
        cluster. Past `timeout` for pg_ctl, the postmaster is SIGKILLed."""
        with self._lock:
            self.closed = True
        try:
            if os.path.exists(os.path.join(self.data, "postmaster.pid")):
                self.stop_server("immediate", timeout)
        finally:
            for pid in {self.server_pid, self._read_pid()}:
                if pid is not None and self._is_postmaster(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            shutil.rmtree(self.dir, ignore_errors=True)
