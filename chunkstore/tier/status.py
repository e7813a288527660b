"""What `ckptfs status` reads about a host's staging directory, without opening a tier:
the pending chunks and bytes of every journal segment, and which processes own them."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from chunkstore.fileio import dir_bytes
from chunkstore.tier.journal import (
    open_segments,
    parse_segment,
)


def pid_alive(pid: int) -> bool:
    """Is this process running (a zombie counts as gone)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def scan_staging(root: str) -> dict:
    """Read-only view of a staging directory for `ckptfs status`: pending work from the
    journals themselves (right even after a crash), rates from the live processes' status.

    `upload_rate_bps` is what the uploaders report: encoded (compressed) bytes sent to the
    nodes, each chunk counted once, averaged over their last 10 s; `pending_bytes` are raw
    (staged uncompressed), so a fall of pending bytes is faster than the upload rate by the
    compression ratio."""
    journal = os.path.join(root, "journal")
    segs = []
    total_chunks = total_bytes = 0
    oldest = None
    rate = 0.0
    if os.path.isdir(journal):
        for name, _, fd in open_segments(journal):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                live = False
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                live = True
            with open(fd, "rb", closefd=False) as f:
                st = parse_segment(f.read())
            info: dict = {}
            try:
                with open(os.path.join(root, "status", name[:-4] + ".json")) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                pass
            nbytes = sum(s for s, _ in st.pending.values())
            seg_oldest = min((t for _, t in st.pending.values()), default=None)
            seg_rate = float(info.get("upload_rate_bps", 0.0)) if live else 0.0
            segs.append(
                {
                    "segment": name,
                    "live": live,
                    "pid": info.get("pid"),
                    "pending_chunks": len(st.pending),
                    "pending_bytes": nbytes,
                    "oldest_pending_ns": seg_oldest,
                    "upload_rate_bps": seg_rate,
                    # the live process's counter of encoded bytes sent (each chunk once):
                    # two readings give an upload rate over any interval (`status --watch`)
                    "uploaded_bytes": int(info.get("uploaded_bytes", 0)) if live else 0,
                    "to_upload_chunks": info.get("to_upload_chunks") if live else len(st.pending),
                    "last_error": info.get("last_error", "") if live else "",
                    "torn_tail": st.torn,
                }
            )
            total_chunks += len(st.pending)
            total_bytes += nbytes
            rate += seg_rate
            if seg_oldest is not None and (oldest is None or seg_oldest < oldest):
                oldest = seg_oldest
    return {
        "staging": root,
        "host": socket.gethostname(),
        "pending_chunks": total_chunks,
        "pending_bytes": total_bytes,
        "oldest_pending_age_s": None
        if oldest is None
        else max(0.0, (time.time_ns() - oldest) / 1e9),
        "upload_rate_bps": rate,
        "staged_bytes": dir_bytes(os.path.join(root, "staged")),
        "cache_bytes": dir_bytes(os.path.join(root, "cache")),
        "segments": segs,
    }
