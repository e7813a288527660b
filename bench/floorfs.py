"""The FUSE framework's floors on this machine: minimal pyfuse3 filesystems.

    python -m bench.floorfs MOUNTPOINT [--store DIR]

A flat directory of regular files, with only what `cp`-style writes and reads, torch.save
and fsync need. bench.fuse runs its workloads through it beside the mount, so each run
shows what the simplest filesystems on the same framework do on this machine:

- without --store, writes are dropped (a file keeps only its size; reads return zeros):
  what pyfuse3, trio and the kernel's FUSE round trips cost (`framework_*`);
- with --store, each file's bytes go to a file in DIR and reads come back from it: a
  pyfuse3 filesystem that keeps the bytes on this disk with no chunking, hashing, dedup
  or metadata (`storing_floor_*`). Of six ways measured to write (pwrite on the serving
  thread, a trio worker thread per request, one writer thread fed by a queue, each with
  and without direct_io; 2026-11-30, disk 1,237-1,351 MB/s) the queue with direct_io was
  the fastest, 893-899 MB/s against 583-885 for the others: that is the one kept. Reads
  pread on the serving thread (a worker thread per request was slower), after the
  file's queued writes have landed.

Opens follow the mount's rule (a write-only open is direct_io: the kernel hands the
writer's pages to the request instead of copying them into the page cache first), and
it mounts with the mount's options and request tasks, so both see the same requests.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import queue
import stat
import sys
import threading

import pyfuse3
import trio

QUEUE_DEPTH = 32  # writes (1 MiB each) queued for the writer thread


class _File:
    def __init__(self, ino: int, fd: int | None) -> None:
        self.ino = ino
        self.fd = fd
        self.size = 0
        self.mode = stat.S_IFREG | 0o644
        self.error: OSError | None = None  # a failed write, reported by the next fsync


def _fuse_error(e: OSError) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(e.errno or errno.EIO)


class FloorFS(pyfuse3.Operations):
    def __init__(self, store: str | None) -> None:
        super().__init__()
        self.store = store
        self.names: dict[bytes, _File] = {}
        self.files: dict[int, _File] = {}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.queue: queue.Queue = queue.Queue(QUEUE_DEPTH)
        self.pending: dict[int, int] = {}  # writes queued, by inode
        self.done = threading.Condition()
        if store is not None:
            threading.Thread(target=self._writer, daemon=True).start()

    # -- the writer thread and waiting for it (always off the trio thread) ----------------
    def _writer(self) -> None:
        while True:
            f, buf, off = self.queue.get()
            try:
                view = memoryview(buf)
                while view:  # a short write goes on with the rest
                    n = os.pwrite(f.fd, view, off)
                    view, off = view[n:], off + n
            except OSError as e:
                f.error = e
            with self.done:
                self.pending[f.ino] -= 1
                self.done.notify_all()

    def _landed(self, f: _File) -> None:
        with self.done:
            self.done.wait_for(lambda: not self.pending.get(f.ino))

    async def _wait_landed(self, f: _File) -> None:
        if self.pending.get(f.ino):
            await trio.to_thread.run_sync(self._landed, f)

    def _synced(self, f: _File) -> None:
        self._landed(f)
        if f.error is not None:
            e, f.error = f.error, None
            raise _fuse_error(e)
        try:
            os.fsync(f.fd)
        except OSError as e:
            raise _fuse_error(e) from None

    # -- requests --------------------------------------------------------------------------
    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        if inode == pyfuse3.ROOT_INODE:
            a.st_mode, a.st_nlink = stat.S_IFDIR | 0o755, 2
        elif inode in self.files:
            f = self.files[inode]
            a.st_mode, a.st_nlink, a.st_size = f.mode, 1, f.size
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        a.st_ino = inode
        a.st_blksize = 1 << 20
        a.attr_timeout = a.entry_timeout = 1.0  # the mount's timeouts
        return a

    async def getattr(self, inode, ctx=None):
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        f = self.names.get(name) if parent_inode == pyfuse3.ROOT_INODE else None
        if f is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(f.ino)

    async def _truncate(self, f: _File, size: int) -> None:
        if f.fd is not None:
            await self._wait_landed(f)  # else a queued write lands past the new end
            try:
                os.ftruncate(f.fd, size)
            except OSError as e:
                raise _fuse_error(e) from None
        f.size = size

    async def setattr(self, inode, attr, fields, fh, ctx):
        f = self.files.get(inode)
        if f is not None and fields.update_size:
            await self._truncate(f, attr.st_size)
        return self._attr(inode)

    def _info(self, ino: int, flags: int) -> pyfuse3.FileInfo:
        fi = pyfuse3.FileInfo(fh=ino)
        fi.direct_io = flags & os.O_ACCMODE == os.O_WRONLY
        fi.keep_cache = not fi.direct_io
        return fi

    async def create(self, parent_inode, name, mode, flags, ctx):
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        f = self.names.get(name)
        if f is None:
            fd = None
            if self.store is not None:
                path = os.path.join(self.store, str(self.next_ino))
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                except OSError as e:
                    raise _fuse_error(e) from None
            f = self.names[name] = self.files[self.next_ino] = _File(self.next_ino, fd)
            self.next_ino += 1
        elif flags & os.O_TRUNC:
            await self._truncate(f, 0)
        return self._info(f.ino, flags), self._attr(f.ino)

    async def open(self, inode, flags, ctx):
        if inode not in self.files:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & os.O_TRUNC:
            await self._truncate(self.files[inode], 0)
        return self._info(inode, flags)

    async def write(self, fh, off, buf):
        f = self.files[fh]
        if f.fd is not None:
            with self.done:
                self.pending[fh] = self.pending.get(fh, 0) + 1
            try:
                self.queue.put_nowait((f, buf, off))
            except queue.Full:  # the disk is behind: wait off the loop
                await trio.to_thread.run_sync(self.queue.put, (f, buf, off))
        f.size = max(f.size, off + len(buf))
        return len(buf)

    async def read(self, fh, off, size):
        f = self.files[fh]
        if f.fd is None:
            return bytes(max(0, min(size, f.size - off)))
        await self._wait_landed(f)
        try:
            return os.pread(f.fd, size, off)
        except OSError as e:
            raise _fuse_error(e) from None

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        f = self.files[fh]
        if f.fd is not None:
            await trio.to_thread.run_sync(self._synced, f)

    async def release(self, fh):
        pass


def main(argv: list[str]) -> int:
    from fusefs.mount.tuning import mount_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mountpoint")
    ap.add_argument("--store", metavar="DIR", help="keep the bytes in files under DIR")
    args = ap.parse_args(argv)
    fs = FloorFS(args.store)
    pyfuse3.init(fs, args.mountpoint, mount_options(fsname="floorfs"))
    try:
        trio.run(functools.partial(pyfuse3.main, min_tasks=4, max_tasks=64))  # as CkptFS.run
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
