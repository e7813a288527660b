"""Group commit for the metadata service: two dedicated threads, validate then write.

Thousands of ranks send commit_rank at the same moment. The service's loop
only queues each one (`submit`); a validation thread takes what is waiting in
chunks of up to VALIDATE_MAX ranks and checks them without the database
(`engine.prepare_commits`, which also makes the rows that need no database,
sql/commitrows.py), and a writer thread writes every chunk validated so far,
up to MAX_BATCH ranks, in one transaction (`engine.merge_prepared`, then
`engine.write_commits`) while the next ones are validated, so the validation
(Python, under the GIL) overlaps the SQL (which runs without it). The writer
is the bottleneck of a burst: small chunks let it start early and never wait
for a big validation to finish (with 2048-rank chunks it sat idle ~40 ms of a
4096-rank publish), and merging keeps its transactions few and large (each
costs ~5 ms beyond its rows). Results go back to the loop with
`run_sync_soon`, in the order the batches were written.

Why threads that live as long as the service, and not a trio task per stage
handing work to `trio.to_thread`: during a burst the loop is busy decoding
~20 MB of requests, four connections a MiB at a time, and every hand-off of
the task pipeline (a thread finishing, a memory channel, a new thread call)
waited for scheduling rounds behind that decoding. Measured on 4096 ranks:
the first write began 50-70 ms after its batch was validated, and each later
write 5-15 ms after the previous one ended; on the critical path, that was a
fifth of the publish time. These threads wait on a condition variable and
take the GIL back within a switch interval.

When no commit has come for APPLY_IDLE seconds, the writer applies the
engine's pending-reference journal in small slices, so a commit never waits
behind a long apply.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from metadata.engine import MetaEngine, internal_error

log = logging.getLogger("ckptfs.meta")

MAX_BATCH = 2048  # ranks per group commit (16384 ranks: ~9% faster publish than 1024)
VALIDATE_MAX = 512  # ranks per validated chunk: the writer starts sooner, waits less
APPLY_IDLE = 0.05  # no request for this long: apply a slice of the reference journal
APPLY_SLICE = 1  # journal rows per slice (up to JOURNAL_GROUP = 32 rank commits): ~10-50 ms
SETTLE = 0.002  # a partial batch waits until commits stop arriving for this long,
SETTLE_MAX = 0.01  # but never longer than this after its first commit was queued
GC_HOLD_MAX = 10.0  # seconds of unbroken commits before cyclic GC runs again

Acknowledge = Callable[[list, list], None]


class GroupCommit:
    """The commit pipeline; `run` it in the service's nursery, `submit` from the loop.

    `acknowledge(batch, results)` runs on the loop for each written batch: batch
    is the submitted (item, slot) pairs, results their outcomes (a dict or a
    MetaError each). `busy()` says the loop is about to need the database for
    something else (a manifest being built): no journal slice then.
    """

    def __init__(
        self, engine: MetaEngine, acknowledge: Acknowledge, busy: Callable[[], bool]
    ) -> None:
        self.engine = engine
        self._acknowledge = acknowledge
        self._busy = busy
        lock = threading.Lock()
        self._more = threading.Condition(lock)  # commits queued (the validator waits)
        self._ready = threading.Condition(lock)  # a validated batch (the writer waits)
        self._room = threading.Condition(lock)  # the writer took it (the validator waits)
        self._queue: list[tuple[tuple, Any]] = []
        self._validated: deque[tuple[list, Any]] = deque()
        self._inflight = 0  # chunks taken from the queue and not yet acknowledged
        self._stopping = False
        self._last_submit = 0.0
        self._queued_since = 0.0  # when the queue last went from empty to not
        self._gc_held: float | None = None  # when cyclic GC was turned off
        self.journal_dirty = True  # a previous run may have left pending references
        self.last_request = 0.0  # time.monotonic() of the latest request (set by the loop)

    # -- the loop's side -------------------------------------------------------
    def submit(self, item: tuple, slot: Any) -> None:
        with self._more:
            self._queue.append((item, slot))
            self._last_submit = now = time.monotonic()
            if len(self._queue) == 1:
                self._queued_since = now
                self._more.notify()
            elif len(self._queue) == VALIDATE_MAX:  # else the validator is awake or busy
                self._more.notify()

    async def run(self) -> None:
        """Run both threads until cancelled; then they finish what they hold and stop.
        A batch that was queued but not written is not answered: the service is
        going away, and the clients retry on its successor."""
        token = trio.lowlevel.current_trio_token()
        self._stopping = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, self._validate_loop)
                nursery.start_soon(trio.to_thread.run_sync, self._write_loop, token)
                try:
                    await trio.sleep_forever()
                finally:
                    with self._more:
                        self._stopping = True
                        for cond in (self._more, self._ready, self._room):
                            cond.notify_all()
        finally:  # never leave cyclic GC off
            self._gc_release()

    def _acknowledged(self, batch: list, results: list, chunks: int = 1) -> None:
        """On the loop: hand a written batch's outcomes (of `chunks` validated chunks) to
        the service."""
        try:
            self._acknowledge(batch, results)
        except Exception as e:  # noqa: BLE001 - a bug here must not take the loop down
            log.exception("acknowledging a group commit of %d ranks failed", len(batch))
            err = internal_error("commit acknowledgement", e)
            for _, slot in batch:  # nobody may wait forever for an answer
                if not slot.done:
                    slot.set(error=err)
        finally:
            with self._more:
                self._inflight -= chunks
                if not (self._inflight or self._queue):
                    self._gc_release()

    # -- the threads -------------------------------------------------------------
    def _validate_loop(self) -> None:
        while True:
            with self._more:
                while not self._stopping:
                    # the writer has a whole batch waiting
                    full = sum(len(b) for b, _ in self._validated) >= MAX_BATCH
                    if not self._queue or full:
                        (self._room if full else self._more).wait()
                        continue
                    now = time.monotonic()
                    settle = min(
                        SETTLE - (now - self._last_submit),
                        SETTLE_MAX - (now - self._queued_since),
                    )
                    if len(self._queue) >= VALIDATE_MAX or settle <= 0:
                        break
                    self._more.wait(settle)  # a burst is arriving: take it whole
                if self._stopping:
                    return
                batch, self._queue = self._queue[:VALIDATE_MAX], self._queue[VALIDATE_MAX:]
                self._inflight += 1
                self._gc_hold()
            items = [item for item, _ in batch]
            try:
                prepared = self.engine.prepare_commits(items)
            except Exception as e:  # noqa: BLE001 - a bug must not stop group commit
                log.exception("validating a group commit of %d ranks failed", len(batch))
                err = internal_error("commit", e)
                prepared = ([err] * len(batch), [])
            with self._ready:
                self._validated.append((batch, prepared))
                self._ready.notify()

    def _write_loop(self, token: trio.lowlevel.TrioToken) -> None:
        while True:
            with self._ready:
                if not self._validated and not self._stopping:
                    self._ready.wait(APPLY_IDLE if self.journal_dirty else None)
                if self._stopping:
                    return
                jobs = self._take()
                quiet = not (self._queue or self._validated or self._inflight)
            if not jobs:
                if quiet and self.journal_dirty and self._idle():
                    self._apply_slice()
                continue
            batch = [entry for b, _ in jobs for entry in b]
            try:
                if len(jobs) == 1:
                    prepared = jobs[0][1]
                else:
                    prepared = self.engine.merge_prepared([p for _, p in jobs])
                results = self.engine.write_commits(prepared)
            except Exception as e:  # noqa: BLE001 - answered as EIO; the service goes on
                log.exception("group commit of %d ranks failed", len(batch))
                err = internal_error("commit", e)
                results = [err] * len(batch)
            self.journal_dirty = True
            token.run_sync_soon(self._acknowledged, batch, results, len(jobs))

    def _take(self) -> list[tuple[list, Any]]:
        """(Called with the lock held.) Every validated chunk waiting, up to MAX_BATCH ranks
        (at least one chunk), to write in one transaction: when the writer is behind, a
        burst is written in a few big transactions, not many small ones. One chunk only
        if the engine cannot merge them."""
        jobs: list[tuple[list, Any]] = []
        n = 0
        can_merge = hasattr(self.engine, "merge_prepared")
        while self._validated and (not jobs or can_merge):
            if jobs and n + len(self._validated[0][0]) > MAX_BATCH:
                break
            jobs.append(self._validated.popleft())
            n += len(jobs[-1][0])
        if jobs:
            self._room.notify()
        return jobs

    def _idle(self) -> bool:
        return time.monotonic() - self.last_request >= APPLY_IDLE and not self._busy()

    def _apply_slice(self) -> None:
        try:
            left = self.engine.apply_pending(APPLY_SLICE)
        except AttributeError:  # an engine without a journal
            self.journal_dirty = False
            return
        except Exception:  # noqa: BLE001 - retried later; commits go on meanwhile
            log.exception("applying pending chunk references failed")
            with self._ready:
                self._ready.wait(1.0)
            return
        self.journal_dirty = bool(left)

    # -- cyclic GC ----------------------------------------------------------------
    def _gc_hold(self) -> None:
        """No cyclic GC during a burst of commits (called with the lock held): its
        young-generation passes rescanned the burst's live requests and rows (~12 ms
        each, a few per 1024 ranks, under the GIL the writer needs). Collection
        resumes when the burst is answered, or after GC_HOLD_MAX seconds of
        unbroken commits."""
        if self._gc_held is None:
            if gc.isenabled():  # else someone else turned it off: leave it to them
                gc.disable()
                self._gc_held = time.monotonic()
        elif time.monotonic() - self._gc_held > GC_HOLD_MAX:
            gc.enable()  # a long burst: collect as usual until it ends

    def _gc_release(self) -> None:
        if self._gc_held is not None:
            self._gc_held = None
            gc.enable()
