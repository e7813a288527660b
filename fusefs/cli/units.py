"""Human sizes on the command line (`4MiB`, `512k`, `1.5GB`); bytes everywhere else;
and seconds (`parse_seconds`, an argparse type: service and agent options)."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    m = _RE.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"bad size {text!r}: use e.g. 4MiB, 512KiB, 1GB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT (HOST defaults to 127.0.0.1; IPv6 in brackets) for --listen and --metrics."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, not {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def parse_seconds(text: str, *, positive: bool = True) -> float:
    """argparse type of a number of seconds: > 0 (--idle-timeout, --idle-exit), or >= 0
    with positive=False (--db-wait)."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v > 0 if positive else v >= 0) or v == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected seconds {'>' if positive else '>='} 0, got {text!r}"
        )
    return v
