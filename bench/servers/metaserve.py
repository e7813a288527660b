"""`ckptfs meta serve` as a child process: started, killed, restarted on the same port.

The harness, the benchmarks and the tests start metadata service replicas through this one
launcher. A replica can live in a network namespace (`prefix`) on that namespace's address.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from bench.servers import ServerError, child_env, first_line, tail

START_TIMEOUT = 60.0
# A replica on PostgreSQL waits this long for its database at start (meta serve --db-wait),
# less than START_TIMEOUT: past it the replica itself says, in one line, why it did not start.
DB_WAIT = START_TIMEOUT - 15.0
RESTART_FOR = 10.0  # how long a restart retries a port that lingers after the kill


class MetaServer:
    """One service process; `restart()` comes back on the same port.

    `db`: a postgresql:// URL (default: the volume's own engine); `tls`: (certificate, key)
    to serve TLS with, which clients then trust; `log_path`: where its stderr goes (default:
    a temporary file, removed by stop()); `args`: more options of `meta serve`."""

    def __init__(
        self,
        volume: str,
        *,
        db: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: tuple[str, str] | None = None,
        prefix: Sequence[str] = (),
        log_path: str | None = None,
        start: bool = True,
        args: Sequence[str] = (),
    ) -> None:
        self.volume = str(volume)
        self.db = db
        self.host = host
        self.port = port
        self.tls = tls
        self.prefix = list(prefix)
        self.args = list(args)  # more `meta serve` options
        self.token_file = os.path.join(self.volume, "meta.token")
        self._own_log = log_path is None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="ckptfs-meta-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.closed = False  # close(): never started again (a restart racing a teardown)
        self._lock = threading.Lock()
        if start:
            self.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        ca = f"&ca={self.tls[0]}" if self.tls else ""
        return f"ckptfs://{self.address}?token_file={self.token_file}{ca}"

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start and wait for its "serving ... on HOST:PORT" line (which gives the port)."""
        cmd = [*self.prefix, sys.executable, "-m", "fusefs.cli", "meta", "serve", self.volume,
               "--listen", f"{self.host}:{self.port}"]  # fmt: skip
        if self.db:
            cmd += ["--db", self.db, "--db-wait", f"{DB_WAIT:g}"]
        if self.tls:
            cmd += ["--tls-cert", self.tls[0], "--tls-key", self.tls[1]]
        cmd += self.args
        with self._lock, open(self.log_path, "ab") as log:
            if self.closed:
                raise ServerError("meta serve: closed (the run is being torn down)")
            self.proc = subprocess.Popen(
                cmd, env=child_env(), stdout=subprocess.PIPE, stderr=log, start_new_session=True
            )
        line = first_line(self.proc, timeout)
        text = line.decode(errors="replace")
        if "serving" not in text:  # "ckptfs meta: serving VOL on HOST:PORT ..."
            self.kill()
            why = (text.strip() + " " + tail(self.log_path)).strip() or "no output"
            raise ServerError(f"meta serve failed: {why}")
        self.port = int(text.split(" on ")[1].split()[0].rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_status(self) -> int | None:
        """The exit status of the process last started (negative: the signal that ended
        it), or None while it runs or before it was started."""
        return self.proc.poll() if self.proc is not None else None

    def terminate(self) -> None:
        """Ask it to end (SIGTERM, and SIGCONT should it be stopped); returns at once."""
        with self._lock:
            proc = self.proc
        if proc is not None and proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def close(self, grace: float = 10.0) -> None:
        """Stop for good: SIGTERM, SIGKILL after `grace` seconds; a start() racing this
        one (a fault restarting the replica) fails instead of starting a process."""
        with self._lock:
            self.closed = True
        self.terminate()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.stop()

    def kill(self) -> None:
        """SIGKILL: no cleanup, the crash a service must survive."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
            if self.proc.stdout:
                self.proc.stdout.close()

    def restart(self) -> None:
        """Kill and start again on the same port. Only a port still in use after the kill
        is retried (for RESTART_FOR seconds); any other failure is the answer."""
        self.kill()
        end = time.monotonic() + RESTART_FOR
        while True:
            try:
                self.start()
                return
            except ServerError as e:
                if "in use" not in str(e) or time.monotonic() >= end:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        if self._own_log:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass


def self_signed(
    directory: str, name: str = "service", address: str = "127.0.0.1"
) -> tuple[str, str]:
    """A certificate for `address` and its key, made by the openssl CLI
    (scripts/install-system.sh installs it); also the CA clients trust."""
    cert, key = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN=ckptfs-{name}",
         "-addext", f"subjectAltName=IP:{address}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
