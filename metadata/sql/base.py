"""The namespace and chunk accounting in SQL, shared by the SQLite and PostgreSQL engines.

One class holds every query; an engine subclass supplies the connection, the
DDL dialect and how a write transaction begins. Queries are written with `?`
placeholders and portable SQL (ON CONFLICT, RETURNING), so the two engines
cannot drift apart in behaviour.
"""

from __future__ import annotations

import errno
import json
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

from metadata.engine import (
    ROOT_INO,
    Attr,
    MetaEngine,
    MetaError,
)
from metadata.sql.changes import ChangeLogMixin
from metadata.sql.checkpoints import CheckpointMixin
from metadata.sql.chunkrefs import ChunkRefMixin
from metadata.sql.ckptquery import CheckpointQueryMixin
from metadata.sql.dumpsql import DumpSqlMixin
from metadata.sql.leases import LeaseMixin
from metadata.sql.maintenance import MaintenanceMixin
from metadata.sql.namespace import ATTR_COLS, NamespaceMixin, attr_of
from metadata.sql.requests import RequestMixin
from metadata.sql.retention import RetentionMixin
from metadata.sql.tokens import TokenMixin
from metadata.sql.txlocks import SCHEMA_LOCK

INO_HWM = "ino_hwm"  # config key: the highest inode number ever handed out
INO_BLOCK = 256  # inode numbers a connection reserves at once for creates
BULK_ROWS = 512  # rows per multi-row INSERT (a power of two; times 13 columns < 32766,
# SQLite's bound-parameter limit since 3.32)


def _now() -> int:
    return time.time_ns()


class SqlEngine(
    ChangeLogMixin,
    NamespaceMixin,
    ChunkRefMixin,
    LeaseMixin,
    RetentionMixin,
    CheckpointMixin,
    CheckpointQueryMixin,
    MaintenanceMixin,
    RequestMixin,
    TokenMixin,
    DumpSqlMixin,
    MetaEngine,
):
    """Subclasses set `self._conn` and implement `_ddl`, `_begin` and `_q`."""

    _lock: threading.RLock
    _conn: Any

    # -- dialect hooks ------------------------------------------------------
    def _ddl(self) -> list[str]:
        raise NotImplementedError

    def _q(self, sql: str) -> str:
        """Translate `?` placeholders to the driver's style."""
        return sql

    @contextmanager
    def _tx(self, *, durable: bool | str = False) -> Iterator[Any]:
        """A write transaction on the engine's one connection. Re-entrant: a nested call
        joins the outer transaction (a nested durable one makes the outer durable). The
        subclass begins it (taking the write lock up front) and ends it.

        durable=True: once this returns, the commit survives a power cut, not only a
        killed process (checkpoint outcomes are acknowledged to every rank).
        durable="lazy": a checkpoint write whose caller decides after the commit whether
        its outcome needs that (`_durable_point`): a rank commit that does not publish is
        acknowledged without an fsync, since only the publish is visible to anyone and its
        fsync persists every commit before it. Engines read `_want_durable` in
        `_begin`/`_end`; PostgreSQL commits are always durable."""
        with self._lock:
            if self._depth:
                if self._owner != threading.get_ident():  # never: _lock is held
                    raise RuntimeError("transaction state of another thread")
                self._depth += 1
                self._want_durable = _stronger(self._want_durable, durable)
                try:
                    yield self._conn
                finally:
                    self._depth -= 1
                return
            self._want_durable = durable
            self._begin()
            self._depth = 1
            self._owner = threading.get_ident()
            try:
                yield self._conn
            except BaseException:
                self._depth = 0
                self._owner = None
                self._ino_block = None  # its high-water mark may be rolled back with it
                self._end(commit=False)
                raise
            self._depth = 0
            self._owner = None
            try:
                self._end(commit=True)
            except BaseException:
                self._ino_block = None
                raise

    _want_durable: bool | str = False
    _owner: int | None = None  # the thread whose transaction is open

    def _in_tx(self) -> bool:
        """Is the calling thread inside a write transaction of this engine?"""
        return self._owner == threading.get_ident()

    # -- locks ---------------------------------------------------------------
    # SQLite's BEGIN IMMEDIATE serializes every writer, so these are no-ops there;
    # PostgreSQL overrides them (see the docstring of metadata/engines/postgres.py for what each
    # protects and the order they are taken in).
    _retryable: tuple[type[BaseException], ...] = ()  # conflicts `txretry.retried` reruns
    _skip_locked = ""  # appended to a journal read that takes only rows nobody holds
    _for_update = ""  # appended to a read whose rows the transaction then changes

    def _lock_inodes(self, c: Any, inos: Any) -> None:
        """Hold these inodes' rows until the transaction ends (a directory: its entries
        too, since every change of an entry locks its directory first)."""

    def _lock_steps(self, c: Any, keys: Any) -> None:
        """Hold these (job, step) checkpoints until the transaction ends."""

    def _lock_named(self, c: Any, name: str, *, shared: bool = False) -> None:
        """Hold a named lock (RENAME_LOCK, CHUNK_GATE, SCHEMA_LOCK) until the end."""

    def _durable_point(self) -> None:
        """Make every commit so far survive a power cut (after a durable="lazy" commit
        whose outcome turned out to need it). PostgreSQL commits are durable already."""

    def sync(self) -> None:
        self._durable_point()

    def _start_writeback(self) -> None:
        """Start writing what lazy commits left in the OS's cache, without waiting, so
        the `_durable_point` of the publish has only the tail left to write."""

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self, *, commit: bool) -> None:
        raise NotImplementedError

    @contextmanager
    def _read(self) -> Iterator[Any]:
        # One connection: a read under the lock sees every committed write.
        with self._lock:
            yield self._conn

    def _x(self, c: Any, sql: str, args: tuple | list = ()) -> Any:
        return c.execute(self._q(sql), args)

    def _one(self, c: Any, sql: str, args: tuple | list = ()) -> Any:
        return self._x(c, sql, args).fetchone()

    # -- volume --------------------------------------------------------------
    # Columns added since the first volumes, by table (declarations in SQLite's dialect).
    UPGRADES = {
        "inodes": {"alloc": "INTEGER NOT NULL DEFAULT -1"},
        # who registered a chunk row (chunkrefs.py): NULL, trusted, for an older volume's
        "chunks": {"domain": "INTEGER"},
        "ref_journal": {"domain": "INTEGER"},
    }
    # tables since the first volumes (made from `_ddl` at open: made lazily, inside a
    # writer's transaction, one held the schema lock for every other writer's first call)
    TABLES_ADDED = (
        "inline_data", "chunk_doomed", "lease_grants", "lease_ends", "tokens", "token_state"
    )  # fmt: skip

    def _upgrade_schema(self) -> None:
        """Add the columns a volume made by an older version lacks; called at open, before
        anything reads them. Existing rows get the declared default (alloc -1: st_blocks
        falls back to the size until the file is written again). A database not yet
        formatted is left alone: init_volume makes the whole schema."""
        with self._read() as c:
            if not self._has(c, "inodes", "*"):
                return
            todo = {
                table: cols
                for table, cols in self.UPGRADES.items()
                if not all(self._has(c, table, k) for k in cols)
            }
            tables = [t for t in self.TABLES_ADDED if not self._has(c, t, "*")]
            log_missing = not self._has(c, "changes", "*")
        if log_missing:  # (metadata/sql/changes.py)
            with self._tx() as c:
                self._make_change_log(c)
        if todo or tables:
            with self._tx() as c:
                self._lock_named(c, SCHEMA_LOCK)
                for table, cols in todo.items():
                    self._add_columns(c, table, cols)
                if "chunks" in todo:  # its index of unverified rows (sqlite.SCHEMA)
                    (stmt,) = [s for s in self._ddl() if " chunks_unverified " in s]
                    self._x(c, stmt)
                for table in tables:  # IF NOT EXISTS: another process may have made it
                    (stmt,) = [s for s in self._ddl() if f" EXISTS {table} (" in s]
                    self._x(c, stmt)
                if self._has(c, "chunk_leases", "*"):
                    self._drop_chunk_leases(c)

    def _drop_chunk_leases(self, c: Any) -> None:
        """A volume made before leases were packed (sql/leases.py) kept a row per leased
        id in chunk_leases: expires > 0 a live lease, < 0 condemned until -expires, 0
        lapsed (or released by gc). Live ones become grants, the others stay refused at
        commit as doomed (released for 0), and the table goes."""
        now = time.time_ns()
        self._x(
            c,
            "INSERT INTO chunk_doomed (id, deadline) SELECT id, -expires "
            "FROM chunk_leases WHERE expires <= 0 ON CONFLICT (id) DO NOTHING",
        )
        live = self._x(c, "SELECT id, expires FROM chunk_leases WHERE expires > ?", (now,))
        c.executemany(
            self._q("INSERT INTO lease_grants (granted, expires, ids) VALUES (?, ?, ?)"),
            [(now, int(exp), bytes(cid)) for cid, exp in live.fetchall()],
        )
        self._x(c, "DROP TABLE chunk_leases")

    def _add_columns(self, c: Any, table: str, cols: dict[str, str]) -> None:
        """Add each column of `cols` (name -> declaration) that `table` lacks (checked
        again here, in the write transaction: another process may have added it)."""
        for col, decl in cols.items():
            if not self._has(c, table, col):
                self._x(c, self._ddl_text(f"ALTER TABLE {table} ADD COLUMN {col} {decl}"))

    def _has(self, c: Any, table: str, col: str) -> bool:
        """Does `table` exist (col "*"), or have column `col`? A failed probe is rolled back
        to a savepoint, so the transaction around it goes on (PostgreSQL aborts it)."""
        in_tx = self._depth > 0
        if in_tx:
            self._x(c, "SAVEPOINT probe")
        try:
            self._x(c, f"SELECT {col} FROM {table} LIMIT 0")
        except Exception:  # noqa: BLE001 - the driver's "no such table/column"
            if in_tx:
                self._x(c, "ROLLBACK TO SAVEPOINT probe")
            return False
        finally:
            if in_tx:
                self._x(c, "RELEASE SAVEPOINT probe")
        return True

    def init_volume(self, config: dict) -> None:
        with self._tx() as c:
            self._lock_named(c, SCHEMA_LOCK)
            for stmt in self._ddl():
                self._x(c, stmt)
            self._make_change_log(c)
            if self._one(c, "SELECT value FROM config WHERE key = 'volume'"):
                raise MetaError(errno.EEXIST, "volume already formatted")
            self._x(
                c, "INSERT INTO config (key, value) VALUES ('volume', ?)", (json.dumps(config),)
            )
            now = _now()
            self._x(
                c,
                f"INSERT INTO inodes ({ATTR_COLS}, target) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (ROOT_INO, stat.S_IFDIR | 0o755, 2, 0, 0, 0, now, now, now, 0, 0, -1, b""),
            )

    def get_config(self) -> dict:
        with self._read() as c:
            row = self._one(c, "SELECT value FROM config WHERE key = 'volume'")
        if row is None:
            raise MetaError(errno.ENOENT, "volume is not formatted")
        return json.loads(row[0])

    _seed: int | None = None

    def _chunk_seed(self) -> int:
        """The volume's chunk-id seed (fixed when it was formatted), to check inline bytes
        against their ids."""
        if self._seed is None:
            self._seed = int(self.get_config()["seed"])
        return self._seed

    # -- helpers -----------------------------------------------------------
    def _getattr(self, c: Any, ino: int) -> Attr:
        row = self._one(c, f"SELECT {ATTR_COLS} FROM inodes WHERE ino = ?", (ino,))
        if row is None:
            raise MetaError(errno.ENOENT, f"no inode {ino}")
        return attr_of(row)

    def _blob(self, c: Any, ino: int) -> bytes:
        """A file's packed extents (checkpoints.EXT records, sorted by offset)."""
        row = self._one(c, "SELECT extents FROM inodes WHERE ino = ?", (ino,))
        return bytes(row[0]) if row is not None and row[0] else b""

    def _bulk_insert(
        self, c: Any, table: str, cols: str, rows: list[tuple], fixed: dict[str, Any] | None = None
    ) -> None:
        """Insert many rows at once (PostgreSQL overrides this with COPY); `fixed` gives
        columns whose value every row shares.

        Multi-row VALUES statements, not executemany: executemany gives up the GIL
        around every row's step, and in the service, where a validation thread runs
        beside the writer, each of those 20k re-acquisitions per 4096 ranks can wait
        a whole switch interval. One statement per BULK_ROWS rows gives it up once.
        Shared values are bound once, as the statement's first parameters (13
        parameters per inode row were ~20% of a group commit's write). Statements
        have power-of-two row counts, so their text repeats and the driver's cache
        keeps them compiled: compiling a multi-row VALUES costs ~5 us a row, more
        than running it. Callers pass blobs as bytearrays: the sqlite3 module binds a
        bytes value only after looking it up in its adapter registry, ~0.9 us a value
        under the GIL, and a bytearray directly (names, extent lists and digests are
        a third of a group commit's values)."""
        if not rows:
            return
        shared = list((fixed or {}).values())
        names = ", ".join([*(fixed or {}), cols])
        ncol = cols.count(",") + 1
        i = 0
        while i < len(rows):
            n = min(BULK_ROWS, 1 << ((len(rows) - i).bit_length() - 1))
            part = rows[i : i + n]
            sql = self._bulk_sql(table, names, ncol, len(shared), n)
            c.execute(sql, [*shared, *chain.from_iterable(part)])
            i += n

    def _bulk_sql(self, table: str, names: str, ncol: int, nfix: int, n: int) -> str:
        """INSERT of n rows: nfix shared parameters (?1..?nfix, repeated in every row)
        then ncol plain ones per row. Only the shared ones are numbered: SQLite looks
        numbered parameters up linearly, so numbering them all made compiling a
        512-row statement quadratic (~50 ms)."""
        key = (table, names, n)
        sql = self._bulk_sql_cache.get(key)
        if sql is None:
            one = "(" + ",".join([f"?{j}" for j in range(1, nfix + 1)] + ["?"] * ncol) + ")"
            sql = f"INSERT INTO {table} ({names}) VALUES " + ",".join([one] * n)
            sql = self._bulk_sql_cache[key] = self._q(sql)
        return sql

    _bulk_sql_cache: dict[tuple[str, str, int], str] = {}  # noqa: RUF012 - text, shared

    def _alloc_inos(self, c: Any, n: int) -> list[int]:
        """Reserve n inode numbers (the write lock is held), never one handed out before.

        The kernel keys its inodes by number, and a FUSE generation of 0 says a number
        always means the same inode: a directory removed while a process still held it,
        then made again under a reused number, stayed unusable (ENOENT) until a remount.
        SQLite would reuse the largest number once its row is deleted, so the highest
        number ever given is kept in `config` (PostgreSQL's identity sequence never
        reuses one)."""
        row = self._one(c, "SELECT value FROM config WHERE key = ?", (INO_HWM,))
        top = self._one(c, "SELECT COALESCE(MAX(ino), 0) FROM inodes")[0]
        top = max(int(top), int(row[0]) if row else 0)
        self._x(
            c,
            "INSERT INTO config (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (INO_HWM, str(top + n)),
        )
        return list(range(top + 1, top + 1 + n))

    def _alloc_one_ino(self, c: Any) -> int:
        """An inode number for a create, from a block this connection reserved before.

        Reserving one number per create wrote the high-water mark in `config` every
        time: a statement and a dirty page more (a 16 KB WAL frame) per small file,
        ~40 us of a ~150 us create. The block's numbers are never handed out by another
        connection, since the mark covers them; a rollback drops the block (`_tx`), as it
        may have undone the mark that reserved it, and unused numbers are skipped."""
        r = self._ino_block
        if r is None or r[0] > r[1]:
            got = self._alloc_inos(c, INO_BLOCK)
            r = self._ino_block = [got[0], got[-1]]
        r[0] += 1
        return r[0] - 1

    _ino_block: list[int] | None = None  # [next, last] inode numbers reserved by this connection


def _stronger(a: bool | str, b: bool | str) -> bool | str:
    """The stronger of two durability levels: True > "lazy" > False."""
    if a is True or b is True:
        return True
    return "lazy" if "lazy" in (a, b) else False
