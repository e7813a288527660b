"""The agent's way to the metadata: its one service connection, or the embedded engine.

`RemoteUpstream` sends each rank's request over the agent's RemoteEngine (one connection,
with failover) carrying the rank's own token and idempotency key: the service checks the
rank's role and scope as if the rank had connected, and a retry through a restarted agent
is applied once. The sends run in one sender thread (a service that stops reading must not
stall the loop), fed by a queue: what the loop queued while it sent goes in its next
write, one hand-off for many requests (a trio thread hop per request was ~15% of an
agent's CPU in a 4,096-rank save). The answer comes back as a concurrent Future, awaited
on the trio loop by a done-callback: no thread waits for the service.

`LocalUpstream` calls an embedded engine (a volume directory's SQLite) in worker threads,
bounded by a limiter. Whoever can open the volume directory is its administrator, so
there is no credential to check.

Both answer `commit_ranks(job, step, ranks)` (a host's commits as one request, each rank's
outcome on its own); the remote one says ENOSYS when the service predates it, and the
batcher falls back to one commit_rank per rank.
"""

from __future__ import annotations

import errno
import threading
from collections import deque
from concurrent.futures import Future
from functools import partial
from typing import Any

import trio

from metadata.engine import MetaEngine, MetaError
from metadata.wire.protocol import REMOTE_METHODS

THREADS = 8  # engine calls of an embedded volume at once


async def wait_future(fut: Future) -> Any:
    """A concurrent Future's result, awaited without a thread."""
    if not fut.done():
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_f: Future) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        fut.add_done_callback(wake)
        await done.wait()
    return fut.result()


def _chain(inner: Future, outer: Future) -> None:
    """Complete `outer` as `inner` completes."""

    def done(f: Future) -> None:
        e = f.exception()
        if e is None:
            outer.set_result(f.result())
        else:
            outer.set_exception(e)

    inner.add_done_callback(done)


UPSTREAM_COUNTERS = ("failovers", "reconnects", "hangs")


class RemoteUpstream:
    """A `ckptfs://` volume: the agent's RemoteEngine, each request on a rank's behalf."""

    remote = True

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._queue: deque[tuple[list, Future]] = deque()
        self._cv = threading.Condition()
        self._sender: threading.Thread | None = None
        self._closed = False

    async def call(
        self, token: str, method: str, args: list, kwargs: dict, key: bytes | None = None
    ) -> Any:
        enc = self.engine.encode_many([(method, tuple(args), kwargs)], token=token, keys=[key])
        out: Future = Future()
        with self._cv:
            if self._closed:
                raise MetaError(errno.EBADF, "the agent's upstream is closed")
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_loop, name="ckptfs-agent-send", daemon=True
                )
                self._sender.start()
            self._queue.append((enc, out))
            self._cv.notify()
        return await wait_future(out)

    def _send_loop(self) -> None:
        """Send what is queued, all of it in one submit, until closed and drained."""
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
            try:
                futs = self.engine.submit_encoded([e for enc, _ in batch for e in enc])
            except Exception as e:  # closed, or its connection failed for good: each caller
                for _, out in batch:
                    out.set_exception(e)
                continue
            for (_, out), fut in zip(batch, futs, strict=True):
                _chain(fut, out)

    def close(self) -> None:
        """Stop the sender once what is queued is sent (the agent's serve ends)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            sender = self._sender
        if sender is not None:
            sender.join(timeout=5)

    def connections(self) -> int:
        """Connections this agent opened to the service (the first, then each reconnect)."""
        return 1 + int(getattr(self.engine, "reconnects", 0))

    def counters(self) -> dict[str, int]:
        """Its failovers (to another replica), reconnects and hangs (connections left for
        silence or a missed deadline): the host's, as a rank's own client counts them."""
        return {k: int(getattr(self.engine, k, 0) or 0) for k in UPSTREAM_COUNTERS}


class LocalUpstream:
    """An embedded engine, called in threads (no credential: module docstring)."""

    remote = False

    def __init__(self, engine: MetaEngine, config: dict) -> None:
        self.engine = engine
        self.config = config
        self.limiter = trio.CapacityLimiter(THREADS)

    async def call(
        self, token: str, method: str, args: list, kwargs: dict, key: bytes | None = None
    ) -> Any:
        if method not in REMOTE_METHODS:  # (commit_ranks, before the engine had it)
            raise MetaError(errno.ENOSYS, f"unknown method {method!r}")
        if method == "get_config":
            return self.config
        return await self._run(getattr(self.engine, method), *args, **kwargs)

    async def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return await trio.to_thread.run_sync(partial(fn, *args, **kw), limiter=self.limiter)

    def connections(self) -> int:
        return 0

    def counters(self) -> dict[str, int]:
        return dict.fromkeys(UPSTREAM_COUNTERS, 0)

    def close(self) -> None:
        """Nothing of its own to stop (its threads are trio's)."""
