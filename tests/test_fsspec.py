"""The fsspec filesystem (fusefs/fsspec): fsspec's own abstract test suite, the semantics
the volume gives it (atomic close, metadata-only copy, range reads, append), the entry
point, and the exceptions a wrong URL, host, token or path raises.

The abstract suite runs against a volume directory opened in this process; the URL tests
against a real `ckptfs meta serve` subprocess (tests/fixtures/service.py)."""

from __future__ import annotations

import errno
import importlib.metadata
import os
import pickle
import re
import socket
import subprocess
import sys

import fsspec
import fsspec.tests.abstract as abstract
import pytest

from fusefs.client.registry import close_volumes
from fusefs.client.volume import Volume, VolumeSettings
from fusefs.fsspec import CkptfsFileSystem
from tests.fixtures.fsspec_entry import declared_entry_point

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 64 * 1024


@pytest.fixture(scope="module", autouse=True)
def _isolated(tmp_path_factory):
    """Staging and the default volume under tmp; every volume closed (drained) after."""
    old = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "XDG_DATA_HOME")}
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("xdg-data"))
    yield
    close_volumes()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def vol_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("fsspec") / "vol")
    Volume.create(path, settings=VolumeSettings(chunk_size=CHUNK)).close()
    return path


@pytest.fixture(scope="module")
def ckfs(vol_dir) -> CkptfsFileSystem:
    return CkptfsFileSystem(volume=vol_dir, skip_instance_cache=True)


# -- fsspec's abstract suite ---------------------------------------------------------------
class CkptfsFixtures(abstract.AbstractFixtures):
    @pytest.fixture
    def fs(self, ckfs):
        return ckfs

    @pytest.fixture
    def fs_path(self, ckfs, request):
        # no glob characters: the suite globs below this path
        path = "/abstract/" + re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:120]
        yield path
        if ckfs.exists(path):
            ckfs.rm(path, recursive=True)


class TestCkptfsCopy(abstract.AbstractCopyTests, CkptfsFixtures):
    pass


class TestCkptfsGet(abstract.AbstractGetTests, CkptfsFixtures):
    pass


class TestCkptfsPut(abstract.AbstractPutTests, CkptfsFixtures):
    pass


class TestCkptfsOpen(abstract.AbstractOpenTests, CkptfsFixtures):
    pass


class TestCkptfsPipe(abstract.AbstractPipeTests, CkptfsFixtures):
    pass


# -- the entry point -------------------------------------------------------------------------
def test_entry_point_names_the_filesystem():
    mod, _, name = declared_entry_point().partition(":")
    assert getattr(importlib.import_module(mod), name) is CkptfsFileSystem


def test_fsspec_finds_the_protocol_with_no_import(entry_point_env, vol_dir, tmp_path):
    """A fresh interpreter that imports only fsspec opens ckptfs:// URLs."""
    code = (
        "import sys, fsspec\n"
        "assert 'fusefs' not in sys.modules\n"
        f"fs = fsspec.filesystem('ckptfs', volume={vol_dir!r})\n"
        "with fsspec.open('ckptfs:///ep/hello.txt', 'w', volume=" + repr(vol_dir) + ") as f:\n"
        "    f.write('hello from fsspec')\n"
        "print(type(fs).__name__, fs.cat_file('/ep/hello.txt').decode())\n"
    )
    env = dict(entry_point_env, XDG_CACHE_HOME=str(tmp_path / "cache"))
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["CkptfsFileSystem", "hello", "from", "fsspec"]


# -- what the volume gives the filesystem ----------------------------------------------------
def test_range_reads_fetch_only_the_chunks_they_cover(ckfs, monkeypatch):
    data = os.urandom(32 * CHUNK)
    ckfs.pipe_file("/range/f", data)
    fetched: list[bytes] = []
    real = ckfs.volume.fetch_chunk

    def counting(cid, **kw):
        fetched.append(cid)
        return real(cid, **kw)

    monkeypatch.setattr(ckfs.volume, "fetch_chunk", counting)
    assert ckfs.cat_file("/range/f", 5 * CHUNK + 10, 5 * CHUNK + 20) == data[5 * CHUNK + 10 :][:10]
    assert len(fetched) == 1
    assert ckfs.cat_file("/range/f", -100) == data[-100:]
    assert len(fetched) == 2
    fetched.clear()
    with ckfs.open("/range/f", "rb") as f:
        f.seek(20 * CHUNK + 5)
        assert f.read(100) == data[20 * CHUNK + 5 :][:100]
        assert len(fetched) == 1  # a seek and a read: no read-ahead of the rest
        assert f.read() == data[20 * CHUNK + 105 :]


def test_writes_become_visible_at_close_only(ckfs):
    ckfs.pipe_file("/atomic/f", b"old content")
    with ckfs.open("/atomic/f", "wb") as f:
        f.write(b"new ")
        assert ckfs.cat_file("/atomic/f") == b"old content"
        f.write(b"content")
    assert ckfs.cat_file("/atomic/f") == b"new content"
    with ckfs.open("/atomic/g", "wb") as f:
        f.write(b"x" * 3 * CHUNK)
        assert not ckfs.exists("/atomic/g")  # made at the commit
    assert ckfs.info("/atomic/g")["size"] == 3 * CHUNK


def test_a_failed_write_leaves_the_old_content(ckfs):
    ckfs.pipe_file("/failed/f", b"keep me")
    with pytest.raises(RuntimeError), ckfs.open("/failed/f", "wb") as f:
        f.write(b"half a checkpoint")
        raise RuntimeError("the save failed")
    assert ckfs.cat_file("/failed/f") == b"keep me"
    with pytest.raises(RuntimeError), ckfs.open("/failed/new", "wb") as f:
        f.write(b"x")
        raise RuntimeError("the save failed")
    assert not ckfs.exists("/failed/new")


def test_a_filesystem_outlives_close_volumes(vol_dir):
    """fsspec caches filesystem instances: one made before close_volumes() (a teardown, an
    atexit drain) reopens the volume on its next use instead of failing on a closed one."""
    fs = CkptfsFileSystem(volume=vol_dir)
    fs.pipe_file("/outlive/f", b"before")
    first = fs.volume
    close_volumes()
    again = CkptfsFileSystem(volume=vol_dir)
    assert again is fs  # fsspec's instance cache
    assert again.cat_file("/outlive/f") == b"before"
    again.pipe_file("/outlive/g", b"after")
    assert fs.volume is not first
    assert fs.cat_file("/outlive/g") == b"after"


def test_copy_shares_chunks_and_checksums_follow_content(ckfs):
    data = os.urandom(5 * CHUNK + 123)
    ckfs.pipe_file("/cp/src", data)
    ckfs.cp_file("/cp/src", "/cp/deep/dst")
    meta, vol = ckfs.volume.meta, ckfs.volume
    src, dst = vol.resolve("/cp/src"), vol.resolve("/cp/deep/dst")
    assert src.ino != dst.ino
    assert meta.get_extents(src.ino) == meta.get_extents(dst.ino)  # the same chunks
    assert ckfs.cat_file("/cp/deep/dst") == data
    assert ckfs.checksum("/cp/src") == ckfs.checksum("/cp/deep/dst")
    ckfs.pipe_file("/cp/other", data[:-1] + b"!")
    assert ckfs.checksum("/cp/other") != ckfs.checksum("/cp/src")
    ckfs.pipe_file("/cp/src", b"changed")  # the copy keeps its content
    assert ckfs.cat_file("/cp/deep/dst") == data


def test_mv_renames_a_tree_in_place(ckfs):
    ckfs.pipe_file("/mv/a/x", b"1")
    ckfs.pipe_file("/mv/a/sub/y", b"2")
    ino = ckfs.info("/mv/a/sub/y")["ino"]
    ckfs.mv("/mv/a", "/mv/b", recursive=True)
    assert not ckfs.exists("/mv/a")
    assert ckfs.info("/mv/b/sub/y")["ino"] == ino  # renamed, not copied
    ckfs.makedirs("/mv/into")
    ckfs.mv("/mv/b/x", "/mv/into")
    assert ckfs.cat_file("/mv/into/x") == b"1"
    with pytest.raises(IsADirectoryError):
        ckfs.mv("/mv/b", "/mv/c")
    with pytest.raises(FileNotFoundError):
        ckfs.mv("/mv/none", "/mv/d")


def test_append_keeps_the_existing_chunks(ckfs):
    head = os.urandom(2 * CHUNK + 7)
    ckfs.pipe_file("/append/f", head)
    before = ckfs.volume.meta.get_extents(ckfs.info("/append/f")["ino"])
    with ckfs.open("/append/f", "ab") as f:
        assert f.tell() == len(head)
        f.write(b"tail")
    assert ckfs.cat_file("/append/f") == head + b"tail"
    after = ckfs.volume.meta.get_extents(ckfs.info("/append/f")["ino"])
    assert after[: len(before)] == before
    with ckfs.open("/append/new", "ab") as f:
        f.write(b"fresh")
    assert ckfs.cat_file("/append/new") == b"fresh"


def test_rm_mkdir_touch_modified_and_text(ckfs):
    ckfs.makedirs("/misc/d/e")
    with pytest.raises(FileExistsError):
        ckfs.mkdir("/misc/d")
    ckfs.makedirs("/misc/d", exist_ok=True)
    ckfs.touch("/misc/d/e/t")
    t0 = ckfs.modified("/misc/d/e/t")
    ckfs.touch("/misc/d/e/t", truncate=False)
    assert ckfs.modified("/misc/d/e/t") >= t0
    with pytest.raises(IsADirectoryError):
        ckfs.rm("/misc/d")
    with pytest.raises(IsADirectoryError):
        ckfs.open("/misc/d", "wb")
    with pytest.raises(IsADirectoryError):
        ckfs.cat_file("/misc/d")
    ckfs.rm("/misc/d", recursive=True)
    assert not ckfs.exists("/misc/d")
    with ckfs.open("/misc/t.txt", "w", encoding="utf-8") as f:
        f.write("ligne\nzwei\n")
    with ckfs.open("/misc/t.txt", "r", encoding="utf-8") as f:
        assert f.readlines() == ["ligne\n", "zwei\n"]
    assert sorted(ckfs.glob("/misc/*.txt")) == ["/misc/t.txt"]
    with pytest.raises(OSError) as e:
        ckfs.pipe_file("/misc/" + "n" * 300, b"")
    assert e.value.errno == errno.ENAMETOOLONG


def test_transaction_commits_at_its_end(ckfs):
    with ckfs.transaction:
        ckfs.pipe_file("/txn/a", b"A")
        ckfs.pipe_file("/txn/b", b"B")
        assert not ckfs.exists("/txn/a")
    assert ckfs.cat_file("/txn/a") + ckfs.cat_file("/txn/b") == b"AB"
    with pytest.raises(RuntimeError), ckfs.transaction:
        ckfs.pipe_file("/txn/c", b"C")
        raise RuntimeError("roll back")
    assert not ckfs.exists("/txn/c")


# -- URLs of a real service, and what a wrong one raises -------------------------------------
@pytest.fixture
def service(tmp_path, meta_server, entry_point_site):
    """A volume served by `ckptfs meta serve`; this process's volumes closed before it stops."""
    vol = str(tmp_path / "svc")
    Volume.create(vol, settings=VolumeSettings(chunk_size=CHUNK)).close()
    srv = meta_server(vol)
    yield srv
    close_volumes()


def test_service_url_roundtrip(service):
    url = f"ckptfs://127.0.0.1:{service.port}/job/data.bin?token_file={service.token_file}"
    data = os.urandom(3 * CHUNK + 11)
    with fsspec.open(url, "wb") as f:
        f.write(data)
    with fsspec.open(url, "rb") as f:
        assert f.read() == data
    fs, path = fsspec.core.url_to_fs(url)
    assert isinstance(fs, CkptfsFileSystem) and path == "/job/data.bin"
    assert fs.unstrip_protocol(path) == f"ckptfs://127.0.0.1:{service.port}/job/data.bin"
    assert fs.ls(f"ckptfs://127.0.0.1:{service.port}/job", detail=False) == [path]


def test_wrong_path_is_file_not_found(service):
    fs = fsspec.filesystem(
        "ckptfs", host="127.0.0.1", port=service.port, token_file=service.token_file
    )
    with pytest.raises(FileNotFoundError) as e:
        fs.open("/no/such/file", "rb")
    assert f"ckptfs://127.0.0.1:{service.port}/no/such/file" in str(e.value)
    # the missing component as a path, never a bytes repr (it said `(b'no' not found)`)
    assert "(/no does not exist)" in str(e.value) and "b'" not in str(e.value)
    with pytest.raises(FileNotFoundError):
        fs.ls("/nowhere")


def test_wrong_token_is_permission_error(service, tmp_path, monkeypatch):
    bad = tmp_path / "bad.token"
    bad.write_text("not-the-token-of-this-volume\n")
    bad.chmod(0o600)  # others may not read a token file
    with pytest.raises(PermissionError, match="wrong token"):
        fsspec.open(f"ckptfs://127.0.0.1:{service.port}/x?token_file={bad}", "rb").open()
    for var in ("CKPTFS_TOKEN", "CKPTFS_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(PermissionError, match="no token"):
        fsspec.filesystem("ckptfs", host="127.0.0.1", port=service.port)


def test_no_secret_travels_with_the_filesystem(service, tmp_path, monkeypatch):
    """fsspec keeps storage options for to_json() and pickle: a raw token= is refused, and
    a filesystem opened by token file carries the file's path, never the secret."""
    with pytest.raises(ValueError, match="token_file"):
        fsspec.filesystem("ckptfs", host="127.0.0.1", port=service.port, token="s3cret-value")
    secret = open(service.token_file).read().strip()
    monkeypatch.delenv("CKPTFS_TOKEN", raising=False)
    monkeypatch.delenv("CKPTFS_TOKEN_FILE", raising=False)
    fs = fsspec.filesystem(
        "ckptfs", host="127.0.0.1", port=service.port, token_file=service.token_file,
        skip_instance_cache=True,
    )  # fmt: skip
    fs.pipe_file("/carried.bin", b"x")
    assert fs.cat_file("/carried.bin") == b"x"
    for blob in (fs.to_json().encode(), pickle.dumps(fs)):
        assert secret.encode() not in blob
    assert pickle.loads(pickle.dumps(fs)).cat_file("/carried.bin") == b"x"


def test_wrong_host_is_connection_error(tmp_path, entry_point_site):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "t"
    token.write_text("x" * 32)
    token.chmod(0o600)  # others may not read a token file
    with pytest.raises(
        ConnectionError, match=f"cannot reach the metadata service at 127.0.0.1:{port}"
    ):
        fsspec.open(f"ckptfs://127.0.0.1:{port}/x?token_file={token}&retry=0", "rb").open()


def test_bad_options(tmp_path, vol_dir, entry_point_site):
    with pytest.raises(FileNotFoundError, match="no volume at"):
        CkptfsFileSystem(volume=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not both"):
        CkptfsFileSystem(host="127.0.0.1", port=1, volume=vol_dir)
    with pytest.raises(ValueError, match="port"):
        fsspec.core.url_to_fs("ckptfs://127.0.0.1:http/x")
