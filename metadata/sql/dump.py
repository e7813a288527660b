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
import functools
import json
import re
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


# -- the schema a dump may name -------------------------------------------------------
# A dump is data from wherever it was kept (a file, an object node), and its table and
# column names are pasted into SQL by the loader (a bulk insert names its columns). So
# read_records, which every load and every reader of a backup goes through, admits only
# the tables of DUMP_TABLES and, for each, only columns the code declares for it: the DDL
# of metadata/engines/sqlite.py SCHEMA and metadata/sql/checkpoints.py CKPT_SCHEMA, and
# UR_COLUMNS (metadata/sql/maintenance.py makes that table). A dump naming anything else
# is refused before a statement is made; the names that reach SQL are the code's own
# strings (dump_columns), and values are always bound parameters (or COPY data).
UR_COLUMNS = ("chunk", "node", "since")  # MaintenanceMixin._ensure_ur's DDL
_CREATE = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*)\)\s*(?:WITHOUT ROWID)?", re.S)
_NOT_COLUMNS = {"PRIMARY", "UNIQUE", "FOREIGN", "CHECK", "CONSTRAINT"}
INT64 = (-(1 << 63), (1 << 63) - 1)


def _split_top(body: str) -> list[str]:
    """A CREATE TABLE body's items: split at the commas outside parentheses."""
    out, depth, cur = [], 0, []
    for ch in body:
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        depth += (ch == "(") - (ch == ")")
        cur.append(ch)
    out.append("".join(cur))
    return [p.strip() for p in out if p.strip()]


@functools.cache
def dump_columns() -> dict[str, tuple[str, ...]]:
    """table -> the columns the code declares for it, for every table of DUMP_TABLES."""
    from metadata.engines.sqlite import SCHEMA
    from metadata.sql.checkpoints import CKPT_SCHEMA

    declared: dict[str, tuple[str, ...]] = {"under_replicated": UR_COLUMNS}
    for stmt in [*SCHEMA, *CKPT_SCHEMA]:
        m = _CREATE.fullmatch(stmt.strip())
        if m is not None:
            items = _split_top(m.group(2))
            cols = [p.split()[0] for p in items if p.split()[0].upper() not in _NOT_COLUMNS]
            declared[m.group(1)] = tuple(cols)
    return {t: declared[t] for t in DUMP_TABLES}


def code_names(table: Any, cols: Any) -> tuple[str, list[str]]:
    """The code's own strings for a table and columns a dump names; DumpError (one line)
    for a table not in DUMP_TABLES, a column the code does not declare for it, a repeated
    column, or anything that is not a list of strings."""
    known = dump_columns()
    if not isinstance(table, str) or table not in known:
        raise DumpError(f"corrupt dump: unknown table {_short(table)}")
    ours = {c: c for c in known[table]}
    if not isinstance(cols, list) or not cols:
        raise DumpError(f"corrupt dump: table {table}: no column list")
    out = []
    for c in cols:
        if not isinstance(c, str) or c not in ours:
            raise DumpError(f"corrupt dump: table {table} has no column {_short(c)}")
        out.append(ours[c])
    if len(set(out)) != len(out):
        raise DumpError(f"corrupt dump: table {table}: a column named twice")
    table_name = next(t for t in known if t == table)
    return table_name, out


def _short(v: Any) -> str:
    """A value from a dump, quoted for a one-line message."""
    return repr(v)[:60].replace("\n", " ")


def _check_rows(table: str, ncol: int, rows: Any) -> None:
    """Rows of a table record: lists of ncol values, each an int (64-bit), str, bytes or
    None, which is all the schema holds."""
    if not isinstance(rows, list) or len(rows) > BATCH:
        raise DumpError(f"corrupt dump: table {table}: not a batch of rows")
    lo, hi = INT64
    for r in rows:
        if type(r) is not list or len(r) != ncol:
            raise DumpError(f"corrupt dump: table {table}: a row of the wrong width")
        for v in r:
            t = type(v)
            if t is int:
                if not lo <= v <= hi:
                    raise DumpError(f"corrupt dump: table {table}: an integer out of range")
            elif t is not bytes and t is not str and v is not None:
                raise DumpError(f"corrupt dump: table {table}: a value of type {t.__name__}")


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
    """The records of a dump, one at a time (a record is at most BATCH rows), checked:
    a header first and once, then tables of DUMP_TABLES, each once, naming only columns
    the code declares (and as the code's own strings, see code_names), rows of their
    width and of the schema's types, and an end record. Every reader of a dump (load,
    restore, gc's look at a backup's chunks) goes through here."""
    dec = msgspec.msgpack.Decoder()
    reader = zstandard.ZstdDecompressor().stream_reader(src, closefd=False)
    seen_end = False
    check = _Checker()
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
            if seen_end:
                raise DumpError("corrupt dump: records after the end")
            rec = check(rec)
            seen_end = rec[0] == "E"
            yield rec
    except zstandard.ZstdError as e:
        raise DumpError(f"corrupt dump: {e}") from None
    if not seen_end:
        raise DumpError("the dump is truncated (no end record)")


class _Checker:
    """The order and content of a dump's records (read_records)."""

    def __init__(self) -> None:
        self.head = False
        self.table: str | None = None
        self.ncol = 0
        self.seen: set[str] = set()

    def __call__(self, rec: list) -> list:
        kind = rec[0]
        if kind == "H":
            if self.head or len(rec) != 2 or not isinstance(rec[1], dict):
                raise DumpError("corrupt dump: a bad header")
            if rec[1].get("format") != FORMAT:
                raise DumpError(f"unsupported dump format {_short(rec[1].get('format'))}")
            self.head = True
            return rec
        if not self.head:
            raise DumpError("corrupt dump: no header")
        if kind == "T":
            if len(rec) != 3:
                raise DumpError("corrupt dump: a bad table record")
            table, cols = code_names(rec[1], rec[2])
            if table in self.seen:
                raise DumpError(f"corrupt dump: table {table} twice")
            self.seen.add(table)
            self.table, self.ncol = table, len(cols)
            return ["T", table, cols]
        if kind == "R":
            if self.table is None or len(rec) != 2:
                raise DumpError("corrupt dump: rows before a table")
            _check_rows(self.table, self.ncol, rec[1])
            return rec
        end = rec[1] if len(rec) == 2 else None
        if not (
            isinstance(end, dict)
            and isinstance(end.get("rows"), dict)
            and all(type(end.get(k)) is int for k in ("files", "checkpoints", "extents"))
        ):
            raise DumpError("corrupt dump: a bad end record")
        return rec


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
            elif head is None:  # read_records checked the order; a caller may not use it
                raise DumpError("corrupt dump: no header")
            elif kind == "T":
                table, cols = code_names(rec[1], rec[2])
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
    if "key" not in cols or "value" not in cols:
        raise DumpError("corrupt dump: table config without key and value")
    k, v = cols.index("key"), cols.index("value")
    if row[k] != "volume":
        return row
    try:
        cfg = json.loads(row[v])
    except (TypeError, ValueError):
        cfg = None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("nodes", []), list):
        raise DumpError("corrupt dump: the volume config is not a JSON object")
    out = list(row)
    out[v] = json.dumps(fn(cfg))
    return out
