"""The `ckptfs` command. Each concern registers its subcommands from its own module.

User mistakes (missing volume, bad size, missing file) print one line and exit
non-zero; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import secrets
import stat
import sys
from importlib.metadata import entry_points

from chunkstore.codec import CODECS
from chunkstore.nodes import NodeError, redact_url
from chunkstore.store import ChunkStoreError
from fusefs.cli.progress import Progress
from fusefs.cli.text import shown
from fusefs.cli.units import format_size, parse_size
from fusefs.client.registry import open_volume
from fusefs.client.volume import Volume, VolumeError, VolumeSettings, default_nodes_dir
from metadata.engine import MetaError

# Modules of this package that add subcommands: each defines register(subparsers).
COMMAND_MODULES: list[str] = [
    "fusefs.cli.mount",
    "fusefs.cli.service",
    "fusefs.cli.ops",
    "fusefs.cli.tier",
    "fusefs.cli.demo",
    "fusefs.cli.tokens",
    "fusefs.cli.agent",
]
# Packages above this one (the load-test harness) add theirs through this entry-point group,
# so that no import runs from fusefs up to them.
PLUGIN_GROUP = "ckptfs.commands"


log = logging.getLogger("ckptfs.cli")


class UserError(Exception):
    """Raised by commands for a problem the user can fix; printed as one line."""


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def cmd_format(args: argparse.Namespace) -> int:
    settings = VolumeSettings(
        chunk_size=args.chunk_size,
        chunking=args.chunking,
        compression=args.compression,
        replicas=args.replicas,
        cdc_min=args.cdc_min,
        cdc_max=args.cdc_max,
        backup_interval=args.backup_interval,
        backup_keep=args.backup_keep,
    )
    nodes: int | list[str] = args.node if args.node else args.nodes
    with Volume.create(args.volume, nodes=nodes, settings=settings, db=args.db) as vol:
        path = os.path.abspath(args.volume)
        meta = redact_url(args.db) if args.db else f"SQLite in {path}"
        print(
            f"formatted {args.volume}: {len(vol.store.nodes)} nodes, R={settings.replicas}, "
            f"{format_size(settings.chunk_size)} {settings.chunking} chunks, {settings.compression}"
        )
        print(f"  metadata: {meta}")
        urls = [redact_url(n.info.url) for n in vol.store.nodes]
        if not args.node:
            shown_nodes = f"{default_nodes_dir(path)}/n0..n{len(urls) - 1}"
        else:
            shown_nodes = ", ".join(urls)
        print(f"  nodes:    {shown_nodes} (chunks)")
        if settings.backup_interval > 0:
            backups = (
                f"metadata snapshots on the nodes every {settings.backup_interval:g} s while "
                f"`meta serve` or a mount runs (newest {settings.backup_keep} kept), and at "
                "each `ckptfs meta backup`"
            )
        else:
            backups = "metadata snapshots on the nodes at each `ckptfs meta backup`"
        print(f"  backups:  {backups}")
        # the backup key (fusefs.maint.backup), made now: every volume signs its backups
        # from the first; it must be copied off the host before the volume can be lost
        from fusefs.maint import backup as bk

        try:
            kpath, _made = bk.make_key(path)
        except (OSError, bk.BackupError) as e:
            raise UserError(
                f"formatted, but cannot make the backup key: {e} (run `ckptfs meta backup-key`)"
            ) from None
        where = " and into each service replica's volume directory" if args.db else ""
        print(
            f"  key:      {shown(kpath)} (0600) signs the backups: copy it off this host{where}"
            " now (`meta restore --key` needs it once the volume is lost)"
        )
    return 0


STDIO = "-"  # `put VOL - PATH` reads standard input, `get VOL PATH -` writes standard output


def cmd_put(args: argparse.Namespace) -> int:
    if args.local_file == STDIO:
        src = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
        label = "put (stdin)"
    else:
        try:
            src = open(args.local_file, "rb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise UserError(f"cannot read {args.local_file}: {e.strerror}") from e
        label = f"put {os.path.basename(args.local_file)}"
    with src, open_volume(args.volume) as vol:
        st = os.fstat(src.fileno())
        total = st.st_size if stat.S_ISREG(st.st_mode) else 0  # a pipe: no size known
        bufsize = vol.settings.chunk_size
        with (
            Progress(total, label, enabled=None if total else False) as bar,
            vol.open_write(args.vol_path) as w,
        ):
            while True:
                buf = src.read(bufsize)
                if not buf:
                    break
                w.write(buf)
                bar.update(len(buf))
    return 0


def _get_to_stdout(vol: Volume, r) -> int:
    """The file's bytes on standard output; a reader that goes away (`| head`) ends it
    quietly, as it does `cat`."""
    out = sys.stdout.buffer
    step = vol.settings.chunk_size
    try:
        for off in range(0, r.size, step):
            out.write(r.pread(off, step))
        out.flush()
    except BrokenPipeError:
        null = os.open(os.devnull, os.O_WRONLY)  # no second error when Python flushes at exit
        os.dup2(null, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports `cat` killed by it
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with open_volume(args.volume) as vol:
        if args.local_file == STDIO:
            with vol.open_read(args.vol_path) as r:
                code = _get_to_stdout(vol, r)
            _warn_bad_replicas(vol)
            return code
        with vol.open_read(args.vol_path) as r:
            # Created exclusively, under a name nobody can guess, never through a link: a
            # fixed name let a symlink planted at DEST.ckptfs-partial redirect the write.
            tmp = f"{args.local_file}.ckptfs-partial.{secrets.token_hex(6)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            try:
                with open(fd, "wb") as out, Progress(r.size, f"get {args.vol_path}") as bar:
                    step = vol.settings.chunk_size
                    for off in range(0, r.size, step):
                        data = r.pread(off, step)
                        out.write(data)
                        bar.update(len(data))
                    out.flush()
                    os.fsync(out.fileno())
                os.rename(tmp, args.local_file)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        _warn_bad_replicas(vol)
    return 0


def _warn_bad_replicas(vol: Volume) -> None:
    for bad in vol.store.bad_replicas:
        print(
            f"ckptfs: warning: bad replica of chunk {bad.cid.hex()} on node {bad.node}: "
            f"{bad.reason} (served from another replica)",
            file=sys.stderr,
        )


def _mode_str(mode: int) -> str:
    return stat.filemode(mode)


def cmd_ls(args: argparse.Namespace) -> int:
    with Volume.open(args.volume) as vol:
        attr = vol.resolve(args.vol_path)
        entries = vol.listdir(args.vol_path) if attr.is_dir else [(b"", attr)]
        for name, a in entries:
            label = shown(name) or shown(args.vol_path)
            if a.is_dir:
                label += "/"
            print(f"{_mode_str(a.mode)} {a.size:>14} {label}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with Volume.open(args.volume) as vol:
        attr = vol.resolve(args.vol_path)
        if attr.is_dir and not args.recursive:
            raise UserError(f"{args.vol_path} is a directory (use -r)")
        if attr.is_dir:
            for path, _attr in sorted(vol.walk(args.vol_path), key=lambda t: -t[0].count("/")):
                vol.unlink(path)
        vol.unlink(args.vol_path)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with Volume.open(args.volume) as vol:
        st = vol.stats()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        for k, v in st.items():
            shown = format_size(v) if k.endswith("_bytes") else v
            print(f"{k:20} {shown}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptfs", description="checkpoint storage for training jobs")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    f = sub.add_parser("format", help="create a volume")
    f.add_argument("volume", help="volume directory")
    f.add_argument(
        "--nodes",
        type=int,
        default=4,
        help="local directory nodes without --node (default 4), in VOLUME.nodes/ beside the "
        "volume directory, so the chunks and metadata backups outlive its loss",
    )
    f.add_argument(
        "--node",
        action="append",
        metavar="URL",
        help="node URL (dir:/path or s3://bucket/prefix?endpoint=...), repeatable; "
        "append ?domain=LABEL for failure domains",
    )
    f.add_argument("--replicas", "-r", type=int, default=2)
    f.add_argument("--chunk-size", type=size_arg, default=4 * 2**20)
    f.add_argument("--chunking", choices=["fixed", "cdc"], default="fixed")
    f.add_argument("--cdc-min", type=size_arg, default=None)
    f.add_argument("--cdc-max", type=size_arg, default=None)
    f.add_argument(
        "--backup-interval",
        type=float,
        default=3600.0,
        metavar="S",
        help="seconds between automatic metadata backups onto the nodes, 0 for none",
    )
    f.add_argument("--backup-keep", type=int, default=7, metavar="N", help="backups kept")
    f.add_argument("--compression", choices=list(CODECS), default="auto")
    f.add_argument("--db", default=None, help="postgresql://... (default: embedded SQLite)")
    f.set_defaults(func=cmd_format)

    g = sub.add_parser("put", help="copy a local file into the volume")
    g.add_argument("volume")
    g.add_argument("local_file", help="a local file, or - for standard input (./- for a file)")
    g.add_argument("vol_path")
    g.set_defaults(func=cmd_put)

    g = sub.add_parser("get", help="copy a file out of the volume")
    g.add_argument("volume")
    g.add_argument("vol_path")
    g.add_argument("local_file", help="a local file, or - for standard output (./- for a file)")
    g.set_defaults(func=cmd_get)

    g = sub.add_parser("ls", help="list a directory")
    g.add_argument("volume")
    g.add_argument("vol_path", nargs="?", default="/")
    g.set_defaults(func=cmd_ls)

    g = sub.add_parser("rm", help="remove a file (or a tree with -r)")
    g.add_argument("volume")
    g.add_argument("vol_path")
    g.add_argument("-r", "--recursive", action="store_true")
    g.set_defaults(func=cmd_rm)

    g = sub.add_parser("stats", help="logical vs stored bytes, dedup and compression")
    g.add_argument("volume")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_stats)

    for modname in COMMAND_MODULES:
        importlib.import_module(modname).register(sub)
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            mod = ep.load()
        except ModuleNotFoundError as e:  # an optional part not installed: no command
            log.debug("command plugin %s: %s", ep.value, e)
            continue
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="ckptfs: %(levelname)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except BaseException as e:  # noqa: BLE001 - _report re-raises what is not a user's error
        return _report(sole_error(e))


def sole_error(e: BaseException) -> BaseException:
    """The one error inside (nested) exception groups, or `e` itself.

    trio >= 0.25 raises what fails inside a nursery as an ExceptionGroup, also when only one
    task failed (the others are cancelled): a taken --listen port or a refused database
    arrives wrapped. Unwrapped while exactly one error that is not a cancellation is left,
    so it prints as its one line; a group of several real errors stays a group (a bug)."""
    while isinstance(e, BaseExceptionGroup):
        real = [x for x in e.exceptions if not _is_cancellation(x)]
        if len(real) != 1:
            return e
        e = real[0]
    return e


def _is_cancellation(e: BaseException) -> bool:
    import trio  # noqa: PLC0415 - trio is loaded by any command that makes groups

    if isinstance(e, BaseExceptionGroup):
        return all(_is_cancellation(x) for x in e.exceptions)
    return isinstance(e, trio.Cancelled)


def _report(e: BaseException) -> int:
    """One line on stderr for a user's error (its exit status); anything else re-raised."""
    if isinstance(e, KeyboardInterrupt):
        print("ckptfs: interrupted", file=sys.stderr)
        return 130
    if isinstance(e, MetaError):
        code = errno.errorcode.get(e.errno, e.errno) if e.errno else None
        tail = f" ({code})" if code else ""
        print(f"ckptfs: error: {shown(str(e))}{tail}", file=sys.stderr)
        return 1
    if isinstance(e, OSError) and e.strerror and not isinstance(e, MetaError):
        # "[Errno 98] ..." is Python's, not the user's: the message, and the file it names
        text = f"{e.strerror}: {e.filename}" if e.filename is not None else e.strerror
        print(f"ckptfs: error: {shown(text)}", file=sys.stderr)
        return 1
    if isinstance(e, UserError | VolumeError | ValueError | ChunkStoreError | NodeError | OSError):
        print(f"ckptfs: error: {shown(str(e))}", file=sys.stderr)
        return 1
    raise e
