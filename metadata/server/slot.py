"""One outcome awaited by several parties, without a task of its own.

The service answers most requests by callbacks on the loop: an idempotency key's
first outcome answers its retries, a cached manifest answers every rank that asks,
a group commit's written batch answers its ranks. A Slot holds that outcome and
calls back whoever waits for it (a plain callback, or a trio event for a task).
"""

from __future__ import annotations

from typing import Any

import trio


class Slot:
    """One outcome shared by several waiters (an idempotency key, a cached manifest).

    Waiters are plain callbacks or trio events, so answering a request from a
    slot needs no task of its own.
    """

    __slots__ = ("done", "result", "error", "_waiters", "binding", "born")

    def __init__(self) -> None:
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._waiters: list[Any] = []
        self.binding = b""  # a keyed request's: who asked, what (server/access.py)
        self.born = 0.0  # a keyed request's: when it came (IDEM_KEEP_S)

    def set(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.done = result, error, True
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            w(self)

    def add(self, callback: Any) -> None:
        if self.done:
            callback(self)
        else:
            self._waiters.append(callback)

    async def get(self) -> Any:
        if not self.done:
            event = trio.Event()
            self._waiters.append(lambda _s: event.set())
            await event.wait()
        if self.error is not None:
            raise self.error
        return self.result
