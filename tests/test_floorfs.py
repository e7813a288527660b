"""bench/floorfs.py, the floors bench.fuse compares the mount with: the storing one must
keep every byte it is given (else its speed would be a false floor), the dropping one
must keep sizes."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.fuse import ROOT, unmount, wait_mounted

MiB = 2**20


def _mount(mp: str, *opts: str) -> subprocess.Popen:
    os.makedirs(mp)
    proc = subprocess.Popen([sys.executable, "-m", "bench.floorfs", mp, *opts], cwd=ROOT)
    wait_mounted(mp, proc)
    return proc


def test_the_storing_floor_keeps_every_byte(tmp_path):
    store, mp = str(tmp_path / "store"), str(tmp_path / "mnt")
    os.makedirs(store)
    proc = _mount(mp, "--store", store)
    data = os.urandom(5 * MiB + 123)
    try:
        fd = os.open(os.path.join(mp, "f"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:  # write-only: direct_io, the requests of the writer's own sizes
            for off in range(0, len(data), MiB):
                assert os.write(fd, data[off : off + MiB]) == len(data[off : off + MiB])
            os.fsync(fd)
        finally:
            os.close(fd)
        assert os.stat(os.path.join(mp, "f")).st_size == len(data)
        with open(os.path.join(mp, "f"), "rb") as f:
            assert f.read() == data
        (backing,) = os.listdir(store)
        with open(os.path.join(store, backing), "rb") as f:
            assert f.read() == data
    finally:
        unmount(mp, proc)
    assert proc.returncode == 0


def test_the_dropping_floor_keeps_sizes_only(tmp_path):
    mp = str(tmp_path / "mnt")
    proc = _mount(mp)
    try:
        with open(os.path.join(mp, "f"), "wb") as f:
            f.write(b"x" * (3 * MiB))
            f.flush()
            os.fsync(f.fileno())
        assert os.stat(os.path.join(mp, "f")).st_size == 3 * MiB
        with open(os.path.join(mp, "f"), "rb") as f:
            assert f.read() == bytes(3 * MiB)
        assert not os.path.exists(os.path.join(mp, "g"))
    finally:
        unmount(mp, proc)
    assert proc.returncode == 0
