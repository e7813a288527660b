"""The namespace in SQL (names, inodes, attributes, xattrs), mixed into SqlEngine.

Every method is one transaction on the engine's connection (`_tx`), or one read
(`_read`); directory entries are unique per (parent, name) by a table constraint.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections import Counter
from typing import Any

from metadata.ckptformat import pack_extents, unpack_extents
from metadata.engine import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    Attr,
    DirEntry,
    Extent,
    MetaError,
    check_blob,
    check_name,
    check_u32,
)
from metadata.sql.needs import SqlCore
from metadata.sql.txlocks import RENAME_LOCK, retried

ATTR_COLS = "ino, mode, nlink, uid, gid, size, atime, mtime, ctime, rdev, generation, alloc"
_LOOKUP_SQL = (
    f"SELECT {', '.join('i.' + k.strip() for k in ATTR_COLS.split(','))} "
    "FROM dentries d JOIN inodes i ON i.ino = d.ino WHERE d.parent = ? AND d.name = ?"
)
XATTR_MAX = 64 * 1024
NAME_MAX_XATTR = 255

# What create makes: the node types of mknod(2), plus directories and symlinks. FIFOs,
# sockets and device nodes hold no data here: the kernel serves them (a pipe, a socket,
# the device's driver) and only asks the mount for their attributes.
_KINDS = frozenset(
    [stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR,
     stat.S_IFBLK]
)  # fmt: skip


def _now() -> int:
    return time.time_ns()


def attr_of(row: Any) -> Attr:
    return Attr(*row)


class NamespaceMixin(SqlCore):
    """Needs SqlEngine's `_tx`, `_read`, `_x`, `_one`, `_getattr`, `_blob`, `_alloc_one_ino`
    and the chunk accounting (`_adjust_refs`, `_release_extents`)."""

    def _lookup(self, c: Any, parent: int, name: bytes) -> Attr:
        row = self._one(c, _LOOKUP_SQL, (parent, name))
        if row is None:
            raise MetaError(errno.ENOENT, f"{os.fsdecode(name)!r} not found")
        return attr_of(row)

    def _dir(self, c: Any, ino: int) -> Attr:
        """A directory that still has a name. A removed one kept for a mount (`_drop_dir`)
        is ENOENT, as Linux answers for a dead directory: another mount's kernel does not
        know it is gone, and an entry made in it would be lost with it."""
        a = self._getattr(c, ino)
        if not a.is_dir:
            raise MetaError(errno.ENOTDIR, f"inode {ino} is not a directory")
        if a.nlink <= 0:
            raise MetaError(errno.ENOENT, f"directory {ino} was removed")
        return a

    def _touch_dir(self, c: Any, ino: int, nlink_delta: int = 0) -> None:
        now = _now()
        self._x(
            c,
            "UPDATE inodes SET mtime = ?, ctime = ?, nlink = nlink + ? WHERE ino = ?",
            (now, now, nlink_delta, ino),
        )

    def _drop_inode_if_orphan(self, c: Any, ino: int, open_inodes: bool = False) -> None:
        row = self._one(c, "SELECT nlink, mode FROM inodes WHERE ino = ?", (ino,))
        if row is None or row[0] > 0:
            return
        self._release_extents(c, ino)
        self._x(c, "DELETE FROM xattrs WHERE ino = ?", (ino,))
        self._x(c, "DELETE FROM inodes WHERE ino = ?", (ino,))

    # -- namespace -----------------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> Attr:
        check_name(name)
        with self._read() as c:
            return self._lookup(c, parent, name)

    def getattr(self, ino: int) -> Attr:
        with self._read() as c:
            return self._getattr(c, ino)

    @retried
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
        check_name(name)
        check_u32(mode, "mode")
        check_u32(uid, "uid")
        check_u32(gid, "gid")
        check_blob(target, "symlink target")
        kind = stat.S_IFMT(mode)
        if kind not in _KINDS:
            raise MetaError(errno.EINVAL, f"file type {kind:#o} is not one a file can have")
        if kind not in (stat.S_IFCHR, stat.S_IFBLK):
            rdev = 0  # only a device node has a device number
        elif not isinstance(rdev, int) or not 0 <= rdev < 2**63:
            raise MetaError(errno.EINVAL, "device number out of range")
        if kind == stat.S_IFLNK and not target:
            raise MetaError(errno.EINVAL, "symlink needs a target")
        if len(target) > 4096:
            raise MetaError(errno.ENAMETOOLONG, "symlink target longer than 4096 bytes")
        with self._tx() as c:
            self._lock_inodes(c, (parent,))
            d = self._dir(c, parent)
            ino = self._alloc_one_ino(c)
            entry = self._x(
                c,
                "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?) "
                "ON CONFLICT (parent, name) DO NOTHING",
                (parent, name, ino),
            )
            if entry.rowcount != 1:  # the name is taken (one statement less than asking)
                raise MetaError(errno.EEXIST, f"{name!r} exists")
            if setgid_inherit and d.mode & stat.S_ISGID:
                gid = d.gid
                if kind == stat.S_IFDIR:
                    mode |= stat.S_ISGID
            now = _now()
            nlink = 2 if kind == stat.S_IFDIR else 1
            size = len(target) if kind == stat.S_IFLNK else 0
            row = (ino, mode, nlink, uid, gid, size, now, now, now, rdev, 0,
                   0 if kind == stat.S_IFREG else -1)  # fmt: skip
            self._x(
                c,
                "INSERT INTO inodes (ino, mode, nlink, uid, gid, size, atime, mtime, ctime, "
                "rdev, generation, alloc, target) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (*row, target),
            )
            self._touch_dir(c, parent, 1 if kind == stat.S_IFDIR else 0)
            return Attr(*row)  # what the row holds: no need to read it back

    @retried
    def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        check_name(new_name)
        with self._tx() as c:
            self._lock_inodes(c, (new_parent,))  # the directory, then the file
            self._lock_inodes(c, (ino,))
            a = self._getattr(c, ino)
            if a.is_dir:
                raise MetaError(errno.EPERM, "hard links to directories are not allowed")
            if a.nlink == 0:
                raise MetaError(errno.ENOENT, "cannot link an unlinked inode")
            self._dir(c, new_parent)
            entry = self._x(
                c,
                "INSERT INTO dentries (parent, name, ino) VALUES (?,?,?) "
                "ON CONFLICT (parent, name) DO NOTHING",
                (new_parent, new_name, ino),
            )
            if entry.rowcount != 1:
                raise MetaError(errno.EEXIST, f"{new_name!r} exists")
            self._x(
                c, "UPDATE inodes SET nlink = nlink + 1, ctime = ? WHERE ino = ?", (_now(), ino)
            )
            self._touch_dir(c, new_parent)
            return self._getattr(c, ino)

    @retried
    def unlink(self, parent: int, name: bytes) -> Attr:
        check_name(name)
        with self._tx() as c:
            self._lock_inodes(c, (parent,))  # the directory, then the entry's inode
            a = self._lookup(c, parent, name)
            self._lock_inodes(c, (a.ino,))
            if a.is_dir:
                raise MetaError(errno.EISDIR, f"{name!r} is a directory")
            self._x(c, "DELETE FROM dentries WHERE parent = ? AND name = ?", (parent, name))
            self._x(
                c, "UPDATE inodes SET nlink = nlink - 1, ctime = ? WHERE ino = ?", (_now(), a.ino)
            )
            self._touch_dir(c, parent)
            return self._getattr(c, a.ino)

    @retried
    def rmdir(self, parent: int, name: bytes, *, keep: bool = False) -> Attr:
        check_name(name)
        with self._tx() as c:
            self._lock_inodes(c, (parent,))  # the directory, then the one removed from it
            a = self._lookup(c, parent, name)
            self._lock_inodes(c, (a.ino,))  # no entry is made in it from now on
            if not a.is_dir:
                raise MetaError(errno.ENOTDIR, f"{name!r} is not a directory")
            if self._one(c, "SELECT 1 FROM dentries WHERE parent = ? LIMIT 1", (a.ino,)):
                raise MetaError(errno.ENOTEMPTY, f"{name!r} is not empty")
            self._x(c, "DELETE FROM dentries WHERE parent = ? AND name = ?", (parent, name))
            self._touch_dir(c, parent, -1)
            return self._drop_dir(c, a.ino, keep)

    def _drop_dir(self, c: Any, ino: int, keep: bool) -> Attr:
        """A directory's last name went: delete it, or (keep) leave it as an orphan with
        no links, for the mount to delete at the kernel's FORGET (`forget_orphan`): a
        process sitting in it, or holding it open, may still fstat it, as on ext4."""
        self._x(c, "UPDATE inodes SET nlink = 0, size = 0, ctime = ? WHERE ino = ?", (_now(), ino))
        a = self._getattr(c, ino)
        if not keep:
            self._drop_inode_if_orphan(c, ino)
        return a

    def _is_ancestor(self, c: Any, anc: int, ino: int) -> bool:
        """Is `anc` the directory `ino` or one of its ancestors?"""
        seen = 0
        while True:
            if ino == anc:
                return True
            if ino == ROOT_INO:
                return False
            row = self._one(c, "SELECT parent FROM dentries WHERE ino = ? LIMIT 1", (ino,))
            if row is None:
                return False
            ino = row[0]
            seen += 1
            if seen > 100_000:
                raise MetaError(errno.ELOOP, "directory tree loop")

    @retried
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
        check_name(name)
        check_name(new_name)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise MetaError(errno.EINVAL, f"unsupported rename flags {flags:#x}")
        moves_dirs = parent != new_parent  # ... and what moves is a directory: see below
        with self._tx() as c:
            src = self._lookup(c, parent, name)
            if moves_dirs and (src.is_dir or flags & RENAME_EXCHANGE):
                # One directory changes parents at a time, so the ancestry check below
                # sees a tree no other transaction is rearranging: no cycle can form.
                self._lock_named(c, RENAME_LOCK)
            self._lock_inodes(c, (parent, new_parent))  # both directories, then the inodes
            src = self._lookup(c, parent, name)  # again: it may have changed before the lock
            if moves_dirs and src.is_dir:
                self._lock_named(c, RENAME_LOCK)  # held already unless src just changed
            self._dir(c, new_parent)
            try:
                dst: Attr | None = self._lookup(c, new_parent, new_name)
            except MetaError:
                dst = None
            self._lock_inodes(c, (src.ino,) if dst is None else (src.ino, dst.ino))
            if src.is_dir and self._is_ancestor(c, src.ino, new_parent):
                raise MetaError(errno.EINVAL, "cannot move a directory into itself")
            if flags & RENAME_EXCHANGE:
                if dst is None:
                    raise MetaError(errno.ENOENT, f"{os.fsdecode(new_name)!r} not found")
                if dst.is_dir and self._is_ancestor(c, dst.ino, parent):
                    raise MetaError(errno.EINVAL, "cannot move a directory into itself")
                self._x(
                    c,
                    "UPDATE dentries SET ino = ? WHERE parent = ? AND name = ?",
                    (dst.ino, parent, name),
                )
                self._x(
                    c,
                    "UPDATE dentries SET ino = ? WHERE parent = ? AND name = ?",
                    (src.ino, new_parent, new_name),
                )
                # both inodes changed names: their ctime moves, as a rename's source does
                now = _now()
                self._x(
                    c, "UPDATE inodes SET ctime = ? WHERE ino IN (?, ?)", (now, src.ino, dst.ino)
                )
                if src.is_dir != dst.is_dir and parent != new_parent:
                    d = 1 if src.is_dir else -1
                    self._touch_dir(c, parent, -d)
                    self._touch_dir(c, new_parent, d)
                else:
                    self._touch_dir(c, parent)
                    self._touch_dir(c, new_parent)
                return None
            if dst is not None:
                if flags & RENAME_NOREPLACE:
                    raise MetaError(errno.EEXIST, f"{new_name!r} exists")
                if dst.ino == src.ino:
                    return None  # POSIX: renaming a name onto a link of the same inode does nothing
                if src.is_dir and not dst.is_dir:
                    raise MetaError(errno.ENOTDIR, f"{new_name!r} is not a directory")
                if dst.is_dir and not src.is_dir:
                    raise MetaError(errno.EISDIR, f"{new_name!r} is a directory")
                if dst.is_dir:
                    if self._one(c, "SELECT 1 FROM dentries WHERE parent = ? LIMIT 1", (dst.ino,)):
                        raise MetaError(errno.ENOTEMPTY, f"{new_name!r} is not empty")
                self._x(
                    c, "DELETE FROM dentries WHERE parent = ? AND name = ?", (new_parent, new_name)
                )
                if dst.is_dir:
                    dst = self._drop_dir(c, dst.ino, keep)
                    self._touch_dir(c, new_parent, -1)
                else:
                    self._x(
                        c,
                        "UPDATE inodes SET nlink = nlink - 1, ctime = ? WHERE ino = ?",
                        (_now(), dst.ino),
                    )
            self._x(
                c,
                "UPDATE dentries SET parent = ?, name = ? WHERE parent = ? AND name = ?",
                (new_parent, new_name, parent, name),
            )
            self._x(c, "UPDATE inodes SET ctime = ? WHERE ino = ?", (_now(), src.ino))
            if src.is_dir and parent != new_parent:
                self._touch_dir(c, parent, -1)
                self._touch_dir(c, new_parent, 1)
            else:
                self._touch_dir(c, parent)
                if new_parent != parent:
                    self._touch_dir(c, new_parent)
            if dst is not None and not dst.is_dir:
                return self._getattr(c, dst.ino)
            return dst if dst is not None and keep else None

    def readdir(self, ino: int, offset: int, limit: int = 1000) -> list[DirEntry]:
        cols = ", ".join("i." + k.strip() for k in ATTR_COLS.split(","))
        with self._read() as c:
            self._dir(c, ino)
            rows = self._x(
                c,
                f"SELECT d.id, d.name, {cols} FROM dentries d JOIN inodes i ON i.ino = d.ino "
                "WHERE d.parent = ? AND d.id > ? ORDER BY d.id LIMIT ?",
                (ino, offset, limit),
            ).fetchall()
        return [DirEntry(bytes(r[1]), attr_of(r[2:]), r[0]) for r in rows]

    @retried
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
        for v, what in ((mode, "mode"), (uid, "uid"), (gid, "gid"), (clear_mode, "clear_mode")):
            if v is not None:
                check_u32(v, what)
        for t in (atime_ns, mtime_ns, size):
            if t is not None and type(t) is not int:
                raise MetaError(errno.EINVAL, f"times and sizes are integers, not {t!r:.40}")
        for t in (atime_ns, mtime_ns):
            if t is not None and not -(2**63) <= t < 2**63:  # years 1677-2262
                raise MetaError(errno.EOVERFLOW, "time out of the range a volume keeps")
        with self._tx() as c:
            self._lock_inodes(c, (ino,))
            a = self._getattr(c, ino)
            now = _now()
            if mode is not None:
                a.mode = stat.S_IFMT(a.mode) | (mode & 0o7777)
            a.mode &= ~(clear_mode & 0o7777)
            if uid is not None:
                a.uid = uid
            if gid is not None:
                a.gid = gid
            if atime_ns is not None:
                a.atime_ns = atime_ns
            if mtime_ns is not None:
                a.mtime_ns = mtime_ns
            if size is not None:
                if not a.is_reg:
                    raise MetaError(
                        errno.EISDIR if a.is_dir else errno.EINVAL, "not a regular file"
                    )
                if size < 0:
                    raise MetaError(errno.EINVAL, f"negative size {size}")
                if size != a.size:
                    if size < a.size:
                        a.alloc = self._trim_extents(c, ino, size)
                    a.size = size
                    a.generation += 1
                if mtime_ns is None:  # a truncate marks mtime even at the same size (Linux)
                    a.mtime_ns = now
            a.ctime_ns = now
            self._x(
                c,
                "UPDATE inodes SET mode=?, uid=?, gid=?, size=?, atime=?, mtime=?, ctime=?, "
                "generation=? WHERE ino=?",
                (
                    a.mode,
                    a.uid,
                    a.gid,
                    a.size,
                    a.atime_ns,
                    a.mtime_ns,
                    a.ctime_ns,
                    a.generation,
                    ino,
                ),
            )
            return a

    def _trim_extents(self, c: Any, ino: int, size: int) -> int:
        """Cut a file's extents at `size`; the bytes they still cover."""
        keep: list[Extent] = []
        delta: Counter[bytes] = Counter()
        for e in unpack_extents(self._blob(c, ino)):
            if e.offset + e.length <= size:
                keep.append(e)
            elif e.offset < size:
                keep.append(Extent(e.offset, size - e.offset, e.chunk_id, e.chunk_off))
            else:
                delta[e.chunk_id] -= 1
        alloc = sum(e.length for e in keep)
        self._x(
            c,
            "UPDATE inodes SET extents = ?, alloc = ? WHERE ino = ?",
            (pack_extents(keep), alloc, ino),
        )
        self._adjust_refs(c, dict(delta))
        return alloc

    def parent(self, ino: int) -> int:
        if ino == ROOT_INO:
            return ROOT_INO
        with self._read() as c:
            row = self._one(c, "SELECT parent FROM dentries WHERE ino = ? LIMIT 1", (ino,))
        if row is None:
            raise MetaError(errno.ENOENT, f"inode {ino} has no name")
        return int(row[0])

    def readlink(self, ino: int) -> bytes:
        with self._read() as c:
            row = self._one(c, "SELECT mode, target FROM inodes WHERE ino = ?", (ino,))
        if row is None:
            raise MetaError(errno.ENOENT, f"no inode {ino}")
        if not stat.S_ISLNK(row[0]):
            raise MetaError(errno.EINVAL, "not a symlink")
        return bytes(row[1])

    @retried
    def forget_orphan(self, ino: int) -> None:
        with self._tx() as c:
            self._lock_inodes(c, (ino,))
            self._drop_inode_if_orphan(c, ino)

    @retried
    def purge_orphans(self) -> int:
        with self._tx() as c:
            inos = [r[0] for r in self._x(c, "SELECT ino FROM inodes WHERE nlink <= 0").fetchall()]
            self._lock_inodes(c, inos)  # _drop_inode_if_orphan reads each one again
            for ino in inos:
                self._drop_inode_if_orphan(c, ino)
        return len(inos)

    # -- xattrs --------------------------------------------------------------
    def get_xattr(self, ino: int, name: bytes) -> bytes:
        with self._read() as c:
            row = self._one(c, "SELECT value FROM xattrs WHERE ino = ? AND name = ?", (ino, name))
        if row is None:
            raise MetaError(errno.ENODATA, f"no attribute {name!r}")
        return bytes(row[0])

    @retried
    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        check_blob(name, "attribute name")
        check_blob(value, "attribute value")
        if not name or len(name) > NAME_MAX_XATTR or b"\0" in name:
            raise MetaError(errno.ERANGE, f"bad attribute name {name[:40]!r}")
        if len(value) > XATTR_MAX:
            raise MetaError(errno.E2BIG, f"attribute value over {XATTR_MAX} bytes")
        with self._tx() as c:
            self._lock_inodes(c, (ino,))  # not deleted meanwhile (its xattrs go with it)
            self._getattr(c, ino)
            self._x(
                c,
                "INSERT INTO xattrs (ino, name, value) VALUES (?,?,?) "
                "ON CONFLICT (ino, name) DO UPDATE SET value = excluded.value",
                (ino, name, value),
            )
            self._x(c, "UPDATE inodes SET ctime = ? WHERE ino = ?", (_now(), ino))

    def list_xattr(self, ino: int) -> list[bytes]:
        with self._read() as c:
            rows = self._x(c, "SELECT name FROM xattrs WHERE ino = ? ORDER BY name", (ino,))
            return [bytes(r[0]) for r in rows.fetchall()]

    @retried
    def remove_xattr(self, ino: int, name: bytes) -> None:
        with self._tx() as c:
            self._lock_inodes(c, (ino,))
            cur = self._x(c, "DELETE FROM xattrs WHERE ino = ? AND name = ?", (ino, name))
            if cur.rowcount == 0:
                raise MetaError(errno.ENODATA, f"no attribute {name!r}")
            self._x(c, "UPDATE inodes SET ctime = ? WHERE ino = ?", (_now(), ino))
