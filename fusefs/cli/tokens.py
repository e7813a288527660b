"""`ckptfs token create|list|revoke VOLUME`: scoped credentials (metadata/sql/tokens.py).

These commands open the volume's metadata database directly: whoever can open it is the
volume's administrator (as whoever can read the volume's token file), so no token is
asked for. Secrets are printed once, at create, and kept only hashed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from fusefs.cli.text import shown

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """`7d`, `12h`, `30m`, `90s` or plain seconds -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"a duration like 7d, 12h, 30m or 90s, not {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def cmd_create(args: argparse.Namespace) -> int:
    from fusefs.cli.service import open_meta

    with open_meta(args.volume) as meta:
        secret = meta.create_token(
            args.name, args.role, args.job, args.prefix, args.expires or 0.0
        )  # fmt: skip
    print(secret)
    scope = [f"job {j}" for j in args.job] + [f"prefix {p}" for p in args.prefix]
    print(
        f"ckptfs: token {args.name} ({args.role}{': ' + ', '.join(scope) if scope else ''}) "
        "created; the secret above is shown only now: keep it in a file only its owner "
        "may read (chmod 600), and pass it as ?token_file=PATH or CKPTFS_TOKEN_FILE",
        file=sys.stderr,
    )
    return 0


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "never"


def cmd_list(args: argparse.Namespace) -> int:
    from fusefs.cli.service import open_meta

    with open_meta(args.volume) as meta:
        recs = meta.list_tokens()
    if args.json:
        print(json.dumps([r.as_dict() for r in recs], indent=2))
        return 0
    rows = [
        (shown(r.name), r.role, ",".join(r.jobs) or "-", ",".join(r.prefixes) or "-",
         _when(r.expires), "expired" if r.expires and r.expires <= time.time() else "")
        for r in recs
    ]  # fmt: skip
    head = ("NAME", "ROLE", "JOBS", "PREFIXES", "EXPIRES", "")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    for row in [head, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from fusefs.cli.service import open_meta

    with open_meta(args.volume) as meta:
        meta.revoke_token(args.name)
    print(f"ckptfs: token {args.name} revoked (services refuse it within a second)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("token", help="scoped credentials of a volume (admin)")
    tsub = t.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    c = tsub.add_parser("create", help="make a token and print its secret once")
    c.add_argument("volume", help="volume directory")
    c.add_argument("--name", required=True, help="a name for logs and revocation")
    c.add_argument("--role", required=True, choices=["admin", "writer", "reader"])
    c.add_argument("--job", action="append", default=[], help="a job it may use (repeat)")
    c.add_argument(
        "--prefix", action="append", default=[], help="a path it may use, e.g. /team-a (repeat)"
    )
    c.add_argument("--expires", type=parse_duration, default=None, help="e.g. 7d, 12h")
    c.set_defaults(func=cmd_create)
    ls = tsub.add_parser("list", help="the volume's tokens (never their secrets)")
    ls.add_argument("volume", help="volume directory")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    r = tsub.add_parser("revoke", help="refuse a token from its next request on")
    r.add_argument("volume", help="volume directory")
    r.add_argument("name")
    r.set_defaults(func=cmd_revoke)
