"""A dump or a backup is data from wherever it was kept: its table and column names never
reach SQL (issue 40, A). A backup planted on one node, whose table record names columns
that are SQL, is refused in one line by `meta restore` and `meta load`, on SQLite and on
PostgreSQL, before any statement runs. (A keyed restore never reads it: it does not verify;
these restores are `--no-verify`, where the dump's own checks are what stands.)"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import struct
import tempfile

import msgspec
import pytest
import xxhash
import zstandard

from chunkstore import codec
from chunkstore.nodes import open_node, parse_node_url
from fusefs.client.volume import Volume
from fusefs.maint import backup as bk
from metadata.sql.dump import DumpError, dump_columns, load_dump, read_records
from tests.test_backup import ckptfs

_LEN = struct.Struct("<I")


def _raw_records(blob: bytes) -> list[list]:
    """A dump's records, decoded without any check (what an attacker starts from)."""
    data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read()
    out, i = [], 0
    while i < len(data):
        (n,) = _LEN.unpack_from(data, i)
        out.append(msgspec.msgpack.decode(data[i + 4 : i + 4 + n]))
        i += 4 + n
    return out


def _raw_dump(records: list[list]) -> bytes:
    body = bytearray()
    for rec in records:
        b = msgspec.msgpack.encode(rec)
        body += _LEN.pack(len(b)) + b
    return zstandard.ZstdCompressor().compress(bytes(body))


def _volume_with_backup(tmp_path) -> tuple[list[str], dict, list[list]]:
    nodes = [f"dir:{tmp_path / 'nodes' / f'n{i}'}" for i in range(3)]
    vol = Volume.create(str(tmp_path / "vol"), nodes=nodes)
    vol.write_file("/a.txt", b"hello")
    m = bk.create_backup(vol)
    records = _raw_records(bk.backup_stream(vol.store.nodes, m).read())
    vol.close()
    return nodes, m, records


def _plant(node_url: str, name: str, manifest: dict, records: list[list], number: int) -> None:
    """A backup written straight into one node's directory (nobody else's)."""
    node = open_node(parse_node_url(node_url, name=name))
    data = _raw_dump(records)
    node.put(bk.backup_id(number, 0), codec.encode(data, "none"))
    piece = {"len": len(data), "xxh128": xxhash.xxh3_128_hexdigest(data)}
    forged = {**manifest, "id": number, "created": manifest["created"] + 1, "pieces": [piece],
              "size": len(data)}  # fmt: skip
    body = json.dumps(forged).encode()
    node.put(bk.backup_id(number, bk.MANIFEST_PIECE), codec.encode(body, "none"))
    node.close()


def _evil(records: list[list], table: str, cols: list[str], row: list) -> list[list]:
    """The records with an evil table record first (so that, refused, nothing loads)."""
    head, rest = records[0], records[1:]
    return [head, ["T", table, cols], ["R", [row]], *rest]


def _sqlite_injection() -> tuple[list[str], list]:
    """Columns that make SQLite's multi-row INSERT run a SELECT of ours and store its
    result: as many placeholders as the loader counts columns (commas + 1)."""
    pre = "value) SELECT 7, x'6576696c', sqlite_version() WHERE "
    ncol = ("ino, name, " + pre).count(",") + 1
    cols = ["ino", "name", pre + " OR ".join(["?"] * ncol) + " --"]
    return cols, [1] * ncol


def _one_line_error(proc) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("ckptfs: warning:")]
    assert len(lines) == 1 and lines[0].startswith("ckptfs: error:"), proc.stderr
    assert "has no column" in proc.stderr, proc.stderr


def test_restore_refuses_a_planted_backup_naming_sql_columns_sqlite(tmp_path):
    nodes, m, records = _volume_with_backup(tmp_path)
    cols, row = _sqlite_injection()
    _plant(nodes[1], "n1", m, _evil(records, "xattrs", cols, row), m["id"] + 1000)
    new = str(tmp_path / "new")
    proc = ckptfs("meta", "restore", new, *[a for u in nodes for a in ("--node", u)],
                  "--backup", str(m["id"] + 1000), "--no-verify", check=False)  # fmt: skip
    db = os.path.join(new, "meta.db")
    if os.path.exists(db):  # (the old code restored it, and stored the SELECT's result)
        rows = sqlite3.connect(db).execute("SELECT * FROM xattrs").fetchall()
        assert rows == [], rows
    _one_line_error(proc)
    assert not os.path.exists(new)


def test_load_refuses_a_dump_naming_sql_columns_sqlite(tmp_path):
    _nodes, _m, records = _volume_with_backup(tmp_path)
    cols, row = _sqlite_injection()
    dump = tmp_path / "evil.ckd"
    dump.write_bytes(_raw_dump(_evil(records, "xattrs", cols, row)))
    new = str(tmp_path / "new")
    proc = ckptfs("meta", "load", str(dump), new, check=False)
    db = os.path.join(new, "meta.db")
    if os.path.exists(db):
        assert sqlite3.connect(db).execute("SELECT * FROM xattrs").fetchall() == []
    _one_line_error(proc)
    assert not os.path.exists(new)


@pytest.fixture
def world_dir():
    """A directory the database server's user may write (it runs as `postgres`)."""
    d = tempfile.mkdtemp(prefix="ckptfs-evil-")
    os.chmod(d, 0o777)
    yield d
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)


def test_restore_refuses_a_planted_backup_naming_sql_columns_postgresql(
    tmp_path, pg_url, world_dir
):
    import psycopg

    nodes, m, records = _volume_with_backup(tmp_path)
    target = os.path.join(world_dir, "ran")
    cols = ["ino", "name", f"value) FROM PROGRAM 'id > {target}' --"]
    _plant(nodes[1], "n1", m, _evil(records, "xattrs", cols, [1, b"n", b"v"]), m["id"] + 1000)
    new = str(tmp_path / "new")
    proc = ckptfs("meta", "restore", new, *[a for u in nodes for a in ("--node", u)],
                  "--backup", str(m["id"] + 1000), "--no-verify", "--db", pg_url,
                  check=False)  # fmt: skip
    assert not os.path.exists(target), open(target).read()  # no command ran on the host
    _one_line_error(proc)
    with psycopg.connect(pg_url) as conn:  # and nothing was loaded
        for table in ("config", "inodes", "xattrs", "chunks"):
            n = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            assert n == 0, (table, n)
    # the real backup still restores, verified, the planted one passed over
    key = str(tmp_path / "vol" / bk.KEY_FILE)
    ckptfs("meta", "restore", str(tmp_path / "good"), *[a for u in nodes for a in ("--node", u)],
           "--key", key)  # fmt: skip
    with Volume.open(str(tmp_path / "good")) as v:
        assert v.read_file("/a.txt") == b"hello"


def test_load_refuses_a_dump_naming_sql_columns_postgresql(tmp_path, pg_url, world_dir):
    _nodes, _m, records = _volume_with_backup(tmp_path)
    target = os.path.join(world_dir, "ran")
    cols = ["ino", "name", f"value) FROM PROGRAM 'id > {target}' --"]
    dump = tmp_path / "evil.ckd"
    dump.write_bytes(_raw_dump(_evil(records, "xattrs", cols, [1, b"n", b"v"])))
    proc = ckptfs("meta", "load", str(dump), str(tmp_path / "new"), "--db", pg_url, check=False)
    assert not os.path.exists(target), open(target).read()
    _one_line_error(proc)


@pytest.mark.parametrize(
    ("rec", "why"),
    [
        (["T", "sqlite_master", ["name"]], "unknown table"),
        (["T", "xattrs; DROP TABLE inodes", ["ino"]], "unknown table"),
        (["T", "xattrs", ["ino", "ino"]], "named twice"),
        (["T", "xattrs", ["ino", 3]], "has no column"),
        (["T", "xattrs", "ino"], "no column list"),
    ],
)
def test_reader_refuses_names_the_code_does_not_declare(tmp_path, rec, why):
    _nodes, _m, records = _volume_with_backup(tmp_path)
    blob = _raw_dump([records[0], rec, ["R", []], *records[1:]])
    with pytest.raises(DumpError, match=why):
        list(read_records(io.BytesIO(blob)))


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ([[1, b"n"]], "wrong width"),
        ([[1, b"n", [1, 2]]], "type list"),
        ([[1, b"n", 1.5]], "type float"),
        ([[1 << 63, b"n", b"v"]], "out of range"),
        ("rows", "not a batch"),
    ],
)
def test_reader_refuses_rows_not_of_the_schema(tmp_path, rows, why):
    _nodes, _m, records = _volume_with_backup(tmp_path)
    blob = _raw_dump([records[0], ["T", "xattrs", ["ino", "name", "value"]], ["R", rows],
                      *records[1:]])  # fmt: skip
    with pytest.raises(DumpError, match=why):
        list(read_records(io.BytesIO(blob)))


def test_loader_takes_names_only_from_the_code(tmp_path):
    """Even a caller that skips read_records cannot make the loader paste a name."""
    from metadata.engines import open_engine

    os.makedirs(tmp_path / "v")
    engine = open_engine("sqlite:meta.db", str(tmp_path / "v"))
    try:
        recs = [["H", {"format": 1}], ["T", "xattrs", ["ino", "name", "value) --"]]]
        with pytest.raises(DumpError, match="has no column"):
            load_dump(engine, iter(recs))
    finally:
        engine.close()


def test_dump_columns_match_the_databases_tables(tmp_path):
    """The code-side list the reader checks against is what the engine makes."""
    vol = Volume.create(
        str(tmp_path / "vol"), nodes=[f"dir:{tmp_path / f'n{i}'}" for i in range(3)]
    )
    vol.write_file("/x", b"x")
    with vol.meta.snapshot() as snap:
        for table, cols in dump_columns().items():
            if snap.has_table(table):
                assert tuple(snap.columns(table)) == cols, table
    vol.close()
