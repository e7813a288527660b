"""Checks of checkpoint requests, before any database access.

Pure CPU work: the service validates the next group commit in a thread while
the previous one is written. Names: job names and checkpoint paths are
relative paths without '..', NUL or over-long names.
"""

from __future__ import annotations

import errno
import os
import struct
import sys
from itertools import accumulate, chain, repeat
from operator import attrgetter, lt
from typing import Any

import numpy as np
import xxhash

from metadata.ckptformat import CHK, EXT, WireFile, file_fields, pack_files
from metadata.engine import (
    DURABLE,
    MAX_CHUNK_BYTES,
    NAME_MAX,
    MetaError,
    chunk_lengths_ok,
)

PATH_MAX = 4096
MAX_FILES_PER_RANK = 100_000
MAX_WORLD = 1 << 20


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


def check_job(job: Any) -> str:
    if not isinstance(job, str) or not job or len(job) > 200:
        raise MetaError(errno.EINVAL, "job must be a non-empty string of at most 200 characters")
    split_rel(job, "job name")
    return job


def check_int(v: Any, what: str, lo: int = 0, hi: int = 2**62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise MetaError(errno.EINVAL, f"{what} must be an integer in [{lo}, {hi})")
    return v


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
            size = check_int(size, "size")
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
            check_job(job)
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
