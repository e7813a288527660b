"""The fsspec filesystem (fusefs/fsspec): fsspec's own abstract test suite, the semantics
the volume gives it (atomic close, metadata-only copy, range reads, append), the entry
point, and the exceptions a wrong URL, host, token or path raises.

The abstract suite runs against a volume directory opened in this process; the URL tests
against a real `ckptfs meta serve` subprocess (tests/fixtures/service.py)."""

from __future__ import annotations

import errno
import importlib.metadata
import os
import re
import socket
import subprocess
import sys
import tomllib

import fsspec
import fsspec.tests.abstract as abstract
import pytest

from fusefs.client.registry import close_volumes
from fusefs.client.volume import Volume, VolumeSettings
from fusefs.fsspec import CkptfsFileSystem

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
