"""Per-node circuit breakers: a node that just failed is skipped, not waited on.

After a node error (refused, timeout, 5xx) the node is "open" for a backoff
that doubles with each consecutive failure (1 s .. 30 s). While open, writes
go to other nodes (hinted handoff, recorded as under-replicated) and reads try
it last. When the backoff expires, the next request is a probe: success closes
the breaker, failure reopens it for longer. A missing object is an answer,
not a failure: the node is healthy.
"""

from __future__ import annotations

import threading
import time


class NodeHealth:
    def __init__(self, base: float = 1.0, cap: float = 30.0) -> None:
        self.base = base
        self.cap = cap
        self.failures = 0  # consecutive: reset by a success
        self.errors = 0  # every failure since start (a counter for metrics)
        self.down_until = 0.0
        self.last_error = ""
        self._lock = threading.Lock()

    def available(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) >= self.down_until

    def ok(self) -> None:
        if self.failures:
            with self._lock:
                self.failures = 0
                self.down_until = 0.0

    def failed(self, error: str = "") -> None:
        with self._lock:
            self.failures += 1
            self.errors += 1
            backoff = min(self.cap, self.base * 2 ** (self.failures - 1))
            self.down_until = time.monotonic() + backoff
            self.last_error = error

    def reset(self) -> None:
        with self._lock:
            self.failures = 0
            self.down_until = 0.0
