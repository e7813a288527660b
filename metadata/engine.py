"""The metadata engine interface: what every engine (SQLite, PostgreSQL, the
network client) provides. Short on purpose, like JuiceFS's meta interface.

Every mutating method is one transaction: a crash leaves the namespace either
before or after the call. Names are bytes (POSIX names are not text); they are
validated here, once, for every engine.

Files are lists of extents. An extent maps file bytes [offset, offset+length)
to chunk bytes [chunk_off, chunk_off+length); bytes of a file covered by no
extent read as zeros (holes cost nothing, so truncate to a huge size is free).
Chunks are reference counted by the extents that point at them; a chunk whose
count falls to zero stays until garbage collection and its grace period.
"""

from __future__ import annotations

import errno
import stat
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import xxhash

ROOT_INO = 1
NAME_MAX = 255
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

# Chunk states: staged = only in a host's write-behind tier; durable = on R nodes;
# inline = small enough that its bytes live in the metadata beside the extents naming it
# (`inline_data`), never on a node: see INLINE_DATA_MAX.
STAGED = 0
DURABLE = 1
INLINE = 2

# Chunks up to this size (raw bytes) may be stored inline in the metadata. A 4 KiB file
# stored as an object costs a staged file, a journal fsync on close, and R node writes
# with their fsyncs in the background; inline, its bytes go in the close's one metadata
# transaction (as Lustre's data-on-MDT does for small files). The bytes are exactly as
# durable as the file's name and extents, which live in the same database.
INLINE_DATA_MAX = 16 * 1024


class MetaError(Exception):
    """An engine refused a request; `errno` is what the FUSE layer returns."""

    def __init__(self, err: int, message: str) -> None:
        super().__init__(message)
        self.errno = err

    def __reduce__(self):  # errors cross process boundaries (DCP gathers them from ranks)
        return (type(self), (self.errno, str(self)))


class UnknownChunks(MetaError):
    """Extents name chunks that no one registered: the caller must store them first."""


class MetaBusy(MetaError):
    """A loop engine's call that would have waited (a lock, a recovery): nothing was done,
    and the caller runs it again on an ordinary engine, from a worker."""

    def __init__(self, err: int = errno.EAGAIN, message: str = "busy") -> None:
        super().__init__(err, message)


def internal_error(what: str, e: BaseException) -> MetaError:
    """An unexpected failure (a bug, a broken database) as the EIO a client is answered."""
    return MetaError(errno.EIO, f"{what} failed: {type(e).__name__}: {e}")


def shutting_down() -> MetaError:
    """The answer to a request the service stops before running: retry elsewhere."""
    return MetaError(errno.EAGAIN, "service shutting down; retry")


COMMIT_RANKS_MAX = 4096  # ranks in one commit_ranks: a host's, or a few hosts'


def rank_items(job: str, step: int, ranks: list) -> list[tuple | MetaError]:
    """A commit_ranks request's ranks as commit_rank items (job, step, rank, files, host),
    or each rank's own refusal. The request as a whole is refused (EINVAL, nothing
    committed) unless `ranks` is a list of at most COMMIT_RANKS_MAX [rank, files] or
    [rank, files, host] entries. A rank listed twice is refused wherever it appears:
    which of its two commits was meant is not ours to guess; the other ranks go on."""
    if not isinstance(ranks, list | tuple):
        raise MetaError(errno.EINVAL, "commit_ranks: ranks must be a list of [rank, files, host]")
    if len(ranks) > COMMIT_RANKS_MAX:
        raise MetaError(
            errno.EINVAL,
            f"commit_ranks: at most {COMMIT_RANKS_MAX} ranks in one request, got {len(ranks)}",
        )
    items: list[tuple] = []
    seen: dict[int, int] = {}
    for r in ranks:
        if not isinstance(r, list | tuple) or not 2 <= len(r) <= 3:
            raise MetaError(
                errno.EINVAL, "commit_ranks: each rank is [rank, files] or [rank, files, host]"
            )
        items.append((job, step, r[0], r[1], r[2] if len(r) > 2 else ""))
        if type(r[0]) is int:
            seen[r[0]] = seen.get(r[0], 0) + 1
    if len(seen) == len(items):  # (all distinct ints: the usual case)
        return list(items)
    twice = {r: n for r, n in seen.items() if n > 1}
    return [
        MetaError(errno.EINVAL, f"commit_ranks: rank {it[2]} appears {twice[it[2]]} times")
        if type(it[2]) is int and it[2] in twice
        else it
        for it in items
    ]


def rank_answer(res: dict | MetaError) -> dict:
    """One rank's entry in a commit_ranks answer: {"ok": commit_rank's answer}, or
    {"errno", "error"}: one rank's refusal never fails the others."""
    if isinstance(res, MetaError):
        return {"errno": res.errno, "error": str(res)}
    return {"ok": res}


@dataclass
class Attr:
    ino: int
    mode: int  # full st_mode, file type bits included
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0
    generation: int = 0  # bumped by every extent commit: lets caches know a file changed
    alloc: int = -1  # bytes its extents cover (holes excluded); -1: not kept, use size

    @property
    def blocks(self) -> int:
        """st_blocks: 512-byte units of the bytes stored for the file (a sparse file's
        holes take none)."""
        return ((self.size if self.alloc < 0 else self.alloc) + 511) // 512

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_link(self) -> bool:
        return stat.S_ISLNK(self.mode)


@dataclass(frozen=True)
class Extent:
    offset: int
    length: int
    chunk_id: bytes
    chunk_off: int = 0


@dataclass(frozen=True)
class NewChunk:
    """A chunk first stored by the committing writer; an INLINE one carries its bytes."""

    chunk_id: bytes
    raw_len: int
    stored_len: int
    state: int = DURABLE
    data: bytes = b""

    @classmethod
    def inline(cls, chunk_id: bytes, raw: bytes) -> NewChunk:
        return cls(chunk_id, len(raw), len(raw), INLINE, bytes(raw))


@dataclass(frozen=True)
class ChunkRow:
    """A chunk's metadata row, as fsck and gc see it."""

    raw_len: int
    stored_len: int
    refcount: int
    state: int
    touched_ns: int


@dataclass
class DirEntry:
    name: bytes
    attr: Attr
    next_offset: int  # readdir cookie: pass it back to continue after this entry


@dataclass
class VolumeStats:
    logical_bytes: int = 0
    stored_bytes: int = 0
    raw_unique_bytes: int = 0
    unique_chunks: int = 0
    staged_chunks: int = 0
    files: int = 0
    inodes: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        dedup = self.logical_bytes / self.raw_unique_bytes if self.raw_unique_bytes else 1.0
        comp = self.raw_unique_bytes / self.stored_bytes if self.stored_bytes else 1.0
        return {
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "unique_chunks": self.unique_chunks,
            "dedup_ratio": round(dedup, 4),
            "compression_ratio": round(comp, 4),
            "raw_unique_bytes": self.raw_unique_bytes,
            "staged_chunks": self.staged_chunks,
            "files": self.files,
            "inodes": self.inodes,
            **self.extra,
        }


def check_name(name: bytes) -> bytes:
    """Reject names POSIX or we cannot store: empty, '.', '..', '/', NUL, > 255 bytes."""
    if not isinstance(name, bytes):
        raise MetaError(errno.EINVAL, f"name must be bytes, got {type(name).__name__}")
    if len(name) > NAME_MAX:
        raise MetaError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes: {name[:40]!r}...")
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise MetaError(errno.EINVAL, f"invalid name {name!r}")
    return name


def check_u32(value: object, what: str) -> int:
    """A uid, gid or mode: an int in [0, 2**32). Stored as given, a value of another type
    or range (from a client of the service) made every later stat of the inode fail on
    every mount."""
    if type(value) is not int or not 0 <= value < 2**32:
        raise MetaError(errno.EINVAL, f"{what} must be an integer in [0, 2**32), not {value!r:.40}")
    return value


def check_blob(value: object, what: str) -> bytes:
    """A byte string the metadata stores (a symlink target, an xattr value)."""
    if not isinstance(value, bytes):
        raise MetaError(errno.EINVAL, f"{what} must be bytes, not {type(value).__name__}")
    return value


def inline_chunk_id(data: bytes, seed: int) -> bytes:
    """The chunk id of inline bytes, to check them against the id they claim.

    The id is a format fact of the volume (DESIGN.md invariant 1: xxh3-128 of the raw
    bytes, seeded with the volume's secret), which the data plane (chunkstore.ids) and
    this check implement side by side, as two readers of one file format do: metadata
    and chunkstore do not import each other. tests/test_postgres.py holds them equal."""
    return xxhash.xxh3_128_digest(data, seed=seed)


MAX_CHUNK_BYTES = 1 << 40  # raw or stored length of one chunk: far past any chunker's


def chunk_lengths_ok(raw_len: int, stored_len: int) -> bool:
    """Lengths a new chunk record can have (else EINVAL, not an overflow deep in the
    database driver)."""
    return 0 < raw_len < MAX_CHUNK_BYTES and 0 < stored_len < MAX_CHUNK_BYTES


def check_new_chunks(chunks: list[NewChunk], seed: int | None = None) -> None:
    """Types and lengths in range; an INLINE chunk carries exactly its raw bytes (at most
    INLINE_DATA_MAX), any other none. With the volume's `seed`, inline bytes must hash to
    their id: the metadata is their only copy, and a row keeps the first bytes it was given
    (ON CONFLICT DO NOTHING), so bytes that do not match would hide the chunk from every
    other file naming that id."""
    for ch in chunks:
        if not (
            isinstance(ch.chunk_id, bytes)
            and len(ch.chunk_id) == 16
            and type(ch.raw_len) is int
            and type(ch.stored_len) is int
            and type(ch.state) is int
            and isinstance(ch.data, bytes)
        ):
            raise MetaError(errno.EINVAL, f"malformed new chunk record {ch!r:.120}")
        if not chunk_lengths_ok(ch.raw_len, ch.stored_len):
            raise MetaError(errno.EINVAL, f"bad length in new chunk {ch.chunk_id.hex()}")
        if ch.state == INLINE:
            n = len(ch.data)
            if not (n == ch.raw_len == ch.stored_len and n <= INLINE_DATA_MAX):
                raise MetaError(
                    errno.EINVAL,
                    f"inline chunk {ch.chunk_id.hex()}: {n} bytes for a raw length of "
                    f"{ch.raw_len} (at most {INLINE_DATA_MAX})",
                )
            if seed is not None and inline_chunk_id(ch.data, seed) != ch.chunk_id:
                raise MetaError(
                    errno.EINVAL, f"inline chunk {ch.chunk_id.hex()}: its bytes do not match its id"
                )
        elif ch.state not in (STAGED, DURABLE) or ch.data:
            raise MetaError(errno.EINVAL, f"bad state {ch.state} of new chunk {ch.chunk_id.hex()}")


def check_extents(extents: list[Extent], size: int) -> None:
    """Extents must be sorted, non-overlapping, positive and inside the file."""
    if size < 0:
        raise MetaError(errno.EINVAL, f"negative file size {size}")
    end = 0
    for e in extents:
        if e.length <= 0 or e.offset < end or e.chunk_off < 0 or len(e.chunk_id) != 16:
            raise MetaError(errno.EINVAL, f"bad extent list at offset {e.offset}")
        end = e.offset + e.length
    if end > size:
        raise MetaError(errno.EINVAL, f"extents end at {end}, past the file size {size}")


class MetaEngine(ABC):
    """Namespace, extents and chunk accounting. Blocking calls; thread-safe."""

    # -- volume --------------------------------------------------------------
    @abstractmethod
    def init_volume(self, config: dict) -> None:
        """Create the schema and the root directory; error if already formatted."""

    @abstractmethod
    def get_config(self) -> dict: ...

    # -- namespace -----------------------------------------------------------
    @abstractmethod
    def lookup(self, parent: int, name: bytes) -> Attr: ...

    @abstractmethod
    def getattr(self, ino: int) -> Attr: ...

    @abstractmethod
    def create(
        self,
        parent: int,
        name: bytes,
        mode: int,
        uid: int,
        gid: int,
        *,
        target: bytes = b"",
        rdev: int = 0,
        setgid_inherit: bool = False,
    ) -> Attr:
        """Make a regular file, directory, symlink, FIFO, socket or device node (by the
        type bits of mode).

        EEXIST if the name exists. `target` is the symlink's target, `rdev` a device
        node's device number. Who may make a device node is the caller's check.
        setgid_inherit: in a setgid directory the new inode takes the directory's group,
        and a new directory its setgid bit (BSD group semantics, as Linux has them); the
        engine reads the directory in the creating transaction anyway, so a mount need
        not ask for it first.
        """

    @abstractmethod
    def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr: ...

    @abstractmethod
    def unlink(self, parent: int, name: bytes) -> Attr:
        """Remove a non-directory entry; returns the inode's attributes after it.

        An inode whose nlink reaches 0 is kept (it may still be open) until
        `forget_orphan` is called for it; orphans left by a crash are purged by
        `purge_orphans` at mount.
        """

    @abstractmethod
    def rmdir(self, parent: int, name: bytes, *, keep: bool = False) -> Attr:
        """Remove an empty directory; its attrs, with no links. keep=True leaves the inode
        until `forget_orphan` (the mount: the kernel may still hold it)."""

    @abstractmethod
    def rename(
        self,
        parent: int,
        name: bytes,
        new_parent: int,
        new_name: bytes,
        flags: int = 0,
        *,
        keep: bool = False,
    ) -> Attr | None:
        """Atomic rename; returns the replaced inode's attrs (nlink already dropped) if any:
        a file's always, a directory's with keep=True (then kept as rmdir keeps it)."""

    @abstractmethod
    def readdir(self, ino: int, offset: int, limit: int = 1000) -> list[DirEntry]: ...

    @abstractmethod
    def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        clear_mode: int = 0,
    ) -> Attr:
        """Change attributes; a smaller size trims extents (and drops chunk refs).
        clear_mode: mode bits to clear from the current mode, in the same transaction
        (setuid/setgid after a write: never puts back a bit a chmod took away)."""

    @abstractmethod
    def readlink(self, ino: int) -> bytes: ...

    @abstractmethod
    def parent(self, ino: int) -> int:
        """The directory holding a directory's name (the root's is the root): readdir's
        ".." entry. ENOENT for a directory that has no name any more."""

    @abstractmethod
    def forget_orphan(self, ino: int) -> None:
        """Delete an inode with nlink 0 and release its chunks (no-op otherwise)."""

    @abstractmethod
    def purge_orphans(self) -> int: ...

    # -- extended attributes ------------------------------------------------
    @abstractmethod
    def get_xattr(self, ino: int, name: bytes) -> bytes: ...

    @abstractmethod
    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None: ...

    @abstractmethod
    def list_xattr(self, ino: int) -> list[bytes]: ...

    @abstractmethod
    def remove_xattr(self, ino: int, name: bytes) -> None: ...

    # -- data ----------------------------------------------------------------
    @abstractmethod
    def get_extents(self, ino: int) -> list[Extent]: ...

    @abstractmethod
    def commit_file(
        self,
        ino: int,
        extents: list[Extent],
        size: int,
        new_chunks: list[NewChunk],
        mtime_ns: int | None = None,
    ) -> Attr:
        """Replace a file's extents and size in one transaction.

        Registers `new_chunks`, takes references on every chunk of `extents`
        and drops those of the old extents. Every referenced chunk must be
        known (registered now or before): EIO otherwise, nothing changed.
        """

    def commit_ranks(self, job: str, step: int, ranks: list) -> list[dict]:
        """Several ranks' commit_rank in one call (a host's agent sends its ranks' so):
        `ranks` = [[rank, files, host], ...], answered in order, each rank's answer
        or refusal apart (rank_answer). Here one commit_rank each; the SQL engines
        write them in one transaction, the service in its group commit."""
        out = []
        for item in rank_items(job, step, ranks):
            if not isinstance(item, MetaError):
                try:
                    item = self.commit_rank(*item[:4], host=item[4])  # type: ignore[attr-defined]
                except MetaError as e:
                    item = e
            out.append(rank_answer(item))
        return out

    @abstractmethod
    def missing_chunks(self, ids: list[bytes]) -> set[bytes]:
        """Which of these chunk ids the volume does not hold (one batched query).

        Found chunks with no references get their grace timer restarted, so a
        writer that deduplicates against them keeps them from gc.
        """

    @abstractmethod
    def chunk_info(self, ids: list[bytes]) -> dict[bytes, tuple[int, int, int, int]]:
        """id -> (raw_len, stored_len, refcount, state) for the known ones."""

    @abstractmethod
    def inline_data(self, ids: list[bytes]) -> dict[bytes, bytes]:
        """id -> bytes of those of these chunks stored inline (one batched query; readers
        ask for chunks of small extents only, the only ones that can be inline)."""

    @abstractmethod
    def mark_durable(self, ids: list[bytes], stored_lens: list[int] | None = None) -> None:
        """Chunks now on R nodes; `stored_lens` when their encoding changed on upload."""

    @abstractmethod
    def stats(self) -> VolumeStats: ...

    @abstractmethod
    def sync(self) -> None:
        """Make every commit so far survive a power cut, not only a killed process (a
        file's fsync on the mount: commits are otherwise lazily synced)."""

    def claim_service(self) -> None:  # noqa: B027 - optional
        """Called by a service before it serves this engine: refuse (MetaError) if this
        engine cannot be shared with another service (an embedded SQLite volume runs
        one). Shared databases (PostgreSQL) claim nothing."""

    def close(self) -> None:  # noqa: B027 - optional
        pass

    # -- change feed ----------------------------------------------------------------------
    def changes_since(self, after: int | None, limit: int = 4096, xacts: bool = False) -> tuple:
        """The inodes changed since sequence number `after`, for clients that cache
        metadata (metadata/sql/changes.py): (oldest, newest, [[seq, ino], ...]). ENOSYS where
        there is no change log: such a client keeps its caches short instead.

        A number may be missing below listed ones while the transaction that took it runs
        (PostgreSQL), for as long as it runs. xacts=True adds, from the same snapshot,
        (xmin, next): the oldest transaction id still running and one past every id handed
        out. A number missing below a listed record of this read is final (rolled back, if
        still missing) once a later read from at or below it has xmin >= this read's next.
        Engines without concurrent writers answer 0, 0. Callers that do not pass xacts
        (older clients) get the 3-tuple; older services refuse it (EINVAL)."""
        raise MetaError(errno.ENOSYS, "this metadata engine keeps no change log")

    # -- hooks for a long-running frontend (the mount) ------------------------------------
    def loop_engine(self) -> MetaEngine | None:
        """A second engine whose short calls (lookup, getattr, create, a small commit_file)
        may run right on an event loop, or None where every call must go to a worker.

        It never waits: a call that would (a lock held, a recovery pending) raises
        MetaBusy with nothing done. Worth having only where a call costs far less than a
        thread round trip (an in-process database); the caller closes it."""
        return None

    #: seconds between `housekeeping()` calls while a frontend runs; None: not needed
    housekeeping_interval: float | None = None

    def housekeeping(self) -> None:  # noqa: B027 - optional
        """Upkeep a long-running frontend runs from a worker thread every
        `housekeeping_interval` seconds (SQLite: checkpoint a WAL that its loop engine,
        which never checkpoints, keeps growing)."""

    def __enter__(self) -> MetaEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
