"""The volume client every frontend shares: a namespace by path over files of chunks.

A Volume joins a metadata engine (in-process SQLite, PostgreSQL, or the network client:
one interface, metadata.engine) with a ChunkStore over the volume's object nodes and,
optionally, the host's write-behind tier. Chunks are written through its one sink
(fusefs.client.sink: used by FileWriter, the DCP writer and the mount) and read through
`fetch_chunk` (verified; the host read cache when a tier is attached; waits for a chunk
still staged on another host). Hashing and zstd release the GIL (chunkstore.codec), so the
pool's threads use every core.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from chunkstore import codec
from chunkstore.chunker import MAX_CHUNK, MIN_CHUNK, make_chunker
from chunkstore.ids import chunk_id
from chunkstore.nodes import NodeError, NodeInfo, ObjectNode, open_node, parse_node_url
from chunkstore.store import ChunkStore, ChunkUnavailable
from fusefs.client.reader import FileReader
from fusefs.client.sink import ChunkSink
from fusefs.client.writer import FileWriter
from metadata.engine import (
    INLINE,
    ROOT_INO,
    STAGED,
    Attr,
    MetaEngine,
    MetaError,
    check_name,
)
from metadata.engines import EngineURLError, open_engine

log = logging.getLogger("ckptfs.volume")

VOLUME_FILE = "volume.json"
FORMAT_VERSION = 1
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
    backup_interval: float = 3600.0  # automatic metadata backups (fusefs.maint.backup); 0: off
    backup_keep: int = 7

    def validate(self, n_nodes: int) -> None:
        if not 0 <= self.backup_interval <= 366 * 86400:
            raise VolumeError("backup interval must be 0 (off) .. 366 days, in seconds")
        if not 1 <= self.backup_keep <= 10_000:
            raise VolumeError("backups to keep must be 1..10000")
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


def _shown(path: str | bytes) -> str:
    """A volume path in a message, as the user wrote it (not a bytes repr)."""
    return os.fsdecode(path)


def _prefix(parts: list[bytes], n: int) -> str:
    """The first n components of a path, as an absolute volume path."""
    return "/" + "/".join(os.fsdecode(p) for p in parts[:n])


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
        self.agent: str | None = None  # the host agent's socket, when opened through one
        self.sink = ChunkSink(self)

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
        nodes_dir = None
        if isinstance(nodes, int):
            if not 1 <= nodes <= 256:
                raise VolumeError(f"node count must be 1..256, not {nodes}")
            nodes_dir = default_nodes_dir(path)
            if _holds_files(nodes_dir):
                raise VolumeError(
                    f"{nodes_dir} already holds nodes (of an earlier volume? `ckptfs meta "
                    f"backups --node dir:{nodes_dir}/n0 ...` lists its backups): restore from "
                    "it, remove it, or give this volume other nodes with --node"
                )
            urls = [f"dir:{nodes_dir}/n{i}" for i in range(nodes)]
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
            "backup_interval": settings.backup_interval,
            "backup_keep": settings.backup_keep,
            "nodes": [{"name": i.name, "url": i.url, "domain": i.domain} for i in infos],
        }
        meta_url = db or "sqlite:meta.db"
        nodes_objs: list[ObjectNode] = []
        try:
            with (
                making_volume(nodes_dir) if nodes_dir else nullcontext(),
                making_volume(path) as closers,
            ):
                # Nodes first: an unreachable node must fail the format before any metadata
                # exists (it used to leave meta.db without volume.json, and a traceback).
                for info in infos:
                    node = open_node(info, path)
                    nodes_objs.append(node)
                    closers.append(node.close)
                    ensure = getattr(node, "ensure", None)
                    if ensure:
                        ensure()
                meta = _open_engine(meta_url, path)
                closers.append(meta.close)
                meta.init_volume(config)
                write_volume_file(path, meta_url)
        except (NodeError, OSError, ValueError) as e:
            raise VolumeError(f"cannot format {path}: {e}") from None
        return cls(meta, config, base_dir=path, nodes=nodes_objs)

    @classmethod
    def open(cls, spec: str, *, token: str | None = None, **kw) -> Volume:
        """Open a volume directory or a `ckptfs://HOST:PORT` service (`token`: the service's,
        when neither the URL nor the environment names it)."""
        if spec.startswith("ckptfs://"):
            from metadata.client import connect

            meta = connect(spec, token=token)
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
        self.sink.close()
        self.sink.end_leases()  # chunks this process stored and never committed: gc may go
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
        """Put the host write-behind tier (chunkstore.tier.tier) under this volume.

        Uploaded chunks are marked durable in the metadata in batches; ids the metadata does
        not know yet (file not committed) are handed back to the tier to retry."""
        from chunkstore.tier.tier import WriteBehindTier, default_staging_dir

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
        parts = split_path(path)
        for k in range(len(parts)):
            if not attr.is_dir:
                raise MetaError(
                    errno.ENOTDIR, f"{_shown(path)}: {_prefix(parts, k)} is not a directory"
                )
            attr = self._lookup(attr, path, parts, k)
        return attr

    def _lookup(self, parent: Attr, path: str | bytes, parts: list[bytes], k: int) -> Attr:
        """parts[k] in `parent`; a missing one is ENOENT naming the whole path as the user
        gave it, and which component is missing when it is not the last."""
        try:
            return self.meta.lookup(parent.ino, parts[k])
        except MetaError as e:
            if e.errno != errno.ENOENT:
                raise
            where = "" if k == len(parts) - 1 else f" ({_prefix(parts, k + 1)} does not exist)"
            raise MetaError(errno.ENOENT, f"{_shown(path)}: not found{where}") from None

    def _parent(self, path: str | bytes, *, make: bool = False) -> tuple[Attr, bytes]:
        parts = split_path(path)
        if not parts:
            raise MetaError(errno.EINVAL, "the volume root has no parent")
        attr = self.meta.getattr(ROOT_INO)
        for k, name in enumerate(parts[:-1]):
            try:
                attr = self._lookup(attr, path, parts, k)
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
                raise MetaError(
                    errno.ENOTDIR, f"{_shown(path)}: {_prefix(parts, k + 1)} is not a directory"
                )
        return attr, parts[-1]

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
        parts = split_path(path)
        a = self._lookup(parent, path, parts, len(parts) - 1)
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
    def create_file(
        self, path: str, *, mode: int = 0o644, parents: bool = True, exclusive: bool = False
    ) -> Attr:
        """The regular file at `path`, created (empty) if missing; EEXIST if `exclusive`."""
        parent, name = self._parent(path, make=parents)
        try:
            return self.meta.create(parent.ino, name, stat.S_IFREG | mode, os.getuid(), os.getgid())
        except MetaError as e:
            if e.errno != errno.EEXIST or exclusive:
                raise
            attr = self.meta.lookup(parent.ino, name)
            if attr.is_dir:
                raise MetaError(errno.EISDIR, f"{path!r} is a directory") from None
            if not attr.is_reg:
                raise MetaError(errno.EINVAL, f"{path!r} is not a regular file") from None
            return attr

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
        attr = self.create_file(path, mode=mode, parents=parents, exclusive=exclusive)
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
    def make_chunker(self, *, views: bool = False):
        """The volume's cutter (chunkstore.chunker); views: fixed chunks as uncopied views."""
        s = self.settings
        return make_chunker(
            s.chunking, s.chunk_size, min_size=s.cdc_min, max_size=s.cdc_max, views=views
        )

    def read_chunk_into(self, cid: bytes, views: list[memoryview], *, nowait: bool = False) -> bool:
        """A chunk's raw bytes read into `views` from this host's tier, if it holds the chunk
        uncompressed; False otherwise (then fetch_chunk), with the views maybe overwritten.
        nowait=True: only if those bytes are in memory, else BlockingIOError."""
        return self.tier is not None and self.tier.read_into(cid, views, nowait=nowait)

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


def _open_engine(url: str, base_dir: str) -> MetaEngine:
    try:
        return open_engine(url, base_dir)
    except EngineURLError as e:
        raise VolumeError(str(e)) from None


def _holds_files(path: str) -> bool:
    """Is there a file anywhere under `path` (a node's chunk or backup object)?"""
    return any(files for _, _, files in os.walk(path))


def default_nodes_dir(path: str) -> str:
    """Where `ckptfs format VOL` puts its local directory nodes without --node: `VOL.nodes`,
    beside the volume directory, not in it. The nodes hold the chunks and the metadata
    backups, which exist to survive the loss of the volume directory (the metadata), so
    they must not be deleted with it; a sibling stays on the same filesystem and is found
    by name. Volumes formatted before (nodes in VOL/nodes) keep working: the config records
    every node's URL."""
    return os.path.abspath(path) + ".nodes"


@contextmanager
def making_volume(path: str) -> Iterator[list[Callable[[], None]]]:
    """A volume directory being made (format, load, restore): if the body fails, what it
    opened is closed (the callables it appends, last first) and what it added is removed,
    the directory itself if it did not exist, so a failure leaves nothing half-made."""
    fresh = not os.path.exists(path)
    before = set() if fresh else set(os.listdir(path))
    closers: list[Callable[[], None]] = []
    try:
        os.makedirs(path, exist_ok=True)
        yield closers
    except BaseException:
        for close in reversed(closers):
            try:
                close()
            except Exception:  # noqa: S110 - the body's error is the one to report
                pass
        _remove_new(path, fresh, before)
        raise


def _remove_new(path: str, fresh: bool, before: set[str]) -> None:
    """Undo a failed format: the directory if it made it, else only the entries it added."""
    if fresh:
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        added = set(os.listdir(path)) - before
    except OSError:
        return
    for name in added:
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except OSError:
                pass


def write_volume_file(path: str, meta_url: str) -> None:
    """The volume directory's volume.json (where its metadata is), written atomically and
    durably: the last step of a format, a load or a restore, so a volume either has it
    whole or is not one. Not for others (0660 less the umask): a PostgreSQL URL may carry
    its password."""
    tmp = os.path.join(path, VOLUME_FILE + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o660), "w") as f:
        json.dump({"format": FORMAT_VERSION, "meta": meta_url}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(path, VOLUME_FILE))
