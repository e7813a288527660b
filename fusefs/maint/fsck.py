"""fsck: compare what metadata says with what the object nodes hold, and repair.

One pass, three sources of truth:
  - the chunk rows (id, stored length, refcount, state) and the extents (true refcounts),
  - a listing of every node,
  - (with verify) the replicas themselves, checked with codec.verify.

Problem kinds (each entry of `problems` in the JSON report):
  missing_replica    a placement node lacks a durable chunk   -> copied from a good replica
  corrupt_replica    a replica fails verification            -> rewritten from a good one
  extra_replica      a good copy off its placement nodes (a hinted-handoff copy, or a node
                     change) once every placement replica is good -> deleted
  dangling_extent    extents reference a chunk no node holds, or that has no row
                                                               -> unrepairable (names files),
                     unless the object is found, then its row is re-registered
  lost_chunk         an unreferenced row whose object is nowhere -> row dropped
  refcount_mismatch  stored refcount != references from extents  -> set to the true count
  orphan_object      an object with no chunk row, older than the grace period -> deleted
  bad_inline         an inline chunk (bytes in the metadata) whose bytes are missing or do
                     not match its id                     -> unrepairable (names files)
  node_unreachable   a node could not be listed             -> unrepairable now

Objects without a row that are younger than the grace period belong to writers
in flight (stored, not yet committed): counted, never touched. Chunks only
staged in a host's write-behind tier are not expected on the nodes yet, nor are
inline ones, whose bytes are in the metadata (checked against their ids instead).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from chunkstore import codec
from chunkstore.ids import chunk_id
from chunkstore.nodes import NodeError, ObjectNode
from fusefs.cli.progress import Progress
from fusefs.client.volume import Volume
from fusefs.maint.backup import backup_named, is_backup_id
from metadata.engine import DURABLE, INLINE, STAGED, NewChunk

DEFAULT_GRACE = 3600.0  # seconds an unreferenced chunk or row-less object is left alone
THREADS = 16  # node round trips overlap (S3 latency), verification runs in parallel


@dataclass
class Problem:
    kind: str
    detail: str
    chunk: str | None = None
    node: str | None = None
    repaired: bool = False
    why_not: str | None = None  # set when --repair could not fix it
    files: list[str] | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    chunks: int = 0
    objects: int = 0
    replicas_read: int = 0
    bytes_read: int = 0
    young_objects: int = 0
    staged: int = 0  # chunks only in a host's write-behind tier so far (not expected on nodes)
    inline: int = 0  # chunks whose bytes are in the metadata (not expected on nodes)
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, p: Problem) -> Problem:
        with self._lock:
            self.problems.append(p)
        return p

    def count_read(self, n: int) -> None:
        with self._lock:
            self.replicas_read += 1
            self.bytes_read += n

    @property
    def remaining(self) -> list[Problem]:
        return [p for p in self.problems if not p.repaired]

    def as_dict(self) -> dict:
        kinds: dict[str, int] = {}
        for p in self.problems:
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
        return {
            "problems": [p.as_dict() for p in self.problems],
            "by_kind": kinds,
            "remaining": len(self.remaining),
            "repaired": sum(p.repaired for p in self.problems),
            "chunks": self.chunks,
            "objects": self.objects,
            "replicas_read": self.replicas_read,
            "bytes_read": self.bytes_read,
            "young_objects_skipped": self.young_objects,
            "staged_chunks": self.staged,
            "inline_chunks": self.inline,
            "seconds": round(self.seconds, 3),
        }


class RateLimit:
    """Token bucket over bytes read, shared by the worker threads (scrub --rate)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        delay = start - now
        if delay > 0:
            time.sleep(delay)


def list_nodes(vol: Volume, report: Report) -> dict[str, dict[bytes, tuple[int, float]]]:
    """{node name: {chunk id: (size, mtime)}} for every node that answered."""
    out: dict[str, dict[bytes, tuple[int, float]]] = {}

    def one(node: ObjectNode) -> None:
        try:
            out[node.name] = {
                cid: (size, mt) for cid, size, mt in node.list() if not is_backup_id(cid)
            }  # a backup's objects are no chunks (fusefs/maint/backup.py)
        except (NodeError, OSError) as e:
            report.add(
                Problem(
                    "node_unreachable",
                    f"cannot list node {node.name}: {e}",
                    node=node.name,
                    why_not="node did not answer",
                )
            )

    with ThreadPoolExecutor(len(vol.store.nodes)) as ex:
        list(ex.map(one, vol.store.nodes))
    return out


class _Checker:
    """Per-chunk replica checks, run from a thread pool."""

    def __init__(
        self, vol: Volume, report: Report, listings, *, repair: bool, verify: bool, rate: RateLimit
    ) -> None:
        self.vol = vol
        self.store = vol.store
        self.report = report
        self.listings = listings
        self.repair = repair
        self.verify = verify
        self.rate = rate
        self.by_name = {n.name: n for n in vol.store.nodes}
        self.healed: list[bytes] = []  # chunks whose placement is now complete
        self.lost: list[bytes] = []  # chunks with no good replica anywhere
        self._lock = threading.Lock()

    def _read_ok(
        self, node: ObjectNode, cid: bytes, raw_len: int | None
    ) -> tuple[bytes | None, str]:
        """(blob, "") for a replica that verifies, (None, reason) otherwise."""
        try:
            blob = node.get(cid)
        except NodeError as e:
            return None, f"unreadable: {e}"
        self.rate.take(len(blob))
        self.report.count_read(len(blob))
        try:
            codec.verify(blob)
            _, _, rl = codec.header_info(blob)
            if raw_len is not None and rl != raw_len:
                raise codec.ChunkFormatError(f"raw length {rl}, metadata says {raw_len}")
        except codec.ChunkFormatError as e:
            return None, str(e)
        return blob, ""

    def check(self, cid: bytes, raw_len: int | None, durable: bool = True) -> None:
        """Verify a chunk's replicas on the nodes. A chunk not yet durable is still staged
        on a host and its upload may have stopped half-way (a crash): the copies present
        are checked, the ones not there yet are not missing."""
        h = cid.hex()
        holders = [self.by_name[n] for n, objs in self.listings.items() if cid in objs]
        placement = self.store.placement(cid)
        good: dict[str, bytes | None] = {}
        fixes: list[Problem] = []
        for node in holders:
            if not self.verify:
                good[node.name] = None
                continue
            blob, why = self._read_ok(node, cid, raw_len)
            if blob is not None:
                good[node.name] = blob
            else:
                fixes.append(
                    Problem(
                        "corrupt_replica",
                        f"replica of {h} on {node.name}: {why}",
                        chunk=h,
                        node=node.name,
                    )
                )
        bad = {p.node for p in fixes}
        for n in placement if durable else ():
            if n.name in self.listings and n.name not in good and n.name not in bad:
                fixes.append(
                    Problem(
                        "missing_replica", f"chunk {h} missing on {n.name}", chunk=h, node=n.name
                    )
                )
        for p in fixes:
            self.report.add(p)
        if not good:
            if not durable:
                return  # the staged copy on its host is the one the upload will use
            with self._lock:
                self.lost.append(cid)
            for p in fixes:
                p.why_not = "no good replica left to copy from"
            return
        if self.repair and fixes:
            blob = self._source_blob(cid, good, raw_len)
            for p in fixes:
                node = self.by_name[p.node]  # type: ignore[index]
                if blob is None:
                    p.why_not = "no replica verified on re-read"
                    continue
                try:
                    node.put(cid, blob)
                    p.repaired = True
                    good[node.name] = blob
                except NodeError as e:
                    p.why_not = f"rewrite failed: {e}"
        if not all(n.name in good for n in placement):
            return  # keep every off-placement copy until the placement is whole
        with self._lock:
            self.healed.append(cid)
        home = {n.name for n in placement}
        for name in [n for n in good if n not in home]:
            p = self.report.add(
                Problem(
                    "extra_replica",
                    f"chunk {h} has a copy off its placement on {name}",
                    chunk=h,
                    node=name,
                )
            )
            if not self.repair:
                continue
            try:
                self.by_name[name].delete(cid)
                p.repaired = True
            except NodeError as e:
                p.why_not = f"delete failed: {e}"

    def _source_blob(self, cid: bytes, good: dict[str, bytes | None], raw_len) -> bytes | None:
        for name, blob in good.items():
            if blob is not None:
                return blob
            blob, _ = self._read_ok(self.by_name[name], cid, raw_len)
            if blob is not None:
                return blob
        return None


def check_volume(
    vol: Volume,
    *,
    repair: bool = False,
    verify: bool = True,
    grace: float = DEFAULT_GRACE,
    consistency: bool = True,
    rate_mbps: float | None = None,
    progress: bool | None = None,
    label: str = "fsck",
) -> Report:
    """The shared engine of fsck (consistency=True) and scrub (replicas only)."""
    t0 = time.monotonic()
    meta = vol.meta
    report = Report()
    rows = meta.chunk_rows()
    true = meta.true_refcounts() if consistency else {}
    listings = list_nodes(vol, report)
    report.chunks = len(rows)
    report.objects = sum(len(v) for v in listings.values())
    checker = _Checker(
        vol,
        report,
        listings,
        repair=repair,
        verify=verify,
        rate=RateLimit(rate_mbps * 1e6 if rate_mbps else None),
    )

    fix_counts: dict[bytes, int] = {}
    if consistency:
        for cid, row in rows.items():
            want = true.get(cid, 0)
            if row.refcount != want:
                p = report.add(
                    Problem(
                        "refcount_mismatch",
                        f"chunk {cid.hex()}: refcount {row.refcount}, extents reference it {want}x",
                        chunk=cid.hex(),
                    )
                )
                fix_counts[cid] = want
                p.repaired = repair
        if repair and fix_counts:
            meta.fix_refcounts(fix_counts)

    report.staged = sum(row.state == STAGED for row in rows.values())
    _inline(vol, report, rows)
    todo = [
        (cid, row.raw_len, row.state == DURABLE)
        for cid, row in rows.items()
        if row.state == DURABLE or any(cid in objs for objs in listings.values())
    ]
    with (
        Progress(len(todo), label, enabled=progress, unit="chunks") as bar,
        ThreadPoolExecutor(THREADS) as ex,
    ):
        for _ in ex.map(lambda t: checker.check(*t), todo):
            bar.update(1)

    if consistency:
        _dangling(vol, report, rows, true, listings, checker, repair)
        _orphans(vol, report, rows, listings, grace, repair)
    if repair and checker.healed:
        pending = meta.under_replicated()
        meta.clear_under_replicated(
            [(cid, n) for cid in checker.healed for n in pending.get(cid, ())]
        )
    report.seconds = time.monotonic() - t0
    return report


def _inline(vol: Volume, report: Report, rows) -> None:
    """Inline chunks: their bytes must be in the metadata and hash to their id. Nothing
    to repair from (the metadata is their one copy); the problem names the files."""
    ids = [cid for cid, row in rows.items() if row.state == INLINE]
    report.inline = len(ids)
    bad: dict[bytes, str] = {}
    for i in range(0, len(ids), 500):
        part = ids[i : i + 500]
        found = vol.meta.inline_data(part)
        for cid in part:
            data = found.get(cid)
            if data is None:
                bad[cid] = "its bytes are missing from the metadata"
            elif chunk_id(data, vol.seed) != cid or len(data) != rows[cid].raw_len:
                bad[cid] = "its bytes do not match its id"
    files = _files(vol, list(bad)) if bad else {}
    for cid, why in bad.items():
        report.add(
            Problem(
                "bad_inline",
                f"inline chunk {cid.hex()}: {why}",
                chunk=cid.hex(),
                files=files.get(cid),
                why_not="data lost: the metadata held the only copy",
            )
        )


def _files(vol: Volume, ids: list[bytes]) -> dict[bytes, list[str]]:
    out = {}
    for cid, inos in vol.meta.files_using(ids).items():
        out[cid] = [vol.meta.inode_path(i) or f"<unlinked inode {i}>" for i in inos]
    return out


def _dangling(vol, report: Report, rows, true, listings, checker: _Checker, repair: bool) -> None:
    """Referenced chunks with no row, or with no good replica on any node."""
    no_row = [cid for cid in true if cid not in rows]
    lost = [cid for cid in checker.lost if cid in rows]
    files = _files(vol, no_row + [c for c in lost if true.get(c, 0) > 0])
    reachable_all = len(listings) == len(vol.store.nodes)
    for cid in lost:
        h = cid.hex()
        if true.get(cid, 0) > 0 or rows[cid].refcount > 0:
            report.add(
                Problem(
                    "dangling_extent",
                    f"chunk {h} is referenced but no node holds a good copy",
                    chunk=h,
                    files=files.get(cid),
                    why_not="data lost: no replica to restore from"
                    if reachable_all
                    else "no reachable node holds it",
                )
            )
        else:
            p = report.add(Problem("lost_chunk", f"unreferenced chunk {h} is on no node", chunk=h))
            if repair and reachable_all:
                vol.meta.drop_chunk_rows([cid])
                p.repaired = True
    for cid in no_row:
        h = cid.hex()
        p = report.add(
            Problem(
                "dangling_extent",
                f"extents reference chunk {h}, which has no row",
                chunk=h,
                files=files.get(cid),
            )
        )
        if not repair:
            continue
        holders = [checker.by_name[n] for n, objs in listings.items() if cid in objs]
        for node in holders:
            blob, _ = checker._read_ok(node, cid, None)
            if blob is not None:
                _, _, raw_len = codec.header_info(blob)
                vol.meta.register_chunk_rows(
                    [NewChunk(cid, raw_len, len(blob), DURABLE)], {cid: true[cid]}
                )
                p.repaired = True
                p.detail += f"; row restored from the copy on {node.name}"
                break
        else:
            p.why_not = "data lost: no node holds the object"


def _orphans(vol: Volume, report: Report, rows, listings, grace: float, repair: bool) -> None:
    cutoff = time.time() - grace
    by_name = {n.name: n for n in vol.store.nodes}
    old: list[tuple[str, bytes]] = []
    for name, objs in listings.items():
        for cid, (_size, mt) in objs.items():
            if cid in rows:
                continue
            if mt < cutoff:
                old.append((name, cid))
            else:
                report.young_objects += 1
    # Rows registered while we listed are not orphans: ask again, without side effects.
    known = vol.meta.known_chunks(list({cid for _, cid in old})) if old else set()
    # Objects a kept backup names are not orphans: its restore needs them.
    known |= backup_named(vol.store.nodes, {cid for _, cid in old} - known) if old else set()
    for name, cid in old:
        if cid in known:
            continue
        p = report.add(
            Problem(
                "orphan_object",
                f"object {cid.hex()} on {name} has no chunk row",
                chunk=cid.hex(),
                node=name,
            )
        )
        if repair:
            try:
                by_name[name].delete(cid)
                p.repaired = True
            except NodeError as e:
                p.why_not = f"delete failed: {e}"


def heal_pending(vol: Volume) -> tuple[int, int]:
    """Repair only the recorded under-replicated chunks (cheap: no full listing).

    Copies each missing replica back to its placement node, then deletes the hinted-handoff
    copy the degraded write left on another node (once the placement is complete again, as
    fsck --repair would). Returns (replicas restored, still pending). Used when a node comes
    back: by `ckptfs flush` and `ckptfs fsck --pending`.
    """
    pending = vol.meta.under_replicated()
    by_name = {n.name: n for n in vol.store.nodes}
    done: list[tuple[bytes, str]] = []
    left = 0
    for cid, names in pending.items():
        blob = None
        for node in vol.store.read_order(cid):
            if node.name in names:
                continue
            try:
                b = node.get(cid)
                codec.verify(b)
                blob = b
                break
            except (NodeError, codec.ChunkFormatError):
                continue
        whole = True
        for name in names:
            node = by_name.get(name)
            if node is None or blob is None:
                left += 1
                whole = False
                continue
            try:
                node.put(cid, blob)
                done.append((cid, name))
            except NodeError:
                left += 1
                whole = False
        if whole:
            _drop_handoff_copies(vol, cid)
    vol.meta.clear_under_replicated(done)
    return len(done), left


def _drop_handoff_copies(vol: Volume, cid: bytes) -> None:
    """Delete copies off the chunk's placement (best effort: fsck --repair finds the rest)."""
    home = {n.name for n in vol.store.placement(cid)}
    for node in vol.store.nodes:
        if node.name in home:
            continue
        try:
            if node.exists(cid):
                node.delete(cid)
        except NodeError:
            pass
