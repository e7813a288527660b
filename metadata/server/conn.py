"""One client connection on the service's side: its bytes in and out, and its answers.

Why not trio's SocketStream for plain TCP: a restarted job opens thousands of connections
at once, each for a request or two, and there the service's cost is its cost per
connection. SocketStream checkpoints twice on every call (even when the kernel has the
bytes), and the service wrapped each receive in a cancel scope for the idle timeout and
each answer in a wake-up of a writer task: about 1 ms of the service's CPU for a connect,
one request and a close (a bare SocketStream echo: 330 us; the same on a raw socket: 136
us, on this machine). So a plain connection here is a non-blocking socket read and written
directly, waiting on trio's epoll (wait_readable / wait_writable) only when the kernel says
EAGAIN; an answer goes out at once, from the loop, when nothing is queued before it (a
group commit's answers go together, in one write: `corked`); and
only a connection whose client does not read as fast as it is answered gets a writer task
(answers queue behind what is unsent, in order). TLS records need trio.SSLStream: a TLS
connection queues every answer for its writer task, as all connections did before.

The idle timeout is the service's (a reaper walks its least recently active connections),
not a cancel scope per receive.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from metadata.engine import MetaError, internal_error
from metadata.server.budget import Budget
from metadata.server.stats import ServiceStats
from metadata.wire.protocol import HEADER, encode, encode_answer

log = logging.getLogger("ckptfs.meta")

MAX_INFLIGHT_PER_CONN = 4096  # requests read and not yet answered
OUT_MAX = 32 << 20  # answer bytes queued for a connection before its requests wait
YIELD_EVERY = 16  # receives that found bytes waiting, between two checkpoints,
YIELD_BYTES = 256 << 10  # or this many bytes of them
WRITE_CHUNK = 1 << 20  # queued answers joined per write: a queue is never copied whole


class SocketLink:
    """A plain TCP connection: a non-blocking socket on trio's epoll."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._ready = 0  # receives in a row that did not wait
        self._ready_bytes = 0  # and their bytes

    async def receive(self, n: int) -> bytes:
        while True:
            try:
                data = self.sock.recv(n)
            except BlockingIOError:
                self._ready = self._ready_bytes = 0
                await trio.lowlevel.wait_readable(self.sock)
                continue
            self._ready += 1
            self._ready_bytes += len(data)
            if self._ready >= YIELD_EVERY or self._ready_bytes >= YIELD_BYTES:
                self._ready = self._ready_bytes = 0  # a client that always has bytes
                await trio.lowlevel.checkpoint()  # waiting must not keep the loop
            return data

    def try_receive(self, n: int) -> bytes | None:
        """What the client has sent, without waiting (None: nothing yet)."""
        try:
            return self.sock.recv(n)
        except BlockingIOError:
            return None

    async def peek(self) -> bytes:
        """The first byte the client sends, left unread (b"": it closed)."""
        while True:
            try:
                return self.sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)

    def try_send(self, parts: list[bytes]) -> int:
        """Write what the kernel takes now; the bytes written (0 also when the client is
        gone: the session's next receive finds that out and ends the connection)."""
        try:
            return self.sock.sendmsg(parts)
        except OSError:  # EAGAIN, or the client gone
            return 0

    async def send_all(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            try:
                n = self.sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            view = view[n:]

    def stream(self) -> trio.SocketStream:
        """This socket as a trio stream (for TLS): the link is not used after this."""
        return trio.SocketStream(trio.socket.from_stdlib_socket(self.sock))

    async def aclose(self) -> None:
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()


class StreamLink:
    """A connection through a trio stream (TLS): every answer goes by the writer task."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def receive(self, n: int) -> bytes:
        return await self.stream.receive_some(n)

    def try_receive(self, n: int) -> bytes | None:
        return None  # TLS: the first receive runs the handshake

    def try_send(self, parts: list[bytes]) -> int:
        return 0

    async def send_all(self, data: bytes | memoryview) -> None:
        await self.stream.send_all(data)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


Link = SocketLink | StreamLink


class Conn:
    """An authenticated connection's answers: written at once when possible, else queued
    for its writer task, which sends everything queued in one write.

    The session reads no more requests while MAX_INFLIGHT_PER_CONN are unanswered or
    OUT_MAX bytes of answers wait to be written: a client that pipelines requests and
    never reads the answers stalls only itself. (Bounded by the count alone, such a client
    grew the service past a gigabyte, since a queued answer freed its request's slot, and
    held everyone else's requests behind its answers.) A slot is freed when its answer is
    queued, not written: a client that resends many requests before it reads again (after
    a reconnect) must not wait for the service while the service waits for it.

    What it queues, and the frame it is receiving, are charged to the service's one memory
    budget (budget.py), which may pause its reading or drop it."""

    def __init__(
        self, link: Link, counters: ServiceStats | None = None, budget: Budget | None = None
    ) -> None:
        self.link = link
        self.counters = counters
        self.budget = budget if budget is not None else Budget()
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.out_since = 0.0  # when the queue last moved (began, or a write went out)
        self.partial_bytes = 0  # of a frame being received
        self.in_since = 0.0  # when that frame last got a byte
        self.inflight = 0
        self.drained = trio.Event()
        self.closed = False
        self.scope = trio.CancelScope()  # cancelled to close an idle connection
        self.idle_closed = False
        self.last_request = time.monotonic()  # the idle reaper's clock
        self.nursery: trio.Nursery | None = None  # the session's: where a writer starts
        self._writing = False
        self._held = False  # answers queued inside `corked`, to write when it ends

    @property
    def full(self) -> bool:
        """Read no more requests (until `drained`): too many in flight, too much queued,
        or some queued while the service's memory budget is tight."""
        return (
            self.inflight >= MAX_INFLIGHT_PER_CONN
            or self.out_bytes > OUT_MAX
            or (self.out_bytes > 0 and self.budget.tight)
        )

    @property
    def idle(self) -> bool:
        """Nothing in flight, queued or being written."""
        return self.inflight == 0 and self.out_bytes == 0 and not self._writing

    def send(self, body: bytes) -> None:
        if self.closed:
            return
        parts = [HEADER.pack(len(body)), body]
        held = _corked and not self._writing
        if not self.out and not self._writing and not held:
            n = self.link.try_send(parts)
            if n == 4 + len(body):
                return
            if n:  # the rest waits for the writer, as one piece
                parts = [b"".join(parts)[n:]]
        self.out += parts
        n = sum(len(p) for p in parts)
        if not self.out_bytes:
            self.out_since = time.monotonic()
        self.out_bytes += n
        self.budget.charge(self, n)  # may drop this very connection
        if not held:
            self._start_writer()
        elif not self._held:
            self._held = True
            _corked[-1].append(self)

    def _flush(self) -> None:
        """Write what was queued while `corked`: as much as the kernel takes now, up to
        IOV_PARTS pieces a sendmsg; the rest goes to the writer task."""
        self._held = False
        while self.out and not self.closed and not self._writing:
            parts = self.out[:IOV_PARTS]
            want = sum(map(len, parts))
            n = self.link.try_send(parts)
            if n:
                self._wrote(n)
            if n != want:  # the kernel took part: the rest, as one piece, to the writer
                self.out[: len(parts)] = [b"".join(parts)[n:]] if n else parts
                self._start_writer()
                break
            del self.out[: len(parts)]
        if not self.full:
            self.drained.set()

    def received(self, pending: int) -> None:
        """The session's decoder holds `pending` bytes of an unfinished frame."""
        n = pending - self.partial_bytes
        if n:
            self.partial_bytes = pending
            self.in_since = time.monotonic()
            self.budget.charge(self, n)

    def drop(self, why: str) -> None:
        """Close the connection now, for the memory budget: what it held is released."""
        if self.closed:
            return
        log.warning("dropping a connection: %s", why)
        self.close()
        self.scope.cancel()

    def close(self) -> None:
        """No more answers: the queue and the partial frame leave the budget."""
        self.closed = True
        held = self.out_bytes + self.partial_bytes
        self.out.clear()  # in place: the writer's reference to it frees nothing later
        self.out_bytes = self.partial_bytes = 0
        if held:
            self.budget.charge(self, -held)

    def _start_writer(self) -> None:
        """(An answer may come from outside the session, a group commit's or a batched
        read's, as the session ends: a closed connection starts nothing.)"""
        if not self._writing and not self.closed and self.nursery is not None:
            try:
                self.nursery.start_soon(self._writer)
            except RuntimeError:  # the session's nursery closed under a late answer
                self.close()
                return
            self._writing = True

    async def _writer(self) -> None:
        """Send the queue in writes of about WRITE_CHUNK (joining all of a long queue at
        once held it twice), releasing each from the budget once written."""
        try:
            while self.out:
                out = self.out
                k = n = 0
                while k < len(out) and n < WRITE_CHUNK:
                    n += len(out[k])
                    k += 1
                data = out[0] if k == 1 else b"".join(out[:k])
                del out[:k]
                await self.link.send_all(data)
                del data
                if self.closed:  # dropped or ended meanwhile: close() released it all
                    return
                self._wrote(n)
        finally:
            self._writing = False

    def _wrote(self, n: int) -> None:
        """n queued bytes reached the kernel: out of the queue's count and the budget."""
        self.out_bytes -= n
        self.out_since = time.monotonic()
        self.budget.charge(self, -n)
        if not self.full:
            self.drained.set()

    def reply(self, rid: int, result: Any, error: BaseException | None, method: str) -> None:
        """Answer request `rid` with its result or error; frees its in-flight slot."""
        self.inflight -= 1
        if self.counters is not None:
            self.counters.reply(method, error)
        if self.closed:  # dropped or gone: nothing to encode for
            return
        try:
            if error is None:
                body = encode_answer(rid, result)
            else:
                body = encode([rid, *_error_reply(method, error)])
        except Exception as e:  # noqa: BLE001 - an unencodable result must not kill the conn
            log.exception("cannot encode the answer of %s", method)
            body = encode([rid, errno.EIO, f"{method}: unencodable result: {e}"])
        self.send(body)
        if not self.full:
            self.drained.set()


_corked: list[list[Conn]] = []  # inside `corked()`: the connections holding answers
IOV_PARTS = 1024  # pieces per sendmsg (Linux's IOV_MAX)


@contextmanager
def corked() -> Iterator[None]:
    """Answers sent meanwhile (on the loop) are queued, and each connection's are written
    together when it ends, in one sendmsg of up to 512 answers. A group commit answers
    up to 2048 ranks in one callback: a sendmsg each (each waking the client's process)
    was ~60% of that callback, and ~0.2 s of the loop's CPU in a 16,384-rank publish."""
    held: list[Conn] = []
    _corked.append(held)
    try:
        yield
    finally:
        _corked.pop()
        for conn in held:
            conn._flush()


def _error_reply(method: str, e: BaseException) -> tuple[int, str]:
    if isinstance(e, MetaError):
        return e.errno or errno.EIO, str(e)
    if isinstance(e, TypeError | ValueError):
        return errno.EINVAL, f"bad arguments for {method}: {e}"
    return errno.EIO, str(internal_error(method, e))
