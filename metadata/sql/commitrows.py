"""The rows a group commit inserts that need no database, made off the writer's path.

The service validates a burst of rank commits in one thread and writes them in
another (metadata/server/groupcommit.py). The writer is the bottleneck: each
batch waits for the one before, while the validator has time to spare. So what
`CheckpointMixin._write_ranks` inserts and can know without the database (the
files' columns, each rank's ckpt_ranks row but its inode numbers, the journal
rows) is made here, by the validator; the writer only resolves directories,
numbers the inodes and runs the statements. Validated chunks waiting for the
writer are merged (`merge`) so that it writes them in one transaction.
"""

from __future__ import annotations

from itertools import chain
from operator import is_
from typing import Any

from metadata.ckptformat import INO, RANK

JOURNAL_GROUP = 32  # rank commits of one step per journal row


def journal_rows(by_step: dict[tuple[str, int, int | None], list[tuple]]) -> list[tuple]:
    """ref_journal rows for a group commit's (rank, chunks, refs, closed) entries: up to
    JOURNAL_GROUP ranks of one step and trust domain (chunkrefs.py) per row. Thousands
    of rows of a few KB each cost more than the blobs (measured: ~100 ms of a 4096-rank
    write), and an applied slice is still small. Blobs are bytearrays (see
    SqlEngine._bulk_insert)."""
    rows = []
    for (job, step, domain), entries in by_step.items():
        for g in range(0, len(entries), JOURNAL_GROUP):
            part = entries[g : g + JOURNAL_GROUP]
            ranks = _BLOB.join(RANK.pack(e[0]) for e in part)
            chunks = _BLOB.join(e[1] for e in part if not e[3])
            refs = _BLOB.join(e[2] for e in part)
            owned = _BLOB.join(e[1] for e in part if e[3])
            rows.append((job, step, part[0][0], ranks, chunks, refs, owned, domain))
    return rows


_BLOB = bytearray()  # its join() makes a bytearray


class Rows:
    """What `_write_ranks` inserts for a list of prepared commits that needs no database:
    the files' columns, each rank's ckpt_ranks row but its inode numbers and time, the
    journal rows. Made by the validator (`CheckpointMixin.prepare_commits`): ~25 ms of
    the writer's Python per 4096 ranks before (bytearray copies of the extents, the rows'
    tuples, the journal's joins). The writer uses them only when it writes exactly these
    commits (`cover`); else it makes its own for what it writes."""

    def __init__(self, todo: list[tuple], domains: dict, *, files: bool = True) -> None:
        self.todo = todo
        self.files = FileCols.of(todo) if files else None
        self.ranks: list[tuple] = []  # ckpt_ranks rows less `committed` and `inos`
        self.ino_ends = [0]  # byte offsets of each rank's INO records
        journal: dict[tuple[str, int, int | None], list[tuple]] = {}
        end = 0
        for i, job, step, rank, files_, host, digest, new_bytes, closed, parts in todo:
            size, paths, chunks, refs = parts[:4]
            n = len(files_)
            self.ranks.append(
                (job, step, rank, host, size, new_bytes, n, bytearray(digest), bytearray(paths))
            )
            end += INO.size * n
            self.ino_ends.append(end)
            if refs or chunks:
                key = (job, step, domains.get(i))  # (a trusted committer's: None)
                journal.setdefault(key, []).append((rank, chunks, refs, closed))
        self.journal = journal_rows(journal) if journal else []

    def cover(self, fresh: list[tuple]) -> bool:
        """Are `fresh` exactly the commits these rows were made for, in the same order?"""
        return len(fresh) == len(self.todo) and all(map(is_, fresh, self.todo))

    @classmethod
    def joined(cls, parts: list[Rows], todo: list[tuple]) -> Rows:
        """One Rows of several, for `todo`: their commits, one after another."""
        new = cls.__new__(cls)
        new.todo = todo
        new.files = FileCols() if all(p.files for p in parts) else None
        new.ranks, new.ino_ends, new.journal = [], [0], []
        for p in parts:
            if new.files is not None and p.files is not None:
                new.files.extend(p.files)
            new.ranks += p.ranks
            base = new.ino_ends[-1]
            new.ino_ends += [base + e for e in p.ino_ends[1:]]
            new.journal += p.journal
        return new


class FileCols:
    """Every file's directory prefix, name, size, extents and alloc, in commit order;
    names (also as bytearrays) and extents as bytearrays, the values the inserts bind
    (see SqlEngine._bulk_insert)."""

    def __init__(self) -> None:
        self.prefixes: list[tuple[bytes, ...]] = []
        self.names: list[bytes] = []
        self.name_blobs: list[bytearray] = []
        self.sizes: list[int] = []
        self.blobs: list[bytearray] = []
        self.allocs: list[int] = []

    @classmethod
    def of(cls, todo: list[tuple]) -> FileCols:
        out = cls()
        rows = list(chain.from_iterable(t[4] for t in todo))
        if rows:
            _, parts, sizes, blobs, _ = zip(*rows, strict=True)
            out.prefixes = [tuple(p[:-1]) for p in parts]
            out.names = [p[-1] for p in parts]
            out.name_blobs = list(map(bytearray, out.names))
            out.sizes = list(sizes)
            out.blobs = list(map(bytearray, blobs))
            out.allocs = list(chain.from_iterable(t[9][5] for t in todo))
        return out

    def extend(self, other: FileCols) -> None:
        for name, col in vars(other).items():
            getattr(self, name).extend(col)


def merge(prepared: list[tuple]) -> tuple[list[Any], list[tuple], dict, Rows | None]:
    """Several `prepare_commits` results as one, to write in one transaction: their
    items one after another (each commit's item index moved past the ones before)."""
    out: list[Any] = []
    todo: list[tuple] = []
    domains: dict[int, int] = {}
    rows: list[Rows | None] = []
    for p in prepared:
        off = len(out)
        out += p[0]
        todo += p[1] if not off else [(t[0] + off, *t[1:]) for t in p[1]]
        domains.update((i + off, d) for i, d in (p[2] if len(p) > 2 else {}).items())
        rows.append(p[3] if len(p) > 3 else None)
    parts = [r for r in rows if r is not None]
    return out, todo, domains, Rows.joined(parts, todo) if len(parts) == len(rows) else None
