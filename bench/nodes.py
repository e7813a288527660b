"""Chunk store over 3 SeaweedFS nodes (R=2) vs plain boto3 4 MiB objects, same run.

Prints one JSON object: put/get MB/s of both, the ratios (`put_vs_plain_s3`,
target >= 0.4, since R=2 sends every byte twice; `get_vs_plain_s3`, >= 1.0)
and the scrub rate. The baseline uses the same thread count as the volume's
pool (8), so the ratio measures the chunk store, not the parallelism.

    python -m bench.nodes            # 1 GiB
    CKPTFS_BENCH_MIB=256 python -m bench.nodes
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
import numpy as np
from botocore.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.servers.seaweed import SeaweedCluster, WeedServer  # noqa: E402
from fusefs.client.volume import FileReader, Volume, VolumeSettings  # noqa: E402
from fusefs.maint.scrub import scrub  # noqa: E402

BLOCK = 4 * 2**20
THREADS = 8


def blocks(total: int) -> list[bytes]:
    return [np.random.default_rng(i).bytes(BLOCK) for i in range(total // BLOCK)]


def plain_s3(endpoint: str, data: list[bytes]) -> tuple[float, float]:
    c = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="any",
        aws_secret_access_key="any",
        region_name="us-east-1",
        config=Config(
            max_pool_connections=32,
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )
    c.create_bucket(Bucket="plain-baseline")
    c.put_object(Bucket="plain-baseline", Key="warm", Body=b"x")  # volume allocation
    with ThreadPoolExecutor(THREADS) as ex:
        t0 = time.perf_counter()
        list(
            ex.map(
                lambda i: c.put_object(Bucket="plain-baseline", Key=f"o/{i}", Body=data[i]),
                range(len(data)),
            )
        )
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = list(
            ex.map(
                lambda i: c.get_object(Bucket="plain-baseline", Key=f"o/{i}")["Body"].read(),
                range(len(data)),
            )
        )
        get_s = time.perf_counter() - t0
    assert got == data
    return put_s, get_s


def main() -> None:
    total = int(os.environ.get("CKPTFS_BENCH_MIB", "1024")) * 2**20
    data = blocks(total)
    nbytes = len(data) * BLOCK
    tmp = tempfile.mkdtemp(prefix="ckptfs-bench-nodes-")
    servers = [WeedServer(f"{tmp}/s{i}", f"{tmp}/s{i}.log") for i in range(3)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        cluster = SeaweedCluster(servers)
        plain_put, plain_get = plain_s3(servers[0].endpoint, data)
        vol = Volume.create(
            f"{tmp}/vol",
            nodes=cluster.urls(3),
            settings=VolumeSettings(replicas=2, compression="none"),
        )
        with vol:
            vol.write_file("/warm", os.urandom(3 * BLOCK))  # first write allocates volumes
            t0 = time.perf_counter()
            with vol.open_write("/big") as w:
                for b in data:
                    w.write(b)
            put_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            ra = int(os.environ.get("CKPTFS_BENCH_READAHEAD", "0"))
            reader = (
                FileReader(vol, vol.resolve("/big"), readahead=ra) if ra else vol.open_read("/big")
            )
            with reader as r:
                for i, b in enumerate(data):
                    if r.pread(i * BLOCK, BLOCK) != b:
                        raise SystemExit(f"bench: block {i} read back wrong")
            get_s = time.perf_counter() - t0
            rep = scrub(vol, progress=False)
            if rep.problems:
                raise SystemExit(f"bench: scrub found {len(rep.problems)} problems")
            scrub_mbps = rep.bytes_read / 1e6 / rep.seconds
    finally:
        for s in servers:
            s.kill()
    mb = nbytes / 1e6
    print(
        json.dumps(
            {
                "bytes": nbytes,
                "replicas": 2,
                "nodes": 3,
                "threads": THREADS,
                "plain_s3_put_mbps": round(mb / plain_put, 1),
                "plain_s3_get_mbps": round(mb / plain_get, 1),
                "store_put_mbps": round(mb / put_s, 1),
                "store_get_mbps": round(mb / get_s, 1),
                "put_vs_plain_s3": round(plain_put / put_s, 3),
                "get_vs_plain_s3": round(plain_get / get_s, 3),
                "scrub_mbps": round(scrub_mbps, 1),
                "scrub_replicas_read": rep.replicas_read,
            }
        )
    )


if __name__ == "__main__":
    main()
