"""The metadata wire protocol: length-prefixed msgpack frames over TCP.

Frame: 4-byte big-endian body length, then a msgpack body. A connection opens
with one exchange, the handshake (version and token), then carries pipelined
requests and responses matched by request id, in any order:

    hello    {"proto": 1, "token": str}            -> {"proto": 1, "ok": true}
    request  [id, method, args, kwargs, idem_key]  -> [id, 0, result]
                                                   or [id, errno, message]
    request  [id, method, args, kwargs, idem_key, token]   (the same, on behalf of
             another credential: a host's client carrying many ranks on one connection)

`idem_key` (bytes or nil) marks a mutating request: the service applies a
request with a given key once and answers retries from the first outcome. A request's
own `token` (a string, at most TOKEN_MAX characters), when present, is the credential
its permission and scope are checked against instead of the connection's hello's: one
connection then carries requests of many ranks, each with its own scope. It travels in
the request, not as per-connection state, so a request resent to another replica after
a failover carries it too.
The engine's dataclasses travel as msgpack extension types (compact, and the
decoder rebuilds them without knowing the method), sets and tuples likewise.
Anything malformed raises ProtocolError, the only exception the decoders raise.
"""

from __future__ import annotations

import struct
from dataclasses import fields
from typing import Annotated, Any, Literal

import msgspec

from metadata.ckptformat import WireFile
from metadata.engine import Attr, ChunkRow, DirEntry, Extent, NewChunk, VolumeStats

PROTO_VERSION = 3  # 2: Attr.alloc; 3: NewChunk.data (inline chunks)
# The service's defaults for authenticated connections (service.py; `meta serve` options),
# here so the CLI can show them without importing the service and trio.
IDLE_TIMEOUT = 900.0  # seconds without a request, nothing in flight
MAX_CONNECTIONS = 65536
MAX_FRAME = 64 * 2**20
MEMORY_BUDGET = 256 * 2**20  # answers queued + frames half received, all connections (budget.py)
HEADER = struct.Struct(">I")

_TYPES: dict[int, type] = {
    1: Attr, 2: Extent, 3: NewChunk, 4: DirEntry, 5: VolumeStats, 6: ChunkRow
}  # fmt: skip
_CODES = {cls: code for code, cls in _TYPES.items()}
_FIELDS = {cls: [f.name for f in fields(cls)] for cls in _TYPES.values()}
_SET = 20


# The engine methods a client may call: MetaEngine's interface plus checkpoints.
# A method added to the engine becomes remote by adding its name here.
READ_METHODS = frozenset(
    {
        "ping", "get_config", "lookup", "getattr", "readdir", "readlink", "get_xattr", "list_xattr",
        "get_extents", "chunk_info", "inline_data", "stats", "step_state", "wait_published",
        "latest", "latest_durable", "manifest", "list_checkpoints", "checkpoint_info",
        "pending_refs", "get_retention", "chunk_rows", "true_refcounts", "files_using",
        "inode_path", "known_chunks", "under_replicated", "parent", "sync", "changes_since",
        "unverified_chunks",
    }
)  # fmt: skip
MUTATING_METHODS = frozenset(
    {
        "create", "link", "unlink", "rmdir", "rename", "setattr", "forget_orphan",
        "purge_orphans", "set_xattr", "remove_xattr", "commit_file", "missing_chunks",
        "mark_durable", "begin", "commit_rank", "abort", "expire", "delete_checkpoint",
        "retain", "set_retention", "apply_retention", "fix_refcounts", "gc_chunk_rows",
        "record_under_replicated", "clear_under_replicated", "drop_chunk_rows",
        "register_chunk_rows", "apply_pending", "renew_chunk_leases", "end_chunk_leases",
        "gc_orphan_objects", "gc_release_objects", "commit_ranks", "mark_verified",
    }
)  # fmt: skip
REMOTE_METHODS = READ_METHODS | MUTATING_METHODS

# The one permission every remote method needs (checked at one place, at the service
# boundary: metadata/server/access.py), and what of its arguments the caller's scope must
# cover: "job" (the first argument names a job), "ino" (the first is an inode or a parent
# directory), "ino2" (rename and link: both directories), "" (nothing scoped). Roles:
# "read" any credential (a scoped one within its scope), "write" a writer (within its
# scope) or admin, "admin" the volume's administrator only.
PERMISSIONS: dict[str, tuple[str, str]] = {
    # liveness, configuration (the chunk-id seed a writer hashes with), content by id
    "ping": ("read", ""), "get_config": ("read", ""), "stats": ("read", ""),
    "sync": ("read", ""), "chunk_info": ("read", ""), "inline_data": ("read", ""),
    "changes_since": ("read", ""), "pending_refs": ("read", ""),
    # the namespace, read
    "lookup": ("read", "ino"), "getattr": ("read", "ino"), "readdir": ("read", "ino"),
    "readlink": ("read", "ino"), "get_xattr": ("read", "ino"), "list_xattr": ("read", "ino"),
    "get_extents": ("read", "ino"), "parent": ("read", "ino"),
    # checkpoints, read
    "step_state": ("read", "job"), "wait_published": ("read", "job"), "latest": ("read", "job"),
    "latest_durable": ("read", "job"), "manifest": ("read", "job"),
    "list_checkpoints": ("read", "job"), "checkpoint_info": ("read", "job"),
    "get_retention": ("read", "job"),
    # the namespace, written
    "create": ("write", "ino"), "unlink": ("write", "ino"), "rmdir": ("write", "ino"),
    "setattr": ("write", "ino"), "set_xattr": ("write", "ino"),
    "remove_xattr": ("write", "ino"), "commit_file": ("write", "ino"),
    "forget_orphan": ("write", "ino"), "link": ("write", "ino2"), "rename": ("write", "ino2"),
    # chunks a writer stores (its own claims: leases, durability after its uploads)
    "missing_chunks": ("write", ""), "mark_durable": ("write", ""),
    "renew_chunk_leases": ("write", ""), "end_chunk_leases": ("write", ""),
    # checkpoints, written: a writer's own jobs
    "begin": ("write", "job"), "commit_rank": ("write", "job"), "abort": ("write", "job"),
    "commit_ranks": ("write", "job"),
    "delete_checkpoint": ("write", "job"), "retain": ("write", "job"),
    "set_retention": ("write", "job"), "apply_retention": ("write", "job"),
    # maintenance: gc, fsck and scrub repair, chunk rows, orphans, the volume's clock
    "expire": ("admin", ""), "purge_orphans": ("admin", ""), "fix_refcounts": ("admin", ""),
    "gc_chunk_rows": ("admin", ""), "record_under_replicated": ("admin", ""),
    "clear_under_replicated": ("admin", ""), "drop_chunk_rows": ("admin", ""),
    "register_chunk_rows": ("admin", ""), "apply_pending": ("admin", ""),
    "gc_orphan_objects": ("admin", ""), "gc_release_objects": ("admin", ""),
    "chunk_rows": ("admin", ""), "true_refcounts": ("admin", ""), "files_using": ("admin", ""),
    "inode_path": ("admin", ""), "known_chunks": ("admin", ""),
    "under_replicated": ("admin", ""),
    # the verifier (fusefs/maint/verify.py): scoped writers' chunk claims checked on the nodes
    "unverified_chunks": ("admin", ""), "mark_verified": ("admin", ""),
}  # fmt: skip


class ProtocolError(Exception):
    """A peer sent something that is not a valid frame or message."""


def wire(obj: Any) -> Any:
    """Engine dataclasses and sets -> extension types (msgspec would send dataclasses as maps)."""
    t = type(obj)
    code = _CODES.get(t)
    if code is not None:
        return msgspec.msgpack.Ext(code, _ENC.encode([wire(getattr(obj, f)) for f in _FIELDS[t]]))
    if t is list or t is tuple:
        return [wire(x) for x in obj]
    if t is dict:
        return {k: wire(v) for k, v in obj.items()}
    if t is set or t is frozenset:
        return msgspec.msgpack.Ext(_SET, _ENC.encode([wire(x) for x in obj]))
    return obj


def _enc_hook(obj: Any) -> Any:
    raise TypeError(f"cannot send a {type(obj).__name__} over the metadata protocol")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _SET:
        return set(_DEC.decode(data))
    cls = _TYPES.get(code)
    if cls is None:
        raise ProtocolError(f"unknown extension type {code}")
    vals = _DEC.decode(data)
    if not isinstance(vals, list):
        raise ProtocolError(f"bad {cls.__name__} encoding")
    return cls(*vals)


_ENC = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DEC = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def encode(obj: Any) -> bytes:
    return _ENC.encode(wire(obj))


def encode_answer(rid: int, result: Any) -> bytes:
    """A success answer; a result encoded once for many answers (msgspec.Raw: a group
    commit's ranks, a manifest) needs no walk through `wire`."""
    if type(result) is msgspec.Raw:
        return _ENC.encode((rid, 0, result))
    return encode([rid, 0, result])


def decode(body: bytes | memoryview) -> Any:
    try:
        return _DEC.decode(body)
    except ProtocolError:
        raise
    except Exception as e:  # msgspec errors, bad dataclass arity (TypeError) ...
        raise ProtocolError(f"undecodable message: {e}") from None


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def encode_frame(obj: Any) -> bytes:
    return frame(encode(obj))


class FrameDecoder:
    """Incremental frame splitter: feed bytes, get complete frame bodies back.

    A frame that lies whole inside one `feed` comes back as a memoryview of the
    fed bytes, not a copy (the decoders read any buffer); only a frame split
    across feeds is assembled in a buffer, which grows with what arrives (a frame is
    never allocated at its announced size: a sender that stalls holds what it sent).
    Copying every body twice was ~5 us of the service's loop per 5 KB rank commit."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()  # the start of a frame split across feeds

    def feed(self, data: bytes) -> list[bytes | memoryview]:
        out: list[bytes | memoryview] = []
        mv = memoryview(data)
        pos, end = 0, len(mv)
        buf = self._buf
        if buf:  # complete the split frame first, from the front of `data`
            if len(buf) < 4:
                pos = min(4 - len(buf), end)
                buf += mv[:pos]
                if len(buf) < 4:
                    return out
            n = self._size(buf, 0)
            take = min(4 + n - len(buf), end - pos)
            buf += mv[pos : pos + take]
            pos += take
            if len(buf) < 4 + n:
                return out
            out.append(memoryview(buf)[4:])  # not copied (twice: a slice, then bytes)
            self._buf = bytearray()
        while end - pos >= 4:
            n = self._size(mv, pos)
            if end - pos < 4 + n:
                break
            out.append(mv[pos + 4 : pos + 4 + n])
            pos += 4 + n
        if pos < end:
            self._buf = bytearray(mv[pos:])
        return out

    def _size(self, buf: bytes | bytearray | memoryview, pos: int) -> int:
        (n,) = HEADER.unpack_from(buf, pos)
        if n > self.max_frame:
            raise ProtocolError(f"frame of {n} bytes exceeds the {self.max_frame} byte limit")
        return n

    @property
    def pending(self) -> int:
        return len(self._buf)


TOKEN_MAX = 512  # characters of a request's own token (a scoped one has 47)


def parse_request(body: bytes | memoryview) -> tuple:
    """Validate a request's shape: (id, method, args, kwargs, idempotency key[, token])."""
    msg = decode(body)
    if not isinstance(msg, list) or len(msg) not in (5, 6):
        raise ProtocolError("a request is [id, method, args, kwargs, idem_key[, token]]")
    if len(msg) == 6:
        token = msg.pop()
        if not isinstance(token, str) or not 0 < len(token) <= TOKEN_MAX:
            raise ProtocolError(f"a request's token is a string of 1..{TOKEN_MAX} characters")
    else:
        token = None
    rid, method, args, kwargs, key = msg
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 < rid < 2**63:
        raise ProtocolError("request id must be a positive integer")
    if not isinstance(method, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ProtocolError("bad request fields")
    if not all(isinstance(k, str) for k in kwargs):
        raise ProtocolError("keyword argument names must be strings")
    if key is not None and (not isinstance(key, bytes) or not 8 <= len(key) <= 64):
        raise ProtocolError("idempotency key must be 8..64 bytes")
    head = (rid, method, args, kwargs, key)
    return head if token is None else (*head, token)


_RID = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]
_KEY = Annotated[bytes, msgspec.Meta(min_length=8, max_length=64)] | None
_TOKEN = Annotated[str, msgspec.Meta(min_length=1, max_length=TOKEN_MAX)]
_RANK_ARGS = tuple[str, int, int, list[WireFile]]
_RANKS_ARGS = tuple[str, int, list[tuple[int, list[WireFile], str]]]  # commit_ranks'
# (the method name as msgpack encodes it, its arguments): the requests decoded typed
_COMMITS = ((b"\xabcommit_rank", "commit_rank", _RANK_ARGS),
            (b"\xaccommit_ranks", "commit_ranks", _RANKS_ARGS))  # fmt: skip
# by the request's array header: without (0x95) or with (0x96) its own token
_COMMIT_DECODERS = {
    tag: {
        0x95: msgspec.msgpack.Decoder(
            tuple[_RID, Literal[name], args, dict[str, str], _KEY]  # type: ignore[valid-type]
        ),
        0x96: msgspec.msgpack.Decoder(
            tuple[_RID, Literal[name], args, dict[str, str], _KEY, _TOKEN]  # type: ignore[valid-type]
        ),
    }
    for tag, name, args in _COMMITS
}


def parse_commit(body: bytes | memoryview) -> tuple | None:
    """A well-typed commit_rank or commit_ranks request (with or without its own token)
    decoded straight into WireFiles, else None (then `parse_request` decodes it, and the
    engine's checks name what is wrong). Thousands of ranks send these at once; the
    typed decode is the service loop's cheapest."""
    head = bytes(body[:25])  # array header, id (up to 9 bytes), method
    for tag, decoders in _COMMIT_DECODERS.items():
        if tag in head:
            dec = decoders.get(head[0])
            if dec is None:
                return None
            try:
                return dec.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None
    return None


def parse_hello(body: bytes | memoryview) -> dict:
    msg = decode(body)
    if not isinstance(msg, dict) or not isinstance(msg.get("token"), str):
        raise ProtocolError("the first message must be a hello with a token")
    return msg
