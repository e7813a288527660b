"""The FUSE framework's floor: a minimal pyfuse3 filesystem whose writes are dropped.

    python -m bench.nullfs MOUNTPOINT

One regular file, `f`, accepts writes at any offset and keeps only its size. bench.fuse
writes the same 1 GiB through it as through the mount: what pyfuse3, trio and the kernel's
FUSE round trips cost before any storage work (`framework_write_mbps`, `write_vs_framework`).
"""

from __future__ import annotations

import errno
import stat
import sys

import pyfuse3
import trio

FILE_INO = pyfuse3.ROOT_INODE + 1


class NullFS(pyfuse3.Operations):
    def __init__(self) -> None:
        super().__init__()
        self.size = 0

    async def getattr(self, inode, ctx=None):
        a = pyfuse3.EntryAttributes()
        if inode == pyfuse3.ROOT_INODE:
            a.st_mode, a.st_nlink = stat.S_IFDIR | 0o755, 2
        elif inode == FILE_INO:
            a.st_mode, a.st_nlink, a.st_size = stat.S_IFREG | 0o644, 1, self.size
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        a.st_ino = inode
        a.attr_timeout = a.entry_timeout = 300
        return a

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode == pyfuse3.ROOT_INODE and name == b"f":
            return await self.getattr(FILE_INO)
        raise pyfuse3.FUSEError(errno.ENOENT)

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        if fields.update_size:
            self.size = attr.st_size
        return await self.getattr(inode)

    async def write(self, fh, off, buf):
        self.size = max(self.size, off + len(buf))
        return len(buf)

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        pass

    async def release(self, fh):
        pass


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.nullfs MOUNTPOINT", file=sys.stderr)
        return 2
    pyfuse3.init(NullFS(), argv[0], set(pyfuse3.default_options) | {"fsname=nullfs"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
