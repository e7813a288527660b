"""One memory budget for every connection of the service: answers queued and frames half read.

Each connection bounds what it holds (conn.OUT_MAX of queued answers, MAX_INFLIGHT_PER_CONN
requests, one frame of at most --max-frame being received), but only per connection: four
and eight authenticated clients that each sent 1000 get_xattr requests with 64 KiB answers
and never read raised the service's RSS by 292 and 503 MiB, and three that stopped 16 bytes
short of a 64 MiB frame held 219 MiB until the 900 s idle timeout. Times the connection cap
that is no bound at all. So every byte a connection queues for its client, and every byte
of a frame it has not finished receiving, is charged here, against one budget for the
whole service (`meta serve --memory-budget`, MEMORY_BUDGET by default):

- past PAUSE_AT of the budget, a connection with answers queued reads no more requests
  (Conn.full) until its queue drains: a slow reader stops adding to what it holds, a client
  that keeps up is not slowed;
- past SHED_AT of the budget, the connections holding memory are dropped, the one stalled
  longest first (its queue unsent, or its frame not progressing, for the longest time),
  until the service is back under: a well-behaved client, whose queue moves, goes last.
  The rest of the budget is for what is not charged: answers being read from the engine
  and encoded (the read batcher hands them back a slice at a time), requests in flight;
- a frame that stops arriving is dropped after PARTIAL_STALL_S without a byte (checked every
  CHECK_EVERY), whatever the budget: a sender that stalls is not waited for 900 s.

The accounting is by the bytes the connection keeps (answers encoded and queued, the
decoder's partial frame), charged and released on the loop, and costs nothing on the hot
path: an answer written at once and a frame read whole are never charged.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any

import trio

from metadata.wire.protocol import MEMORY_BUDGET

log = logging.getLogger("ckptfs.meta")

# MEMORY_BUDGET (protocol.py, beside the other `meta serve` defaults): 256 MiB, a small host's
PAUSE_AT = 0.75  # of the budget: connections with answers queued stop reading requests
SHED_AT = 0.875  # of the budget: the connections stalled longest are dropped
PARTIAL_STALL_S = 10.0  # seconds without a byte of a frame being received: dropped
CHECK_EVERY = 1.0  # seconds between two looks for stalled frames
# glibc's M_MMAP_THRESHOLD, fixed (see big_buffers_mapped): buffers this big or bigger are
# mapped, not taken from the heap; the 1 MiB receive buffers stay below it.
MMAP_THRESHOLD = 2 << 20
_M_MMAP_THRESHOLD = -3
TRIM_AFTER = 32 << 20  # bytes released from the budget before the heap is trimmed


MIN_BUDGET = 1 << 20


class Budget:
    """The service's budget. Holders are connections (conn.Conn) that keep bytes charged
    here; each has `out_bytes`, `partial_bytes`, `out_since`, `in_since`, `full` and
    `drop(why)`. Everything runs on the service's loop."""

    def __init__(self, limit: int = MEMORY_BUDGET) -> None:
        if limit < MIN_BUDGET:
            raise ValueError(f"memory budget must be at least 1 MiB, got {limit} bytes")
        self.limit = limit
        self.pause_at = int(limit * PAUSE_AT)
        self.shed_at = int(limit * SHED_AT)
        self.used = 0
        self.peak = 0  # the most ever charged at once
        self.tight = False  # used past pause_at: connections with answers queued pause
        self.holders: dict[Any, None] = {}
        self.released = 0  # bytes released since the heap was last trimmed
        self.libc: Any = None  # set by run(): glibc, when the service runs on it
        self.trim_s = 0.0  # time spent trimming the heap, in all
        self.stats = {"dropped_budget": 0, "dropped_stalled": 0}

    def charge(self, conn: Any, n: int) -> None:
        """`conn` keeps `n` more bytes (n < 0: fewer)."""
        self.used += n
        if n > 0:
            self.holders[conn] = None
            if self.used > self.peak:
                self.peak = self.used
            if self.used > self.pause_at:
                self.tight = True
                if self.used > self.shed_at:
                    self._shed()
        else:
            self.released -= n
            if not conn.out_bytes and not conn.partial_bytes:
                self.holders.pop(conn, None)
            if self.tight and self.used <= self.pause_at:
                self.tight = False

    def _shed(self) -> None:
        """Drop holders, the one stalled longest first, until back under SHED_AT."""
        now = time.monotonic()
        while self.used > self.shed_at and self.holders:
            victim = min(self.holders, key=_stalled_since)
            held = victim.out_bytes + victim.partial_bytes
            self.stats["dropped_budget"] += 1
            victim.drop(
                f"the service's memory budget ({self.limit >> 20} MiB) is spent; this "
                f"connection held {held} bytes, stalled {now - _stalled_since(victim):.1f} s"
            )
            self.holders.pop(victim, None)  # (drop released it; never picked twice)
        self.trim()  # now: the next flood must not come on top of what was just freed

    def trim(self) -> None:
        """Give the heap's free pages back to the system, once TRIM_AFTER bytes were
        released (a few ms for hundreds of MiB: after drops, and from run())."""
        if self.libc is not None and self.released > TRIM_AFTER:
            self.released = 0
            t0 = time.perf_counter()
            self.libc.malloc_trim(0)
            self.trim_s += time.perf_counter() - t0

    def check_stalled(self, now: float) -> None:
        """Drop connections whose partial frame got no byte for PARTIAL_STALL_S. One that
        does not read because it is paused (its answers unread) is not stalled by its
        client: its clock restarts."""
        old = now - PARTIAL_STALL_S
        for conn in [c for c in self.holders if c.partial_bytes and c.in_since < old]:
            if conn.full:
                conn.in_since = now
                continue
            self.stats["dropped_stalled"] += 1
            conn.drop(
                f"a frame stopped arriving ({conn.partial_bytes} bytes received, none "
                f"for {now - conn.in_since:.0f} s)"
            )
            self.holders.pop(conn, None)

    async def run(self) -> None:
        """The stalled-frame check, every CHECK_EVERY (in the service's nursery)."""
        self.libc = _libc()
        if self.libc is not None:
            self.libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        while True:
            await trio.sleep(CHECK_EVERY)
            if self.holders:
                self.check_stalled(time.monotonic())
            self.trim()

    def sizes(self) -> dict[str, int]:
        return {"budget_used": self.used, "budget_holders": len(self.holders)}


def _stalled_since(conn: Any) -> float:
    """Since when the connection's held bytes have not moved (its oldest clock of the two)."""
    t = float("inf")
    if conn.out_bytes:
        t = conn.out_since
    if conn.partial_bytes and conn.in_since < t:
        t = conn.in_since
    return t


def _libc() -> Any:
    """glibc, to keep the service's RSS near what it holds (None: another C library).

    Freed memory stays in the process: answers dropped for the budget left the heap at its
    high-water mark, and a later flood of another size (frames) came on top of it (three
    stalled 64 MiB frames after a flood of unread answers: RSS 400 MiB over the start,
    with 224 MiB charged). So, once TRIM_AFTER bytes left the budget, the heap's free
    pages go back to the system (malloc_trim: at once after drops, else every
    CHECK_EVERY); and buffers
    of MMAP_THRESHOLD or more are mapped (glibc's own threshold rises to 32 MiB once a
    mapped buffer is freed: a frame growing by realloc then moved through the heap)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc's, or AttributeError
    except (OSError, AttributeError):
        return None
    return libc
