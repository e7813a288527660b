"""Write transactions that the database may roll back to break a conflict, run again.

On PostgreSQL, writers of different checkpoints and of unrelated parts of the
namespace run side by side (postgres.py explains the locks). Locks are taken
in one order (step locks, the chunk gate, then inode rows parents first), but
not every transaction can know every row it will lock up front (a rename
learns what it replaces only after it looked), so two transactions can still
wait for each other. PostgreSQL then rolls one back with a deadlock error
(40P01), as it does with a serialization failure (40001): the standard answer
is to run that transaction again from the start. `retried` does that for an
engine method whose whole transaction failed; a method called inside another
one's transaction lets the error reach the outermost, which runs again whole.

SQLite serializes writers (BEGIN IMMEDIATE): its engine retries nothing.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import xxhash

log = logging.getLogger("ckptfs.meta")

# Named locks (no-ops on SQLite; transaction-scoped advisory locks on PostgreSQL).
RENAME_LOCK = "rename"  # a directory moving to another parent (no cycles)
CHUNK_GATE = "chunk-gate"  # shared: takes chunk references; exclusive: deletes chunk rows
SCHEMA_LOCK = "schema"  # DDL (tables made or changed at open or on first use)

TX_RETRIES = 20  # attempts after the first, then the error reaches the caller
RETRY_DELAY = 0.002  # seconds before the first retry, doubled each time (jittered)
RETRY_DELAY_MAX = 0.2

F = TypeVar("F", bound=Callable[..., Any])


def retried(fn: F) -> F:
    """Run `fn` (an engine method holding one whole transaction) again, after a short
    jittered backoff, when its transaction was rolled back by a conflict the engine
    lists in `_retryable`. Everything `fn` did was rolled back with it, so running it
    again is running it once."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        delay = RETRY_DELAY
        attempt = 0
        while True:
            try:
                return fn(self, *args, **kwargs)
            except self._retryable as e:
                if self._in_tx() or attempt >= TX_RETRIES:
                    raise  # inside another transaction: the outermost method runs again
                attempt += 1
                log.debug("%s: %s; running it again (%d)", fn.__name__, e, attempt)
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, RETRY_DELAY_MAX)

    return wrapper  # type: ignore[return-value]


def lock_key(*parts: object) -> int:
    """A signed 64-bit advisory-lock key for a named thing (a checkpoint step, a global
    lock). Two names sharing a key only make their transactions wait for each other."""
    k = xxhash.xxh64_intdigest("\0".join(map(str, parts)).encode("utf-8", "surrogatepass"))
    return k - (1 << 64) if k >= 1 << 63 else k
