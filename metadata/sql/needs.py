"""What the SQL mixins need from each other and from the engine core, stated once.

`SqlEngine` (base.py) is composed of one mixin per concern; each calls helpers that
another part defines: the core's transactions and statements (base.py, with the dialect of
engines/sqlite.py or engines/postgres.py), the chunk accounting's `_missing`, the leases'
`_refuse_doomed` and so on. Every mixin inherits this Protocol instead of declaring its own
`_x: Any` lines, so a type checker sees one contract, and a helper renamed in one place
and not here is one error, not a silent AttributeError in a rarely taken path. Only
annotations: nothing here is defined, so the real methods always win in the MRO.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

Cursor = Any  # a DB-API cursor: sqlite3's or psycopg's


class SqlCore(Protocol):
    # -- the core (base.py) and its dialect (engines/) -----------------------------------
    _tx: Callable[..., AbstractContextManager[Cursor]]  # a write transaction
    _read: Callable[[], AbstractContextManager[Cursor]]  # a read
    _x: Callable[..., Any]  # run a statement written with `?` placeholders
    _one: Callable[..., Any]  # its first row
    _q: Callable[[str], str]  # `?` -> the dialect's placeholders
    _has: Callable[[Cursor, str, str], bool]  # a table ("*") or a column exists
    _blob_type: Callable[[], str]
    _ddl: Callable[[], list[str]]
    _lock_named: Callable[..., None]  # a named lock (txlocks.py), shared or exclusive
    _lock_inodes: Callable[[Cursor, Any], None]
    _lock_steps: Callable[[Cursor, Any], None]
    _chunk_seed: Callable[[], int]
    _getattr: Callable[[Cursor, int], Any]
    _blob: Callable[[Cursor, int], bytes]
    _bulk_insert: Callable[..., None]
    _alloc_inos: Callable[[Cursor, int], list[int]]
    _alloc_one_ino: Callable[[Cursor], int]
    _durable_point: Callable[[], None]
    _start_writeback: Callable[[], None]
    _retryable: tuple[type[BaseException], ...]
    _skip_locked: str
    _for_update: str
    # -- chunk accounting (chunkrefs.py) -----------------------------------------------
    _missing: Callable[[Cursor, list[bytes]], set[bytes]]  # ids with no chunk row
    _settle: Callable[[Cursor], None]  # journalled registrations become rows
    _adjust_refs: Callable[..., None]
    _release_extents: Callable[[Cursor, int], None]
    # -- leases (leases.py) ----------------------------------------------------------------
    _grant_leases: Callable[[Cursor, list[bytes], int], None]
    _refuse_doomed: Callable[[Cursor, Iterable[bytes]], None]
    _end_leases: Callable[[Cursor, list[bytes], int], None]
    # -- checkpoints (checkpoints.py) ------------------------------------------------------
    _ckpt_read: Callable[[], AbstractContextManager[Cursor]]
    _ckpt_ddl: Callable[[], list[str]]
    _step: Callable[..., tuple]
    _brief: Callable[..., dict]
    _blobs: Callable[[Cursor, list[int]], dict[int, bytes]]
    _file_rows: Callable[[Cursor, list[int]], dict[int, tuple[int, bytes]]]
    # -- maintenance (maintenance.py) ------------------------------------------------------
    _ensure_ur: Callable[[Cursor], None]
