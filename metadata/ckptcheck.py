"""Checks of checkpoint requests, before any database access: one rule set, one
implementation, whatever the batch.

Pure CPU work: the service validates the next group commit in a thread while
the previous one is written (`prepare_commits`). Thousands of ranks commit at
once, so a batch is checked column by column: a pass of C-speed builtins over
every file's fields, then numpy over every file's packed extents and chunk
records at once. Each rule is written once and yields, per file, whether it
holds; a rank's error is the first broken rule of its first bad file, in the
order its files were sent, which is what the rank gets alone or in any batch.
Names: job names and checkpoint paths are relative paths without '..', NUL or
over-long names; the file paths that passed are remembered (`_check_paths`).
"""

from __future__ import annotations

import errno
import os
import struct
import sys
from itertools import accumulate, chain
from operator import attrgetter, itemgetter, lt
from typing import Any

import numpy as np
import xxhash

from metadata.ckptformat import CHK, EXT, WireFile, file_fields, pack_files
from metadata.engine import (
    DURABLE,
    MAX_CHUNK_BYTES,
    NAME_MAX,
    MetaError,
)

PATH_MAX = 4096
MAX_FILES_PER_RANK = 100_000
MAX_WORLD = 1 << 20


def split_rel(path: str | bytes, what: str = "path") -> list[bytes]:
    """A path relative to its checkpoint: no absolute paths, '..', NUL or bad names."""
    got = _path_check(path, what)
    if type(got) is not tuple:
        raise got
    return list(got[1])


def _path_check(path: Any, what: str = "path") -> tuple[bytes, tuple[bytes, ...]] | MetaError:
    """The path rules: (the path's bytes, its parts), or the error saying which rule it
    breaks (returned, not raised: a batch checks thousands at once). The bytes are the
    parts joined: a path is rejected, never rewritten."""
    try:
        if type(path) is str:
            raw = path.encode(_FSENC, _FSERR)
        else:  # a str subclass: encoded the standard way
            raw = os.fsencode(path) if isinstance(path, str) else path
    except UnicodeError as e:  # a lone surrogate the encoder's error handler cannot take
        return MetaError(errno.EINVAL, f"{what} is not encodable: {e}")
    if not isinstance(raw, bytes) or not raw:
        return MetaError(errno.EINVAL, f"{what} must be a non-empty string")
    if len(raw) > PATH_MAX:
        return MetaError(errno.ENAMETOOLONG, f"{what} longer than {PATH_MAX} bytes")
    if raw[0] == 47 or b"\0" in raw:  # 47: "/"
        return MetaError(errno.EINVAL, f"{what} {raw[:80]!r} must be relative, without NUL")
    parts = raw.split(b"/")
    # check_name's rules, checked for all parts at once (16k paths per 4096-rank step)
    if b"" in parts or b"." in parts or b".." in parts:
        return MetaError(errno.EINVAL, f"{what} {raw[:80]!r} escapes or is not normalized")
    if len(raw) > NAME_MAX and max(map(len, parts)) > NAME_MAX:
        return MetaError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes in {what}")
    return raw, tuple(parts)


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


MANIFEST_RANKS_MAX = 65536  # ranks one manifest request may name (a host has far fewer)


def no_durable_step(job: str) -> MetaError:
    """What a manifest of the latest durable step answers when there is none."""
    return MetaError(
        errno.ENOENT, f"{job} has no durable step (none published, or none on the nodes yet)"
    )


def manifest_ranks(rank: Any, ranks: Any) -> list[int] | None:
    """The ranks a manifest request asks for (None: the whole step), checked: one `rank`,
    or a list `ranks` of at most MANIFEST_RANKS_MAX distinct ranks; not both."""
    if rank is not None and ranks is not None:
        raise MetaError(errno.EINVAL, "give rank or ranks, not both")
    if rank is not None:
        return [check_int(rank, "rank")]
    if ranks is None:
        return None
    if not isinstance(ranks, list | tuple) or len(ranks) > MANIFEST_RANKS_MAX:
        raise MetaError(errno.EINVAL, f"ranks must be a list of at most {MANIFEST_RANKS_MAX}")
    out = [check_int(r, "rank") for r in ranks]
    if len(set(out)) != len(out):
        raise MetaError(errno.EINVAL, "ranks must be distinct")
    return out


# -- a batch of rank commits ------------------------------------------------------------
#
# prepare_commits' output, per valid commit: (item index, job, step, rank, files, host,
# digest, new bytes, closed, parts). files: (path, parts, size, packed extents, packed
# new chunks), in path order. closed: every file's extents are exactly its new chunks, in
# order (the journal then takes one reference per chunk record and needs no copy of the
# extents). parts, what the write needs, computed here, off the writer's path: (total
# size, the paths joined with NULs, the new chunks and, unless closed, the extents, packed
# (the journal's blobs), the directory prefixes the files need, each file's `alloc`: the
# bytes its extents cover).


def prepare_commits(items: list[tuple]) -> tuple[list[Any], list[tuple]]:
    """Validate a group commit's (job, step, rank, files, host) items without the
    database: (each item's error or None, the valid commits). Every item gets exactly
    the error it gets alone (module docstring)."""
    out: list[Any] = [None] * len(items)
    heads: list[tuple] = []  # (item index, job, step, rank, host, files)
    jobs: set[str] = set()  # job names checked in this batch (one per step, usually)
    for i, item in enumerate(items):
        try:
            job, step, rank, files, host = item[:5]  # (a sixth: checkpoints.py)
            if type(job) is not str or job not in jobs:
                jobs.add(check_job(job))
            if type(step) is not int or not 0 <= step < 2**62:  # (the usual ones: no call)
                check_int(step, "step")
            if type(rank) is not int or not 0 <= rank < 2**62:
                check_int(rank, "rank")
            if not isinstance(host, str) or len(host) > 255:
                raise MetaError(errno.EINVAL, "host must be a string of at most 255 chars")
            if not isinstance(files, list):
                raise MetaError(errno.EINVAL, "files must be a list")
            if len(files) > MAX_FILES_PER_RANK:
                raise MetaError(
                    errno.E2BIG, f"more than {MAX_FILES_PER_RANK} files in one rank commit"
                )
            heads.append((i, job, step, rank, host, files))
        except MetaError as e:
            out[i] = e
        except (TypeError, ValueError) as e:
            out[i] = MetaError(errno.EINVAL, f"bad commit_rank arguments: {e}")
    if not set(map(type, chain.from_iterable(h[5] for h in heads))) <= {WireFile}:
        heads = _dict_files(heads, out)  # typed by the decoder, usually: nothing to do
    if not heads:
        return out, []
    cols = _Columns(heads)
    for k, err in cols.errors().items():
        out[heads[k][0]] = err
    return out, cols.commits()


def _dict_files(heads: list[tuple], out: list[Any]) -> list[tuple]:
    """Ranks whose files are not all WireFiles (the service decodes them so): each must
    be a dict (or a WireFile), and Extent/NewChunk lists are packed here; a rank that
    sends anything else gets its error in `out` and is dropped."""
    kept = []
    for h in heads:
        files = h[5]
        if all(type(f) is WireFile for f in files):
            kept.append(h)
        elif not all(isinstance(f, dict | WireFile) for f in files):
            out[h[0]] = MetaError(errno.EINVAL, "each file is a dict with path, size, extents")
        elif any(
            type(f) is dict
            and (isinstance(f.get("extents"), list) or isinstance(f.get("new_chunks"), list))
            for f in files
        ):
            try:
                kept.append((*h[:5], pack_files(files)))
            except (TypeError, ValueError) as e:
                out[h[0]] = MetaError(errno.EINVAL, f"bad commit_rank arguments: {e}")
        else:
            kept.append(h)
    return kept


_PATH, _SIZE = attrgetter("path"), attrgetter("size")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_EXTS, _CHKS = attrgetter("extents"), attrgetter("new_chunks")
_BAD_EXTENT, _PAST_END, _BAD_CHUNK = 1, 2, 3  # _file_faults' codes


class _Columns:
    """Every file of a batch's ranks, field by field, in the order sent.

    The per-file rules, in the order a rank's error names them: the path
    (`_path_check`), not listed twice, the size, extents and new chunks packed;
    then, for the packed records (`_file_faults`, vectorized): extents sorted and
    not overlapping, inside the size, new-chunk records in range."""

    def __init__(self, heads: list[tuple]) -> None:
        self.heads = heads
        self.counts = [len(h[5]) for h in heads]
        self.starts = list(accumulate(self.counts, initial=0))
        flat = list(chain.from_iterable(h[5] for h in heads))
        self.nf = nf = len(flat)
        if set(map(type, flat)) <= {WireFile}:  # as the service decodes them
            paths, sizes = list(map(_PATH, flat)), list(map(_SIZE, flat))
            exts, chks = list(map(_EXTS, flat)), list(map(_CHKS, flat))
        elif nf:
            paths, sizes, exts, chks = (list(c) for c in zip(*map(file_fields, flat), strict=True))
        else:
            paths, sizes, exts, chks = [], [], [], []
        self.checked = checked = _check_paths(paths)
        self.sizes, self.exts, self.chks = sizes, exts, chks
        # the rules the C-speed pass can tell hold for every file (else `_scalar_fault`
        # walks the files of the ranks where one may not)
        ok = (
            set(map(type, checked)) <= {tuple}
            and set(map(type, sizes)) <= {int}
            and (not nf or (min(sizes) >= 0 and max(sizes) < 2**62))
            and set(map(type, exts)) | set(map(type, chks)) <= {bytes}
        )
        if ok:
            self.elen = np.fromiter(map(len, exts), np.int64, nf)
            self.clen = np.fromiter(map(len, chks), np.int64, nf)
            ok = not ((self.elen % EXT.size).any() or (self.clen % CHK.size).any())
            self.raws = list(map(_FIRST, checked))
        else:
            self.elen = self.clen = None
            self.raws = [c[0] if type(c) is tuple else b"" for c in checked]
        self.unsorted = _unsorted(self.raws, self.starts)
        # rank -> (file, error): the first broken rule, of the rank's first bad file
        self.scalar: dict[int, tuple[int, MetaError]] = {}
        suspects = range(len(heads)) if not ok else self._with_dups()
        for k in suspects:
            fault = self._scalar_fault(k)
            if fault is not None:
                self.scalar[k] = fault
        self._numeric()

    def _with_dups(self) -> list[int]:
        """Ranks that list a path twice (their paths, sorted, repeat one)."""
        dups = []
        for k in self.unsorted:
            a, b = self.starts[k], self.starts[k + 1]
            names = self.raws[a:b]
            if len(set(names)) != len(names):
                dups.append(k)
        return dups

    def _scalar_fault(self, k: int) -> tuple[int, MetaError] | None:
        """Rank k's first file (in the order sent) that breaks a rule the numeric pass
        does not check, with its error; None if none does. Blobs of bytes' kin become
        bytes, as the wire's would be."""
        seen: set[bytes] = set()
        for j in range(self.starts[k], self.starts[k + 1]):
            got = self.checked[j]
            if type(got) is not tuple:
                return j, got
            path = got[0]
            if path in seen:
                return j, MetaError(errno.EINVAL, f"file {path!r} listed twice")
            seen.add(path)
            size = self.sizes[j]
            if type(size) is not int or not 0 <= size < 2**62:
                try:
                    check_int(size, "size")
                except MetaError as e:
                    return j, e
            blob, chk = self.exts[j], self.chks[j]
            if type(blob) is not bytes or type(chk) is not bytes:
                if not isinstance(blob, bytes | bytearray) or not isinstance(
                    chk, bytes | bytearray
                ):
                    return j, _not_packed(path)
                self.exts[j], self.chks[j] = blob, chk = bytes(blob), bytes(chk)
            if len(blob) % EXT.size or len(chk) % CHK.size:
                return j, _not_packed(path)
        return None

    def _numeric(self) -> None:
        """The packed records' rules for every file the scalar rules passed (all of
        them, usually): per file, a fault code and what the error needs."""
        nf = self.nf
        take = np.ones(nf, bool)  # files whose records are checked
        for k, (j, _) in self.scalar.items():
            take[j : self.starts[k + 1]] = False  # the rank's error is this file's or before
        self.take = take
        if not self.scalar and self.elen is not None:  # the usual batch: every file
            idx: Any = range(nf)
            exts, chks, sizes = self.exts, self.chks, self.sizes
            self.ext_n, self.chk_n = self.elen // EXT.size, self.clen // CHK.size
        else:
            idx = np.flatnonzero(take).tolist()
            exts = [self.exts[j] for j in idx]
            chks = [self.chks[j] for j in idx]
            sizes = [self.sizes[j] for j in idx]
            self.ext_n = np.fromiter(map(len, exts), np.int64, len(exts)) // EXT.size
            self.chk_n = np.fromiter(map(len, chks), np.int64, len(chks)) // CHK.size
        self.ext_all, self.chk_all = b"".join(exts), b"".join(chks)
        self.code, self.detail, self.alloc, self.new, self.closed = _file_faults(
            sizes, self.ext_all, self.ext_n, self.chk_all, self.chk_n
        )
        self.pos = np.full(nf, -1, np.int64)  # file -> its row in the numeric columns
        self.pos[np.asarray(idx, np.int64)] = np.arange(len(idx))

    def errors(self) -> dict[int, MetaError]:
        """Rank index -> its error, for the ranks that have one."""
        if self._errors is None:
            self._errors = self._find_errors()
        return self._errors

    _errors: dict[int, MetaError] | None = None

    def _find_errors(self) -> dict[int, MetaError]:
        out: dict[int, MetaError] = {}
        bad_files = np.flatnonzero(self.code)  # rows of the numeric columns
        first_numeric: dict[int, int] = {}  # rank -> its first file with a numeric fault
        if len(bad_files):
            files = np.flatnonzero(self.take)[bad_files] if not self.take.all() else bad_files
            owner = np.searchsorted(np.asarray(self.starts), files, side="right") - 1
            for j, k in zip(files.tolist(), owner.tolist(), strict=True):
                first_numeric.setdefault(k, j)
        for k in set(first_numeric) | set(self.scalar):
            j = first_numeric.get(k)
            scalar = self.scalar.get(k)
            if scalar is not None and (j is None or scalar[0] < j):
                out[k] = scalar[1]
            else:
                out[k] = self._numeric_error(j)
        return out

    def _numeric_error(self, j: int) -> MetaError:
        path, row = self.raws[j], int(self.pos[j])
        code, detail = int(self.code[row]), int(self.detail[row])
        if code == _BAD_EXTENT:
            off = EXT.unpack_from(self.ext_all, detail * EXT.size)[0]
            return MetaError(errno.EINVAL, f"{path!r}: bad extent list at offset {off}")
        if code == _PAST_END:
            off, n = EXT.unpack_from(self.ext_all, detail * EXT.size)[:2]
            size = self.sizes[j]
            return MetaError(errno.EINVAL, f"{path!r}: extents end at {off + n}, past size {size}")
        return MetaError(errno.EINVAL, f"{path!r}: bad new chunk record")

    def commits(self) -> list[tuple]:
        """The valid ranks' commits (see the section comment), files in path order."""
        bad = self.errors()
        good = [k for k in range(len(self.heads)) if k not in bad]
        if not good:
            return []
        starts, raws = self.starts, self.raws
        unsorted = set(self.unsorted)  # usually none: ranks send them sorted
        if len(good) == len(self.heads) and not unsorted:  # the usual batch: as checked
            paths, sizes, exts, chks = raws, self.sizes, self.exts, self.chks
            parts = list(map(_SECOND, self.checked))
            alloc, new, closed = self.alloc, self.new, self.closed
            ext_all, chk_all = self.ext_all, self.chk_all
            elen, clen = self.ext_n * EXT.size, self.chk_n * CHK.size
        else:
            files: list[int] = []  # every good file, each rank's in path order
            for k in good:
                run = range(starts[k], starts[k + 1])
                files.extend(sorted(run, key=raws.__getitem__) if k in unsorted else run)
            rows = self.pos[np.asarray(files, np.int64)]
            paths = [raws[j] for j in files]
            parts = [self.checked[j][1] for j in files]
            sizes = [self.sizes[j] for j in files]
            exts = [self.exts[j] for j in files]
            chks = [self.chks[j] for j in files]
            alloc, new, closed = self.alloc[rows], self.new[rows], self.closed[rows]
            ext_all, chk_all = b"".join(exts), b"".join(chks)
            elen = np.fromiter(map(len, exts), np.int64, len(exts))
            clen = np.fromiter(map(len, chks), np.int64, len(chks))
        nf = len(paths)
        alloc = alloc.tolist()
        # Per file: the digest's head (see `_DIGEST_HEAD`), and offsets into the columns.
        plen = np.fromiter(map(len, paths), np.int64, nf)
        heads = np.empty((nf, 4), "<u8")
        heads[:, 0], heads[:, 1] = plen, np.fromiter(sizes, np.uint64, nf)
        heads[:, 2], heads[:, 3] = elen // EXT.size, clen // CHK.size
        hsz = _DIGEST_HEAD.size
        p_at = [0, *accumulate((plen + 1).tolist())]
        e_at, c_at = [0, *accumulate(elen.tolist())], [0, *accumulate(clen.tolist())]
        s_at = [0, *accumulate(sizes)]
        n_at = _prefix(new).tolist()
        open_at = _prefix(~closed).tolist()  # files not closed, running count
        praw = b"\0".join(paths)
        hv, pv, ev, cv = map(memoryview, (heads.tobytes(), praw, ext_all, chk_all))
        rowsets = list(zip(paths, parts, sizes, exts, chks, strict=True))
        shallow = not parts or max(map(len, parts)) <= 2  # one directory deep at most
        todo = []
        a = 0
        for k in good:
            i, job, step, rank, host, _ = self.heads[k]
            b = a + self.counts[k]
            pe = p_at[b] - 1 if b > a else p_at[a]  # the rank's paths end (no files: empty)
            if shallow:
                dirs = {(p[0],) for p in parts[a:b] if len(p) == 2}
            else:
                dirs = {tuple(p[:d]) for p in parts[a:b] for d in range(1, len(p))}
            is_closed = open_at[b] == open_at[a]
            rank_parts = (
                s_at[b] - s_at[a],
                praw[p_at[a] : pe],
                chk_all[c_at[a] : c_at[b]],
                b"" if is_closed else ext_all[e_at[a] : e_at[b]],
                dirs,
                alloc[a:b],
            )
            h = xxhash.xxh3_128(hv[hsz * a : hsz * b])
            h.update(pv[p_at[a] : pe])
            h.update(ev[e_at[a] : e_at[b]])
            h.update(cv[c_at[a] : c_at[b]])
            todo.append((i, job, step, rank, rowsets[a:b], host, h.digest(), n_at[b] - n_at[a],
                         is_closed, rank_parts))  # fmt: skip
            a = b
        return todo


def _check_paths(paths: list) -> list:
    """`_path_check` of each path, remembering the str paths that pass (a plain dict,
    emptied when full): a job's ranks send the same file names at every step, and 16k
    paths checked afresh cost ~18 ms of a 4096-rank commit's validation, ~2 ms when
    remembered. A path that fails is checked again each time (its error is made anew:
    an exception raised twice would grow its traceback)."""
    if not set(map(type, paths)) <= {str}:
        return list(map(_path_check, paths))
    checked = list(map(_GOOD_PATHS.get, paths))
    if None in checked:
        if len(_GOOD_PATHS) >= GOOD_PATHS_MAX:
            _GOOD_PATHS.clear()
        for j, got in enumerate(checked):
            if got is None:
                got = checked[j] = _path_check(paths[j])
                if type(got) is tuple:
                    _GOOD_PATHS[paths[j]] = got
    return checked


GOOD_PATHS_MAX = 1 << 17
_GOOD_PATHS: dict[str, tuple[bytes, tuple[bytes, ...]]] = {}


def _not_packed(path: bytes) -> MetaError:
    return MetaError(errno.EINVAL, f"{path!r}: extents/new_chunks are not packed lists")


def _file_faults(
    sizes: list[int], ext_all: bytes, ext_n: Any, chk_all: bytes, chk_n: Any
) -> tuple[Any, Any, Any, Any, Any]:
    """The packed records' rules for many files at once: file j has sizes[j], ext_n[j]
    extents and chk_n[j] new-chunk records, every file's packed one after another in
    ext_all and chk_all.

    Per file: the fault code (0 none; _BAD_EXTENT: an extent empty, or starting before
    the previous one ends; _PAST_END: the last extent ends past the size; _BAD_CHUNK: a
    record's lengths out of range or its state unknown; the first of these that applies,
    as they are listed) and the extent it names; the bytes its extents cover (`alloc`),
    the raw bytes of its new chunks, and whether it is closed (its extents are exactly
    its new chunks, in order: no known chunk to look up). Fields are read through strided
    views of the packed records (numpy's structured-dtype access copied, ~3x slower);
    sums are exact (uint64 differences of cumulative sums), ends are checked for
    wrapping past 2**64."""
    nf = len(sizes)
    code = np.zeros(nf, np.int8)
    detail = np.zeros(nf, np.int64)
    ne, nc = len(ext_all) // EXT.size, len(chk_all) // CHK.size
    fidx = np.repeat(np.arange(nf), ext_n)
    e_at = np.concatenate(([0], np.cumsum(ext_n)))
    if ne:
        off = np.ndarray((ne,), "<u8", ext_all, 0, (EXT.size,))
        ln = np.ndarray((ne,), "<u8", ext_all, 8, (EXT.size,))
        end = off + ln  # wraps past 2**64: `wrapped`
        wrapped = end < off
        same_file = fidx[1:] == fidx[:-1]
        bad = ln == 0
        bad[1:] |= same_file & ((off[1:] < end[:-1]) | wrapped[:-1])
        if bad.any():
            at = np.flatnonzero(bad)
            files, first = np.unique(fidx[at], return_index=True)
            code[files], detail[files] = _BAD_EXTENT, at[first]
        last = e_at[1:][ext_n > 0] - 1  # each file's last extent
        lf = fidx[last]
        past = wrapped[last] | (end[last] > np.fromiter(sizes, np.uint64, nf)[lf])
        past &= code[lf] == 0
        code[lf[past]], detail[lf[past]] = _PAST_END, last[past]
        alloc = np.diff(_prefix(ln)[e_at])
    else:
        alloc = np.zeros(nf, np.uint64)
    c_at = np.concatenate(([0], np.cumsum(chk_n)))
    if nc:
        raw = np.ndarray((nc,), "<u8", chk_all, 16, (CHK.size,))
        stored = np.ndarray((nc,), "<u8", chk_all, 24, (CHK.size,))
        st = np.ndarray((nc,), "u1", chk_all, 32, (CHK.size,))
        big = (raw >= MAX_CHUNK_BYTES) | (stored >= MAX_CHUNK_BYTES)
        badc = (raw == 0) | (stored == 0) | big | (st > DURABLE)
        if badc.any():
            files = np.unique(np.repeat(np.arange(nf), chk_n)[badc])
            files = files[code[files] == 0]
            code[files] = _BAD_CHUNK
        new = np.diff(_prefix(raw)[c_at])
    else:
        new = np.zeros(nf, np.uint64)
    closed = ext_n == chk_n
    if ne and nc and closed.any():
        e_lo, e_hi = (np.ndarray((ne,), "<u8", ext_all, 24 + h, (EXT.size,)) for h in (0, 8))
        c_lo, c_hi = (np.ndarray((nc,), "<u8", chk_all, h, (CHK.size,)) for h in (0, 8))
        if closed.all():  # the usual batch: the ids of all files align
            differ, files = (e_lo != c_lo) | (e_hi != c_hi), fidx
        else:
            em, cm = np.repeat(closed, ext_n), np.repeat(closed, chk_n)
            differ = (e_lo[em] != c_lo[cm]) | (e_hi[em] != c_hi[cm])
            files = fidx[em]
        closed &= np.bincount(files, weights=differ, minlength=nf) == 0
    return code, detail, alloc, new, closed


def _prefix(values: Any) -> Any:
    """0 and the running sums of unsigned 64-bit values, as uint64 (differences of it are
    exact sums below 2**64; numpy would make a float64 of [0] and uint64s)."""
    out = np.zeros(len(values) + 1, np.uint64)
    np.cumsum(values, dtype=np.uint64, out=out[1:])
    return out


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


# A rank commit's identity (its digest): xxh3-128 over each file's (path length, size,
# extent count, chunk count), then the paths joined with NULs, the extents, the new
# chunks, in path order. A retry with the same content has the same digest.
_DIGEST_HEAD = struct.Struct("<QQQQ")
