"""An engine-independent dump of a volume's whole metadata, and loading it back.

Why a format of our own and not the database's: a dump taken from SQLite must load into
PostgreSQL (the migration path off one machine) and back, and a backup stored on the
object nodes must be readable with nothing but the nodes. So a dump is the tables' rows,
typed only as msgpack types (int, str, bytes), in one zstd stream:

    record  = u32 little-endian length + msgpack array
    ["H", {"format": 1, "created": ns, "source": "sqlite"|"postgresql", "tables": [...]}]
    ["T", table, [column, ...]]        then, for that table,
    ["R", [[value, ...], ...]]         batches of at most BATCH rows
    ["E", {"rows": {table: n}, "files": n, "checkpoints": n, "extents": n}]

Tables come in DUMP_TABLES order; `chunks` is first, so that gc can learn which chunks a
backup names by reading only the start of it (fusefs/maint/backup.py). The dump is taken
in one read snapshot (SQLite: a read transaction on a connection of its own, which WAL
keeps consistent while writers go on; PostgreSQL: REPEATABLE READ with a server-side
cursor), so it is consistent without stopping writers, and rows stream through in
batches: memory is bounded by a batch, never by the volume. The `requests` table (answers
kept 15 minutes for retried calls) is not dumped: it means nothing to a new volume.

Loading goes into an empty database: the engine's own DDL, then each table by its bulk
insert (SQLite: multi-row INSERTs, PostgreSQL: COPY), one transaction per batch; then
PostgreSQL's identity sequences are moved past the loaded keys.
"""

from __future__ import annotations

import errno
import stat
import struct
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import msgspec
import zstandard

from metadata.engine import MetaError

FORMAT = 1
BATCH = 2048  # rows per record: a few MB at most (an inode row holds its extent blob)
# `chunks` first (gc reads only that far); the rest in the order a reader wants them.
DUMP_TABLES = (
    "chunks",
    "config",
    "inodes",
    "dentries",
    "xattrs",
    "inline_data",
    "ref_journal",
    "ckpt_steps",
    "ckpt_ranks",
    "under_replicated",
)
IDENTITY = {"inodes": "ino", "dentries": "id", "ref_journal": "id"}  # PostgreSQL sequences
EXT_SIZE = 40  # bytes per packed extent (metadata.ckptformat.EXT)
PUBLISHED = 1  # ckpt_steps.state of a published step (metadata.sql.checkpoints)
_LEN = struct.Struct("<I")
MAX_RECORD = 1 << 30  # a length above this is a corrupt dump, not an allocation


class DumpError(Exception):
    """A dump that cannot be read (truncated, corrupt, another format) or loaded."""


# -- writing --------------------------------------------------------------------------
def write_dump(
    engine: Any,
    out: IO[bytes],
    *,
    level: int = 3,
    config_fn: Callable[[dict], dict] | None = None,
) -> dict:
    """Stream the engine's metadata into `out` (a binary file-like; only write() is used);
    `config_fn` rewrites the volume config on the way (node paths made absolute).

    Returns the end record's counts. `engine` is a SqlEngine (SQLite or PostgreSQL): the
    network client has no SQL to read, so a service's volume is dumped where its
    database is."""
    snapshot = getattr(engine, "snapshot", None)
    if snapshot is None:
        raise MetaError(errno.EOPNOTSUPP, "dump needs the volume's database, not a service")
    enc = msgspec.msgpack.Encoder()
    cctx = zstandard.ZstdCompressor(level=level, threads=0)
    counts: dict[str, Any] = {"rows": {}, "files": 0, "checkpoints": 0, "extents": 0}
    with cctx.stream_writer(out, closefd=False) as zw, snapshot() as snap:

        def put(rec: list) -> None:
            body = enc.encode(rec)
            zw.write(_LEN.pack(len(body)))
            zw.write(body)

        tables = [t for t in DUMP_TABLES if snap.has_table(t)]
        put(["H", {"format": FORMAT, "created": time.time_ns(), "source": snap.source,
                   "tables": tables}])  # fmt: skip
        for table in tables:
            cols = snap.columns(table)
            put(["T", table, cols])
            n = 0
            tally = _tally(table, cols, counts)
            for rows in snap.rows(table, cols, BATCH):
                rows = [[_plain(v) for v in r] for r in rows]
                if table == "config" and config_fn is not None:
                    rows = [_config_row(r, cols, config_fn) for r in rows]
                if tally is not None:
                    tally(rows)
                put(["R", rows])
                n += len(rows)
            counts["rows"][table] = n
        put(["E", counts])
    return counts


def _plain(v: Any) -> Any:
    """Driver values as msgpack types (memoryview/bytearray -> bytes)."""
    if isinstance(v, memoryview | bytearray):
        return bytes(v)
    return v


def _tally(table: str, cols: list[str], counts: dict) -> Callable[[list], None] | None:
    """What the manifest says about a dump (files, published checkpoints, extents)."""
    if table == "inodes":
        mi, ei = cols.index("mode"), cols.index("extents")

        def inodes(rows: list) -> None:
            for r in rows:
                if stat.S_ISREG(r[mi]):
                    counts["files"] += 1
                counts["extents"] += len(r[ei] or b"") // EXT_SIZE

        return inodes
    if table == "ckpt_steps":
        si = cols.index("state")

        def steps(rows: list) -> None:
            counts["checkpoints"] += sum(1 for r in rows if r[si] == PUBLISHED)

        return steps
    return None


# -- reading --------------------------------------------------------------------------
def read_records(src: IO[bytes]) -> Iterator[list]:
    """The records of a dump, one at a time (a record is at most BATCH rows)."""
    dec = msgspec.msgpack.Decoder()
    reader = zstandard.ZstdDecompressor().stream_reader(src, closefd=False)
    seen_end = False
    try:
        while True:
            head = _read_exact(reader, _LEN.size, allow_eof=True)
            if not head:
                break
            (n,) = _LEN.unpack(head)
            if n > MAX_RECORD:
                raise DumpError(f"corrupt dump: a record of {n} bytes")
            try:
                rec = dec.decode(_read_exact(reader, n))
            except msgspec.DecodeError as e:
                raise DumpError(f"corrupt dump: {e}") from None
            if not isinstance(rec, list) or not rec or rec[0] not in ("H", "T", "R", "E"):
                raise DumpError("corrupt dump: not a dump record")
            seen_end = rec[0] == "E"
            yield rec
    except zstandard.ZstdError as e:
        raise DumpError(f"corrupt dump: {e}") from None
    if not seen_end:
        raise DumpError("the dump is truncated (no end record)")


def _read_exact(reader: Any, n: int, *, allow_eof: bool = False) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = reader.read(n - len(buf))
        if not part:
            if allow_eof and not buf:
                return b""
            raise DumpError("the dump is truncated")
        buf += part
    return bytes(buf)


def iter_table(records: Iterator[list], table: str) -> Iterator[list]:
    """Rows of one table from a record stream, stopping once it has been read (gc reads
    the `chunks` table of a backup without reading the rest)."""
    cols: list[str] | None = None
    for rec in records:
        if rec[0] == "T":
            if cols is not None:
                return
            if rec[1] == table:
                cols = rec[2]
        elif rec[0] == "R" and cols is not None:
            yield from rec[1]
        elif rec[0] == "E":
            return


# -- loading --------------------------------------------------------------------------
def load_dump(
    engine: Any, records: Iterator[list], *, config_fn: Callable[[dict], dict] | None = None
) -> dict:
    """Load a dump's records into an empty database; returns the header plus the end
    record's counts. `config_fn` rewrites the volume config before it is stored (a
    restore points it at the nodes it was restored from)."""
    loader = getattr(engine, "bulk_loader", None)
    if loader is None:
        raise MetaError(errno.EOPNOTSUPP, "load needs a database, not a service")
    head: dict | None = None
    end: dict | None = None
    with loader() as load:
        table: str | None = None
        cols: list[str] = []
        for rec in records:
            kind = rec[0]
            if kind == "H":
                head = rec[1]
                if not isinstance(head, dict) or head.get("format") != FORMAT:
                    raise DumpError(f"unsupported dump format {head!r:.80}")
            elif head is None:
                raise DumpError("corrupt dump: no header")
            elif kind == "T":
                table, cols = rec[1], list(rec[2])
                if table not in DUMP_TABLES:
                    raise DumpError(f"corrupt dump: unknown table {table!r:.80}")
            elif kind == "R":
                if table is None:
                    raise DumpError("corrupt dump: rows before a table")
                rows = rec[1]
                if table == "config" and config_fn is not None:
                    rows = [_config_row(r, cols, config_fn) for r in rows]
                load.rows(table, cols, rows)
            elif kind == "E":
                end = rec[1]
        if end is None:
            raise DumpError("the dump is truncated (no end record)")
    return {**(head or {}), **end}


def _config_row(row: list, cols: list[str], fn: Callable[[dict], dict]) -> list:
    import json

    k, v = cols.index("key"), cols.index("value")
    if row[k] != "volume":
        return row
    out = list(row)
    out[v] = json.dumps(fn(json.loads(row[v])))
    return out
