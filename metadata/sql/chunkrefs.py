"""Chunk rows and their reference counts in SQL, mixed into SqlEngine.

A file's extents hold one reference per extent on their chunk. `commit_file`
moves references in the same transaction as the extents; checkpoint commits
journal theirs (`ref_journal`) and `_apply_journal` adds them in bulk off the
publish path. Every reader that needs exact counts applies the journal first.

Trust domains (issue 39). A commit's claim that its new chunks are stored is the
writer's word. A row carries `domain`: NULL when a trusted caller registered it (the
admin, an embedded engine, INLINE bytes, which are checked against their id) or once
a trusted verifier read it back from its nodes (fusefs/maint/verify.py,
`mark_verified`); else the scoped writer's domain (metadata/server/access.py, one per
token scope). `missing_chunks` answers "held" for a trusted row, or for a row of the
caller's own domain: another scope's claim never makes a writer skip storing its data.
A scoped writer also moves only its own domain's rows from STAGED to DURABLE.
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
from metadata.sql.leases import MAX_IDS, check_ids
from metadata.sql.namespace import ATTR_COLS, attr_of
from metadata.sql.needs import SqlCore
from metadata.sql.txlocks import CHUNK_GATE, retried


def _now() -> int:
    return time.time_ns()


def _chunk_key(ch: NewChunk) -> bytes:
    return ch.chunk_id


def check_domain(domain: object) -> int | None:
    """A trust domain: None (trusted) or a positive 31-bit integer (access.py)."""
    if domain is None:
        return None
    if type(domain) is not int or not 0 < domain < 2**31:
        raise MetaError(errno.EINVAL, f"a trust domain is a positive 31-bit integer: {domain!r}")
    return domain


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

    # A row already there adds the references; the rest by who claims (module docstring):
    # UNTRUSTED_ROW's fields take a trusted claim's, and keep the lower state against
    # another domain's claim (a staged chunk is never hidden by someone's durable claim);
    # a trusted row against a trusted claim, or a row against its own domain's claim, keeps
    # the higher state; a trusted row ignores a scoped claim.
    UPSERT_TAIL = (
        "ON CONFLICT (id) DO UPDATE SET "
        "refcount = chunks.refcount + excluded.refcount, touched = excluded.touched, "
        "state = CASE WHEN chunks.domain IS NOT NULL AND excluded.domain IS NULL "
        "THEN excluded.state "
        "WHEN chunks.domain IS NOT NULL AND chunks.domain <> excluded.domain THEN "
        "CASE WHEN excluded.state < chunks.state THEN excluded.state ELSE chunks.state END "
        "WHEN excluded.state > chunks.state AND "
        "(chunks.domain IS NULL) = (excluded.domain IS NULL) THEN excluded.state "
        "ELSE chunks.state END, "
        "raw_len = CASE WHEN chunks.domain IS NOT NULL AND excluded.domain IS NULL "
        "THEN excluded.raw_len ELSE chunks.raw_len END, "
        "stored_len = CASE WHEN chunks.domain IS NOT NULL AND excluded.domain IS NULL "
        "THEN excluded.stored_len ELSE chunks.stored_len END, "
        "domain = CASE WHEN excluded.domain IS NULL THEN NULL ELSE chunks.domain END"
    )
    _UPSERT_CHUNKS = (
        "INSERT INTO chunks (id, raw_len, stored_len, refcount, state, touched, domain) "
        "VALUES (?,?,?,?,?,?,?) " + UPSERT_TAIL
    )

    def _upsert_chunks(self, c: Any, rows: list[tuple]) -> None:
        """New chunk rows (id, raw_len, stored_len, refcount, state, touched, domain), ids
        sorted; a row already there adds the references (UPSERT_TAIL for the rest;
        PostgreSQL: one statement)."""
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
        k_domain = col.get("domain")
        new: dict[bytes, tuple[int, int, int, int | None]] = {}
        refs: Counter[bytes] = Counter()
        for row in rows:
            owned = bytes(row[k_owned]) if k_owned is not None else b""
            dom = row[k_domain] if k_domain is not None else None
            for blob in (row[k_chunks], owned):
                for cid, raw_len, stored_len, st in CHK.iter_unpack(blob):
                    prev = new.get(cid)
                    if prev is None or (
                        (prev[3] is not None and dom is None)  # a trusted claim wins
                        or (st > prev[2] and prev[3] == dom)
                    ):
                        new[cid] = (raw_len, stored_len, st, dom)
            refs.update(blob_chunk_ids(row[k_refs]))
            refs.update([owned[i : i + 16] for i in range(0, len(owned), CHK.size)])
        now = _now()
        if new:
            self._upsert_chunks(
                c,
                [
                    (bytearray(cid), *new[cid][:2], refs.pop(cid, 0), new[cid][2], now, new[cid][3])
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
        domain: int | None = None,
    ) -> Attr:
        """`domain`: the caller's trust domain, set by the service for a scoped
        credential (module docstring); None: trusted."""
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
            self._register_chunks(c, new_chunks, now, check_domain(domain))
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

    def _register_chunks(
        self, c: Any, chunks: list[NewChunk], now: int, domain: int | None = None
    ) -> None:
        """Rows for new chunks, of the caller's `domain` (a trusted caller's claim makes a
        row already there trusted: it did store the chunk, which was missing to it). A row
        already there keeps its state, except:
        - a chunk only staged so far (in one host's write-behind tier) is durable once a
          writer stored it on the nodes, and INLINE once a commit brings its bytes: the
          metadata copy makes it durable at once, where dropping the bytes left this
          fsync'd file in the hands of that host's tier (a test lost it with the host);
        - a chunk already on the nodes (or INLINE) takes no copy of the bytes.
        So `inline_data` holds bytes exactly for INLINE rows, and a reader never has two
        copies to choose between. A scoped writer's DURABLE claim moves only its own
        domain's STAGED rows; INLINE bytes (checked against their id) are trusted."""
        if not chunks:
            return
        chunks = sorted(chunks, key=_chunk_key)  # rows locked in one order by every writer
        c.executemany(
            self._q(
                "INSERT INTO chunks (id, raw_len, stored_len, refcount, state, touched, domain) "
                "VALUES (?,?,?,0,?,?,?) ON CONFLICT (id) DO UPDATE SET "
                # a row another domain registered, unverified: a trusted claim replaces it
                # (INLINE bytes too: a claim of "on the nodes" may be false); another
                # scoped claim keeps the lower state. Otherwise as DO NOTHING.
                "state = CASE WHEN excluded.domain IS NULL THEN excluded.state "
                "WHEN excluded.state < chunks.state THEN excluded.state "
                "ELSE chunks.state END, "
                "raw_len = CASE WHEN excluded.domain IS NULL THEN excluded.raw_len "
                "ELSE chunks.raw_len END, "
                "stored_len = CASE WHEN excluded.domain IS NULL THEN excluded.stored_len "
                "ELSE chunks.stored_len END, "
                "domain = CASE WHEN excluded.domain IS NULL THEN NULL ELSE chunks.domain END "
                "WHERE chunks.domain IS NOT NULL AND "
                "(excluded.domain IS NULL OR chunks.domain <> excluded.domain)"
            ),
            [
                (
                    ch.chunk_id,
                    ch.raw_len,
                    ch.stored_len,
                    ch.state,
                    now,
                    None if ch.state == INLINE else domain,
                )
                for ch in chunks
            ],  # fmt: skip
        )
        durable = [ch.chunk_id for ch in chunks if ch.state == DURABLE]
        self._from_staged(c, durable, DURABLE, domain=domain)
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

    def _from_staged(
        self, c: Any, ids: list[bytes], state: int, also: str = "", *, domain: int | None = None
    ) -> None:
        """Move the STAGED rows among `ids` to `state` (DURABLE: on their nodes; INLINE:
        their bytes in the metadata), setting `also` with it. A row in any other state
        keeps it: an INLINE row never changes, a DURABLE one is never demoted. A scoped
        caller (`domain`) moves only its own domain's rows."""
        if ids:
            ids = sorted(ids)
            mine = "" if domain is None else f" AND domain = {int(domain)}"
            c.executemany(
                self._q(
                    f"UPDATE chunks SET state = {state}{also} WHERE id = ? "
                    f"AND state = {STAGED}{mine}"
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

    def _missing(
        self, c: Any, ids: list[bytes], *, domain: int | None | bool = False
    ) -> set[bytes]:
        """The ids with no row; with `domain` (None: a trusted caller's), also those whose
        row another domain registered and no one verified (module docstring)."""
        found: set[bytes] = set()
        mine = "" if domain is False else f" AND (domain IS NULL OR domain = {int(domain or 0)})"
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            marks = ",".join("?" * len(part))
            found.update(
                bytes(r[0])
                for r in self._x(
                    c, f"SELECT id FROM chunks WHERE id IN ({marks}){mine}", part
                ).fetchall()
            )
        return set(ids) - found

    @retried
    def missing_chunks(self, ids: list[bytes], domain: int | None = None) -> set[bytes]:
        """`domain`: the caller's trust domain (the service sets it for a scoped
        credential); a row of another domain not yet verified counts as missing."""
        ids = list(dict.fromkeys(check_ids(ids, "missing_chunks")))
        domain = check_domain(domain)
        with self._tx() as c:
            # gc is not between the look and the touch (a chunk found is one it keeps)
            self._lock_named(c, CHUNK_GATE, shared=True)
            missing = self._missing(c, ids, domain=domain)
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
    def mark_durable(
        self, ids: list[bytes], stored_lens: list[int] | None = None, domain: int | None = None
    ) -> None:
        """STAGED chunks are on their nodes now. Only STAGED ones change: an INLINE row
        stays INLINE even if some host also uploaded those bytes (a writer that staged the
        same content before the inline commit): its bytes are in the metadata either way,
        and fsck must not look for it on the nodes. A scoped caller (`domain`) changes
        only its own domain's rows: another scope's staged chunk is not its to declare."""
        domain = check_domain(domain)
        mine = "" if domain is None else f" AND domain = {domain}"
        with self._tx() as c:
            self._settle(c)  # a journalled chunk's row must exist, or the update is lost
            if stored_lens is not None:  # compressed at upload: the size on the nodes
                c.executemany(
                    self._q(
                        f"UPDATE chunks SET stored_len = ? WHERE id = ? AND state = {STAGED}{mine}"
                    ),
                    [(n, i) for i, n in sorted(zip(ids, stored_lens, strict=True)) if n > 0],
                )
            self._from_staged(c, ids, DURABLE, domain=domain)

    # -- verification (fusefs/maint/verify.py, admin) ------------------------------
    def unverified_chunks(self, after: bytes = b"", limit: int = 1000) -> list[bytes]:
        """Up to `limit` ids past `after`, in id order, of rows a scoped writer registered
        and no one verified (read through an index of only those rows)."""
        if type(limit) is not int or not 0 < limit <= MAX_IDS:
            raise MetaError(errno.EINVAL, f"unverified_chunks: limit must be 1..{MAX_IDS}")
        if not isinstance(after, bytes) or len(after) > 16:
            raise MetaError(errno.EINVAL, "unverified_chunks: after is a chunk id")
        self.apply_pending()
        with self._read() as c:
            rows = self._x(
                c,
                "SELECT id FROM chunks WHERE domain IS NOT NULL AND id > ? "
                f"AND state <> {INLINE} ORDER BY id LIMIT ?",
                (after, limit),
            ).fetchall()
        return [bytes(r[0]) for r in rows]

    @retried
    def mark_verified(self, ids: list[bytes]) -> int:
        """Rows whose objects a trusted verifier read back whole from R nodes: DURABLE, and
        counted for every domain's deduplication from now on. Returns how many changed."""
        ids = sorted(set(check_ids(ids, "mark_verified")))
        n = 0
        with self._tx() as c:
            for i in ids:
                n += self._x(
                    c,
                    f"UPDATE chunks SET domain = NULL, state = {DURABLE} WHERE id = ? "
                    f"AND domain IS NOT NULL AND state <> {INLINE}",
                    (i,),
                ).rowcount
        return n

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
