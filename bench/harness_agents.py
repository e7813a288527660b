"""The simulated hosts' agents: one `ckptfs agent` process per host, started by the
coordinator beside the service (bench.harness_env), watched like the other servers of the
fleet (bench.harness_watch), restarted for a resume and stopped at teardown.

Each agent serves its host's volume on a socket of its own (--socket, under the run's
directory) and runs the host's write-behind tier in the host's staging directory; the
worker processes' ranks connect to it (bench.harness_ranks). On --topology netns it runs
inside its host's network namespace, as the host's worker process does: its connections
to the service replicas and the S3 nodes are the host's, and a partition of the host cuts
them too (a path-named Unix socket is reachable from any network namespace). A resume
restarts every agent (SIGTERM: the agent stops accepting and exits; the next one's tier
adopts the journal it left) before the resume's clock starts: on a real host the agent
outlives the job, and what a restart of the job costs is the ranks' reconnects and reads.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from bench.servers import ServerError, child_env, first_line, tail

START_TIMEOUT = 60.0
STOP_GRACE = 10.0


class AgentProc:
    """One host's `ckptfs agent` process."""

    def __init__(
        self,
        index: int,
        url: str,
        sock: str,
        staging: str,
        staging_size: int,
        durability: str,
        log_path: str,
        prefix: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.index = index
        self.prefix = list(prefix)  # runs it inside its host's network namespace (netns)
        self.name = f"a{index}"
        self.url = url
        self.socket = sock
        self.staging = staging
        self.staging_size = staging_size
        self.durability = durability
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        """Start the process (spawn, then `wait_serving`: many start side by side)."""
        cmd = [*self.prefix, sys.executable, "-m", "fusefs.cli", "agent", self.url,
               "--socket", self.socket, "--staging", self.staging,
               "--staging-size", str(self.staging_size),
               "--durability", self.durability]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=child_env(), stdout=subprocess.PIPE, stderr=log, start_new_session=True
            )

    def wait_serving(self, timeout: float = START_TIMEOUT) -> None:
        """Wait for its "serving ... on SOCKET" line; ServerError (with its log) if none."""
        assert self.proc is not None and self.proc.stdout is not None
        line = first_line(self.proc, timeout)
        if b"serving" not in line:
            self.kill()
            why = (line.decode(errors="replace").strip() + " " + tail(self.log_path)).strip()
            raise ServerError(f"ckptfs agent {self.name} did not start: {why or 'no output'}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_status(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                try:
                    self.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def wait(self, grace: float = STOP_GRACE) -> None:
        """Wait for the exit a terminate() asked for; SIGKILL after `grace` seconds."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def stats(self, token: str) -> dict:
        """The agent's counters (agent_stats: ranks served, its service connections, the
        grouped requests), asked on a connection of our own."""
        from metadata.client import RemoteEngine

        eng = RemoteEngine([(self.socket, 0)], token, retry_for=0)
        try:
            return eng.call("agent_stats")
        finally:
            eng.close()


def start_all(agents: list[AgentProc], token: str) -> None:
    """Start every agent side by side and wait until each serves; on failure, stop all.

    Each is then asked once with the ranks' token, as a host's agent that has served the
    job's ranks before has verified it: an agent verifies a token with the service at its
    first hello and trusts it for a minute (fusefs/agent/server.py TOKEN_TTL), but every
    hello that arrives before the first verification ends pings the service itself (256
    ranks reconnecting at once to a fresh agent: 256 pings)."""
    try:
        for a in agents:
            a.spawn()
        for a in agents:
            a.wait_serving()
        for a in agents:
            a.stats(token)
    except BaseException:
        stop_all(agents, grace=2.0)
        raise


def stop_all(agents: list[AgentProc], grace: float = STOP_GRACE) -> None:
    """Ask all to stop at once, then wait for each (SIGKILL past `grace`)."""
    for a in agents:
        a.terminate()
    end = time.monotonic() + grace
    for a in agents:
        a.wait(max(0.1, end - time.monotonic()))


def summary(agents: list[AgentProc], token: str) -> dict:
    """What the agents say they did, summed (errors listed, not raised: a finding)."""
    keys = ("ranks_served", "requests", "upstream_connections", "commit_groups",
            "commits_grouped", "commits_single", "manifest_groups", "manifests_grouped",
            "missing_groups", "missing_merged", "uploader_threads",
            "failovers", "reconnects", "hangs")  # fmt: skip
    out: dict = {"agents": len(agents), **dict.fromkeys(keys, 0), "errors": []}
    for a in agents:
        try:
            st = a.stats(token)
        except Exception as e:  # noqa: BLE001 - reported
            out["errors"].append(f"{a.name}: {e}")
            continue
        for k in keys:
            out[k] += int(st.get(k, 0) or 0)
    return out
