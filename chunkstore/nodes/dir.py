"""A local-directory object node (flash-backed in production, any disk in tests).

Layout: `ROOT/objects/ab/cd/<32 hex>` with a two-level fan-out so no directory
grows past ~65k entries per level, and `ROOT/tmp/` for writes in progress.
A put writes a temp file, fsyncs it, renames it into place (never over a whole
object: RENAME_NOREPLACE, and an object found there is read and kept if whole,
replaced only if damaged) and fsyncs the directory: a reader sees either no object
or the whole object, and an acknowledged put survives a crash. That a writer cannot
replace or delete objects by other means is up to the directory's permissions (the
node is a directory every writer's uid can write). Keys are chunk ids rendered as hex, so no
caller-supplied string can name a path outside ROOT.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterator

from chunkstore.fileio import fsync_dir, rename_noreplace, temp_path, write_new
from chunkstore.ids import check_id, from_hex
from chunkstore.nodes import NodeError, NodeInfo, ObjectMissing, ObjectNode

log = logging.getLogger("ckptfs.dirnode")


class DirNode(ObjectNode):
    def __init__(self, info: NodeInfo, base_dir: str | None = None) -> None:
        self.info = info
        path = info.url[4:].partition("?")[0]
        if not os.path.isabs(path):
            if base_dir is None:
                raise ValueError(f"node {info.name}: relative path {path!r} needs a volume dir")
            path = os.path.join(base_dir, path)
        self.root = os.path.realpath(path)
        self._objects = os.path.join(self.root, "objects")
        self._tmp = os.path.join(self.root, "tmp")
        self._made: set[str] = set()
        self._lock = threading.Lock()
        self._fsync_dirs = True
        self._unsynced: dict[str, str] = {}  # object path -> its directory, awaiting sync()

    def ensure(self) -> None:
        """Create the node's directories (format time, or a node that was wiped)."""
        os.makedirs(self._objects, exist_ok=True)
        os.makedirs(self._tmp, exist_ok=True)

    def _path(self, cid: bytes) -> tuple[str, str]:
        h = check_id(cid).hex()
        d = os.path.join(self._objects, h[:2], h[2:4])
        return d, os.path.join(d, h)

    def put(self, cid: bytes, blob: bytes | memoryview) -> None:
        self._write(cid, blob, sync=True)

    def put_nosync(self, cid: bytes, blob: bytes | memoryview) -> None:
        """Write and rename into place, start the disk writing, fsync later in `sync()`.

        Until then a crash can leave a torn object under its final name: the header
        checksum rejects it on read, fsck reports it, and no metadata names it yet
        (the commit that would waits for `sync()`). An object already there is kept,
        never replaced by the unsynced file."""
        self._write(cid, blob, sync=False)

    def sync(self) -> None:
        with self._lock:
            files, self._unsynced = self._unsynced, {}
        dirs = set(files.values())
        try:
            for path in files:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    log.warning("node %s: %s vanished before sync", self.name, path)
                    continue
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            for d in dirs:
                fsync_dir(d)
        except OSError as e:
            raise NodeError(f"node {self.name}: sync: {e.strerror or e}") from e

    def _write(self, cid: bytes, blob: bytes | memoryview, *, sync: bool) -> None:
        d, final = self._path(cid)
        try:
            if d not in self._made:
                os.makedirs(d, exist_ok=True)
                os.makedirs(self._tmp, exist_ok=True)
                with self._lock:
                    self._made.add(d)
            tmp = temp_path(self._tmp, f"{cid.hex()}.")
            write_new(tmp, blob, sync=sync)
            if not rename_noreplace(tmp, final):
                # Never replace a whole object (ids are content: it holds these bytes, and
                # metadata may name it already); a damaged or planted one is replaced, by
                # a synced file only (a power cut must not tear what a reader may need).
                if self._whole(cid, final):
                    os.unlink(tmp)
                    if sync:  # its writer may not have synced it yet: we rely on it now
                        _fdatasync(final)
                else:
                    if not sync:
                        _fdatasync(tmp)
                    os.rename(tmp, final)
            if not sync:
                with self._lock:
                    self._unsynced[final] = d
            elif self._fsync_dirs:
                fsync_dir(d)
        except FileNotFoundError as e:
            # The node's directory vanished under us (a lost disk): that is a
            # node failure, not a missing object.
            raise NodeError(f"node {self.name}: {e}") from e
        except OSError as e:
            raise NodeError(f"node {self.name}: put {cid.hex()}: {e.strerror or e}") from e

    def _whole(self, cid: bytes, final: str) -> bool:
        try:
            with open(final, "rb") as f:
                return self.keeps(cid, f.read())
        except FileNotFoundError:
            return False

    def get(self, cid: bytes) -> bytes:
        _, final = self._path(cid)
        try:
            with open(final, "rb") as f:
                return f.read()
        except FileNotFoundError:
            if not os.path.isdir(self.root):
                raise NodeError(f"node {self.name}: directory {self.root} is gone") from None
            raise ObjectMissing(f"node {self.name}: no object {cid.hex()}") from None
        except OSError as e:
            raise NodeError(f"node {self.name}: get {cid.hex()}: {e.strerror or e}") from e

    def exists(self, cid: bytes) -> bool:
        return os.path.exists(self._path(cid)[1])

    def delete(self, cid: bytes) -> None:
        try:
            os.unlink(self._path(cid)[1])
        except FileNotFoundError:
            pass
        except OSError as e:
            raise NodeError(f"node {self.name}: delete {cid.hex()}: {e.strerror or e}") from e

    def list(self) -> Iterator[tuple[bytes, int, float]]:
        if not os.path.isdir(self._objects):
            return
        for a in _fan_dirs(self._objects):
            da = os.path.join(self._objects, a)
            for b in _fan_dirs(da):
                with os.scandir(os.path.join(da, b)) as it:
                    for entry in it:
                        try:
                            cid = from_hex(entry.name)
                        except ValueError:
                            continue  # foreign file: not ours to report as an object
                        if entry.name[:4] != a + b or not entry.is_file(follow_symlinks=False):
                            continue  # misplaced or not a plain file: no object of ours
                        st = entry.stat(follow_symlinks=False)
                        yield cid, st.st_size, st.st_mtime

    def sweep_tmp(self, cutoff: float) -> tuple[int, int]:
        """A put killed between its temp write and the rename leaves the temp file behind:
        nothing else ever names it. Only files older than the cutoff go (a live put's are
        seconds old)."""
        files = nbytes = 0
        try:
            entries = list(os.scandir(self._tmp))
        except FileNotFoundError:
            return (0, 0)
        except OSError as e:
            raise NodeError(f"node {self.name}: list tmp: {e.strerror or e}") from e
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_mtime < cutoff:
                    os.unlink(entry.path)
                    files += 1
                    nbytes += st.st_size
            except FileNotFoundError:
                continue
            except OSError as e:
                raise NodeError(f"node {self.name}: remove {entry.name}: {e.strerror or e}") from e
        return files, nbytes

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self.list())

    def capacity(self) -> tuple[int, int]:
        try:
            st = os.statvfs(self.root if os.path.isdir(self.root) else os.path.dirname(self.root))
        except OSError:
            return (0, 0)
        return (st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)

    def wipe(self) -> None:
        """Delete every object (tests simulating a lost node)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def plant(self, cid: bytes, blob: bytes) -> None:
        """Write `blob` over the object, whatever is there (tests planting damage: a put
        never replaces a whole object)."""
        d, final = self._path(cid)
        os.makedirs(d, exist_ok=True)
        with open(final, "wb") as f:
            f.write(blob)


def _fdatasync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _fan_dirs(path: str) -> list[str]:
    """The fan-out directories in `path` (two lowercase hex digits, real directories, not
    links): anything else there is not ours, and following it could leave the node."""
    out = []
    with os.scandir(path) as it:
        for e in it:
            if len(e.name) == 2 and all(c in "0123456789abcdef" for c in e.name):
                if e.is_dir(follow_symlinks=False):
                    out.append(e.name)
    return sorted(out)
