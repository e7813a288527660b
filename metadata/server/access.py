"""Who a connection is and what it may call: the one place the service checks permissions.

Authentication and authorization sit together at the service boundary. A connection's
hello carries a token: the volume's own token file is the administrator; any other token
is looked up by its SHA-256 among the scoped credentials of metadata/sql/tokens.py. Every
request is then checked against the permission its method declares
(metadata/wire/protocol.py PERMISSIONS) and, for a scoped credential, against its scope:

- a "job" method's job must be one of the credential's jobs;
- an "ino" method's inode (or the entry it names in a directory) must lie under one of
  its roots: its prefixes, and each job's checkpoint directory `/JOB`. The directories
  above a root may be looked up, listed (showing only the way to the roots) and, for a
  writer, made (mkdir -p), so that a mount or `ckptfs put` reaches its scope from `/`.

The admin credential takes none of these paths: its requests cost what they did. A
scoped one's namespace requests resolve their inode's path through the engine, cached for
PATH_TTL_S (a directory moved by someone else is seen within that time).

Revocation and expiry: the tokens are reloaded when the database's token generation
moves (polled every ACCESS_POLL_S by each replica), and every request looks its
credential up again, so a revoked or expired token is refused at its next request.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import stat
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
import xxhash

from metadata.engine import MetaError
from metadata.sql.tokens import TokenRecord, token_digest
from metadata.wire.protocol import PERMISSIONS

ACCESS_POLL_S = 0.5  # how often a replica looks for new or revoked tokens
PATH_TTL_S = 2.0  # how long an inode's resolved path is trusted
PATH_CACHE = 65536  # inodes whose paths are kept
ADMIN_DIGEST = b"admin"  # the volume's own token (no scoped record has so short a digest)
_RANK = {"read": 0, "write": 1, "admin": 2}
_ROLE = {"reader": 0, "writer": 1, "admin": 2}


@dataclass(frozen=True)
class Principal:
    name: str
    role: str
    jobs: frozenset[str]
    roots: tuple[bytes, ...]  # absolute paths, no trailing slash
    expires: float  # 0: never
    digest: bytes
    # the trust domain of the chunks it registers (metadata/sql/chunkrefs.py): one per
    # scope, so tokens of the same scope (which may overwrite each other's files anyway)
    # deduplicate against each other's claims; None for the admin (trusted)
    domain: int | None = None

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def scope(self) -> str:
        parts = [f"jobs {', '.join(sorted(self.jobs))}"] if self.jobs else []
        prefixes = [r.decode(errors="replace") for r in self.roots]
        if prefixes:
            parts.append(f"paths {', '.join(prefixes)}")
        return f"token {self.name} ({self.role}: {'; '.join(parts) or 'everything'})"

    def inside(self, path: bytes) -> bool:
        return self.admin or any(path == r or path.startswith(r + b"/") for r in self.roots)

    def above(self, path: bytes) -> bool:
        """A directory on the way from / to one of the roots."""
        if path == b"/":
            return True
        return any(r.startswith(path + b"/") for r in self.roots)


ADMIN = Principal("admin", "admin", frozenset(), (), 0.0, ADMIN_DIGEST)


def principal_of(rec: TokenRecord) -> Principal:
    roots = {p.encode() for p in rec.prefixes} | {b"/" + j.encode() for j in rec.jobs}
    return Principal(
        rec.name,
        rec.role,
        frozenset(rec.jobs),
        tuple(sorted(roots)),
        rec.expires,
        rec.digest,
        scope_domain(rec.jobs, rec.prefixes),
    )


def scope_domain(jobs: tuple[str, ...] | list[str], prefixes: tuple[str, ...] | list[str]) -> int:
    """A scope's trust domain: a positive 31-bit digest of its jobs and prefixes."""
    text = "\0".join(["j", *sorted(jobs), "p", *sorted(prefixes)]).encode()
    n = int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "big") & 0x7FFFFFFF
    return n or 1


# Methods told the caller's trust domain (a scoped credential's; chunkrefs.py)
DOMAIN_METHODS = frozenset(
    {"missing_chunks", "commit_file", "commit_rank", "commit_ranks", "mark_durable"}
)


def with_domain(p: Principal, method: str, kwargs: dict) -> dict:
    """A scoped caller's request as the engine runs it: its trust domain set by the
    service (whatever the client sent), so its chunk claims count only for its scope."""
    if p.domain is None or method not in DOMAIN_METHODS:
        return kwargs
    return {**kwargs, "domain": p.domain}


def denied(p: Principal, method: str, why: str) -> MetaError:
    return MetaError(errno.EACCES, f"{method}: {why} ({p.scope()})")


class Access:
    """The credentials a service knows, and the checks (see the module docstring)."""

    def __init__(self, engine: Any, admin_token: bytes) -> None:
        self.engine = engine
        self._admin = admin_token
        self._by_digest: dict[bytes, Principal] = {ADMIN_DIGEST: ADMIN}
        self.generation = -1
        self._paths: OrderedDict[int, tuple[float, bytes | None]] = OrderedDict()
        self._reloading: trio.Event | None = None  # a reload_now in flight

    # -- credentials (blocking: run in a worker thread) -----------------------------
    def reload(self) -> bool:
        """Read the token generation, and the tokens if it moved; True if they changed."""
        gen = self.engine.token_generation()
        if gen == self.generation:
            return False
        recs = self.engine.list_tokens()
        table = {r.digest: principal_of(r) for r in recs if r.role != "admin"}
        table.update({r.digest: _admin_named(r) for r in recs if r.role == "admin"})
        table[ADMIN_DIGEST] = ADMIN
        self._by_digest = table
        self.generation = gen
        return True

    async def reload_now(self, run: Callable[[Callable[[], bool]], Awaitable[bool]]) -> None:
        """`reload` in a worker thread (`run`), one at a time: callers that come while one
        runs wait for it. So a token made a moment ago works at once, in a hello or as a
        request's own token (an agent's rank may beat the poll), and unknown tokens sent
        in a burst cost one reload, not one each."""
        if self._reloading is not None:
            await self._reloading.wait()
            return
        self._reloading = done = trio.Event()
        try:
            await run(self.reload)
        finally:
            self._reloading = None
            done.set()

    def authenticate(self, token: str) -> Principal | None:
        """The principal a hello's token names, from memory (None: unknown so far)."""
        if hmac.compare_digest(token.encode(), self._admin):
            return ADMIN
        return self._by_digest.get(token_digest(token))

    def current(self, p: Principal) -> Principal | None:
        """The credential as it stands now: None once revoked or expired."""
        if p is ADMIN:
            return p
        now_p = self._by_digest.get(p.digest)
        if now_p is None or (now_p.expires and time.time() >= now_p.expires):
            return None
        return now_p

    # -- checks -------------------------------------------------------------------
    def refuse(self, p: Principal, method: str, args: list | tuple, kwargs: dict) -> Any:
        """The refusal of a request that memory alone decides (role, job scope), else
        None. "ino" methods of a scoped credential also need `refuse_paths`."""
        need, scope = PERMISSIONS[method]
        if _ROLE[p.role] < _RANK[need]:
            return denied(p, method, f"needs the {need} permission")
        if p.admin or scope != "job":
            return None
        job = args[0] if args else kwargs.get("job")
        if job is None:
            if method == "list_checkpoints":
                return None  # answered with the scope's jobs only (`visible`)
            return denied(p, method, "names no job")
        if job not in p.jobs:
            return denied(p, method, f"job {job!r} is outside the scope")
        if method == "begin" and kwargs.get("path") is not None:
            path = b"/" + str(kwargs["path"]).strip("/").encode()
            if not p.inside(path):
                return denied(p, method, f"checkpoint path {kwargs['path']!r} is outside")
        return None

    def needs_paths(self, p: Principal, method: str) -> bool:
        return not p.admin and PERMISSIONS[method][1] in ("ino", "ino2")

    async def refuse_paths(
        self,
        p: Principal,
        method: str,
        args: list,
        kwargs: dict,
        run: Callable[..., Awaitable[Any]],
    ) -> MetaError | None:
        """The scope check of an inode method (`run` runs a blocking call in a thread)."""
        a = list(args)

        def arg(i: int, name: str) -> Any:
            return a[i] if len(a) > i else kwargs.get(name)

        async def path(ino: Any) -> bytes | None:
            if not isinstance(ino, int) or isinstance(ino, bool):
                raise MetaError(errno.EINVAL, f"{method}: an inode number is an integer")
            hit = self._paths.get(ino)
            if hit is not None and time.monotonic() - hit[0] < PATH_TTL_S:
                return hit[1]
            got = await run(self.engine.path_of, ino)
            self._paths[ino] = (time.monotonic(), got)
            self._paths.move_to_end(ino)
            while len(self._paths) > PATH_CACHE:
                self._paths.popitem(last=False)
            return got

        def child(parent: bytes | None, name: Any) -> bytes | None:
            if parent is None or not isinstance(name, bytes | str):
                return None
            name = name.encode() if isinstance(name, str) else name
            return (parent.rstrip(b"/") + b"/" + name) if parent != b"/" else b"/" + name

        write = PERMISSIONS[method][0] == "write"
        if method in ("lookup", "create", "unlink", "rmdir"):
            target = child(await path(arg(0, "parent")), arg(1, "name"))
            if target is None:
                return denied(p, method, "the directory is outside the scope")
            if p.inside(target):
                return None
            if method == "lookup" and p.above(target):
                return None
            mode = arg(2, "mode")
            if method == "create" and isinstance(mode, int) and stat.S_ISDIR(mode):
                if p.above(target):
                    return None  # mkdir -p on the way to a root
            return denied(p, method, f"{target.decode(errors='replace')} is outside the scope")
        if method == "rename":
            src = child(await path(arg(0, "parent")), arg(1, "name"))
            dst = child(await path(arg(2, "new_parent")), arg(3, "new_name"))
            if src is not None and dst is not None and p.inside(src) and p.inside(dst):
                return None
            return denied(p, method, "source or destination is outside the scope")
        if method == "link":
            src = await path(arg(0, "ino"))
            dst = child(await path(arg(1, "new_parent")), arg(2, "new_name"))
            if src is not None and dst is not None and p.inside(src) and p.inside(dst):
                return None
            return denied(p, method, "source or destination is outside the scope")
        target = await path(arg(0, "ino"))
        if target is None:
            return denied(p, method, "the inode is not under the scope (or unlinked)")
        if p.inside(target):
            return None
        if not write and method in ("getattr", "readdir") and p.above(target):
            return None  # the way to a root: attributes, and a listing showing only it
        return denied(p, method, f"{target.decode(errors='replace')} is outside the scope")

    def visible(self, p: Principal, method: str, args: list, result: Any, parent: bytes) -> Any:
        """A listing above the scope's roots shows only the way to them."""
        if p.admin:
            return result
        if method == "list_checkpoints":
            return [r for r in result if r.get("job") in p.jobs]
        if method == "readdir" and not p.inside(parent):
            keep = []
            for e in result:
                name = e.name if hasattr(e, "name") else e[0]
                full = (parent.rstrip(b"/") + b"/" + name) if parent != b"/" else b"/" + name
                if p.inside(full) or p.above(full):
                    keep.append(e)
            return keep
        return result

    def listed(self, args: list) -> bytes:
        """The path of a readdir's directory, as its scope check resolved it."""
        hit = self._paths.get(args[0]) if args and isinstance(args[0], int) else None
        return hit[1] if hit and hit[1] is not None else b"/"


def _after_rid(body: bytes | memoryview) -> int:
    """Where a request's encoding goes on past its id (a msgpack array header of one
    byte, then the id as a positive integer of 1, 2, 3, 5 or 9 bytes)."""
    tag = body[1] if len(body) > 1 else 0
    return 1 + {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}.get(tag, 1)


def request_binding(name: str, body: bytes | memoryview | None) -> bytes:
    """What a keyed request is bound to: who asked and what (the method, arguments and key
    as encoded, past the request id, which a retry changes). A key replayed with another
    binding is refused (EINVAL), never answered with someone else's outcome."""
    what = xxhash.xxh3_128_digest(body[_after_rid(body) :]) if body is not None else b""
    return _who(name) + what


@functools.lru_cache(maxsize=4096)
def _who(name: str) -> bytes:
    """A credential's part of a binding (computed once per name: every keyed request,
    4,096 rank commits at once among them, asks)."""
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def _admin_named(rec: TokenRecord) -> Principal:
    return Principal(rec.name, "admin", frozenset(), (), rec.expires, rec.digest)
