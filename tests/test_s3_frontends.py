"""The mount and the DCP backend on S3 object nodes (three real SeaweedFS servers, R=2).

The engine round trip on S3 is in test_s3.py; here the two frontends run their
round trips unchanged against a volume whose every node is an S3 bucket.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess

import pytest

from fusefs.client.volume import Volume, VolumeSettings
from metadata.engine import INLINE
from tests.fixtures.mount import run_cli
from tests.test_dcp import CHUNK, assert_checks, launch

KiB = 1024


def _s3_volume(path: str, seaweed, **settings) -> str:
    settings.setdefault("chunk_size", CHUNK)
    settings.setdefault("replicas", 2)
    Volume.create(path, nodes=seaweed.urls(3), settings=VolumeSettings(**settings)).close()
    return path


@pytest.fixture
def s3_volume(tmp_path, seaweed, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))  # staging stays in tmp
    return _s3_volume(str(tmp_path / "vol"), seaweed)


def _tree(root: str) -> None:
    """A small tree with files around the chunk size, a hole and an empty file."""
    os.makedirs(os.path.join(root, "a", "b"))
    for i, size in enumerate([0, 1, CHUNK - 1, CHUNK, 3 * CHUNK + 7, 700 * KiB]):
        with open(os.path.join(root, "a" if i % 2 else "a/b", f"f{i}.bin"), "wb") as f:
            f.write(os.urandom(size))
    with open(os.path.join(root, "sparse.bin"), "wb") as f:
        f.seek(5 * CHUNK)
        f.write(b"tail")


def _same_tree(a: str, b: str) -> None:
    cmp = filecmp.dircmp(a, b)
    assert not cmp.left_only and not cmp.right_only and not cmp.funny_files
    for name in cmp.common_files:
        assert filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False), name
    for sub in cmp.common_dirs:
        _same_tree(os.path.join(a, sub), os.path.join(b, sub))


def test_mount_round_trip_on_s3_nodes(tmp_path, s3_volume, mount_factory, mount_env):
    src = str(tmp_path / "src")
    _tree(src)
    m = mount_factory(s3_volume, "mnt", "--durability", "remote")
    shutil.copytree(src, os.path.join(m.mp, "tree"))
    _same_tree(src, os.path.join(m.mp, "tree"))
    subprocess.run(["fusermount3", "-u", m.mp], check=True, timeout=60)
    m.proc.wait(timeout=60)
    # a fresh mount reads everything back from the S3 nodes
    m2 = mount_factory(s3_volume, "mnt2")
    _same_tree(src, os.path.join(m2.mp, "tree"))
    with Volume.open(s3_volume) as vol:
        objects = sum(len(list(n.list())) for n in vol.store.nodes)
        inline = sum(r.state == INLINE for r in vol.meta.chunk_rows().values())
        assert inline == 3  # the 1-byte file, the 7-byte tail, the sparse file's "tail"
        # R=2 on the S3 nodes for the others
        assert objects == 2 * (vol.stats()["unique_chunks"] - inline)
    out = run_cli("fsck", s3_volume, "--json", env=mount_env)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dcp_round_trip_on_s3_nodes(tmp_path, s3_volume):
    """The 4-rank DCP scenario of test_dcp (save, step 2 dedup, failing step 3, exact
    loads) with every chunk on S3."""
    results = launch("save", 4, s3_volume, str(tmp_path / "out"))
    assert_checks(
        results, "exact_load", "bytes_item", "partial_load", "step2_load", "failed_save_raised"
    )
    assert all(r["latest_after_failure"] == 2 for r in results)
    s1, s2 = results[0]["stats_after_1"], results[0]["stats_after_2"]
    assert s2["raw_unique_bytes"] - s1["raw_unique_bytes"] <= 0.15 * (
        s2["logical_bytes"] - s1["logical_bytes"]
    )
    # drain the host's write-behind tier to S3, then the volume must be whole on the nodes
    env = dict(os.environ)
    out = run_cli("flush", s3_volume, "--timeout", "120", env=env, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    out = run_cli("fsck", s3_volume, "--json", env=env, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
