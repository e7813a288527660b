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
import sys
import time
from collections import Counter
from collections.abc import Iterable
from itertools import accumulate, chain, repeat
from operator import attrgetter, lt
from typing import Any

import msgspec
import numpy as np
import xxhash

from metadata.engine import (
    DURABLE,
    MAX_CHUNK_BYTES,
    NAME_MAX,
    ROOT_INO,
    STAGED,
    Extent,
    MetaError,
    NewChunk,
    UnknownChunks,
    chunk_lengths_ok,
    internal_error,
)

OPEN, PUBLISHED, ABORTED, DELETED = 0, 1, 2, 3
STATE_NAMES = {OPEN: "open", PUBLISHED: "published", ABORTED: "aborted", DELETED: "deleted"}
PATH_MAX = 4096
MAX_FILES_PER_RANK = 100_000
MAX_WORLD = 1 << 20
JOURNAL_MAX = 20_000  # pending journal rows before commit_ranks applies them itself
JOURNAL_GROUP = 32  # rank commits of one step per journal row
EXT = struct.Struct("<QQQ16s")  # offset, length, chunk_off, chunk id (also inodes.extents)
CHK = struct.Struct("<16sQQB")  # chunk id, raw_len, stored_len, state
INO = struct.Struct("<Q")  # ckpt_ranks.inos: the rank's file inodes, in path order
RANK = struct.Struct("<Q")  # ref_journal.ranks: the rank commits a journal row holds

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
JOURNAL_COLUMNS = {"ranks": "BLOB NOT NULL DEFAULT x''", "owned": "BLOB NOT NULL DEFAULT x''"}


class _Fallback(Exception):
    """The bulk commit met a conflict it cannot pin on one rank: redo rank by rank."""


def _now() -> int:
    return time.time_ns()


def pack_extents(extents: Iterable[Extent]) -> bytes:
    return b"".join(EXT.pack(e.offset, e.length, e.chunk_off, e.chunk_id) for e in extents)


def unpack_extents(data: bytes) -> list[Extent]:
    return [Extent(o, n, bytes(c), co) for o, n, co, c in EXT.iter_unpack(data)]


def blob_chunk_ids(data: bytes) -> list[bytes]:
    """The chunk id of every extent in a packed list, without building Extent objects."""
    return [data[i : i + 16] for i in range(24, len(data), EXT.size)]


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


class WireFile(msgspec.Struct):
    """One file of a commit_rank as clients send it (`pack_files`), decoded with its types
    checked by msgspec (protocol.parse_commit): a 4096-rank burst spent ~14 ms per 1024
    ranks decoding these as dicts and checking each field in Python, ~9 ms as structs."""

    path: str
    size: int
    extents: bytes = b""
    new_chunks: bytes = b""


def file_fields(f: WireFile | dict) -> tuple[Any, Any, Any, Any]:
    """(path, size, extents, new_chunks) of a commit's file, a WireFile or a dict."""
    if type(f) is WireFile:
        return f.path, f.size, f.extents, f.new_chunks
    return f.get("path", b""), f.get("size"), f.get("extents", b""), f.get("new_chunks", b"")


def split_rel(path: str | bytes, what: str = "path") -> list[bytes]:
    """A path relative to its checkpoint: no absolute paths, '..', NUL or bad names."""
    return _split_rel(path, what)[1]


def _split_rel(path: Any, what: str = "path") -> tuple[bytes, list[bytes]]:
    """split_rel's checks; (the path's bytes, its parts). The bytes are the parts joined:
    a path is rejected, never rewritten."""
    raw = path.encode(_FSENC, _FSERR) if type(path) is str else path
    if not isinstance(raw, bytes) or not raw:
        if isinstance(path, str):
            raw = os.fsencode(path)  # a str subclass: encode it the standard way
        if not isinstance(raw, bytes) or not raw:
            raise MetaError(errno.EINVAL, f"{what} must be a non-empty string")
    if len(raw) > PATH_MAX:
        raise MetaError(errno.ENAMETOOLONG, f"{what} longer than {PATH_MAX} bytes")
    if raw[0] == 47 or b"\0" in raw:  # 47: "/"
        raise MetaError(errno.EINVAL, f"{what} {raw[:80]!r} must be relative, without NUL")
    parts = raw.split(b"/")
    # check_name's rules, checked for all parts at once (16k paths per 4096-rank step)
    if b"" in parts or b"." in parts or b".." in parts:
        raise MetaError(errno.EINVAL, f"{what} {raw[:80]!r} escapes or is not normalized")
    if len(raw) > NAME_MAX and max(map(len, parts)) > NAME_MAX:
        raise MetaError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes in {what}")
    return raw, parts


_FSENC, _FSERR = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def _check_job(job: Any) -> str:
    if not isinstance(job, str) or not job or len(job) > 200:
        raise MetaError(errno.EINVAL, "job must be a non-empty string of at most 200 characters")
    split_rel(job, "job name")
    return job


def _check_int(v: Any, what: str, lo: int = 0, hi: int = 2**62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise MetaError(errno.EINVAL, f"{what} must be an integer in [{lo}, {hi})")
    return v


def _chk_ids(data: bytes) -> list[bytes]:
    return [data[i : i + 16] for i in range(0, len(data), CHK.size)]


def _norm_files(files: Any) -> tuple[list[tuple[bytes, list[bytes], int, bytes, bytes]], int]:
    """Validate a rank's files: [(path, parts, size, packed extents, packed new chunks)],
    sorted by path, and the raw bytes of the rank's declared new chunks."""
    if not isinstance(files, list):
        raise MetaError(errno.EINVAL, "files must be a list")
    if len(files) > MAX_FILES_PER_RANK:
        raise MetaError(errno.E2BIG, f"more than {MAX_FILES_PER_RANK} files in one rank commit")
    out = []
    seen: set[bytes] = set()
    new_bytes = 0
    if not all(type(f) is WireFile for f in files):  # typed by the decoder: nothing to unpack
        if not all(isinstance(f, dict | WireFile) for f in files):
            raise MetaError(errno.EINVAL, "each file is a dict with path, size, extents")
        if any(
            type(f) is dict
            and (isinstance(f.get("extents"), list) or isinstance(f.get("new_chunks"), list))
            for f in files
        ):
            files = pack_files(files)
    for f in files:
        p, size, blob, chk_blob = file_fields(f)
        path, parts = _split_rel(p)
        if path in seen:
            raise MetaError(errno.EINVAL, f"file {path!r} listed twice")
        seen.add(path)
        if type(size) is not int or not 0 <= size < 2**62:
            size = _check_int(size, "size")
        if type(blob) is not bytes or type(chk_blob) is not bytes:
            if not isinstance(blob, bytes | bytearray) or not isinstance(
                chk_blob, bytes | bytearray
            ):
                raise MetaError(errno.EINVAL, f"{path!r}: extents/new_chunks are not packed lists")
            blob, chk_blob = bytes(blob), bytes(chk_blob)
        if len(blob) % EXT.size or len(chk_blob) % CHK.size:
            raise MetaError(errno.EINVAL, f"{path!r}: extents/new_chunks are not packed lists")
        end = 0
        for off, n, _coff, _ in EXT.iter_unpack(blob):
            if n <= 0 or off < end:
                raise MetaError(errno.EINVAL, f"{path!r}: bad extent list at offset {off}")
            end = off + n
        if end > size:
            raise MetaError(errno.EINVAL, f"{path!r}: extents end at {end}, past size {size}")
        for _cid, raw_len, stored_len, st in CHK.iter_unpack(chk_blob):
            if not chunk_lengths_ok(raw_len, stored_len) or st > DURABLE:
                raise MetaError(errno.EINVAL, f"{path!r}: bad new chunk record")
            new_bytes += raw_len
        out.append((path, parts, size, blob, chk_blob))
    out.sort(key=_first)
    return out, new_bytes


class _SlowPath(Exception):
    """A group commit needs the rank-by-rank checks (for the exact error)."""


# Byte sequences of a path list joined and framed with NULs that only a path
# `_split_rel` refuses can contain: empty, absolute, an empty, "." or ".." part.
_BAD_SEQS = tuple(
    a + b + c
    for b in (b"", b".", b"..")
    for a in (b"\0", b"/")
    for c in (b"\0", b"/")
    if b or a + c != b"\0/"  # "\0/" alone is an absolute path: listed below
) + (b"\0/",)


def _first(t: tuple) -> Any:
    return t[0]


_EXT_DT = np.dtype([("off", "<u8"), ("len", "<u8"), ("coff", "<u8"), ("id", "V16")])
_CHK_DT = np.dtype([("id", "V16"), ("raw", "<u8"), ("stored", "<u8"), ("st", "u1")])
BATCH_CHECK_MIN = 16  # ranks in a group commit before the vectorized checks pay off


def _check_columns(
    counts: list[int], sizes: list[int], ext_all: bytes, ext_n: Any, chk_all: bytes, chk_n: Any
) -> tuple[bool, list[int], list[bool], list[int]]:
    """`_norm_files`'s extent and chunk checks for a whole batch, vectorized: item k
    owns the next counts[k] files; file j has sizes[j], ext_n[j] packed extents and
    chk_n[j] new-chunk records, all files' packed one after another in ext_all and
    chk_all.

    Returns whether every file passes, every item's new-chunk byte count,
    whether each item is self-contained (every file's extents are exactly its
    declared new chunks, in order: no lookup of known chunks needed), and the
    bytes each file's extents cover (its `alloc`). Fields are
    read through strided views of the packed records: numpy's structured-dtype
    field access copied and was ~3x slower.
    """
    n, nf = len(counts), len(sizes)
    owner = np.repeat(np.arange(n), counts)  # file -> item
    ne, nc = len(ext_all) // EXT.size, len(chk_all) // CHK.size
    fidx = np.repeat(np.arange(nf), ext_n)
    if ne:
        off = np.ndarray((ne,), "<u8", ext_all, 0, (EXT.size,))
        ln = np.ndarray((ne,), "<u8", ext_all, 8, (EXT.size,))
        if ((ln == 0) | (off >= 2**62) | (ln >= 2**62)).any():
            return False, [], [], []
        end = off + ln  # no wrap-around: both below 2**62
        same_file = fidx[1:] == fidx[:-1]
        if (same_file & (off[1:] < end[:-1])).any():  # overlaps or goes backwards
            return False, [], [], []
        last = np.ones(ne, bool)
        last[:-1] = ~same_file
        if (end[last] > np.fromiter(sizes, np.uint64, nf)[fidx[last]]).any():
            return False, [], [], []
        sums = np.bincount(fidx, weights=ln, minlength=nf)
        if sums.max() >= 2**52:  # float64 sums are exact below 2**53: else the exact path
            return False, [], [], []
        alloc = [int(b) for b in sums.tolist()]
    else:
        alloc = [0] * nf
    new_bytes = [0] * n
    if nc:
        raw = np.ndarray((nc,), "<u8", chk_all, 16, (CHK.size,))
        stored = np.ndarray((nc,), "<u8", chk_all, 24, (CHK.size,))
        st = np.ndarray((nc,), "u1", chk_all, 32, (CHK.size,))
        big = (raw >= MAX_CHUNK_BYTES) | (stored >= MAX_CHUNK_BYTES)
        if ((raw == 0) | (stored == 0) | big | (st > DURABLE)).any():
            return False, [], [], []
        per_file = np.bincount(np.repeat(np.arange(nf), chk_n), weights=raw, minlength=nf)
        new_bytes = [int(b) for b in np.bincount(owner, weights=per_file, minlength=n).tolist()]
    same = ext_n == chk_n
    if ne and nc and same.any():
        e_lo, e_hi = (np.ndarray((ne,), "<u8", ext_all, 24 + h, (EXT.size,)) for h in (0, 8))
        c_lo, c_hi = (np.ndarray((nc,), "<u8", chk_all, h, (CHK.size,)) for h in (0, 8))
        if same.all():  # the usual batch: the ids of all files align
            differ, files = (e_lo != c_lo) | (e_hi != c_hi), fidx
        else:
            em, cm = np.repeat(same, ext_n), np.repeat(same, chk_n)
            differ = (e_lo[em] != c_lo[cm]) | (e_hi[em] != c_hi[cm])
            files = fidx[em]
        same &= np.bincount(files, weights=differ, minlength=nf) == 0
    closed = (np.bincount(owner, weights=~same, minlength=n) == 0).tolist()
    return True, new_bytes, closed, alloc


def _prepare_columns(items: list[tuple]) -> list[tuple]:
    """`prepare_commits` for a batch of well-typed commits (files as WireFiles, which
    `protocol.parse_commit` decodes), checked column by column: one pass of C-speed
    builtins and numpy over all the batch's files, then a few joins per rank.

    The per-rank checks cost ~45 us of Python a rank (~4 files), under the GIL
    the group commit's writer needs: at 4096 ranks, a third of the publish time.
    Anything this does not take as it is (a dict file, a value out of range, a bad
    path, a duplicate) raises _SlowPath, and the rank-by-rank checks name the error.
    """
    try:
        jobs, steps, ranks, files, hosts = zip(*items, strict=True)
    except (TypeError, ValueError) as e:
        raise _SlowPath from e
    types = (set(map(type, jobs)), set(map(type, steps)), set(map(type, ranks)),
             set(map(type, files)), set(map(type, hosts)))  # fmt: skip
    if types != ({str}, {int}, {int}, {list}, {str}):
        raise _SlowPath
    try:
        for job in set(jobs):
            _check_job(job)
    except (MetaError, TypeError, ValueError) as e:  # UnicodeError: a lone surrogate
        raise _SlowPath from e
    counts = list(map(len, files))
    if (min(steps) < 0 or max(steps) >= 2**62 or min(ranks) < 0 or max(ranks) >= 2**62
            or max(map(len, hosts)) > 255 or max(counts) > MAX_FILES_PER_RANK):  # fmt: skip
        raise _SlowPath
    flat = list(chain.from_iterable(files))
    if set(map(type, flat)) != {WireFile}:
        raise _SlowPath
    nf = len(flat)
    paths: list = list(map(_PATH, flat))
    sizes: list = list(map(_SIZE, flat))
    exts: list = list(map(_EXTS, flat))
    chks: list = list(map(_CHKS, flat))
    if (set(map(type, paths)) != {str} or set(map(type, sizes)) != {int}
            or set(map(type, exts)) | set(map(type, chks)) != {bytes}
            or min(sizes) < 0 or max(sizes) >= 2**62):  # fmt: skip
        raise _SlowPath
    joined = "\0".join(paths)
    try:
        raw = joined.encode(_FSENC, _FSERR)
    except UnicodeError as e:
        raise _SlowPath from e
    paths = raw.split(b"\0")
    if len(paths) != nf or max(map(len, paths)) > NAME_MAX:  # a NUL in a path; long ones
        raise _SlowPath
    framed = b"\0" + raw + b"\0"
    if any(seq in framed for seq in _BAD_SEQS):
        raise _SlowPath
    starts = list(accumulate(counts, initial=0))
    # Each rank's files in path order, no path twice: usually sent that way already.
    unsorted = _unsorted(paths, starts)
    if unsorted:
        order = list(range(nf))
        for k in unsorted:
            a, b = starts[k], starts[k + 1]
            order[a:b] = sorted(order[a:b], key=paths.__getitem__)
        paths, sizes, exts, chks = ([col[j] for j in order] for col in (paths, sizes, exts, chks))
        if _unsorted(paths, starts):  # a path twice
            raise _SlowPath
    elen = np.fromiter(map(len, exts), np.int64, nf)
    clen = np.fromiter(map(len, chks), np.int64, nf)
    if (elen % EXT.size).any() or (clen % CHK.size).any():
        raise _SlowPath
    ext_all, chk_all = b"".join(exts), b"".join(chks)
    ext_n = elen // EXT.size
    ok, new_bytes, closed, alloc = _check_columns(
        counts, sizes, ext_all, ext_n, chk_all, clen // CHK.size
    )  # fmt: skip
    if not ok:
        raise _SlowPath
    # Per file: the digest's head (see _digest), and offsets into the joined columns.
    plen = np.fromiter(map(len, paths), np.int64, nf)
    heads = np.empty((nf, 4), "<u8")
    heads[:, 0], heads[:, 1] = plen, np.fromiter(sizes, np.uint64, nf)
    heads[:, 2], heads[:, 3] = ext_n, clen // CHK.size
    hsz = _DIGEST_HEAD.size
    p_at = [0, *accumulate((plen + 1).tolist())]
    e_at, c_at = [0, *accumulate(elen.tolist())], [0, *accumulate(clen.tolist())]
    s_at = [0, *accumulate(sizes)]
    praw = b"\0".join(paths)
    hv, pv, ev, cv = map(memoryview, (heads.tobytes(), praw, ext_all, chk_all))
    parts = list(map(bytes.split, paths, repeat(b"/")))
    rows = list(zip(paths, parts, sizes, exts, chks, strict=True))
    shallow = max(map(len, parts)) <= 2  # the common shape: at most one directory deep
    todo = []
    for k, item in enumerate(items):
        a, b = starts[k], starts[k + 1]
        pe = p_at[b] - 1 if b > a else p_at[a]  # the rank's paths end (no files: empty)
        if shallow:
            dirs = {(p[0],) for p in parts[a:b] if len(p) == 2}
        else:
            dirs = {tuple(p[:d]) for p in parts[a:b] for d in range(1, len(p))}
        rank_parts = (
            s_at[b] - s_at[a],
            praw[p_at[a] : pe],
            chk_all[c_at[a] : c_at[b]],
            b"" if closed[k] else ext_all[e_at[a] : e_at[b]],
            dirs,
            alloc[a:b],
        )
        h = xxhash.xxh3_128(hv[hsz * a : hsz * b])
        h.update(pv[p_at[a] : pe])
        h.update(ev[e_at[a] : e_at[b]])
        h.update(cv[c_at[a] : c_at[b]])
        todo.append((k, item[0], item[1], item[2], rows[a:b], item[4], h.digest(),
                     new_bytes[k], closed[k], rank_parts))  # fmt: skip
    return todo


_PATH, _SIZE = attrgetter("path"), attrgetter("size")
_EXTS, _CHKS = attrgetter("extents"), attrgetter("new_chunks")


def _unsorted(paths: list[bytes], starts: list[int]) -> list[int]:
    """The items (item k owns paths[starts[k]:starts[k+1]]) whose paths do not strictly
    increase."""
    n = len(paths)
    if n < 2:
        return []
    up = np.fromiter(map(lt, paths[:-1], paths[1:]), bool, n - 1)
    cuts = np.array(starts[1:-1], np.int64)
    up[cuts[(cuts > 0) & (cuts < n)] - 1] = True  # across a boundary: no order needed
    if up.all():
        return []
    owner = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    return sorted(set(owner[np.flatnonzero(~up)].tolist()))


def _rank_parts(
    files: list, closed: bool
) -> tuple[int, bytes, bytes, bytes, set[tuple[bytes, ...]], list[int]]:
    """What the write of a rank's row needs, computed before the write lock: total
    size, paths (NUL-separated), new chunks and extents (the journal's blobs), the
    directory prefixes its files need and the bytes each file's extents cover
    (`alloc`). A closed rank's extents are exactly its
    new chunks: the journal takes one reference per chunk record (`owned`) and
    needs no second copy of the ids."""
    if not files:
        return 0, b"", b"", b"", set(), []
    paths, parts, sizes, exts, chunks = zip(*files, strict=True)  # columns, at C speed
    if max(map(len, parts)) <= 2:  # the common shape: files at most one directory deep
        dirs = {(p[0],) for p in parts if len(p) == 2}
    else:
        dirs = {tuple(p[:k]) for p in parts for k in range(1, len(p))}
    return (
        sum(sizes),
        b"\0".join(paths),
        b"".join(chunks),
        b"" if closed else b"".join(exts),
        dirs,
        [sum(e[1] for e in EXT.iter_unpack(x)) for x in exts],
    )


def _journal_rows(by_step: dict[tuple[str, int], list[tuple]]) -> list[tuple]:
    """ref_journal rows for a group commit's (rank, chunks, refs, closed) entries: up to
    JOURNAL_GROUP ranks of one step per row. Thousands of rows of a few KB each cost
    more than the blobs (measured: ~100 ms of a 4096-rank write), and an applied slice
    is still small. Blobs are bytearrays (see SqlEngine._bulk_insert)."""
    rows = []
    for (job, step), entries in by_step.items():
        for g in range(0, len(entries), JOURNAL_GROUP):
            part = entries[g : g + JOURNAL_GROUP]
            ranks = _BLOB.join(RANK.pack(e[0]) for e in part)
            chunks = _BLOB.join(e[1] for e in part if not e[3])
            refs = _BLOB.join(e[2] for e in part)
            owned = _BLOB.join(e[1] for e in part if e[3])
            rows.append((job, step, part[0][0], ranks, chunks, refs, owned))
    return rows


def _digest(files: list) -> bytes:
    """A rank commit's identity: xxh3-128 over each file's (path length, size, extent
    count, chunk count), then the paths joined with NULs, the extents, the new chunks, in
    path order (the layout `_prepare_columns` hashes from its joined columns)."""
    paths, _, sizes, exts, chks = zip(*files, strict=True) if files else ((),) * 5
    h = xxhash.xxh3_128(
        b"".join(
            _DIGEST_HEAD.pack(len(p), size, len(e) // EXT.size, len(c) // CHK.size)
            for p, size, e, c in zip(paths, sizes, exts, chks, strict=True)
        )
    )
    for col in (b"\0".join(paths), b"".join(exts), b"".join(chks)):
        h.update(col)
    return h.digest()


_DIGEST_HEAD = struct.Struct("<QQQQ")
_BLOB = bytearray()  # its join() makes a bytearray


class CheckpointMixin:
    """Checkpoint coordination on top of SqlEngine's connection and helpers."""

    _ckpt_ready = False

    def _ckpt_tx(self, durable: bool | str = True):
        """A durable write transaction: checkpoint outcomes are acknowledged to ranks."""
        if not self._ckpt_ready:
            with self._tx() as c:
                for stmt in self._ckpt_ddl():
                    self._x(c, stmt)
                # the journal columns a volume made before them lacks (commits write
                # them; `_apply_journal` reads either layout, so nothing waits)
                self._add_columns(c, "ref_journal", JOURNAL_COLUMNS)
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
        res = self.commit_ranks([(job, step, rank, files, host)])[0]
        if isinstance(res, MetaError):
            raise res
        return res

    def commit_ranks(self, items: list[tuple]) -> list[dict | MetaError]:
        """Group commit: many ranks' commits in one transaction (see `write_commits`)."""
        return self.write_commits(self.prepare_commits(items))

    def prepare_commits(self, items: list[tuple]) -> tuple[list[Any], list[tuple]]:
        """Validate a group commit without touching the database: (outcomes so far, the
        valid commits). Pure CPU work, so the service runs it for the next batch while
        the previous one is being written. A big batch of typed commits is checked
        column by column (`_prepare_columns`); if anything in it looks wrong, or for a
        small batch, each rank is checked alone, so every rank gets the error it would
        get alone."""
        if len(items) >= BATCH_CHECK_MIN:
            try:
                return [None] * len(items), _prepare_columns(items)
            except _SlowPath:
                pass
        out: list[Any] = [None] * len(items)
        todo = []
        jobs: set[str] = set()  # job names checked in this batch (one per step, usually)
        for i, item in enumerate(items):
            try:
                job, step, rank, files, host = item
                if type(job) is not str or job not in jobs:
                    jobs.add(_check_job(job))
                _check_int(step, "step")
                _check_int(rank, "rank")
                if not isinstance(host, str) or len(host) > 255:
                    raise MetaError(errno.EINVAL, "host must be a string of at most 255 chars")
                norm, new_bytes = _norm_files(files)
                todo.append((i, job, step, rank, norm, host, _digest(norm), new_bytes, False))
            except MetaError as e:
                out[i] = e
            except (TypeError, ValueError) as e:
                out[i] = MetaError(errno.EINVAL, f"bad commit_rank arguments: {e}")
        return out, [(*t, _rank_parts(t[4], t[8])) for t in todo]

    def write_commits(self, prepared: tuple[list[Any], list[tuple]]) -> list[dict | MetaError]:
        """Write prepared commits in one transaction, one bulk insert per table (durable once
        it publishes or aborts a step).

        A conflict that cannot be pinned on one rank before writing (two ranks
        writing the same path, a file where a directory is) rolls the batch back
        to a savepoint and redoes it rank by rank, each in its own savepoint, for
        exact errors.
        """
        out, todo = prepared
        out = list(out)
        if not todo:
            return out
        # Rank commits that only record files are acknowledged without an fsync: nothing
        # is visible until the publish, whose fsync (below) persists every commit before
        # it. Measured: 8 embedded DCP ranks each fsyncing their commit queued ~25 ms per
        # rank and halved the step-2 speedup.
        with self._ckpt_tx(durable="lazy") as c:
            self._x(c, "SAVEPOINT batch")
            try:
                res = self._commit_group(c, todo, careful=False)
            except Exception:  # noqa: BLE001 - a conflict; the careful pass names it
                self._x(c, "ROLLBACK TO SAVEPOINT batch")
                res = {}
                for t in todo:
                    self._x(c, "SAVEPOINT one")
                    try:
                        res.update(self._commit_group(c, [t], careful=True))
                    except MetaError as e:
                        self._x(c, "ROLLBACK TO SAVEPOINT one")
                        res[t[0]] = e
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

    def _commit_group(self, c: Any, todo: list[tuple], careful: bool) -> dict[int, Any]:
        """Write every valid commit of `todo` with bulk statements; {item index: result}.

        careful=False raises on a conflict it cannot attribute (the caller then
        retries rank by rank); careful=True (one rank) raises the MetaError.
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
        if fresh:
            self._write_ranks(c, fresh, steps, now, careful)
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
                ext_ids, new_ids = blob_chunk_ids(f[3]), _chk_ids(f[4])
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
        self, c: Any, fresh: list[tuple], steps: dict, now: int, careful: bool
    ) -> None:
        """Directories, inodes, dentries, rank records and journal rows, one statement each."""
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
        rows = list(chain.from_iterable(t[4] for t in fresh))
        if careful:
            file_rows, file_dents = self._careful_files(
                c, fresh, steps, resolved, used, fresh_dirs, inos[first:]
            )  # fmt: skip
        elif rows:  # column by column: ~2 us of Python a file less than a loop
            _, parts, sizes, blobs, _ = zip(*rows, strict=True)
            roots = chain.from_iterable(
                repeat(steps[(t[1], t[2])][2], len(t[4])) for t in fresh
            )  # fmt: skip
            prefixes = [tuple(p[:-1]) for p in parts]
            names = [p[-1] for p in parts]
            parents = list(map(resolved.__getitem__, zip(roots, prefixes, strict=True)))
            keys = set(zip(parents, names, strict=True))
            if len(keys) != len(rows) or not keys.isdisjoint(used):
                raise _Fallback("two files, or a file and a directory, share a path")
            file_inos = inos[first:]
            allocs = chain.from_iterable(t[9][5] for t in fresh)
            file_rows = list(
                zip(file_inos, sizes, map(bytearray, blobs), allocs, strict=True)
            )  # fmt: skip
            file_dents = list(zip(parents, map(bytearray, names), file_inos, strict=True))
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
        rank_rows = []
        journal: dict[tuple[str, int], list[tuple]] = {}
        packed = bytearray(np.array(inos[first:], "<u8"))  # INO records, every file's
        k = 0
        for _i, job, step, rank, files, host, digest, new_bytes, closed, parts in fresh:
            size, paths, chunks, refs = parts[:4]
            n = len(files)
            rank_rows.append(
                (job, step, rank, host, now, size, new_bytes, n, bytearray(digest),
                 packed[k : k + INO.size * n], bytearray(paths))
            )  # fmt: skip
            k += INO.size * n
            if refs or chunks:
                journal.setdefault((job, step), []).append((rank, chunks, refs, closed))
        self._bulk_insert(
            c,
            "ckpt_ranks",
            "job, step, rank, host, committed, bytes, new_bytes, files, digest, inos, paths",
            rank_rows,
        )
        if journal:
            self._bulk_insert(
                c, "ref_journal", "job, step, rank, ranks, chunks, refs, owned",
                _journal_rows(journal),
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
                row = self._one(
                    c,
                    "SELECT d.ino, i.mode FROM dentries d JOIN inodes i ON i.ino = d.ino "
                    "WHERE d.parent = ? AND d.name = ?",
                    (parent, name),
                )
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

    def _subtree(self, c: Any, root: int) -> tuple[list[int], Counter[int]]:
        """The directories under `root` (itself first) and the files in them, each with the
        number of its links inside the tree; level by level, bounded in depth."""
        dirs = [root]
        files: Counter[int] = Counter()
        level = [root]
        for _ in range(10_000):  # depth bound
            if not level:
                break
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
        pending: set[int] = set()
        for first, ranks in self._x(
            c, "SELECT rank, ranks FROM ref_journal WHERE job = ? AND step = ?", (job, step)
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

    def expire(self, now_ns: int | None = None) -> list[tuple[str, int]]:
        """Abort every open step past its deadline; returns the (job, step) aborted."""
        now = now_ns if now_ns is not None else _now()
        with self._ckpt_read() as c:  # the common case, nothing due, takes no write lock
            due = self._one(
                c, "SELECT 1 FROM ckpt_steps WHERE state = ? AND deadline < ?", (OPEN, now)
            )
        if due is None:
            return []
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
        self.apply_pending()  # chunk states of journalled chunks live in the journal
        with self._ckpt_read() as c:
            steps = self._x(
                c,
                "SELECT step FROM ckpt_steps WHERE job = ? AND state = ? ORDER BY step DESC "
                "LIMIT 1000",
                (job, PUBLISHED),
            ).fetchall()
            for (step,) in steps:
                inos = self._step_inos(c, job, step)
                ids: set[bytes] = set()
                for ranks in inos.values():
                    for blob in self._blobs(c, [ino for _, ino in ranks]).values():
                        ids.update(blob_chunk_ids(blob))
                if not self._any_staged(c, sorted(ids)):
                    return int(step)
        return None

    def _any_staged(self, c: Any, ids: list[bytes]) -> bool:
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            marks = ",".join("?" * len(part))
            if self._one(
                c,
                f"SELECT 1 FROM chunks WHERE id IN ({marks}) AND state = {STAGED} LIMIT 1",
                part,
            ):
                return True
        return False

    def _step_inos(self, c: Any, job: str, step: int) -> dict[int, list[tuple[bytes, int]]]:
        """rank -> [(path, ino)] from the rank records (files in path order)."""
        out: dict[int, list[tuple[bytes, int]]] = {}
        for rank, inos, paths in self._x(
            c,
            "SELECT rank, inos, paths FROM ckpt_ranks WHERE job = ? AND step = ? ORDER BY rank",
            (job, step),
        ).fetchall():
            nums = [i for (i,) in INO.iter_unpack(bytes(inos))]
            names = bytes(paths).split(b"\0") if nums else []
            out[int(rank)] = list(zip(names, nums, strict=True))
        return out

    def manifest_parts(self, job: str, step: int) -> tuple[dict, dict[int, list[dict]]]:
        """A published step's header and its files grouped by rank (extents packed)."""
        _check_job(job)
        with self._ckpt_read() as c:
            head = self._brief(c, job, step)
            if head["state"] != "published":
                raise MetaError(
                    errno.EAGAIN, f"{job} step {step} is {head['state']}, not published"
                )
            files = self._step_inos(c, job, step)
            by_ino = self._file_rows(c, [ino for fs in files.values() for _, ino in fs])
        by_rank: dict[int, list[dict]] = {}
        for rank, fs in files.items():
            out = by_rank[rank] = []
            for path, ino in fs:
                hit = by_ino.get(ino)
                if hit is not None:  # a file unlinked since publish drops out
                    out.append(
                        {"path": os.fsdecode(path), "size": hit[0], "rank": rank, "extents": hit[1]}
                    )
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
