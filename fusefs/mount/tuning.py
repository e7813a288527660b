"""How the mount tunes the kernel and its own process: read-ahead and in-flight read
requests for the mount's device, the mount options, and glibc's malloc for the daemon's
request buffers. All best effort: a host that refuses one serves all the same."""

from __future__ import annotations

import logging
import os

import pyfuse3

log = logging.getLogger("ckptfs.mount")


def tune_readahead(dev: int) -> None:
    """Raise the kernel's read-ahead for this mount (root only; best effort).

    The default 128 KiB turns a sequential read into many small FUSE requests;
    4 MiB lets each request carry up to max_read bytes and keeps the daemon's
    chunk prefetch busy.
    """
    try:
        path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
        with open(path, "w") as f:
            f.write("4096")
    except OSError as e:
        log.debug("read-ahead not tuned: %s", e)


MAX_BACKGROUND = 64  # FUSE requests the kernel keeps in flight for readahead (default 12)


def tune_background(dev: int) -> None:
    """Let the kernel keep more read requests in flight (root, fusectl mounted; best effort).

    Every readahead request of a FUSE mount is a "background" request, and the kernel
    sends at most 12 of them at a time (and, past 9, drops asynchronous readahead), for
    all the files of the mount together: 8 ranks loading their checkpoints at once had a
    request and a half each in flight, each waiting for its chunk to come off the disk.
    64 (48 before readahead is dropped) gave 8 parallel torch.loads 22-33% more throughput
    in alternating runs. libfuse 3.14 cannot set it at INIT, so it is set through fusectl
    (/sys/fs/fuse/connections/<minor>/, mounted by systemd on most hosts)."""
    base = f"/sys/fs/fuse/connections/{os.minor(dev)}"
    try:
        for name, value in (("max_background", MAX_BACKGROUND),
                            ("congestion_threshold", MAX_BACKGROUND * 3 // 4)):  # fmt: skip
            with open(os.path.join(base, name), "w") as f:
                f.write(str(value))
    except OSError as e:
        log.debug("background requests not tuned: %s", e)


def mount_options(*, allow_other: bool = False, fsname: str = "ckptfs") -> set[str]:
    opts = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    # nodev, nosuid: a device node or setuid file that any client of a shared volume can
    # make must not act as one on this host (they are stored and listed all the same)
    opts |= {f"fsname={fsname}", "subtype=ckptfs", "noatime", "nodev", "nosuid"}
    if allow_other:
        opts.add("allow_other")
    return opts


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def tune_malloc() -> None:
    """Keep the daemon's request buffers in the heap (glibc only; best effort).

    Every FUSE write arrives as a fresh 1 MiB bytes object. With glibc's defaults those are
    mmap'd, or the heap top is trimmed after them, so each request faults in and zeroes
    256 new pages: 10% of the daemon's CPU in a 1 GiB write. A fixed mmap threshold and a
    trim threshold above the working set (requests plus dirty blocks in flight) keep reusing
    the same pages."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 2**20)
    except (OSError, AttributeError) as e:
        log.debug("malloc not tuned: %s", e)
