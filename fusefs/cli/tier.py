"""`ckptfs status` and `ckptfs flush`: what the host's write-behind tier still holds.

Both read the staging directory itself (journals, per-process status files), so they work
whether the processes that staged the data are alive, busy or dead: `flush` adopts the
journals of dead processes and uploads their chunks, and waits for the live ones to drain.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from chunkstore.tier.status import scan_staging
from chunkstore.tier.tier import default_staging_dir
from fusefs.cli.progress import Progress
from fusefs.cli.units import format_size
from fusefs.maint.fsck import heal_pending


def _staging(args: argparse.Namespace, vol) -> str:
    return os.path.abspath(args.staging or default_staging_dir(vol.config["uuid"]))


def _rate(bps: float) -> str:
    return f"{format_size(bps)}/s"


def _snapshot(vol, root: str, spec: str) -> dict:
    """The figures `status` shows: this host's staging (read from its journals and the live
    processes' status files) and the chunks not yet durable anywhere."""
    st = scan_staging(root) if os.path.isdir(root) else scan_staging_empty(root)
    st["volume_staged_chunks"] = vol.stats()["staged_chunks"]
    st["mounts"] = _mounts(spec)
    return st


def _mounts(spec: str) -> list[dict]:
    """This user's mounts of the volume on this host: where their daemons log."""
    from fusefs.cli.mount import mounts_of

    return mounts_of(spec)


def _render_mounts(mounts: list[dict]) -> list[str]:
    lines = []
    for m in mounts:
        state = f"pid {m['pid']}" if m["live"] else f"pid {m['pid']} (dead)"
        log = f", log {m['log']}" if m["log"] else ", foreground (no log file)"
        lines.append(f"mount        {m['mountpoint']}: {state}{log}")
    return lines


def _upload_line(st: dict, window: tuple[float, float, float] | None) -> str:
    """One upload figure, saying what it measures. Without a window (one `status`, the first
    refresh of --watch): the uploaders' own average over their last 10 s, of compressed bytes.
    With one, (seconds, bytes sent compressed, staged bytes made durable) between the last
    two refreshes: both over the same interval, so they differ only by compression (the
    staged bytes are raw) and by what was staged meanwhile."""
    if window is None:
        return (
            f"upload rate  {_rate(st['upload_rate_bps'])} sent to the nodes, compressed "
            "(average of the last 10 s)"
        )
    secs, sent, drained = window
    if drained >= 0:
        durable = f"pending fell {_rate(drained / secs)} (staged, uncompressed)"
    else:
        durable = f"pending grew {_rate(-drained / secs)} (staged faster than sent)"
    return (
        f"upload rate  {_rate(sent / secs)} sent to the nodes, compressed; {durable}; "
        f"over the last {secs:.1f}s"
    )


def _render(st: dict, window: tuple[float, float, float] | None = None) -> list[str]:
    age = st["oldest_pending_age_s"]
    lines = [
        f"staging      {st['staging']} (host {st['host']})",
        f"pending      {st['pending_chunks']} chunks, {format_size(st['pending_bytes'])}"
        + (f", oldest {age:.1f}s ago" if age is not None else ""),
        _upload_line(st, window),
        f"staged/cache {format_size(st['staged_bytes'])} / {format_size(st['cache_bytes'])}",
        f"volume       {st['volume_staged_chunks']} chunks not yet durable (all hosts)",
    ]
    for s in st["segments"]:
        who = f"pid {s['pid']}" if s["live"] else "orphaned (owner died; next flush uploads it)"
        err = f", last error: {s['last_error']}" if s["last_error"] else ""
        lines.append(
            f"  {s['segment']}: {who}: {s['pending_chunks']} chunks, "
            f"{format_size(s['pending_bytes'])}, {_rate(s['upload_rate_bps'])}{err}"
        )
    return lines + _render_mounts(st.get("mounts", []))


def cmd_status(args: argparse.Namespace) -> int:
    from fusefs.cli.main import UserError
    from fusefs.client.volume import Volume

    if args.interval <= 0:
        raise UserError("--interval must be a positive number of seconds")
    with Volume.open(args.volume) as vol:
        root = _staging(args, vol)
        if args.staging and not os.path.isdir(root):
            raise UserError(f"no staging directory at {root}")
        if args.watch:
            return _watch(args, vol, root)
        st = _snapshot(vol, root, args.volume)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print("\n".join(_render(st)))
    return 0


# Terminal control: cursor home, clear to the end of the line, clear below, clear screen.
HOME, EOL, EOS, CLEAR = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[2J"


def _watch(args: argparse.Namespace, vol, root: str) -> int:
    """The same figures every --interval seconds, redrawn in place on a terminal (as
    `juicefs stats`); elsewhere (a pipe, a log) one block per refresh, or one JSON object
    per line with --json. Ctrl-C ends it; --count N after N refreshes."""
    tty = sys.stdout.isatty() and not args.json
    prev: tuple[float, dict] | None = None
    shown = 0
    try:
        if tty:
            sys.stdout.write(CLEAR)
        while True:
            st = _snapshot(vol, root, args.volume)
            now = time.monotonic()
            window = None
            if prev is not None and now > prev[0]:
                window = _window(prev[1], st, now - prev[0])
            prev = (now, st)
            if args.json:
                print(json.dumps(st), flush=True)
            else:
                head = (
                    f"ckptfs status {args.volume}  {time.strftime('%H:%M:%S')}, "
                    f"every {args.interval:g}s (Ctrl-C to stop)"
                )
                lines = [head, "", *_render(st, window)]
                if tty:
                    sys.stdout.write(HOME + "".join(f"{x}{EOL}\n" for x in lines) + EOS)
                else:
                    sys.stdout.write("\n".join(lines) + "\n\n")
                sys.stdout.flush()
            shown += 1
            if args.count and shown >= args.count:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        if tty:
            sys.stdout.write("\n")
        return 0


def _window(old: dict, new: dict, secs: float) -> tuple[float, float, float]:
    """(seconds, compressed bytes sent, staged bytes made durable) between two snapshots.
    Sent bytes count the processes alive in both (a counter is per process: one that
    started or ended in between would count its whole life)."""
    before = {s["segment"]: s["uploaded_bytes"] for s in old["segments"] if s["live"]}
    sent = sum(
        max(0, s["uploaded_bytes"] - before[s["segment"]])
        for s in new["segments"]
        if s["live"] and s["segment"] in before
    )
    return secs, float(sent), float(old["pending_bytes"] - new["pending_bytes"])


def scan_staging_empty(root: str) -> dict:
    import socket

    return {
        "staging": root,
        "host": socket.gethostname(),
        "pending_chunks": 0,
        "pending_bytes": 0,
        "oldest_pending_age_s": None,
        "upload_rate_bps": 0.0,
        "staged_bytes": 0,
        "cache_bytes": 0,
        "segments": [],
    }


def _others_left(root: str, own: str, since: float) -> int | None:
    """Bytes other live processes still have to make durable; None while a status is stale."""
    left = 0
    for s in scan_staging(root)["segments"]:
        if s["segment"] == own or not s["pending_chunks"]:
            continue
        if not s["live"]:
            return None  # orphaned: our tier adopts it on its next pass
        try:
            with open(os.path.join(root, "status", s["segment"][:-4] + ".json")) as f:
                info = json.load(f)
        except (OSError, ValueError):
            return None
        if info.get("updated", 0) < since:
            return None
        left += int(info.get("undurable_bytes", s["pending_bytes"]))
    return left


def cmd_flush(args: argparse.Namespace) -> int:
    from fusefs.cli.main import UserError
    from fusefs.client.volume import Volume

    start = time.time()
    end = None if args.timeout is None else time.monotonic() + args.timeout
    with Volume.open(args.volume) as vol:
        root = _staging(args, vol)
        if not os.path.isdir(root):
            if args.staging:
                raise UserError(f"no staging directory at {root}")
            print("nothing staged on this host")
            return 0
        tier = vol.attach_tier(root, durability="local")
        total = scan_staging(root)["pending_bytes"]
        with Progress(total, "flush") as bar:
            while True:
                own = tier.stats()["undurable_bytes"]
                others = _others_left(root, tier.seg.name, start)
                left = own + (others if others is not None else total)
                if others is not None:
                    done = max(0, total - left)
                    if done > bar.done:
                        bar.update(done - bar.done)
                    if left == 0 and tier.drained():
                        break
                if end is not None and time.monotonic() > end:
                    raise UserError(
                        f"flush timed out after {args.timeout}s with {format_size(left)} "
                        f"not yet durable (see `ckptfs status {args.volume}`)"
                    )
                time.sleep(0.2)
        staged = vol.stats()["staged_chunks"]
        healed, unhealed = heal_pending(vol)
    print(f"flushed {root}: everything staged on this host is on the object nodes")
    if healed or unhealed:
        # writes that met a down node went to the next one (hinted handoff): copy them back
        print(
            f"restored {healed} replica(s) to their placement nodes"
            + (
                f"; {unhealed} still pending (`ckptfs fsck --pending` when the node is back)"
                if unhealed
                else ""
            )
        )
    if staged:
        print(f"note: {staged} chunks are still staged on other hosts")
    return 0


def register(sub) -> None:
    s = sub.add_parser("status", help="write-behind tier: pending chunks, upload rate")
    s.add_argument("volume")
    s.add_argument("--staging", metavar="DIR", help="staging directory (default: per volume)")
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--watch", "-w", action="store_true", help="refresh the figures in place until Ctrl-C"
    )
    s.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="with --watch")
    s.add_argument("--count", type=int, default=0, metavar="N", help="with --watch: N refreshes")
    s.set_defaults(func=cmd_status)

    f = sub.add_parser("flush", help="wait until this host's staged chunks are durable")
    f.add_argument("volume")
    f.add_argument("--staging", metavar="DIR", help="staging directory (default: per volume)")
    f.add_argument("--timeout", type=float, default=None, metavar="SECONDS")
    f.set_defaults(func=cmd_flush)
