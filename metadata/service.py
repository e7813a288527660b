"""The metadata service: one engine shared by many hosts over TCP (trio).

Every connection authenticates first (constant-time token compare), then
pipelines requests; each request runs as its own task, and blocking engine
calls go to worker threads under one CapacityLimiter. Three requests get
special handling because thousands of ranks send them at the same moment:

- commit_rank: queued to one batcher task that hands everything waiting to
  `engine.commit_ranks` in one transaction (group commit);
- manifest: built once per published step and encoded once (whole and per
  rank); every request is answered from that encoding, never the database;
- wait_published: answered from in-memory terminal states, woken by local
  publishes, with a slow database poll for steps published elsewhere.

Mutating requests carry idempotency keys; a retry of a key answers with the
first outcome (within this process's lifetime; checkpoint calls are also
idempotent by content, which survives a restart).
"""

from __future__ import annotations

import errno
import hmac
import logging
import math
import os
from collections import OrderedDict
from functools import partial
from typing import Any

import msgspec
import trio

from metadata.engine import MetaEngine, MetaError
from metadata.protocol import (
    MAX_FRAME,
    PROTO_VERSION,
    REMOTE_METHODS,
    FrameDecoder,
    ProtocolError,
    encode,
    encode_frame,
    parse_hello,
    parse_request,
)

log = logging.getLogger("ckptfs.meta")

HANDSHAKE_TIMEOUT = 10.0
MAX_INFLIGHT_PER_CONN = 512
MAX_BATCH = 2048
IDEM_KEEP = 200_000
MANIFESTS_KEEP = 8
EXPIRE_EVERY = 0.5


def absolute_config(config: dict, base_dir: str | None) -> dict:
    """Resolve `dir:` node paths relative to the volume dir, for clients elsewhere."""
    if not base_dir:
        return config
    out = dict(config)
    nodes = []
    for n in config.get("nodes", []):
        n = dict(n)
        url = n.get("url", "")
        if url.startswith("dir:"):
            path, sep, query = url[4:].partition("?")
            if not os.path.isabs(path):
                n["url"] = "dir:" + os.path.join(base_dir, path) + sep + query
        nodes.append(n)
    out["nodes"] = nodes
    return out


class _Slot:
    """One waiter's answer from a shared computation (group commit, idempotency)."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def set(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.event.set()

    async def get(self) -> Any:
        await self.event.wait()
        if self.error is not None:
            raise self.error
        return self.result


class MetaService:
    def __init__(
        self,
        engine: MetaEngine,
        token: str,
        *,
        base_dir: str | None = None,
        max_frame: int = MAX_FRAME,
        threads: int = 8,
    ) -> None:
        self.engine = engine
        self._token = token.encode()
        self.base_dir = base_dir
        self.max_frame = max_frame
        self.limiter = trio.CapacityLimiter(threads)
        self._commits_in, self._commits_out = trio.open_memory_channel(math.inf)
        self._idem: OrderedDict[bytes, _Slot] = OrderedDict()
        self._manifests: OrderedDict[tuple, Any] = OrderedDict()
        self._terminal: dict[tuple[str, int], dict] = {}
        self._changed = trio.Event()
        self.connections = 0
        self.stats = {"requests": 0, "batches": 0, "batched_commits": 0, "bad_clients": 0}

    # -- lifecycle -------------------------------------------------------------
    async def serve(
        self, host: str, port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(port, host=host)
            nursery.start_soon(self._batcher)
            nursery.start_soon(self._expirer)
            task_status.started(listeners[0].socket.getsockname()[1])
            await trio.serve_listeners(self._handle, listeners)

    async def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return await trio.to_thread.run_sync(partial(fn, *args, **kw), limiter=self.limiter)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- connections -------------------------------------------------------------
    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        peer = "?"
        try:
            peer = "{}:{}".format(*stream.socket.getpeername()[:2])
            await self._session(stream, peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass
        except ProtocolError as e:
            self.stats["bad_clients"] += 1
            log.info("dropping %s: %s", peer, e)
            try:
                await stream.send_all(encode_frame([0, errno.EPROTO, str(e)]))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        except Exception:  # a bug must not take the service down
            log.exception("connection %s failed", peer)
        finally:
            self.connections -= 1
            await trio.aclose_forcefully(stream)

    async def _session(self, stream: trio.SocketStream, peer: str) -> None:
        dec = FrameDecoder(self.max_frame)
        frames: list[bytes] = []
        with trio.move_on_after(HANDSHAKE_TIMEOUT) as scope:
            while not frames:
                data = await stream.receive_some(65536)
                if not data:
                    return
                frames = dec.feed(data)
        if scope.cancelled_caught:
            raise ProtocolError("no hello within the handshake timeout")
        hello = parse_hello(frames.pop(0))
        if hello.get("proto") != PROTO_VERSION:
            await stream.send_all(
                encode_frame(
                    {"ok": False, "errno": errno.EPROTO, "proto": PROTO_VERSION,
                     "error": f"protocol version {hello.get('proto')!r} not supported"}
                )
            )  # fmt: skip
            return
        if not hmac.compare_digest(hello["token"].encode(), self._token):
            self.stats["bad_clients"] += 1
            log.warning("wrong token from %s", peer)
            await stream.send_all(
                encode_frame({"ok": False, "errno": errno.EACCES, "error": "wrong token"})
            )
            return
        await stream.send_all(encode_frame({"ok": True, "proto": PROTO_VERSION}))
        send_lock = trio.Lock()
        slots = trio.Semaphore(MAX_INFLIGHT_PER_CONN)
        async with trio.open_nursery() as nursery:
            while True:
                for body in frames:
                    req = parse_request(body)
                    await slots.acquire()
                    nursery.start_soon(self._request, stream, send_lock, slots, req)
                data = await stream.receive_some(1 << 20)
                if not data:
                    break
                frames = dec.feed(data)
            nursery.cancel_scope.deadline = trio.current_time() + 600  # let answers finish

    async def _request(
        self, stream: trio.SocketStream, lock: trio.Lock, slots: trio.Semaphore, req: tuple
    ) -> None:
        rid, method, args, kwargs, key = req
        self.stats["requests"] += 1
        try:
            try:
                result = await self._call(method, args, kwargs, key)
                out = encode([rid, 0, result])
            except MetaError as e:
                out = encode([rid, e.errno or errno.EIO, str(e)])
            except (TypeError, ValueError) as e:
                out = encode([rid, errno.EINVAL, f"bad arguments for {method}: {e}"])
            except Exception as e:
                log.exception("%s failed", method)
                out = encode([rid, errno.EIO, f"{method} failed: {type(e).__name__}: {e}"])
            async with lock:
                await stream.send_all(len(out).to_bytes(4, "big") + out)
        finally:
            slots.release()

    # -- dispatch ------------------------------------------------------------------
    async def _call(self, method: str, args: list, kwargs: dict, key: bytes | None) -> Any:
        if method not in REMOTE_METHODS:
            raise MetaError(errno.ENOSYS, f"unknown method {method!r}")
        if key is None:
            return await self._dispatch(method, args, kwargs)
        slot = self._idem.get(key)
        if slot is not None:
            return await slot.get()
        slot = self._idem[key] = _Slot()
        while len(self._idem) > IDEM_KEEP:
            self._idem.popitem(last=False)
        try:
            result = await self._dispatch(method, args, kwargs)
        except MetaError as e:
            slot.set(error=e)
            raise
        except BaseException:
            del self._idem[key]  # not an outcome: let a retry run it again
            slot.set(error=MetaError(errno.EAGAIN, "first attempt failed; retry"))
            raise
        slot.set(result)
        return result

    async def _dispatch(self, method: str, args: list, kwargs: dict) -> Any:
        special = {
            "get_config": self._get_config,
            "commit_rank": self._commit_rank,
            "manifest": self._manifest,
            "wait_published": self._wait_published,
        }.get(method)
        if special is not None:
            return await special(*args, **kwargs)
        result = await self._run(getattr(self.engine, method), *args, **kwargs)
        if method in ("abort", "expire", "begin"):
            self._notify()
        return result

    async def _get_config(self) -> dict:
        return absolute_config(await self._run(self.engine.get_config), self.base_dir)

    # -- group commit ------------------------------------------------------------
    async def _commit_rank(
        self, job: str, step: int, rank: int, files: list, *, host: str = ""
    ) -> dict:
        slot = _Slot()
        self._commits_in.send_nowait(((job, step, rank, files, host), slot))
        return await slot.get()

    async def _batcher(self) -> None:
        async for first in self._commits_out:
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._commits_out.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                results = await self._run(self.engine.commit_ranks, [item for item, _ in batch])
            except Exception as e:
                log.exception("group commit of %d ranks failed", len(batch))
                err = MetaError(errno.EIO, f"commit failed: {type(e).__name__}: {e}")
                results = [err] * len(batch)
            self.stats["batches"] += 1
            self.stats["batched_commits"] += len(batch)
            changed = False
            for (_, slot), res in zip(batch, results, strict=True):
                if isinstance(res, MetaError):
                    slot.set(error=res)
                else:
                    if res["state"] != "open":
                        self._terminal[(res["job"], res["step"])] = res
                        changed = True
                    slot.set(res)
            if changed:
                self._notify()

    async def _expirer(self) -> None:
        while True:
            await trio.sleep(EXPIRE_EVERY)
            try:
                if await self._run(self.engine.expire):
                    self._notify()
            except Exception:
                log.exception("deadline check failed")

    # -- waiting -------------------------------------------------------------------
    async def _wait_published(
        self,
        job: str,
        step: int,
        timeout: float = 60.0,  # noqa: ASYNC109 - the RPC's argument, not a trio timeout
    ) -> dict:
        if not isinstance(timeout, int | float) or timeout < 0:
            raise MetaError(errno.EINVAL, "timeout must be a non-negative number")
        deadline = trio.current_time() + min(float(timeout), 86400.0)
        poll = 0.05
        while True:
            info = self._terminal.get((job, step))
            if info is None:
                info = await self._run(self.engine.step_state, job, step)
                if info["state"] != "open":
                    self._terminal[(job, step)] = info
            if info["state"] != "open":
                return info
            now = trio.current_time()
            if now >= deadline:
                raise MetaError(errno.ETIMEDOUT, f"{job} step {step} not published in {timeout}s")
            with trio.move_on_after(min(poll, deadline - now)):
                await self._changed.wait()  # a local publish/abort, or poll the database
            poll = min(poll * 2, 1.0)

    # -- manifests -------------------------------------------------------------------
    async def _manifest(self, job: str, step: int, rank: int | None = None) -> dict:
        key = (job, step)
        entry = self._manifests.get(key)
        if entry is None:
            entry = self._manifests[key] = _Slot()
            try:
                head, by_rank = await self._run(self.engine.manifest_parts, job, step)
                enc = msgspec.msgpack.Encoder()
                full = msgspec.Raw(enc.encode([f for r in sorted(by_rank) for f in by_rank[r]]))
                per = {r: msgspec.Raw(enc.encode(fs)) for r, fs in by_rank.items()}
                entry.set((head, full, per))
            except BaseException as e:
                del self._manifests[key]
                entry.set(error=e if isinstance(e, MetaError) else MetaError(errno.EIO, str(e)))
                raise
            while len(self._manifests) > MANIFESTS_KEEP:
                self._manifests.popitem(last=False)
        head, full, per = await entry.get()
        if rank is None:
            return {**head, "files": full}
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise MetaError(errno.EINVAL, "rank must be an integer")
        return {**head, "files": per.get(rank, msgspec.Raw(b"\x90"))}
