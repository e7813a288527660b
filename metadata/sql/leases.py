"""Leases of chunks in flight: what keeps gc from deleting a writer's uncommitted objects.

A writer stores a new chunk on the nodes (or in its host's tier) before the commit that
registers its row; until then gc's object sweep sees an object with no row. Age alone
(the grace period) lost the chunks of any file open longer than that, and the commit then
registered them as durable: the file was unreadable. Three tables:

- `lease_grants` (granted, expires, ids): `missing_chunks` leases the ids it reports
  missing, in the transaction that answers, under CHUNK_GATE shared, as ONE row holding
  them packed; the writer renews the leases of its uncommitted chunks (`renew_chunk_leases`,
  from the sink's renewal thread) with one more row. Rows are appended (rowid order is
  time order), so a grant writes a page or two, whatever the ids: a row per id, keyed by
  the random id, wrote a page per id, and made "which of these exist?" 20 times dearer
  (4,096 asks of 64 ids: 0.27 s before leases, 5 s with a row per id).
- `lease_ends` (id, at): leases that ended early: the writer gave the chunk up
  (`end_chunk_leases`), or gc deleted the chunk's row (every grant on it predates that
  row: `missing_chunks` leases only ids without one). A grant counts for an id only if it
  came after the id's end.
- `chunk_doomed` (id, deadline): what gc condemned. gc's object sweep asks
  `gc_orphan_objects`, under CHUNK_GATE exclusive, for ids with no chunk row, no journalled
  registration and no live lease, and marks them doomed until `deadline`: gc deletes them
  before it, and not after (it checks its own clock before each delete), then releases
  them (`gc_release_objects`: the deadline becomes now). gc reads the live grants whole
  (the last TTL's, unpacked): gc is rare, asks are not.

A commit naming a new chunk that has no row is refused only when that chunk is doomed: gc
condemned it, so its object may be gone. Nothing else is refused: a lease that lapsed
without gc condemning the chunk left the object where it was, and a chunk that another
rank's commit journalled (no row yet) is as good as registered. Commits do not touch the
leases: the rows they register keep the objects from then on.

Why this shape (issue 38): the first version kept a row per leased id, proved leases at
every commit, per chunk, and ended them there. It refused the second of two processes
storing the same new content in one step (the first commit had ended the shared lease,
and its registration was only in `ref_journal`), and it cost three statements per new
chunk on the commit path: a 4,096-rank publish (262,144 new chunks) went from ~0.3 s to
~1.2 s. Condemnations are rare (objects of failed writers) and recorded apart, so a
commit asks one question when none exists (`SELECT 1 FROM chunk_doomed LIMIT 1`) and
looks ids up only when some do.

Why it holds (both engines; SQLite serializes every writer, PostgreSQL orders these
transactions through CHUNK_GATE): gc deletes an object only after dooming it, and dooms
only with no live lease and no row, under the exclusive gate. A grant, renewal or commit
runs wholly before (then the lease is live, or the row exists, and gc keeps the object) or
wholly after (then it sees the doomed row: no renewal, the commit refuses). A grant
during the hold leaves the doomed row (the writer's put may race gc's delete: its commit is
refused); a grant after the deadline or the release clears it (its put comes after every
delete gc will do). Residual: a writer silent past its lease whose id another writer
re-leased after gc's deadline commits on that writer's put (the other writer was told the
chunk is missing and stores it).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Iterable
from typing import Any

from metadata.engine import MetaError
from metadata.sql.needs import SqlCore
from metadata.sql.txlocks import CHUNK_GATE, retried

LEASE_TTL_S = 1800.0  # a writer renews every RENEW_EVERY_S (sink.py), well within it
LEASE_PURGE_S = 7 * 86400.0  # ended leases and released dooms kept this long
MAX_HOLD_S = 3600.0  # the longest gc may hold content doomed (fusefs/maint/gc.py: 300 s)
MAX_IDS = 1 << 20  # ids in one lease, renewal or gc request


def check_ids(ids: Any, what: str) -> list[bytes]:
    """A client's list of chunk ids, bounded (a list past MAX_IDS is refused, EINVAL)."""
    if not isinstance(ids, list | tuple | set) or len(ids) > MAX_IDS:
        raise MetaError(errno.EINVAL, f"{what}: a list of at most {MAX_IDS} chunk ids")
    if not all(isinstance(cid, bytes) and len(cid) == 16 for cid in ids):
        raise MetaError(errno.EINVAL, f"{what}: chunk ids are 16 bytes")
    return sorted(set(ids))


def _now() -> int:
    return time.time_ns()


def _in_parts(ids: list[bytes], n: int = 500) -> Iterable[tuple[list[bytearray], str]]:
    """(parameters, placeholders) of `... IN (...)` queries over ids, n at a time."""
    for i in range(0, len(ids), n):
        part = [bytearray(cid) for cid in ids[i : i + n]]
        yield part, ",".join("?" * len(part))


class LeaseMixin(SqlCore):
    """Needs SqlEngine's `_tx`, `_x`, `_q`, `_one`, `_lock_named`, `_missing`, `_settle`."""

    lease_ttl_s: float = LEASE_TTL_S

    def _any_doomed(self, c: Any) -> bool:
        return self._one(c, "SELECT 1 FROM chunk_doomed LIMIT 1") is not None

    def _doomed(self, c: Any, ids: list[bytes]) -> dict[bytes, int]:
        """{id: deadline} of the doomed among ids (one indexed look-up per id)."""
        out: dict[bytes, int] = {}
        for part, marks in _in_parts(ids):
            for r in self._x(
                c, f"SELECT id, deadline FROM chunk_doomed WHERE id IN ({marks})", part
            ).fetchall():
                out[bytes(r[0])] = int(r[1])
        return out

    def _grant_leases(self, c: Any, ids: list[bytes], now: int) -> None:
        """Leases on ids a writer was told are missing (caller holds CHUNK_GATE shared): one
        appended row. Doomed ids whose hold is over are cleared; inside the hold they stay
        doomed (gc may still delete the object this writer is about to put)."""
        if not ids:
            return
        ids = sorted(ids)
        if self._any_doomed(c):
            over = [cid for cid, dl in self._doomed(c, ids).items() if dl <= now]
            for part, marks in _in_parts(over):
                self._x(c, f"DELETE FROM chunk_doomed WHERE id IN ({marks})", part)
        self._x(
            c,
            "INSERT INTO lease_grants (granted, expires, ids) VALUES (?, ?, ?)",
            (now, now + int(self.lease_ttl_s * 1e9), b"".join(ids)),
        )

    def _end_leases(self, c: Any, ids: list[bytes], now: int) -> None:
        """The grants made so far no longer count for these ids (one row per id: rare)."""
        c.executemany(
            self._q(
                "INSERT INTO lease_ends (id, at) VALUES (?, ?) "
                "ON CONFLICT (id) DO UPDATE SET at = excluded.at"
            ),
            [(bytearray(cid), now) for cid in sorted(set(ids))],
        )

    def _leased(self, c: Any, ids: set[bytes], now: int) -> set[bytes]:
        """Which of ids hold a live lease: a live grant naming them, made after their end."""
        if not ids:
            return set()
        latest: dict[bytes, int] = {}
        for granted, packed in self._x(
            c, "SELECT granted, ids FROM lease_grants WHERE expires > ?", (now,)
        ).fetchall():
            raw = bytes(packed)
            for k in range(0, len(raw), 16):
                cid = raw[k : k + 16]
                if cid in ids and latest.get(cid, -1) < granted:
                    latest[cid] = int(granted)
        if not latest:
            return set()
        ended: dict[bytes, int] = {}
        for part, marks in _in_parts(sorted(latest)):
            for r in self._x(
                c, f"SELECT id, at FROM lease_ends WHERE id IN ({marks})", part
            ).fetchall():
                ended[bytes(r[0])] = int(r[1])
        return {cid for cid, g in latest.items() if g > ended.get(cid, -1)}

    def _refuse_doomed(self, c: Any, new_ids: Iterable[bytes]) -> None:
        """Refuse a commit's new chunks that gc condemned and nobody registered since: their
        objects may be gone. Runs under CHUNK_GATE shared, before registering. `new_ids`
        is iterated only when something is doomed at all (a generator costs nothing then)."""
        if not self._any_doomed(c):
            return
        doomed = sorted(self._doomed(c, sorted(set(new_ids))))
        lost = sorted(self._missing(c, doomed)) if doomed else []
        if lost:
            raise MetaError(
                errno.EIO,
                f"{len(lost)} new chunk(s), e.g. {lost[0].hex()}, were condemned by gc while "
                "this writer held no live lease on them (their objects may be gone): write "
                "the file again",
            )

    @retried
    def end_chunk_leases(self, ids: list[bytes]) -> None:
        """A writer gives these chunks up (its save failed): their leases end now, so gc
        may collect the objects after the grace period, not the lease's TTL."""
        ids = check_ids(ids, "end_chunk_leases")
        if not ids:
            return
        with self._tx() as c:
            self._lock_named(c, CHUNK_GATE, shared=True)
            self._end_leases(c, ids, _now())

    @retried
    def renew_chunk_leases(self, ids: list[bytes]) -> set[bytes]:
        """Extend the leases of ids still in flight (no row, not doomed) with one more
        grant; answers the others: registered by a commit since (no longer in flight) or
        lost (doomed by gc: the commit will refuse them). A lease that lapsed while gc
        doomed nothing is renewed: its object is where it was."""
        ids = check_ids(ids, "renew_chunk_leases")
        if not ids:
            return set()
        now = _now()
        with self._tx() as c:
            self._lock_named(c, CHUNK_GATE, shared=True)  # not between gc's look and its doom
            live = sorted(self._missing(c, ids))  # no row yet: in flight
            if live and self._any_doomed(c):
                live = sorted(set(live) - set(self._doomed(c, live)))
            if live:
                self._x(
                    c,
                    "INSERT INTO lease_grants (granted, expires, ids) VALUES (?, ?, ?)",
                    (now, now + int(self.lease_ttl_s * 1e9), b"".join(live)),
                )
        return set(ids) - set(live)

    @retried
    def gc_orphan_objects(self, ids: list[bytes], hold_s: float) -> set[bytes]:
        """The ids among these node objects that gc may delete, doomed for `hold_s`
        seconds: no chunk row (journal applied first), no live lease, not doomed by a gc
        still inside its hold. The caller deletes them within hold_s of asking, by its own
        clock, or not at all."""
        ids = check_ids(ids, "gc_orphan_objects")
        if not isinstance(hold_s, int | float) or not 0 < hold_s <= MAX_HOLD_S:
            raise MetaError(errno.EINVAL, f"gc_orphan_objects: hold_s in (0, {MAX_HOLD_S:g}] s")
        now = _now()
        with self._tx() as c:
            self._lock_named(c, CHUNK_GATE)  # no grant, renewal or commit in flight
            self._settle(c)  # journalled registrations are rows
            orphans = sorted(self._missing(c, ids)) if ids else []
            leased = self._leased(c, set(orphans), now)
            held = {cid for cid, dl in self._doomed(c, orphans).items() if dl > now}
            doomed = [cid for cid in orphans if cid not in leased and cid not in held]
            deadline = now + int(hold_s * 1e9)
            c.executemany(
                self._q(
                    "INSERT INTO chunk_doomed (id, deadline) VALUES (?, ?) "
                    "ON CONFLICT (id) DO UPDATE SET deadline = excluded.deadline"
                ),
                [(bytearray(cid), deadline) for cid in doomed],
            )
            # lapsed grants matter to nobody; ends and dooms are kept for late commits
            self._x(c, "DELETE FROM lease_grants WHERE expires <= ?", (now,))
            old = now - int(LEASE_PURGE_S * 1e9)
            self._x(c, "DELETE FROM lease_ends WHERE at < ?", (old,))
            self._x(c, "DELETE FROM chunk_doomed WHERE deadline < ?", (old,))
        return set(doomed)

    @retried
    def gc_release_objects(self, ids: list[bytes]) -> None:
        """gc deleted (or gave up on) these doomed objects: their hold ends now, so a writer
        asking from now on is granted a lease that clears the doom (its put comes after
        every delete), while a commit on a lease granted before stays refused."""
        ids = check_ids(ids, "gc_release_objects")
        if not ids:
            return
        now = _now()
        with self._tx() as c:
            self._lock_named(c, CHUNK_GATE, shared=True)
            c.executemany(
                self._q("UPDATE chunk_doomed SET deadline = ? WHERE id = ? AND deadline > ?"),
                [(now, bytearray(cid), now) for cid in ids],
            )
