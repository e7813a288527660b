"""Scoped credentials: tokens kept hashed in the metadata database, never the secret itself.

A token is `ckt_` + 256 random bits (URL-safe), shown once by `ckptfs token create`. The
database keeps its SHA-256 (a fast hash is enough: the secret is random, not a password)
with its name, role, scope and expiry. Roles (metadata/server/access.py decides what each
may call):

- admin: everything, as the volume's own token file (meta serve's `--token-file`) is;
- writer: creates, writes and commits files and checkpoints inside its jobs and prefixes,
  and reads only there;
- reader: reads only its jobs and prefixes.

Every change bumps a generation counter (`token_state`); each service replica reads it
every ACCESS_POLL_S and reloads the tokens when it moved, so a revocation reaches every
replica's next request within that time, without a database read per request. Tokens
are not part of the metadata dump (backups on the nodes carry no credentials): after a
restore, create them again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from metadata.engine import MetaError
from metadata.sql.needs import SqlCore
from metadata.sql.txlocks import retried

ROLES = ("admin", "writer", "reader")
TOKEN_PREFIX = "ckt_"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_SCOPE = 64  # jobs and prefixes a token may name, each


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class TokenRecord:
    """A token as the database keeps it (its digest, never the secret)."""

    name: str
    role: str
    jobs: tuple[str, ...]
    prefixes: tuple[str, ...]
    expires: float  # seconds since the epoch; 0: never
    created: float
    digest: bytes

    def as_dict(self) -> dict:
        return {
            "name": self.name, "role": self.role, "jobs": list(self.jobs),
            "prefixes": list(self.prefixes), "expires": self.expires or None,
            "created": self.created,
        }  # fmt: skip


def normal_prefix(p: str) -> str:
    """An absolute path without '.', '..', empty components or a trailing slash."""
    if not isinstance(p, str) or not p.startswith("/") or "\0" in p:
        raise MetaError(errno.EINVAL, f"a prefix is an absolute path, not {p!r}")
    parts = [x for x in p.split("/") if x]
    if any(x in (".", "..") or len(x.encode()) > 255 for x in parts):
        raise MetaError(errno.EINVAL, f"prefix {p!r}: no '.' or '..' components")
    return "/" + "/".join(parts)


class TokenMixin(SqlCore):
    """Needs SqlEngine's `_tx`, `_read`, `_x`, `_one`, `_q`."""

    @retried
    def create_token(
        self,
        name: str,
        role: str,
        jobs: list[str] = (),  # type: ignore[assignment]
        prefixes: list[str] = (),  # type: ignore[assignment]
        expires_s: float = 0.0,
    ) -> str:
        """Record a new token and return its secret (the only time it exists in clear)."""
        from metadata.ckptcheck import check_job

        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise MetaError(errno.EINVAL, f"token name {name!r}: 1-64 of A-Z a-z 0-9 . _ -")
        if role not in ROLES:
            raise MetaError(errno.EINVAL, f"role {role!r}: one of {', '.join(ROLES)}")
        jobs = sorted(set(jobs))
        for j in jobs:
            check_job(j)
        prefixes = sorted({normal_prefix(p) for p in prefixes})
        if len(jobs) > MAX_SCOPE or len(prefixes) > MAX_SCOPE:
            raise MetaError(errno.EINVAL, f"at most {MAX_SCOPE} jobs and {MAX_SCOPE} prefixes")
        if role != "admin" and not jobs and not prefixes:
            raise MetaError(errno.EINVAL, f"a {role} token needs at least one --job or --prefix")
        if not isinstance(expires_s, int | float) or not 0 <= expires_s <= 10 * 365 * 86400:
            raise MetaError(errno.EINVAL, "expiry must be within 10 years")
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        with self._tx() as c:
            if self._one(c, "SELECT 1 FROM tokens WHERE name = ?", (name,)) is not None:
                raise MetaError(errno.EEXIST, f"a token named {name} exists")
            self._x(
                c,
                "INSERT INTO tokens (name, role, jobs, prefixes, expires, created, digest) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (name, role, json.dumps(jobs), json.dumps(prefixes),
                 now + expires_s if expires_s else 0.0, now, token_digest(secret)),
            )  # fmt: skip
            self._bump_tokens(c)
        return secret

    @retried
    def revoke_token(self, name: str) -> None:
        with self._tx() as c:
            if self._x(c, "DELETE FROM tokens WHERE name = ?", (name,)).rowcount != 1:
                raise MetaError(errno.ENOENT, f"no token named {name}")
            self._bump_tokens(c)

    def list_tokens(self) -> list[TokenRecord]:
        with self._read() as c:
            rows = self._x(
                c,
                "SELECT name, role, jobs, prefixes, expires, created, digest FROM tokens "
                "ORDER BY name",
            ).fetchall()
        return [
            TokenRecord(r[0], r[1], tuple(json.loads(r[2])), tuple(json.loads(r[3])),
                        float(r[4]), float(r[5]), bytes(r[6]))
            for r in rows
        ]  # fmt: skip

    def token_generation(self) -> int:
        """Moves at every create and revoke (a service reloads the tokens when it does)."""
        with self._read() as c:
            row = self._one(c, "SELECT gen FROM token_state WHERE id = 0")
        return int(row[0]) if row else 0

    def _bump_tokens(self, c: Any) -> None:
        self._x(
            c,
            "INSERT INTO token_state (id, gen) VALUES (0, 1) "
            "ON CONFLICT (id) DO UPDATE SET gen = token_state.gen + 1",
        )
