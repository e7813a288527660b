"""The embedded SQLite engine (the default): WAL, one connection, one writer at a time.

WAL with synchronous=NORMAL survives a killed process with every committed
transaction (the crash the write-behind tier and the mount care about); a
power cut may lose the last few commits but never corrupts the database.
"""

from __future__ import annotations

import sqlite3
import threading

from metadata.sqlbase import SqlEngine

SCHEMA = [
    "CREATE TABLE IF NOT EXISTS config (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS inodes (
        ino INTEGER PRIMARY KEY, mode INTEGER NOT NULL, nlink INTEGER NOT NULL,
        uid INTEGER NOT NULL, gid INTEGER NOT NULL, size INTEGER NOT NULL,
        atime INTEGER NOT NULL, mtime INTEGER NOT NULL, ctime INTEGER NOT NULL,
        rdev INTEGER NOT NULL DEFAULT 0, generation INTEGER NOT NULL DEFAULT 0,
        target BLOB NOT NULL DEFAULT x'', extents BLOB NOT NULL DEFAULT x'')""",
    """CREATE TABLE IF NOT EXISTS dentries (
        id INTEGER PRIMARY KEY, parent INTEGER NOT NULL, name BLOB NOT NULL,
        ino INTEGER NOT NULL, UNIQUE (parent, name))""",
    "CREATE INDEX IF NOT EXISTS dentries_ino ON dentries (ino)",
    """CREATE TABLE IF NOT EXISTS chunks (
        id BLOB PRIMARY KEY, raw_len INTEGER NOT NULL, stored_len INTEGER NOT NULL,
        refcount INTEGER NOT NULL, state INTEGER NOT NULL, touched INTEGER NOT NULL)
        WITHOUT ROWID""",
    # Chunk references taken by checkpoint commits, applied to `chunks` in bulk off the
    # publish path (sqlbase.apply_pending): new chunks packed as CHK records, refs as the
    # files' packed extents (one reference per extent).
    """CREATE TABLE IF NOT EXISTS ref_journal (
        id INTEGER PRIMARY KEY, job TEXT NOT NULL, step INTEGER NOT NULL,
        rank INTEGER NOT NULL, chunks BLOB NOT NULL, refs BLOB NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS ref_journal_step ON ref_journal (job, step)",
    """CREATE TABLE IF NOT EXISTS xattrs (
        ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL,
        PRIMARY KEY (ino, name)) WITHOUT ROWID""",
]


class SqliteEngine(SqlEngine):
    def __init__(self, path: str) -> None:
        self.path = path
        self._conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=60
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA foreign_keys=OFF")
        self._lock = threading.RLock()
        self._depth = 0

    def _ddl(self) -> list[str]:
        return SCHEMA

    def _begin(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def _end(self, *, commit: bool) -> None:
        self._conn.execute("COMMIT" if commit else "ROLLBACK")

    def close(self) -> None:
        with self._lock:
            self._conn.close()
