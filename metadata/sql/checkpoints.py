"""Checkpoint transactions in SQL: begin, one commit per rank, atomic publish.

A mixin of SqlEngine, so the same code runs embedded (SQLite), on PostgreSQL
and behind the service. Design:

- `begin` creates the step's directory inode *unlinked*: nothing in the
  namespace reaches it. `commit_rank` does all the heavy work for its files
  inside that hidden tree (inodes, dentries, extents, chunk references taken
  at once so gc cannot collect them). Publish is then one dentry insert that
  links the tree at `path` (default `JOB/step-NNNNNN`): O(1) whatever the
  rank count, and atomic, so a reader sees all ranks' files or none.
- A rank's commit is identified by a digest of its content: a retry with the
  same content is a no-op; different content is an error (EEXIST).
- `abort` (or a deadline passing) deletes the hidden tree and drops its refs.
- Extents travel packed (40 bytes each, see `pack_extents`) so thousands of
  ranks do not cost millions of Python objects on the service.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections import Counter
from itertools import chain, repeat
from typing import Any

import numpy as np

from metadata.ckptcheck import MAX_WORLD, check_int, check_job, prepare_commits, split_rel
from metadata.ckptformat import (
    CHK,
    EXT,
    INO,
    RANK,
    WireFile,
    blob_chunk_ids,
    chk_ids,
    file_fields,
    pack_chunks,
    pack_extents,
    pack_files,
    unpack_extents,
)
from metadata.engine import (
    ROOT_INO,
    MetaError,
    UnknownChunks,
    internal_error,
    rank_answer,
    rank_items,
)
from metadata.sql.chunkrefs import check_domain
from metadata.sql.commitrows import JOURNAL_GROUP, Rows, merge
from metadata.sql.needs import SqlCore
from metadata.sql.txlocks import CHUNK_GATE, SCHEMA_LOCK, retried

__all__ = [  # the packing helpers, importable from here as before
    "CHK", "EXT", "INO", "RANK", "WireFile", "blob_chunk_ids", "file_fields", "pack_chunks",
    "pack_extents", "pack_files", "unpack_extents", "CheckpointMixin", "JOURNAL_GROUP",
]  # fmt: skip

OPEN, PUBLISHED, ABORTED, DELETED = 0, 1, 2, 3
STATE_NAMES = {OPEN: "open", PUBLISHED: "published", ABORTED: "aborted", DELETED: "deleted"}
JOURNAL_MAX = 20_000  # pending journal rows before commit_group applies them itself

CKPT_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS ckpt_steps (
        job TEXT NOT NULL, step INTEGER NOT NULL, world_size INTEGER NOT NULL,
        state INTEGER NOT NULL, path BLOB NOT NULL, root INTEGER NOT NULL,
        created INTEGER NOT NULL, deadline INTEGER NOT NULL, published INTEGER NOT NULL,
        reason TEXT NOT NULL, PRIMARY KEY (job, step))""",
    "CREATE INDEX IF NOT EXISTS ckpt_steps_state ON ckpt_steps (state, deadline)",
    """CREATE TABLE IF NOT EXISTS ckpt_ranks (
        job TEXT NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL, host TEXT NOT NULL,
        committed INTEGER NOT NULL, bytes INTEGER NOT NULL, new_bytes INTEGER NOT NULL,
        files INTEGER NOT NULL, digest BLOB NOT NULL, inos BLOB NOT NULL, paths BLOB NOT NULL,
        PRIMARY KEY (job, step, rank))""",
]
# Journal columns newer than the first volumes (sqlite.SCHEMA has them): added on open.


class _Fallback(Exception):
    """The bulk commit met a conflict it cannot pin on one rank: redo rank by rank."""


def _now() -> int:
    return time.time_ns()


class CheckpointMixin(SqlCore):
    """Checkpoint coordination on top of SqlEngine's connection and helpers."""

    _ckpt_ready = False

    def _ckpt_tx(self, durable: bool | str = True):
        """A durable write transaction: checkpoint outcomes are acknowledged to ranks."""
        if not self._ckpt_ready:
            with self._tx() as c:
                # DDL only when something is missing: its lock would make this first
                # transaction wait for every other writer's (PostgreSQL)
                if not all(self._has(c, t, "*") for t in ("ckpt_steps", "ckpt_ranks")):
                    self._lock_named(c, SCHEMA_LOCK)
                    for stmt in self._ckpt_ddl():
                        self._x(c, stmt)
            self._ckpt_ready = True
        return self._tx(durable=durable)

    def _ddl_text(self, stmt: str) -> str:
        """One DDL statement in the engine's dialect (written in SQLite's)."""
        return stmt

    def _ckpt_read(self):
        if not self._ckpt_ready:
            with self._ckpt_tx():
                pass
        return self._read()

    def _ckpt_ddl(self) -> list[str]:
        return CKPT_SCHEMA

    def _step(self, c: Any, job: str, step: int) -> tuple:
        row = self._one(
            c,
            "SELECT state, world_size, root, path, deadline, reason, created, published "
            "FROM ckpt_steps WHERE job = ? AND step = ?",
            (job, step),
        )
        if row is None:
            raise MetaError(errno.ENOENT, f"no checkpoint {job} step {step} (call begin first)")
        return row

    # -- begin -------------------------------------------------------------
    @retried
    def begin(
        self,
        job: str,
        step: int,
        world_size: int,
        *,
        path: str | None = None,
        deadline_s: float = 600.0,
    ) -> dict:
        """Open a step (idempotent: the same arguments again return the same step)."""
        check_job(job)
        check_int(step, "step")
        check_int(world_size, "world_size", 1, MAX_WORLD)
        if not isinstance(deadline_s, int | float) or not 0 < deadline_s <= 30 * 86400:
            raise MetaError(errno.EINVAL, "deadline_s must be in (0, 30 days]")
        dest = b"/".join(split_rel(path if path is not None else f"{job}/step-{step:06d}"))
        with self._ckpt_tx() as c:
            self._lock_steps(c, [(job, step)])  # a begin on another service waits, then sees it
            row = self._one(
                c,
                "SELECT world_size, path, state FROM ckpt_steps WHERE job = ? AND step = ?",
                (job, step),
            )
            if row is not None:
                if row[0] != world_size or bytes(row[1]) != dest:
                    raise MetaError(
                        errno.EEXIST,
                        f"{job} step {step} exists with world_size {row[0]}, "
                        f"path {bytes(row[1])!r}",
                    )
                return self._brief(c, job, step)
            if self._ns_exists(c, dest):
                raise MetaError(errno.EEXIST, f"checkpoint path {dest!r} already exists")
            now = _now()
            root = self._new_dir_inode(c, now)
            self._x(
                c,
                "INSERT INTO ckpt_steps (job, step, world_size, state, path, root, created, "
                "deadline, published, reason) VALUES (?,?,?,?,?,?,?,?,0,'')",
                (job, step, world_size, OPEN, dest, root, now, now + int(deadline_s * 1e9)),
            )
            return self._brief(c, job, step)

    def _new_dir_inode(self, c: Any, now: int) -> int:
        """A root-owned 0755 directory inode (no entry yet): a step's root, or a missing
        directory on its publish path."""
        ino = self._alloc_inos(c, 1)[0]
        self._x(
            c,
            "INSERT INTO inodes (ino, mode, nlink, uid, gid, size, atime, mtime, ctime, rdev, "
            "generation, target) VALUES (?,?,2,0,0,0,?,?,?,0,0,?)",
            (ino, stat.S_IFDIR | 0o755, now, now, now, b""),
        )
        return ino

    def _ns_exists(self, c: Any, dest: bytes) -> bool:
        ino = ROOT_INO
        for name in dest.split(b"/"):
            row = self._one(
                c, "SELECT ino FROM dentries WHERE parent = ? AND name = ?", (ino, name)
            )
            if row is None:
                return False
            ino = row[0]
        return True

    def _brief(self, c: Any, job: str, step: int) -> dict:
        state, world, _, path, _, reason, _, _ = self._step(c, job, step)
        n = self._one(c, "SELECT COUNT(*) FROM ckpt_ranks WHERE job = ? AND step = ?", (job, step))[
            0
        ]
        return {
            "job": job,
            "step": step,
            "state": STATE_NAMES[state],
            "world_size": world,
            "committed": int(n),
            "path": os.fsdecode(bytes(path)),
            "reason": reason,
        }

    # -- commit ------------------------------------------------------------
    def commit_rank(
        self, job: str, step: int, rank: int, files: list[dict], *, host: str = ""
    ) -> dict:
        """Record one rank's files (invisible until publish); the last rank publishes."""
        res = self.commit_group([(job, step, rank, files, host)])[0]
        if isinstance(res, MetaError):
            raise res
        return res

    def commit_ranks(self, job: str, step: int, ranks: list) -> list[dict]:
        """A host's ranks' commits (engine.MetaEngine.commit_ranks) in one transaction."""
        items = rank_items(job, step, ranks)
        done = iter(self.commit_group([it for it in items if not isinstance(it, MetaError)]))
        return [rank_answer(it if isinstance(it, MetaError) else next(done)) for it in items]

    def commit_group(self, items: list[tuple]) -> list[dict | MetaError]:
        """Group commit: many ranks' commits in one transaction (see `write_commits`)."""
        return self.write_commits(self.prepare_commits(items))

    def prepare_commits(self, items: list[tuple]) -> tuple[list[Any], list[tuple], dict, Rows]:
        """Validate a group commit without touching the database: (outcomes so far, the
        valid commits, {item index: trust domain}, the rows the write inserts that need no
        database: commitrows.Rows). Pure CPU work, so the service runs it
        for the next batch while the previous one is being written
        (ckptcheck.prepare_commits). An item may carry a sixth field, its committer's
        trust domain (the service sets it for a scoped credential; chunkrefs.py)."""
        out, todo = prepare_commits(items)
        domains = {}
        for i, item in enumerate(items):
            if len(item) > 5 and item[5] is not None:
                try:
                    domains[i] = check_domain(item[5])
                except MetaError as e:
                    out[i] = e
        if domains and any(isinstance(out[i], MetaError) for i in domains):
            todo = [t for t in todo if out[t[0]] is None]
        return out, todo, domains, Rows(todo, domains)

    def merge_prepared(self, prepared: list[tuple]) -> tuple:
        """Several `prepare_commits` results as one `write_commits` argument (the service's
        writer takes every validated chunk waiting, commitrows.merge)."""
        return merge(prepared)

    @retried
    def write_commits(self, prepared: tuple[list[Any], list[tuple]]) -> list[dict | MetaError]:
        """Write prepared commits in one transaction, one bulk insert per table (durable once
        it publishes or aborts a step).

        A conflict that cannot be pinned on one rank before writing (two ranks
        writing the same path, a file where a directory is) rolls the batch back
        to a savepoint and redoes it rank by rank, each in its own savepoint, for
        exact errors.
        """
        out, todo = prepared[:2]
        domains = prepared[2] if len(prepared) > 2 else {}
        rows = prepared[3] if len(prepared) > 3 else None
        out = list(out)
        if not todo:
            return out
        # Rank commits that only record files are acknowledged without an fsync: nothing
        # is visible until the publish, whose fsync (below) persists every commit before
        # it. Measured: 8 embedded DCP ranks each fsyncing their commit queued ~25 ms per
        # rank and halved the step-2 speedup.
        with self._ckpt_tx(durable="lazy") as c:
            # The steps written (their rank counts, their publish, an abort racing it) and
            # the chunk gate (the references checked stay valid): see postgres.py.
            self._lock_steps(c, {(t[1], t[2]) for t in todo})
            self._lock_named(c, CHUNK_GATE, shared=True)
            self._x(c, "SAVEPOINT batch")
            try:
                res = self._commit_group(c, todo, careful=False, domains=domains, rows=rows)
            except self._retryable:
                raise  # the whole transaction runs again (txlocks.retried)
            except Exception:  # noqa: BLE001 - a conflict; the careful pass names it
                self._x(c, "ROLLBACK TO SAVEPOINT batch")
                res = {}
                for t in todo:
                    self._x(c, "SAVEPOINT one")
                    try:
                        res.update(self._commit_group(c, [t], careful=True, domains=domains))
                    except MetaError as e:
                        self._x(c, "ROLLBACK TO SAVEPOINT one")
                        res[t[0]] = e
                    except self._retryable:
                        raise
                    except Exception as e:  # noqa: BLE001 - e.g. a value past 2**63: this rank's
                        self._x(c, "ROLLBACK TO SAVEPOINT one")
                        res[t[0]] = internal_error("commit_rank", e)
                    self._x(c, "RELEASE SAVEPOINT one")
            self._x(c, "RELEASE SAVEPOINT batch")
            # Embedded use has no background applier: past a bound, apply here.
            if self._journal_span(c) > JOURNAL_MAX:
                self._apply_journal(c, None)
        for i, r in res.items():
            out[i] = r
        if any(isinstance(r, dict) and r["state"] != "open" for r in res.values()):
            self._durable_point()  # a publish (or an abort) is acknowledged: persist it
        else:
            self._start_writeback()  # so that fsync has less left to write
        # A fresh commit whose step is now published is the one that published it.
        # Retention runs after the publish is visible, never inside its transaction.
        published = {
            r["job"]
            for r in res.values()
            if isinstance(r, dict) and not r["duplicate"] and r["state"] == "published"
        }
        for job in published:
            self.apply_retention(job)
        return out

    def _commit_group(
        self,
        c: Any,
        todo: list[tuple],
        careful: bool,
        domains: dict | None = None,
        rows: Rows | None = None,
    ) -> dict[int, Any]:
        """Write every valid commit of `todo` with bulk statements; {item index: result}.

        careful=False raises on a conflict it cannot attribute (the caller then
        retries rank by rank); careful=True (one rank) raises the MetaError. `rows`:
        the validator's rows for `todo` (`Rows`), used when every commit is written.
        """
        now = _now()
        res: dict[int, Any] = {}
        steps: dict[tuple[str, int], Any] = {}
        groups: dict[tuple[str, int], list[tuple]] = {}
        for t in todo:
            key = (t[1], t[2])
            if key not in steps:
                try:
                    steps[key] = self._step(c, *key)[:3]
                except MetaError as e:
                    steps[key] = e
            groups.setdefault(key, []).append(t)
        fresh: list[tuple] = []
        dups: dict[int, tuple[str, int]] = {}
        for key, group in groups.items():
            st = steps[key]
            if isinstance(st, MetaError):
                res.update((t[0], st) for t in group)
                continue
            state, world, _root = st
            prev = self._rank_digests(c, key, [t[3] for t in group if t[3] < world])
            for t in group:
                i, job, step, rank, _files, _host, digest, _new, _closed, _parts = t
                if rank >= world:
                    res[i] = MetaError(
                        errno.EINVAL, f"rank {rank} out of range for world_size {world}"
                    )
                elif rank in prev:
                    if prev[rank] != digest:
                        res[i] = MetaError(
                            errno.EEXIST,
                            f"rank {rank} of {job} step {step} already committed other files",
                        )
                    else:
                        dups[i] = key
                elif state == ABORTED:
                    res[i] = MetaError(errno.ESTALE, f"{job} step {step} was aborted")
                elif state != OPEN:
                    res[i] = MetaError(errno.EINVAL, f"{job} step {step} is already published")
                else:
                    prev[rank] = digest  # a second copy in this batch is a duplicate
                    fresh.append(t)
        fresh = self._known_refs(c, fresh, res)
        if rows is not None and (careful or not rows.cover(fresh)):
            rows = None  # some were duplicates or refused: the writer makes its own
        if fresh:
            self._write_ranks(c, fresh, steps, now, careful, domains or {}, rows)
        briefs: dict[tuple[str, int], dict] = {}
        for key in {(t[1], t[2]) for t in fresh}:
            n = self._one(c, "SELECT COUNT(*) FROM ckpt_ranks WHERE job = ? AND step = ?", key)[0]
            if n == steps[key][1]:
                self._publish(c, *key)
        answers: dict[tuple[str, int], dict] = {}  # one object per step: encoded once
        for t in fresh:
            key = (t[1], t[2])
            if key not in answers:
                briefs[key] = self._brief(c, *key)
                answers[key] = {**briefs[key], "duplicate": False}
            res[t[0]] = answers[key]
        for i, key in dups.items():
            if key not in briefs:
                briefs[key] = self._brief(c, *key)
            res[i] = {**briefs[key], "duplicate": True}
        return res

    def _rank_digests(self, c: Any, key: tuple[str, int], ranks: list[int]) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        ranks = sorted(set(ranks))
        for i in range(0, len(ranks), 500):
            part = ranks[i : i + 500]
            marks = ",".join("?" * len(part))
            for r, d in self._x(
                c,
                f"SELECT rank, digest FROM ckpt_ranks WHERE job = ? AND step = ? "
                f"AND rank IN ({marks})",
                (*key, *part),
            ).fetchall():
                out[int(r)] = bytes(d)
        return out

    def _known_refs(self, c: Any, fresh: list[tuple], res: dict) -> list[tuple]:
        """Drop (with EIO) commits whose extents reference a chunk nobody registered."""
        ask: set[bytes] = set()
        for t in fresh:
            if t[8]:  # self-contained: checked in _check_columns
                continue
            for f in t[4]:
                ext_ids, new_ids = blob_chunk_ids(f[3]), chk_ids(f[4])
                if ext_ids != new_ids:  # the common case: every extent a new chunk, in order
                    ask.update(set(ext_ids).difference(new_ids))
        if not ask:
            return fresh
        missing = self._missing(c, sorted(ask))
        if missing:  # only journalled so far? apply the journal and look again
            self._settle(c)
            missing = self._missing(c, sorted(missing))
        if not missing:
            return fresh
        keep = []
        for t in fresh:
            new = {r[0] for f in t[4] for r in CHK.iter_unpack(f[4])}
            bad = [cid for f in t[4] for cid in blob_chunk_ids(f[3]) if cid in missing]
            bad = [cid for cid in bad if cid not in new]
            if bad:
                res[t[0]] = UnknownChunks(
                    errno.EIO,
                    f"extents reference {len(set(bad))} unknown chunk(s), e.g. {bad[0].hex()}",
                )
            else:
                keep.append(t)
        return keep

    def _write_ranks(
        self,
        c: Any,
        fresh: list[tuple],
        steps: dict,
        now: int,
        careful: bool,
        domains: dict,
        pre: Rows | None = None,
    ) -> None:
        """Directories, inodes, dentries, rank records and journal rows, one statement each.
        `pre`: the rows that need no database, made by the validator (`Rows`), else here
        (the careful pass writes its files' rows itself: `_careful_files`)."""
        if pre is None:
            pre = Rows(fresh, domains, files=not careful)
        # Directories: resolve level by level; new ones get placeholder ids (< 0) first.
        resolved: dict[tuple[int, tuple[bytes, ...]], int] = {}
        used: dict[tuple[int, bytes], bool] = {}  # (parent, name) -> is a directory
        new_dirs: list[tuple[int, bytes]] = []  # (parent id, name)
        want: set[tuple[int, tuple[bytes, ...]]] = set()
        by_root: dict[int, list[set]] = {}
        for t in fresh:
            by_root.setdefault(steps[(t[1], t[2])][2], []).append(t[9][4])
        for root, dir_sets in by_root.items():
            resolved[(root, ())] = root
            want.update(zip(repeat(root), set().union(*dir_sets)))
        for depth in range(1, 1 + max((len(p) for _, p in want), default=0)):
            by_parent: dict[int, list[tuple[int, tuple[bytes, ...]]]] = {}
            for root, prefix in want:
                if len(prefix) == depth:
                    parent = resolved[(root, prefix[:-1])]
                    by_parent.setdefault(parent, []).append((root, prefix))
            for parent, entries in sorted(by_parent.items()):
                found = self._children(c, parent, [p[-1] for _, p in entries]) if parent > 0 else {}
                for root, prefix in sorted(entries):
                    name = prefix[-1]
                    hit = found.get(name)
                    if hit is not None:
                        if not stat.S_ISDIR(hit[1]):
                            if careful:
                                raise MetaError(
                                    errno.ENOTDIR, f"{name!r} is a file of another rank"
                                )
                            raise _Fallback(name)
                        resolved[(root, prefix)] = hit[0]
                    else:
                        new_dirs.append((parent, name))
                        resolved[(root, prefix)] = -len(new_dirs)
                    used[(parent, name)] = True
        # Inode numbers: the new directories', then the files' in `fresh` and path order.
        first = len(new_dirs)
        inos = self._alloc_inos(c, first + sum(len(t[4]) for t in fresh))
        real = {-k - 1: ino for k, ino in enumerate(inos[:first])}  # placeholder -> ino
        resolved = {key: real.get(v, v) for key, v in resolved.items()}
        used = {(real.get(p, p), name): d for (p, name), d in used.items()}
        fresh_dirs = set(inos[:first])  # no entries in the database yet
        nlink: Counter[int] = Counter(real.get(parent, parent) for parent, _ in new_dirs)
        dir_rows = []
        dent_rows = []
        for k, (parent, name) in enumerate(new_dirs):  # a new dir's links counted in its row
            dir_rows.append((inos[k], 2 + nlink.pop(inos[k], 0)))
            dent_rows.append((real.get(parent, parent), bytearray(name), inos[k]))
        # Files: collisions inside the batch are caught here, with the database by UNIQUE.
        file_inos = inos[first:]
        if careful:
            file_rows, file_dents = self._careful_files(
                c, fresh, steps, resolved, used, fresh_dirs, file_inos
            )  # fmt: skip
        elif file_inos:  # column by column: ~2 us of Python a file less than a loop
            cols = pre.files
            roots = chain.from_iterable(
                repeat(steps[(t[1], t[2])][2], len(t[4])) for t in fresh
            )  # fmt: skip
            parents = list(map(resolved.__getitem__, zip(roots, cols.prefixes, strict=True)))
            keys = set(zip(parents, cols.names, strict=True))
            if len(keys) != len(file_inos) or not keys.isdisjoint(used):
                raise _Fallback("two files, or a file and a directory, share a path")
            file_rows = list(zip(file_inos, cols.sizes, cols.blobs, cols.allocs, strict=True))
            file_dents = list(zip(parents, cols.name_blobs, file_inos, strict=True))
        else:
            file_rows, file_dents = [], []
        dent_rows += file_dents
        # What every new inode shares is fixed; target, rdev (and a dir's extents and
        # generation) keep their defaults.
        same = {"uid": 0, "gid": 0, "atime": now, "mtime": now, "ctime": now}
        self._bulk_insert(
            c, "inodes", "ino, nlink", dir_rows,
            {"mode": stat.S_IFDIR | 0o755, "size": 0, **same},
        )  # fmt: skip
        self._bulk_insert(
            c, "inodes", "ino, size, extents, alloc", file_rows,
            {"mode": stat.S_IFREG | 0o644, "nlink": 1, "generation": 1, **same},
        )  # fmt: skip
        self._bulk_insert(c, "dentries", "parent, name, ino", dent_rows)
        if nlink:  # directories that existed before this batch
            c.executemany(
                self._q("UPDATE inodes SET nlink = nlink + ? WHERE ino = ?"),
                [(n, ino) for ino, n in sorted(nlink.items())],
            )
        # new chunks gc may have deleted are refused (leases.py); ranks carry no INLINE ones.
        # A generator: read only when gc has condemned something at all.
        self._refuse_doomed(c, (bytes(r[0]) for t in fresh for r in CHK.iter_unpack(t[9][2])))
        packed = bytearray(np.array(file_inos, "<u8"))  # INO records, every file's
        ends = pre.ino_ends
        self._bulk_insert(
            c,
            "ckpt_ranks",
            "job, step, rank, host, bytes, new_bytes, files, digest, paths, inos",
            [(*r, packed[a:b]) for r, a, b in zip(pre.ranks, ends[:-1], ends[1:], strict=True)],
            {"committed": now},
        )
        if pre.journal:
            self._bulk_insert(
                c, "ref_journal", "job, step, rank, ranks, chunks, refs, owned, domain",
                pre.journal,
            )  # fmt: skip

    def _careful_files(
        self, c: Any, fresh: list[tuple], steps: dict, resolved: dict, used: dict,
        fresh_dirs: set[int], file_inos: list[int],
    ) -> tuple[list[tuple], list[tuple]]:  # fmt: skip
        """Inode and dentry rows of `_write_ranks`'s files (careful, one rank): the exact
        error for a path another rank, or the database, already holds."""
        file_rows, dent_rows = [], []
        inos = iter(file_inos)
        for t in fresh:
            root = steps[(t[1], t[2])][2]
            for (path, parts, size, blob, _chunks), alloc in zip(t[4], t[9][5], strict=True):
                parent = resolved[(root, tuple(parts[:-1]))]
                key = (parent, parts[-1])
                clash = key in used
                if not clash and parent not in fresh_dirs:
                    clash = self._one(
                        c, "SELECT 1 FROM dentries WHERE parent = ? AND name = ?", key
                    ) is not None  # fmt: skip
                if clash:
                    raise MetaError(errno.EEXIST, f"{path!r} is already committed by another rank")
                used[key] = False
                ino = next(inos)
                file_rows.append((ino, size, bytearray(blob), alloc))
                dent_rows.append((parent, bytearray(parts[-1]), ino))
        return file_rows, dent_rows

    def _children(self, c: Any, parent: int, names: list[bytes]) -> dict[bytes, tuple[int, int]]:
        """name -> (ino, mode) of the existing entries among `names` under `parent`."""
        out: dict[bytes, tuple[int, int]] = {}
        names = sorted(set(names))
        for i in range(0, len(names), 500):
            part = names[i : i + 500]
            marks = ",".join("?" * len(part))
            for name, ino, mode in self._x(
                c,
                "SELECT d.name, d.ino, i.mode FROM dentries d JOIN inodes i ON i.ino = d.ino "
                f"WHERE d.parent = ? AND d.name IN ({marks})",
                (parent, *map(bytearray, part)),  # bytearrays: see _bulk_insert
            ).fetchall():
                out[bytes(name)] = (int(ino), int(mode))
        return out

    def _publish(self, c: Any, job: str, step: int) -> None:
        """Link the hidden tree into the namespace; on a conflict, abort the step instead."""
        _, _, root, path, *_ = self._step(c, job, step)
        parts = bytes(path).split(b"/")
        self._x(c, "SAVEPOINT publish")
        try:
            parent = ROOT_INO
            for name in parts[:-1]:
                row = self._child(c, parent, name)
                if row is None:  # make it, holding the directory it goes in (namespace.py)
                    self._lock_inodes(c, (parent,))
                    self._dir(c, parent)  # not removed meanwhile
                    row = self._child(c, parent, name)  # nor made by someone else
                if row is None:
                    ino = self._new_dir_inode(c, _now())
                    self._x(
                        c,
                        "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)",
                        (parent, name, ino),
                    )
                    self._touch_dir(c, parent, 1)
                    parent = ino
                elif not stat.S_ISDIR(row[1]):
                    raise MetaError(errno.ENOTDIR, f"{name!r} on the checkpoint path is a file")
                else:
                    parent = row[0]
            self._lock_inodes(c, (parent,))  # the directory the step's tree is linked into
            self._dir(c, parent)
            entry = self._x(
                c,
                "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?) "
                "ON CONFLICT (parent, name) DO NOTHING",
                (parent, parts[-1], root),
            )
            if entry.rowcount != 1:
                raise MetaError(errno.EEXIST, f"checkpoint path {bytes(path)!r} already exists")
            self._touch_dir(c, parent, 1)
            self._x(
                c,
                "UPDATE ckpt_steps SET state = ?, published = ? WHERE job = ? AND step = ?",
                (PUBLISHED, _now(), job, step),
            )
            self._x(c, "RELEASE SAVEPOINT publish")
        except MetaError as e:
            self._x(c, "ROLLBACK TO SAVEPOINT publish")
            self._x(c, "RELEASE SAVEPOINT publish")
            self._abort(c, job, step, f"publish failed: {e}")

    def _child(self, c: Any, parent: int, name: bytes) -> tuple[int, int] | None:
        """(ino, mode) of `name` in directory `parent`, or None."""
        return self._one(
            c,
            "SELECT d.ino, i.mode FROM dentries d JOIN inodes i ON i.ino = d.ino "
            "WHERE d.parent = ? AND d.name = ?",
            (parent, name),
        )

    # -- abort / deadlines ---------------------------------------------------
    @retried
    def abort(self, job: str, step: int, reason: str = "aborted by request") -> dict:
        check_job(job)
        check_int(step, "step")
        with self._ckpt_tx() as c:
            self._lock_steps(c, [(job, step)])
            state = self._step(c, job, step)[0]
            if state == PUBLISHED:
                raise MetaError(errno.EBUSY, f"{job} step {step} is published; delete it instead")
            if state == OPEN:
                self._abort(c, job, step, str(reason)[:500])
            return self._brief(c, job, step)

    def _subtree(self, c: Any, root: int, *, lock: bool = False) -> tuple[list[int], Counter[int]]:
        """The directories under `root` (itself first) and the files in them, each with the
        number of its links inside the tree; level by level, bounded in depth. lock=True
        holds each level's directories before reading their entries (a published tree:
        nobody adds an entry to them until the transaction ends)."""
        dirs = [root]
        files: Counter[int] = Counter()
        level = [root]
        for _ in range(10_000):  # depth bound
            if not level:
                break
            if lock:
                self._lock_inodes(c, level)
            below: list[int] = []
            for i in range(0, len(level), 500):
                part = level[i : i + 500]
                marks = ",".join("?" * len(part))
                for ino, mode in self._x(
                    c,
                    "SELECT d.ino, i.mode FROM dentries d JOIN inodes i ON i.ino = d.ino "
                    f"WHERE d.parent IN ({marks})",
                    part,
                ).fetchall():
                    if stat.S_ISDIR(mode):
                        below.append(int(ino))
                    else:
                        files[int(ino)] += 1
            dirs.extend(below)
            level = below
        return dirs, files

    def _abort(self, c: Any, job: str, step: int, reason: str) -> None:
        dirs, files = self._subtree(c, self._step(c, job, step)[2])
        inos = dirs + list(files)
        # Ranks whose references are still journalled: drop the entries (never applied).
        # The others' references were applied: take them back.
        # Locked (PostgreSQL): a row another service is applying right now is waited for,
        # and then gone (applied, so its ranks count as applied below), never both.
        pending: set[int] = set()
        for first, ranks in self._x(
            c,
            "SELECT rank, ranks FROM ref_journal WHERE job = ? AND step = ? ORDER BY id"
            + self._for_update,
            (job, step),
        ).fetchall():
            pending.add(int(first))
            pending.update(r for (r,) in RANK.iter_unpack(bytes(ranks)))
        self._x(c, "DELETE FROM ref_journal WHERE job = ? AND step = ?", (job, step))
        applied = [
            ino
            for rank, packed in self._x(
                c, "SELECT rank, inos FROM ckpt_ranks WHERE job = ? AND step = ?", (job, step)
            ).fetchall()
            if int(rank) not in pending
            for (ino,) in INO.iter_unpack(bytes(packed))
        ]
        refs: Counter[bytes] = Counter()
        for blob in self._blobs(c, applied).values():
            refs.update(blob_chunk_ids(blob))
        self._adjust_refs(c, {k: -v for k, v in refs.items()}, settle=False)
        for i in range(0, len(inos), 500):
            part = inos[i : i + 500]
            marks = ",".join("?" * len(part))
            for table, col in (("xattrs", "ino"), ("dentries", "parent")):
                self._x(c, f"DELETE FROM {table} WHERE {col} IN ({marks})", part)
            self._x(c, f"DELETE FROM inodes WHERE ino IN ({marks})", part)
        self._x(
            c,
            "UPDATE ckpt_steps SET state = ?, reason = ? WHERE job = ? AND step = ?",
            (ABORTED, reason, job, step),
        )

    def _blobs(self, c: Any, inos: list[int]) -> dict[int, bytes]:
        """ino -> packed extents, for the inodes that still exist."""
        return {ino: blob for ino, (_, blob) in self._file_rows(c, inos).items()}

    def _file_rows(self, c: Any, inos: list[int]) -> dict[int, tuple[int, bytes]]:
        """ino -> (size, packed extents) for the inodes that still exist."""
        out: dict[int, tuple[int, bytes]] = {}
        for i in range(0, len(inos), 500):
            part = inos[i : i + 500]
            marks = ",".join("?" * len(part))
            for ino, size, blob in self._x(
                c, f"SELECT ino, size, extents FROM inodes WHERE ino IN ({marks})", part
            ).fetchall():
                out[int(ino)] = (int(size), bytes(blob))
        return out

    @retried
    def expire(self, now_ns: int | None = None) -> list[tuple[str, int]]:
        """Abort every open step past its deadline; returns the (job, step) aborted."""
        now = now_ns if now_ns is not None else _now()
        with self._ckpt_read() as c:  # the common case, nothing due, takes no write lock
            due = self._one(
                c, "SELECT 1 FROM ckpt_steps WHERE state = ? AND deadline < ?", (OPEN, now)
            )
        if due is None:
            return []
        done: list[tuple[str, int]] = []
        with self._ckpt_tx() as c:
            rows = self._x(
                c, "SELECT job, step FROM ckpt_steps WHERE state = ? AND deadline < ?", (OPEN, now)
            ).fetchall()
            self._lock_steps(c, rows)
            for job, step in rows:  # again, locked: another service may have ended it
                state, world, *_, deadline = self._step(c, job, step)[:5]
                if state != OPEN or deadline >= now:
                    continue
                done.append((job, step))
                have = {
                    r[0]
                    for r in self._x(
                        c, "SELECT rank FROM ckpt_ranks WHERE job = ? AND step = ?", (job, step)
                    ).fetchall()
                }
                missing = [r for r in range(world) if r not in have]
                self._abort(c, job, step, f"deadline passed; missing ranks {rank_ranges(missing)}")
        return done


def rank_ranges(nums: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5' (missing-rank lists stay short for big worlds)."""
    out: list[str] = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)
