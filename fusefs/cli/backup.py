"""`ckptfs meta backup|backups|restore|dump|load`: metadata backups on the object nodes,
restoring a volume from its nodes alone, and moving a volume between SQLite and
PostgreSQL through one engine-independent dump (metadata/sql/dump.py, fusefs/maint/backup.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

from fusefs.cli.text import shown
from fusefs.cli.units import format_size
from fusefs.client.volume import VOLUME_FILE, Volume, making_volume, write_volume_file
from fusefs.maint import backup as bk
from metadata.engines import open_engine
from metadata.sql.dump import DumpError, load_dump, read_records, write_dump


def _user_error(msg: str) -> Exception:
    from fusefs.cli.main import UserError

    return UserError(msg)


def _local(volume: str) -> str:
    if volume.startswith("ckptfs://"):
        raise _user_error(
            "backup, dump and restore read the database itself: run them where the volume "
            "directory is (the service's), not through ckptfs://"
        )
    return volume


def cmd_backup(args: argparse.Namespace) -> int:
    with Volume.open(_local(args.volume)) as vol:
        try:
            m = bk.create_backup(vol, keep=args.keep)
        except (bk.BackupError, DumpError) as e:
            raise _user_error(str(e)) from None
    if args.json:
        print(json.dumps(m, indent=2))
    else:
        print(
            f"backup {m['id']}: {m['files']} files, {m['checkpoints']} checkpoints, "
            f"{m['extents']} extents, {format_size(m['size'])} in {len(m['pieces'])} "
            f"object(s) on the nodes ({m['seconds']:.1f} s)"
        )
    return 0


def cmd_backups(args: argparse.Namespace) -> int:
    nodes = _nodes(args.node)
    try:
        scan = bk.scan_backups(nodes)
    finally:
        for n in nodes:
            n.close()
    found = scan.backups
    key = bk.read_key(args.key) if args.key else None
    for m in found:
        m["verified"] = bk.verify(m, key) if key is not None else None
    for p in scan.problems:  # planted or damaged objects: named, skipped
        print(
            f"ckptfs: warning: backup object {p['object']} skipped: {shown(p['problem'])}",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    if not found:
        print("no backups on these nodes")
        _print_problems(scan.problems)
        return 0
    print(
        f"{'ID':>12} {'CREATED':20} {'SIZE':>10} {'FILES':>9} {'CHECKPOINTS':>11} "
        f"{'VERIFIED':>8}  VOLUME"
    )
    for m in found:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["created"]))
        print(
            f"{m['id']:>12} {when:20} {format_size(m['size']):>10} {m['files']:>9} "
            f"{m['checkpoints']:>11} {_verified(m['verified']):>8}  {shown(str(m.get('volume')))}"
        )
    _print_problems(scan.problems)
    return 0


def _verified(v: bool | None) -> str:
    return "?" if v is None else ("yes" if v else "NO")


def _print_problems(problems: list[dict]) -> None:
    if problems:
        print(f"{len(problems)} backup object(s) unreadable or ill-formed, skipped:")
        for p in problems:
            print(f"  {p['object']}  {shown(p['problem'])}")


def _nodes(urls: list[str]) -> list:
    try:
        return bk.open_nodes(urls)
    except ValueError as e:
        raise _user_error(str(e)) from None


def cmd_restore(args: argparse.Namespace) -> int:
    if args.key and args.no_verify:
        raise _user_error("give --key FILE or --no-verify, not both")
    if not args.key and not args.no_verify:
        raise _user_error(
            "restore verifies the backup with the volume's backup key: give --key FILE (the "
            "copy of VOL/backup.key), or --no-verify to restore an unverified backup"
        )
    if args.no_verify:
        print(
            "ckptfs: warning: --no-verify: the backup is not verified (whoever can write a "
            "node can forge one): restoring the newest found alike on R nodes",
            file=sys.stderr,
        )
    try:
        key = bk.read_key(args.key) if args.key else None
        rep = bk.restore(
            args.new_volume, args.node, backup=args.backup, db=args.db, key=key,
            no_verify=args.no_verify,
        )  # fmt: skip
    except bk.BackupError as e:
        raise _user_error(str(e)) from None
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        print(
            f"restored backup {rep.backup} into {shown(rep.path)}: {rep.files} files, "
            f"{rep.checkpoints} checkpoints, {rep.chunks} chunks ({rep.seconds:.1f} s)"
        )
        for cid in rep.missing_chunks[:20]:
            print(f"  missing on every node: chunk {cid}")
    if rep.missing_chunks:
        print(
            f"ckptfs: warning: {len(rep.missing_chunks)} chunk(s) the backup names are on no "
            "node; `ckptfs fsck` names the files that use them",
            file=sys.stderr,
        )
        return 2
    return 0


def cmd_backup_key(args: argparse.Namespace) -> int:
    path = os.path.abspath(_local(args.volume))
    if not os.path.exists(os.path.join(path, VOLUME_FILE)):
        raise _user_error(f"{path} is not a volume directory")
    try:
        kpath, made = bk.make_key(path)
        kid = bk.key_id(bk.read_key(kpath))
    except (OSError, bk.BackupError) as e:
        raise _user_error(str(e)) from None
    print(
        f"{'made' if made else 'have'} the backup key {shown(kpath)} (id {kid}): copy it off "
        "this host (restore --key needs it after the volume is lost) and into the volume "
        "directory of every service replica"
    )
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    path = os.path.abspath(_local(args.volume))
    with Volume.open(path) as vol:
        absolute = partial(bk.absolute_nodes, base=path)
        if args.file == "-":
            counts = write_dump(vol.meta, sys.stdout.buffer, config_fn=absolute)
        else:
            tmp = args.file + ".tmp"
            with open(tmp, "wb") as f:
                counts = write_dump(vol.meta, f, config_fn=absolute)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, args.file)
    rows = sum(counts["rows"].values())
    print(
        f"dumped {counts['files']} files, {counts['checkpoints']} checkpoints, "
        f"{counts['extents']} extents ({rows} rows)",
        file=sys.stderr if args.file == "-" else sys.stdout,
    )
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    path = os.path.abspath(args.new_volume)
    if os.path.exists(os.path.join(path, VOLUME_FILE)):
        raise _user_error(f"{path} already holds a volume")
    meta_url = args.db or "sqlite:meta.db"
    infos = bk.node_infos(args.node) if args.node else None

    def config(cfg: dict) -> dict:
        if infos is None:
            return cfg
        return {**cfg, "nodes": [{"name": i.name, "url": i.url, "domain": i.domain} for i in infos]}

    try:
        src = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")  # noqa: SIM115
    except OSError as e:
        raise _user_error(f"cannot read {args.file}: {e.strerror}") from None
    try:
        with making_volume(path):
            engine = open_engine(meta_url, path)
            try:
                out = load_dump(engine, read_records(src), config_fn=config)
                write_volume_file(path, meta_url)
            finally:
                engine.close()
    except DumpError as e:
        raise _user_error(f"{args.file}: {e}") from None
    finally:
        if src is not sys.stdin.buffer:
            src.close()
    print(
        f"loaded {out['files']} files, {out['checkpoints']} checkpoints, "
        f"{out['extents']} extents into {shown(path)} ({meta_url.split('://')[0].split(':')[0]})"
    )
    return 0


def register_meta(msub: argparse._SubParsersAction) -> None:
    """Subcommands of `ckptfs meta` (called by fusefs.cli.service.register)."""
    b = msub.add_parser("backup", help="back the metadata up onto the object nodes")
    b.add_argument("volume", metavar="VOLUME")
    keep = f"keep the newest K backups (default: backup_keep, {bk.BACKUP_KEEP})"
    b.add_argument("--keep", type=int, default=None, metavar="K", help=keep)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_backup)
    ls = msub.add_parser("backups", help="list the backups found on object nodes")
    ls.add_argument("--node", action="append", required=True, metavar="URL")
    ls.add_argument("--key", default=None, metavar="FILE", help="show which backups verify")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_backups)
    r = msub.add_parser("restore", help="rebuild a volume from a backup on its nodes")
    r.add_argument("new_volume", metavar="NEWVOLUME")
    r.add_argument("--node", action="append", required=True, metavar="URL",
                   help="the volume's nodes, in its order (repeat)")  # fmt: skip
    r.add_argument("--backup", type=int, default=None, metavar="ID", help="default: newest")
    r.add_argument("--db", default=None, metavar="URL", help="postgresql://... (default SQLite)")
    r.add_argument("--key", default=None, metavar="FILE",
                   help="the volume's backup key (a copy of VOL/backup.key): restore only a "
                   "backup that verifies; required unless --no-verify")  # fmt: skip
    r.add_argument("--no-verify", action="store_true",
                   help="restore without a key: the newest backup found alike on R nodes, "
                   "unverified (trusts whatever the nodes hold)")  # fmt: skip
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_restore)
    d = msub.add_parser("dump", help="write the metadata to a file (engine-independent)")
    d.add_argument("volume", metavar="VOLUME")
    d.add_argument("file", metavar="FILE", help="- for stdout")
    d.set_defaults(func=cmd_dump)
    lo = msub.add_parser("load", help="make a new volume from a dump (SQLite or PostgreSQL)")
    lo.add_argument("file", metavar="FILE", help="- for stdin")
    lo.add_argument("new_volume", metavar="NEWVOLUME")
    lo.add_argument("--db", default=None, metavar="URL", help="postgresql://... (default SQLite)")
    lo.add_argument("--node", action="append", default=None, metavar="URL",
                    help="use these nodes instead of the dump's (repeat)")  # fmt: skip
    lo.set_defaults(func=cmd_load)
    k = msub.add_parser("backup-key", help="make (if missing) and show the backup key")
    k.add_argument("volume", metavar="VOLUME")
    k.set_defaults(func=cmd_backup_key)
