"""Operator subcommands: fsck, scrub, gc (registered by fusefs.cli)."""

from __future__ import annotations

import argparse
import json
import sys

from fusefs.cli.text import shown
from fusefs.cli.units import format_size
from fusefs.maint.fsck import DEFAULT_GRACE, Report, check_volume, heal_pending


def _grace(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if val < 0:
        raise argparse.ArgumentTypeError("the grace period cannot be negative")
    return val


def _rate(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate in MB/s: {text!r}") from None
    if val <= 0:
        raise argparse.ArgumentTypeError("the rate must be positive (MB/s)")
    return val


def _print_report(rep: Report, verb: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        for p in rep.problems:
            state = (
                "repaired" if p.repaired else ("NOT repaired: " + p.why_not if p.why_not else "")
            )
            line = f"{p.kind}: {shown(p.detail)}" + (f" [{shown(state)}]" if state else "")
            print(line)
            for f in p.files or ():
                print(f"    used by {shown(f)}")
        left = len(rep.remaining)
        fixed = len(rep.problems) - left
        print(
            f"{verb}: {rep.chunks} chunks, {rep.objects} objects, {rep.replicas_read} replicas "
            f"read ({format_size(rep.bytes_read)}) in {rep.seconds:.1f}s: "
            f"{len(rep.problems)} problem(s), {fixed} repaired, {left} remaining"
            + (
                f"; {rep.staged} chunk(s) still staged in a host's write-behind tier "
                "(checked once uploaded: `ckptfs flush` on that host)"
                if rep.staged
                else ""
            )
            + (f"; {rep.inline} inline chunk(s) checked in the metadata" if rep.inline else ""),
            file=sys.stderr if as_json else sys.stdout,
        )
    return 0 if not rep.remaining else 1


def cmd_fsck(args: argparse.Namespace) -> int:
    from fusefs.client.volume import Volume

    with Volume.open(args.volume) as vol:
        if args.pending:
            done, left = heal_pending(vol)
            print(f"fsck: {done} recorded missing replica(s) restored, {left} still pending")
            return 0 if not left else 1
        rep = check_volume(vol, repair=args.repair, verify=not args.no_verify, grace=args.grace)
        return _print_report(rep, "fsck", args.json)


def cmd_scrub(args: argparse.Namespace) -> int:
    from fusefs.client.volume import Volume
    from fusefs.maint.scrub import scrub

    with Volume.open(args.volume) as vol:
        rep = scrub(vol, rate_mbps=args.rate, repair=not args.no_repair)
        return _print_report(rep, "scrub", args.json)


def cmd_gc(args: argparse.Namespace) -> int:
    from fusefs.client.volume import Volume
    from fusefs.maint.gc import gc

    with Volume.open(args.volume) as vol:
        rep = gc(vol, grace=args.grace)
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        print(
            f"gc: {rep.rows_deleted} unreferenced chunk(s), {rep.objects_deleted} object(s) "
            f"deleted, {format_size(rep.bytes_freed)} freed; {rep.young_objects_skipped} "
            f"object(s) younger than the grace period kept"
            + (
                f"; {rep.tmp_files_deleted} partial write(s) left by a crash removed"
                if rep.tmp_files_deleted
                else ""
            )
        )
        for e in rep.errors:
            print(f"gc: warning: {e}", file=sys.stderr)
    return 0 if not rep.errors else 1


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("fsck", help="check chunks, replicas and refcounts (and --repair)")
    g.add_argument("volume")
    g.add_argument("--repair", action="store_true", help="fix what can be fixed")
    g.add_argument("--json", action="store_true", help="print the report as JSON")
    g.add_argument(
        "--grace",
        type=_grace,
        default=DEFAULT_GRACE,
        metavar="SECONDS",
        help=f"objects without a row younger than this are in-flight writes (default "
        f"{DEFAULT_GRACE:.0f})",
    )
    g.add_argument("--no-verify", action="store_true", help="list only, do not read replicas")
    g.add_argument(
        "--pending",
        action="store_true",
        help="only restore the replicas recorded as missing by degraded writes (fast)",
    )
    g.set_defaults(func=cmd_fsck)

    g = sub.add_parser("scrub", help="read and verify every replica, rewrite bad ones")
    g.add_argument("volume")
    g.add_argument("--json", action="store_true")
    g.add_argument("--rate", type=_rate, default=None, metavar="MB/s", help="read rate limit")
    g.add_argument("--no-repair", action="store_true", help="report only")
    g.set_defaults(func=cmd_scrub)

    g = sub.add_parser("gc", help="delete unreferenced chunks and orphan objects")
    g.add_argument("volume")
    g.add_argument(
        "--grace",
        type=_grace,
        default=DEFAULT_GRACE,
        metavar="SECONDS",
        help=f"keep anything touched more recently than this (default {DEFAULT_GRACE:.0f})",
    )
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_gc)
