"""Where the harness runs: an embedded throwaway volume, or an existing volume / service.

--embedded: a temporary directory with a volume (local directory nodes, or one SeaweedFS
server per node when --nodes s3), its `ckptfs meta serve` on 127.0.0.1, per-host staging
directories. Everything is removed at stop(). Attaching: VOLUME is a volume directory (a
`meta serve` is started on it, so the group commit is what gets measured) or a running
service's ckptfs:// URL; only staging directories are temporary then.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

from bench.harness_config import HarnessConfig, HarnessError
from bench.servers import ServerError
from bench.servers.metaserve import MetaServer
from bench.servers.seaweed import WeedServer


class Env:
    def __init__(self, cfg: HarnessConfig, chunk: int) -> None:
        self.cfg = cfg
        self.chunk = chunk
        self.root = tempfile.mkdtemp(prefix="ckptfs-bench-", dir=cfg.workdir)
        self.staging_root = os.path.join(self.root, "staging")
        self.fault_dir = os.path.join(self.root, "faults")
        self.url = ""
        self.server: MetaServer | None = None
        self.weeds: list = []
        self.node_dirs: list[str] = []
        self.killed: str | None = None
        os.makedirs(self.staging_root)
        os.makedirs(self.fault_dir)

    def _check_space(self, path: str) -> None:
        c = self.cfg
        need = c.steps * c.ranks * c.shard_size * (2 + c.replicas)
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
        if need > 0.9 * free:
            raise HarnessError(
                f"this run may need {need / 2**30:.1f} GiB of disk under {path}, "
                f"{free / 2**30:.1f} GiB free: fewer ranks, steps or a smaller --shard-size"
            )

    def start(self, say: Callable[[str], None]) -> None:
        c = self.cfg
        self._check_space(self.root)
        if c.volume is not None and c.volume.startswith("ckptfs://"):
            self.url = c.volume
            return
        if c.volume is not None:
            from fusefs.volume import VOLUME_FILE

            vol_dir = os.path.abspath(c.volume)
            if not os.path.exists(os.path.join(vol_dir, VOLUME_FILE)):
                raise HarnessError(
                    f"no volume at {c.volume} (run `ckptfs format {c.volume}` first)"
                )
        else:
            from fusefs.volume import Volume, VolumeSettings

            vol_dir = os.path.join(self.root, "vol")
            if c.nodes == "s3":
                urls = self._start_weeds(say)
            else:
                urls = [f"dir:nodes/n{i}" for i in range(c.node_count)]
            settings = VolumeSettings(chunk_size=self.chunk, replicas=c.replicas)
            try:
                Volume.create(vol_dir, nodes=urls, settings=settings).close()
            except Exception as e:
                raise HarnessError(f"cannot create the benchmark volume: {e}") from e
            if c.nodes == "dir":
                self.node_dirs = [
                    os.path.join(vol_dir, "nodes", f"n{i}") for i in range(c.node_count)
                ]
        log = os.path.join(self.root, "meta.log")
        try:
            self.server = MetaServer(vol_dir, log_path=log)
        except ServerError as e:
            raise HarnessError(f"ckptfs meta serve did not start: {e} (log {log})") from None
        self.url = self.server.url

    def _start_weeds(self, say: Callable[[str], None]) -> list[str]:
        say(f"starting {self.cfg.node_count} SeaweedFS servers on 127.0.0.1 ...")
        for i in range(self.cfg.node_count):
            d = os.path.join(self.root, f"weed{i}")
            os.makedirs(d)
            self.weeds.append(WeedServer(d, os.path.join(self.root, f"weed{i}.log")))
        try:
            for w in self.weeds:
                w.start()
            for w in self.weeds:
                w.wait_ready()
        except RuntimeError as e:
            raise HarnessError(f"SeaweedFS did not start: {e}") from e
        return [f"s3://bench-n{i}/ck?endpoint={w.endpoint}" for i, w in enumerate(self.weeds)]

    def kill_node(self) -> None:
        """Node n0 dies: its SeaweedFS server is SIGKILLed, or its directory becomes a file."""
        if self.weeds:
            self.weeds[0].kill()
        elif self.node_dirs:
            d = self.node_dirs[0]
            os.rename(d, d + ".dead")
            with open(d, "w") as f:  # every path under the node now fails with ENOTDIR
                f.write("this node was killed by ckptfs bench --kill-node\n")
        self.killed = "n0"

    def slow_node(self) -> None:
        with open(os.path.join(self.fault_dir, "slow-n0"), "w") as f:
            f.write(f"{self.cfg.slow_node_delay}\n")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        for w in self.weeds:
            try:
                w.kill()
            except Exception:  # noqa: S110 - best effort; the directory goes next
                pass
        self.weeds = []
        shutil.rmtree(self.root, ignore_errors=True)
