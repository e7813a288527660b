"""What a mount caches of the namespace, and how it stays consistent with other clients.

Two caches, kept by the same rules:

- the kernel's: every entry and attribute reply carries a timeout, CACHED_TIMEOUT (60 s)
  while the change feed runs, so `stat`, `ls -l` and path walks over recently used names
  never reach the daemon; a name that does not exist is answered with a negative entry
  (inode 0) under the same timeout, so probing for `latest` or `step-200` is cached too;
- the daemon's (`attrs`, `names`): attributes by inode and inode numbers by (directory,
  name), 0 for a name known to be absent, so a lookup the kernel forgot (memory
  pressure, dropped caches) is answered without asking the metadata. Bounded: entries
  the kernel does not hold go first.

Consistency (docs/ARCHITECTURE.md, "Metadata caching"):

- A change made through this mount is in both caches when its reply is sent: the kernel
  updates its own caches for its own operations, and this module is updated in the
  same step of the event loop.
- A change made anywhere else (another mount, host or process: a DCP save, `ckptfs put`,
  a retention pass) is in the metadata's change log (metadata/sql/changes.py) when its
  transaction commits. Every FEED_POLL_S (0.5 s) the mount reads the log past what it
  has seen and, for each changed inode it caches, drops its attributes from both caches;
  for each changed directory, it looks its cached names up again and invalidates those
  that now name another inode or none (`pyfuse3.invalidate_entry`). So another client's
  change is visible here within FEED_BOUND_S (1 s): a poll interval plus a poll.
- A reply computed from a read that raced a poll's invalidation (the metadata answered
  from a worker while the poll ran) gets SHORT_TIMEOUT (1 s) instead, so a value read
  before a change can never be cached for long after it.
- File content is close-to-open, as before: an open asks the metadata itself (never
  these caches) for the file's generation, and drops the kernel's pages of a file
  another client committed since.
- Without a change log (an engine or service that has none) or while the log cannot be
  read, replies get SHORT_TIMEOUT and the daemon caches nothing: a change is visible
  within 1 s, as before this cache. If the mount fell so far behind that the log was
  pruned past it, it drops everything it caches.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pyfuse3
import trio

from metadata.engine import Attr, MetaEngine, MetaError
from metadata.periodic import run_periodic

log = logging.getLogger("ckptfs.mount")

CACHED_TIMEOUT = 60.0  # kernel entry/attribute timeout while the feed runs
SHORT_TIMEOUT = 1.0  # without a feed, and for replies that raced an invalidation
FEED_POLL_S = 0.5  # how often the change log is read
FEED_BOUND_S = 1.0  # the documented bound: a change elsewhere is seen here within this
FEED_LIMIT = 4096  # records read per query
FEED_DOWN_S = 5.0  # the log unreadable this long: short timeouts until it is read again
HOLE_WAIT_S = 5.0  # a service without xacts: a number missing this long was rolled back
ATTRS_MAX = 1 << 18  # daemon cache sizes before entries the kernel does not hold go
NAMES_MAX = 1 << 18
NEGATIVE_MAX = 1 << 16  # names cached as absent; past this, negative replies are not cached
READDIR_OVER = 64  # a changed directory with more cached names than this is read whole

Meta = Callable[..., Awaitable[Any]]


class MetaCache:
    """The daemon's attribute and name caches and the change feed that keeps them (and the
    kernel's) consistent with other clients."""

    def __init__(self, lookups: dict[int, int]) -> None:
        self.lookups = lookups  # the kernel's lookup counts (CkptFS.lookups): what it holds
        self.attrs: dict[int, Attr] = {}
        self.names: dict[int, dict[bytes, int]] = {}  # directory -> name -> ino (0: absent)
        self.n_names = 0
        self.n_negative = 0
        self.live = False  # the feed runs: long timeouts, daemon caching on
        self.gen = 0  # bumped by every invalidation: a read that saw it change is suspect
        self.floor = 0  # every log record up to here is applied
        self.above: set[int] = set()  # applied records past the floor
        # records past the floor not seen yet: the `next` bound of the read that found
        # them (xacts), or since when (a service that cannot say: HOLE_WAIT_S)
        self.holes: dict[int, float] = {}
        self.xacts = True  # the log's reads say which transactions may still commit
        self.settling: int | None = None  # until xmin reaches this: writers of the start
        self._last_read = 0.0
        self.polls = 0
        self.invalidated = 0

    # -- timeouts ---------------------------------------------------------------------
    def timeout(self, gen: int | None = None) -> float:
        """The kernel timeout for a reply whose read began at invalidation count `gen`."""
        if not self.live or (gen is not None and gen != self.gen):
            return SHORT_TIMEOUT
        return CACHED_TIMEOUT

    def negative_timeout(self, gen: int) -> float:
        """A negative entry is cached only while few are: each must be remembered, since
        nothing tells the daemon when the kernel drops one."""
        if self.n_negative >= NEGATIVE_MAX:
            return 0.0
        return self.timeout(gen)

    # -- the daemon's caches ----------------------------------------------------------
    def attr(self, ino: int) -> Attr | None:
        return self.attrs.get(ino) if self.live else None

    def name(self, parent: int, name: bytes) -> int | None:
        """The inode a cached name holds, 0 if cached as absent, None if not cached."""
        if not self.live:
            return None
        d = self.names.get(parent)
        return None if d is None else d.get(name)

    def put_attr(self, a: Attr, gen: int | None = None) -> None:
        """Cache attributes (fresh from the metadata, or from a change made here). A read
        that raced an invalidation (`gen` no longer current) is not cached."""
        if not self.live or (gen is not None and gen != self.gen):
            return
        self.attrs[a.ino] = a
        if len(self.attrs) > ATTRS_MAX:
            self._trim_attrs()

    def drop_attr(self, ino: int) -> None:
        self.attrs.pop(ino, None)

    def put_name(self, parent: int, name: bytes, ino: int, gen: int | None = None) -> None:
        """Cache what a name holds (0: absent), as replied to the kernel with the long
        timeout: only a remembered name can be invalidated there. A read that raced an
        invalidation is not remembered: its reply gets SHORT_TIMEOUT (`timeout`)."""
        if not self.live or (gen is not None and gen != self.gen):
            return
        d = self.names.setdefault(parent, {})
        old = d.get(name)
        if old is None:
            self.n_names += 1
        elif old == 0:
            self.n_negative -= 1
        d[name] = ino
        if ino == 0:
            self.n_negative += 1
        if self.n_names > NAMES_MAX:
            self._trim_names()

    def drop_name(self, parent: int, name: bytes) -> None:
        d = self.names.get(parent)
        if d is None:
            return
        old = d.pop(name, None)
        if old is not None:
            self.n_names -= 1
            if old == 0:
                self.n_negative -= 1
        if not d:
            del self.names[parent]

    def drop_dir(self, ino: int) -> None:
        """A directory removed here: its names go (the kernel forgets them itself)."""
        for name in list(self.names.get(ino, ())):
            self.drop_name(ino, name)

    def forget(self, ino: int) -> None:
        """An inode deleted: nothing about it is cached any more."""
        self.attrs.pop(ino, None)
        self.drop_dir(ino)

    def _trim_attrs(self) -> None:
        for ino in [i for i in self.attrs if not self.lookups.get(i)]:
            del self.attrs[ino]
            if len(self.attrs) <= ATTRS_MAX // 2:
                return

    def _trim_names(self) -> None:
        """Forget names whose inode the kernel no longer holds (it holds no dentry for
        them then). Names cached as absent stay: the kernel may hold them."""
        for parent, d in list(self.names.items()):
            for name, ino in list(d.items()):
                if ino and not self.lookups.get(ino):
                    self.drop_name(parent, name)
            if self.n_names <= NAMES_MAX // 2:
                return

    def clear(self) -> tuple[list[int], list[tuple[int, bytes]]]:
        """Drop everything; returns what the kernel may hold of it (to invalidate)."""
        self.gen += 1
        inodes = [i for i, n in self.lookups.items() if n > 0]
        entries = [(p, name) for p, d in self.names.items() for name in d]
        self.attrs.clear()
        self.names.clear()
        self.n_names = self.n_negative = 0
        return inodes, entries

    # -- the change feed --------------------------------------------------------------
    async def run(self, meta: Meta, engine: MetaEngine) -> None:
        """Follow the metadata's change log for as long as the mount runs."""
        while True:
            try:
                got = await self._read_log(meta, engine, None)
                newest = got[1]
                break
            except MetaError as e:
                if e.errno in (errno.ENOSYS, errno.EINVAL, errno.EPROTO):
                    log.info("no change feed (%s): metadata cached %.0f s", e, SHORT_TIMEOUT)
                    return  # an engine or service without a change log
                log.warning("change feed not readable yet: %s", e)
            except Exception as e:  # the service not reachable yet
                log.warning("change feed not readable yet: %s", e)
            await trio.sleep(FEED_DOWN_S)
        self.floor = newest
        # Numbers up to `newest` that transactions running now took are not read (the log
        # is read from `newest` on): until those transactions have ended, nothing is
        # cached (short timeouts), so none of them can leave a stale entry behind.
        self.settling = got[4] if self.xacts and got[3] < got[4] else None
        self.live = self.settling is None
        self._last_read = time.monotonic()
        await run_periodic(
            "change_feed", partial(self.poll, meta, engine), FEED_POLL_S, log=log,
            on_error=self._feed_failed, on_ok=self._feed_read,
        )  # fmt: skip

    def _feed_failed(self, e: Exception) -> None:
        """A poll failed (the service unreachable; run_periodic logged and counted it):
        past FEED_DOWN_S without a read, new replies are short-lived until one works."""
        if self.live and time.monotonic() - self._last_read > FEED_DOWN_S:
            self.live = False

    def _feed_read(self) -> None:
        self.live = self.settling is None

    async def _read_log(self, meta: Meta, engine: MetaEngine, after: int | None) -> tuple:
        """One read of the log: (oldest, newest, rows, xmin, next); xmin and next are None
        from a service that cannot say (one older than xacts: it refuses the argument)."""
        if self.xacts:
            try:
                return tuple(
                    await meta(partial(engine.changes_since, xacts=True), after, FEED_LIMIT)
                )
            except MetaError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.info("change feed: the metadata cannot say which writers run (%s): "
                         "a missing record is waited for %.0f s", e, HOLE_WAIT_S)  # fmt: skip
                self.xacts = False
                self.settling = None
                self.holes = dict.fromkeys(self.holes, time.monotonic())
        oldest, newest, rows = await meta(engine.changes_since, after, FEED_LIMIT)
        return oldest, newest, rows, None, None

    async def poll(self, meta: Meta, engine: MetaEngine) -> None:
        """Read the log past the floor and apply what other clients changed."""
        changed: set[int] = set()
        after = self.floor
        first: tuple[int | None, float] | None = None  # the first read's xmin and reach
        while True:
            oldest, newest, rows, xmin, nxt = await self._read_log(meta, engine, after)
            if after == self.floor and oldest > self.floor + 1 and newest:
                await self._apply_all(newest)  # the log was pruned past us: start over
                return
            for seq, ino in rows:
                if seq not in self.above:
                    self.above.add(seq)
                    changed.add(ino)
            if rows:  # numbers this read passed over: holes, found by this read
                now = time.monotonic()
                for seq in range(after + 1, rows[-1][0]):
                    if seq not in self.above and seq not in self.holes:
                        self.holes[seq] = now if nxt is None else nxt
            if first is None:  # it read everything past the floor up to its reach
                first = xmin, rows[-1][0] if len(rows) == FEED_LIMIT else float("inf")
            if len(rows) < FEED_LIMIT:
                break
            after = rows[-1][0]
        self._last_read = time.monotonic()
        assert first is not None
        if not self.xacts:  # the service changed to one that cannot say, mid-poll
            first = None, first[1]
        if self.settling is not None and first[0] is not None and first[0] >= self.settling:
            self.settling = None  # every writer running at the start has ended
        self._advance(*first)
        self.polls += 1
        if changed:
            await self._apply(meta, engine, changed)

    def _advance(self, xmin: int | None, reach: float) -> None:
        """Move the floor over applied records and final holes. A hole is final once the
        transaction that took its number has ended (metadata/sql/changes.py): `xmin`, from
        the poll's first read, which read every number up to `reach`, is at or past the
        bound noted when the hole was found; that read still not listing it means it was
        rolled back. From a service that cannot say, a hole empty for HOLE_WAIT_S."""
        now = time.monotonic()
        while True:
            nxt = self.floor + 1
            if nxt in self.above:
                self.above.discard(nxt)
            elif nxt not in self.holes:
                return  # past everything read
            elif xmin is None and now - self.holes[nxt] > HOLE_WAIT_S:
                pass
            elif xmin is None or nxt > reach or xmin < self.holes[nxt]:
                return  # its transaction may still commit it
            self.floor = nxt
            self.holes.pop(nxt, None)

    async def _apply(self, meta: Meta, engine: MetaEngine, changed: set[int]) -> None:
        """Invalidate what is cached of the changed inodes: attributes (daemon and kernel)
        and, for directories, the cached names that changed."""
        self.gen += 1
        for ino in changed:
            self.attrs.pop(ino, None)
        inodes = [ino for ino in changed if self.lookups.get(ino)]
        dirs = {d: dict(self.names[d]) for d in changed if d in self.names}
        now = await meta(_current_names, engine, dirs) if dirs else {}
        entries = []
        for d, cached in dirs.items():
            for name, ino in cached.items():
                if now[d].get(name, 0) != ino:
                    entries.append((d, name))
                    if self.names.get(d, {}).get(name) == ino:  # not changed here meanwhile
                        self.drop_name(d, name)
        if inodes or entries:
            self.invalidated += len(inodes) + len(entries)
            await trio.to_thread.run_sync(invalidate, inodes, entries)

    async def _apply_all(self, newest: int) -> None:
        log.warning("change feed: the log was pruned past this mount; dropping its caches")
        inodes, entries = self.clear()
        self.floor, self.above, self.holes = newest, set(), {}
        await trio.to_thread.run_sync(invalidate, inodes, entries)


def _current_names(engine: MetaEngine, dirs: dict[int, dict[bytes, int]]) -> dict:
    """Worker thread: what each cached name of these directories holds now (0: absent)."""
    out: dict[int, dict[bytes, int]] = {}
    for d, names in dirs.items():
        now: dict[bytes, int] = {}
        try:
            if len(names) > READDIR_OVER:
                off = 0
                while batch := engine.readdir(d, off):
                    now.update((e.name, e.attr.ino) for e in batch)
                    off = batch[-1].next_offset
            else:
                for name in names:
                    try:
                        now[name] = engine.lookup(d, name).ino
                    except MetaError as e:
                        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
                            raise
        except MetaError as e:  # the directory itself is gone: every name with it
            if e.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise
        out[d] = now
    return out


def invalidate(inodes: list[int], entries: list[tuple[int, bytes]]) -> None:
    """Worker thread: make the kernel forget these attributes and entries. (Not on the
    event loop: an invalidation waits for requests on the same inode in flight.)"""
    for ino in inodes:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOSYS):
                log.warning("invalidate inode %d: %s", ino, e)
    for parent, name in entries:
        try:
            pyfuse3.invalidate_entry(parent, name)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOSYS):
                log.warning("invalidate entry %d/%r: %s", parent, name, e)
