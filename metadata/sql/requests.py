"""Requests applied once: each one's key and outcome, recorded in its own transaction.

A client sends every mutating request with a random key and, when its
connection breaks before the answer came, sends it again with the same key,
to whichever service replica it reaches next (client.py). The outcome of a
key must therefore live where every replica sees it, and change exactly
when the request's effects do: in the database, written by the transaction
that applies the request. `run_once` claims the key first thing in that
transaction (a row in `requests`), runs the engine method inside it, stores
the answer in the claimed row and commits all of it together:

- the first attempt committed: a retry finds the row and gets the stored
  answer, nothing runs again (a create retried after its answer was lost is
  answered with the inode it made, not EEXIST);
- it rolled back (an error, a crash, a killed service): the claim went with
  it, so the retry runs it as new;
- it is still running on another replica: the retry's claim waits on the
  unique key until that transaction ends, then takes one of the two above.

An error is not recorded: a request that failed changed nothing, and its retry
runs again. Keys are kept REQUEST_KEEP_S (the client retries for at most
wire/url.py MAX_RETRY, well within it), then `prune_requests` deletes them.

checkpoint commits (commit_rank) do not go through here: they are idempotent
by content (the rank's digest, in the same transaction as its files), which
answers a retry the same way and costs nothing per request. Nor do methods
that are idempotent as they are (begin, abort, delete_checkpoint, mark_durable,
missing_chunks, ...): see ONCE_METHODS.
"""

from __future__ import annotations

import errno
import time
from typing import Any

from metadata.engine import MetaError
from metadata.sql.needs import SqlCore
from metadata.sql.txlocks import SCHEMA_LOCK, retried
from metadata.wire.protocol import decode, encode

REQUEST_KEEP_S = 900.0  # seconds a request's key and answer are kept

# Mutating methods whose second run would not answer as the first did (EEXIST, ENOENT,
# a count of zero) or would undo someone else's change made in between (a file's
# extents, attributes): a keyed request of these runs through `run_once`.
ONCE_METHODS = frozenset(
    {
        "create", "link", "unlink", "rmdir", "rename", "setattr", "set_xattr",
        "remove_xattr", "commit_file", "purge_orphans", "retain", "apply_retention",
        "gc_chunk_rows", "drop_chunk_rows",
    }
)  # fmt: skip


class KeyReused(MetaError):
    """A request key replayed by another caller, or with another method or arguments: its
    refusal is no outcome of the key (the first caller's retry is still answered)."""


_DDL = [
    "CREATE TABLE IF NOT EXISTS requests (key {blob} PRIMARY KEY, "
    "created BIGINT NOT NULL, result {blob} NOT NULL, binding {blob})",
    "CREATE INDEX IF NOT EXISTS requests_created ON requests (created)",
]


class RequestMixin(SqlCore):
    """Needs SqlEngine's `_tx`, `_read`, `_x`, `_one`, `_lock_named`, `_blob_type`."""

    _req_ready = False

    def _ensure_requests(self, c: Any) -> None:
        """The table, made on first use (volumes made before it need no migration)."""
        if not self._req_ready:
            if not self._has(c, "requests", "*"):  # else no DDL, and no lock to wait for
                self._lock_named(c, SCHEMA_LOCK)
                for stmt in _DDL:
                    self._x(c, stmt.format(blob=self._blob_type()))
            elif not self._has(c, "requests", "binding"):  # a table made before bindings
                self._lock_named(c, SCHEMA_LOCK)
                if not self._has(c, "requests", "binding"):
                    self._x(c, f"ALTER TABLE requests ADD COLUMN binding {self._blob_type()}")
            self._req_ready = True

    @retried
    def run_once(
        self, key: bytes, method: str, args: list, kwargs: dict, binding: bytes = b""
    ) -> Any:
        """Apply `method(*args, **kwargs)` once for `key`: the first committed outcome is
        every later call's answer (module docstring). `binding` says who asked and what
        (server/access.py): a key replayed with another binding is refused (EINVAL), never
        answered with someone else's outcome."""
        if method not in ONCE_METHODS:
            raise MetaError(errno.EINVAL, f"{method} is not run through the request table")
        if not isinstance(key, bytes) or not 8 <= len(key) <= 64:
            raise MetaError(errno.EINVAL, "a request key is 8 to 64 bytes")
        fn = getattr(self, method)
        with self._tx() as c:
            self._ensure_requests(c)
            claim = self._x(
                c,
                "INSERT INTO requests (key, created, result, binding) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (key) DO NOTHING",
                (key, time.time_ns(), b"", binding),
            )
            if claim.rowcount != 1:  # applied before (or just now, elsewhere): its answer
                row = self._one(c, "SELECT result, binding FROM requests WHERE key = ?", (key,))
                if bytes(row[1] or b"") != binding:
                    raise KeyReused(
                        errno.EINVAL,
                        f"{method}: idempotency key reused by another caller, method or arguments",
                    )
                return decode(bytes(row[0]))
            result = fn(*args, **kwargs)
            self._x(c, "UPDATE requests SET result = ? WHERE key = ?", (encode(result), key))
            return result

    @retried
    def prune_requests(self, keep_s: float = REQUEST_KEEP_S) -> int:
        """Forget the requests older than `keep_s` seconds; how many were forgotten."""
        with self._tx() as c:
            self._ensure_requests(c)
            cur = self._x(
                c, "DELETE FROM requests WHERE created < ?", (time.time_ns() - int(keep_s * 1e9),)
            )
            return max(0, cur.rowcount)
