"""A terminal progress bar for long work (put, get, flush, scrub), silent off a tty."""

from __future__ import annotations

import sys
import time

from fusefs.cli.units import format_size


class Progress:
    def __init__(self, total: int, label: str, *, enabled: bool | None = None, unit: str = "B"):
        self.total = max(total, 0)
        self.label = label
        self.done = 0
        self.unit = unit
        self.start = time.monotonic()
        self._last = 0.0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _fmt(self, n: float) -> str:
        return format_size(n) if self.unit == "B" else f"{n:.0f} {self.unit}"

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        rate = self.done / max(now - self.start, 1e-6)
        sys.stderr.write(
            f"\r{self.label} [{bar}] {frac * 100:5.1f}% {self._fmt(self.done)}/"
            f"{self._fmt(self.total)} {self._fmt(rate)}/s "
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
