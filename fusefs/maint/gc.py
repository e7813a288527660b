"""gc: delete unreferenced chunks and orphan objects older than the grace period.

Order matters for safety. Rows go first, in one transaction, and only rows
with refcount 0, no extent pointing at them, and an untouched grace timer
(missing_chunks restarts it when a writer deduplicates against the chunk).
Then objects: an object is deleted only if it is older than the grace period, no kept
backup names it (fusefs/maint/backup.py; backups' own objects stay too), and the metadata
condemns it (`gc_orphan_objects`): no row names it and no writer holds a lease on it. A
writer's uncommitted chunks are leased from the "which exist?" answer until its commit,
however long the file stays open; a lease that lapsed is refused at commit, so no commit
names an object gc may have deleted (metadata/sql/leases.py has the races).

First, gc vouches for the chunk rows scoped writers registered (fusefs/maint/verify.py):
their whole objects then count for every scope's deduplication.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import asdict, dataclass, field

from chunkstore.nodes import NodeError
from fusefs.cli.progress import Progress
from fusefs.client.volume import Volume
from fusefs.maint.backup import BackupError, backup_named, is_backup_id
from fusefs.maint.fsck import DEFAULT_GRACE
from fusefs.maint.verify import verify_chunks
from metadata.engine import MetaError

log = logging.getLogger("ckptfs.gc")

BATCH = 1000
DOOM_S = 300.0  # gc deletes a batch of condemned objects within half of this, or stops


@dataclass
class GcReport:
    rows_deleted: int = 0
    objects_deleted: int = 0
    bytes_freed: int = 0
    young_objects_skipped: int = 0
    tmp_files_deleted: int = 0  # partial replica writes a crash left on directory nodes
    chunks_verified: int = 0  # scoped writers' chunk rows proven stored (verify.py)
    chunks_unproven: int = 0  # ... and left unverified (fewer than R whole replicas)
    errors: list[str] = field(default_factory=list)
    # backup objects on the nodes that are unreadable or ill-formed (planted, or damaged):
    # skipped, not an error of gc's ({"object", "backup", "problem"}, fusefs/maint/backup.py)
    bad_backups: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def gc(vol: Volume, *, grace: float = DEFAULT_GRACE, progress: bool | None = None) -> GcReport:
    if grace < 0:
        raise ValueError(f"grace period must be >= 0 seconds, got {grace}")
    t0 = time.monotonic()
    rep = GcReport()
    try:
        checked = verify_chunks(vol)
        rep.chunks_verified, rep.chunks_unproven = checked.verified, checked.unproven
    except MetaError as e:  # a service older than trust domains: nothing to verify
        if e.errno != errno.ENOSYS:
            raise
    while True:
        gone = vol.meta.gc_chunk_rows(grace)
        rep.rows_deleted += len(gone)
        if len(gone) < 100_000:
            break
    cutoff = time.time() - grace
    with Progress(len(vol.store.nodes), "gc", enabled=progress, unit="nodes") as bar:
        for node in vol.store.nodes:
            try:
                files, nbytes = node.sweep_tmp(cutoff)
                rep.tmp_files_deleted += files
                rep.bytes_freed += nbytes
                old: list[tuple[bytes, int]] = []
                for cid, size, mtime in node.list():
                    if is_backup_id(cid):
                        continue  # a backup's piece: dropped with its backup
                    if mtime < cutoff:
                        old.append((cid, size))
                    else:
                        rep.young_objects_skipped += 1
                # Objects a kept backup names stay (one read of the backups per node)...
                kept = _kept(vol, {cid for cid, _ in old}, rep)
                old = [(cid, size) for cid, size in old if cid not in kept]
                for i in range(0, len(old), BATCH):
                    part = old[i : i + BATCH]
                    # ...and the others are condemned for DOOM_S: no row, no writer's lease
                    # on them, none granted until then (metadata/sql/leases.py); deleted before
                    # the deadline or not at all
                    asked = time.monotonic()
                    doomed = vol.meta.gc_orphan_objects([cid for cid, _ in part], DOOM_S)
                    for cid, size in part:
                        if cid not in doomed:
                            continue
                        if time.monotonic() - asked > DOOM_S / 2:  # margin for clock rates
                            rep.errors.append(f"node {node.name}: batch outlived its hold")
                            break
                        node.delete(cid)
                        rep.objects_deleted += 1
                        rep.bytes_freed += size
                    if doomed:  # done: a writer asking from now on may store them again
                        vol.meta.gc_release_objects(sorted(doomed))
            except NodeError as e:
                rep.errors.append(f"node {node.name}: {e}")
            except BackupError as e:  # a node did not answer: nothing deleted on this one
                rep.errors.append(f"node {node.name}: backups not all readable ({e})")
            bar.update(1)
    rep.seconds = time.monotonic() - t0
    return rep


def _kept(vol: Volume, candidates: set[bytes], rep: GcReport) -> set[bytes]:
    """Objects a kept backup names: its restore would need them (fusefs/maint/backup.py).
    Backups that cannot be read are skipped, and named once in the report."""
    if not candidates:
        return set()
    problems: list[dict] = []
    named = backup_named(vol.store.nodes, candidates, problems)
    seen = {p["object"] for p in rep.bad_backups}
    for p in problems:
        if p["object"] not in seen:
            seen.add(p["object"])
            rep.bad_backups.append(p)
            log.warning("gc: backup object %s skipped: %s", p["object"], p["problem"])
    return named
