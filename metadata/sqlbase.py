"""The namespace and chunk accounting in SQL, shared by the SQLite and PostgreSQL engines.

One class holds every query; an engine subclass supplies the connection, the
DDL dialect and how a write transaction begins. Queries are written with `?`
placeholders and portable SQL (ON CONFLICT, RETURNING), so the two engines
cannot drift apart in behaviour.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

from metadata.changes import ChangeLogMixin
from metadata.checkpoints import (
    CHK,
    CheckpointMixin,
    blob_chunk_ids,
    pack_extents,
    unpack_extents,
)
from metadata.engine import (
    DURABLE,
    INLINE,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    STAGED,
    Attr,
    DirEntry,
    Extent,
    MetaEngine,
    MetaError,
    NewChunk,
    UnknownChunks,
    VolumeStats,
    check_blob,
    check_extents,
    check_name,
    check_new_chunks,
    check_u32,
)
from metadata.maintenance import MaintenanceMixin
from metadata.retention import RetentionMixin

_ATTR_COLS = "ino, mode, nlink, uid, gid, size, atime, mtime, ctime, rdev, generation, alloc"
_LOOKUP_SQL = (
    f"SELECT {', '.join('i.' + k.strip() for k in _ATTR_COLS.split(','))} "
    "FROM dentries d JOIN inodes i ON i.ino = d.ino WHERE d.parent = ? AND d.name = ?"
)
XATTR_MAX = 64 * 1024
INO_HWM = "ino_hwm"  # config key: the highest inode number ever handed out
INO_BLOCK = 256  # inode numbers a connection reserves at once for creates
BULK_ROWS = 512  # rows per multi-row INSERT (a power of two; times 13 columns < 32766,
# SQLite's bound-parameter limit since 3.32)


# What create makes: the node types of mknod(2), plus directories and symlinks. FIFOs,
# sockets and device nodes hold no data here: the kernel serves them (a pipe, a socket,
# the device's driver) and only asks the mount for their attributes.
_KINDS = frozenset(
    [stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR,
     stat.S_IFBLK]
)  # fmt: skip


def _now() -> int:
    return time.time_ns()


def _attr(row: Any) -> Attr:
    return Attr(*row)


class SqlEngine(ChangeLogMixin, RetentionMixin, CheckpointMixin, MaintenanceMixin, MetaEngine):
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
            try:
                yield self._conn
            except BaseException:
                self._depth = 0
                self._ino_block = None  # its high-water mark may be rolled back with it
                self._end(commit=False)
                raise
            self._depth = 0
            try:
                self._end(commit=True)
            except BaseException:
                self._ino_block = None
                raise

    _want_durable: bool | str = False

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
    UPGRADES = {"inodes": {"alloc": "INTEGER NOT NULL DEFAULT -1"}}
    TABLES_ADDED = ("inline_data",)  # tables since the first volumes (made from `_ddl`)

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
        if log_missing:  # (metadata/changes.py)
            with self._tx() as c:
                self._make_change_log(c)
        if todo or tables:
            with self._tx() as c:
                for table, cols in todo.items():
                    self._add_columns(c, table, cols)
                for table in tables:  # IF NOT EXISTS: another process may have made it
                    (stmt,) = [s for s in self._ddl() if f" EXISTS {table} (" in s]
                    self._x(c, stmt)

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
                f"INSERT INTO inodes ({_ATTR_COLS}, target) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (ROOT_INO, stat.S_IFDIR | 0o755, 2, 0, 0, 0, now, now, now, 0, 0, -1, b""),
            )

    def get_config(self) -> dict:
        with self._read() as c:
            row = self._one(c, "SELECT value FROM config WHERE key = 'volume'")
        if row is None:
            raise MetaError(errno.ENOENT, "volume is not formatted")
        return json.loads(row[0])

    def set_config(self, config: dict) -> None:
        with self._tx() as c:
            self._x(c, "UPDATE config SET value = ? WHERE key = 'volume'", (json.dumps(config),))

    _seed: int | None = None

    def _chunk_seed(self) -> int:
        """The volume's chunk-id seed (fixed when it was formatted), to check inline bytes
        against their ids."""
        if self._seed is None:
            self._seed = int(self.get_config()["seed"])
        return self._seed

    # -- helpers -----------------------------------------------------------
    def _getattr(self, c: Any, ino: int) -> Attr:
        row = self._one(c, f"SELECT {_ATTR_COLS} FROM inodes WHERE ino = ?", (ino,))
        if row is None:
            raise MetaError(errno.ENOENT, f"no inode {ino}")
        return _attr(row)

    def _lookup(self, c: Any, parent: int, name: bytes) -> Attr:
        row = self._one(c, _LOOKUP_SQL, (parent, name))
        if row is None:
            raise MetaError(errno.ENOENT, f"{name!r} not found")
        return _attr(row)

    def _dir(self, c: Any, ino: int) -> Attr:
        """A directory that still has a name. A removed one kept for a mount (`_drop_dir`)
        is ENOENT, as Linux answers for a dead directory: another mount's kernel does not
        know it is gone, and an entry made in it would be lost with it."""
        a = self._getattr(c, ino)
        if not a.is_dir:
            raise MetaError(errno.ENOTDIR, f"inode {ino} is not a directory")
        if a.nlink <= 0:
            raise MetaError(errno.ENOENT, f"directory {ino} was removed")
        return a

    def _touch_dir(self, c: Any, ino: int, nlink_delta: int = 0) -> None:
        now = _now()
        self._x(
            c,
            "UPDATE inodes SET mtime = ?, ctime = ?, nlink = nlink + ? WHERE ino = ?",
            (now, now, nlink_delta, ino),
        )

    def _blob(self, c: Any, ino: int) -> bytes:
        """A file's packed extents (checkpoints.EXT records, sorted by offset)."""
        row = self._one(c, "SELECT extents FROM inodes WHERE ino = ?", (ino,))
        return bytes(row[0]) if row is not None and row[0] else b""

    def _release_extents(self, c: Any, ino: int) -> None:
        """Drop the references of an inode's extents (the caller rewrites or deletes the inode)."""
        refs = Counter(blob_chunk_ids(self._blob(c, ino)))
        self._adjust_refs(c, {k: -v for k, v in refs.items()})

    def _adjust_refs(self, c: Any, delta: dict[bytes, int], *, settle: bool = True) -> None:
        """Add reference deltas. A decrement may hit a chunk whose row is still only in the
        journal (a checkpoint commit not applied yet): apply the journal first, so no
        decrement is lost on a missing row."""
        now = _now()
        rows = sorted((cid, d) for cid, d in delta.items() if d)
        if not rows:
            return
        if settle and any(d < 0 for _, d in rows):
            self._settle(c)
        c.executemany(
            self._q("UPDATE chunks SET refcount = refcount + ?, touched = ? WHERE id = ?"),
            [(d, now, bytearray(cid)) for cid, d in rows],  # see _bulk_insert
        )

    # -- pending references (the journal checkpoint commits write) -------------
    def _settle(self, c: Any) -> None:
        """Apply every pending journal entry inside the caller's write transaction."""
        if self._one(c, "SELECT 1 FROM ref_journal LIMIT 1") is not None:
            self._apply_journal(c, None)

    def _apply_journal(self, c: Any, limit: int | None) -> int:
        """Register journalled new chunks and add their references, in bulk, sorted by id.

        `SELECT *`: a volume made before the `owned` column reads the same until its
        first checkpoint transaction adds it (`_ckpt_tx`)."""
        sql = "SELECT * FROM ref_journal ORDER BY id"
        cur = self._x(c, sql + (" LIMIT ?" if limit else ""), (limit,) if limit else ())
        col = {d[0]: k for k, d in enumerate(cur.description)}
        rows = cur.fetchall()
        if not rows:
            return 0
        k_chunks, k_refs, k_owned = col["chunks"], col["refs"], col.get("owned")
        new: dict[bytes, tuple[int, int, int]] = {}
        refs: Counter[bytes] = Counter()
        for row in rows:
            owned = bytes(row[k_owned]) if k_owned is not None else b""
            for blob in (row[k_chunks], owned):
                for cid, raw_len, stored_len, st in CHK.iter_unpack(blob):
                    prev = new.get(cid)
                    if prev is None or st > prev[2]:
                        new[cid] = (raw_len, stored_len, st)
            refs.update(blob_chunk_ids(row[k_refs]))
            refs.update([owned[i : i + 16] for i in range(0, len(owned), CHK.size)])
        now = _now()
        if new:
            c.executemany(
                self._q(
                    "INSERT INTO chunks (id, raw_len, stored_len, refcount, state, touched) "
                    "VALUES (?,?,?,?,?,?) ON CONFLICT (id) DO UPDATE SET "
                    "refcount = chunks.refcount + excluded.refcount, touched = excluded.touched, "
                    "state = CASE WHEN excluded.state > chunks.state THEN excluded.state "
                    "ELSE chunks.state END"
                ),
                [
                    (bytearray(cid), *new[cid][:2], refs.pop(cid, 0), new[cid][2], now)
                    for cid in sorted(new)
                ],  # bytearrays: see _bulk_insert
            )
        self._adjust_refs(c, refs, settle=False)
        ids = [r[col["id"]] for r in rows]
        self._x(c, "DELETE FROM ref_journal WHERE id >= ? AND id <= ?", (ids[0], ids[-1]))
        return len(rows)

    def apply_pending(self, limit: int | None = None) -> int:
        """Apply up to `limit` journal entries (all if None); returns how many remain.

        The service runs this in the background between group commits; embedded
        engines reach it through stats, chunk_info, gc and fsck (and `_settle`).
        """
        with self._read() as c:
            if self._one(c, "SELECT 1 FROM ref_journal LIMIT 1") is None:
                return 0
        with self._tx() as c:
            self._apply_journal(c, limit)
            return int(self._one(c, "SELECT COUNT(*) FROM ref_journal")[0])

    def pending_refs(self) -> int:
        """Journal rows (each up to JOURNAL_GROUP rank commits of one step, written by
        one group commit) whose chunk references are not applied yet."""
        with self._read() as c:
            return int(self._one(c, "SELECT COUNT(*) FROM ref_journal")[0])

    def _journal_span(self, c: Any) -> int:
        """About how many journal entries wait (ids are dense): two index probes, no scan."""
        lo, hi = self._one(c, "SELECT MIN(id), MAX(id) FROM ref_journal")
        return 0 if lo is None else int(hi) - int(lo) + 1

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

    def _drop_inode_if_orphan(self, c: Any, ino: int, open_inodes: bool = False) -> None:
        row = self._one(c, "SELECT nlink, mode FROM inodes WHERE ino = ?", (ino,))
        if row is None or row[0] > 0:
            return
        self._release_extents(c, ino)
        self._x(c, "DELETE FROM xattrs WHERE ino = ?", (ino,))
        self._x(c, "DELETE FROM inodes WHERE ino = ?", (ino,))

    # -- namespace -----------------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> Attr:
        check_name(name)
        with self._read() as c:
            return self._lookup(c, parent, name)

    def getattr(self, ino: int) -> Attr:
        with self._read() as c:
            return self._getattr(c, ino)

    def create(
        self,
        parent: int,
        name: bytes,
        mode: int,
        uid: int,
        gid: int,
        *,
        target: bytes = b"",
        rdev: int = 0,
        setgid_inherit: bool = False,
    ) -> Attr:
        check_name(name)
        check_u32(mode, "mode")
        check_u32(uid, "uid")
        check_u32(gid, "gid")
        check_blob(target, "symlink target")
        kind = stat.S_IFMT(mode)
        if kind not in _KINDS:
            raise MetaError(errno.EINVAL, f"file type {kind:#o} is not one a file can have")
        if kind not in (stat.S_IFCHR, stat.S_IFBLK):
            rdev = 0  # only a device node has a device number
        elif not isinstance(rdev, int) or not 0 <= rdev < 2**63:
            raise MetaError(errno.EINVAL, "device number out of range")
        if kind == stat.S_IFLNK and not target:
            raise MetaError(errno.EINVAL, "symlink needs a target")
        if len(target) > 4096:
            raise MetaError(errno.ENAMETOOLONG, "symlink target longer than 4096 bytes")
        with self._tx() as c:
            d = self._dir(c, parent)
            ino = self._alloc_one_ino(c)
            entry = self._x(
                c,
                "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?) "
                "ON CONFLICT (parent, name) DO NOTHING",
                (parent, name, ino),
            )
            if entry.rowcount != 1:  # the name is taken (one statement less than asking)
                raise MetaError(errno.EEXIST, f"{name!r} exists")
            if setgid_inherit and d.mode & stat.S_ISGID:
                gid = d.gid
                if kind == stat.S_IFDIR:
                    mode |= stat.S_ISGID
            now = _now()
            nlink = 2 if kind == stat.S_IFDIR else 1
            size = len(target) if kind == stat.S_IFLNK else 0
            row = (ino, mode, nlink, uid, gid, size, now, now, now, rdev, 0,
                   0 if kind == stat.S_IFREG else -1)  # fmt: skip
            self._x(
                c,
                "INSERT INTO inodes (ino, mode, nlink, uid, gid, size, atime, mtime, ctime, "
                "rdev, generation, alloc, target) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (*row, target),
            )
            self._touch_dir(c, parent, 1 if kind == stat.S_IFDIR else 0)
            return Attr(*row)  # what the row holds: no need to read it back

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        check_name(new_name)
        with self._tx() as c:
            a = self._getattr(c, ino)
            if a.is_dir:
                raise MetaError(errno.EPERM, "hard links to directories are not allowed")
            if a.nlink == 0:
                raise MetaError(errno.ENOENT, "cannot link an unlinked inode")
            self._dir(c, new_parent)
            if self._one(
                c, "SELECT 1 FROM dentries WHERE parent = ? AND name = ?", (new_parent, new_name)
            ):
                raise MetaError(errno.EEXIST, f"{new_name!r} exists")
            self._x(
                c,
                "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)",
                (new_parent, new_name, ino),
            )
            self._x(
                c, "UPDATE inodes SET nlink = nlink + 1, ctime = ? WHERE ino = ?", (_now(), ino)
            )
            self._touch_dir(c, new_parent)
            return self._getattr(c, ino)

    def unlink(self, parent: int, name: bytes) -> Attr:
        check_name(name)
        with self._tx() as c:
            a = self._lookup(c, parent, name)
            if a.is_dir:
                raise MetaError(errno.EISDIR, f"{name!r} is a directory")
            self._x(c, "DELETE FROM dentries WHERE parent = ? AND name = ?", (parent, name))
            self._x(
                c, "UPDATE inodes SET nlink = nlink - 1, ctime = ? WHERE ino = ?", (_now(), a.ino)
            )
            self._touch_dir(c, parent)
            return self._getattr(c, a.ino)

    def rmdir(self, parent: int, name: bytes, *, keep: bool = False) -> Attr:
        check_name(name)
        with self._tx() as c:
            a = self._lookup(c, parent, name)
            if not a.is_dir:
                raise MetaError(errno.ENOTDIR, f"{name!r} is not a directory")
            if self._one(c, "SELECT 1 FROM dentries WHERE parent = ? LIMIT 1", (a.ino,)):
                raise MetaError(errno.ENOTEMPTY, f"{name!r} is not empty")
            self._x(c, "DELETE FROM dentries WHERE parent = ? AND name = ?", (parent, name))
            self._touch_dir(c, parent, -1)
            return self._drop_dir(c, a.ino, keep)

    def _drop_dir(self, c: Any, ino: int, keep: bool) -> Attr:
        """A directory's last name went: delete it, or (keep) leave it as an orphan with
        no links, for the mount to delete at the kernel's FORGET (`forget_orphan`): a
        process sitting in it, or holding it open, may still fstat it, as on ext4."""
        self._x(c, "UPDATE inodes SET nlink = 0, size = 0, ctime = ? WHERE ino = ?", (_now(), ino))
        a = self._getattr(c, ino)
        if not keep:
            self._drop_inode_if_orphan(c, ino)
        return a

    def _is_ancestor(self, c: Any, anc: int, ino: int) -> bool:
        """Is `anc` the directory `ino` or one of its ancestors?"""
        seen = 0
        while True:
            if ino == anc:
                return True
            if ino == ROOT_INO:
                return False
            row = self._one(c, "SELECT parent FROM dentries WHERE ino = ? LIMIT 1", (ino,))
            if row is None:
                return False
            ino = row[0]
            seen += 1
            if seen > 100_000:
                raise MetaError(errno.ELOOP, "directory tree loop")

    def rename(
        self,
        parent: int,
        name: bytes,
        new_parent: int,
        new_name: bytes,
        flags: int = 0,
        *,
        keep: bool = False,
    ) -> Attr | None:
        check_name(name)
        check_name(new_name)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise MetaError(errno.EINVAL, f"unsupported rename flags {flags:#x}")
        with self._tx() as c:
            src = self._lookup(c, parent, name)
            self._dir(c, new_parent)
            try:
                dst: Attr | None = self._lookup(c, new_parent, new_name)
            except MetaError:
                dst = None
            if src.is_dir and self._is_ancestor(c, src.ino, new_parent):
                raise MetaError(errno.EINVAL, "cannot move a directory into itself")
            if flags & RENAME_EXCHANGE:
                if dst is None:
                    raise MetaError(errno.ENOENT, f"{new_name!r} not found")
                if dst.is_dir and self._is_ancestor(c, dst.ino, parent):
                    raise MetaError(errno.EINVAL, "cannot move a directory into itself")
                self._x(
                    c,
                    "UPDATE dentries SET ino = ? WHERE parent = ? AND name = ?",
                    (dst.ino, parent, name),
                )
                self._x(
                    c,
                    "UPDATE dentries SET ino = ? WHERE parent = ? AND name = ?",
                    (src.ino, new_parent, new_name),
                )
                # both inodes changed names: their ctime moves, as a rename's source does
                now = _now()
                self._x(
                    c, "UPDATE inodes SET ctime = ? WHERE ino IN (?, ?)", (now, src.ino, dst.ino)
                )
                if src.is_dir != dst.is_dir and parent != new_parent:
                    d = 1 if src.is_dir else -1
                    self._touch_dir(c, parent, -d)
                    self._touch_dir(c, new_parent, d)
                else:
                    self._touch_dir(c, parent)
                    self._touch_dir(c, new_parent)
                return None
            if dst is not None:
                if flags & RENAME_NOREPLACE:
                    raise MetaError(errno.EEXIST, f"{new_name!r} exists")
                if dst.ino == src.ino:
                    return None  # POSIX: renaming a name onto a link of the same inode does nothing
                if src.is_dir and not dst.is_dir:
                    raise MetaError(errno.ENOTDIR, f"{new_name!r} is not a directory")
                if dst.is_dir and not src.is_dir:
                    raise MetaError(errno.EISDIR, f"{new_name!r} is a directory")
                if dst.is_dir:
                    if self._one(c, "SELECT 1 FROM dentries WHERE parent = ? LIMIT 1", (dst.ino,)):
                        raise MetaError(errno.ENOTEMPTY, f"{new_name!r} is not empty")
                self._x(
                    c, "DELETE FROM dentries WHERE parent = ? AND name = ?", (new_parent, new_name)
                )
                if dst.is_dir:
                    dst = self._drop_dir(c, dst.ino, keep)
                    self._touch_dir(c, new_parent, -1)
                else:
                    self._x(
                        c,
                        "UPDATE inodes SET nlink = nlink - 1, ctime = ? WHERE ino = ?",
                        (_now(), dst.ino),
                    )
            self._x(
                c,
                "UPDATE dentries SET parent = ?, name = ? WHERE parent = ? AND name = ?",
                (new_parent, new_name, parent, name),
            )
            self._x(c, "UPDATE inodes SET ctime = ? WHERE ino = ?", (_now(), src.ino))
            if src.is_dir and parent != new_parent:
                self._touch_dir(c, parent, -1)
                self._touch_dir(c, new_parent, 1)
            else:
                self._touch_dir(c, parent)
                if new_parent != parent:
                    self._touch_dir(c, new_parent)
            if dst is not None and not dst.is_dir:
                return self._getattr(c, dst.ino)
            return dst if dst is not None and keep else None

    def readdir(self, ino: int, offset: int, limit: int = 1000) -> list[DirEntry]:
        cols = ", ".join("i." + k.strip() for k in _ATTR_COLS.split(","))
        with self._read() as c:
            self._dir(c, ino)
            rows = self._x(
                c,
                f"SELECT d.id, d.name, {cols} FROM dentries d JOIN inodes i ON i.ino = d.ino "
                "WHERE d.parent = ? AND d.id > ? ORDER BY d.id LIMIT ?",
                (ino, offset, limit),
            ).fetchall()
        return [DirEntry(bytes(r[1]), _attr(r[2:]), r[0]) for r in rows]

    def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        clear_mode: int = 0,
    ) -> Attr:
        for v, what in ((mode, "mode"), (uid, "uid"), (gid, "gid"), (clear_mode, "clear_mode")):
            if v is not None:
                check_u32(v, what)
        for t in (atime_ns, mtime_ns, size):
            if t is not None and type(t) is not int:
                raise MetaError(errno.EINVAL, f"times and sizes are integers, not {t!r:.40}")
        for t in (atime_ns, mtime_ns):
            if t is not None and not -(2**63) <= t < 2**63:  # years 1677-2262
                raise MetaError(errno.EOVERFLOW, "time out of the range a volume keeps")
        with self._tx() as c:
            a = self._getattr(c, ino)
            now = _now()
            if mode is not None:
                a.mode = stat.S_IFMT(a.mode) | (mode & 0o7777)
            a.mode &= ~(clear_mode & 0o7777)
            if uid is not None:
                a.uid = uid
            if gid is not None:
                a.gid = gid
            if atime_ns is not None:
                a.atime_ns = atime_ns
            if mtime_ns is not None:
                a.mtime_ns = mtime_ns
            if size is not None:
                if not a.is_reg:
                    raise MetaError(
                        errno.EISDIR if a.is_dir else errno.EINVAL, "not a regular file"
                    )
                if size < 0:
                    raise MetaError(errno.EINVAL, f"negative size {size}")
                if size != a.size:
                    if size < a.size:
                        a.alloc = self._trim_extents(c, ino, size)
                    a.size = size
                    a.generation += 1
                if mtime_ns is None:  # a truncate marks mtime even at the same size (Linux)
                    a.mtime_ns = now
            a.ctime_ns = now
            self._x(
                c,
                "UPDATE inodes SET mode=?, uid=?, gid=?, size=?, atime=?, mtime=?, ctime=?, "
                "generation=? WHERE ino=?",
                (
                    a.mode,
                    a.uid,
                    a.gid,
                    a.size,
                    a.atime_ns,
                    a.mtime_ns,
                    a.ctime_ns,
                    a.generation,
                    ino,
                ),
            )
            return a

    def _trim_extents(self, c: Any, ino: int, size: int) -> int:
        """Cut a file's extents at `size`; the bytes they still cover."""
        keep: list[Extent] = []
        delta: Counter[bytes] = Counter()
        for e in unpack_extents(self._blob(c, ino)):
            if e.offset + e.length <= size:
                keep.append(e)
            elif e.offset < size:
                keep.append(Extent(e.offset, size - e.offset, e.chunk_id, e.chunk_off))
            else:
                delta[e.chunk_id] -= 1
        alloc = sum(e.length for e in keep)
        self._x(
            c,
            "UPDATE inodes SET extents = ?, alloc = ? WHERE ino = ?",
            (pack_extents(keep), alloc, ino),
        )
        self._adjust_refs(c, dict(delta))
        return alloc

    def parent(self, ino: int) -> int:
        if ino == ROOT_INO:
            return ROOT_INO
        with self._read() as c:
            row = self._one(c, "SELECT parent FROM dentries WHERE ino = ? LIMIT 1", (ino,))
        if row is None:
            raise MetaError(errno.ENOENT, f"inode {ino} has no name")
        return int(row[0])

    def readlink(self, ino: int) -> bytes:
        with self._read() as c:
            row = self._one(c, "SELECT mode, target FROM inodes WHERE ino = ?", (ino,))
        if row is None:
            raise MetaError(errno.ENOENT, f"no inode {ino}")
        if not stat.S_ISLNK(row[0]):
            raise MetaError(errno.EINVAL, "not a symlink")
        return bytes(row[1])

    def forget_orphan(self, ino: int) -> None:
        with self._tx() as c:
            self._drop_inode_if_orphan(c, ino)

    def purge_orphans(self) -> int:
        with self._tx() as c:
            inos = [r[0] for r in self._x(c, "SELECT ino FROM inodes WHERE nlink <= 0").fetchall()]
            for ino in inos:
                self._drop_inode_if_orphan(c, ino)
        return len(inos)

    # -- xattrs --------------------------------------------------------------
    def get_xattr(self, ino: int, name: bytes) -> bytes:
        with self._read() as c:
            row = self._one(c, "SELECT value FROM xattrs WHERE ino = ? AND name = ?", (ino, name))
        if row is None:
            raise MetaError(errno.ENODATA, f"no attribute {name!r}")
        return bytes(row[0])

    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        check_blob(name, "attribute name")
        check_blob(value, "attribute value")
        if not name or len(name) > NAME_MAX_XATTR or b"\0" in name:
            raise MetaError(errno.ERANGE, f"bad attribute name {name[:40]!r}")
        if len(value) > XATTR_MAX:
            raise MetaError(errno.E2BIG, f"attribute value over {XATTR_MAX} bytes")
        with self._tx() as c:
            self._getattr(c, ino)
            self._x(
                c,
                "INSERT INTO xattrs (ino, name, value) VALUES (?,?,?) "
                "ON CONFLICT (ino, name) DO UPDATE SET value = excluded.value",
                (ino, name, value),
            )
            self._x(c, "UPDATE inodes SET ctime = ? WHERE ino = ?", (_now(), ino))

    def list_xattr(self, ino: int) -> list[bytes]:
        with self._read() as c:
            rows = self._x(c, "SELECT name FROM xattrs WHERE ino = ? ORDER BY name", (ino,))
            return [bytes(r[0]) for r in rows.fetchall()]

    def remove_xattr(self, ino: int, name: bytes) -> None:
        with self._tx() as c:
            cur = self._x(c, "DELETE FROM xattrs WHERE ino = ? AND name = ?", (ino, name))
            if cur.rowcount == 0:
                raise MetaError(errno.ENODATA, f"no attribute {name!r}")
            self._x(c, "UPDATE inodes SET ctime = ? WHERE ino = ?", (_now(), ino))

    # -- data ----------------------------------------------------------------
    def get_extents(self, ino: int) -> list[Extent]:
        with self._read() as c:
            return unpack_extents(self._blob(c, ino))

    def commit_file(
        self,
        ino: int,
        extents: list[Extent],
        size: int,
        new_chunks: list[NewChunk],
        mtime_ns: int | None = None,
    ) -> Attr:
        check_extents(extents, size)
        check_new_chunks(new_chunks, self._chunk_seed())
        with self._tx() as c:
            row = self._one(c, f"SELECT {_ATTR_COLS}, extents FROM inodes WHERE ino = ?", (ino,))
            if row is None:
                raise MetaError(errno.ENOENT, f"no inode {ino}")
            a = _attr(row[:-1])
            if not a.is_reg:
                raise MetaError(errno.EISDIR if a.is_dir else errno.EINVAL, "not a regular file")
            now = _now()
            self._register_chunks(c, new_chunks, now)
            delta = Counter(e.chunk_id for e in extents)
            self._check_known(c, set(delta) - {ch.chunk_id for ch in new_chunks})
            delta.subtract(blob_chunk_ids(bytes(row[-1] or b"")))
            self._adjust_refs(c, delta)
            mt = mtime_ns if mtime_ns is not None else now
            alloc = sum(e.length for e in extents)
            self._x(
                c,
                "UPDATE inodes SET size = ?, mtime = ?, ctime = ?, generation = generation + 1, "
                "extents = ?, alloc = ? WHERE ino = ?",
                (size, mt, now, pack_extents(extents), alloc, ino),
            )
            # The row as updated (the write lock is held): no need to read it back.
            return dataclasses.replace(
                a, size=size, mtime_ns=mt, ctime_ns=now, generation=a.generation + 1, alloc=alloc
            )

    def _register_chunks(self, c: Any, chunks: list[NewChunk], now: int) -> None:
        """Rows for new chunks. A row already there keeps its state, except:
        - a chunk only staged so far (in one host's write-behind tier) is durable once a
          writer stored it on the nodes, and INLINE once a commit brings its bytes: the
          metadata copy makes it durable at once, where dropping the bytes left this
          fsync'd file in the hands of that host's tier (a test lost it with the host);
        - a chunk already on the nodes (or INLINE) takes no copy of the bytes.
        So `inline_data` holds bytes exactly for INLINE rows, and a reader never has two
        copies to choose between."""
        if not chunks:
            return
        c.executemany(
            self._q(
                "INSERT INTO chunks (id, raw_len, stored_len, refcount, state, touched) "
                "VALUES (?,?,?,0,?,?) ON CONFLICT (id) DO NOTHING"
            ),
            [(ch.chunk_id, ch.raw_len, ch.stored_len, ch.state, now) for ch in chunks],
        )
        self._from_staged(c, [ch.chunk_id for ch in chunks if ch.state == DURABLE], DURABLE)
        inline = [ch for ch in chunks if ch.state == INLINE]
        if inline:  # a row already there holds the same bytes (their id was checked)
            self._from_staged(c, [ch.chunk_id for ch in inline], INLINE, ", stored_len = raw_len")
            c.executemany(
                self._q(
                    "INSERT INTO inline_data (id, data) SELECT ?, ? WHERE EXISTS "
                    f"(SELECT 1 FROM chunks WHERE id = ? AND state = {INLINE}) "
                    "ON CONFLICT (id) DO NOTHING"
                ),
                [(ch.chunk_id, ch.data, ch.chunk_id) for ch in inline],
            )

    def _from_staged(self, c: Any, ids: list[bytes], state: int, also: str = "") -> None:
        """Move the STAGED rows among `ids` to `state` (DURABLE: on their nodes; INLINE:
        their bytes in the metadata), setting `also` with it. A row in any other state
        keeps it: an INLINE row never changes, a DURABLE one is never demoted."""
        if ids:
            c.executemany(
                self._q(
                    f"UPDATE chunks SET state = {state}{also} WHERE id = ? AND state = {STAGED}"
                ),
                [(i,) for i in ids],
            )

    def _check_known(self, c: Any, ids: set[bytes]) -> None:
        if not ids:
            return
        missing = self._missing(c, list(ids))
        if missing:  # maybe only journalled so far (a checkpoint commit not yet applied)
            self._settle(c)
            missing = self._missing(c, list(missing))
        if missing:
            raise UnknownChunks(
                errno.EIO,
                f"extents reference {len(missing)} unknown chunk(s), "
                f"e.g. {next(iter(missing)).hex()}",
            )

    def _missing(self, c: Any, ids: list[bytes]) -> set[bytes]:
        found: set[bytes] = set()
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            marks = ",".join("?" * len(part))
            found.update(
                bytes(r[0])
                for r in self._x(c, f"SELECT id FROM chunks WHERE id IN ({marks})", part).fetchall()
            )
        return set(ids) - found

    def missing_chunks(self, ids: list[bytes]) -> set[bytes]:
        ids = list(dict.fromkeys(ids))
        with self._tx() as c:
            missing = self._missing(c, ids)
            present = [(_now(), cid) for cid in ids if cid not in missing]
            if present:
                c.executemany(
                    self._q("UPDATE chunks SET touched = ? WHERE id = ? AND refcount <= 0"), present
                )
        return missing

    def chunk_info(self, ids: list[bytes]) -> dict[bytes, tuple[int, int, int, int]]:
        out: dict[bytes, tuple[int, int, int, int]] = {}
        self.apply_pending()
        with self._read() as c:
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                marks = ",".join("?" * len(part))
                for r in self._x(
                    c,
                    "SELECT id, raw_len, stored_len, refcount, state FROM chunks "
                    f"WHERE id IN ({marks})",
                    part,
                ).fetchall():
                    out[bytes(r[0])] = (r[1], r[2], r[3], r[4])
        return out

    def inline_data(self, ids: list[bytes]) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        with self._read() as c:
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                marks = ",".join("?" * len(part))
                for r in self._x(
                    c, f"SELECT id, data FROM inline_data WHERE id IN ({marks})", part
                ).fetchall():
                    # text where bytes belong (a row an older version let a client write)
                    # comes back as its bytes, which fail the id check like any damage
                    data = r[1].encode() if isinstance(r[1], str) else bytes(r[1])
                    out[bytes(r[0])] = data
        return out

    def mark_durable(self, ids: list[bytes], stored_lens: list[int] | None = None) -> None:
        """STAGED chunks are on their nodes now. Only STAGED ones change: an INLINE row
        stays INLINE even if some host also uploaded those bytes (a writer that staged the
        same content before the inline commit): its bytes are in the metadata either way,
        and fsck must not look for it on the nodes."""
        with self._tx() as c:
            self._settle(c)  # a journalled chunk's row must exist, or the update is lost
            if stored_lens is not None:  # compressed at upload: the size on the nodes
                c.executemany(
                    self._q(f"UPDATE chunks SET stored_len = ? WHERE id = ? AND state = {STAGED}"),
                    [(n, i) for i, n in zip(ids, stored_lens, strict=True) if n > 0],
                )
            self._from_staged(c, ids, DURABLE)

    def stats(self) -> VolumeStats:
        self.apply_pending()
        with self._read() as c:
            files, logical = self._one(
                c,
                # size * 1.0: a REAL sum in SQLite, NUMERIC in PostgreSQL; an INTEGER sum
                # overflows past 2**63-1 bytes (two 2**62 sparse files) and failed statfs
                "SELECT COUNT(*), COALESCE(SUM(size * 1.0), 0) FROM inodes WHERE nlink > 0 AND "
                f"(mode & {0o170000}) = {stat.S_IFREG}",
            )
            inodes = self._one(c, "SELECT COUNT(*) FROM inodes")[0]
            n, raw, stored, staged = self._one(
                c,
                "SELECT COUNT(*), COALESCE(SUM(raw_len * 1.0), 0), "
                "COALESCE(SUM(stored_len * 1.0), 0), "
                f"COALESCE(SUM(CASE WHEN state = {STAGED} THEN 1 ELSE 0 END), 0) "
                "FROM chunks WHERE refcount > 0",
            )
        return VolumeStats(
            logical_bytes=int(logical),
            stored_bytes=int(stored),
            raw_unique_bytes=int(raw),
            unique_chunks=int(n),
            staged_chunks=int(staged),
            files=int(files),
            inodes=int(inodes),
        )


NAME_MAX_XATTR = 255


def _stronger(a: bool | str, b: bool | str) -> bool | str:
    """The stronger of two durability levels: True > "lazy" > False."""
    if a is True or b is True:
        return True
    return "lazy" if "lazy" in (a, b) else False
