"""The metadata engines by URL: the one place that maps `sqlite:PATH` and
`postgresql://...` to an engine, so that no frontend names a database library."""

from __future__ import annotations

import os

from metadata.engine import MetaEngine

# How long a database server that does not answer is waited for: by a running service
# after it lost its connection, and by default at a service's start (`meta serve --db-wait`).
DB_WAIT_S = 120.0


class EngineURLError(ValueError):
    """A metadata URL that names no engine, or a database that cannot be opened."""


def open_engine(url: str, base_dir: str, wait_s: float = 0.0) -> MetaEngine:
    """The engine for a volume's metadata URL; relative SQLite paths resolve against
    base_dir (the volume directory). `wait_s`: how long a database server that does not
    answer yet is waited for (PostgreSQL; a service's start, not a one-shot command)."""
    if url.startswith("sqlite:"):
        import sqlite3

        from metadata.engines.sqlite import SqliteEngine

        db = url[len("sqlite:") :]
        path = db if os.path.isabs(db) else os.path.join(base_dir, db)
        try:
            return SqliteEngine(path)
        except sqlite3.Error as e:  # e.g. a database this user may not open: one line
            raise EngineURLError(f"cannot open the metadata database {path}: {e}") from None
    if url.startswith(("postgresql://", "postgres://")):
        from metadata.engines.postgres import PostgresEngine

        return PostgresEngine(url, wait_s)
    raise EngineURLError(f"unknown metadata engine URL {url!r}")
