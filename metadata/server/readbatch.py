"""Read requests answered in batches by one dedicated thread.

When a job restarts, thousands of ranks ask the same questions at the same
moment (`latest`, `step_state`, `checkpoint_info`), and a remote mount sends
`lookup`/`getattr` for every file it opens. Each read used to cost a trio task,
a worker-thread hop and a turn at the engine's lock (both engines serialize on
one connection): 4096 pipelined `latest` calls took 1.7-2.0 s, over twenty
times the protocol floor.

Here the loop only queues a read (`submit`); one thread takes everything
queued, runs it, and hands the outcomes back with one `run_sync_soon` per
slice (one thread is enough: the engine runs one call at a time anyway).
Identical calls (same method and arguments) in one batch run once and share
the answer.

Why a shared answer is never stale: a batch is taken only after each of its
requests was queued, and it runs after that, so every answer reflects every
write acknowledged before its request arrived, exactly as if the request had
run alone. (Joining a read already running would not have that property.)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import trio

from metadata.engine import MetaEngine, MetaError, internal_error, shutting_down

log = logging.getLogger("ckptfs.meta")

SLICE_S = 0.005  # hand finished answers back at least this often within a long batch
SLICE_N = 256  # ...or every this many calls
SLICE_BYTES = 1 << 20  # ...or once its bytes results (xattrs, inline data) hold this much
# Slices handed back and not yet answered by the loop, at most: the thread waits past it.
# Unbounded, 8 clients' 8,000 get_xattr of 64 KiB were read far faster than the loop
# answered them, and their results (500 MB) waited in the loop's queue, outside the
# service's memory budget (budget.py).
SLICES_AHEAD = 2

Outcome = tuple[Any, BaseException | None]


def _key(method: str, args: list, kwargs: dict) -> tuple | None:
    """A hashable identity for a call, or None (unhashable arguments: run it alone)."""
    try:
        key = (method, tuple(args), tuple(sorted(kwargs.items())))
        hash(key)
    except TypeError:
        return None
    return key


class ReadBatcher:
    """`run` it in the service's nursery; `submit` reads from the loop. Each read's
    `slot.set(result, error=...)` is called on the loop."""

    def __init__(self, engine: MetaEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._queue: list[tuple[str, list, dict, Any]] = []
        self._stopping = False
        self._ahead = threading.Semaphore(SLICES_AHEAD)

    def submit(self, method: str, args: list, kwargs: dict, slot: Any) -> None:
        with self._cond:
            self._queue.append((method, args, kwargs, slot))
            if len(self._queue) == 1:
                self._cond.notify()

    async def run(self) -> None:
        """Serve until cancelled. Reads still queued then are answered EAGAIN (the
        service is going away: retry), as a read task cancelled mid-call is."""
        token = trio.lowlevel.current_trio_token()
        self._stopping = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, self._loop, token)
            try:
                await trio.sleep_forever()
            finally:
                with self._cond:
                    self._stopping = True
                    left, self._queue = self._queue, []
                    self._cond.notify_all()
                self._hand_back([(slot, None, shutting_down()) for *_, slot in left])

    def _loop(self, token: trio.lowlevel.TrioToken) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                batch, self._queue = self._queue, []
            self._run_batch(batch, token)

    def _run_batch(self, batch: list[tuple[str, list, dict, Any]], token: Any) -> None:
        done: dict[tuple, Outcome] = {}
        out: list[tuple[Any, Any, Any]] = []
        since = time.monotonic()
        size = 0
        for method, args, kwargs, slot in batch:
            key = _key(method, args, kwargs)
            outcome = done.get(key) if key is not None else None
            if outcome is None:
                outcome = self._call(method, args, kwargs)
                if key is not None:
                    done[key] = outcome
            out.append((slot, *outcome))
            if type(outcome[0]) is bytes:
                size += len(outcome[0])
            if len(out) >= SLICE_N or size >= SLICE_BYTES or time.monotonic() - since >= SLICE_S:
                self._send_back(out, token)
                out, since, size = [], time.monotonic(), 0
        if out:
            self._send_back(out, token)

    def _send_back(self, out: list[tuple[Any, Any, Any]], token: Any) -> None:
        """Hand a slice to the loop, once it has fewer than SLICES_AHEAD to answer."""
        while not self._ahead.acquire(timeout=0.1):
            if self._stopping:
                return
        token.run_sync_soon(self._answer, out)

    def _answer(self, out: list[tuple[Any, Any, Any]]) -> None:
        self._ahead.release()
        self._hand_back(out)

    def _call(self, method: str, args: list, kwargs: dict) -> Outcome:
        try:
            return getattr(self.engine, method)(*args, **kwargs), None
        except (MetaError, TypeError, ValueError) as e:
            return None, e
        except Exception as e:  # noqa: BLE001 - a bug in one read must not stop the others
            log.exception("%s failed", method)
            return None, internal_error(method, e)

    @staticmethod
    def _hand_back(out: list[tuple[Any, Any, Any]]) -> None:
        for slot, result, error in out:
            slot.set(result, error=error)
