"""Names on a terminal. File, job and host names come from users and clients and may hold
anything but `/` and NUL, terminal escape sequences included: human output shows what is
not printable escaped (`\\x1b`, `\\n`, undecodable bytes as `\\xff`). JSON output is
exact and never goes through here."""

from __future__ import annotations

import os


def shown(text: str | bytes | None) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    if 0xDC80 <= n <= 0xDCFF:  # a byte os.fsdecode could not decode (surrogateescape)
        return f"\\x{n - 0xDC00:02x}"
    return c.encode("unicode_escape").decode("ascii")
