"""The FUSE filesystem: pyfuse3 Operations over a Volume, on trio.

Namespace requests become one metadata call each, run in a worker thread
(nothing blocks the trio loop); file data goes through fusefs.mount.filecache.
A file's new content becomes visible to other mounts when it is closed or
fsync'd, in one commit (close-to-open consistency). Every handler maps
errors to an errno: MetaError and FileError carry one, anything unexpected
is logged and answered with EIO, so bad input never takes the daemon down.

Metadata caching (fusefs.mount.metacache): the kernel keeps entries, attributes and
negative entries for a minute, the daemon keeps attributes and names, and the
metadata's change log invalidates both within a second of a change made by anyone
else. A file's page cache is kept across opens while its content generation (bumped by
each extent commit) is the one whose pages the kernel holds, and dropped, with its
cached attributes, when another writer changed it (an open asks the metadata itself).

Write-only opens (torch.save, cp, tar, rsync, dd of=) use direct I/O: the kernel
hands the writer's pages to the daemon without copying them into its page cache,
and, above all, skips the "security.capability" getxattr round trip that a
cached write costs on every write() (file_remove_privs; the kernel only stops
asking with FUSE_HANDLE_KILLPRIV_V2, which libfuse 3.14 cannot negotiate). Pages
cached by other opens of such a file are not updated by those writes, so the next
open after them drops the file's page cache.

The kernel write-back cache (FUSE_WRITEBACK_CACHE) stays off: measured here it
did not speed up 1 MiB sequential writes (the getxattr per write() remains, and
fsync waits for the daemon anyway), and with it the kernel ignores the file size
the daemon reports for a cached inode, so a file rewritten through another
mount would keep its stale size (close-to-open consistency across mounts).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyfuse3
import trio

from chunkstore.store import ChunkStoreError
from fusefs.client.volume import Volume
from fusefs.maint.backup import run_auto_backups
from fusefs.mount.blocks import FileError, FileState
from fusefs.mount.filecache import FileCache
from fusefs.mount.metacache import MetaCache
from fusefs.mount.tuning import (
    mount_options,
    tune_background,
    tune_malloc,
    tune_readahead,
)
from metadata.engine import NAME_MAX, STAGED, Attr, MetaBusy, MetaError
from metadata.periodic import run_periodic

log = logging.getLogger("ckptfs.mount")

DOTS = 2  # readdir cookies 1 and 2 are "." and ".."
BLKSIZE = 1 << 20  # st_blksize: stdio, cp and dd pick their buffer size from it
CONTROL_FLUSH = b"user.ckptfs.flush"  # setxattr on the root: drain the write-behind tier
INFO_PREFIX = b"user.ckptfs."
INFO_NAMES = (b"chunks", b"stored_bytes", b"dedup", b"durability")
_PRIV_BITS = stat.S_ISUID | stat.S_ISGID  # what a write by another user may clear


def handler(fn: Callable) -> Callable:
    """Errors become errnos; the daemon never dies of a request. Each request and each
    error answer is counted by operation (CkptFS.op_counts / op_errors, for metrics: a
    dict add on the loop thread, no lock)."""
    op = fn.__name__

    @functools.wraps(fn)
    async def wrapped(self, *args, **kw):
        counts = self.op_counts
        counts[op] = counts.get(op, 0) + 1
        try:
            return await fn(self, *args, **kw)
        except pyfuse3.FUSEError:
            errs = self.op_errors
            errs[op] = errs.get(op, 0) + 1
            raise
        except Exception as e:  # trio.Cancelled and KeyboardInterrupt go through
            errs = self.op_errors
            errs[op] = errs.get(op, 0) + 1
            raise _fuse_error(op, e) from None

    return wrapped


def _fuse_error(op: str, e: Exception) -> pyfuse3.FUSEError:
    """The errno answer of a request that failed with `e` (logged when unexpected)."""
    if isinstance(e, MetaError | FileError):
        return pyfuse3.FUSEError(e.errno)
    if isinstance(e, ChunkStoreError):
        log.error("%s: %s", op, e)
        return pyfuse3.FUSEError(errno.EIO)
    if isinstance(e, OSError):
        log.error("%s: %s", op, e)
        return pyfuse3.FUSEError(e.errno or errno.EIO)
    log.error("%s failed", op, exc_info=e)
    return pyfuse3.FUSEError(errno.EIO)


@dataclass
class Handle:
    st: FileState
    flags: int
    # The opener's groups when it lacks CAP_FSETID (not root), else None: its writes
    # clear the file's setuid/setgid bits (`_kill_privs`).
    groups: frozenset[int] | None = None


class CkptFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, vol: Volume, mountpoint: str) -> None:
        super().__init__()
        self.vol = vol
        self.mountpoint = mountpoint
        self.local = vol.meta.loop_engine()
        self.cache: FileCache | None = None
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self.orphans: set[int] = set()  # nlink 0, still known to the kernel or open
        self.direct_written: set[int] = set()  # written past the page cache since last open
        self.lookups: dict[int, int] = {}  # the kernel's lookup count per inode
        self.mc = MetaCache(self.lookups)  # names and attributes, kept by the change feed
        self.page_gen: dict[int, int] = {}  # generation whose pages the kernel may hold
        self._statfs: tuple[float, tuple[int, int]] | None = None
        self.requests = 0
        # Counters for fusefs.metrics, bumped on the loop thread: requests and error
        # answers by operation (`handler`), and the bytes read and written through FUSE.
        self.op_counts: dict[str, int] = {}
        self.op_errors: dict[str, int] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.agent: Any = None  # the host agent this mount serves (`mount --agent`), if any

    # -- plumbing ------------------------------------------------------------------
    async def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until unmounted or signalled; then publish what is still dirty."""
        try:
            async with trio.open_nursery() as bg:
                self.cache = FileCache(self.vol, bg, local=self.local)
                async with trio.open_nursery() as n:
                    n.start_soon(self._signals)
                    n.start_soon(self._probe, on_ready)
                    n.start_soon(self.mc.run, self.meta, self.vol.meta)
                    every = self.vol.meta.housekeeping_interval
                    if every is not None:  # logged, counted and retried if it raises
                        n.start_soon(
                            functools.partial(
                                run_periodic, "housekeeping", self._housekeeping, every, log=log
                            )
                        )
                    if self.vol.base_dir is not None:  # a volume directory: no service
                        n.start_soon(run_auto_backups, self.vol)  # backs its metadata up (0: off)
                    if self.agent is not None:  # this host's ranks' client (fusefs/agent)
                        n.start_soon(self._serve_agent)
                    await pyfuse3.main(min_tasks=4, max_tasks=64)
                    n.cancel_scope.cancel()
                await self.cache.shutdown()
                await self.reap_all()
                bg.cancel_scope.cancel()
        finally:
            if self.local is not None:
                self.local.close()

    async def _serve_agent(self) -> None:
        """The host agent on this mount's volume (`mount --agent`): a socket taken by
        another agent is said once and the mount goes on without serving ranks."""
        from fusefs.agent.server import AgentError

        try:
            await self.agent.serve()
        except AgentError as e:
            log.warning("not serving this host's ranks: %s", e)

    async def _housekeeping(self) -> None:
        """The engine's periodic upkeep (MetaEngine.housekeeping), from a worker: a step
        of run_periodic, every housekeeping_interval seconds."""
        await self.meta(self.vol.meta.housekeeping)

    async def _signals(self) -> None:
        import signal

        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
            async for sig in sigs:
                log.info("signal %d: unmounting", sig)
                pyfuse3.terminate()
                return

    async def _probe(self, on_ready: Callable[[], None] | None) -> None:
        """The mount answers once a stat through it returns (the kernel sent INIT)."""
        st = await trio.to_thread.run_sync(os.stat, self.mountpoint)
        # Not a second stat here: on this (the serving) thread, a stat whose cached
        # attributes have expired waits for a GETATTR that only this thread can answer.
        await trio.to_thread.run_sync(tune_readahead, st.st_dev)
        await trio.to_thread.run_sync(tune_background, st.st_dev)
        if on_ready is not None:
            on_ready()

    async def meta(self, fn, *args, **kw):
        assert self.cache is not None
        return await self.cache.meta(fn, *args, **kw)

    async def _getattr(self, ino: int, *, fresh: bool = False) -> Attr:
        """An inode's attributes: the daemon's cache, else the metadata (fresh=True: the
        metadata always, as an open needs for close-to-open)."""
        if not fresh:
            a = self.mc.attr(ino)
            if a is not None:
                return a
        gen = self.mc.gen
        a = await self._local_call("getattr", ino)
        self.mc.put_attr(a, gen)
        return a

    async def _lookup(self, parent: int, name: bytes) -> Attr:
        """What a name holds: the daemon's cache (ENOENT for a name cached as absent),
        else the metadata, whose answer is cached."""
        ino = self.mc.name(parent, name)
        if ino == 0:
            raise MetaError(errno.ENOENT, "no such entry (cached)")
        if ino is not None:
            a = self.mc.attr(ino)
            if a is not None:
                return a
        gen = self.mc.gen
        try:
            a = await self._local_call("lookup", parent, name)
        except MetaError as e:
            if e.errno == errno.ENOENT:
                self.mc.put_name(parent, name, 0, gen)
            raise
        self.mc.put_name(parent, name, a.ino, gen)
        self.mc.put_attr(a, gen)
        return a

    async def _local_call(self, method: str, *args: Any, **kw: Any) -> Any:
        """A short metadata call, run right here when the engine has a loop engine
        (MetaEngine.loop_engine: a local SQLite file).

        A lookup or getattr is a ~20 us query and a create ~150 us, and each round trip
        through a worker thread cost the loop ~150 us of CPU more (and the request ~0.8 ms):
        creating a small file (lookup, create, getattr, write, flush, release) spent half
        its daemon CPU on such trips. S3QL runs all its metadata queries on the loop.
        These run on a connection of their own that never waits, checkpoints or applies
        the reference journal: where it would (a worker holds the write lock, WAL recovery
        after a crash, a pending journal) the call fails at once with MetaBusy, nothing
        done, and goes to a worker as before. Reads see every
        committed write (WAL); the calls allowed here are only those that touch a few rows."""
        if self.local is not None:
            try:
                return getattr(self.local, method)(*args, **kw)
            except MetaBusy as e:
                log.debug("inline %s%r: %s; via a worker", method, args, e)
        return await self.meta(getattr(self.vol.meta, method), *args, **kw)

    def _view(self, a: Attr) -> Attr:
        """The engine's attributes, with the size, mtime and ctime of unflushed writes."""
        st = self.cache.states.get(a.ino) if self.cache else None
        if st is None or not st.dirty:
            return a
        v = Attr(**a.__dict__)
        v.size, v.mtime_ns = st.size, st.mtime_ns
        if v.alloc >= 0:  # unflushed writes count as stored (at most the size)
            v.alloc = min(st.size, st.allocated())
        v.ctime_ns = max(v.ctime_ns, st.mtime_ns)  # a write changes ctime too
        return v

    def _ref(self, a: Attr, gen: int | None = None) -> pyfuse3.EntryAttributes:
        """An entry reply: the kernel now holds one more lookup of the inode."""
        self.lookups[a.ino] = self.lookups.get(a.ino, 0) + 1
        return self._entry(a, gen)

    def _entry(self, a: Attr, gen: int | None = None) -> pyfuse3.EntryAttributes:
        """Entry and attribute reply. `gen`: the cache's invalidation count when the read
        behind it began (None: attributes a change made here returned, current)."""
        a = self._view(a)
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = e.attr_timeout = self.mc.timeout(gen)
        e.st_mode = a.mode
        e.st_nlink = a.nlink
        e.st_uid = a.uid
        e.st_gid = a.gid
        e.st_rdev = a.rdev
        e.st_size = a.size
        e.st_blksize = BLKSIZE
        e.st_blocks = a.blocks
        e.st_atime_ns = a.atime_ns
        e.st_mtime_ns = a.mtime_ns
        e.st_ctime_ns = a.ctime_ns
        return e

    async def _make(self, parent_inode: int, name: bytes, mode: int, ctx, **kw) -> Attr:
        """Create an inode owned by the caller, with BSD group semantics under a setgid
        directory (the engine applies them in the creating transaction)."""
        a = await self._local_call(
            "create", parent_inode, name, mode, ctx.uid, ctx.gid, setgid_inherit=True, **kw
        )
        self._named(parent_inode, name, a)
        return a

    def _named(self, parent: int, name: bytes, a: Attr) -> None:
        """A name made here: cached, and its directory's attributes (times, links) dropped."""
        self.mc.put_name(parent, name, a.ino)
        self.mc.put_attr(a)
        self.mc.drop_attr(parent)

    def _unnamed(self, parent: int, name: bytes) -> None:
        """A name removed here (or replaced): forgotten, with its directory's attributes."""
        self.mc.drop_name(parent, name)
        self.mc.drop_attr(parent)

    def _negative(self, gen: int) -> pyfuse3.EntryAttributes:
        """A lookup of a name that does not exist: an entry of inode 0, which the kernel
        keeps as a negative entry for its timeout (no FORGET follows)."""
        e = pyfuse3.EntryAttributes()
        e.st_ino = 0
        e.entry_timeout = self.mc.negative_timeout(gen)
        if not e.entry_timeout:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return e

    # -- namespace -------------------------------------------------------------
    @handler
    async def lookup(self, parent_inode, name, ctx=None):
        gen = self.mc.gen
        if name == b".":
            return self._ref(await self._getattr(parent_inode), gen)
        if len(name) > NAME_MAX:
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        try:
            a = await self._lookup(parent_inode, name)
        except MetaError as e:
            if e.errno != errno.ENOENT:
                raise
            return self._negative(gen)
        return self._ref(a, gen)

    @handler
    async def getattr(self, inode, ctx=None):
        gen = self.mc.gen
        return self._entry(await self._getattr(inode), gen)

    @handler
    async def setattr(self, inode, attr, fields, fh, ctx):
        cur = await self._getattr(inode)
        kw: dict = {}
        if fields.update_mode:
            old, new = cur.mode & 0o7777, attr.st_mode & 0o7777
            # A non-owner may only lose setuid/setgid: the kernel sends that for its write
            # or truncate (keeping a setgid bit without group-execute).
            if ctx.uid not in (0, cur.uid) and (new & ~old or (old ^ new) & ~_PRIV_BITS):
                raise pyfuse3.FUSEError(errno.EPERM)
            kw["mode"] = attr.st_mode
        if fields.update_uid and attr.st_uid != cur.uid:
            if ctx.uid != 0:
                raise pyfuse3.FUSEError(errno.EPERM)
            kw["uid"] = attr.st_uid
        if fields.update_gid and attr.st_gid != cur.gid:
            if ctx.uid != 0 and (ctx.uid != cur.uid or attr.st_gid not in _groups(ctx)):
                raise pyfuse3.FUSEError(errno.EPERM)
            kw["gid"] = attr.st_gid
        if fields.update_atime:
            kw["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            kw["mtime_ns"] = attr.st_mtime_ns
        st = self.cache.states.get(inode)
        if fields.update_size:
            if not cur.is_reg:
                raise pyfuse3.FUSEError(errno.EISDIR if cur.is_dir else errno.EINVAL)
            kw["size"] = attr.st_size
        if not cur.is_dir and (fields.update_size or fields.update_uid or fields.update_gid):
            # A truncate or chown by a process without CAP_FSETID clears setuid/setgid as
            # a write does. FUSE leaves to the filesystem the setgid bit without
            # group-execute of a file whose group the caller is not in.
            groups = self._opener(cur, ctx)
            if groups is not None:
                kw["clear_mode"] = self._kill_bits(kw.get("mode", cur.mode), cur.gid, groups)
        if st is not None and (fields.update_size or fields.update_mtime):
            await self.cache.commit(st)  # unflushed writes land first, then the change
        if fields.update_size:  # may drop chunk references: not on the loop
            new = await self.meta(lambda: self.vol.meta.setattr(inode, **kw))
        else:
            new = await self._local_call("setattr", inode, **kw)
        if st is not None:
            if fields.update_size:
                st.truncated(new.size)
            st.attr = new
        if fields.update_size:
            self.page_gen[inode] = new.generation
        self.mc.put_attr(new)
        return self._entry(new)

    @handler
    async def readlink(self, inode, ctx):
        return await self.meta(self.vol.meta.readlink, inode)

    @handler
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if stat.S_IFMT(mode) in (stat.S_IFCHR, stat.S_IFBLK) and ctx.uid != 0:
            raise pyfuse3.FUSEError(errno.EPERM)  # the kernel checks CAP_MKNOD too
        return self._ref(await self._make(parent_inode, name, mode, ctx, rdev=rdev))

    @handler
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._ref(await self._make(parent_inode, name, stat.S_IFDIR | (mode & 0o7777), ctx))

    @handler
    async def symlink(self, parent_inode, name, target, ctx):
        return self._ref(
            await self._make(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target=target)
        )

    @handler
    async def link(self, inode, new_parent_inode, new_name, ctx):
        a = await self._local_call("link", inode, new_parent_inode, new_name)
        self._named(new_parent_inode, new_name, a)
        return self._ref(a)

    @handler
    async def unlink(self, parent_inode, name, ctx):
        after = await self._local_call("unlink", parent_inode, name)
        self._unnamed(parent_inode, name)
        await self._maybe_orphan(after)

    @handler
    async def rmdir(self, parent_inode, name, ctx):
        after = await self._local_call("rmdir", parent_inode, name, keep=True)
        self._unnamed(parent_inode, name)
        self.mc.drop_dir(after.ino)
        await self._maybe_orphan(after)

    @handler
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        # the moved inode's ctime changes: its cached attributes go (found by name first)
        moved = self.mc.name(parent_inode_old, name_old)
        if moved is None:
            moved = (await self._local_call("lookup", parent_inode_old, name_old)).ino
        replaced = await self._local_call(
            "rename", parent_inode_old, name_old, parent_inode_new, name_new, flags, keep=True
        )
        other = self.mc.name(parent_inode_new, name_new)
        self._unnamed(parent_inode_old, name_old)
        self._unnamed(parent_inode_new, name_new)
        for ino in (moved, other):
            if ino:
                self.mc.drop_attr(ino)
        if replaced is not None:
            await self._maybe_orphan(replaced)

    async def _maybe_orphan(self, a: Attr) -> None:
        """An inode whose last name went: delete it now, or at its last close."""
        self.mc.put_attr(a)
        st = self.cache.states.get(a.ino)
        if st is not None:
            st.attr.nlink = a.nlink
        if a.nlink > 0:
            return
        self.orphans.add(a.ino)
        await self._reap(a.ino)

    async def _reap(self, ino: int) -> None:
        """Delete an orphan once no handle is open and the kernel forgot it.

        Until the kernel's FORGET, a path walk that resolved to the inode
        before it was unlinked or renamed over may still open it, as on a
        local filesystem.
        """
        if ino not in self.orphans or self.lookups.get(ino, 0) > 0:
            return
        st = self.cache.states.get(ino)
        if st is not None and st.opens > 0:
            return
        self.orphans.discard(ino)
        self.page_gen.pop(ino, None)
        self.mc.forget(ino)
        if st is not None:
            self.cache.discard(st)
            self.cache.drop_if_idle(st)
        await self.meta(self.vol.meta.forget_orphan, ino)

    async def forget(self, inode_list):
        try:
            for ino, n in inode_list:
                left = self.lookups.get(ino, 0) - n
                if left > 0:
                    self.lookups[ino] = left
                else:
                    self.lookups.pop(ino, None)
                    self.direct_written.discard(ino)  # the kernel dropped its pages with it
                    self.page_gen.pop(ino, None)  # (the map grew by every file ever opened)
                    await self._reap(ino)
        except Exception:  # forget has no reply: never let it escape
            log.exception("forget failed")

    async def reap_all(self) -> None:
        """Unmounted: the kernel holds nothing any more, so every orphan can go."""
        self.lookups.clear()
        for ino in list(self.orphans):
            try:
                await self._reap(ino)
            except Exception as e:
                log.error("orphan inode %d not deleted (purged at next mount): %s", ino, e)

    # -- directories -------------------------------------------------------------
    @handler
    async def opendir(self, inode, ctx):
        a = await self._getattr(inode)
        if not a.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @handler
    async def readdir(self, fh, start_id, token):
        """ "." and ".." first, as every Linux filesystem lists them (cookies 1 and 2; an
        entry's cookie is its engine offset + DOTS). The kernel takes no lookup of those
        two from a readdirplus reply, so they are not counted."""
        if start_id < DOTS:  # the kernel uses only their inode number and type
            dots = [(b".", fh), (b"..", await self._local_call("parent", fh))]
            for k in range(start_id, DOTS):
                name, ino = dots[k]
                attr = pyfuse3.EntryAttributes()
                attr.st_ino, attr.st_mode = ino, stat.S_IFDIR
                if not pyfuse3.readdir_reply(token, name, attr, k + 1):
                    return
        off = max(start_id - DOTS, 0)
        for _ in range(1 << 30):
            gen = self.mc.gen
            batch = await self.meta(self.vol.meta.readdir, fh, off, 512)
            if not batch:
                return
            for e in batch:
                if not pyfuse3.readdir_reply(
                    token, e.name, self._entry(e.attr, gen), e.next_offset + DOTS
                ):
                    return
                self.lookups[e.attr.ino] = self.lookups.get(e.attr.ino, 0) + 1
                self.mc.put_name(fh, e.name, e.attr.ino, gen)  # readdirplus: the kernel
                self.mc.put_attr(e.attr, gen)  # holds the entry now
            off = batch[-1].next_offset

    async def releasedir(self, fh):
        pass

    @handler
    async def fsyncdir(self, fh, datasync):
        await self.meta(self.vol.meta.sync)  # names are in the metadata: make them durable

    @handler
    async def statfs(self, ctx):
        total, free = await self._capacity()
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLKSIZE
        s.f_frsize = 4096
        s.f_blocks = total // s.f_frsize
        s.f_bfree = free // s.f_frsize
        s.f_bavail = s.f_bfree
        st = await self.meta(self.vol.meta.stats)
        s.f_files = st.inodes + (1 << 32)
        s.f_ffree = 1 << 32
        s.f_favail = s.f_ffree
        s.f_namemax = NAME_MAX
        return s

    async def _capacity(self) -> tuple[int, int]:
        """Usable bytes: distinct backing filesystems counted once, divided by R."""
        now = time.monotonic()
        if self._statfs is not None and now - self._statfs[0] < 2.0:
            return self._statfs[1]

        def probe() -> tuple[int, int]:
            seen: dict[int, int] = {}
            for n in self.vol.store.nodes:
                t, f = n.capacity()
                if t:
                    seen[t] = max(seen.get(t, 0), f)
            r = max(1, self.vol.settings.replicas)
            return sum(seen) // r, sum(seen.values()) // r

        cap = await trio.to_thread.run_sync(probe)
        self._statfs = (now, cap)
        return cap

    # -- files ---------------------------------------------------------------------
    def _new_fh(self, st: FileState, flags: int, groups: frozenset[int] | None) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(st, flags, groups)
        return fh

    @staticmethod
    def _opener(a: Attr, ctx: pyfuse3.RequestContext) -> frozenset[int] | None:
        """The groups `_kill_privs` checks a writer against; None for root (CAP_FSETID).
        Only a setgid file without group-execute needs the supplementary groups, which
        cost a read of /proc on the loop."""
        if ctx.uid == 0:
            return None
        if a.mode & (stat.S_ISGID | stat.S_IXGRP) == stat.S_ISGID:
            return frozenset(_groups(ctx))
        return frozenset([ctx.gid])

    @staticmethod
    def _kill_bits(mode: int, gid: int, groups: frozenset[int]) -> int:
        """The bits a write by a process without CAP_FSETID clears: setuid, and setgid
        when group-executable or when the writer is not in the file's group (Linux's
        should_remove_suid and, since 6.2, setattr_should_drop_sgid). The kernel leaves
        this to the filesystem here: FUSE passes no such flag to pyfuse3's write, and its
        own clearing keeps a setgid bit without group-execute."""
        kill = mode & stat.S_ISUID
        if mode & stat.S_ISGID and (mode & stat.S_IXGRP or gid not in groups):
            kill |= stat.S_ISGID
        return kill

    async def _kill_privs(self, st: FileState, groups: frozenset[int]) -> None:
        kill = self._kill_bits(st.attr.mode, st.attr.gid, groups)
        if kill:
            st.attr = await self._local_call("setattr", st.ino, clear_mode=kill)
            self.mc.put_attr(st.attr)
            await trio.to_thread.run_sync(_invalidate_attr, st.ino)

    @handler
    async def create(self, parent_inode, name, mode, flags, ctx):
        a = await self._make(parent_inode, name, stat.S_IFREG | (mode & 0o7777), ctx)
        entry = self._ref(a)
        st = await self.cache.open_state(a)
        self.page_gen[a.ino] = a.generation
        fi = pyfuse3.FileInfo(fh=self._new_fh(st, flags, self._opener(a, ctx)))
        fi.keep_cache = True
        fi.direct_io = _write_only(flags)
        return fi, entry

    @handler
    async def open(self, inode, flags, ctx):
        st = self.cache.states.get(inode)
        if st is None:
            a = await self._getattr(inode, fresh=True)  # close-to-open: never a cached copy
            if a.is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if not a.is_reg:
                raise pyfuse3.FUSEError(errno.EINVAL)
            groups = self._opener(a, ctx)
            kill = 0
            if flags & os.O_TRUNC:  # marks mtime and ctime even if already empty (POSIX)
                kill = self._kill_bits(a.mode, a.gid, groups) if groups is not None else 0
                a = await self.meta(
                    lambda: self.vol.meta.setattr(inode, size=0, clear_mode=kill)
                )  # fmt: skip
                self.mc.put_attr(a)
            keep = self.page_gen.get(inode) == a.generation
            if kill or (not keep and inode in self.page_gen):
                await trio.to_thread.run_sync(_invalidate_attr, inode)
            st = await self.cache.open_state(a)
        else:
            groups = self._opener(st.attr, ctx)
            st.opens += 1
            try:
                keep = await self._revalidate(st)
                if flags & os.O_TRUNC:
                    await self._truncate(st, 0)
                    if groups is not None:
                        await self._kill_privs(st, groups)  # a truncating open is a write
            except BaseException:
                st.opens -= 1
                raise
        direct = _write_only(flags)
        if inode in self.direct_written and not direct:
            keep = False  # direct writes bypassed the pages the kernel may hold
            self.direct_written.discard(inode)
        self.page_gen[inode] = st.attr.generation
        fi = pyfuse3.FileInfo(fh=self._new_fh(st, flags, groups))
        fi.keep_cache = keep
        fi.direct_io = direct
        return fi

    async def _revalidate(self, st: FileState) -> bool:
        """Close-to-open for an inode this mount holds open already: if another mount
        committed the file since we loaded it, load its new size and extents (unless we have
        unflushed writes of our own: then the last close wins). Returns whether the kernel's
        cached pages are still the file's. Without this, an open while another descriptor
        was held read the content from before the other mount's close."""
        if st.unflushed:
            return True
        a = await self._getattr(st.ino, fresh=True)
        if a.generation == st.attr.generation or not await self.cache.reload(st, a):
            return True
        await trio.to_thread.run_sync(_invalidate_attr, st.ino)
        return False

    async def _truncate(self, st: FileState, size: int) -> None:
        await self.cache.commit(st)
        new = await self.meta(lambda: self.vol.meta.setattr(st.ino, size=size))
        st.truncated(new.size)
        st.attr = new
        self.mc.put_attr(new)

    @handler
    async def read(self, fh, off, size):
        data = await self.cache.read(self.handles[fh].st, off, size)
        self.bytes_read += len(data)
        return data

    @handler
    async def write(self, fh, off, buf):
        h = self.handles[fh]
        if _write_only(h.flags):
            self.direct_written.add(h.st.ino)
        if h.groups is not None and h.st.attr.mode & (stat.S_ISUID | stat.S_ISGID):
            await self._kill_privs(h.st, h.groups)
        n = await self.cache.write(h.st, off, buf)
        self.bytes_written += n
        return n

    async def _commit(self, st: FileState) -> None:
        if st.attr.nlink <= 0 and st.ino in self.orphans:
            return  # nobody can open it again: its data need not be published
        before = st.attr
        await self.cache.commit(st)
        self.page_gen[st.ino] = st.attr.generation
        if st.attr is not before:  # committed: the new size, times and blocks
            self.mc.put_attr(st.attr)

    @handler
    async def flush(self, fh):
        await self._commit(self.handles[fh].st)

    @handler
    async def fsync(self, fh, datasync):
        await self._commit(self.handles[fh].st)
        # The commit survives a killed daemon; fsync promises a power cut too, for the
        # extents (and inline bytes) as the tier's fsync does for the staged chunks.
        await self.meta(self.vol.meta.sync)

    @handler
    async def release(self, fh):
        h = self.handles.pop(fh, None)
        if h is None:
            return
        st = h.st
        try:
            if st.dirty:
                await self._commit(st)
        finally:
            st.opens -= 1
            if st.opens <= 0:
                if st.ino in self.orphans:
                    self.cache.discard(st)
                    await self._reap(st.ino)
                self.cache.drop_if_idle(st)

    # -- extended attributes --------------------------------------------------------
    @handler
    async def setxattr(self, inode, name, value, ctx):
        if inode == pyfuse3.ROOT_INODE and name == CONTROL_FLUSH:
            return await self._flush_tier()
        if name.startswith(INFO_PREFIX):
            raise pyfuse3.FUSEError(errno.EPERM)
        _check_xattr_name(name)
        await self.meta(self.vol.meta.set_xattr, inode, name, value)
        self.mc.drop_attr(inode)  # its ctime

    @handler
    async def getxattr(self, inode, name, ctx):
        if name.startswith(INFO_PREFIX) and name[len(INFO_PREFIX) :] in INFO_NAMES:
            return await self._info(inode, name[len(INFO_PREFIX) :])
        _check_xattr_name(name)
        return await self.meta(self.vol.meta.get_xattr, inode, name)

    @handler
    async def listxattr(self, inode, ctx):
        names = await self.meta(self.vol.meta.list_xattr, inode)
        if ctx.uid != 0:  # trusted.* is for CAP_SYS_ADMIN: not even its names (as ext4)
            names = [n for n in names if not n.startswith(b"trusted.")]
        return names

    @handler
    async def removexattr(self, inode, name, ctx):
        if name.startswith(INFO_PREFIX):
            raise pyfuse3.FUSEError(errno.EPERM)
        _check_xattr_name(name)
        await self.meta(self.vol.meta.remove_xattr, inode, name)
        self.mc.drop_attr(inode)  # its ctime

    async def _info(self, inode: int, key: bytes) -> bytes:
        """The read-only user.ckptfs.* attributes, computed from the committed extents."""
        a = await self._getattr(inode)
        if not a.is_reg:
            raise pyfuse3.FUSEError(errno.ENODATA)
        extents = await self.meta(self.vol.meta.get_extents, inode)
        ids = list(dict.fromkeys(e.chunk_id for e in extents))
        info = await self.meta(self.vol.meta.chunk_info, ids) if ids else {}
        if key == b"chunks":
            return str(len(ids)).encode()
        if key == b"stored_bytes":
            return str(sum(info[c][1] for c in ids if c in info)).encode()
        if key == b"dedup":
            # Share of the file's bytes whose chunk is also referenced elsewhere.
            logical = sum(e.length for e in extents)
            shared = sum(e.length for e in extents if info.get(e.chunk_id, (0, 0, 0, 0))[2] > 1)
            return f"{shared / logical if logical else 0.0:.4f}".encode()
        staged = sum(1 for c in ids if c in info and info[c][3] == STAGED)
        return b"durable" if not staged else f"staged {staged}/{len(ids)}".encode()

    async def _flush_tier(self) -> None:
        for st in list(self.cache.states.values()):
            if st.dirty and st.attr.nlink > 0:
                await self._commit(st)
        tier = self.vol.tier
        flush = getattr(tier, "flush", None)
        if flush is not None:
            await trio.to_thread.run_sync(flush)

    async def access(self, inode, mode, ctx):
        return True  # default_permissions: the kernel already checked


def _write_only(flags: int) -> bool:
    """Opens that get direct I/O: nothing reads through them, and mmap needs read access."""
    return flags & os.O_ACCMODE == os.O_WRONLY


def _groups(ctx: pyfuse3.RequestContext) -> set[int]:
    try:
        return set(pyfuse3.get_sup_groups(ctx.pid)) | {ctx.gid}
    except Exception:  # the process may be gone
        return {ctx.gid}


def _invalidate_attr(inode: int) -> None:
    try:
        pyfuse3.invalidate_inode(inode, attr_only=True)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOSYS):
            log.warning("invalidate inode %d: %s", inode, e)


def _check_xattr_name(name: bytes) -> None:
    """Namespaces stored here: user.* and trusted.*, as Linux filesystems answer: another
    namespace is not supported (EOPNOTSUPP), a name with nothing after it is invalid."""
    for ns in (b"user.", b"trusted."):
        if name.startswith(ns):
            if len(name) == len(ns):
                raise pyfuse3.FUSEError(errno.EINVAL)
            return
    raise pyfuse3.FUSEError(errno.EOPNOTSUPP)


def serve(
    vol: Volume,
    mountpoint: str,
    *,
    allow_other: bool = False,
    on_ready: Callable[[], None] | None = None,
    on_start: Callable[[CkptFS], None] | None = None,
    agent: Any = None,
) -> None:
    """Mount, serve until unmounted or SIGINT/SIGTERM, unmount. Blocks.
    `on_start(fs)` gets the filesystem object before the mount (the metrics endpoint
    reads its counters); `agent` (fusefs.agent.server.Agent) is served while mounted."""
    mountpoint = os.path.abspath(mountpoint)
    purged = vol.meta.purge_orphans()
    if purged:
        log.info("purged %d orphan inode(s) left by a crash", purged)
    fs = CkptFS(vol, mountpoint)
    fs.agent = agent
    if on_start is not None:
        on_start(fs)
    tune_malloc()
    pyfuse3.init(fs, mountpoint, mount_options(allow_other=allow_other))
    try:
        trio.run(fs.run, on_ready)
    finally:
        pyfuse3.close(unmount=True)
