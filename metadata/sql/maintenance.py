"""Chunk maintenance queries for fsck, scrub and gc, mixed into SqlEngine.

Kept apart from the namespace SQL because none of it runs on the hot path:
it walks whole tables. Every statement is portable SQL (the SQLite and
PostgreSQL engines share it); the one table it owns, `under_replicated`, is
created on first use so older volumes need no migration.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from metadata.ckptformat import blob_chunk_ids
from metadata.engine import ChunkRow, check_new_chunks
from metadata.sql.needs import SqlCore
from metadata.sql.txlocks import CHUNK_GATE, SCHEMA_LOCK, retried


class MaintenanceMixin(SqlCore):
    """Needs the SqlEngine helpers `_tx`, `_read`, `_x` and `_q`."""

    _ur_ready = False

    # -- dialect --------------------------------------------------------------
    def _blob_type(self) -> str:
        # PostgreSQL's driver style turns `?` into `%s`; its binary type is BYTEA.
        return "BLOB" if self._q("?") == "?" else "BYTEA"  # type: ignore[attr-defined]

    def _ensure_ur(self, c: Any) -> None:
        if self._ur_ready:
            return
        if self._has(c, "under_replicated", "*"):  # type: ignore[attr-defined]
            self._ur_ready = True  # no DDL, and no lock to wait for
            return
        self._lock_named(c, SCHEMA_LOCK)  # type: ignore[attr-defined]
        self._x(  # type: ignore[attr-defined]
            c,
            "CREATE TABLE IF NOT EXISTS under_replicated (chunk "
            f"{self._blob_type()} NOT NULL, node TEXT NOT NULL, since BIGINT NOT NULL, "
            "PRIMARY KEY (chunk, node))",
        )
        self._ur_ready = True

    # -- chunks and references -----------------------------------------------
    def _referenced(self, c: Any) -> Iterable[tuple[int, list[bytes]]]:
        """(ino, chunk id of each extent) for every inode with extents (packed per inode)."""
        rows = self._x(c, "SELECT ino, extents FROM inodes WHERE length(extents) > 0")  # type: ignore[attr-defined]
        for ino, blob in rows.fetchall():
            yield int(ino), blob_chunk_ids(bytes(blob))

    def chunk_rows(self) -> dict[bytes, ChunkRow]:
        """Every chunk row: id -> (raw_len, stored_len, refcount, state, touched)."""
        self.apply_pending()  # type: ignore[attr-defined]  # journalled refs count too
        with self._read() as c:  # type: ignore[attr-defined]
            rows = self._x(  # type: ignore[attr-defined]
                c, "SELECT id, raw_len, stored_len, refcount, state, touched FROM chunks"
            ).fetchall()
        return {bytes(r[0]): ChunkRow(r[1], r[2], r[3], r[4], r[5]) for r in rows}

    @retried
    def true_refcounts(self) -> dict[bytes, int]:
        """References recomputed from the extents (the truth refcounts must match).

        Pending journal entries are applied first, in the same transaction, so
        the counts compare like with like."""
        out: Counter[bytes] = Counter()
        with self._tx() as c:  # type: ignore[attr-defined]
            self._lock_named(c, CHUNK_GATE)  # type: ignore[attr-defined]  # no commit in flight
            self._settle(c)  # type: ignore[attr-defined]
            for _, ids in self._referenced(c):
                out.update(ids)
        return dict(out)

    @retried
    def fix_refcounts(self, counts: dict[bytes, int]) -> int:
        """Set refcounts to recomputed values (touching them, so gc waits a grace period)."""
        if not counts:
            return 0
        now = time.time_ns()
        with self._tx() as c:  # type: ignore[attr-defined]
            self._lock_named(c, CHUNK_GATE)  # type: ignore[attr-defined]  # no commit in flight
            c.executemany(
                self._q("UPDATE chunks SET refcount = ?, touched = ? WHERE id = ?"),  # type: ignore[attr-defined]
                [(n, now, cid) for cid, n in counts.items()],
            )
        return len(counts)

    def files_using(self, ids: Iterable[bytes]) -> dict[bytes, list[int]]:
        """Inodes whose extents reference these chunks (to name what a lost chunk breaks)."""
        want = set(ids)
        out: dict[bytes, list[int]] = {}
        with self._read() as c:  # type: ignore[attr-defined]
            for ino, refs in self._referenced(c):
                for cid in want.intersection(refs):
                    out.setdefault(cid, []).append(ino)
        return out

    def inode_path(self, ino: int) -> str | None:
        """One path of an inode (None for an unlinked one), for messages."""
        path = self.path_of(ino)
        return None if path is None else path.decode(errors="replace")

    def path_of(self, ino: int) -> bytes | None:
        """One path of an inode, exact (None for an unlinked one): what a scoped
        credential's namespace requests are checked against (server/access.py)."""
        names: list[bytes] = []
        with self._read() as c:  # type: ignore[attr-defined]
            for _ in range(4096):
                if ino == 1:
                    return b"/" + b"/".join(reversed(names))
                row = self._x(  # type: ignore[attr-defined]
                    c, "SELECT parent, name FROM dentries WHERE ino = ? LIMIT 1", (ino,)
                ).fetchone()
                if row is None:
                    return None
                ino = row[0]
                names.append(bytes(row[1]))
        return None

    @retried
    def gc_chunk_rows(self, grace_s: float, limit: int = 100_000) -> list[tuple[bytes, int]]:
        """Delete unreferenced chunk rows untouched for `grace_s`; return (id, stored_len).

        A row is deleted only if its refcount is 0 AND no extent points at it
        (a wrong refcount never makes gc destroy live data) AND it was not
        touched within the grace period (a writer that just deduplicated
        against it restarted that timer through missing_chunks).
        """
        cutoff = time.time_ns() - int(grace_s * 1e9)
        cond = "refcount <= 0 AND touched < ?"
        with self._tx() as c:  # type: ignore[attr-defined]
            self._lock_named(c, CHUNK_GATE)  # type: ignore[attr-defined]  # no commit in flight
            # Committed-but-unapplied references count: apply them in this transaction.
            self._settle(c)  # type: ignore[attr-defined]
            rows = self._x(  # type: ignore[attr-defined]
                c, f"SELECT id, stored_len FROM chunks WHERE {cond} LIMIT ?", (cutoff, limit)
            ).fetchall()
            if rows:  # never a chunk some extent still uses, whatever its refcount says
                used = {cid for _, refs in self._referenced(c) for cid in refs}
                rows = [r for r in rows if bytes(r[0]) not in used]
            c.executemany(
                self._q(f"DELETE FROM chunks WHERE id = ? AND {cond}"),  # type: ignore[attr-defined]
                [(r[0], cutoff) for r in rows],
            )
            self._drop_inline(c, [bytes(r[0]) for r in rows])
            # Their leases end with them: `missing_chunks` leases only ids without a row, so
            # every lease on these predates the registration that made the row; a writer
            # still holding one stopped renewing it at that registration, and its commit,
            # if it comes, is refused once gc dooms the object (leases.py). A lease left
            # live would keep gc's object sweep off the object for the rest of its TTL.
            self._end_leases(c, [bytes(r[0]) for r in rows], time.time_ns())
            self._ensure_ur(c)
            c.executemany(
                self._q("DELETE FROM under_replicated WHERE chunk = ?"),  # type: ignore[attr-defined]
                [(r[0],) for r in rows],
            )
        return [(bytes(r[0]), int(r[1])) for r in rows]

    def _drop_inline(self, c: Any, ids: list[bytes]) -> None:
        """The inline bytes of these chunks whose rows are gone (a row kept: bytes kept)."""
        c.executemany(
            self._q(  # type: ignore[attr-defined]
                "DELETE FROM inline_data WHERE id = ? AND NOT EXISTS "
                "(SELECT 1 FROM chunks WHERE chunks.id = inline_data.id)"
            ),
            [(cid,) for cid in ids],
        )

    def known_chunks(self, ids: list[bytes]) -> set[bytes]:
        """Which ids have a chunk row (no grace-timer side effect, unlike missing_chunks)."""
        found: set[bytes] = set()
        self.apply_pending()  # type: ignore[attr-defined]  # journalled chunks are known
        with self._read() as c:  # type: ignore[attr-defined]
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                marks = ",".join("?" * len(part))
                found.update(
                    bytes(r[0])
                    for r in self._x(  # type: ignore[attr-defined]
                        c, f"SELECT id FROM chunks WHERE id IN ({marks})", part
                    ).fetchall()
                )
        return found

    # -- under-replicated chunks ------------------------------------------------
    @retried
    def record_under_replicated(self, cid: bytes, nodes: list[str]) -> None:
        """A degraded write left `cid` without its replica on these placement nodes."""
        now = time.time_ns()
        with self._tx() as c:  # type: ignore[attr-defined]
            self._ensure_ur(c)
            c.executemany(
                self._q(  # type: ignore[attr-defined]
                    "INSERT INTO under_replicated (chunk, node, since) VALUES (?,?,?) "
                    "ON CONFLICT (chunk, node) DO NOTHING"
                ),
                [(cid, n, now) for n in nodes],
            )

    @retried
    def under_replicated(self) -> dict[bytes, set[str]]:
        with self._tx() as c:  # type: ignore[attr-defined]
            self._ensure_ur(c)
            rows = self._x(c, "SELECT chunk, node FROM under_replicated").fetchall()  # type: ignore[attr-defined]
        out: dict[bytes, set[str]] = {}
        for chunk, node in rows:
            out.setdefault(bytes(chunk), set()).add(node)
        return out

    @retried
    def clear_under_replicated(self, pairs: list[tuple[bytes, str]]) -> None:
        if not pairs:
            return
        with self._tx() as c:  # type: ignore[attr-defined]
            self._ensure_ur(c)
            c.executemany(
                self._q("DELETE FROM under_replicated WHERE chunk = ? AND node = ?"),  # type: ignore[attr-defined]
                pairs,
            )

    # -- repairs ---------------------------------------------------------------
    @retried
    def drop_chunk_rows(self, ids: list[bytes]) -> int:
        """Delete these chunk rows if still unreferenced (fsck: a lost, unused chunk)."""
        with self._tx() as c:  # type: ignore[attr-defined]
            self._lock_named(c, CHUNK_GATE)  # type: ignore[attr-defined]  # no commit in flight
            self._settle(c)  # type: ignore[attr-defined]
            used = {cid for _, refs in self._referenced(c) for cid in refs}
            before = self._x(c, "SELECT COUNT(*) FROM chunks").fetchone()[0]  # type: ignore[attr-defined]
            gone = [cid for cid in ids if cid not in used]
            c.executemany(
                self._q("DELETE FROM chunks WHERE id = ? AND refcount <= 0"),  # type: ignore[attr-defined]
                [(cid,) for cid in gone],
            )
            after = self._x(c, "SELECT COUNT(*) FROM chunks").fetchone()[0]  # type: ignore[attr-defined]
            self._drop_inline(c, gone)
        return int(before - after)

    @retried
    def register_chunk_rows(self, chunks: list, refcounts: dict[bytes, int]) -> None:
        """Re-create rows for chunks found on nodes but missing from the table (fsck)."""
        check_new_chunks(chunks, self._chunk_seed())  # type: ignore[attr-defined]
        now = time.time_ns()
        with self._tx() as c:  # type: ignore[attr-defined]
            self._lock_named(c, CHUNK_GATE)  # type: ignore[attr-defined]  # no commit in flight
            self._settle(c)  # type: ignore[attr-defined]
            self._register_chunks(c, chunks, now)  # type: ignore[attr-defined]
            c.executemany(
                self._q("UPDATE chunks SET refcount = ?, touched = ? WHERE id = ?"),  # type: ignore[attr-defined]
                [(refcounts.get(ch.chunk_id, 0), now, ch.chunk_id) for ch in chunks],
            )
