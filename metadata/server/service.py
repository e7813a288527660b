"""The metadata service: one engine shared by many hosts over TCP (trio).

Every connection authenticates first (constant-time token compare), then
pipelines requests. The connection's reader decodes each request and routes
it without a task where it can; an answer is written at once when nothing is
queued before it, else queued for the connection's writer task, which sends
everything queued in one write (conn.py: plain sockets, not trio streams,
because a restarted job's thousands of connects are the service's cost).
Requests that need the
engine run as tasks, blocking calls in worker threads under one
CapacityLimiter. Four kinds of request get special handling because thousands
of ranks send them at the same moment:

- commit_rank: queued for group commit (no task; see groupcommit.py): a
  validation thread checks what waits in chunks of up to 512 ranks, and a
  writer thread writes every chunk validated so far in one transaction while
  the next ones are validated. Between
  bursts the writer applies the engine's pending-reference journal in small
  slices. A commit_ranks (a host's ranks' commits in one request) queues each
  of its ranks so (commitranks.py);
- manifest: built once per published step (right at publish) and encoded
  once, whole and per rank; a request for a built step is answered on the
  reader, from that encoding, with no thread hop and no database access;
- wait_published: no task and no query per waiter (waiters.py): answered from
  the finished steps' states kept here, or when the step settles (a publish or
  abort here, an expiry, or one shared poll per watched step for another
  replica's publish); bounded per connection and in all, and a connection that
  only waits may be closed to make room under the connection cap;
- plain reads (latest, lookup, getattr, ...): queued to one thread that runs
  everything waiting as a batch, identical calls once (see readbatch.py).

Mutating requests carry idempotency keys, and a retry may reach another
replica or this one restarted: what makes it apply once lives in the
database. Requests whose second run would answer differently (create, unlink,
rename, commit_file, ...) record their key and answer in their own
transaction (requests.py); checkpoint commits are idempotent by content (the
rank's digest, written with its files); the rest are idempotent as they are.
A retry that arrives here while the first attempt still runs here waits for
its outcome (the in-memory key table, a fast path only).
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import ssl
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import msgspec
import trio

from metadata.ckptcheck import manifest_ranks, no_durable_step
from metadata.engine import MetaEngine, MetaError, internal_error, shutting_down
from metadata.periodic import run_periodic
from metadata.server.access import (
    ACCESS_POLL_S,
    ADMIN,
    Access,
    Principal,
    request_binding,
    with_domain,
)
from metadata.server.commitranks import submit_ranks
from metadata.server.conn import Budget, Conn, Link, SocketLink, StreamLink, corked
from metadata.server.groupcommit import GroupCommit
from metadata.server.manifests import encode_manifest, manifest_answer
from metadata.server.readbatch import ReadBatcher
from metadata.server.slot import Slot
from metadata.server.stats import ServiceStats
from metadata.server.waiters import Waiters
from metadata.sql.requests import ONCE_METHODS, KeyReused
from metadata.wire.protocol import (
    IDLE_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_FRAME,
    PERMISSIONS,
    PROTO_VERSION,
    READ_METHODS,
    REMOTE_METHODS,
    FrameDecoder,
    ProtocolError,
    encode,
    encode_frame,
    parse_commit,
    parse_hello,
    parse_request,
)

log = logging.getLogger("ckptfs.meta")

HANDSHAKE_TIMEOUT = 10.0
HELLO_MAX = 64 * 1024  # a hello is a few hundred bytes: decoded before the token is checked
MAX_HANDSHAKES = 4096  # connections waiting for their hello; past it the oldest is dropped
# Authenticated connections. One idle for IDLE_TIMEOUT with nothing in flight is closed
# (the client reconnects on its next call and resends nothing: it had nothing pending);
# past MAX_CONNECTIONS the least recently active idle one is closed to make room, and with
# none idle the newcomer is refused with EBUSY (the client tries the next replica, backing
# off within its retry window). `meta serve --idle-timeout / --max-connections`; the
# defaults (IDLE_TIMEOUT, MAX_CONNECTIONS) live in protocol.py.
# Outcomes of keyed requests kept for a retry that reaches this process: a fast path only
# (what makes a retry apply once lives in the database), so bounded in number (a 16k-rank
# job's commits and their retries, ~0.4 KB each: ~20 MB at most) and in age (a retry comes
# within the client's retry window, 60 s by default).
IDEM_KEEP = 50_000
IDEM_KEEP_S = 300.0
MANIFESTS_KEEP = 8
STEP_FILES_KEEP = 4  # open steps whose commits are kept for the manifest
EXPIRE_EVERY = 0.5
PRUNE_EVERY = 60.0  # seconds between deletions of request ids past requests.REQUEST_KEEP_S
SILENT_CHECK_S = 2.0  # seconds between looks for backends stuck in a silent replica's COPY
IDLE_CHECK_MAX = 5.0  # seconds between two walks of the idle connections, at most
ACCEPT_PAUSE = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
ACCEPT_SLEEP = 0.1
ACCEPT_SAY_EVERY = 10.0  # seconds between two log lines of a full descriptor table
ACCEPT_GONE = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}
YIELD_ACCEPTS = 64  # connections accepted between two checkpoints of the accept loop
GC_GEN0 = 50_000  # allocations between young-generation collections (default 700)
SWITCH_INTERVAL = 0.001  # seconds a thread may hold the GIL while another waits
# Reads answered in batches by one thread (readbatch.py); the others are special-cased.
BATCHED_READS = READ_METHODS - {"ping", "get_config", "manifest", "wait_published"}


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


_HELLO_OK = encode_frame({"ok": True, "proto": PROTO_VERSION})


def _check_hello_size(head: bytes) -> None:
    if len(head) == 4 and int.from_bytes(head, "big") > HELLO_MAX:
        raise ProtocolError(f"a hello frame is at most {HELLO_MAX} bytes")


def _commit_args(
    job: str, step: int, rank: int, files: list, *, host: str = "", domain: int | None = None
) -> tuple[str, int, int, list, str, int | None]:
    return job, step, rank, files, host, domain


def _manifest_args(
    job: str, step: int, rank: int | None = None, ranks: list[int] | None = None
) -> tuple[str, int, list[int] | None]:
    return job, step, manifest_ranks(rank, ranks)


class MetaService:
    def __init__(
        self,
        engine: MetaEngine,
        token: str,
        *,
        base_dir: str | None = None,
        max_frame: int = MAX_FRAME,
        threads: int = 8,
        idle_timeout: float = IDLE_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        memory_budget: int | None = None,  # bytes (server/budget.py MEMORY_BUDGET)
    ) -> None:
        if not idle_timeout > 0:
            raise ValueError(f"idle timeout must be > 0 seconds, got {idle_timeout}")
        if max_connections < 1:
            raise ValueError(f"max connections must be >= 1, got {max_connections}")
        engine.claim_service()  # a SQLite volume: refused if another service runs on it
        self.engine = engine
        self._token = token.encode()
        self.access = Access(engine, self._token)  # who may call what (server/access.py)
        # scoped tokens live in the engine (SQL ones): reloaded on a poll and on demand
        self._tokens_reloadable = getattr(engine, "token_generation", None) is not None
        self.base_dir = base_dir
        self.max_frame = max_frame
        self.limiter = trio.CapacityLimiter(threads)
        self.budget = Budget() if memory_budget is None else Budget(memory_budget)
        self._building = 0  # manifests being built: the fan-out comes next, don't apply
        self._group = GroupCommit(engine, self._acknowledge, busy=lambda: self._building > 0)
        self._reads = ReadBatcher(engine)
        self._idem: OrderedDict[bytes, Slot] = OrderedDict()
        self._manifests: OrderedDict[tuple, Slot] = OrderedDict()
        # (job, step) -> {rank: files} of the commits this process wrote: at publish the
        # manifest is encoded from these, without reading the step back (see _prebuild)
        self._step_files: dict[tuple[str, int], dict[int, list]] = {}
        self._waits = Waiters(self._run, engine, max_connections)  # and finished steps' states
        self._nursery: trio.Nursery | None = None
        self._tls: ssl.SSLContext | None = None  # set by serve()
        self.connections = 0
        self._hello_waits: OrderedDict[object, trio.CancelScope] = OrderedDict()
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        # authenticated connections, least recently active first
        self._authed: OrderedDict[Conn, None] = OrderedDict()
        self.stats = {
            "requests": 0,
            "inline": 0,
            "bad_clients": 0,
            "hello_evictions": 0,
            "idle_closed": 0,  # idle past idle_timeout
            "evicted": 0,  # idle, closed to make room under max_connections
            "evicted_waiting": 0,  # only waiting (wait_published), closed to make room
            "refused_full": 0,  # newcomers refused: max_connections, none idle
            "refused_scope": 0,  # requests a credential's role or scope does not allow
            "admin_calls": 0,  # requests that need the admin permission, made by one
        }
        self.counters = ServiceStats()  # replies, latencies, batches, steps (for metrics)

    # -- lifecycle -------------------------------------------------------------
    async def serve(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        # A group commit holds ~10 live containers per rank: with the default thresholds
        # the cyclic GC took ~30% of a 4096-rank commit's CPU. Collect less often.
        gc.freeze()
        gc.set_threshold(GC_GEN0, 20, 20)
        # The group-commit writer gives up the GIL for each SQL statement: a shorter
        # switch interval bounds its wait to take it back (default 5 ms).
        sys.setswitchinterval(SWITCH_INTERVAL)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._tls = ssl_context
            try:
                listeners = await trio.open_tcp_listeners(port, host=host)
            except OSError as e:  # one line naming the address, not "[Errno 98] ..."
                raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
            nursery.start_soon(self._group.run)
            nursery.start_soon(self._reads.run)
            nursery.start_soon(self._waits.run)
            nursery.start_soon(self.budget.run)  # frames that stop arriving (budget.py)
            # the periodic loops: a step that raises is logged, counted and retried
            periodic = partial(run_periodic, log=log)
            nursery.start_soon(periodic, "expire", self._expire, EXPIRE_EVERY)
            if getattr(self.engine, "prune_requests", None) is not None:
                prune = partial(self._run, self.engine.prune_requests)
                nursery.start_soon(periodic, "prune_requests", prune, PRUNE_EVERY)
            every = min(IDLE_CHECK_MAX, self.idle_timeout / 4)
            if self._tokens_reloadable:
                await self._run(self.access.reload)
                tokens = partial(self._run, self.access.reload)
                nursery.start_soon(periodic, "tokens", tokens, ACCESS_POLL_S)
            if getattr(self.engine, "end_silent_backends", None) is not None:
                # a replica stopped mid-COPY holds locks no timeout ends (engines/postgres.py)
                silent = partial(self._run, self.engine.end_silent_backends)
                nursery.start_soon(periodic, "silent_backends", silent, SILENT_CHECK_S)
            nursery.start_soon(periodic, "idle_reaper", self._reap_idle, every)
            bound = listeners[0].socket.getsockname()[1]
            for listener in listeners:  # accepted here as plain sockets (conn.py says why)
                sock = socket.socket(fileno=listener.socket.detach())
                sock.setblocking(False)
                nursery.start_soon(self._accept, sock, nursery)
            task_status.started(bound)

    async def _accept(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        """Accept every connection waiting, then wait for the next; a full descriptor table
        pauses accepting instead of failing the service."""
        try:
            n = 0
            said = -ACCEPT_SAY_EVERY
            while True:
                try:
                    sock, addr = listener.accept()
                except BlockingIOError:
                    n = 0
                    await trio.lowlevel.wait_readable(listener)
                    continue
                except OSError as e:
                    if e.errno in ACCEPT_PAUSE:
                        if time.monotonic() - said > ACCEPT_SAY_EVERY:
                            said = time.monotonic()
                            log.error("accepting a connection: %s; pausing", e)
                        await trio.sleep(ACCEPT_SLEEP)
                        continue
                    if e.errno in ACCEPT_GONE:  # the client gave up before the accept
                        await trio.lowlevel.checkpoint()
                        continue
                    raise
                sock.setblocking(False)
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
                nursery.start_soon(self._handle, SocketLink(sock), addr)
                n += 1
                if n % YIELD_ACCEPTS == 0:  # a storm of connects: let the accepted ones run
                    await trio.lowlevel.checkpoint()
        finally:
            trio.lowlevel.notify_closing(listener)
            listener.close()

    async def _reload_then(self, conn: Conn, nursery: trio.Nursery, req: tuple, body: Any) -> None:
        """A request's own token unknown: reload (access.py `reload_now`), route it again."""
        await self.access.reload_now(self._run)
        self._on_request(conn, nursery, req, body, again=True)

    async def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return await trio.to_thread.run_sync(partial(fn, *args, **kw), limiter=self.limiter)

    def sizes(self) -> dict[str, int]:
        """How many entries each structure that grows with steps, jobs, requests or
        connections holds (tests; every one has a bound)."""
        return {
            "idem": len(self._idem),
            "manifests": len(self._manifests),
            "step_files": len(self._step_files),
            "authed": len(self._authed),
            "hello_waits": len(self._hello_waits),
            **self._waits.sizes(),
            **self.counters.sizes(),
        }

    # -- connections -------------------------------------------------------------
    @contextmanager
    def _waiting_for_hello(self) -> Iterator[trio.CancelScope]:
        """A connection's wait for its hello (or its TLS handshake's first byte), bounded
        in time and in number: past MAX_HANDSHAKES waiting, the one that waited longest
        is dropped. Idle connections that never say hello held a descriptor each for the
        whole timeout, and enough of them locked authenticated clients out. A real client
        says hello at once, so the longest waiter is the idle one."""
        key = object()
        scope = trio.move_on_after(HANDSHAKE_TIMEOUT)
        self._hello_waits[key] = scope
        if len(self._hello_waits) > MAX_HANDSHAKES:
            self._hello_waits.popitem(last=False)[1].cancel()
            self.stats["hello_evictions"] += 1
        try:
            with scope:
                yield scope
        finally:
            self._hello_waits.pop(key, None)

    async def _handle(self, link: Link, addr: Any) -> None:
        self.connections += 1
        peer = "{}:{}".format(*addr[:2]) if isinstance(addr, tuple) else str(addr)
        try:
            if self._tls is not None:
                tls = await self._start_tls(link, peer)
                if tls is None:
                    return
                link = tls
            await self._session(link, peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError, TimeoutError):
            pass  # the client went away (a reset, a keepalive timeout, ...)
        except OSError as e:  # unreachable, or a fault of ours: said, not hidden
            log.info("dropping %s: %s", peer, e)
        except ProtocolError as e:
            self.stats["bad_clients"] += 1
            log.info("dropping %s: %s", peer, e)
            try:
                await link.send_all(encode_frame([0, errno.EPROTO, str(e)]))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        except Exception:  # a bug must not take the service down
            log.exception("connection %s failed", peer)
        finally:
            self.connections -= 1
            await link.aclose()

    async def _start_tls(self, link: Link, peer: str) -> StreamLink | None:
        """TLS over this connection, once its first byte says the client speaks TLS; None
        when the client is gone or did not. A plain client is told so in plain text, and
        gives up (EPROTO) instead of taking a dropped connection for a network fault and
        retrying forever. (The TLS handshake itself runs in the hello's first receive.)"""
        assert isinstance(link, SocketLink)
        with self._waiting_for_hello():
            first = await link.peek()
            if first and first != b"\x16":  # not a TLS handshake record
                self.stats["bad_clients"] += 1
                log.info("dropping %s: a client without TLS", peer)
                await link.send_all(
                    encode_frame(
                        {"ok": False, "errno": errno.EPROTO,
                         "error": "this service speaks TLS: add ?ca=PATH or ?tls=1 to the URL"}
                    )
                )  # fmt: skip
                return None
            if not first:
                return None
            return StreamLink(trio.SSLStream(link.stream(), self._tls, server_side=True))
        raise ProtocolError("no TLS handshake in time (or too many connections waiting)")

    async def _session(self, link: Link, peer: str) -> None:
        dec = FrameDecoder(self.max_frame)
        frames: list[bytes | memoryview] = []
        head = b""  # the hello's frame header
        data = link.try_receive(65536)  # a client says hello with its connect: mostly here
        if data is not None:
            if not data:
                return
            head = data[:4]
            _check_hello_size(head)
            frames = dec.feed(data)
        if not frames:
            with self._waiting_for_hello() as scope:
                while not frames:
                    try:  # with TLS, the first receive runs its handshake
                        data = await link.receive(65536)
                    except trio.BrokenResourceError as e:
                        if isinstance(e.__cause__, ssl.SSLError):  # e.g. a client without TLS
                            why = e.__cause__.reason or e.__cause__
                            raise ProtocolError(f"TLS: {why}") from None
                        raise
                    if not data:
                        return
                    if len(head) < 4:  # refuse a big hello before reading, let alone decoding
                        head += data[: 4 - len(head)]
                        _check_hello_size(head)
                    frames = dec.feed(data)
            if scope.cancelled_caught:
                raise ProtocolError("no hello in time (or too many connections waiting)")
        hello = parse_hello(frames.pop(0))
        if hello.get("proto") != PROTO_VERSION:
            await link.send_all(
                encode_frame(
                    {"ok": False, "errno": errno.EPROTO, "proto": PROTO_VERSION,
                     "error": f"protocol version {hello.get('proto')!r} not supported"}
                )
            )  # fmt: skip
            return
        principal = self.access.authenticate(hello["token"])
        if principal is None and self._tokens_reloadable:
            await self.access.reload_now(self._run)  # a token made since the last look
            principal = self.access.authenticate(hello["token"])
        if principal is None or self.access.current(principal) is None:
            self.stats["bad_clients"] += 1
            log.warning("wrong token from %s", peer)
            await link.send_all(
                encode_frame({"ok": False, "errno": errno.EACCES, "error": "wrong token"})
            )
            return
        conn = Conn(link, self.counters, self.budget)
        conn.principal = principal
        if not self._admit(conn):
            self.stats["refused_full"] += 1
            log.warning("refusing %s: %d connections, none idle", peer, len(self._authed))
            await link.send_all(
                encode_frame(
                    {"ok": False, "errno": errno.EBUSY,
                     "error": f"the service holds its maximum of {self.max_connections} "
                     "connections, all busy (meta serve --max-connections)"}
                )
            )  # fmt: skip
            return
        await link.send_all(_HELLO_OK)
        try:
            with conn.scope:
                async with trio.open_nursery() as nursery:
                    conn.nursery = nursery
                    try:
                        await self._serve_requests(conn, link, dec, frames, nursery)
                    finally:  # before the nursery closes: a late answer starts no writer
                        conn.closed = True
                    # The client is gone. Queued commits still complete in the group commit
                    # (a retry on a new connection finds their outcome); tasks stop here.
                    if nursery.child_tasks:  # (a cancel costs, even with nothing to stop)
                        nursery.cancel_scope.cancel()
        finally:
            conn.close()  # what it held leaves the memory budget
            self._authed.pop(conn, None)
            self._waits.drop_conn(conn)  # its waits go with it
        if conn.idle_closed:
            log.debug("closed %s: idle", peer)

    async def _serve_requests(
        self,
        conn: Conn,
        link: Link,
        dec: FrameDecoder,
        frames: list[bytes | memoryview],
        nursery: trio.Nursery,
    ) -> None:
        """Route the connection's requests until the client is gone or the connection is
        closed (idle, or evicted: then what was read with it is not run)."""
        while True:
            if frames:
                conn.last_request = time.monotonic()
                if conn in self._authed:  # not closed meanwhile
                    self._authed.move_to_end(conn)  # the most recently active
            for body in frames:
                while conn.full:
                    conn.drained = trio.Event()
                    await conn.drained.wait()
                req = parse_commit(body) or parse_request(body)
                # a keyed request is bound to what it asked (server/access.py: keys)
                self._on_request(conn, nursery, req, body if req[4] is not None else None)
            data = await link.receive(1 << 20)
            if not data or conn.scope.cancel_called:
                return
            frames = dec.feed(data)
            if dec.pending or conn.partial_bytes:  # a frame half received: charged (budget.py)
                conn.received(dec.pending)

    def _admit(self, conn: Conn) -> bool:
        """Count an authenticated connection in, under max_connections.

        At the cap the least recently active connection with nothing in flight is closed
        to make room: an idle client loses nothing (it reconnects on its next call),
        while refusing newcomers would let clients that went quiet, or a leak of them,
        lock active ranks out until the idle timeout. With every connection busy the
        newcomer is refused (EBUSY, which the client retries on the next replica and
        after a backoff): closing a busy one would only move its requests to a retry.

        A connection whose only requests in flight are waits, quiet for EVICT_AGE, may go
        too (else as many long waits as the cap locked newcomers out for hours): its client
        reconnects and sends its waits again. At most EVICT_PER_S a second (waiters.py):
        each makes a reconnect that may close another's while connections are wanted past
        the cap; past that the newcomer is refused as above."""
        if len(self._authed) >= self.max_connections:
            victim = next((c for c in self._authed if c.inflight == 0), None)
            if victim is None:
                now = time.monotonic()
                if self._waits.may_evict(now):
                    victim = next((c for c in self._authed if self._waits.evictable(c, now)), None)
                if victim is None:
                    return False
                self._waits.evicted(now)
                self.stats["evicted_waiting"] += 1
            else:
                self.stats["evicted"] += 1
            self._close_idle(victim)
        self._authed[conn] = None
        return True

    def _close_idle(self, conn: Conn) -> None:
        """Close a connection with nothing in flight: its session leaves its receive loop."""
        self._authed.pop(conn, None)
        conn.idle_closed = True
        conn.scope.cancel()

    async def _reap_idle(self) -> None:
        """Close connections that sent nothing for idle_timeout with nothing in flight or
        unsent (a periodic step, every min(IDLE_CHECK_MAX, idle_timeout / 4) seconds).
        Without it every client that went quiet (a crashed host behind a NAT, a
        rank that finished) held a descriptor and a task for good. The walk starts at the
        least recently active and stops at the first one that is not idle by age, so it
        costs what it closes; a connection waiting on a long request (wait_published) is
        not idle."""
        old = time.monotonic() - self.idle_timeout
        for conn in list(self._authed):
            if conn.last_request > old:
                break
            if conn.idle:
                self.stats["idle_closed"] += 1
                self._close_idle(conn)

    # -- dispatch ------------------------------------------------------------------
    def _on_request(
        self, conn: Conn, nursery: trio.Nursery, req: tuple, body: Any = None, again: bool = False
    ) -> None:
        """Route one request without a task where possible: the hot ones never wait here.
        again: re-routed after a token reload (already counted and in flight)."""
        rid, method, args, kwargs, key = req[:5]
        if not again:
            self.stats["requests"] += 1
            conn.inflight += 1
        if method != "ping":
            self._group.last_request = time.monotonic()
        if method not in REMOTE_METHODS:
            conn.reply(rid, None, MetaError(errno.ENOSYS, f"unknown method {method!r}"), method)
            return
        p = conn.principal
        if len(req) > 5:  # on behalf of another credential (wire/protocol.py)
            p = self.access.authenticate(req[5])
            if p is None and not again and self._tokens_reloadable:  # made since the last look?
                nursery.start_soon(self._reload_then, conn, nursery, req, body)
                return
            if p is None:
                err = MetaError(errno.EACCES, f"{method}: the request's token is not known")
                self.stats["refused_scope"] += 1
                conn.reply(rid, None, err, method)
                return
        scoped = p is not ADMIN
        if scoped:
            now_p = self.access.current(p)
            err = (
                MetaError(errno.EACCES, f"token {p.name} was revoked or has expired")
                if now_p is None
                else self.access.refuse(now_p, method, args, kwargs)
            )
            if err is not None:
                self._refused(p, method, err)
                conn.reply(rid, None, err, method)
                return
            p = now_p
            if len(req) <= 5:
                conn.principal = now_p
            kwargs = with_domain(p, method, kwargs)  # its chunk claims: its scope's only
        if PERMISSIONS[method][0] == "admin":
            self.stats["admin_calls"] += 1
            log.info("admin call %s by token %s", method, p.name)
        slot: Slot | None = None
        if key is not None and method not in READ_METHODS:  # a read is safe to run again
            binding = request_binding(p.name, body)
            prev = self._idem.get(key)
            if prev is not None:  # a retry: answer with the first outcome, if it is one
                if prev.binding != binding:
                    err = KeyReused(
                        errno.EINVAL, f"{method}: idempotency key reused by another caller, "
                        "method or arguments",
                    )  # fmt: skip
                    self._refused(p, method, err)
                    conn.reply(rid, None, err, method)
                    return
                prev.add(lambda s: conn.reply(rid, s.result, s.error, method))
                return
            slot = self._idem[key] = Slot()
            slot.binding = binding
            slot.born = time.monotonic()
            while len(self._idem) > IDEM_KEEP:
                self._idem.popitem(last=False)
            slot.add(lambda s: conn.reply(rid, s.result, s.error, method))
        else:
            slot = Slot()
            slot.add(lambda s: conn.reply(rid, s.result, s.error, method))
        try:
            if method == "ping":
                self.stats["inline"] += 1
                slot.set(None)
                return
            if scoped and (self.access.needs_paths(p, method) or method == "list_checkpoints"):
                # the namespace scope needs the engine: checked in the task
                nursery.start_soon(self._scoped_task, p, method, args, kwargs, key, slot)
                return
            if method == "commit_rank":
                item = _commit_args(*args, **kwargs)
                started = self.counters.commit_arrived(item[0], item[1])
                slot.add(lambda _s: self.counters.commit_answered(started))
                self._group.submit(item, slot)
                return
            if method == "commit_ranks":  # a host's ranks' commits, each as above
                submit_ranks(self._group, self.counters, args, kwargs, slot)
                return
            if method == "wait_published":
                self._waits.add(conn, slot, p.name, *args, **kwargs)
                return
            if method == "manifest":
                job, step, only = _manifest_args(*args, **kwargs)
                if step is None:  # the latest durable step's: its number first, batched
                    found = Slot()
                    found.add(lambda s: self._manifest_of(s, job, only, slot))
                    self._reads.submit("latest_durable", [job], {}, found)
                    return
                if self._manifest_inline(job, step, only, slot):
                    return
                args, kwargs = [job, step, only], {}  # checked once: _manifest takes `only`
            elif method in BATCHED_READS:
                self._reads.submit(method, args, kwargs, slot)
                return
        except (TypeError, ValueError, MetaError) as e:
            slot.set(error=e)  # bad arguments: an outcome, like any engine refusal
            return
        nursery.start_soon(self._task, method, args, kwargs, key, slot)

    def _manifest_inline(self, job: str, step: int, only: list[int] | None, slot: Slot) -> bool:
        """Answer a manifest request from the step's encoding, if it is built."""
        entry = self._manifests.get((job, step))
        if entry is None or not entry.done or entry.error is not None:
            return False
        self.stats["inline"] += 1
        slot.set(manifest_answer(entry.result, only))
        return True

    def _manifest_of(self, found: Slot, job: str, only: list[int] | None, slot: Slot) -> None:
        """The second half of a manifest request for the latest durable step, once the
        batched read found its number: answered inline, or built (in the service's
        nursery: the connection may be gone, the encoding is kept for the next)."""
        if found.error is not None:
            slot.set(error=found.error)
        elif found.result is None:
            slot.set(error=no_durable_step(job))
        elif not self._manifest_inline(job, found.result, only, slot):
            assert self._nursery is not None
            self._nursery.start_soon(
                self._task, "manifest", [job, found.result, only], {}, None, slot
            )

    def _refused(self, p: Principal, method: str, err: MetaError) -> None:
        self.stats["refused_scope"] += 1
        log.warning("refused: %s", err)  # the message names the method and the token

    async def _scoped_task(
        self, p: Principal, method: str, args: list, kwargs: dict, key: bytes | None, slot: Slot
    ) -> None:
        """A scoped credential's namespace request: its scope checked, then run, and a
        listing above its roots trimmed to the way to them (server/access.py)."""
        try:
            err = None
            if self.access.needs_paths(p, method):
                err = await self.access.refuse_paths(p, method, args, kwargs, self._run)
        except MetaError as e:
            err = e
        if err is not None:
            self._refused(p, method, err)
            if key is not None:
                self._idem.pop(key, None)
            slot.set(error=err)
            return
        inner = Slot()
        inner.binding = slot.binding

        def answer(s: Slot) -> None:
            if s.error is not None:
                slot.set(error=s.error)
            else:  # a listing above the scope's roots: only the way to them
                slot.set(self.access.visible(p, method, args, s.result, self.access.listed(args)))

        inner.add(answer)
        await self._task(method, args, kwargs, key, inner)

    async def _task(
        self, method: str, args: list, kwargs: dict, key: bytes | None, slot: Slot
    ) -> None:
        try:
            result = await self._dispatch(method, args, kwargs, key, slot.binding)
        except KeyReused as e:
            self.stats["refused_scope"] += 1
            log.warning("refused: %s", e)
            if key is not None and self._idem.get(key) is slot:
                self._idem.pop(key)  # not the key's outcome: its own caller's retry runs
            slot.set(error=e)
        except (MetaError, TypeError, ValueError) as e:
            slot.set(error=e)
        except Exception as e:
            log.exception("%s failed", method)
            if key is not None:
                self._idem.pop(key, None)  # not an outcome: let a retry run it again
            slot.set(error=internal_error(method, e))
        except BaseException:
            if key is not None:
                self._idem.pop(key, None)
            slot.set(error=shutting_down())
            raise
        else:
            slot.set(result)

    async def _dispatch(
        self, method: str, args: list, kwargs: dict, key: bytes | None = None, binding: bytes = b""
    ) -> Any:
        if method == "get_config":
            return await self._get_config(*args, **kwargs)
        if method == "manifest":
            return await self._manifest(*args, **kwargs)
        run_once = getattr(self.engine, "run_once", None)
        if key is not None and method in ONCE_METHODS and run_once is not None:
            # applied once whichever replica a retry reaches: the key and the answer are
            # written in the request's own transaction (requests.py); the key carries its
            # binding (who asked, what), checked there against a retry's
            result = await self._run(run_once, key, method, args, kwargs, binding)
        else:
            result = await self._run(getattr(self.engine, method), *args, **kwargs)
        if method == "abort":
            self.counters.step_state(result["job"], result["step"], result["state"])
            if result["state"] != "open":
                self._waits.settle((result["job"], result["step"]), result)
        elif method == "expire":
            for job, step in result or ():
                self.counters.step_state(job, step, "aborted")
            self._waits.poke(result or ())
        if method in ("delete_checkpoint", "retain", "apply_retention"):
            self._forget_job(args[0] if args else kwargs["job"])
        return result

    def _forget_job(self, job: str) -> None:
        """Drop cached manifests and states of a job whose steps were deleted."""
        for key in [k for k in self._manifests if k[0] == job]:
            del self._manifests[key]
        self._waits.forget_job(job)

    async def _get_config(self) -> dict:
        return absolute_config(await self._run(self.engine.get_config), self.base_dir)

    # -- group commit ------------------------------------------------------------
    def _acknowledge(self, batch: list, results: list) -> None:
        """A written group commit (on the loop): answers, terminal states, manifests."""
        with corked():  # one write per connection, not one per rank (conn.py)
            self._answer_batch(batch, results)

    def _answer_batch(self, batch: list, results: list) -> None:
        encoded: dict[int, msgspec.Raw] = {}  # ranks of a step share one answer object
        self.counters.batch(len(batch))
        for (item, slot), res in zip(batch, results, strict=True):
            if isinstance(res, MetaError):
                slot.set(error=res)
            else:
                key = (res["job"], res["step"])
                self.counters.step_state(res["job"], res["step"], res["state"])
                self._remember_files(key, item, res)
                if res["state"] != "open" and key not in self._waits.terminal:
                    if res["state"] == "published":
                        self._forget_job(key[0])  # retention may have deleted old steps
                    self._waits.settle(key, res)  # kept, and its waiters answered
                    if res["state"] == "published" and self._nursery is not None:
                        self._nursery.start_soon(self._prebuild, *key)
                raw = encoded.get(id(res))
                if raw is None:
                    raw = encoded[id(res)] = msgspec.Raw(encode(res))
                slot.set(raw)

    def _remember_files(self, key: tuple[str, int], item: tuple, res: dict) -> None:
        if res["state"] == "aborted":
            self._step_files.pop(key, None)
        elif not res["duplicate"]:
            if key not in self._step_files:
                while len(self._step_files) >= STEP_FILES_KEEP:  # open steps never finished
                    del self._step_files[next(iter(self._step_files))]
                self._step_files[key] = {}
            self._step_files[key][item[2]] = item[3]

    async def _expire(self) -> None:
        """Abort the steps whose deadline passed (a periodic step, every EXPIRE_EVERY)."""
        expired = await self._run(self.engine.expire)
        for job, step in expired or ():
            self.counters.step_state(job, step, "aborted")
        if expired:
            self._waits.poke(expired)
        old = time.monotonic() - IDEM_KEEP_S  # keyed outcomes past their age (IDEM_KEEP_S)
        while self._idem and next(iter(self._idem.values())).born < old:
            self._idem.popitem(last=False)

    # -- manifests -------------------------------------------------------------------
    async def _prebuild(self, job: str, step: int) -> None:
        """Encode a step's manifest as soon as it publishes: the fan-out follows.

        When every rank committed through this process, the files it received are
        the step's content (the tree was unreachable until publish): encode those
        and skip reading 4 x N inodes back. Otherwise (ranks committed through
        another service, or before a restart) read the step from the engine."""
        key = (job, step)
        files = self._step_files.pop(key, None)
        head = self._waits.terminal.get(key)
        if files and head and len(files) == head["world_size"] and key not in self._manifests:
            entry = self._manifests[key] = Slot()
            head = {k: v for k, v in head.items() if k != "duplicate"}
            self._building += 1
            try:
                parts = await trio.to_thread.run_sync(encode_manifest, head, files)
            except Exception:  # noqa: BLE001 - fall back to reading the step
                log.exception("encoding the manifest of %s/%s from commits failed", job, step)
                del self._manifests[key]
                entry.set(error=MetaError(errno.EAGAIN, "manifest not ready; retry"))
            else:
                entry.set(parts)
                while len(self._manifests) > MANIFESTS_KEEP:
                    self._manifests.popitem(last=False)
                return
            finally:
                self._building -= 1
        try:
            await self._manifest(job, step)
        except Exception:  # noqa: BLE001 - a request will build it (and report) later
            log.debug("prebuilding the manifest of %s/%s failed", job, step, exc_info=True)

    async def _manifest(self, job: str, step: int, only: list[int] | None = None) -> dict:
        """The step's manifest, or the files of the ranks in `only` (as _manifest_args
        checked them), built once per step and kept."""
        key = (job, step)
        entry = self._manifests.get(key)
        if entry is None:
            entry = self._manifests[key] = Slot()
            self._building += 1
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
            finally:
                self._building -= 1
            while len(self._manifests) > MANIFESTS_KEEP:
                self._manifests.popitem(last=False)
        return manifest_answer(await entry.get(), only)
