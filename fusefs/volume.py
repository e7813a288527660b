"""The volume client both frontends share: files as streams of deduplicated chunks.

A Volume joins a metadata engine (in-process SQLite, PostgreSQL, or the
network client: one interface) with a ChunkStore over the volume's object
nodes. Writing a file runs a small pipeline per writer:

    feed -> chunker -> batch of B chunks -> ids hashed in the worker pool
         -> one `missing_chunks` query per batch -> new chunks encoded and
            stored by pool tasks (bounded in-flight bytes) -> on close, one
            `commit_file` transaction with the extents and the new chunks.

Hashing and zstd release the GIL (see chunkstore.codec), so pool threads use
both cores. Memory is bounded by the chunker (one chunk) plus the in-flight
window, whatever the file size.
"""

from __future__ import annotations

import bisect
import errno
import json
import logging
import os
import secrets
import stat
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from chunkstore import codec
from chunkstore.chunker import MAX_CHUNK, MIN_CHUNK, make_chunker
from chunkstore.ids import chunk_id, pieces_id
from chunkstore.node import NodeInfo, ObjectNode, open_node, parse_node_url
from chunkstore.store import ChunkStore, ChunkUnavailable
from metadata.engine import (
    DURABLE,
    INLINE,
    INLINE_DATA_MAX,
    ROOT_INO,
    STAGED,
    Attr,
    Extent,
    MetaEngine,
    MetaError,
    NewChunk,
    check_name,
)

log = logging.getLogger("ckptfs.volume")

VOLUME_FILE = "volume.json"
FORMAT_VERSION = 1
HASH_BATCH = 8  # chunks per "which exist?" query
INFLIGHT_BYTES = 64 * 2**20  # raw bytes being encoded/stored per writer
# Chunks are stored unsynced and acknowledged in one batch before the commit; a long
# write syncs every UNSYNCED_MAX bytes (a quarter of a write-behind tier's budget, if
# smaller) so it never holds more than that unacknowledged: the tier can neither upload
# nor evict an unacknowledged chunk, and a full staging of them could never drain.
UNSYNCED_MAX = 256 * 2**20
# A chunk that the metadata knows but no node holds yet is staged in some host's write-behind
# tier (a file closed on another host a moment ago). A read waits this long for that tier's
# upload (it drains after half a second without writes, or after 30 s of unbroken writes)
# before it fails with EIO.
STAGED_WAIT_S = 120.0


class VolumeError(Exception):
    """A volume-level problem a user can act on (missing volume, bad option)."""


@dataclass
class VolumeSettings:
    chunk_size: int = 4 * 2**20
    chunking: str = "fixed"
    compression: str = "auto"
    replicas: int = 2
    cdc_min: int | None = None
    cdc_max: int | None = None

    def validate(self, n_nodes: int) -> None:
        if not MIN_CHUNK <= self.chunk_size <= MAX_CHUNK:
            raise VolumeError(
                f"chunk size {self.chunk_size} out of range: "
                f"{MIN_CHUNK} (64KiB) .. {MAX_CHUNK} (64MiB)"
            )
        if self.chunking not in ("fixed", "cdc"):
            raise VolumeError(f"chunking must be fixed or cdc, not {self.chunking!r}")
        if self.compression not in codec.CODECS:
            raise VolumeError(f"compression must be one of {', '.join(codec.CODECS)}")
        if not 1 <= self.replicas <= n_nodes:
            raise VolumeError(f"replicas must be between 1 and the node count ({n_nodes})")
        try:
            make_chunker(
                self.chunking, self.chunk_size, min_size=self.cdc_min, max_size=self.cdc_max
            )
        except ValueError as e:
            raise VolumeError(str(e)) from e


def split_path(path: str | bytes) -> list[bytes]:
    """Volume paths are '/'-separated; every component is validated as a name."""
    raw = os.fsencode(path)
    parts = [p for p in raw.split(b"/") if p and p != b"."]
    for p in parts:
        if p == b"..":
            raise MetaError(errno.EINVAL, f"'..' not allowed in volume path {path!r}")
        check_name(p)
    return parts


class Volume:
    def __init__(
        self,
        meta: MetaEngine,
        config: dict,
        *,
        base_dir: str | None = None,
        workers: int | None = None,
        nodes: list[ObjectNode] | None = None,
    ) -> None:
        self.meta = meta
        self.config = config
        self.base_dir = base_dir
        self.seed = int(config["seed"])
        self.settings = VolumeSettings(
            chunk_size=config["chunk_size"],
            chunking=config["chunking"],
            compression=config["compression"],
            replicas=config["replicas"],
            cdc_min=config.get("cdc_min"),
            cdc_max=config.get("cdc_max"),
        )
        if nodes is None:
            nodes = [
                open_node(NodeInfo(n["name"], n["url"], n["domain"]), base_dir)
                for n in config["nodes"]
            ]
        self.store = ChunkStore(nodes, self.settings.replicas, self.seed)
        self.store.on_under_replicated = getattr(meta, "record_under_replicated", None)
        self.workers = workers or 8  # threads of `pool`
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ckptfs-chunk")
        self.tier = None  # the write-behind tier, when one is attached

    # -- opening -------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str,
        *,
        nodes: int | list[str] = 4,
        settings: VolumeSettings | None = None,
        db: str | None = None,
    ) -> Volume:
        """Format a new volume directory (SQLite metadata unless `db` names PostgreSQL)."""
        settings = settings or VolumeSettings()
        path = os.path.abspath(path)
        if os.path.exists(os.path.join(path, VOLUME_FILE)):
            raise VolumeError(f"{path} already holds a volume")
        if os.path.exists(path) and not os.path.isdir(path):
            raise VolumeError(f"{path} exists and is not a directory")
        if isinstance(nodes, int):
            if not 1 <= nodes <= 256:
                raise VolumeError(f"node count must be 1..256, not {nodes}")
            urls = [f"dir:nodes/n{i}" for i in range(nodes)]
        else:
            urls = list(nodes)
        if not urls:
            raise VolumeError("a volume needs at least one node")
        infos = []
        for i, url in enumerate(urls):
            try:
                infos.append(parse_node_url(url, name=f"n{i}"))
            except ValueError as e:
                raise VolumeError(str(e)) from e
        settings.validate(len(infos))
        config = {
            "format": FORMAT_VERSION,
            "uuid": str(uuid.uuid4()),
            "seed": secrets.randbits(63),
            "created": time.time(),
            "chunk_size": settings.chunk_size,
            "chunking": settings.chunking,
            "compression": settings.compression,
            "replicas": settings.replicas,
            "cdc_min": settings.cdc_min,
            "cdc_max": settings.cdc_max,
            "nodes": [{"name": i.name, "url": i.url, "domain": i.domain} for i in infos],
        }
        os.makedirs(path, exist_ok=True)
        meta_url = db or "sqlite:meta.db"
        meta = _open_engine(meta_url, path)
        meta.init_volume(config)
        nodes_objs = [open_node(i, path) for i in infos]
        for n in nodes_objs:
            ensure = getattr(n, "ensure", None)
            if ensure:
                ensure()
        tmp = os.path.join(path, VOLUME_FILE + ".tmp")
        # not for others (0660 less the umask): a PostgreSQL URL may carry its password
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o660), "w") as f:
            json.dump({"format": FORMAT_VERSION, "meta": meta_url}, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(path, VOLUME_FILE))
        return cls(meta, config, base_dir=path, nodes=nodes_objs)

    @classmethod
    def open(cls, spec: str, **kw) -> Volume:
        """Open a volume directory or a `ckptfs://HOST:PORT` service."""
        if spec.startswith("ckptfs://"):
            from metadata.client import connect

            meta = connect(spec)
            return cls(meta, meta.get_config(), **kw)
        path = os.path.abspath(spec)
        vf = os.path.join(path, VOLUME_FILE)
        try:
            with open(vf) as f:
                desc = json.load(f)
        except FileNotFoundError:
            raise VolumeError(f"no volume at {spec} (run `ckptfs format {spec}` first)") from None
        except (OSError, ValueError) as e:
            raise VolumeError(f"cannot read {vf}: {e}") from e
        if desc.get("format") != FORMAT_VERSION:
            raise VolumeError(f"{vf}: unsupported volume format {desc.get('format')!r}")
        meta = _open_engine(desc["meta"], path)
        return cls(meta, meta.get_config(), base_dir=path, **kw)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.tier is not None:
            self.tier.close()
        self.store.close()
        self.meta.close()

    def __enter__(self) -> Volume:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attach_tier(
        self,
        staging_dir: str | None = None,
        size: int | None = None,
        durability: str = "local",
        **kw,
    ):
        """Put the host write-behind tier (chunkstore.writeback) under this volume.

        Uploaded chunks are marked durable in the metadata in batches; ids the metadata does
        not know yet (file not committed) are handed back to the tier to retry."""
        from chunkstore.writeback import WriteBehindTier, default_staging_dir

        if self.tier is not None:
            raise VolumeError("a write-behind tier is already attached")
        meta = self.meta

        def on_durable(ids: list[bytes], stored_lens: list[int]) -> list[bytes]:
            known = meta.chunk_info(ids)
            hit = [(i, n) for i, n in zip(ids, stored_lens, strict=True) if i in known]
            if hit:
                sizes = [n for _, n in hit]
                meta.mark_durable([i for i, _ in hit], sizes if any(sizes) else None)
            return [i for i in ids if i not in known]

        # Writers stage chunks raw; compression happens at upload (codec.transcoder).
        kw.setdefault("transcode", codec.transcoder(self.settings.compression))
        try:
            self.tier = WriteBehindTier(
                self.store,
                staging_dir or default_staging_dir(self.config["uuid"]),
                size=size,
                durability=durability,
                on_durable=on_durable,
                **kw,
            )
        except ValueError as e:
            raise VolumeError(str(e)) from e
        return self.tier

    # -- namespace by path ------------------------------------------------
    def resolve(self, path: str | bytes) -> Attr:
        attr = self.meta.getattr(ROOT_INO)
        for name in split_path(path):
            if not attr.is_dir:
                raise MetaError(errno.ENOTDIR, f"{path!r}: not a directory on the way")
            attr = self.meta.lookup(attr.ino, name)
        return attr

    def _parent(self, path: str | bytes, *, make: bool = False) -> tuple[Attr, bytes]:
        parts = split_path(path)
        if not parts:
            raise MetaError(errno.EINVAL, "the volume root has no parent")
        attr = self.meta.getattr(ROOT_INO)
        for name in parts[:-1]:
            try:
                attr = self.meta.lookup(attr.ino, name)
            except MetaError as e:
                if e.errno != errno.ENOENT or not make:
                    raise
                try:
                    attr = self.meta.create(
                        attr.ino, name, stat.S_IFDIR | 0o755, os.getuid(), os.getgid()
                    )
                except MetaError as e2:  # lost a race with another creator
                    if e2.errno != errno.EEXIST:
                        raise
                    attr = self.meta.lookup(attr.ino, name)
            if not attr.is_dir:
                raise MetaError(errno.ENOTDIR, f"{name!r} in {path!r} is not a directory")
        return attr, parts[-1]

    def stat(self, path: str) -> Attr:
        return self.resolve(path)

    def exists(self, path: str) -> bool:
        try:
            self.resolve(path)
            return True
        except MetaError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return False
            raise

    def listdir(self, path: str = "/") -> list[tuple[bytes, Attr]]:
        d = self.resolve(path)
        if not d.is_dir:
            raise MetaError(errno.ENOTDIR, f"{path!r} is not a directory")
        out, off = [], 0
        while True:
            batch = self.meta.readdir(d.ino, off)
            if not batch:
                return out
            out.extend((e.name, e.attr) for e in batch)
            off = batch[-1].next_offset

    def walk(self, path: str = "/") -> Iterator[tuple[str, Attr]]:
        """Every entry under path, depth first, as (volume path, attr)."""
        base = "/" + "/".join(os.fsdecode(p) for p in split_path(path))
        for name, attr in self.listdir(path):
            child = base.rstrip("/") + "/" + os.fsdecode(name)
            yield child, attr
            if attr.is_dir:
                yield from self.walk(child)

    def mkdir(self, path: str, *, parents: bool = False, mode: int = 0o755) -> Attr:
        parent, name = self._parent(path, make=parents)
        try:
            return self.meta.create(parent.ino, name, stat.S_IFDIR | mode, os.getuid(), os.getgid())
        except MetaError as e:
            if e.errno == errno.EEXIST and parents:
                a = self.meta.lookup(parent.ino, name)
                if a.is_dir:
                    return a
            raise

    def unlink(self, path: str) -> None:
        parent, name = self._parent(path)
        a = self.meta.lookup(parent.ino, name)
        if a.is_dir:
            self.meta.rmdir(parent.ino, name)
            return
        after = self.meta.unlink(parent.ino, name)
        if after.nlink <= 0:
            self.meta.forget_orphan(after.ino)

    def rename(self, src: str, dst: str, flags: int = 0) -> None:
        sp, sn = self._parent(src)
        dp, dn = self._parent(dst)
        replaced = self.meta.rename(sp.ino, sn, dp.ino, dn, flags)
        if replaced is not None and replaced.nlink <= 0:
            self.meta.forget_orphan(replaced.ino)

    # -- data ----------------------------------------------------------------
    def open_write(
        self,
        path: str,
        *,
        mode: int = 0o644,
        parents: bool = True,
        codec_name: str | None = None,
        exclusive: bool = False,
        inline: bool = True,
    ) -> FileWriter:
        """A writer whose bytes replace the file's content atomically at close().
        inline=False stores even the smallest chunks on the nodes (FileWriter)."""
        parent, name = self._parent(path, make=parents)
        try:
            attr = self.meta.create(parent.ino, name, stat.S_IFREG | mode, os.getuid(), os.getgid())
        except MetaError as e:
            if e.errno != errno.EEXIST or exclusive:
                raise
            attr = self.meta.lookup(parent.ino, name)
            if attr.is_dir:
                raise MetaError(errno.EISDIR, f"{path!r} is a directory") from None
            if not attr.is_reg:
                raise MetaError(errno.EINVAL, f"{path!r} is not a regular file") from None
        return FileWriter(self, attr.ino, codec_name=codec_name, inline=inline)

    def write_file(self, path: str, data: bytes, **kw) -> Attr:
        with self.open_write(path, **kw) as w:
            w.write(data)
        return w.attr

    def open_read(self, path: str) -> FileReader:
        attr = self.resolve(path)
        if attr.is_dir:
            raise MetaError(errno.EISDIR, f"{path!r} is a directory")
        if not attr.is_reg:  # a symlink, FIFO, socket or device node: no bytes of its own
            raise MetaError(errno.EINVAL, f"{path!r} is not a regular file")
        return FileReader(self, attr)

    def read_file(self, path: str) -> bytes:
        with self.open_read(path) as r:
            return r.pread(0, r.size)

    def stats(self) -> dict:
        return self.meta.stats().as_dict()

    # -- chunk plumbing shared by all writers -----------------------------
    def make_chunker(self):
        s = self.settings
        return make_chunker(s.chunking, s.chunk_size, min_size=s.cdc_min, max_size=s.cdc_max)

    def hash_many(self, chunks: list[Any]) -> list[bytes]:
        """The ids of a batch of chunks, each one buffer or a list of pieces (pieces_id).

        Hashed on the pool in one task per worker (interleaved, so big and small chunks
        spread evenly) rather than one per chunk: each task is a wake-up and a GIL handoff,
        and eight DCP ranks on two cores pay for every one."""
        seed = self.seed

        def ids(part: list[Any]) -> list[bytes]:
            return [pieces_id(c, seed) if isinstance(c, list) else chunk_id(c, seed) for c in part]

        n = min(len(chunks), self.workers)
        if n <= 1:
            return ids(chunks)
        out: list[bytes] = [b""] * len(chunks)
        for k, part in enumerate(self.pool.map(lambda k: ids(chunks[k::n]), range(n))):
            out[k::n] = part
        return out

    def missing_chunks(self, ids: list[bytes]) -> set[bytes]:
        """Which of these chunks the volume lacks, asked by a writer about to store them;
        the rest are written already (dedup). Asking counts as a foreground write for the
        host's tier: see WriteBehindTier.foreground."""
        if self.tier is not None:
            self.tier.foreground()
        return self.meta.missing_chunks(ids)

    def store_chunk(
        self,
        cid: bytes,
        raw: bytes,
        codec_name: str | None = None,
        elem_width: int | None = None,
        *,
        sync: bool = True,
        inline: bool = False,
    ) -> NewChunk:
        """Encode and store one chunk (blocking); returns its record for commit.

        inline=True (a writer committing with commit_file): a chunk of at most INLINE_DATA_MAX
        bytes is not stored here; its record carries the bytes into the commit that names it
        (INLINE), which keeps them in the metadata. Checkpoint commits carry no bytes.
        `elem_width` is a float-width hint (DCP knows each tensor's dtype; probing costs more).
        sync=False: durable only after the next `sync_chunks()`, which the writer must call
        before the commit that names the chunk (one batch of fsyncs per commit)."""
        if inline and len(raw) <= INLINE_DATA_MAX:
            return NewChunk.inline(cid, raw)
        blob = codec.encode(raw, codec_name or self.settings.compression, elem_width=elem_width)
        if self.tier is not None:
            state = self.tier.put(cid, blob, sync=sync)
        else:
            self.store.put_encoded(cid, blob, sync=sync)
            state = DURABLE
        return NewChunk(cid, len(raw), len(blob), state)

    def sync_chunks(self) -> None:
        """Acknowledge every chunk stored with sync=False (tier staging or object nodes)."""
        if self.tier is not None:
            self.tier.sync_staged()
        else:
            self.store.sync()

    def read_chunk_into(self, cid: bytes, views: list[memoryview]) -> bool:
        """A chunk's raw bytes read into `views` from this host's tier, if it holds the chunk
        uncompressed; False otherwise (then fetch_chunk), with the views maybe overwritten."""
        return self.tier is not None and self.tier.read_into(cid, views)

    def inline_chunks(self, ids: list[bytes]) -> dict[bytes, bytes]:
        """The verified bytes of those of these chunks stored inline in the metadata (one
        query). Only chunks of small extents (`maybe_inline`) are worth asking about.
        Bytes that do not hash to their id are left out (and logged): the caller then
        reads the chunk like any other, from the nodes, and fails there if they have no
        copy either (fetch_chunk names the corrupt inline bytes then)."""
        found = self.meta.inline_data(ids) if ids else {}
        for cid, data in list(found.items()):
            if chunk_id(data, self.seed) != cid:
                log.error("inline chunk %s is corrupt in the metadata (`ckptfs fsck`)", cid.hex())
                del found[cid]
        return found

    def fetch_chunk(
        self, cid: bytes, *, view: bool = False, small: bool = False
    ) -> bytes | memoryview:
        """Verified raw bytes of a chunk, through the host tier when there is one.

        view=True: a raw object in the tier comes back as a view of the mapped file
        (cache.read_object fast=True), for readers that only copy out of it.
        small=True: the chunk may be inline (`maybe_inline` of the extent that names it):
        the metadata is asked first. No node holds an inline chunk, and asking them for it
        reports each placement node as missing a replica.

        A chunk staged on another host and not uploaded yet is waited for (STAGED_WAIT_S):
        a reader on a second host opens a file right after its writer's close, before the
        writer's tier has drained, and used to get EIO."""
        if small:
            data = self.inline_chunks([cid]).get(cid)
            if data is not None:
                return data
        try:
            return self._fetch_once(cid, view)
        except ChunkUnavailable as e:
            state = self._state(cid)
            if state == INLINE:
                return self._inline_or_fail(cid)
            if state != STAGED:
                raise
            first = e
        # Not on the nodes yet: ask the metadata (not the nodes, whose misses log as bad
        # replicas) until that tier marks it durable, then read it once more. A commit of
        # the same small content elsewhere may make it INLINE meanwhile: then it is read
        # from the metadata (the nodes may never get it).
        deadline = time.monotonic() + STAGED_WAIT_S
        delay = 0.02
        while (state := self._state(cid)) == STAGED:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChunkUnavailable(
                    f"chunk {cid.hex()} is still only in another host's write-behind tier "
                    f"after {STAGED_WAIT_S:.0f} s (is that host up? `ckptfs status` "
                    f"there shows its uploads): {first}"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.5)
        if state == INLINE:
            return self._inline_or_fail(cid)
        return self._fetch_once(cid, view)

    def _inline_or_fail(self, cid: bytes) -> bytes:
        """An INLINE chunk the nodes did not have: its bytes from the metadata, asked again
        (it may have turned INLINE after the caller asked), or an error naming them."""
        data = self.inline_chunks([cid]).get(cid)
        if data is None:
            raise ChunkUnavailable(
                f"inline chunk {cid.hex()} is missing or corrupt in the metadata (`ckptfs fsck`)"
            )
        return data

    def _fetch_once(self, cid: bytes, view: bool) -> bytes | memoryview:
        if self.tier is not None:
            return self.tier.get(cid, view=view)
        return self.store.get(cid)

    def _state(self, cid: bytes) -> int | None:
        """The chunk's state in the metadata (STAGED: in some host's tier, not on R nodes
        yet), None if it has no row."""
        info = self.meta.chunk_info([cid]).get(cid)
        return None if info is None else info[3]


def maybe_inline(e: Extent) -> bool:
    """Can the chunk this extent names be inline? Only if the extent is small: an inline
    chunk has at most INLINE_DATA_MAX bytes, and an extent covers part of its chunk at most."""
    return e.length <= INLINE_DATA_MAX


def _open_engine(url: str, base_dir: str) -> MetaEngine:
    if url.startswith("sqlite:"):
        import sqlite3

        from metadata.sqlite import SqliteEngine

        db = url[len("sqlite:") :]
        path = db if os.path.isabs(db) else os.path.join(base_dir, db)
        try:
            return SqliteEngine(path)
        except sqlite3.Error as e:  # e.g. a database this user may not open: one line
            raise VolumeError(f"cannot open the metadata database {path}: {e}") from None
    if url.startswith(("postgresql://", "postgres://")):
        from metadata.postgres import PostgresEngine

        return PostgresEngine(url)
    raise VolumeError(f"unknown metadata engine URL {url!r}")


def drain_quietly(inflight: deque[tuple[Future, int]]) -> None:
    """Cancel or wait out a failed writer's store tasks; the first error is the one reported."""
    while inflight:
        fut, _ = inflight.popleft()
        fut.cancel()
        try:
            fut.result()
        except BaseException:  # noqa: S110
            pass


class FileWriter:
    """Streams bytes into chunks; the file changes only at close(), in one commit."""

    def __init__(
        self, vol: Volume, ino: int, *, codec_name: str | None = None, inline: bool = True
    ) -> None:
        """inline=False: the file is committed through a checkpoint (commit_rank), which
        takes no inline chunks (Volume.store_chunk)."""
        self.vol = vol
        self.ino = ino
        self.codec_name = codec_name
        self.inline = inline
        self.chunker = vol.make_chunker()
        self.size = 0
        self.extents: list[Extent] = []
        self.new_chunks: dict[bytes, NewChunk] = {}
        self._batch: list[tuple[int, bytes]] = []
        self._inflight: deque[tuple[Future, int]] = deque()
        self._inflight_bytes = 0
        self._unsynced_bytes = 0
        budget = getattr(vol.tier, "budget", None)
        self._unsynced_max = UNSYNCED_MAX if budget is None else min(UNSYNCED_MAX, budget // 4)
        self._planned: set[bytes] = set()
        self._lock = threading.Lock()
        self.attr: Attr | None = None
        self.closed = False

    def write(self, data: bytes | memoryview) -> int:
        if self.closed:
            raise ValueError("write to a closed FileWriter")
        for ch in self.chunker.feed(data):
            self._add(ch)
        return len(data)

    def cut(self) -> None:
        """Force a chunk boundary here (DCP cuts at every tensor, for dedup)."""
        for ch in self.chunker.cut():
            self._add(ch)

    def _add(self, raw: bytes) -> None:
        self._batch.append((self.size, raw))
        self.size += len(raw)
        if len(self._batch) >= HASH_BATCH:
            self._flush_batch()

    def _flush_batch(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        ids = self.vol.hash_many([raw for _, raw in batch])
        ask = [cid for cid in dict.fromkeys(ids) if cid not in self._planned]
        missing = self.vol.missing_chunks(ask) if ask else set()
        for (off, raw), cid in zip(batch, ids, strict=True):
            self.extents.append(Extent(off, len(raw), cid, 0))
            if cid in missing and cid not in self._planned:
                self._planned.add(cid)
                self._submit(cid, raw)

    def _submit(self, cid: bytes, raw: bytes) -> None:
        while self._inflight and self._inflight_bytes + len(raw) > INFLIGHT_BYTES:
            self._reap_one()
        if self._unsynced_bytes and self._unsynced_bytes + len(raw) > self._unsynced_max:
            self._sync()
        fut = self.vol.pool.submit(
            self.vol.store_chunk, cid, raw, self.codec_name, sync=False, inline=self.inline
        )
        self._inflight.append((fut, len(raw)))
        self._inflight_bytes += len(raw)
        self._unsynced_bytes += len(raw)

    def _reap_one(self) -> None:
        fut, n = self._inflight.popleft()
        self._inflight_bytes -= n
        rec = fut.result()
        self.new_chunks[rec.chunk_id] = rec

    def _sync(self) -> None:
        """Wait for the chunks in flight, then make them durable in one batch."""
        while self._inflight:
            self._reap_one()
        self.vol.sync_chunks()
        self._unsynced_bytes = 0

    def flush_data(self) -> None:
        """Store every byte written so far durably (no commit)."""
        for ch in self.chunker.cut():
            self._add(ch)
        self._flush_batch()
        self._sync()

    def close(self, *, commit: bool = True) -> Attr | None:
        if self.closed:
            return self.attr
        self.closed = True
        try:
            for ch in self.chunker.finish():
                self._add(ch)
            self._flush_batch()
            self._sync()
        except BaseException:
            self._drain_quietly()
            raise
        if commit:
            self.attr = self.vol.meta.commit_file(
                self.ino, self.extents, self.size, list(self.new_chunks.values())
            )
        return self.attr

    def abort(self) -> None:
        self.closed = True
        self._drain_quietly()

    def _drain_quietly(self) -> None:
        drain_quietly(self._inflight)

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class FileReader:
    """Range reads over a file's extents, with read-ahead of the following chunks."""

    def __init__(self, vol: Volume, attr: Attr, *, readahead: int = 16) -> None:
        self.vol = vol
        self.attr = attr
        self.size = attr.size
        self.extents = vol.meta.get_extents(attr.ino)
        self._starts = [e.offset for e in self.extents]
        self._cache: OrderedDict[bytes, Future[bytes]] = OrderedDict()
        self._readahead = readahead
        self._pos = 0

    def _chunk(self, e: Extent) -> Future[bytes]:
        cid = e.chunk_id
        fut = self._cache.get(cid)
        if fut is None:
            fut = self.vol.pool.submit(self.vol.fetch_chunk, cid, small=maybe_inline(e))
            self._cache[cid] = fut
            while len(self._cache) > self._readahead + 4:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(cid)
        return fut

    def _overlapping(self, start: int, end: int) -> Iterable[int]:
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self.extents) and self.extents[i].offset < end:
            e = self.extents[i]
            if e.offset + e.length > start:
                yield i
            i += 1

    def pread(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0:
            raise ValueError("negative offset or size")
        size = max(0, min(size, self.size - offset))
        if size == 0:
            return b""
        end = offset + size
        idx = list(self._overlapping(offset, end))
        if len(idx) == 1:
            e = self.extents[idx[0]]
            if e.offset <= offset and e.offset + e.length >= end:
                raw = self._chunk(e).result()
                self._prefetch(idx[0] + 1)
                s = e.chunk_off + offset - e.offset
                return raw[s : s + size]
        futs = [(self.extents[i], self._chunk(self.extents[i])) for i in idx]
        if idx:
            self._prefetch(idx[-1] + 1)
        out = bytearray(size)
        for e, fut in futs:
            raw = fut.result()
            s = max(offset, e.offset)
            t = min(end, e.offset + e.length)
            out[s - offset : t - offset] = raw[
                e.chunk_off + s - e.offset : e.chunk_off + t - e.offset
            ]
        return bytes(out)

    def _prefetch(self, i: int) -> None:
        for e in self.extents[i : i + self._readahead]:
            self._chunk(e)

    # file-like sequential API
    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self.size - self._pos
        data = self.pread(self._pos, n)
        self._pos += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        for fut in self._cache.values():
            fut.cancel()
        self._cache.clear()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
