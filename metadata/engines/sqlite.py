"""The embedded SQLite engine (the default): WAL, one connection, one writer at a time.

WAL with synchronous=NORMAL survives a killed process with every committed
transaction (the crash the write-behind tier and the mount care about); a
power cut may lose the last few commits but never corrupts the database.
Durable transactions (checkpoint begin/commit/publish/abort, whose outcomes
are acknowledged to ranks) run with synchronous=FULL: the WAL is fsync'd
before COMMIT returns, so an acknowledged publish survives a power cut too.
They also skip the automatic WAL checkpoint: copying a group commit's tens of
MB from the WAL into the database file is not part of its latency, and the
next ordinary write (in the service, the idle journal apply) does it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

from metadata.engine import MetaBusy, MetaEngine, MetaError
from metadata.sql.base import SqlEngine

log = logging.getLogger("ckptfs.sqlite")

SCHEMA = [
    "CREATE TABLE IF NOT EXISTS config (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS inodes (
        ino INTEGER PRIMARY KEY, mode INTEGER NOT NULL, nlink INTEGER NOT NULL,
        uid INTEGER NOT NULL, gid INTEGER NOT NULL, size INTEGER NOT NULL,
        atime INTEGER NOT NULL, mtime INTEGER NOT NULL, ctime INTEGER NOT NULL,
        rdev INTEGER NOT NULL DEFAULT 0, generation INTEGER NOT NULL DEFAULT 0,
        target BLOB NOT NULL DEFAULT x'', extents BLOB NOT NULL DEFAULT x'',
        alloc INTEGER NOT NULL DEFAULT -1)""",
    """CREATE TABLE IF NOT EXISTS dentries (
        id INTEGER PRIMARY KEY, parent INTEGER NOT NULL, name BLOB NOT NULL,
        ino INTEGER NOT NULL, UNIQUE (parent, name))""",
    "CREATE INDEX IF NOT EXISTS dentries_ino ON dentries (ino)",
    """CREATE TABLE IF NOT EXISTS chunks (
        id BLOB PRIMARY KEY, raw_len INTEGER NOT NULL, stored_len INTEGER NOT NULL,
        refcount INTEGER NOT NULL, state INTEGER NOT NULL, touched INTEGER NOT NULL,
        domain INTEGER) WITHOUT ROWID""",
    # Rows a scoped writer registered, not yet verified on the nodes (chunkrefs.py: domain)
    "CREATE INDEX IF NOT EXISTS chunks_unverified ON chunks (id) WHERE domain IS NOT NULL",
    # Chunk references taken by checkpoint commits, applied to `chunks` in bulk off the
    # publish path (sqlbase.apply_pending). One row holds up to JOURNAL_GROUP rank commits
    # of one step: `ranks` packed (`rank` is the first), `chunks` new chunks as CHK records
    # (no reference), `refs` packed extents (one reference per extent), `owned` new chunks
    # taking one reference per record: a file whose extents are exactly its new chunks is
    # journalled once, not twice.
    """CREATE TABLE IF NOT EXISTS ref_journal (
        id INTEGER PRIMARY KEY, job TEXT NOT NULL, step INTEGER NOT NULL,
        rank INTEGER NOT NULL, chunks BLOB NOT NULL, refs BLOB NOT NULL,
        ranks BLOB NOT NULL DEFAULT x'', owned BLOB NOT NULL DEFAULT x'', domain INTEGER)""",
    "CREATE INDEX IF NOT EXISTS ref_journal_step ON ref_journal (job, step)",
    # The bytes of INLINE chunks (engine.INLINE_DATA_MAX): deleted with their chunk row. A
    # rowid table: its leaf keeps a row up to a page minus 35 bytes, where a WITHOUT ROWID
    # (index) B-tree keeps a quarter page and spills the rest into an overflow page of its
    # own (measured at 16 KB pages: 830 against 990 small files/s).
    """CREATE TABLE IF NOT EXISTS inline_data (id BLOB PRIMARY KEY, data BLOB NOT NULL)""",
    # leases of chunks stored and not yet committed (metadata/sql/leases.py): grants are
    # appended, one row of packed ids each; ends are rare (a save given up, a row gc deleted)
    """CREATE TABLE IF NOT EXISTS lease_grants (
        seq INTEGER PRIMARY KEY, granted INTEGER NOT NULL, expires INTEGER NOT NULL,
        ids BLOB NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS lease_ends (id BLOB PRIMARY KEY, at INTEGER NOT NULL)""",
    # what gc condemned, until its deadline (metadata/sql/leases.py); empty but for failed writers
    """CREATE TABLE IF NOT EXISTS chunk_doomed (id BLOB PRIMARY KEY, deadline INTEGER NOT NULL)""",
    # scoped credentials, hashed (metadata/sql/tokens.py); not dumped onto the nodes
    """CREATE TABLE IF NOT EXISTS tokens (
        name TEXT PRIMARY KEY, role TEXT NOT NULL, jobs TEXT NOT NULL, prefixes TEXT NOT NULL,
        expires DOUBLE PRECISION NOT NULL, created DOUBLE PRECISION NOT NULL,
        digest BLOB NOT NULL UNIQUE)""",
    """CREATE TABLE IF NOT EXISTS token_state (id INTEGER PRIMARY KEY, gen INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS xattrs (
        ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL,
        PRIMARY KEY (ino, name)) WITHOUT ROWID""",
]


# Pages of a new database. Every dirty page is a WAL frame, so a small transaction costs
# about (pages it touches) x PAGE_SIZE: a small file's create and inline commit touch ~6.
# 4 KB pages: 965-1,072 new-content 4 KiB files/s in bench.fuse, against 851-882 at 16 KB;
# a 4096-rank publish (~5 MB per 1024 ranks of inode rows and journal blobs) took 350-369
# against 312-340 ms in alternating runs, 16,384 ranks the same within noise. 16 KB was
# the size until inline chunks made small files' commits page-bound.
# An existing database keeps the size it was created with.
PAGE_SIZE = 4096
WAL_AUTOCHECKPOINT = 1000  # pages: SQLite's default, for ordinary transactions
WAL_DEFER_MAX = 512 << 20  # a durable commit defers the WAL copy up to this WAL size
WAL_KEEP = 64 << 20  # `wal_checkpoint` cuts a WAL it starts over back to this size
CHECKPOINT_WAIT = 0.02  # seconds `wal_checkpoint` may wait for readers (writers wait meanwhile)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_file_range_fn() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range_fn()


def _start_writeback(fd: int) -> None:
    """Start writing the WAL's dirty pages (Linux sync_file_range(SYNC_FILE_RANGE_WRITE),
    no wait), so the publish's fsync finds little left; a no-op where libc lacks it.

    These two small file helpers are written here, not imported from chunkstore.fileio
    (which has the same pair for staged chunks): metadata and chunkstore do not import
    each other (DESIGN.md, "Layers")."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, 2)  # 2: SYNC_FILE_RANGE_WRITE


def _no_others(path: str) -> None:
    """The database closed to other users: small files' bytes live in it (inline chunks),
    with every name and attribute, so a 0644 database let any local user read a 0600 file
    the mount refused them. A new database is made 0660 less the umask before SQLite opens
    it (its WAL and shared-memory files take its mode); an older one we own loses its bits
    for others. Group bits stay: a volume shared through a group (a setgid directory, umask
    002) keeps working for the group, which narrowing to 0600 broke. A database we cannot
    change (another owner, a read-only copy) is left as it is."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        os.close(fd)
        return
    except FileExistsError:
        pass
    except OSError:
        return  # no such directory, read-only: sqlite3 reports it
    for p in (path, path + "-wal", path + "-shm"):
        try:
            st = os.stat(p)
            if st.st_uid == os.geteuid() and st.st_mode & 0o007:
                os.chmod(p, st.st_mode & ~0o007 & 0o7777)
        except OSError:
            pass


class SqliteEngine(SqlEngine):
    def __init__(self, path: str, *, busy_timeout: float = 60.0, inline: bool = False) -> None:
        """inline=True: a connection whose calls run on an event loop (the mount's trio
        thread), so it must never wait or do slow work: it never waits for a lock (busy
        timeout 0: the call fails with sqlite3.OperationalError, nothing done, and the
        caller retries it elsewhere), never checkpoints the WAL (the other connection does,
        see `wal_checkpoint`), and never applies the reference journal (`_settle` refuses
        the same way)."""
        self.path = path
        self.inline = inline
        self._auto = 0 if inline else WAL_AUTOCHECKPOINT
        _no_others(path)
        self._conn = sqlite3.connect(
            path,
            isolation_level=None,
            check_same_thread=False,
            timeout=0 if inline else busy_timeout,
            cached_statements=512,
        )
        self._conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # takes effect in a new database
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA foreign_keys=OFF")
        if inline:
            self._conn.execute("PRAGMA wal_autocheckpoint=0")
        self._busy_ms = 0 if inline else int(busy_timeout * 1000)
        self._lock = threading.RLock()
        self._depth = 0
        self._full = False  # the connection is at synchronous=FULL
        self._deferring = False  # automatic WAL checkpoints are off
        self._wal_seen = 0  # the WAL's mtime at the last housekeeping checkpoint
        if not inline:  # the inline connection opens after the volume's own one
            self._upgrade_schema()

    def _ddl(self) -> list[str]:
        return SCHEMA

    def _begin(self) -> None:
        # The safety level cannot change inside a transaction: set it before BEGIN.
        want = self._want_durable is True  # "lazy": NORMAL, the caller syncs if it must
        defer = bool(self._want_durable) and self._wal_bytes() <= WAL_DEFER_MAX
        if want != self._full:
            self._conn.execute(f"PRAGMA synchronous={'FULL' if want else 'NORMAL'}")
            self._full = want
        if defer != self._deferring:
            auto = 0 if defer else self._auto
            self._conn.execute(f"PRAGMA wal_autocheckpoint={auto}")
            self._deferring = defer
        self._conn.execute("BEGIN IMMEDIATE")

    def _end(self, *, commit: bool) -> None:
        try:
            self._conn.execute("COMMIT" if commit else "ROLLBACK")
        except sqlite3.OperationalError:
            if self._conn.in_transaction:  # a failed COMMIT leaves it open: end it
                self._conn.execute("ROLLBACK")
            raise
        if commit and self._want_durable is True and not self._full:
            self._sync_wal()  # a durable call nested in an ordinary transaction

    def _durable_point(self) -> None:
        with self._lock:
            self._sync_wal()

    def _start_writeback(self) -> None:
        with self._lock:
            self._on_wal(_start_writeback)

    housekeeping_interval = 0.5  # WAL_CHECK: how often a mount looks at the WAL

    def loop_engine(self) -> MetaEngine | None:
        """An inline connection to the same file (see __init__), its sqlite3 errors turned
        into MetaBusy: the caller then retries on this engine, from a worker."""
        return _LoopEngine(SqliteEngine(self.path, inline=True))

    def housekeeping(self) -> None:
        """Checkpoint the WAL if it was written since the last look. The loop engine never
        checkpoints, and a run of inline-only writes (a tree of mkdirs, small files whose
        content is known) grew the WAL by ~64 KB a transaction, to 250+ MB, slowing every
        commit after it."""
        seen = self._wal_seen
        if _mtime_ns(self.path + "-wal") == seen:
            return
        try:
            done = self.wal_checkpoint()
        except sqlite3.Error as e:
            log.debug("WAL checkpoint: %s", e)
            done = False
        if done:  # (its own first write of the new WAL is not news) else: next look
            self._wal_seen = _mtime_ns(self.path + "-wal")

    def wal_checkpoint(self) -> bool:
        """Copy the WAL into the database and start it over; False if readers kept it
        from finishing within CHECKPOINT_WAIT (call again later).

        For a process whose writes mostly go through an inline connection, which never
        checkpoints. RESTART, not PASSIVE: with the mount's loop reading and writing all
        the while, a PASSIVE checkpoint copied every frame but the WAL never started over
        and grew past 250 MB. The first write after a restart rewrites (and syncs) the WAL
        header and, with journal_size_limit, cuts the file: this connection makes that
        write itself, so the inline one never does it on the loop. The short wait bounds
        how long the checkpoint holds off the other writers."""
        with self._lock:
            c = self._conn
            c.execute(f"PRAGMA busy_timeout={int(CHECKPOINT_WAIT * 1000)}")
            try:
                busy = c.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()[0]
            finally:
                c.execute(f"PRAGMA busy_timeout={self._busy_ms}")
            if busy:
                return False
            c.execute(f"PRAGMA journal_size_limit={WAL_KEEP}")
            with self._tx() as t:  # the first write of the new WAL
                self._x(
                    t,
                    "INSERT INTO config (key, value) VALUES ('wal_restarts', '1') "
                    "ON CONFLICT (key) DO UPDATE SET value = value + 1",
                )
            return True

    def _settle(self, c: Any) -> None:
        if not self.inline:
            super()._settle(c)
        elif self._one(c, "SELECT 1 FROM ref_journal LIMIT 1") is not None:
            raise sqlite3.OperationalError("would apply the reference journal on the loop")

    def _wal_bytes(self) -> int:
        try:
            return os.path.getsize(self.path + "-wal")
        except OSError:
            return 0

    _wal_named: int | None = None  # inode of the WAL whose directory entry is durable

    def _sync_wal(self) -> None:
        self._on_wal(self._fsync_wal)

    def _fsync_wal(self, fd: int) -> None:
        """fsync the WAL, and its directory the first time this WAL file is synced here:
        SQLite syncs the directory of a WAL it created only on its own first sync of it,
        which a lazy commit never makes, so a WAL made since (a new one after the last
        connection closed removed the old) could vanish in a power cut, fsync'd content
        and all."""
        os.fsync(fd)
        ino = os.fstat(fd).st_ino
        if ino != self._wal_named:
            _fsync_dir(os.path.dirname(os.path.abspath(self.path)))
            self._wal_named = ino

    def _on_wal(self, fn) -> None:
        """fn(fd) on the WAL file; nothing if checkpointed and removed (the database file
        holds every commit then)."""
        try:
            fd = os.open(self.path + "-wal", os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fn(fd)
        finally:
            os.close(fd)

    _service_fd: int | None = None

    def claim_service(self) -> None:
        """Be the one service of this volume, or refuse with a clear error (EBUSY).

        Replicas share a namespace through a database server's locks; an embedded SQLite
        file has none to share across hosts, and two services on it would each keep
        their own view of what is being committed. The service holds an exclusive flock
        on a file beside the database while it runs: the kernel drops it when the
        process exits, however it exits (SIGKILL included), so a crash never leaves a
        stale lock. The file says which process holds it, for the message."""
        lock = self.path + ".service.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o660)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise MetaError(
                errno.EBUSY,
                f"{os.path.dirname(os.path.abspath(self.path))} is already served by "
                f"`ckptfs meta serve` (pid {holder}): a SQLite volume runs one service; "
                "run replicas on PostgreSQL (`ckptfs format --db postgresql://...`)",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._service_fd = fd

    # -- dump (metadata/sql/dumpsql.py) --------------------------------------------------
    def _snapshot_open(self) -> tuple[Any, str]:
        """A connection of its own in a read transaction: WAL keeps its view while
        writers go on (they never wait for it; only the WAL's truncation does)."""
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("BEGIN")
        conn.execute("SELECT COUNT(*) FROM config").fetchone()  # the snapshot starts here
        return conn, "sqlite"

    def _snapshot_has(self, conn: Any, table: str) -> bool:
        q = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
        return conn.execute(q, (table,)).fetchone() is not None

    def _snapshot_rows(self, conn: Any, sql: str, batch: int) -> Any:
        cur = conn.execute(sql)
        while rows := cur.fetchmany(batch):
            yield rows

    def close(self) -> None:
        with self._lock:
            self._conn.close()
            if self._service_fd is not None:  # closing the file lets go of the flock
                os.close(self._service_fd)
                self._service_fd = None


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


class _LoopEngine:
    """SqliteEngine(inline=True) as the engine interface sees it: its calls raise MetaBusy,
    not sqlite3 errors, so that no frontend needs to know the database library."""

    def __init__(self, eng: SqliteEngine) -> None:
        self._eng = eng

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._eng, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kw: Any) -> Any:
            try:
                return attr(*args, **kw)
            except sqlite3.Error as e:
                raise MetaBusy(message=f"{name}: {e}") from None

        setattr(self, name, call)  # made once: the mount calls these on every lookup
        return call
