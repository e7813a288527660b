"""chunkstore.fileio.write_new: direct writes give back exactly the bytes, at any size."""

from __future__ import annotations

import errno
import os

import pytest

from chunkstore import fileio


@pytest.mark.parametrize(
    "sizes",
    [
        [],  # an empty object
        [1],
        [4096],
        [33, 4 * 2**20],  # a header plus a 4 MiB payload: one bounce window, padded tail
        [fileio.BOUNCE],  # exactly one window
        [5000, fileio.BOUNCE, 123],  # windows that straddle parts
    ],
)
def test_write_new_round_trips_any_size(tmp_path, sizes):
    parts = [os.urandom(n) for n in sizes]
    path = str(tmp_path / "obj")
    n = fileio.write_new(path, [memoryview(p) for p in parts], sync=True)
    assert n == sum(sizes)
    with open(path, "rb") as f:
        assert f.read() == b"".join(parts)
    assert os.stat(path).st_size == n  # the padded tail was cut
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_direct_io_is_used_where_the_filesystem_has_it(tmp_path):
    if str(tmp_path) in fileio._no_direct:
        pytest.skip("this filesystem has no O_DIRECT")
    fd, direct = fileio._open_new(str(tmp_path / "probe"))
    os.close(fd)
    assert direct, "expected O_DIRECT on the test directory's filesystem"


def test_filesystems_without_direct_io_fall_back_to_buffered():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    d = os.path.join("/dev/shm", f"ckptfs-fileio-{os.getpid()}")
    os.makedirs(d)
    try:
        data = os.urandom(10_000)
        fileio.write_new(os.path.join(d, "obj"), data, sync=False)
        with open(os.path.join(d, "obj"), "rb") as f:
            assert f.read() == data
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


def test_a_filesystem_refusing_o_direct_gets_a_buffered_write(tmp_path, monkeypatch):
    """As Linux does on such a filesystem: the file is created, then EINVAL."""
    real_open = os.open

    def refusing_open(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, mode))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(fileio.os, "open", refusing_open)
    monkeypatch.setattr(fileio, "_no_direct", set())
    data = os.urandom(fileio.DIRECT_MIN + 10_000)
    for name in ("a", "b"):  # the first write meets the refusal, the second skips O_DIRECT
        fileio.write_new(str(tmp_path / name), data, sync=True)
        assert (tmp_path / name).read_bytes() == data
    assert str(tmp_path) in fileio._no_direct


def test_only_large_objects_are_written_direct(tmp_path, monkeypatch):
    """A direct write waits for the device: small objects go through the page cache."""
    fd, direct = fileio._open_new(str(tmp_path / "probe"))
    os.close(fd)
    if not direct:
        pytest.skip("this filesystem has no O_DIRECT")
    real_open, flags_seen = os.open, []

    def recording_open(path, flags, mode=0o777):
        flags_seen.append(flags)
        return real_open(path, flags, mode)

    monkeypatch.setattr(fileio.os, "open", recording_open)
    for name, n in (("small", 4096), ("large", fileio.DIRECT_MIN)):
        data = os.urandom(n)
        fileio.write_new(str(tmp_path / name), data, sync=False)
        assert (tmp_path / name).read_bytes() == data
    assert [bool(f & os.O_DIRECT) for f in flags_seen] == [False, True]


def test_an_existing_target_is_an_error_and_is_left_alone(tmp_path):
    path = tmp_path / "obj"
    path.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        fileio.write_new(str(path), b"new", sync=True)
    assert path.read_bytes() == b"old"


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    def broken(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio.os, "write", broken)
    path = tmp_path / "obj"
    with pytest.raises(OSError):
        fileio.write_new(str(path), os.urandom(9000), sync=True)
    assert not path.exists()
