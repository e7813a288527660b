"""Small durable-file helpers shared by the directory node and the write-behind tier."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import threading
import uuid
from collections.abc import Callable


def fsync_dir(path: str) -> None:
    """fsync a directory: makes the renames and creations inside it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fdatasync_path(path: str) -> None:
    """fdatasync a file by name: makes its data (and size) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written (a short write is not an error)."""
    view = memoryview(data).cast("B")
    while view:
        done = os.write(fd, view)
        if done == 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[done:]


def _libc(name: str, argtypes: list) -> Callable[..., int] | None:
    """A libc function through ctypes (errno kept), or None where libc lacks it."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_uint])  # fmt: skip
_RENAMEAT2 = _libc("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                 ctypes.c_uint])  # fmt: skip
_SYNCFS = _libc("syncfs", [ctypes.c_int])
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


def open_syncfs(path: str) -> int | None:
    """A descriptor to syncfs the filesystem holding `path` through, or None where syncfs
    cannot report a failed writeback (no syncfs in libc, Linux before 5.8).

    Kept open by its owner for its lifetime: syncfs reports the writeback errors that
    happened since *this descriptor* last looked, so one opened per call would miss an
    error another process's syncfs saw first, and acknowledge a file that never reached
    the disk."""
    if _SYNCFS is None or not _kernel_at_least(5, 8):
        return None
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def sync_filesystem(fd: int) -> None:
    """syncfs(2) through a descriptor from open_syncfs: every dirty file of that filesystem
    made durable in one call and one journal commit; OSError if any writeback failed."""
    if _SYNCFS(fd) != 0:  # type: ignore[misc]
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def rename_noreplace(src: str, dst: str) -> bool:
    """Rename src to dst unless dst exists (then False, src untouched), atomically:
    renameat2(RENAME_NOREPLACE), or link + unlink where the filesystem lacks it (and a
    check before a rename where it has neither)."""
    if _RENAMEAT2 is not None:
        flags = _RENAME_NOREPLACE
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            return False
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), dst)
    try:
        os.link(src, dst)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        if os.path.lexists(dst):  # no hard links either: check, then rename (a race
            return False  # with another writer of the same name is then possible)
        os.rename(src, dst)
        return True
    os.unlink(src)
    return True


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages now (Linux sync_file_range, no wait), so the disk
    works while the writer computes and the fsync at commit finds little left to do.
    Not a durability point by itself; a no-op where unavailable."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


# -- direct writes -------------------------------------------------------------------------------
#
# Why objects are written with O_DIRECT: on the hosts we measured (VMs with lazily backed
# memory), buffered writes spend most of their CPU copying into freshly allocated page-cache
# pages: 1 GiB written as 256 files took 1.5-2.3 CPU-s and ran at 340-460 MB/s, while the same
# bytes written with O_DIRECT from one reused aligned buffer took 0.16 CPU-s and ran at
# 1,150-1,190 MB/s. Chunk objects are written once and read back rarely (an upload, a cache
# hit), so the page cache buys little for them. The cost is one memcpy into the bounce buffer.

ALIGN = 4096  # O_DIRECT alignment of buffer address, length and file offset
# Smaller objects are written through the page cache: a direct write waits for the device
# (~1 ms here), which made a small file's close spend 1.6 ms staging 4 KiB "without sync";
# buffered, the write takes microseconds and the commit's one fdatasync covers it.
DIRECT_MIN = 256 * 1024
BOUNCE = 4 * 2**20 + 64 * 1024  # a 4 MiB chunk plus its header in one write
_bounce = threading.local()
_no_direct: set[str] = set()  # directories whose filesystem refused O_DIRECT (old tmpfs, ...)


def _bounce_buffer() -> memoryview:
    buf = getattr(_bounce, "buf", None)
    if buf is None:
        buf = _bounce.buf = memoryview(mmap.mmap(-1, BOUNCE))  # page aligned
    return buf


def _open_new(path: str, direct: bool = True) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    mode = 0o600
    where = os.path.dirname(path)
    if direct and hasattr(os, "O_DIRECT") and where not in _no_direct:
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _no_direct.add(where)  # no direct I/O there: buffered from now on
            # Linux creates the file before it checks for O_DIRECT support: the name is
            # ours (callers pass unique temp names), so the empty file goes.
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return os.open(path, flags, mode), False


def _write_buffered(fd: int, parts: list[memoryview]) -> None:
    for p in parts:
        write_all(fd, p)


def _write_direct(fd: int, parts: list[memoryview], total: int) -> None:
    """Copy `parts` through the aligned bounce buffer; the zero-padded tail is cut by ftruncate."""
    bounce = _bounce_buffer()
    fill = 0
    written = 0
    for p in parts:
        while p:
            take = min(len(p), BOUNCE - fill)
            bounce[fill : fill + take] = p[:take]
            fill += take
            p = p[take:]
            if fill == BOUNCE:
                written += _flush_bounce(fd, bounce, fill)
                fill = 0
    if fill:
        pad = -fill % ALIGN
        bounce[fill : fill + pad] = bytes(pad)
        written += _flush_bounce(fd, bounce, fill + pad)
    if written != total:
        os.ftruncate(fd, total)


def _flush_bounce(fd: int, bounce: memoryview, n: int) -> int:
    view = bounce[:n]
    while view:
        try:
            done = os.write(fd, view)
        except OSError as e:
            if e.errno != errno.EINVAL:  # e.g. a device whose blocks are larger than ALIGN
                raise
            done = 0
        if done == 0 or done % ALIGN:  # refused, or short and unaligned: finish buffered
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _write_buffered(fd, [view[done:]])
            return n
        view = view[done:]
    return n


_tmp_seq = itertools.count()


def temp_path(directory: str, prefix: str = "") -> str:
    """A name in `directory` no other writer uses: prefix, our pid (so a cleaner can tell
    a dead process's leftovers), a per-process sequence number and 64 random bits. Eight
    random hex digits alone collided: a tier writes thousands of temp files a step, and
    one EEXIST failed a whole wave of a host's ranks."""
    return os.path.join(
        directory, f"{prefix}{os.getpid()}.{next(_tmp_seq)}.{uuid.uuid4().hex[:16]}"
    )


def write_new(
    path: str,
    parts: bytes | memoryview | list[bytes | memoryview],
    *,
    sync: bool,
    writeback: bool = True,
) -> int:
    """Create `path` (it must not exist; mode 0600) holding the concatenation of `parts`.

    With sync the file is fsync'd before returning; without, it is on its way to the disk (a
    direct write is already there, a buffered one has its writeback started unless
    `writeback` is False: a copy kept durable elsewhere) and a later fdatasync makes it
    durable. A failed write removes the partial file. Returns the size."""
    views = [memoryview(p).cast("B") for p in (parts if isinstance(parts, list) else [parts])]
    total = sum(v.nbytes for v in views)
    fd, is_direct = _open_new(path, direct=total >= DIRECT_MIN)
    try:
        try:
            if is_direct and total:
                _write_direct(fd, views, total)
            else:
                _write_buffered(fd, views)
            if sync:
                os.fsync(fd)
            elif not is_direct and writeback:
                start_writeback(fd)
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return total


def dir_bytes(path: str) -> int:
    """Bytes of the files directly in `path` (0 if it is gone): the tier's space estimate."""
    total = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    total += e.stat().st_size
                except FileNotFoundError:
                    pass
    except FileNotFoundError:
        pass
    return total
