"""`ckptfs meta postgres DIR`: a database for replicas on a fresh machine, as the README's
replicas section runs it (a newcomer had to initdb, create a role and a database by hand)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from fusefs.cli.pg import pg_bin
from tests.test_cli import _assert_clean_error, ckptfs

pytestmark = pytest.mark.skipif(
    not pg_bin() or not os.path.exists(os.path.join(pg_bin() or "", "initdb")),
    reason="PostgreSQL is not installed",
)


@pytest.fixture
def cluster_parent():
    """A parent the `postgres` user can reach when the tests run as root (pytest's tmp_path
    is closed to other users); removed afterwards."""
    parent = tempfile.mkdtemp(prefix="ckptfs-test-pg-", dir="/var/tmp")
    os.chmod(parent, 0o755)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


def test_meta_postgres_gives_replicas_a_database(tmp_path, meta_server, cluster_parent):
    cluster = os.path.join(cluster_parent, "pg")
    try:
        url = ckptfs("meta", "postgres", str(cluster)).stdout.strip()
        assert url.startswith("postgresql://postgres@127.0.0.1:") and url.endswith("/ckptfs")
        # again: the same URL, nothing made twice
        assert ckptfs("meta", "postgres", str(cluster)).stdout.strip() == url

        vol = tmp_path / "vol"
        ckptfs("format", str(vol), "--db", url)
        a, b = meta_server(str(vol)), meta_server(str(vol))  # two replicas, one database
        src = tmp_path / "src"
        src.write_bytes(os.urandom(100_000))
        both = f"ckptfs://127.0.0.1:{a.port},127.0.0.1:{b.port}?token_file={a.token_file}"
        ckptfs("put", both, str(src), "/x.bin")
        only_b = f"ckptfs://127.0.0.1:{b.port}?token_file={a.token_file}"
        assert "x.bin" in ckptfs("ls", only_b, "/").stdout

        # stopped (a reboot), then started again by the same command, with the data
        a.stop()
        b.stop()
        ckptfs("meta", "postgres", str(cluster), "--stop")
        assert ckptfs("meta", "postgres", str(cluster)).stdout.strip() == url
        ckptfs("get", str(vol), "/x.bin", str(tmp_path / "back"))
        assert (tmp_path / "back").read_bytes() == src.read_bytes()
    finally:
        ckptfs("meta", "postgres", str(cluster), "--stop", check=False)


def test_meta_postgres_refuses_a_directory_it_did_not_make(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("x")
    _assert_clean_error(ckptfs("meta", "postgres", str(busy), check=False), "not empty")
    assert sorted(p.name for p in busy.iterdir()) == ["mine.txt"]
    afile = tmp_path / "file"
    afile.write_text("x")
    _assert_clean_error(ckptfs("meta", "postgres", str(afile), check=False), "not a directory")
    _assert_clean_error(
        ckptfs("meta", "postgres", str(tmp_path / "none"), "--stop", check=False), "no cluster"
    )
