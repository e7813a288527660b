"""`ckptfs meta serve` (the metadata service) and `ckptfs checkpoints` (inspect steps)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import time
from functools import partial

from fusefs.cli.text import shown
from fusefs.cli.units import format_size, parse_listen, parse_seconds
from fusefs.client.volume import VOLUME_FILE, VolumeError
from metadata.engine import MetaEngine, MetaError
from metadata.engines import DB_WAIT_S, open_engine
from metadata.wire.protocol import IDLE_TIMEOUT, MAX_CONNECTIONS, MAX_FRAME, MEMORY_BUDGET
from metadata.wire.url import read_token_file

TOKEN_FILE = "meta.token"


def _volume_desc(path: str) -> dict:
    vf = os.path.join(path, VOLUME_FILE)
    try:
        with open(vf) as f:
            return json.load(f)
    except FileNotFoundError:
        raise VolumeError(f"no volume at {path} (run `ckptfs format {path}` first)") from None
    except (OSError, ValueError) as e:
        raise VolumeError(f"cannot read {vf}: {e}") from e


def open_meta(spec: str, db: str | None = None) -> MetaEngine:
    """The metadata engine of a volume dir, or a client of a ckptfs:// service."""
    if spec.startswith("ckptfs://"):
        from metadata.client import connect

        return connect(spec)
    path = os.path.abspath(spec)
    return open_engine(db or _volume_desc(path)["meta"], path)


def ensure_token(path: str) -> str:
    """Read the token file, creating it (0600, 256 random bits) if it does not exist."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            token = read_token_file(path)  # refused if group or others may access it
        except MetaError as e:
            raise VolumeError(str(e)) from None
        if len(token) < 16:
            raise VolumeError(f"token file {path} holds fewer than 16 characters") from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    return token


def listen_arg(text: str) -> tuple[str, int]:
    """argparse type of --listen and --metrics: HOST:PORT."""
    try:
        return parse_listen(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    """argparse type of --max-connections: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def _budget_arg(text: str) -> int:
    """argparse type of --memory-budget: a size of at least 1 MiB."""
    from fusefs.cli.main import size_arg

    v = size_arg(text)
    if v < 1 << 20:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1MiB, got {text!r}")
    return v


def _raise_fd_limit() -> None:
    """Every client holds a descriptor: take the hard limit, not the soft one (often 1024),
    so thousands of ranks, and idle connections waiting to be dropped, fit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from metadata.server.service import MetaService

    path = os.path.abspath(args.volume)
    desc = _volume_desc(path)
    token_file = args.token_file or os.path.join(path, TOKEN_FILE)
    token = ensure_token(token_file)
    tls = None
    if args.tls_cert or args.tls_key:
        from fusefs.cli.main import UserError
        from metadata.wire.tls import server_context

        if not args.tls_cert:
            raise UserError("--tls-key needs --tls-cert")
        tls = server_context(args.tls_cert, args.tls_key)  # before opening anything
    engine = open_engine(args.db or desc["meta"], path, wait_s=args.db_wait)
    engine.get_config()  # fail now, with one line, if the engine holds no volume
    _raise_fd_limit()
    host, port = args.listen
    service = MetaService(
        engine,
        token,
        base_dir=path,
        max_frame=args.max_frame,
        threads=args.threads,
        idle_timeout=args.idle_timeout,
        max_connections=args.max_connections,
        memory_budget=args.memory_budget,
    )
    logging.getLogger("ckptfs.meta").setLevel(logging.INFO if not args.verbose else logging.DEBUG)
    metrics = None
    if args.metrics:
        from fusefs.cli.main import UserError
        from fusefs.metrics import MetricsError, serve_service_metrics

        try:
            metrics = serve_service_metrics(args.metrics, service)
        except MetricsError as e:
            engine.close()
            raise UserError(f"{e} (--metrics)") from None

    from fusefs.client.volume import Volume
    from fusefs.maint.backup import run_auto_backups

    # The nodes of the volume, for its automatic metadata backups (fusefs.maint.backup).
    backups = Volume(engine, engine.get_config(), base_dir=path, workers=1)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_auto_backups, backups)
            bound = await nursery.start(partial(service.serve, host, port, ssl_context=tls))
            mode = ", TLS" if tls else ", no TLS: trusted networks only"
            where = f", metrics {metrics.url}" if metrics else ""
            print(
                f"ckptfs meta: serving {path} on {host}:{bound} (token {token_file}{mode}{where})",
                flush=True,
            )

    try:
        trio.run(main)
    finally:
        if metrics is not None:
            metrics.close()
        backups.pool.shutdown(wait=False)  # not backups.close(): the engine is the service's
        backups.store.close()
        engine.close()
    return 0


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def cmd_list(args: argparse.Namespace) -> int:
    with open_meta(args.volume) as meta:
        rows = meta.list_checkpoints(args.job)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    # Columns as wide as what they hold (a job name of any length stays in its column).
    table = [
        (
            shown(r["job"]),
            str(r["step"]),
            r["state"],
            f"{r['committed']}/{r['world_size']}",
            str(r["files"]),
            format_size(r["bytes"]),
            _when(r["created"]),
        )
        for r in rows
    ]
    head = ("JOB", "STEP", "STATE", "RANKS", "FILES", "SIZE", "CREATED")
    width = [max(len(x) for x in col) for col in zip(head, *table, strict=False)]
    right = (False, True, False, True, True, True, False)
    for line in (head, *table):
        cells = [
            (c.rjust(w) if r else c.ljust(w)) for c, w, r in zip(line, width, right, strict=True)
        ]
        print((" ".join(cells[:-1]) + "  " + cells[-1]).rstrip())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with open_meta(args.volume) as meta:
        info = meta.checkpoint_info(args.job, args.step)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"checkpoint {shown(info['job'])} step {info['step']}: {info['state']}")
    if info["reason"]:
        print(f"  reason:     {shown(info['reason'])}")
    print(f"  path:       /{shown(info['path'])}")
    print(f"  ranks:      {info['committed']}/{info['world_size']} committed")
    if info["missing"]:
        print(f"  missing:    {info['missing']}")
    print(f"  size:       {format_size(info['bytes'])} (new {format_size(info['new_bytes'])})")
    print(f"  dedup:      {info['dedup_ratio'] if info['dedup_ratio'] else '-'}")
    print(f"  created:    {_when(info['created'])}   published: {_when(info['published'])}")
    strag = info["stragglers"]
    print(f"  stragglers: {', '.join(map(str, strag)) if strag else 'none'}")
    ranks = info["ranks"]
    listed = (
        ranks
        if args.all or len(ranks) <= 64
        else ranks[:32] + [r for r in ranks[32:] if r["straggler"]]
    )
    print(f"  {'RANK':>6} {'COMMIT_S':>9} {'FILES':>6} {'BYTES':>10}  HOST")
    for r in listed:
        flag = "  straggler" if r["straggler"] else ""
        print(
            f"  {r['rank']:>6} {r['commit_s']:>9.3f} {r['files']:>6} "
            f"{format_size(r['bytes']):>10}  {shown(r['host']) or '-'}{flag}"
        )
    if len(listed) < len(ranks):
        print(f"  ... {len(ranks) - len(listed)} more ranks (use --all)")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    with open_meta(args.volume) as meta:
        res = meta.delete_checkpoint(args.job, args.step)
    freed = res["inodes_freed"]
    print(f"{shown(args.job)} step {args.step}: {res['state']} ({freed} inodes freed)")
    print("chunks no other step uses are reclaimed by `ckptfs gc` after the grace period")
    return 0


def cmd_retain(args: argparse.Namespace) -> int:
    with open_meta(args.volume) as meta:
        if args.policy:
            meta.set_retention(args.job, args.keep_last)
        deleted = meta.retain(args.job, args.keep_last)
    kept = f"keeping the newest {args.keep_last}"
    print(f"{shown(args.job)}: deleted {len(deleted)} step(s) {deleted if deleted else ''}, {kept}")
    if args.policy:
        print(f"{shown(args.job)}: policy stored, applied after every publish of this job")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from fusefs.cli.main import size_arg

    m = sub.add_parser("meta", help="the metadata service")
    msub = m.add_subparsers(dest="meta_command", required=True, metavar="ACTION")
    from fusefs.cli.backup import register_meta

    register_meta(msub)  # backup, backups, restore, dump, load
    from fusefs.cli.pg import register as register_postgres

    register_postgres(msub)  # postgres: a private cluster for a volume's metadata
    s = msub.add_parser("serve", help="serve a volume's metadata over TCP")
    s.add_argument("volume", help="volume directory (object nodes, token file)")
    s.add_argument("--listen", type=listen_arg, default=("127.0.0.1", 7410), metavar="HOST:PORT")
    s.add_argument("--db", default=None, help="postgresql://... (default: the volume's engine)")
    s.add_argument(
        "--db-wait",
        type=partial(parse_seconds, positive=False),
        default=DB_WAIT_S,
        metavar="SECONDS",
        help=f"at start, wait this long for a PostgreSQL server that does not answer yet, as "
        f"a running replica waits after losing it "
        f"(a database restarting with its replicas; default {DB_WAIT_S:g}, 0: fail at once)",
    )
    s.add_argument("--token-file", default=None, help=f"default VOLUME/{TOKEN_FILE}, created")
    s.add_argument("--max-frame", type=size_arg, default=MAX_FRAME)
    s.add_argument("--threads", type=int, default=8, help="engine worker threads")
    s.add_argument(
        "--idle-timeout",
        type=parse_seconds,
        default=IDLE_TIMEOUT,
        metavar="SECONDS",
        help=f"close a client connection idle this long (default {IDLE_TIMEOUT:g}; "
        "clients reconnect on their next call)",
    )
    s.add_argument(
        "--max-connections",
        type=_positive_int,
        default=MAX_CONNECTIONS,
        metavar="N",
        help=f"authenticated connections at most (default {MAX_CONNECTIONS}); past it the "
        "least recently active idle one is closed, or with none idle the new one refused",
    )
    s.add_argument(
        "--memory-budget",
        type=_budget_arg,
        default=MEMORY_BUDGET,
        metavar="SIZE",
        help=f"bytes of answers queued and frames half received, all connections together "
        f"(default {MEMORY_BUDGET >> 20}MiB, at least 1MiB); past it the connections "
        "stalled longest are dropped",
    )
    s.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS: certificate chain")
    s.add_argument("--tls-key", default=None, metavar="PEM", help="its key (default: in the cert)")
    s.add_argument(
        "--metrics",
        type=listen_arg,
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics",
    )
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("checkpoints", help="list and inspect checkpoint steps")
    c.add_argument("volume", help="volume directory or ckptfs://HOST:PORT")
    csub = c.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    ls = csub.add_parser("list", help="steps of every job, or of one")
    ls.add_argument("job", nargs="?", default=None)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    sh = csub.add_parser("show", help="state, size, dedup and the per-rank timeline of a step")
    sh.add_argument("job")
    sh.add_argument("step", type=int)
    sh.add_argument("--json", action="store_true")
    sh.add_argument("--all", action="store_true", help="every rank, however many")
    sh.set_defaults(func=cmd_show)
    de = csub.add_parser("delete", help="delete a published step (gc reclaims its chunks)")
    de.add_argument("job")
    de.add_argument("step", type=int)
    de.set_defaults(func=cmd_delete)
    rt = csub.add_parser("retain", help="delete all but the newest K published steps of a job")
    rt.add_argument("job")
    rt.add_argument("--keep-last", type=int, required=True, metavar="K")
    rt.add_argument(
        "--policy", action="store_true", help="also store K as the job's policy (after publish)"
    )
    rt.set_defaults(func=cmd_retain)


if __name__ == "__main__":  # pragma: no cover
    from fusefs.cli.main import main

    sys.exit(main())
