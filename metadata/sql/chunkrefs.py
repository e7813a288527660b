"""Chunk rows and their reference counts in SQL, mixed into SqlEngine.

A file's extents hold one reference per extent on their chunk. `commit_file`
moves references in the same transaction as the extents; checkpoint commits
journal theirs (`ref_journal`) and `_apply_journal` adds them in bulk off the
publish path. Every reader that needs exact counts applies the journal first.
"""

from __future__ import annotations

import dataclasses
import errno
import stat
import time
from collections import Counter
from typing import Any

from metadata.ckptformat import CHK, blob_chunk_ids, pack_extents, unpack_extents
from metadata.engine import (
    DURABLE,
    INLINE,
    STAGED,
    Attr,
    Extent,
    MetaError,
    NewChunk,
    UnknownChunks,
    VolumeStats,
    check_extents,
    check_new_chunks,
)
from metadata.sql.leases import check_ids
from metadata.sql.namespace import ATTR_COLS, attr_of
from metadata.sql.needs import SqlCore
from metadata.sql.txlocks import CHUNK_GATE, retried


def _now() -> int:
    return time.time_ns()


def _chunk_key(ch: NewChunk) -> bytes:
    return ch.chunk_id


class ChunkRefMixin(SqlCore):
    """Needs SqlEngine's `_tx`, `_read`, `_x`, `_one`, `_q`, `_blob` and `_chunk_seed`."""

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
        self._add_refs(c, rows, now)

    def _add_refs(self, c: Any, rows: list[tuple[bytes, int]], now: int) -> None:
        """refcount += d for each (id, d), ids sorted (PostgreSQL: one statement)."""
        c.executemany(
            self._q("UPDATE chunks SET refcount = refcount + ?, touched = ? WHERE id = ?"),
            [(d, now, bytearray(cid)) for cid, d in rows],  # see _bulk_insert
        )

    _UPSERT_CHUNKS = (
        "INSERT INTO chunks (id, raw_len, stored_len, refcount, state, touched) "
        "VALUES (?,?,?,?,?,?) ON CONFLICT (id) DO UPDATE SET "
        "refcount = chunks.refcount + excluded.refcount, touched = excluded.touched, "
        "state = CASE WHEN excluded.state > chunks.state THEN excluded.state "
        "ELSE chunks.state END"
    )

    def _upsert_chunks(self, c: Any, rows: list[tuple]) -> None:
        """New chunk rows (id, raw_len, stored_len, refcount, state, touched), ids sorted;
        a row already there adds the references and keeps the higher state (PostgreSQL:
        one statement)."""
        c.executemany(self._q(self._UPSERT_CHUNKS), rows)

    # -- pending references (the journal checkpoint commits write) -------------
    def _settle(self, c: Any) -> None:
        """Apply every pending journal entry inside the caller's write transaction (on
        PostgreSQL, after waiting for whoever is applying some of them: a row another
        transaction applied and deleted meanwhile is no longer there to apply twice)."""
        if self._one(c, "SELECT 1 FROM ref_journal LIMIT 1") is not None:
            self._apply_journal(c, None)

    def _apply_journal(self, c: Any, limit: int | None, *, skip_locked: bool = False) -> int:
        """Register journalled new chunks and add their references, in bulk, sorted by id.

        The rows read are locked (PostgreSQL: FOR UPDATE, or with `skip_locked` only the
        ones nobody else is applying) and deleted by their exact ids, so two services
        applying at once never apply a row twice, and a row committed meanwhile with an
        id inside the range read is left for later, not deleted unapplied.

        `SELECT *`: a volume made before the `owned` column reads the same until its
        first checkpoint transaction adds it (`_ckpt_tx`)."""
        sql = "SELECT * FROM ref_journal ORDER BY id" + (" LIMIT ?" if limit else "")
        sql += self._skip_locked if skip_locked else self._for_update
        cur = self._x(c, sql, (limit,) if limit else ())
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
            self._upsert_chunks(
                c,
                [
                    (bytearray(cid), *new[cid][:2], refs.pop(cid, 0), new[cid][2], now)
                    for cid in sorted(new)
                ],  # bytearrays: see _bulk_insert
            )
        self._adjust_refs(c, refs, settle=False)
        ids = [r[col["id"]] for r in rows]
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            self._x(c, f"DELETE FROM ref_journal WHERE id IN ({','.join('?' * len(part))})", part)
        return len(rows)

    @retried
    def apply_pending(self, limit: int | None = None) -> int:
        """Apply up to `limit` journal entries (all if None); returns how many remain.

        The service runs this in the background between group commits; embedded
        engines reach it through stats, chunk_info, gc and fsck (and `_settle`).
        """
        with self._read() as c:
            if self._one(c, "SELECT 1 FROM ref_journal LIMIT 1") is None:
                return 0
        with self._tx() as c:  # a slice takes rows no other service is applying
            self._apply_journal(c, limit, skip_locked=limit is not None)
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

    # -- data ----------------------------------------------------------------
    def get_extents(self, ino: int) -> list[Extent]:
        with self._read() as c:
            return unpack_extents(self._blob(c, ino))

    @retried
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
            # Takes references: no gc deletes a chunk row between the check that every
            # referenced chunk exists and the commit (CHUNK_GATE), and no other commit of
            # this file computes its reference changes from the same old extents.
            self._lock_named(c, CHUNK_GATE, shared=True)
            self._lock_inodes(c, (ino,))
            row = self._one(c, f"SELECT {ATTR_COLS}, extents FROM inodes WHERE ino = ?", (ino,))
            if row is None:
                raise MetaError(errno.ENOENT, f"no inode {ino}")
            a = attr_of(row[:-1])
            if not a.is_reg:
                raise MetaError(errno.EISDIR if a.is_dir else errno.EINVAL, "not a regular file")
            now = _now()
            # none gc may have deleted (leases.py); INLINE ones carry their bytes
            self._refuse_doomed(c, (ch.chunk_id for ch in new_chunks if ch.state != INLINE))
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
        chunks = sorted(chunks, key=_chunk_key)  # rows locked in one order by every writer
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
            ids = sorted(ids)
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

    @retried
    def missing_chunks(self, ids: list[bytes]) -> set[bytes]:
        ids = list(dict.fromkeys(check_ids(ids, "missing_chunks")))
        with self._tx() as c:
            # gc is not between the look and the touch (a chunk found is one it keeps)
            self._lock_named(c, CHUNK_GATE, shared=True)
            missing = self._missing(c, ids)
            now = _now()
            self._grant_leases(c, list(missing), now)  # gc keeps them until commit (leases.py)
            present = [(now, cid) for cid in sorted(ids) if cid not in missing]
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

    @retried
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
                    [(n, i) for i, n in sorted(zip(ids, stored_lens, strict=True)) if n > 0],
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
