"""Small durable-file helpers shared by the directory node and the write-behind tier."""

from __future__ import annotations

import os
from collections.abc import Callable


def fsync_dir(path: str) -> None:
    """fsync a directory: makes the renames and creations inside it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages now (Linux sync_file_range, no wait), so the disk
    works while the writer computes and the fsync at commit finds little left to do.
    Not a durability point by itself; a no-op where unavailable."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
