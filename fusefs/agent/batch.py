"""The agent's one batching policy: what a host's ranks ask at the same moment goes to the
metadata as one request.

A window collects requests of one kind and key (the credential, and the job and step
where they name one); it closes SETTLE seconds after its last request or SETTLE_MAX after
its first, whichever comes first, or when it holds `cap` items; then one request goes
upstream and each caller gets its own part of the answer:

- commit_rank (token, job, step) -> one `commit_ranks(job, step, [[rank, files, host]..])`,
  answered per rank ({"ok": result} or {"errno", "error"}). A service that predates
  commit_ranks (ENOSYS) gets one commit_rank per rank, with each rank's own key; the
  agent asks again after RETRY_GROUPED seconds (the service may be upgraded under it).
- manifest (token, job, step) -> one `manifest(job, step, ranks=[...])`, split by the
  "rank" each file carries.
- missing_chunks (token) -> one query over the union of ids, each caller its subset.

Two ways a group closes. Commits wait in a window: SETTLE seconds after the last request
or SETTLE_MAX after the first, or at `cap`; ranks of one step reach their commit within a
few ms of each other (they leave the same collective), and a lone rank must not wait
longer than its round trip. "Which exist?" and manifests close by what is in flight
(`inflight=1`, natural batching): a request with none of its kind and key upstream goes at
once, and what arrives while one is upstream goes as one request when it returns. A lone
rank then waits no window (a DCP save asks once per few chunks, in sequence: a 2/20 ms
window made 8 ranks' saves slower than without the agent), and a burst groups as much as
the service's pace lets pile up (256 harness ranks a host asking within a few ms: a 3 ms
window grouped about 6 of them, and the service ran 1,500 queries a step).
A group of one request sends it as it came (the rank's own key included).

The latest durable step. A restarted job's ranks each ask `manifest(job, None)`; they
reach the agent over a second or two (their connects wait on busy workers), so by what is
in flight a group held 2-3 ranks, and for each the service read the job's latest durable
step (a batched read, a thread hop) before answering from the step's encoding: 1,800
requests for 4,096 ranks. The agent remembers the step number an answer named, per
(token, job), for LATEST_TTL seconds, and asks the next ranks' manifests by that number
(answered inline by the service) in a window (BURST_SETTLE after the last, BURST_MAX
after the first): a rank asking the latest within a second of another is in a restart's
burst (186 requests). Credentials are untouched: every request still goes upstream with
the rank's own token and the service decides; only a step number is remembered, for the
token it was answered to. The cost is staleness: a step made durable elsewhere is seen up
to LATEST_TTL late (a commit or a flush through this agent forgets the job's number at
once), and a step gone meanwhile is asked again by None.
"""

from __future__ import annotations

import errno
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from metadata.engine import MetaError

SETTLE = 0.002
SETTLE_MAX = 0.02
RETRY_GROUPED = 300.0  # seconds before asking an old service for commit_ranks again
MAX_IDS = 65536  # chunk ids in one merged missing_chunks
MAX_RANKS = 2048  # ranks in one commit_ranks or manifest
LATEST_TTL = 1.0  # seconds a (token, job)'s latest durable step number is reused
BURST_SETTLE, BURST_MAX = 0.02, 0.05  # the window of the manifests asked by that number


class _Item:
    __slots__ = ("payload", "result", "error", "done")

    def __init__(self, payload: Any) -> None:
        self.payload = payload
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = trio.Event()


class _Group:
    __slots__ = ("items", "first", "last", "size")

    def __init__(self, now: float) -> None:
        self.items: list[_Item] = []
        self.first = now
        self.last = now
        self.size = 0


Flush = Callable[[tuple, list[_Item]], Awaitable[None]]


class Window:
    """Requests of one kind gathered per key; `flush(key, items)` answers every item."""

    def __init__(
        self,
        nursery: trio.Nursery,
        flush: Flush,
        *,
        cap: int,
        size: Callable[[Any], int] = lambda _p: 1,
        settle: float = SETTLE,
        settle_max: float = SETTLE_MAX,
        inflight: int = 0,
    ) -> None:
        self.nursery = nursery
        self.flush = flush
        self.cap = cap
        self.size = size
        self.settle = settle
        self.settle_max = settle_max
        self.inflight = inflight  # > 0: close by what is in flight, not by time
        self.groups: dict[tuple, _Group] = {}
        self.queued: dict[tuple, deque[_Group]] = {}  # inflight: groups not yet sent
        self.busy: dict[tuple, int] = {}  # inflight: sends of the key started, not ended

    async def submit(self, key: tuple, payload: Any) -> Any:
        now = trio.current_time()
        n = self.size(payload)
        item = _Item(payload)
        if self.inflight:
            q = self.queued.setdefault(key, deque())
            if not q or q[-1].size + n > self.cap:
                q.append(_Group(now))
                self._pump(key)
            q[-1].items.append(item)
            q[-1].size += n
            return await self._answered(item)
        g = self.groups.get(key)
        if g is not None and g.size + n > self.cap:
            del self.groups[key]  # full: it goes at its time, the newcomer starts the next
            g = None
        if g is None:
            g = self.groups[key] = _Group(now)
            self.nursery.start_soon(self._close, key, g)
        g.items.append(item)
        g.size += n
        g.last = now
        return await self._answered(item)

    @staticmethod
    async def _answered(item: _Item) -> Any:
        await item.done.wait()
        if item.error is not None:
            raise item.error
        return item.result

    def _pump(self, key: tuple) -> None:
        """Start a send of the key's oldest queued group if fewer than `inflight` are out.
        The send takes its group when it runs, so requests of the same moment join it."""
        if self.queued.get(key) and self.busy.get(key, 0) < self.inflight:
            self.busy[key] = self.busy.get(key, 0) + 1
            self.nursery.start_soon(self._send, key)

    async def _send(self, key: tuple) -> None:
        try:
            q = self.queued.get(key)
            if not q:
                return
            g = q.popleft()
            if not q:
                del self.queued[key]
            await self._flush_group(key, g)
        finally:
            self.busy[key] -= 1
            if not self.busy[key]:
                del self.busy[key]
            self._pump(key)

    async def _close(self, key: tuple, g: _Group) -> None:
        while True:
            due = min(g.last + self.settle, g.first + self.settle_max)
            if trio.current_time() >= due:
                break
            await trio.sleep_until(due)
        if self.groups.get(key) is g:
            del self.groups[key]
        await self._flush_group(key, g)

    async def _flush_group(self, key: tuple, g: _Group) -> None:
        """`flush` the group; every item is answered, whatever the flush did."""
        try:
            await self.flush(key, g.items)
        except BaseException as e:
            for it in g.items:
                if not it.done.is_set():
                    it.error = e if isinstance(e, Exception) else MetaError(errno.EIO, str(e))
                    it.done.set()
            if not isinstance(e, Exception):
                raise
        for it in g.items:  # a flush that forgot one must not leave a rank waiting
            if not it.done.is_set():
                it.error = MetaError(errno.EIO, "the agent lost this request's answer")
                it.done.set()


def _answer(item: _Item, result: Any = None, error: BaseException | None = None) -> None:
    item.result, item.error = result, error
    item.done.set()


Call = Callable[..., Awaitable[Any]]  # upstream.call(token, method, args, kwargs, key)


class Batcher:
    """The three windows over one upstream (module docstring); counts what it grouped."""

    def __init__(self, nursery: trio.Nursery, call: Call) -> None:
        self.call = call
        self.commits = Window(nursery, self._flush_commits, cap=MAX_RANKS)
        self.manifests = Window(nursery, self._flush_manifests, cap=MAX_RANKS, inflight=1)
        self.bursts = Window(
            nursery, self._flush_manifests, cap=MAX_RANKS, settle=BURST_SETTLE, settle_max=BURST_MAX
        )  # manifest(job, None) asked by the remembered step (module docstring)
        self.missing = Window(nursery, self._flush_missing, cap=MAX_IDS, size=len, inflight=1)
        self.no_grouped_until = 0.0  # the service said ENOSYS to commit_ranks: until then
        self.latest: dict[tuple[str, str], tuple[int, float]] = {}  # (step, until): docstring
        self.stats = {
            "commit_groups": 0,  # commit_ranks requests sent
            "commits_grouped": 0,  # ranks' commits that went in them
            "commits_single": 0,  # commits sent alone (alone in their window, or fallback)
            "manifest_groups": 0,
            "manifests_grouped": 0,
            "missing_groups": 0,
            "missing_merged": 0,
            "latest_reused": 0,  # manifest(job, None) asked by the remembered step number
        }

    def forget_latest(self, job: str | None = None) -> None:
        """Drop the remembered latest durable steps (of `job`; None: all): a commit or a
        flush through this agent may have made a newer one."""
        for k in [k for k in self.latest if job is None or k[1] == job]:
            del self.latest[k]

    # -- entry points (the agent's connections) -------------------------------------------
    async def commit_rank(self, token: str, key: bytes | None, args: list, kwargs: dict) -> Any:
        job, step, rank, files, host = _commit_fields(args, kwargs)
        if not isinstance(job, str) or not _is_int(step) or not _is_int(rank):
            return await self._single(token, key, args, kwargs)  # the engine names the error
        self.forget_latest(job)
        return await self.commits.submit((token, job, step), (key, rank, files, host))

    async def manifest(self, token: str, args: list, kwargs: dict) -> Any:
        fields = _manifest_fields(args, kwargs)
        if fields is None:
            return await self.call(token, "manifest", args, kwargs)
        job, step, ranks = fields
        if step is None:
            known = self.latest.get((token, job))
            if known is not None and known[1] > time.monotonic():
                self.stats["latest_reused"] += 1
                try:
                    return await self.bursts.submit((token, job, known[0]), ranks)
                except MetaError:  # the step went meanwhile (deleted): ask the latest again
                    self.latest.pop((token, job), None)
        answer = await self.manifests.submit((token, job, step), ranks)
        got = answer.get("step") if step is None and isinstance(answer, dict) else None
        if _is_int(got):
            self.latest[(token, job)] = (got, time.monotonic() + LATEST_TTL)
            if len(self.latest) > 4096:  # bounded: drop the expired
                now = time.monotonic()
                self.latest = {k: v for k, v in self.latest.items() if v[1] > now}
        return answer

    async def missing_chunks(self, token: str, ids: Any) -> Any:
        if not isinstance(ids, list) or not ids:
            return await self.call(token, "missing_chunks", [ids], {})
        return await self.missing.submit((token,), ids)

    # -- flushes ---------------------------------------------------------------------------
    async def _single(self, token: str, key: bytes | None, args: list, kwargs: dict) -> Any:
        self.stats["commits_single"] += 1
        return await self.call(token, "commit_rank", args, kwargs, key)

    async def _flush_commits(self, gkey: tuple, items: list[_Item]) -> None:
        token, job, step = gkey
        seen: set[int] = set()
        again = [it for it in items if it.payload[1] in seen or seen.add(it.payload[1])]
        if again:  # a rank twice in one window (a resend): each of its repeats alone
            items = [it for it in items if it not in again]
            async with trio.open_nursery() as n:
                n.start_soon(self._flush_commits, gkey, items)
                for it in again:
                    n.start_soon(self._one_commit, token, job, step, it)
            return
        if len(items) > 1 and time.monotonic() >= self.no_grouped_until:
            ranks = [[rank, files, host] for _key, rank, files, host in (i.payload for i in items)]
            try:
                answer = await self.call(token, "commit_ranks", [job, step, ranks], {}, None)
            except MetaError as e:
                if not _unknown_method(e):
                    for it in items:
                        _answer(it, error=e)
                    return
                self.no_grouped_until = time.monotonic() + RETRY_GROUPED
            else:
                self.stats["commit_groups"] += 1
                self.stats["commits_grouped"] += len(items)
                for it, out in zip(items, answer, strict=True):
                    if "ok" in out:
                        _answer(it, out["ok"])
                    else:
                        _answer(it, error=MetaError(out.get("errno") or errno.EIO, out["error"]))
                return
        async with trio.open_nursery() as n:  # alone, or an old service: one each, at once
            for it in items:
                n.start_soon(self._one_commit, token, job, step, it)

    async def _one_commit(self, token: str, job: str, step: int, it: _Item) -> None:
        key, rank, files, host = it.payload
        try:
            res = await self._single(token, key, [job, step, rank, files], {"host": host})
        except MetaError as e:
            _answer(it, error=e)
        else:
            _answer(it, res)

    async def _flush_manifests(self, gkey: tuple, items: list[_Item]) -> None:
        token, job, step = gkey
        want = list(dict.fromkeys(r for it in items for r in it.payload))
        kw = {"rank": want[0]} if len(want) == 1 else {"ranks": want}
        try:
            answer = await self.call(token, "manifest", [job, step], kw)
        except MetaError as e:
            for it in items:
                _answer(it, error=e)
            return
        if len(items) > 1:
            self.stats["manifest_groups"] += 1
            self.stats["manifests_grouped"] += len(items)
        head = {k: v for k, v in answer.items() if k != "files"}
        by_rank: dict[int, list] = {}
        for f in answer.get("files") or ():
            by_rank.setdefault(f.get("rank"), []).append(f)
        for it in items:
            files = [f for r in it.payload for f in by_rank.get(r, ())]
            _answer(it, {**head, "files": files})

    async def _flush_missing(self, gkey: tuple, items: list[_Item]) -> None:
        (token,) = gkey
        ids = list(dict.fromkeys(cid for it in items for cid in it.payload))
        try:
            missing = await self.call(token, "missing_chunks", [ids], {}, os.urandom(16))
        except MetaError as e:
            for it in items:
                _answer(it, error=e)
            return
        if len(items) > 1:
            self.stats["missing_groups"] += 1
            self.stats["missing_merged"] += len(items)
        missing = set(missing)
        for it in items:
            _answer(it, {cid for cid in it.payload if cid in missing})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _commit_fields(args: list, kwargs: dict) -> tuple:
    """commit_rank's (job, step, rank, files, host), however the rank passed them."""
    names = ("job", "step", "rank", "files", "host")
    vals = dict(zip(names, args, strict=False))
    vals.update({k: v for k, v in kwargs.items() if k in names})
    if set(kwargs) - set(names) or len(args) > len(names):
        return None, None, None, None, None  # the engine names the mistake
    return tuple(vals.get(n, "" if n == "host" else None) for n in names)


def _manifest_fields(args: list, kwargs: dict) -> tuple[str, int | None, list[int]] | None:
    """(job, step, ranks) of a manifest request for some ranks; None for one that asks the
    whole step or is malformed (sent as it came)."""
    names = ("job", "step", "rank", "ranks")
    if len(args) > len(names) or set(kwargs) - set(names):
        return None
    vals = dict(zip(names, args, strict=False))
    vals.update(kwargs)
    job, step, rank, ranks = (vals.get(n) for n in names)
    if not isinstance(job, str) or not (step is None or _is_int(step)):
        return None
    if rank is not None and ranks is None and _is_int(rank):
        return job, step, [rank]
    if rank is None and isinstance(ranks, list) and ranks and all(_is_int(r) for r in ranks):
        return job, step, list(ranks)
    return None


def _unknown_method(e: MetaError) -> bool:
    """The upstream does not know commit_ranks (an older service): ENOSYS "unknown method"."""
    return e.errno == errno.ENOSYS or (e.errno == errno.EINVAL and "unknown method" in str(e))
