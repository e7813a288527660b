"""wait_published on the service: waiters are callbacks on a watched step, not tasks.

A waiter used to be a task of its own that looked at the database about once a second
through the service's shared worker threads: 5 connections x 4,000 waiters on one open
step made another client's `create` take 1.9-4.7 s instead of 2 ms, with the service at
107% CPU, all to learn that nothing had changed. Here a waiter costs a few hundred bytes
and no CPU while it waits:

- a wait for a step whose outcome is known (TERMINAL_KEEP finished steps are kept) is
  answered at once, on the connection's reader;
- otherwise it joins the step's watch (a set of waiters per (job, step)) and is answered
  when the step settles: a publish or abort through this service (`settle`, from the
  group commit's acknowledgement or an abort), an expiry (`poke`: the step is looked up
  at once), or, for a step another replica publishes, ONE poll per watched step: a single
  poller task reads the state of every watched step every POLL_S in one worker-thread
  call, while anyone waits (a step is also read as soon as it is first watched: one
  published before this process started is answered without waiting for the poll);
- timeouts are one heap and one timer task, not a cancel scope per waiter.

Bounds (past them a wait is refused at once with EAGAIN and a message naming the bound,
and the client may retry): waiters per connection, per credential (the token's name) and
in all, connections holding waits per credential (half of the service's connection
cap: one credential's idle waits cannot fill it), and steps watched at once (each one
costs a query per POLL_S). A real job waits once per step, from its coordinator; a token
that waits thousands of times is a leak or an attack, and with these bounds it cannot
take the waits, or the connections, others need. A connection's waiters are dropped
when it closes. The service's `_admit` may close a connection whose only requests in flight are
waits to make room under its connection cap (the client reconnects and sends its waits
again): see `evictable`.
"""

from __future__ import annotations

import errno
import heapq
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from metadata.engine import MetaError

log = logging.getLogger("ckptfs.meta")

# A waiter holds a slot, a closure and a heap entry (~0.4 KB): 32k of them ~13 MB, and a
# host's ranks wait on a handful of steps, so thousands in all is a big cluster already.
WAITS_MAX = 32_768
# Half of what one connection may have in flight (conn.MAX_INFLIGHT_PER_CONN = 4096): a
# connection of waits is refused before it stalls its own other requests.
WAITS_PER_CONN = 2_048
# A quarter of WAITS_MAX per credential: at least four tokens to fill the service's waits.
WAITS_PER_CREDENTIAL = 8_192
# Steps watched at once: each costs one step_state query per POLL_S (~1k queries a second
# at most, in one worker-thread call per poll); a job waits on one or two steps at a time.
WATCHED_MAX = 512
POLL_S = 0.5  # seconds between two reads of the watched steps' states (another replica's)
# Finished steps' states kept to answer later waits without the database (~0.5 KB each:
# ~2 MB). A wait for an older step reads the database once, through the poller.
TERMINAL_KEEP = 4_096
MAX_WAIT_S = 86_400.0  # a wait's timeout is cut to a day
# A connection of waits may be closed for a newcomer once it sent nothing for this long,
# and at most EVICT_PER_S such closes a second: each costs its client a reconnect, which
# may close another's (a chain while connections are wanted past the cap).
EVICT_AGE = 2.0
EVICT_PER_S = 50


def wait_args(job: str, step: int, timeout: float = 60.0) -> tuple[str, int, float]:
    """wait_published's arguments, checked (TypeError/MetaError: answered EINVAL)."""
    if not isinstance(job, str) or not isinstance(step, int) or isinstance(step, bool):
        raise TypeError("wait_published(job: str, step: int, timeout: float)")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise MetaError(errno.EINVAL, "timeout must be a non-negative number")
    return job, step, float(timeout)


class _Wait:
    __slots__ = ("key", "slot", "conn", "who", "deadline", "asked", "seq", "live")

    def __init__(
        self, key: tuple, slot: Any, conn: Any, who: str, deadline: float, asked: float, seq: int
    ) -> None:
        self.key = key
        self.slot = slot  # answered with slot.set(result, error)
        self.conn = conn
        self.who = who  # the credential's name
        self.deadline = deadline
        self.asked = asked
        self.seq = seq
        self.live = True


class Waiters:
    """`run` in the service's nursery; everything else is called on the loop."""

    def __init__(
        self, run: Callable[..., Awaitable[Any]], engine: Any, max_connections: int = 1 << 16
    ) -> None:
        self._run = run  # a worker-thread call under the service's limiter
        self.engine = engine
        self.conns_per_credential = max(1, max_connections // 2)
        self._by_who: dict[str, dict[Any, int]] = {}  # credential -> {conn: its waits}
        self._who_waits: dict[str, int] = {}  # credential -> its waits
        self.terminal: OrderedDict[tuple[str, int], dict] = OrderedDict()
        self._terminal_jobs: dict[str, set[int]] = {}  # job -> steps in `terminal`
        self.watched: dict[tuple[str, int], set[_Wait]] = {}
        self._fresh: set[tuple[str, int]] = set()  # watched, not read since
        self._all_due = False  # read every watched step now (an expiry)
        self._by_conn: dict[Any, set[_Wait]] = {}
        self.count = 0
        self._seq = 0
        self._heap: list[tuple[float, int, _Wait]] = []
        self._kick = trio.Event()  # the poller: something to read
        self._timer_kick = trio.Event()  # the timer: an earlier deadline
        self.polls = 0  # worker-thread calls made by the poller
        self._evicts: list[float] = []  # when wait-only connections were closed (last second)

    # -- waits ---------------------------------------------------------------------
    def add(self, conn: Any, slot: Any, who: str, *args: Any, **kwargs: Any) -> None:
        """A wait_published request of credential `who`: answered now, or when its step
        settles or its timeout passes. Raises (EINVAL, EAGAIN) to refuse it."""
        job, step, timeout = wait_args(*args, **kwargs)
        key = (job, step)
        info = self.terminal.get(key)
        if info is not None:
            self.terminal.move_to_end(key)
            slot.set(info)
            return
        mine = self._by_conn.get(conn)
        if mine is not None and len(mine) >= WAITS_PER_CONN:
            raise MetaError(
                errno.EAGAIN, f"wait_published: this connection already waits {len(mine)} "
                f"times (at most {WAITS_PER_CONN} per connection); retry later",
            )  # fmt: skip
        theirs = self._by_who.get(who)
        if theirs is not None:
            if self._who_waits[who] >= WAITS_PER_CREDENTIAL:
                raise MetaError(
                    errno.EAGAIN, f"wait_published: token {who} already waits "
                    f"{WAITS_PER_CREDENTIAL} times (at most that per token); retry later",
                )  # fmt: skip
            if conn not in theirs and len(theirs) >= self.conns_per_credential:
                raise MetaError(
                    errno.EAGAIN, f"wait_published: token {who} already waits on "
                    f"{len(theirs)} connections (at most half of the service's "
                    "connection cap per token); retry later",
                )  # fmt: skip
        if self.count >= WAITS_MAX:
            raise MetaError(
                errno.EAGAIN, f"wait_published: the service holds its maximum of {WAITS_MAX} "
                "waits; retry later",
            )  # fmt: skip
        watch = self.watched.get(key)
        if watch is None:
            if len(self.watched) >= WATCHED_MAX:
                raise MetaError(
                    errno.EAGAIN, f"wait_published: the service watches its maximum of "
                    f"{WATCHED_MAX} steps at once; retry later",
                )  # fmt: skip
            watch = self.watched[key] = set()
            self._fresh.add(key)
            self._kick.set()
        self._seq += 1
        now = trio.current_time()
        w = _Wait(key, slot, conn, who, now + min(timeout, MAX_WAIT_S), timeout, self._seq)
        watch.add(w)
        if mine is None:
            mine = self._by_conn[conn] = set()
        mine.add(w)
        if theirs is None:
            theirs = self._by_who[who] = {}
        theirs[conn] = theirs.get(conn, 0) + 1
        self._who_waits[who] = self._who_waits.get(who, 0) + 1
        self.count += 1
        if not self._heap or w.deadline < self._heap[0][0]:
            self._timer_kick.set()
        heapq.heappush(self._heap, (w.deadline, w.seq, w))
        if len(self._heap) > 2 * self.count + 1024:  # answered waits' entries: compact
            self._heap = [e for e in self._heap if e[2].live]
            heapq.heapify(self._heap)

    def _finish(self, w: _Wait, result: Any = None, error: BaseException | None = None) -> None:
        w.live = False
        self.count -= 1
        self._uncount(w)
        mine = self._by_conn.get(w.conn)
        if mine is not None:
            mine.discard(w)
            if not mine:
                del self._by_conn[w.conn]
        w.slot.set(result, error)

    def _unwatch(self, w: _Wait) -> None:
        watch = self.watched.get(w.key)
        if watch is not None:
            watch.discard(w)
            if not watch:
                del self.watched[w.key]
                self._fresh.discard(w.key)

    def _time_out(self, w: _Wait) -> None:
        self._unwatch(w)
        job, step = w.key
        self._finish(
            w, error=MetaError(errno.ETIMEDOUT, f"{job} step {step} not published in {w.asked:g}s")
        )

    def drop_conn(self, conn: Any) -> None:
        """A connection closed: its waits go, unanswered."""
        for w in self._by_conn.pop(conn, ()):
            if w.live:
                w.live = False
                self.count -= 1
                self._uncount(w)
                self._unwatch(w)

    def _uncount(self, w: _Wait) -> None:
        """A wait left its credential's count."""
        theirs = self._by_who.get(w.who)
        if theirs is not None:
            self._who_waits[w.who] -= 1
            n = theirs.get(w.conn, 0) - 1
            if n > 0:
                theirs[w.conn] = n
            else:
                theirs.pop(w.conn, None)
                if not theirs:
                    del self._by_who[w.who], self._who_waits[w.who]

    def waits_of(self, conn: Any) -> int:
        mine = self._by_conn.get(conn)
        return len(mine) if mine is not None else 0

    def evictable(self, conn: Any, now: float) -> bool:
        """A connection whose only requests in flight are waits, quiet for EVICT_AGE."""
        n = self.waits_of(conn)
        return (
            bool(n)
            and conn.inflight == n
            and not conn.out_bytes
            and (now - conn.last_request >= EVICT_AGE)
        )

    def may_evict(self, now: float) -> bool:
        """Fewer than EVICT_PER_S wait-only connections closed in the last second."""
        self._evicts = [t for t in self._evicts if t > now - 1.0]
        return len(self._evicts) < EVICT_PER_S

    def evicted(self, now: float) -> None:
        self._evicts.append(now)

    # -- outcomes ------------------------------------------------------------------
    def settle(self, key: tuple[str, int], info: dict) -> None:
        """A step published or aborted: kept, and its waiters answered."""
        if key not in self.terminal:
            self.terminal[key] = info
            self._terminal_jobs.setdefault(key[0], set()).add(key[1])
            while len(self.terminal) > TERMINAL_KEEP:
                (job, step), _ = self.terminal.popitem(last=False)
                steps = self._terminal_jobs.get(job)
                if steps is not None:
                    steps.discard(step)
                    if not steps:
                        del self._terminal_jobs[job]
        watch = self.watched.pop(key, None)
        self._fresh.discard(key)
        for w in watch or ():
            self._finish(w, info)

    def poke(self, keys: Any = None) -> None:
        """Steps that may have changed (expired): read the watched ones now (None: all)."""
        if keys is None:
            self._all_due = bool(self.watched)
        else:
            self._fresh.update(k for k in keys if k in self.watched)
        if self._all_due or self._fresh:
            self._kick.set()

    def forget_job(self, job: str) -> None:
        """A job's steps were deleted: their states are no longer known."""
        for step in self._terminal_jobs.pop(job, ()):
            self.terminal.pop((job, step), None)

    # -- tasks ---------------------------------------------------------------------
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._timer)
            await self._poller()

    async def _timer(self) -> None:
        while True:
            now = trio.current_time()
            while self._heap and self._heap[0][0] <= now:
                w = heapq.heappop(self._heap)[2]
                if w.live and w.key not in self._fresh:  # else: timed out after its read
                    self._time_out(w)
            self._timer_kick = trio.Event()
            with trio.move_on_at(self._heap[0][0] if self._heap else float("inf")):
                await self._timer_kick.wait()

    async def _poller(self) -> None:
        next_all = 0.0
        while True:
            now = trio.current_time()
            if not self.watched or (not self._fresh and not self._all_due and now < next_all):
                self._kick = trio.Event()
                with trio.move_on_at(next_all if self.watched else float("inf")):
                    await self._kick.wait()
                continue
            if self._all_due or now >= next_all:
                keys = list(self.watched)
                self._all_due = False
                next_all = now + POLL_S
            else:
                keys = list(self._fresh)
            seq = self._seq
            self.polls += 1
            states = await self._run(_read_states, self.engine, keys)
            now = trio.current_time()
            for key, got in zip(keys, states, strict=True):
                fresh = key in self._fresh
                self._fresh.discard(key)
                if isinstance(got, dict):
                    if got.get("state") != "open":
                        self.settle(key, got)
                        continue
                elif isinstance(got, MetaError):  # e.g. no such step: its waiters are told
                    for w in [w for w in self.watched.get(key, ()) if w.seq <= seq]:
                        self._unwatch(w)
                        self._finish(w, error=got)
                if fresh:  # waits whose timeout passed before their first read
                    for w in [w for w in self.watched.get(key, ()) if w.deadline <= now]:
                        self._time_out(w)

    def sizes(self) -> dict[str, int]:
        return {
            "terminal": len(self.terminal),
            "terminal_jobs": len(self._terminal_jobs),
            "watched": len(self.watched),
            "waits": self.count,
            "wait_conns": len(self._by_conn),
            "wait_tokens": len(self._by_who),
            "wait_heap": len(self._heap),
        }


def _read_states(engine: Any, keys: list[tuple[str, int]]) -> list[Any]:
    """Each step's state (a dict), the MetaError reading it gave, or None (a fault of
    ours, logged: read again at the next poll)."""
    out: list[Any] = []
    for job, step in keys:
        try:
            out.append(engine.step_state(job, step))
        except MetaError as e:
            out.append(e)
        except Exception:  # noqa: BLE001 - the poller must outlive a failed read
            log.exception("reading the state of %s step %s", job, step)
            out.append(None)
    return out
