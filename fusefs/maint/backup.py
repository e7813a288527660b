"""Metadata backups stored on the object nodes, and restoring a volume from the nodes alone.

Lose the database and every chunk on the nodes is anonymous bytes. So a backup is the
metadata dump (metadata/sql/dump.py: engine-independent, zstd, consistent) stored where the
chunks are, replicated and checksummed like them:

- The dump stream is cut into pieces of PIECE_SIZE bytes. Each piece is a chunk object
  (codec header and checksum; `none` codec, as the stream is compressed already) put on
  R nodes by the chunk store's placement, under an id no chunk id can take: chunk ids are
  xxh3-128 outputs, and backup ids start with the 8-byte MAGIC (a chunk id starting with
  it has odds of 2^-64), then the backup number (u32, its creation second) and the piece
  number (u32). The piece number MANIFEST_PIECE is the backup's manifest: JSON with the
  volume's uuid, time, counts, each piece's length and xxh3-128 (a piece is checked
  against it; without the volume's seed, which is inside the dump, the chunk id check
  cannot apply), and the node list.
- The manifest is put last, so a backup is listed only once all its pieces are stored;
  dropping a backup deletes its manifest first.
- `list_backups` finds manifests by listing the nodes: it needs no metadata at all, so
  `ckptfs meta backups --node URL...` and `ckptfs meta restore NEW --node URL...` work
  after the volume directory is gone.
- gc and fsck skip backup objects (`is_backup_id`), and gc keeps every object a kept
  backup names (`backup_named`): the rows of a deleted file go, its objects stay until
  the last backup that could restore it is dropped.

A node is trusted to keep bytes, not to say what a backup is (docs/DESIGN "Trust model"):
anyone who can write one node's directory or bucket can plant objects under backup ids.
So a manifest is read only up to MAX_MANIFEST bytes and checked field by field
(`check_manifest`), a backup whose pieces are on no node is not listed, and what is
wrong is reported by object name (`scan_backups`: `ckptfs meta backups`, gc's report, the
ckptfs_backup_bad_objects metric) and skipped: nothing planted on a node stops a backup,
a listing or gc. A new backup's number is the clock's (past the newest backup whose
number is within ID_SKEW of it, and past every number in use): a planted number, however
large, never pushes it past the id space. The dump itself is checked by its reader
(metadata/sql/dump.py: only the code's tables and columns reach SQL).

The volume config in a dump carries the chunk-id seed (a restore needs it, since ids
depend on it); node credentials are never in the config, so never in a backup.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import IO, Any

import xxhash

from chunkstore import codec
from chunkstore.nodes import (
    NodeError,
    NodeInfo,
    ObjectMissing,
    ObjectNode,
    open_node,
    parse_node_url,
)
from chunkstore.store import ChunkStore
from fusefs.client.volume import VOLUME_FILE, making_volume, write_volume_file
from metadata.engine import INLINE
from metadata.engines import open_engine
from metadata.periodic import capped, run_periodic
from metadata.sql.dump import DumpError, iter_table, load_dump, read_records, write_dump

log = logging.getLogger("ckptfs.backup")

MAGIC = b"\xffckptbk"  # 7 bytes, then the format byte: 8 bytes of prefix
PREFIX = MAGIC + b"\x01"
_NUMS = struct.Struct(">II")  # backup number, piece number (big-endian: ids sort by time)
MANIFEST_PIECE = 0xFFFFFFFF
PIECE_SIZE = 8 << 20  # bytes of dump stream per object
BACKUP_INTERVAL = 3600.0  # default of the volume setting `backup_interval` (seconds)
BACKUP_KEEP = 7  # default of the volume setting `backup_keep`
LAST_KEY = "backup:last"  # config key: when the last automatic backup was attempted
MAX_MANIFEST = 4 << 20  # bytes: ~60k pieces (480 GB of dump); a bigger one is not read
MAX_PIECE = 256 << 20  # bytes a manifest may give one piece
ID_SKEW = 86_400  # seconds: a backup number further ahead of the clock is not followed
_HEX32 = frozenset("0123456789abcdef")


class BackupError(Exception):
    """A backup that cannot be made, found or restored; the message is one line.
    `transient`: a node failed to answer (it may hold a good copy), as opposed to every
    node answering that it has none, or none that checks out."""

    transient = False


def backup_id(number: int, piece: int) -> bytes:
    return PREFIX + _NUMS.pack(number, piece)


def is_backup_id(cid: bytes) -> bool:
    """Is this node object part of a backup (never a chunk, never an orphan)?"""
    return cid[:8] == PREFIX


def parse_id(cid: bytes) -> tuple[int, int]:
    return _NUMS.unpack(cid[8:16])


# -- the backup key -------------------------------------------------------------------
# Backups are authenticated with a key the nodes never hold: KEY_FILE in the volume
# directory (0600; made by `ckptfs format`, or a volume made otherwise at its first
# backup, or by `ckptfs meta backup-key`; put back by a keyed restore), never in the
# database (whose config table is dumped onto the nodes).
# A manifest carries an HMAC-SHA256 under it over its whole content, which names every
# piece's BLAKE2b-256 (xxh3 catches damage, not forgery), so a backup planted on a node,
# or one whose pieces were swapped, does not verify. The operator copies the key off the
# host (a restore is after losing it); the replicas of a PostgreSQL volume each need the
# copy in their own volume directory (`ckptfs meta backup-key` shows its fingerprint).
KEY_FILE = "backup.key"
_MAC_CONTEXT = b"ckptfs-backup-manifest-v1\0"


def key_path(vol_dir: str) -> str:
    return os.path.join(vol_dir, KEY_FILE)


def make_key(vol_dir: str) -> tuple[str, bool]:
    """The volume's backup key, made (32 random bytes, hex, 0600) if missing: (path,
    whether it was made now). Never replaces one: backups already signed need it."""
    path = key_path(vol_dir)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        read_key(path)  # a file that is not a key is an error, not a key kept
        return path, False
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path, True


def write_key(vol_dir: str, key: bytes) -> str:
    """Put a key given (the operator's copy) into a volume directory as KEY_FILE (0600): a
    restored volume goes on signing with the key its backups verify with. Never replaces
    one."""
    path = key_path(vol_dir)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


def read_key(path: str) -> bytes:
    try:
        with open(path) as f:
            text = f.read(200).strip()
        key = bytes.fromhex(text)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise BackupError(f"cannot read the backup key {path}: {why}") from None
    if len(key) < 16:
        raise BackupError(f"{path} is not a backup key (too short)")
    return key


def key_id(key: bytes) -> str:
    """A key's fingerprint (shown, and written in the manifests it signs)."""
    return hashlib.sha256(b"ckptfs-backup-key-id\0" + key).hexdigest()[:16]


def _mac(manifest: dict, key: bytes) -> str:
    body = {k: v for k, v in manifest.items() if k != "mac"}
    payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, _MAC_CONTEXT + payload, hashlib.sha256).hexdigest()


def verify(manifest: dict, key: bytes) -> bool:
    """Does the manifest carry a MAC by this key (and so, every piece's BLAKE2b)?"""
    mac = manifest.get("mac")
    if not isinstance(mac, str) or manifest.get("key_id") != key_id(key):
        return False
    if not all(isinstance(p.get("b2"), str) for p in manifest["pieces"]):
        return False
    return hmac.compare_digest(mac, _mac(manifest, key))


def volume_key(vol: Any) -> bytes | None:
    """The key of an open volume's directory: made at its first backup if it has none
    and its metadata is its own SQLite file (PostgreSQL replicas would each make a
    different one: there the operator runs `ckptfs meta backup-key` and copies it)."""
    base = getattr(vol, "base_dir", None)
    if not base:
        return None
    path = key_path(base)
    if not os.path.exists(path):
        if type(vol.meta).__name__ != "SqliteEngine":
            log.warning(
                "no backup key in %s: backups are not signed (ckptfs meta backup-key)", base
            )
            return None
        make_key(base)
        log.info("made the backup key %s: copy it off this host", path)
    return read_key(path)


# -- writing --------------------------------------------------------------------------
class _PieceWriter(io.RawIOBase):
    """A file-like the dump writes into: every PIECE_SIZE bytes become one object."""

    def __init__(self, store: ChunkStore, number: int, piece_size: int) -> None:
        self.store = store
        self.number = number
        self.piece_size = piece_size
        self.buf = bytearray()
        self.pieces: list[dict] = []

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.buf += b
        while len(self.buf) >= self.piece_size:
            self._put(bytes(self.buf[: self.piece_size]))
            del self.buf[: self.piece_size]
        return len(b)

    def finish(self) -> None:
        if self.buf or not self.pieces:
            self._put(bytes(self.buf))
            self.buf.clear()

    def _put(self, data: bytes) -> None:
        i = len(self.pieces)
        if i >= MANIFEST_PIECE:
            raise BackupError("backup too large")
        self.store.put_encoded(backup_id(self.number, i), codec.encode(data, "none"))
        self.pieces.append(
            {
                "len": len(data),
                "xxh128": xxhash.xxh3_128_hexdigest(data),
                "b2": hashlib.blake2b(data, digest_size=32).hexdigest(),
            }
        )


def create_backup(vol: Any, *, keep: int | None = None, piece_size: int = PIECE_SIZE) -> dict:
    """Back the volume's metadata up onto its nodes; drop all but the newest `keep`
    (default: the volume's `backup_keep`). Returns the manifest."""
    settings = backup_settings(vol.meta)
    key = volume_key(vol)
    keep = settings["keep"] if keep is None else keep
    if keep < 1:
        raise BackupError("backup_keep must be at least 1")
    scan = scan_backups(vol.store.nodes)
    existing = scan.backups
    number = new_number(scan)
    t0 = time.monotonic()
    w = _PieceWriter(vol.store, number, piece_size)
    counts = write_dump(vol.meta, w, config_fn=partial(absolute_nodes, base=vol.base_dir))
    w.finish()
    cfg = vol.config
    manifest = {
        "format": 1,
        "id": number,
        "created": time.time(),
        "volume": cfg.get("uuid"),
        "replicas": vol.settings.replicas,
        "nodes": [{"name": n.name, "domain": n.domain} for n in vol.store.nodes],
        "pieces": w.pieces,
        "size": sum(p["len"] for p in w.pieces),
        "files": counts["files"],
        "checkpoints": counts["checkpoints"],
        "extents": counts["extents"],
        "chunks": counts["rows"].get("chunks", 0),
        "seconds": round(time.monotonic() - t0, 3),
    }
    if key is not None:
        manifest["key_id"] = key_id(key)
        manifest["mac"] = _mac(manifest, key)
    body = json.dumps(manifest, sort_keys=True).encode()
    vol.store.put_encoded(backup_id(number, MANIFEST_PIECE), codec.encode(body, "none"))
    older = sorted(  # (a number ahead of ours is a clock's mistake or a plant: left be)
        [
            m
            for m in existing
            if m.get("volume") == manifest["volume"]
            and m["id"] < number
            and (key is None or verify(m, key))  # a signed volume counts only its own
        ],
        key=lambda m: m["id"],
    )
    for m in older[: max(0, len(older) + 1 - keep)]:
        drop_backup(vol.store.nodes, m)
    return manifest


def drop_backup(nodes: Sequence[ObjectNode], manifest: dict) -> None:
    """Delete a backup from every node: the manifest first (so it is never listed half
    deleted), then its pieces."""
    number = manifest["id"]
    ids = [backup_id(number, MANIFEST_PIECE)] + [
        backup_id(number, i) for i in range(len(manifest["pieces"]))
    ]
    for cid in ids:
        for node in nodes:
            try:
                node.delete(cid)
            except ObjectMissing:
                pass
            except NodeError as e:
                log.warning("dropping backup %d on %s: %s", number, node.name, e)


def absolute_nodes(cfg: dict, base: str | None) -> dict:
    """The config with relative dir: node paths (resolved against the volume directory)
    made absolute: a dump outlives that directory, or loads into another one."""
    if not base:
        return cfg
    out = dict(cfg)
    nodes = []
    for n in cfg.get("nodes", []):
        url = n["url"]
        if url.startswith("dir:"):
            p, sep, q = url[4:].partition("?")
            if not os.path.isabs(p):
                url = "dir:" + os.path.normpath(os.path.join(base, p)) + sep + q
        nodes.append({**n, "url": url})
    out["nodes"] = nodes
    return out


# -- finding and reading --------------------------------------------------------------
@dataclass
class Scan:
    """What a listing of the nodes found: the complete, well-formed backups (newest last),
    the backup objects that are not (`problems`: {"object", "backup", "problem"}), and
    every backup number some object uses (a new backup takes none of them)."""

    backups: list[dict] = field(default_factory=list)
    problems: list[dict] = field(default_factory=list)
    numbers: set[int] = field(default_factory=set)


# Backup objects found bad at this process's last scan (the ckptfs_backup_bad_objects
# metric of the daemons, whose automatic backups scan the nodes).
last_scan_problems = 0


def scan_backups(nodes: Sequence[ObjectNode]) -> Scan:
    """List the nodes for backups: a manifest too big, unreadable or ill-formed, or one
    whose pieces are on no node, is a problem (logged in one line, named in the Scan),
    never an exception."""
    global last_scan_problems
    scan = Scan()
    manifests: dict[int, int] = {}  # number -> largest size seen
    present: set[bytes] = set()
    for node in nodes:
        try:
            for cid, size, _mtime in node.list():
                if is_backup_id(cid) and len(cid) == 16:
                    number, piece = parse_id(cid)
                    scan.numbers.add(number)
                    present.add(cid)
                    if piece == MANIFEST_PIECE:
                        manifests[number] = max(size, manifests.get(number, 0))
        except (NodeError, OSError) as e:
            log.warning("cannot list node %s: %s", node.name, e)
    for number in sorted(manifests):
        cid = backup_id(number, MANIFEST_PIECE)
        try:
            if manifests[number] > MAX_MANIFEST + 64:  # (the codec header's few bytes)
                raise BackupError(f"manifest of {manifests[number]} bytes")
            m = check_manifest(json.loads(_read_object(nodes, cid)), number)
            lost = [i for i in range(len(m["pieces"])) if backup_id(number, i) not in present]
            if lost:
                raise BackupError(f"piece {lost[0]} is on no node")
        except (BackupError, ValueError, RecursionError) as e:
            why = str(e).removeprefix(f"backup {number}: ")
            log.warning("backup %d: skipped: %s", number, why)
            scan.problems.append({"object": cid.hex(), "backup": number, "problem": why[:200]})
            continue
        scan.backups.append(m)
    last_scan_problems = len(scan.problems)
    return scan


def list_backups(nodes: Sequence[ObjectNode]) -> list[dict]:
    """Every complete, well-formed backup on these nodes (newest last), from their
    manifests (scan_backups: the others are logged and skipped)."""
    return scan_backups(nodes).backups


def new_number(scan: Scan, now: float | None = None) -> int:
    """A new backup's number: the clock's second, past the newest listed backup within
    ID_SKEW of the clock (backups taken in one second still sort by time), and past every
    number an object uses. A number a node claims further ahead is not followed: it could
    only push ours to the end of the u32 space (planted 0xFFFFFFFF: struct.error forever)."""
    now_s = int(time.time() if now is None else now)
    near = [m["id"] + 1 for m in scan.backups if m["id"] <= now_s + ID_SKEW]
    number = max(now_s, *near, 1)
    while number in scan.numbers:
        number += 1
    if number >= MANIFEST_PIECE:  # only a clock past 2106 gets here
        raise BackupError(f"no backup number left (clock at {now_s})")
    return number


def _int(v: Any, lo: int = 0, hi: int = 1 << 63) -> bool:
    return type(v) is int and lo <= v < hi


def check_manifest(m: Any, number: int) -> dict:
    """A manifest read from a node, checked field by field (BackupError, one line): every
    field a listing prints, a restore or a drop uses, of its type and within bounds."""
    if not isinstance(m, dict):
        raise BackupError("the manifest is not a JSON object")
    if m.get("format") != 1 or m.get("id") != number:
        raise BackupError("the manifest is not of this format or names another backup")
    for k in ("size", "files", "checkpoints", "extents", "chunks", "replicas"):
        if k in m and not _int(m[k]):
            raise BackupError(f"the manifest's {k} is not a count")
    for k in ("size", "files", "checkpoints"):
        if k not in m:
            raise BackupError(f"the manifest has no {k}")
    created = m.get("created")
    if type(created) not in (int, float) or not 0 <= created < 1e11:
        raise BackupError("the manifest's time is not a time")
    if m.get("volume") is not None and not isinstance(m["volume"], str):
        raise BackupError("the manifest's volume is not a uuid")
    pieces = m.get("pieces")
    if not isinstance(pieces, list) or not 0 < len(pieces) < MANIFEST_PIECE:
        raise BackupError("the manifest lists no pieces")
    for p in pieces:
        if not (
            isinstance(p, dict)
            and _int(p.get("len"), 0, MAX_PIECE + 1)
            and isinstance(p.get("xxh128"), str)
            and len(p["xxh128"]) == 32
            and set(p["xxh128"]) <= _HEX32
            and (p.get("b2") is None or isinstance(p["b2"], str))
        ):
            raise BackupError("the manifest lists a malformed piece")
    if sum(p["len"] for p in pieces) != m["size"]:
        raise BackupError("the manifest's size is not its pieces'")
    nodes = m.get("nodes", [])
    if not isinstance(nodes, list) or not all(
        isinstance(n, dict) and isinstance(n.get("name"), str) and isinstance(n.get("domain"), str)
        for n in nodes
    ):
        raise BackupError("the manifest's node list is malformed")
    return m


def _read_object(
    nodes: Sequence[ObjectNode], cid: bytes, digest: str | None = None, b2: str | None = None
) -> bytes:
    """A backup object from the first node with a good copy (codec checksum, and the
    manifest's digest for a piece)."""
    reasons = []
    transient = False
    for node in nodes:
        try:
            raw = codec.decode(node.get(cid))
        except ObjectMissing:
            continue
        except NodeError as e:
            transient = True
            reasons.append(f"{node.name}: {e}")
            continue
        except (codec.ChunkFormatError, ValueError) as e:
            reasons.append(f"{node.name}: {e}")
            continue
        if (digest is not None and xxhash.xxh3_128_hexdigest(raw) != digest) or (
            b2 is not None and hashlib.blake2b(raw, digest_size=32).hexdigest() != b2
        ):
            reasons.append(f"{node.name}: content does not match the manifest")
            continue
        return raw
    number, piece = parse_id(cid)
    what = "manifest" if piece == MANIFEST_PIECE else f"piece {piece}"
    err = BackupError(
        f"backup {number}: {what} is on no node" + (f" ({'; '.join(reasons)})" if reasons else "")
    )
    err.transient = transient
    raise err


class _PieceReader(io.RawIOBase):
    """The dump stream of a backup, a piece in memory at a time."""

    def __init__(self, nodes: Sequence[ObjectNode], manifest: dict) -> None:
        self.nodes = nodes
        self.m = manifest
        self.i = 0
        self.cur = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self.cur:
            if self.i >= len(self.m["pieces"]):
                return 0
            p = self.m["pieces"][self.i]
            self.cur = memoryview(
                _read_object(self.nodes, backup_id(self.m["id"], self.i), p["xxh128"], p.get("b2"))
            )
            self.i += 1
        n = min(len(b), len(self.cur))
        b[:n] = self.cur[:n]
        self.cur = self.cur[n:]
        return n


def backup_stream(nodes: Sequence[ObjectNode], manifest: dict) -> IO[bytes]:
    return io.BufferedReader(_PieceReader(nodes, manifest), 1 << 20)


def backup_named(
    nodes: Sequence[ObjectNode], candidates: set[bytes], problems: list[dict] | None = None
) -> set[bytes]:
    """Which of these chunk ids a kept backup names (gc must not delete their objects).

    Reads only each backup's `chunks` table (the dump's first), and keeps only ids among
    the candidates: memory is bounded by what gc was about to delete. A backup that
    cannot be read (a piece on no node, or corrupt, or an ill-formed dump) could not be
    restored either: it is skipped and added to `problems` (with the listing's). A node
    that failed to answer may hold what is missing: that raises (BackupError, transient),
    and gc deletes nothing on this pass rather than what a readable backup names."""
    named: set[bytes] = set()
    if not candidates:
        return named
    scan = scan_backups(nodes)
    if problems is not None:
        problems.extend(scan.problems)
    for m in scan.backups:
        try:
            for row in iter_table(read_records(backup_stream(nodes, m)), "chunks"):
                cid = row[0]
                if cid in candidates:
                    named.add(cid)
        except BackupError as e:
            if e.transient:
                raise
            _skipped(m, str(e), problems)
        except DumpError as e:
            _skipped(m, str(e), problems)
    return named


def _skipped(m: dict, why: str, problems: list[dict] | None) -> None:
    why = why.removeprefix(f"backup {m['id']}: ")
    log.warning("backup %d: skipped: %s", m["id"], why)
    if problems is not None:
        cid = backup_id(m["id"], MANIFEST_PIECE).hex()
        problems.append({"object": cid, "backup": m["id"], "problem": why[:200]})


# -- settings and automatic backups ---------------------------------------------------
def backup_settings(meta: Any) -> dict:
    """The volume's backup_interval (seconds; 0 turns automatic backups off) and
    backup_keep, from its config (set at format: `--backup-interval`, `--backup-keep`)."""
    cfg = meta.get_config()
    return {
        "interval": float(cfg.get("backup_interval", BACKUP_INTERVAL)),
        "keep": int(cfg.get("backup_keep", BACKUP_KEEP)),
    }


AUTO_RETRY_S = 300.0  # after a failed automatic backup, try again this much later
AUTO_CHECK_S = 60.0  # how often a long-running writer asks whether a backup is due
AUTO_CHECK_MIN_S = 0.5  # ... at most this often, whatever the interval


class AutoBackup:
    """A long-running writer's automatic backups (meta serve; a mount of a volume
    directory).

    The interval is the volume's `backup_interval` as the process opened it (`vol.config`,
    no database read; it is set at format, so a change would take effect at the next
    start); 0 means none: no tick lists a node or takes a backup. The nodes are listed
    once, at the first tick, for the newest backup; after that the clock decides, so a
    tick that finds none due costs nothing. A failed backup is tried again `retry_s`
    later (AUTO_RETRY_S; less under $CKPTFS_PERIODIC_MAX_S, see metadata.periodic), not
    at every tick: a dump costs."""

    def __init__(self, vol: Any, interval: float | None = None) -> None:
        self.vol = vol
        if interval is None:
            interval = float(vol.config.get("backup_interval", BACKUP_INTERVAL))
        self.interval = interval
        self.retry_s = capped(AUTO_RETRY_S)
        self._newest: float | None = None
        self.taken = 0

    @property
    def check_every(self) -> float:
        """Seconds to the next tick: AUTO_CHECK_S, or a quarter of a shorter interval
        (AUTO_CHECK_MIN_S at least)."""
        interval = self.interval
        if interval <= 0:
            return AUTO_CHECK_S
        return min(AUTO_CHECK_S, max(AUTO_CHECK_MIN_S, interval / 4))

    def step(self, now: float | None = None) -> dict | None:
        """Take a backup if one is due (its manifest), else None. Raises what failed, with
        the next attempt set retry_s later: run_auto_backups logs and counts it."""
        interval = self.interval
        if interval <= 0:
            return None
        try:
            if self._newest is None:
                made = [m["created"] for m in list_backups(self.vol.store.nodes)]
                self._newest = max(made, default=0.0)
            now = time.time() if now is None else now
            if now - self._newest < interval:
                return None
            manifest = create_backup(self.vol)
        except Exception:
            self._newest = time.time() - interval + self.retry_s
            raise
        self._newest = manifest["created"]
        self.taken += 1
        log.info("automatic metadata backup %d: %d bytes", manifest["id"], manifest["size"])
        return manifest

    def tick(self, now: float | None = None) -> dict | None:
        """step() that never raises: a failure is logged here (a caller outside
        run_auto_backups)."""
        try:
            return self.step(now)
        except Exception as e:  # noqa: BLE001 - a failed backup must not stop the writer
            log.warning("automatic metadata backup failed (retried in %.0f s): %s", self.retry_s, e)
            return None


async def run_auto_backups(vol: Any) -> None:
    """The automatic backups of a long-running writer (a trio task, until cancelled).

    With the volume's backup_interval 0 it returns at once: no task ticks, no node is
    listed. Otherwise an AutoBackup steps every `check_every` seconds (AUTO_CHECK_S, or a
    quarter of a shorter interval) in a worker thread, under metadata.periodic: a backup
    that fails is logged in one line, counted (ckptfs_periodic_failures_total{task=
    "backup"}) and tried again later, and never takes the process down."""
    import trio

    auto = AutoBackup(vol)
    if auto.interval <= 0:
        log.info("automatic metadata backups off (backup_interval 0)")
        return

    async def step() -> None:
        # abandon_on_cancel: a backup in progress never holds up the process's exit
        await trio.to_thread.run_sync(auto.step, abandon_on_cancel=True)

    await run_periodic("backup", step, lambda: auto.check_every, log=log)


# -- restoring ------------------------------------------------------------------------
@dataclass
class RestoreReport:
    backup: int = 0
    path: str = ""
    files: int = 0
    checkpoints: int = 0
    chunks: int = 0
    missing_chunks: list[str] = field(default_factory=list)  # named, on no node
    seconds: float = 0.0
    verified: bool = False  # its manifest's MAC checked with the key given

    def as_dict(self) -> dict:
        return asdict(self)


def node_infos(urls: Sequence[str], manifest: dict | None = None) -> list[NodeInfo]:
    """Nodes for URLs given on the command line. With a manifest, node i keeps the name
    and failure domain it had in the backed-up volume (placement hashes names), so give
    the nodes in the volume's order."""
    known = (manifest or {}).get("nodes") or []
    out = []
    for i, url in enumerate(urls):
        name = known[i]["name"] if i < len(known) else f"n{i}"
        info = parse_node_url(url, name=name)
        if i < len(known) and "domain=" not in url:
            info = NodeInfo(info.name, info.url, known[i]["domain"])
        if info.url.startswith("dir:") and not os.path.isabs(info.url[4:].partition("?")[0]):
            p, sep, q = info.url[4:].partition("?")
            info = NodeInfo(info.name, "dir:" + os.path.abspath(p) + sep + q, info.domain)
        out.append(info)
    return out


def open_nodes(urls: Sequence[str], manifest: dict | None = None) -> list[ObjectNode]:
    return [open_node(i) for i in node_infos(urls, manifest)]


def choose(
    backups: list[dict],
    wanted: int | None,
    key: bytes | None = None,
    nodes: Sequence[ObjectNode] | None = None,
) -> dict:
    """The backup to restore: `wanted`, or the newest. With a key, only one that verifies
    (a named one that does not is refused, naming it), and of those the newest whose
    manifest is present and identical on R nodes (the volume's replicas), if any is.

    Without a key (restore --no-verify) a manifest's `replicas` is a node's word, so R is
    what the backups show: the most copies that any backup both claims and has. The
    newest backup with that many identical copies is taken: one planted on a single node
    does not outrank the volume's own, replicated, backups (unless R is 1)."""
    if not backups:
        raise BackupError("no backup found on these nodes")
    if wanted is not None:
        m = next((m for m in backups if m["id"] == wanted), None)
        if m is None:
            have = ", ".join(str(m["id"]) for m in backups)
            raise BackupError(f"no backup {wanted} on these nodes (have {have})")
        if key is not None and not verify(m, key):
            raise BackupError(
                f"backup {wanted} does not verify with this key (forged, damaged, or signed "
                "by another volume's key): refused"
            )
        return m
    if key is None:
        if not nodes:
            return backups[-1]
        copies = {m["id"]: _copies(nodes, m["id"]) for m in backups}
        want = max(min(_replicas(m, nodes), copies[m["id"]]) for m in backups)
        return next(m for m in reversed(backups) if copies[m["id"]] >= want)
    good = [m for m in backups if verify(m, key)]
    if not good:
        bad = ", ".join(str(m["id"]) for m in backups)
        raise BackupError(f"no backup on these nodes verifies with this key (found {bad})")
    if nodes:
        for m in reversed(good):
            if _copies(nodes, m["id"]) >= _replicas(m, nodes):
                return m
        log.warning("no verified backup is on R nodes alike: the newest verified one is used")
    return good[-1]


def _replicas(m: dict, nodes: Sequence[ObjectNode]) -> int:
    """The manifest's replica count, within 1..the node count."""
    return min(max(1, int(m.get("replicas", 1))), len(nodes))


def _copies(nodes: Sequence[ObjectNode], number: int) -> int:
    """On how many nodes the backup's manifest is present, the same as the first good one."""
    cid = backup_id(number, MANIFEST_PIECE)
    bodies = []
    for node in nodes:
        try:
            bodies.append(codec.decode(node.get(cid)))
        except (NodeError, codec.ChunkFormatError, ValueError):
            continue
    return max((bodies.count(b) for b in bodies), default=0)


def restore(
    path: str,
    node_urls: Sequence[str],
    *,
    backup: int | None = None,
    db: str | None = None,
    key: bytes | None = None,
    no_verify: bool = False,
) -> RestoreReport:
    """Rebuild a volume at `path` from a backup on these nodes (the newest, or `backup`).

    The new volume's nodes are the given URLs. Chunks the backup names that no node holds
    are reported (fsck shows them as dangling extents); objects on the nodes that the
    backup does not name are left alone (gc deletes them after its grace period).
    `key` (the volume's backup key) is required: only a backup that verifies is restored
    (choose), and the key is put in the new volume directory (its next backups are
    signed by it). `no_verify=True` without a key restores an unverified backup (the
    newest on R nodes alike: choose); the caller said so (`restore --no-verify`)."""
    if key is None and not no_verify:
        raise BackupError(
            "a restore verifies the backup with the volume's backup key: give the key, or "
            "no_verify=True to restore an unverified one"
        )
    t0 = time.monotonic()
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, VOLUME_FILE)):
        raise BackupError(f"{path} already holds a volume")
    if key is not None and os.path.exists(key_path(path)) and read_key(key_path(path)) != key:
        raise BackupError(f"{key_path(path)} holds another backup key: move it away")
    probe = open_nodes(node_urls)
    try:
        m = choose(list_backups(probe), backup, key, probe)
    finally:
        for n in probe:
            n.close()
    infos = node_infos(node_urls, m)
    nodes = [open_node(i) for i in infos]
    meta_url = db or "sqlite:meta.db"
    rep = RestoreReport(backup=m["id"], path=path, verified=key is not None)

    def new_config(cfg: dict) -> dict:
        cfg = dict(cfg)
        cfg["nodes"] = [{"name": i.name, "url": i.url, "domain": i.domain} for i in infos]
        if cfg.get("replicas", 1) > len(nodes):
            raise BackupError(f"the volume keeps {cfg['replicas']} replicas: give that many nodes")
        return cfg

    try:
        with making_volume(path):
            engine = open_engine(meta_url, path)
            try:
                out = load_dump(engine, read_records(backup_stream(nodes, m)), config_fn=new_config)
                rep.files, rep.checkpoints = out["files"], out["checkpoints"]
                rep.chunks = out["rows"].get("chunks", 0)
                rep.missing_chunks = [c.hex() for c in _missing(engine, nodes)]
                if key is not None and not os.path.exists(key_path(path)):
                    write_key(path, key)
                write_volume_file(path, meta_url)
            finally:
                engine.close()
    except DumpError as e:
        raise BackupError(f"backup {m['id']}: {e}") from None
    finally:
        for n in nodes:
            n.close()
    rep.seconds = round(time.monotonic() - t0, 3)
    return rep


def _missing(engine: Any, nodes: Sequence[ObjectNode]) -> Iterator[bytes]:
    """Chunk rows (not inline) that no node holds: a listing of every node, kept as a set
    of ids that are also rows, checked a batch of rows at a time."""
    held: set[bytes] = set()
    for node in nodes:
        try:
            held.update(cid for cid, _s, _m in node.list() if not is_backup_id(cid))
        except (NodeError, OSError) as e:
            log.warning("cannot list node %s: %s", node.name, e)
    with engine.snapshot() as snap:
        for rows in snap.rows("chunks", ["id", "state"], 4096):
            for cid, state in rows:
                if state != INLINE and bytes(cid) not in held:
                    yield bytes(cid)
