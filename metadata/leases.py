"""Leases of chunks in flight: what keeps gc from deleting a writer's uncommitted objects.

A writer stores a new chunk on the nodes (or in its host's tier) before the commit that
registers its row; until then gc's object sweep sees an object with no row. Age alone
(the grace period) lost the chunks of any file open longer than that, and the commit then
registered them as durable: the file was unreadable. So:

- `missing_chunks` grants a lease on every id it reports missing (expires = now +
  lease_ttl_s), in the transaction that answers, under CHUNK_GATE shared;
- the writer renews the leases of its uncommitted chunks (`renew_chunk_leases`, from the
  sink's renewal thread) while the file stays open; a lease that lapsed or that gc
  condemned is not renewed (the writer learns it is lost);
- gc's object sweep asks `gc_orphan_objects`, under CHUNK_GATE exclusive: ids with no
  chunk row, no journalled registration and no live lease. In the same transaction it
  condemns them: their lease row becomes `-deadline` (gc deletes them before `deadline`,
  and not after: it checks its own clock before each delete). A grant or renewal meets a
  condemned row and leaves it condemned (the writer's put may race gc's delete), until
  the deadline has passed (no delete can follow), when a grant revives it;
- a commit naming a new chunk that has no row refuses it when its lease row is expired or
  condemned: the object may be gone. One clear error, never an unreadable file.

Why it holds (both engines; SQLite serializes every writer, PostgreSQL orders these
transactions through CHUNK_GATE and the lease row's own lock): gc deletes an object only
after condemning it, and condemns only with no live lease, under the exclusive gate; a
grant, renewal or commit runs wholly before (then the lease is live and gc keeps the
object) or wholly after (then it sees the condemned row: no grant, no renewal, the commit
refuses). gc deletes only before the deadline, so a lease revived after it is never
followed by a delete. A writer that asked nothing (no lease row) is outside the protocol:
its commit is accepted as before (every frontend asks, through ChunkSink.missing).
Residual: a writer silent past its lease whose id another writer re-leased after gc's
deadline commits on that writer's put (documented in the report).
"""

from __future__ import annotations

import errno
import time
from typing import Any

from metadata.engine import INLINE, MetaError, NewChunk
from metadata.txlocks import CHUNK_GATE, retried

LEASE_TTL_S = 1800.0  # a writer renews every RENEW_EVERY_S (sink.py), well within it
LEASE_PURGE_S = 7 * 86400.0  # lapsed lease rows kept this long (a late commit is refused)


def _now() -> int:
    return time.time_ns()


class LeaseMixin:
    """Needs SqlEngine's `_tx`, `_x`, `_q`, `_has`, `_lock_named`, `_missing`."""

    _tx: Any
    _x: Any
    _q: Any
    _has: Any
    _lock_named: Any
    _missing: Any
    _settle: Any
    lease_ttl_s: float = LEASE_TTL_S

    def _ensure_leases(self, c: Any) -> None:
        """The table is part of the schema (made at format, or at open for an older
        volume: SqlEngine.TABLES_ADDED), never here: DDL inside a writer's transaction
        held the schema lock for every other writer until it ended."""

    def _lease_rows(self, c: Any, ids: list[bytes]) -> dict[bytes, int]:
        out: dict[bytes, int] = {}
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            marks = ",".join("?" * len(part))
            for r in self._x(
                c, f"SELECT id, expires FROM chunk_leases WHERE id IN ({marks})", part
            ).fetchall():
                out[bytes(r[0])] = int(r[1])
        return out

    def _grant_leases(self, c: Any, ids: list[bytes], now: int) -> None:
        """Leases on ids a writer was told are missing (caller holds CHUNK_GATE shared). A
        condemned row stays condemned until its deadline (gc may still delete)."""
        if not ids:
            return
        self._ensure_leases(c)
        expires = now + int(self.lease_ttl_s * 1e9)
        c.executemany(
            self._q(
                "INSERT INTO chunk_leases (id, expires) VALUES (?, ?) ON CONFLICT (id) DO "
                "UPDATE SET expires = excluded.expires "
                "WHERE chunk_leases.expires >= 0 OR chunk_leases.expires > ?"
            ),
            [(bytearray(cid), expires, -now) for cid in sorted(ids)],
        )

    def _check_leases(self, c: Any, chunks: list[NewChunk] | list[bytes], now: int) -> None:
        """Refuse new chunks whose objects gc may have deleted: no row yet, and a lease that
        lapsed or that gc condemned. Runs under CHUNK_GATE shared, before registering.
        `chunks`: NewChunk records (INLINE ones carry their bytes: exempt) or bare ids."""
        ids = sorted(
            {ch if isinstance(ch, bytes) else ch.chunk_id for ch in chunks}
            - {ch.chunk_id for ch in chunks if not isinstance(ch, bytes) and ch.state == INLINE}
        )
        if not ids:
            return
        self._ensure_leases(c)
        unregistered = sorted(self._missing(c, ids))
        lost = [cid for cid, exp in self._lease_rows(c, unregistered).items() if exp <= now]
        if lost:
            raise MetaError(
                errno.EIO,
                f"{len(lost)} new chunk(s), e.g. {lost[0].hex()}, were stored under a lease "
                "that lapsed or gc condemned (their objects may be gone): write the file again",
            )
        # Registered by this commit: their rows (or journal entries) keep them from now on,
        # and the leases end, so once unreferenced they go after the grace period. Lapsed,
        # not deleted: another writer still holding one is refused if the row goes first.
        c.executemany(
            self._q("UPDATE chunk_leases SET expires = 0 WHERE id = ? AND expires > 0"),
            [(bytearray(cid),) for cid in ids],
        )

    @retried
    def end_chunk_leases(self, ids: list[bytes]) -> None:
        """A writer gives these chunks up (its save failed): their live leases lapse now,
        so gc may collect the objects after the grace period, not the lease's TTL. A
        commit naming one later is refused, as for any lapsed lease."""
        self._lapse(ids, "expires > 0")

    @retried
    def renew_chunk_leases(self, ids: list[bytes]) -> set[bytes]:
        """Extend the live leases among ids; answers the ids not renewed (registered by a
        commit since, so no longer in flight, or lost: lapsed or condemned by gc)."""
        ids = sorted(set(ids))
        if not ids:
            return set()
        now = _now()
        with self._tx() as c:
            self._lock_named(c, CHUNK_GATE, shared=True)  # not between gc's look and its doom
            self._ensure_leases(c)
            live = [cid for cid, exp in self._lease_rows(c, ids).items() if exp > now]
            live = sorted(set(live) & set(self._missing(c, live)))  # no row yet: in flight
            expires = now + int(self.lease_ttl_s * 1e9)
            c.executemany(
                self._q("UPDATE chunk_leases SET expires = ? WHERE id = ?"),
                [(expires, bytearray(cid)) for cid in live],
            )
        return set(ids) - set(live)

    @retried
    def gc_orphan_objects(self, ids: list[bytes], hold_s: float) -> set[bytes]:
        """The ids among these node objects that gc may delete, condemned for `hold_s`
        seconds: no chunk row (journal applied first), no live lease. The caller deletes
        them within hold_s of asking, by its own clock, or not at all."""
        ids = sorted(set(ids))
        now = _now()
        with self._tx() as c:
            self._lock_named(c, CHUNK_GATE)  # no grant, renewal or commit in flight
            self._settle(c)  # journalled registrations are rows
            self._ensure_leases(c)
            orphans = sorted(self._missing(c, ids)) if ids else []
            rows = self._lease_rows(c, orphans)
            # live, or condemned by a gc still inside its deadline: not ours to delete
            doomed = [
                cid for cid in orphans if not (rows.get(cid, 0) > now or -rows.get(cid, 0) > now)
            ]
            deadline = now + int(hold_s * 1e9)
            c.executemany(
                self._q(
                    "INSERT INTO chunk_leases (id, expires) VALUES (?, ?) "
                    "ON CONFLICT (id) DO UPDATE SET expires = excluded.expires"
                ),
                [(bytearray(cid), -deadline) for cid in doomed],
            )
            old = now - int(LEASE_PURGE_S * 1e9)
            self._x(
                c,
                "DELETE FROM chunk_leases WHERE (expires >= 0 AND expires < ?) "
                "OR (expires < 0 AND expires > ?)",
                (old, -old),
            )
        return set(doomed)

    @retried
    def gc_release_objects(self, ids: list[bytes]) -> None:
        """gc deleted (or gave up on) these condemned objects: their rows become lapsed
        leases, so a writer asking now is granted one (its put comes after every delete),
        while a commit on a lease granted during the hold is still refused."""
        self._lapse(ids, "expires < 0")

    def _lapse(self, ids: list[bytes], which: str) -> None:
        """Leases of these ids matching `which` (live: "expires > 0"; condemned: "expires
        < 0") become lapsed, in a transaction of their own under the shared chunk gate."""
        ids = sorted(set(ids))
        if not ids:
            return
        with self._tx() as c:
            self._lock_named(c, CHUNK_GATE, shared=True)
            self._ensure_leases(c)
            c.executemany(
                self._q(f"UPDATE chunk_leases SET expires = 0 WHERE id = ? AND {which}"),
                [(bytearray(cid),) for cid in ids],
            )
