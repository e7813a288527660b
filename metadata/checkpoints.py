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
import struct
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import xxhash

from metadata.engine import DURABLE, NAME_MAX, ROOT_INO, Extent, MetaError, NewChunk, check_name

OPEN, PUBLISHED, ABORTED = 0, 1, 2
STATE_NAMES = {OPEN: "open", PUBLISHED: "published", ABORTED: "aborted"}
PATH_MAX = 4096
MAX_FILES_PER_RANK = 100_000
MAX_WORLD = 1 << 20
EXT = struct.Struct("<QQQ16s")  # offset, length, chunk_off, chunk id
CHK = struct.Struct("<16sQQB")  # chunk id, raw_len, stored_len, state

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
        files INTEGER NOT NULL, digest BLOB NOT NULL, PRIMARY KEY (job, step, rank))""",
    """CREATE TABLE IF NOT EXISTS ckpt_files (
        job TEXT NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL, path BLOB NOT NULL,
        ino INTEGER NOT NULL, PRIMARY KEY (job, step, path))""",
]


def _now() -> int:
    return time.time_ns()


def pack_extents(extents: Iterable[Extent]) -> bytes:
    return b"".join(EXT.pack(e.offset, e.length, e.chunk_off, e.chunk_id) for e in extents)


def unpack_extents(data: bytes) -> list[Extent]:
    return [Extent(o, n, bytes(c), co) for o, n, co, c in EXT.iter_unpack(data)]


def pack_chunks(chunks: Iterable[NewChunk]) -> bytes:
    return b"".join(CHK.pack(c.chunk_id, c.raw_len, c.stored_len, c.state) for c in chunks)


def pack_files(files: list[dict]) -> list[dict]:
    """Files with Extent/NewChunk lists -> the packed form commit_rank sends.

    Anything malformed passes through unchanged, for the engine to reject.
    """
    if not isinstance(files, list):
        return files
    out = []
    for f in files:
        if not isinstance(f, dict):
            out.append(f)
            continue
        g = dict(f)
        if isinstance(g.get("extents"), list) and all(isinstance(e, Extent) for e in g["extents"]):
            g["extents"] = pack_extents(g["extents"])
        chunks = g.get("new_chunks")
        if isinstance(chunks, list) and all(isinstance(c, NewChunk) for c in chunks):
            g["new_chunks"] = pack_chunks(chunks)
        out.append(g)
    return out


def split_rel(path: str | bytes, what: str = "path") -> list[bytes]:
    """A path relative to its checkpoint: no absolute paths, '..', NUL or bad names."""
    raw = os.fsencode(path) if isinstance(path, str) else path
    if not isinstance(raw, bytes) or not raw:
        raise MetaError(errno.EINVAL, f"{what} must be a non-empty string")
    if len(raw) > PATH_MAX:
        raise MetaError(errno.ENAMETOOLONG, f"{what} longer than {PATH_MAX} bytes")
    if raw.startswith(b"/") or b"\0" in raw:
        raise MetaError(errno.EINVAL, f"{what} {raw[:80]!r} must be relative, without NUL")
    parts = raw.split(b"/")
    for p in parts:
        if p in (b"..", b".", b""):
            raise MetaError(errno.EINVAL, f"{what} {raw[:80]!r} escapes or is not normalized")
        if len(p) > NAME_MAX:
            raise MetaError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes in {what}")
        check_name(p)
    return parts


def _check_job(job: Any) -> str:
    if not isinstance(job, str) or not job or len(job) > 200:
        raise MetaError(errno.EINVAL, "job must be a non-empty string of at most 200 characters")
    split_rel(job, "job name")
    return job


def _check_int(v: Any, what: str, lo: int = 0, hi: int = 2**62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise MetaError(errno.EINVAL, f"{what} must be an integer in [{lo}, {hi})")
    return v


def _norm_files(files: Any) -> list[tuple[bytes, list[bytes], int, list, list]]:
    """Validate and unpack a rank's files: (path, parts, size, extent rows, chunk rows)."""
    if not isinstance(files, list):
        raise MetaError(errno.EINVAL, "files must be a list")
    if len(files) > MAX_FILES_PER_RANK:
        raise MetaError(errno.E2BIG, f"more than {MAX_FILES_PER_RANK} files in one rank commit")
    out = []
    seen: set[bytes] = set()
    if not all(isinstance(f, dict) for f in files):
        raise MetaError(errno.EINVAL, "each file is a dict with path, size, extents")
    for f in pack_files(files):
        parts = split_rel(f.get("path", b""))
        path = b"/".join(parts)
        if path in seen:
            raise MetaError(errno.EINVAL, f"file {path!r} listed twice")
        seen.add(path)
        size = _check_int(f.get("size"), "size")
        try:
            ext = list(EXT.iter_unpack(f.get("extents", b"")))
            chk = list(CHK.iter_unpack(f.get("new_chunks", b"")))
        except (struct.error, TypeError):
            raise MetaError(
                errno.EINVAL, f"{path!r}: extents/new_chunks are not packed lists"
            ) from None
        end = 0
        for off, n, _coff, _ in ext:
            if n <= 0 or off < end:
                raise MetaError(errno.EINVAL, f"{path!r}: bad extent list at offset {off}")
            end = off + n
        if end > size:
            raise MetaError(errno.EINVAL, f"{path!r}: extents end at {end}, past size {size}")
        for _, raw_len, stored_len, _st in chk:
            if raw_len <= 0 or stored_len <= 0:
                raise MetaError(errno.EINVAL, f"{path!r}: bad new chunk record")
        out.append((path, parts, size, ext, chk))
    out.sort(key=lambda t: t[0])
    return out


def _digest(files: list) -> bytes:
    h = xxhash.xxh3_128()
    for path, _, size, ext, chk in files:
        h.update(struct.pack("<QQQ", len(path), size, len(ext)) + path)
        h.update(b"".join(EXT.pack(*e) for e in ext))
        h.update(b"".join(CHK.pack(*c) for c in sorted(chk)))
    return h.digest()


class CheckpointMixin:
    """Checkpoint coordination on top of SqlEngine's connection and helpers."""

    _ckpt_ready = False

    def _ckpt_tx(self):
        if not self._ckpt_ready:
            with self._tx() as c:
                for stmt in self._ckpt_ddl():
                    self._x(c, stmt)
            self._ckpt_ready = True
        return self._tx()

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
        _check_job(job)
        _check_int(step, "step")
        _check_int(world_size, "world_size", 1, MAX_WORLD)
        if not isinstance(deadline_s, int | float) or not 0 < deadline_s <= 30 * 86400:
            raise MetaError(errno.EINVAL, "deadline_s must be in (0, 30 days]")
        dest = b"/".join(split_rel(path if path is not None else f"{job}/step-{step:06d}"))
        with self._ckpt_tx() as c:
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
            root = self._one(
                c,
                "INSERT INTO inodes (mode, nlink, uid, gid, size, atime, mtime, ctime, rdev, "
                "generation, target) VALUES (?,2,0,0,0,?,?,?,0,0,?) RETURNING ino",
                (stat.S_IFDIR | 0o755, now, now, now, b""),
            )[0]
            self._x(
                c,
                "INSERT INTO ckpt_steps (job, step, world_size, state, path, root, created, "
                "deadline, published, reason) VALUES (?,?,?,?,?,?,?,?,0,'')",
                (job, step, world_size, OPEN, dest, root, now, now + int(deadline_s * 1e9)),
            )
            return self._brief(c, job, step)

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
        res = self.commit_ranks([(job, step, rank, files, host)])[0]
        if isinstance(res, MetaError):
            raise res
        return res

    def commit_ranks(self, items: list[tuple]) -> list[dict | MetaError]:
        """Group commit: many ranks' commits in one transaction, each isolated by a savepoint."""
        prepared: list[Any] = []
        for job, step, rank, files, host in items:
            try:
                _check_job(job)
                _check_int(step, "step")
                _check_int(rank, "rank")
                if not isinstance(host, str) or len(host) > 255:
                    raise MetaError(errno.EINVAL, "host must be a string of at most 255 chars")
                norm = _norm_files(files)
                prepared.append((job, step, rank, norm, host, _digest(norm)))
            except MetaError as e:
                prepared.append(e)
        out: list[dict | MetaError] = []
        with self._ckpt_tx() as c:
            for i, p in enumerate(prepared):
                if isinstance(p, MetaError):
                    out.append(p)
                    continue
                self._x(c, f"SAVEPOINT r{i}")
                try:
                    out.append(self._commit_one(c, *p))
                except MetaError as e:
                    self._x(c, f"ROLLBACK TO SAVEPOINT r{i}")
                    out.append(e)
                self._x(c, f"RELEASE SAVEPOINT r{i}")
        return out

    def _commit_one(
        self, c: Any, job: str, step: int, rank: int, files: list, host: str, digest: bytes
    ) -> dict:
        state, world, root, *_ = self._step(c, job, step)
        if rank >= world:
            raise MetaError(errno.EINVAL, f"rank {rank} out of range for world_size {world}")
        prev = self._one(
            c,
            "SELECT digest FROM ckpt_ranks WHERE job = ? AND step = ? AND rank = ?",
            (job, step, rank),
        )
        if prev is not None:
            if bytes(prev[0]) != digest:
                raise MetaError(
                    errno.EEXIST, f"rank {rank} of {job} step {step} already committed other files"
                )
            return {**self._brief(c, job, step), "duplicate": True}
        if state == ABORTED:
            raise MetaError(errno.ESTALE, f"{job} step {step} was aborted")
        if state != OPEN:
            raise MetaError(errno.EINVAL, f"{job} step {step} is already published")
        now = _now()
        dirs: dict[tuple[int, bytes], int] = {}
        chunk_rows = {}
        refs: Counter[bytes] = Counter()
        ext_rows = []
        file_rows = []
        total = new_bytes = 0
        for path, parts, size, ext, chk in files:
            parent = root
            for name in parts[:-1]:
                parent = self._tree_dir(c, parent, name, dirs, now)
            if self._one(
                c, "SELECT 1 FROM dentries WHERE parent = ? AND name = ?", (parent, parts[-1])
            ):
                raise MetaError(errno.EEXIST, f"{path!r} is already committed by another rank")
            ino = self._one(
                c,
                "INSERT INTO inodes (mode, nlink, uid, gid, size, atime, mtime, ctime, rdev, "
                "generation, target) VALUES (?,1,0,0,?,?,?,?,0,1,?) RETURNING ino",
                (stat.S_IFREG | 0o644, size, now, now, now, b""),
            )[0]
            self._x(
                c,
                "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)",
                (parent, parts[-1], ino),
            )
            for off, n, coff, cid in ext:
                ext_rows.append((ino, off, n, cid, coff))
                refs[cid] += 1
            for cid, raw_len, stored_len, st in chk:
                chunk_rows[cid] = (cid, raw_len, stored_len, st, now)
                new_bytes += raw_len
            file_rows.append((job, step, rank, path, ino))
            total += size
        # New chunks go in with their reference count; only known ones take an UPDATE.
        absent = self._missing(c, sorted(set(refs) | set(chunk_rows)))
        unknown = [cid for cid in absent if cid in refs and cid not in chunk_rows]
        if unknown:
            raise MetaError(
                errno.EIO,
                f"extents reference {len(unknown)} unknown chunk(s), e.g. {unknown[0].hex()}",
            )
        fresh = [(*chunk_rows[cid][:3], refs.get(cid, 0), *chunk_rows[cid][3:]) for cid in absent]
        if fresh:
            c.executemany(
                self._q(
                    "INSERT INTO chunks (id, raw_len, stored_len, refcount, state, touched) "
                    "VALUES (?,?,?,?,?,?)"
                ),
                sorted(fresh),
            )
        durable = [(cid,) for cid, r in chunk_rows.items() if r[3] == DURABLE and cid not in absent]
        if durable:
            c.executemany(self._q(f"UPDATE chunks SET state = {DURABLE} WHERE id = ?"), durable)
        if ext_rows:
            c.executemany(
                self._q(
                    "INSERT INTO extents (ino, offset, length, chunk, chunk_off) VALUES (?,?,?,?,?)"
                ),
                ext_rows,
            )
        self._adjust_refs(c, {cid: n for cid, n in sorted(refs.items()) if cid not in absent})
        if file_rows:
            c.executemany(
                self._q("INSERT INTO ckpt_files (job, step, rank, path, ino) VALUES (?,?,?,?,?)"),
                file_rows,
            )
        self._x(
            c,
            "INSERT INTO ckpt_ranks (job, step, rank, host, committed, bytes, new_bytes, files, "
            "digest) VALUES (?,?,?,?,?,?,?,?,?)",
            (job, step, rank, host, now, total, new_bytes, len(files), digest),
        )
        n = self._one(c, "SELECT COUNT(*) FROM ckpt_ranks WHERE job = ? AND step = ?", (job, step))[
            0
        ]
        if n == world:
            self._publish(c, job, step)
        return {**self._brief(c, job, step), "duplicate": False}

    def _tree_dir(self, c: Any, parent: int, name: bytes, dirs: dict, now: int) -> int:
        key = (parent, name)
        ino = dirs.get(key)
        if ino is not None:
            return ino
        row = self._one(
            c,
            "SELECT d.ino, i.mode FROM dentries d JOIN inodes i ON i.ino = d.ino "
            "WHERE d.parent = ? AND d.name = ?",
            (parent, name),
        )
        if row is not None:
            if not stat.S_ISDIR(row[1]):
                raise MetaError(errno.ENOTDIR, f"{name!r} is a file of another rank")
            ino = row[0]
        else:
            ino = self._one(
                c,
                "INSERT INTO inodes (mode, nlink, uid, gid, size, atime, mtime, ctime, rdev, "
                "generation, target) VALUES (?,2,0,0,0,?,?,?,0,0,?) RETURNING ino",
                (stat.S_IFDIR | 0o755, now, now, now, b""),
            )[0]
            self._x(
                c, "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)", (parent, name, ino)
            )
            self._x(c, "UPDATE inodes SET nlink = nlink + 1 WHERE ino = ?", (parent,))
        dirs[key] = ino
        return ino

    def _publish(self, c: Any, job: str, step: int) -> None:
        """Link the hidden tree into the namespace; on a conflict, abort the step instead."""
        _, _, root, path, *_ = self._step(c, job, step)
        parts = bytes(path).split(b"/")
        self._x(c, "SAVEPOINT publish")
        try:
            parent = ROOT_INO
            for name in parts[:-1]:
                row = self._one(
                    c,
                    "SELECT d.ino, i.mode FROM dentries d JOIN inodes i ON i.ino = d.ino "
                    "WHERE d.parent = ? AND d.name = ?",
                    (parent, name),
                )
                if row is None:
                    now = _now()
                    ino = self._one(
                        c,
                        "INSERT INTO inodes (mode, nlink, uid, gid, size, atime, mtime, ctime, "
                        "rdev, generation, target) VALUES (?,2,0,0,0,?,?,?,0,0,?) RETURNING ino",
                        (stat.S_IFDIR | 0o755, now, now, now, b""),
                    )[0]
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
            if self._one(
                c, "SELECT 1 FROM dentries WHERE parent = ? AND name = ?", (parent, parts[-1])
            ):
                raise MetaError(errno.EEXIST, f"checkpoint path {bytes(path)!r} already exists")
            self._x(
                c,
                "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)",
                (parent, parts[-1], root),
            )
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

    # -- abort / deadlines ---------------------------------------------------
    def abort(self, job: str, step: int, reason: str = "aborted by request") -> dict:
        _check_job(job)
        _check_int(step, "step")
        with self._ckpt_tx() as c:
            state = self._step(c, job, step)[0]
            if state == PUBLISHED:
                raise MetaError(errno.EBUSY, f"{job} step {step} is published; delete it instead")
            if state == OPEN:
                self._abort(c, job, step, str(reason)[:500])
            return self._brief(c, job, step)

    def _abort(self, c: Any, job: str, step: int, reason: str) -> None:
        root = self._step(c, job, step)[2]
        level = [root]
        inos = [root]
        for _ in range(1000):  # tree depth bound
            if not level:
                break
            below: list[int] = []
            for i in range(0, len(level), 500):
                part = level[i : i + 500]
                marks = ",".join("?" * len(part))
                rows = self._x(c, f"SELECT ino FROM dentries WHERE parent IN ({marks})", part)
                below.extend(r[0] for r in rows.fetchall())
            level = below
            inos.extend(level)
        for i in range(0, len(inos), 500):
            part = inos[i : i + 500]
            marks = ",".join("?" * len(part))
            refs = Counter(
                bytes(r[0])
                for r in self._x(
                    c, f"SELECT chunk FROM extents WHERE ino IN ({marks})", part
                ).fetchall()
            )
            self._adjust_refs(c, {k: -v for k, v in sorted(refs.items())})
            for table, col in (("extents", "ino"), ("xattrs", "ino"), ("dentries", "parent")):
                self._x(c, f"DELETE FROM {table} WHERE {col} IN ({marks})", part)
            self._x(c, f"DELETE FROM inodes WHERE ino IN ({marks})", part)
        self._x(c, "DELETE FROM ckpt_files WHERE job = ? AND step = ?", (job, step))
        self._x(
            c,
            "UPDATE ckpt_steps SET state = ?, reason = ? WHERE job = ? AND step = ?",
            (ABORTED, reason, job, step),
        )

    def expire(self, now_ns: int | None = None) -> list[tuple[str, int]]:
        """Abort every open step past its deadline; returns the (job, step) aborted."""
        now = now_ns if now_ns is not None else _now()
        with self._ckpt_tx() as c:
            rows = self._x(
                c,
                "SELECT job, step, world_size FROM ckpt_steps WHERE state = ? AND deadline < ?",
                (OPEN, now),
            ).fetchall()
            for job, step, world in rows:
                have = {
                    r[0]
                    for r in self._x(
                        c, "SELECT rank FROM ckpt_ranks WHERE job = ? AND step = ?", (job, step)
                    ).fetchall()
                }
                missing = [r for r in range(world) if r not in have]
                self._abort(c, job, step, f"deadline passed; missing ranks {_ranges(missing)}")
        return [(r[0], r[1]) for r in rows]

    # -- queries ---------------------------------------------------------------
    def step_state(self, job: str, step: int) -> dict:
        _check_job(job)
        with self._ckpt_read() as c:
            return self._brief(c, job, step)

    def wait_published(self, job: str, step: int, timeout: float = 60.0) -> dict:
        """Block until the step is published or aborted; ETIMEDOUT after `timeout` s."""
        end = time.monotonic() + max(0.0, float(timeout))
        delay = 0.005
        while True:
            info = self.step_state(job, step)
            if info["state"] != "open":
                return info
            if time.monotonic() >= end:
                raise MetaError(errno.ETIMEDOUT, f"{job} step {step} not published in {timeout}s")
            if self.expire():
                continue
            time.sleep(min(delay, max(0.0, end - time.monotonic())))
            delay = min(delay * 2, 0.1)

    def latest(self, job: str) -> int | None:
        _check_job(job)
        with self._ckpt_read() as c:
            row = self._one(
                c,
                "SELECT MAX(step) FROM ckpt_steps WHERE job = ? AND state = ?",
                (job, PUBLISHED),
            )
        return None if row is None or row[0] is None else int(row[0])

    def latest_durable(self, job: str) -> int | None:
        """The newest published step whose every chunk is on the object nodes."""
        _check_job(job)
        with self._ckpt_read() as c:
            steps = self._x(
                c,
                "SELECT step FROM ckpt_steps WHERE job = ? AND state = ? ORDER BY step DESC "
                "LIMIT 1000",
                (job, PUBLISHED),
            ).fetchall()
            for (step,) in steps:
                staged = self._one(
                    c,
                    "SELECT 1 FROM ckpt_files f JOIN extents e ON e.ino = f.ino "
                    "JOIN chunks k ON k.id = e.chunk "
                    f"WHERE f.job = ? AND f.step = ? AND k.state != {DURABLE} LIMIT 1",
                    (job, step),
                )
                if staged is None:
                    return int(step)
        return None

    def manifest_parts(self, job: str, step: int) -> tuple[dict, dict[int, list[dict]]]:
        """A published step's header and its files grouped by rank (extents packed)."""
        _check_job(job)
        with self._ckpt_read() as c:
            head = self._brief(c, job, step)
            if head["state"] != "published":
                raise MetaError(
                    errno.EAGAIN, f"{job} step {step} is {head['state']}, not published"
                )
            rows = self._x(
                c,
                "SELECT f.rank, f.path, i.size, e.offset, e.length, e.chunk_off, e.chunk "
                "FROM ckpt_files f JOIN inodes i ON i.ino = f.ino "
                "LEFT JOIN extents e ON e.ino = f.ino "
                "WHERE f.job = ? AND f.step = ? ORDER BY f.rank, f.path, e.offset",
                (job, step),
            ).fetchall()
        by_rank: dict[int, list[dict]] = {}
        cur_key = None
        buf: list[bytes] = []
        cur: dict | None = None
        pack = EXT.pack
        for rank, path, size, off, n, coff, cid in rows:
            key = (rank, path)
            if key != cur_key:
                if cur is not None:
                    cur["extents"] = b"".join(buf)
                cur_key, buf = key, []
                cur = {"path": os.fsdecode(bytes(path)), "size": int(size), "rank": int(rank)}
                by_rank.setdefault(int(rank), []).append(cur)
            if off is not None:
                buf.append(pack(off, n, coff, bytes(cid)))
        if cur is not None:
            cur["extents"] = b"".join(buf)
        return head, by_rank

    def manifest(self, job: str, step: int, rank: int | None = None) -> dict:
        """Every file of a published step (or one rank's) with packed extents."""
        head, by_rank = self.manifest_parts(job, step)
        if rank is None:
            files = [f for r in sorted(by_rank) for f in by_rank[r]]
        else:
            files = by_rank.get(_check_int(rank, "rank"), [])
        return {**head, "files": files}

    def list_checkpoints(self, job: str | None = None) -> list[dict]:
        with self._ckpt_read() as c:
            where, args = ("WHERE s.job = ?", (job,)) if job is not None else ("", ())
            rows = self._x(
                c,
                "SELECT s.job, s.step, s.state, s.world_size, s.created, s.published, s.path, "
                "COUNT(r.rank), COALESCE(SUM(r.bytes), 0), COALESCE(SUM(r.files), 0) "
                "FROM ckpt_steps s LEFT JOIN ckpt_ranks r ON r.job = s.job AND r.step = s.step "
                f"{where} GROUP BY s.job, s.step, s.state, s.world_size, s.created, s.published, "
                "s.path ORDER BY s.job, s.step",
                args,
            ).fetchall()
        return [
            {
                "job": r[0],
                "step": int(r[1]),
                "state": STATE_NAMES[r[2]],
                "world_size": int(r[3]),
                "created": r[4] / 1e9,
                "published": r[5] / 1e9 if r[5] else None,
                "path": os.fsdecode(bytes(r[6])),
                "committed": int(r[7]),
                "bytes": int(r[8]),
                "files": int(r[9]),
            }
            for r in rows
        ]

    def checkpoint_info(self, job: str, step: int) -> dict:
        """State, size, dedup, and the per-rank timeline with stragglers flagged."""
        _check_job(job)
        with self._ckpt_read() as c:
            state, world, _, path, deadline, reason, created, published = self._step(c, job, step)
            rows = self._x(
                c,
                "SELECT rank, host, committed, bytes, new_bytes, files FROM ckpt_ranks "
                "WHERE job = ? AND step = ? ORDER BY committed",
                (job, step),
            ).fetchall()
        ranks = [
            {
                "rank": int(r[0]),
                "host": r[1],
                "commit_s": round((r[2] - created) / 1e9, 6),
                "bytes": int(r[3]),
                "new_bytes": int(r[4]),
                "files": int(r[5]),
                "straggler": False,
            }
            for r in rows
        ]
        stragglers = flag_stragglers(ranks)
        have = {r["rank"] for r in ranks}
        total = sum(r["bytes"] for r in ranks)
        new = sum(r["new_bytes"] for r in ranks)
        return {
            "job": job,
            "step": step,
            "state": STATE_NAMES[state],
            "reason": reason,
            "path": os.fsdecode(bytes(path)),
            "world_size": world,
            "created": created / 1e9,
            "deadline": deadline / 1e9,
            "published": published / 1e9 if published else None,
            "committed": len(ranks),
            "missing": _ranges([r for r in range(world) if r not in have]),
            "bytes": total,
            "new_bytes": new,
            "dedup_ratio": round(total / new, 4) if new else None,
            "stragglers": stragglers,
            "ranks": sorted(ranks, key=lambda r: r["rank"]),
        }


def flag_stragglers(ranks: list[dict]) -> list[int]:
    """Ranks that committed well after the typical rank: past median + max(1 s, 3 x MAD)."""
    if len(ranks) < 2:
        return []
    times = sorted(r["commit_s"] for r in ranks)
    med = times[len(times) // 2]
    mad = sorted(abs(t - med) for t in times)[len(times) // 2]
    limit = med + max(1.0, 3 * mad)
    out = []
    for r in ranks:
        if r["commit_s"] > limit:
            r["straggler"] = True
            out.append(r["rank"])
    return sorted(out)


def _ranges(nums: list[int]) -> str:
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
