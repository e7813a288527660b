"""The SQL side of dump and load (metadata/sql/dump.py): a read snapshot to stream tables out
of, and a bulk loader into an empty database. Shared by both engines; each supplies how a
snapshot connection is opened and how it streams a query (`_snapshot_open`,
`_snapshot_rows`, `_snapshot_has`) and what follows a load (`_after_load`)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from metadata.engine import MetaError
from metadata.sql.dump import code_names
from metadata.sql.needs import SqlCore


class Snapshot:
    """One consistent read view of the database, on a connection of its own, so a dump
    neither blocks the engine's writers nor sees half of one of their transactions."""

    def __init__(self, engine: Any, conn: Any, source: str) -> None:
        self.engine = engine
        self.conn = conn
        self.source = source

    def has_table(self, table: str) -> bool:
        return bool(self.engine._snapshot_has(self.conn, table))

    def columns(self, table: str) -> list[str]:
        cur = self.conn.execute(f"SELECT * FROM {table} LIMIT 0")
        return [d[0] for d in cur.description]

    def rows(self, table: str, cols: list[str], batch: int) -> Iterator[list]:
        sql = f"SELECT {', '.join(cols)} FROM {table}"
        yield from self.engine._snapshot_rows(self.conn, sql, batch)


class Loader:
    """Inserts a dump's rows, one transaction per batch (a huge single transaction would
    hold SQLite's WAL, or PostgreSQL's, at the size of the whole volume)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def rows(self, table: str, cols: list[str], rows: list[list]) -> None:
        """`table` and `cols` are pasted into the statement (both engines' bulk inserts
        name their columns), so the names used are the code's own (code_names: a table of
        DUMP_TABLES, columns its DDL declares), whatever the caller passed; values are
        bound (SQLite) or COPY data (PostgreSQL)."""
        table, names = code_names(table, list(cols))
        eng = self.engine
        with eng._tx() as c:
            eng._bulk_insert(c, table, ", ".join(names), [tuple(r) for r in rows])


class DumpSqlMixin(SqlCore):
    """snapshot() and bulk_loader() for SqlEngine."""

    @contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        conn, source = self._snapshot_open()
        try:
            yield Snapshot(self, conn, source)
        finally:
            conn.close()

    @contextmanager
    def bulk_loader(self) -> Iterator[Loader]:
        """The whole schema made, the database checked empty, then rows go in."""
        with self._tx() as c:
            for stmt in [*self._ddl(), *self._ckpt_ddl()]:
                self._x(c, stmt)
            self._ensure_ur(c)
            if self._one(c, "SELECT 1 FROM config WHERE key = 'volume'") is not None:
                raise MetaError(errno.EEXIST, "the target database already holds a volume")
            if self._one(c, "SELECT 1 FROM inodes LIMIT 1") is not None:
                raise MetaError(errno.EEXIST, "the target database is not empty")
        yield Loader(self)
        with self._tx() as c:
            self._after_load(c)
        self._seed = None  # type: ignore[attr-defined]  # the loaded volume's, when asked

    # -- engine hooks --------------------------------------------------------------
    def _snapshot_open(self) -> tuple[Any, str]:
        raise NotImplementedError

    def _snapshot_has(self, conn: Any, table: str) -> bool:
        raise NotImplementedError

    def _snapshot_rows(self, conn: Any, sql: str, batch: int) -> Iterator[list]:
        raise NotImplementedError

    def _after_load(self, c: Any) -> None:
        """Whatever the engine needs once rows were loaded with their own keys."""
