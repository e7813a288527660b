"""The network client: a MetaEngine whose methods are RPCs to `ckptfs meta serve`.

Sync and thread-safe, for worker threads and DCP ranks. One TCP connection per client
carries pipelined requests from any number of threads; an I/O thread owns reading and
reconnecting. A client that only makes plain calls (a rank of a restarted job: connect,
resolve, go) reads each answer on the calling thread instead, and starts the I/O thread
only when something needs it: a pipelined submit, an answer slower than DIRECT_WAIT, a
broken connection, TLS. For a connect, one call and a close the thread and the hand-off
of every answer between two threads were over half of the client's CPU (its restart
cost: thousands of ranks at once). `want=` asks a peer that knows it (a host's agent) for
more in the hello's answer, kept as `hello_answer` (the session's set-up in one round trip).

Replicas and failover. A URL may list several service replicas (sharing one
PostgreSQL database). The client talks to one at a time. Connection attempts
are raced (the next replica STAGGER seconds after one that has not said hello:
a hung replica costs a new client 0.25 s, not the handshake timeout). When an
open connection breaks (reset, the service killed, TCP keepalive finding the
host gone), or a watchdog finds it silent (a ping unanswered while requests are
pending: the process hung) or a request past its deadline (`allowance`: the
replica is stuck in a database call), it starts with the next replica after the
one it left. A round over every replica that finds none is
followed by a jittered exponential backoff, and so on until the retry window
(`retry=`, default 60 s) runs out for a request: the caller sees no error
while any replica answers within it. After a reconnect every unanswered
request is sent again with its original idempotency key, and the service
applies it once whichever replica it reaches (the database keeps what makes it
so: see metadata/sql/requests.py). `failovers` counts the connections opened on
another replica than the previous one, each logged in one line;
`reconnects` every connection after the first.

URL: `ckptfs://HOST:PORT[,HOST:PORT...][?token_file=PATH&retry=SECONDS&tls=1&ca=PATH]`
(an IPv6 address in brackets: `[::1]:7410`). The token comes from, in order:
the URL's `token_file=`, `CKPTFS_TOKEN`, `CKPTFS_TOKEN_FILE`. `tls=1` or
`ca=PATH` speaks TLS to services started with `--tls-cert` (see tls.py); every
replica's certificate must name the host it is listed as. A wrong token or a
TLS mismatch is an error at once, not something to fail over from.
Object-node settings come from the service (`get_config`), so address and
token are all a client needs.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import random
import select
import socket
import ssl
import threading
import time
from concurrent.futures import Future
from typing import Any

from metadata.ckptformat import pack_args
from metadata.engine import MetaEngine, MetaError
from metadata.wire.dial import CONNECT_TIMEOUT, Attempt, check_hello, keepalive
from metadata.wire.protocol import (
    MAX_FRAME,
    MUTATING_METHODS,
    PROTO_VERSION,
    REMOTE_METHODS,
    FrameDecoder,
    ProtocolError,
    decode,
    encode_frame,
)
from metadata.wire.tls import TlsSocket, client_context, describe_tls_error
from metadata.wire.url import UNREACHABLE, check_retry, parse_url, resolve_token

log = logging.getLogger("ckptfs.meta")

STAGGER = 0.25  # seconds before racing the next replica while one has not said hello
DEFAULT_RETRY = 60.0  # seconds a request is retried, over every replica, before it fails
BACKOFF_MIN, BACKOFF_MAX = 0.05, 2.0  # pause after a round over the replicas found none
PERMANENT = (errno.EACCES, errno.EPROTO)  # refusals another replica would repeat
CALL_TIMEOUT = 600.0
SEND_SLICE = 256 << 10  # submit_many writes this much at a time
DIRECT_WAIT = 1.0  # seconds a call reads its answer on its own thread before the I/O thread
# Silence and deadlines (several replicas only; docs/metadata-replicas.md says why these):
PROBE_AFTER = 1.0  # seconds of silence with requests pending before a ping is sent
PROBE_MAX = 8.0  # the gap between pings doubles up to this while each one is answered
PING_TIMEOUT = 3.0  # a ping unanswered this long: the replica is hung, fail over
QUICK_DEADLINE = 10.0  # seconds a replica may take to answer a call quick by nature
LONG_DEADLINE = 30.0  # ... a call that waits for a group commit or builds a manifest
SCAN_DEADLINE = 300.0  # ... a maintenance call that scans the volume
DEADLINE_BYTES_PER_S = 2e6  # a big request's allowance grows by a second per this many bytes
WATCH_TICK = 0.25  # seconds between the watchdog's looks at pending requests
LONG_METHODS = frozenset(
    {
        "commit_rank", "commit_ranks", "manifest", "begin", "abort", "expire", "delete_checkpoint",
        "missing_chunks", "mark_durable", "commit_file", "stats", "sync", "list_checkpoints",
        "checkpoint_info", "renew_chunk_leases", "end_chunk_leases", "set_retention",
    }
)  # fmt: skip
SCAN_METHODS = frozenset(
    {
        "chunk_rows", "true_refcounts", "files_using", "known_chunks", "under_replicated",
        "pending_refs", "gc_chunk_rows", "fix_refcounts", "purge_orphans", "retain",
        "apply_retention", "drop_chunk_rows", "register_chunk_rows", "apply_pending",
        "gc_orphan_objects", "gc_release_objects", "record_under_replicated",
        "clear_under_replicated", "changes_since", "inode_path",
    }
)  # fmt: skip


def allowance(method: str, args: Any, kwargs: Any, size: int) -> float:
    """Seconds a replica may take to answer this request before the client fails over:
    what the call is by nature, what it waits for itself (wait_published's timeout), and
    a second per DEADLINE_BYTES_PER_S of request (a big commit)."""
    if method in SCAN_METHODS:
        base = SCAN_DEADLINE
    elif method in LONG_METHODS:
        base = LONG_DEADLINE
    else:
        base = QUICK_DEADLINE
    return base + waits_for(method, args, kwargs) + size / DEADLINE_BYTES_PER_S


def waits_for(method: str, args: Any, kwargs: Any) -> float:
    """Seconds the request waits by its own argument (wait_published's timeout), else 0."""
    if method != "wait_published":
        return 0.0
    t = kwargs.get("timeout", args[2] if len(args) > 2 else 60.0)
    try:
        return min(max(float(t), 0.0), 86400.0)
    except (TypeError, ValueError):
        return 0.0


def _result_fix(method: str, value: Any) -> Any:
    if method == "chunk_info":
        return {k: tuple(v) for k, v in value.items()}
    return value


class _Pending:
    __slots__ = ("frame", "future", "method", "expires", "allow", "sent", "due", "overdue")

    def __init__(
        self, frame: bytes, future: Future, method: str, expires: float, allow: float, now: float
    ) -> None:
        self.frame = frame
        self.future = future
        self.method = method
        self.expires = expires  # the retry window: past it the caller gets ETIMEDOUT
        self.allow = allow  # seconds one replica may take (`allowance`)
        self.overdue = 0  # times a replica let it pass its deadline: the next allows 2**n
        self.sent = now
        self.due = now + allow

    def sent_again(self, now: float) -> None:
        self.sent = now
        self.due = now + self.allow * (1 << min(self.overdue, 4))


def _call_args(frame: bytes, method: str) -> tuple[list, dict]:
    """A request's arguments, for the one method whose deadline depends on them."""
    if method != "wait_published":
        return [], {}
    try:
        msg = decode(memoryview(frame)[4:])
        return list(msg[2]), dict(msg[3])
    except (ProtocolError, TypeError, ValueError, IndexError):
        return [], {}


def connect(spec: str, **kw: Any) -> RemoteEngine:
    """A client for a `ckptfs://HOST:PORT[,HOST:PORT...]` URL: the first replica that
    answers, tried in order (and over again, with backoff) for the retry window."""
    replicas, params = parse_url(spec)
    token = kw.pop("token", None) or resolve_token(params)
    if "retry" in params:
        kw.setdefault("retry_for", check_retry(params["retry"][0]))
    kw.setdefault("tls", client_context(params))
    return RemoteEngine(replicas, token, **kw)


class RemoteEngine(MetaEngine):
    """MetaEngine over the wire; methods in protocol.REMOTE_METHODS are forwarded."""

    def __init__(
        self,
        replicas: list[tuple[str, int]],
        token: str,
        *,
        retry_for: float = DEFAULT_RETRY,
        max_frame: int = MAX_FRAME,
        tls: ssl.SSLContext | None = None,
        want: tuple[str, ...] = (),
    ) -> None:
        if not replicas or not all(
            isinstance(h, str) and h and isinstance(p, int) for h, p in replicas
        ):
            raise MetaError(errno.EINVAL, f"replicas must be (host, port) pairs, not {replicas!r}")
        self.replicas = list(replicas)
        self._at = 0  # the replica of the current (or last) connection
        self.tls = tls
        self._token = token
        self._want = {"want": list(want)} if want else {}  # sent in every hello (docstring)
        self.hello_answer: dict = {}  # the current connection's hello answer
        self.retry_for = check_retry(retry_for)
        self.max_frame = max_frame
        self._lock = threading.Lock()  # pending map and connection state
        self._send_lock = threading.Lock()  # socket writes, resends
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self._sock: socket.socket | TlsSocket | None = None
        self._closed = False
        self._fatal: MetaError | None = None
        self.reconnects = 0
        self.failovers = 0
        self.hangs = 0  # connections left for silence or a missed deadline (the watchdog)
        self._rx_at = time.monotonic()  # when the current connection last gave us bytes
        self._ping_at: float | None = None  # a probe sent and not yet answered by bytes
        self._probe_gap = PROBE_AFTER
        self._broken: tuple[Any, str] | None = None  # (socket, why) the watchdog broke
        self._watch_wake = threading.Event()
        self._watchdog: threading.Thread | None = None
        # A wrong token fails at once; no replica answering, after the retry window.
        sock = self._connect(time.monotonic() + self.retry_for)
        self._sock = sock
        self._dec = FrameDecoder(self.max_frame)  # the first connection's, shared by both readers
        self._io: threading.Thread | None = None  # started when a call cannot read for itself
        self._reading = threading.Lock()  # held by whoever reads: a caller, or the I/O start

    # -- connection ----------------------------------------------------------------
    @property
    def host(self) -> str:
        return self.replicas[self._at][0]

    @property
    def port(self) -> int:
        return self.replicas[self._at][1]

    def _where(self, i: int) -> str:
        host, port = self.replicas[i]
        if host.startswith("/"):  # a Unix socket (wire/dial.py)
            return host
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _connect(
        self,
        deadline: float | None,
        start: int = 0,
        came_from: int = 0,
        why: str = "",
        on_round: Any = None,
    ) -> socket.socket | TlsSocket:
        """A connection to the first replica that answers, trying them in list order from
        `start`, round and round; after each round that found none, `on_round(error)` and
        a jittered backoff, until `deadline` (None: until the client is closed).

        A connection on another replica than `came_from` (the one just lost, or the first
        listed) is a failover: counted, and logged in one line with `why` (or the error
        `came_from` gave)."""
        delay = BACKOFF_MIN
        n = len(self.replicas)
        while True:
            errors: dict[int, str] = {}
            order = [(start + k) % n for k in range(n)]
            race = self._race_threads if self.tls is not None else self._race
            won = race(order, errors)
            if won is not None:
                i, sock = won
                self._at = i
                if i != came_from:
                    self.failovers += 1
                    # One line, each address once: the error names the replica itself
                    # ("cannot reach the metadata service at ADDR: ..."), and the CLI's
                    # log format already says "ckptfs: WARNING:".
                    gone = self._where(came_from)
                    reason = why or errors.get(came_from, "unreachable")
                    reason = reason.removeprefix(f"{UNREACHABLE}{gone}: ").removeprefix(
                        f"handshake with {gone}: "
                    )
                    log.warning(
                        "metadata service at %s: %s; failed over to %s",
                        gone, reason, self._where(i),
                    )  # fmt: skip
                return sock
            if self._closed:
                raise MetaError(errno.EBADF, "client closed")
            if n == 1:
                msg = errors.get(start, "unreachable")
            else:
                each = "; ".join(e.removeprefix(UNREACHABLE) for e in errors.values())
                msg = f"no replica of the metadata service answers ({each})"
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                tried = f" (tried for {self.retry_for:g} s)" if self.retry_for else ""
                raise MetaError(errno.ECONNREFUSED, msg + tried)
            err = MetaError(errno.ECONNREFUSED, msg)
            if deadline is not None and delay == BACKOFF_MIN:  # a new client, first round
                log.warning(
                    "%s; retrying for up to %g s (retry= in the URL)",
                    msg, self.retry_for,
                )  # fmt: skip
            if on_round is not None:
                on_round(err)
            pause = delay * (0.5 + random.random())
            time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))
            delay = min(delay * 2, BACKOFF_MAX)

    def _hello(self) -> bytes:
        return encode_frame({"proto": PROTO_VERSION, "token": self._token, **self._want})

    def _race(self, order: list[int], errors: dict[int, str]) -> tuple[int, socket.socket] | None:
        """Connection attempts to the replicas in `order`, raced (happy eyeballs): the next
        starts when every started one failed, or STAGGER seconds after the last started
        while none has said hello; the first hello wins and the rest are closed. A hung
        replica (its kernel accepts, the process never answers) costs a new client
        STAGGER, not CONNECT_TIMEOUT. Non-blocking sockets on this thread: no thread
        per attempt (thousands of ranks connect at once). None: every attempt failed
        (each error in `errors`); a permanent refusal is raised."""
        hello = self._hello()
        todo = list(order)
        live: list[Attempt] = []
        next_at = 0.0
        try:
            while True:
                now = time.monotonic()
                if todo and (not live or now >= next_at):
                    if self._closed:
                        raise MetaError(errno.EBADF, "client closed")
                    a = Attempt(self, todo.pop(0), hello, now)
                    live.append(a)
                    next_at = now + STAGGER
                else:
                    if not live:
                        return None
                    until = min(a.deadline for a in live)
                    if todo:
                        until = min(until, next_at)
                    poll = select.poll()
                    by_fd: dict[int, Attempt] = {}
                    for a in live:
                        if a.sock is not None and a.result is None and a.error is None:
                            by_fd[a.sock.fileno()] = a
                            poll.register(a.sock, a.events())
                    for fd, ev in poll.poll(max(0.0, until - now) * 1000) if by_fd else ():
                        by_fd[fd].on_event(ev)
                    now = time.monotonic()
                    for a in live:
                        if a.result is None and a.error is None and now >= a.deadline:
                            a.timed_out()
                for a in list(live):
                    if a.error is not None:
                        live.remove(a)
                        if a.error.errno in PERMANENT:
                            raise a.error
                        errors[a.i] = str(a.error)
                    elif a.result is not None:
                        live.remove(a)
                        for other in live:  # still opening: slower than the winner
                            errors[other.i] = f"no hello in {now - other.started:.2f} s"
                        self.hello_answer = a.answer
                        return a.i, a.result
        finally:
            for a in live:
                a.close()

    def _race_threads(
        self, order: list[int], errors: dict[int, str]
    ) -> tuple[int, socket.socket | TlsSocket] | None:
        """`_race` for TLS connections (whose handshake is blocking): an attempt per
        thread, started the same way; a late winner closes its own connection."""
        results: queue.SimpleQueue = queue.SimpleQueue()
        done = threading.Lock()  # held while deciding; `over` set once a winner is taken
        over: list[bool] = []

        def attempt(i: int) -> None:
            try:
                got: Any = self._open(i, CONNECT_TIMEOUT)
            except MetaError as e:
                got = e
            with done:
                if over and not isinstance(got, MetaError):
                    got.close()
                    return
                results.put((i, got))

        todo = list(order)
        running: dict[int, float] = {}
        next_at = 0.0
        try:
            while True:
                now = time.monotonic()
                if todo and (not running or now >= next_at):
                    if self._closed:
                        raise MetaError(errno.EBADF, "client closed")
                    i = todo.pop(0)
                    running[i] = now
                    threading.Thread(target=attempt, args=(i,), daemon=True).start()
                    next_at = now + STAGGER
                    continue
                if not running:
                    return None
                wait = next_at - now if todo else CONNECT_TIMEOUT + 1
                try:
                    i, got = results.get(timeout=max(0.0, wait))
                except queue.Empty:
                    continue
                del running[i]
                if isinstance(got, MetaError):
                    if got.errno in PERMANENT:
                        raise got
                    errors[i] = str(got)
                    continue
                for j, t in running.items():
                    errors[j] = f"no hello in {time.monotonic() - t:.2f} s"
                return i, got
        finally:
            with done:
                over.append(True)
            while True:  # finished meanwhile: not taken
                try:
                    _i, got = results.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(got, MetaError):
                    got.close()

    def _open(self, i: int, timeout: float) -> socket.socket | TlsSocket:
        """One connection to replica `i`, handshake done."""
        host, port = self.replicas[i]
        try:
            sock: socket.socket | TlsSocket = socket.create_connection(
                (host, port), timeout=timeout
            )
        except OSError as e:
            raise MetaError(errno.ECONNREFUSED, f"{UNREACHABLE}{self._where(i)}: {e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keepalive(sock)
            if self.tls is not None:
                try:
                    sock = TlsSocket(sock, self.tls, host, timeout)
                except ssl.SSLError as e:
                    raise describe_tls_error(host, port, e) from None
            sock.sendall(self._hello())
            dec = FrameDecoder(self.max_frame)
            frames: list[bytes | memoryview] = []
            while not frames:
                data = sock.recv(65536)
                if not data:
                    hint = "" if self.tls else " (a service with TLS? add ?ca=PATH or ?tls=1)"
                    raise ConnectionError(
                        f"service closed the connection during the handshake{hint}"
                    )
                frames = dec.feed(data)
            self.hello_answer = check_hello(frames[0])  # replicas answer alike (one database)
            sock.settimeout(None)
            if frames[1:]:
                raise ProtocolError("unexpected frames after the handshake")
            return sock
        except MetaError:
            sock.close()
            raise
        except (OSError, ProtocolError) as e:
            sock.close()
            raise MetaError(errno.ECONNRESET, f"handshake with {self._where(i)}: {e}") from None

    def _start_io(self) -> None:
        """The I/O thread, from now on the only reader (after a caller reading its own
        answer is done, with the same frame decoder)."""
        if self._io is not None:
            return
        with self._reading:
            if self._io is None and not self._closed:
                with self._lock:
                    sock = self._sock
                self._io = threading.Thread(target=self._io_loop, args=(sock,), daemon=True)
                self._io.start()
                if len(self.replicas) > 1:  # one replica: nothing to fail over to
                    self._watchdog = threading.Thread(
                        target=self._watch_loop, name="ckptfs-meta-watch", daemon=True
                    )
                    self._watchdog.start()

    # -- silence and deadlines (the watchdog) ------------------------------------------
    def _watch_loop(self) -> None:
        while not self._closed:
            self._watch_wake.wait(WATCH_TICK)
            if self._closed:
                return
            try:
                self._watch(time.monotonic())
            except Exception:  # noqa: BLE001 - the watchdog must outlive surprises
                log.debug("metadata client watchdog", exc_info=True)

    def _watch(self, now: float) -> None:
        """Leave a connection whose replica let a request pass its deadline (stuck in a
        database call: its loop may still answer pings), or that stayed silent past
        PING_TIMEOUT after a ping while requests were pending (the process hung: stopped,
        swapping, a loop that never returns). The I/O thread then reconnects, to the next
        replica first, and sends what is pending again with its idempotency keys."""
        with self._lock:
            sock = self._sock
            if sock is None or not self._pending:
                self._ping_at = None
                self._probe_gap = PROBE_AFTER
                return
            late = None
            oldest = now
            for p in self._pending.values():
                if p.due <= now and late is None:
                    late = p
                if p.sent < oldest:
                    oldest = p.sent
            if late is not None:
                late.overdue += 1
            rx_at, ping_at = self._rx_at, self._ping_at
        if late is not None:
            took = now - late.sent
            self._leave(sock, f"no answer to {late.method} in {took:.1f} s")
            return
        if ping_at is not None and rx_at < ping_at:
            if now - ping_at >= PING_TIMEOUT:
                quiet = now - max(rx_at, oldest)
                self._leave(
                    sock, f"silent for {quiet:.1f} s with requests pending, a ping unanswered"
                )
            return
        if ping_at is not None:  # answered: the next one later
            self._ping_at = None
            self._probe_gap = min(self._probe_gap * 2, PROBE_MAX)
        if now - max(rx_at, oldest) >= self._probe_gap:
            self._probe(sock, now)

    def _probe(self, sock: socket.socket | TlsSocket, now: float) -> None:
        """Send a ping (its answer is any bytes arriving; it is no pending request). Only
        when no write is under way and the socket takes it without blocking: a write
        stuck on a replica that stopped reading is the deadline's to find."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            raw = getattr(sock, "_sock", sock)
            poll = select.poll()
            poll.register(raw, select.POLLOUT)
            if not poll.poll(0):
                return
            with self._lock:
                if self._sock is not sock:
                    return
                rid = self._next_id
                self._next_id += 1
                self._ping_at = now
            sock.sendall(encode_frame([rid, "ping", [], {}, None]))
        except OSError:
            pass  # the reader notices
        finally:
            self._send_lock.release()

    def _leave(self, sock: socket.socket | TlsSocket, why: str) -> None:
        """Break the connection (the reader reconnects): the watchdog's verdict."""
        with self._lock:
            if self._sock is not sock or (self._broken is not None and self._broken[0] is sock):
                return  # gone already, or left already
            self._broken = (sock, why)
            self.hangs += 1
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read_until(self, fut: Future) -> None:
        """Read answers on the calling thread until `fut` has one, while they come within
        DIRECT_WAIT; anything else (slow, broken, TLS) is left to the I/O thread. Every
        answer read is delivered, whoever asked. A broken connection is shut down, so
        that the I/O thread starts with a reconnect and resends what is pending."""
        with self._lock:
            sock = self._sock
        if not isinstance(sock, socket.socket):
            return  # TLS, or reconnecting: the I/O thread
        poll = select.poll()  # not a socket timeout: other threads may be sending on it
        poll.register(sock, select.POLLIN)
        try:
            while not fut.done():
                if not poll.poll(DIRECT_WAIT * 1000):
                    return
                data = sock.recv(1 << 20)
                if not data:
                    raise ConnectionError("the service closed the connection")
                self._deliver(self._dec.feed(data))
        except (OSError, ProtocolError):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _io_loop(self, sock: socket.socket | TlsSocket | None) -> None:
        """Read responses; on a broken connection reconnect (the next replica first) and
        resend what is pending."""
        resender: threading.Thread | None = None
        lost = ""
        dec = self._dec
        while not self._closed:
            if sock is None:
                gone = self._at  # tried last: the next replica first
                try:
                    sock = self._connect(
                        None, (gone + 1) % len(self.replicas), gone, lost, self._expire_all
                    )
                except MetaError as e:
                    if e.errno in PERMANENT:
                        self._fail_all(e, permanent=True)
                    return  # closed, or refused for good
                self.reconnects += 1
                resender = threading.Thread(
                    target=self._resend, args=(sock,), name="ckptfs-meta-resend", daemon=True
                )
                resender.start()
            try:
                self._read(sock, dec)
                lost = "the service closed the connection"
            except (OSError, ProtocolError) as e:
                lost = f"connection lost: {e}"
            with self._lock:
                if self._broken is not None and self._broken[0] is sock:
                    lost = self._broken[1]
                self._broken = None
            try:  # wakes a resend blocked in sendall on this connection
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if resender is not None:
                resender.join()
                resender = None
            with self._lock:
                if self._sock is sock:
                    self._sock = None
            try:
                sock.close()
            except OSError:
                pass
            sock = None
            dec = FrameDecoder(self.max_frame)

    def _resend(self, sock: socket.socket | TlsSocket) -> None:
        """After a reconnect: make `sock` the connection and send every pending request
        again, while the I/O thread reads the answers. Sent from the I/O thread itself,
        before it read anything, a resend bigger than what the service queues for one
        connection (OUT_MAX of answers) and the socket buffers hold left each side waiting
        for the other: the client hung for good after a service restart."""
        with self._send_lock:
            with self._lock:
                self._sock = sock
                now = time.monotonic()
                self._rx_at, self._ping_at, self._probe_gap = now, None, PROBE_AFTER
                resend = []
                for p in self._pending.values():
                    p.sent_again(now)
                    resend.append(p.frame)
            try:
                for fr in resend:
                    sock.sendall(fr)
            except OSError:
                pass  # the reader notices

    def _read(self, sock: socket.socket | TlsSocket, dec: FrameDecoder) -> None:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                return
            self._deliver(dec.feed(data))

    def _deliver(self, bodies: list[bytes | memoryview]) -> None:
        self._rx_at = time.monotonic()  # any bytes: the replica's loop is alive
        for body in bodies:
            msg = decode(body)
            if not isinstance(msg, list) or len(msg) != 3:
                raise ProtocolError("bad response")
            rid, code, payload = msg
            if rid == 0:  # the service rejected our stream
                raise ProtocolError(f"service: {payload}")
            self._on_answer(rid, code, payload)

    def _on_answer(self, rid: int, code: int, payload: Any) -> None:
        """Hand the answer of request `rid` to its caller. (Tests override this to lose an
        answer: raising OSError here breaks the connection with the request pending.)"""
        with self._lock:
            p = self._pending.pop(rid, None)
        if p is None or p.future.done():
            return
        if code:
            p.future.set_exception(MetaError(code, str(payload)))
        else:
            try:
                p.future.set_result(_result_fix(p.method, payload))
            except Exception as e:  # noqa: BLE001 - deliver, don't kill the reader
                p.future.set_exception(e)

    def _expire_all(self, cause: MetaError) -> None:
        self._expire_pending(time.monotonic(), cause)

    def _expire_pending(self, now: float, cause: MetaError) -> None:
        with self._lock:
            dead = [rid for rid, p in self._pending.items() if p.expires <= now]
            gone = [self._pending.pop(rid) for rid in dead]
        for p in gone:
            if not p.future.done():
                p.future.set_exception(
                    MetaError(errno.ETIMEDOUT, f"metadata service unreachable: {cause}")
                )

    def _fail_all(self, err: MetaError, *, permanent: bool = False) -> None:
        with self._lock:
            if permanent:
                self._fatal = err
            gone = list(self._pending.values())
            self._pending.clear()
        for p in gone:
            if not p.future.done():
                p.future.set_exception(err)

    # -- calls -------------------------------------------------------------------
    def submit(self, method: str, *args: Any, **kwargs: Any) -> Future:
        """Send a request without waiting (pipelining); the Future holds the answer."""
        return self.submit_many([(method, args, kwargs)])[0]

    def submit_many(self, calls: list[tuple[str, tuple, dict]]) -> list[Future]:
        """Pipeline many requests; each behaves as `submit`.

        For a process that speaks for many ranks at once (a coordinator, the
        commit benchmark). A request over the frame limit is not sent; its
        future holds the E2BIG error.
        """
        return self.submit_encoded(self.encode_many(calls))

    def encode_many(
        self,
        calls: list[tuple[str, tuple, dict]],
        *,
        token: str | None = None,
        keys: list[bytes | None] | None = None,
    ) -> list[tuple]:
        """Encode requests now (ids and idempotency keys assigned) to send later with
        `submit_encoded`: a process speaking for many ranks can pay the encoding
        before the moment they all send. `token`: each request carries it, and the
        service checks it instead of this connection's own (`behalf`). `keys`: the keys
        to send (a host's agent forwards its ranks' own: a retry is still applied once)."""
        out: list[tuple] = []
        for i, (method, args, kwargs) in enumerate(calls):
            args = pack_args(method, args)  # a commit's files, packed
            key = keys[i] if keys is not None else None
            if key is None and method in MUTATING_METHODS:
                key = os.urandom(16)
            with self._lock:
                rid = self._next_id
                self._next_id += 1
            req = [rid, method, list(args), kwargs, key]
            if token is not None:  # the request's own credential (wire/protocol.py)
                req.append(token)
            fr = encode_frame(req)
            out.append((rid, method, fr))
        return out

    def submit_encoded(self, encoded: list[tuple], *, reader: bool = True) -> list[Future]:
        """Send requests from `encode_many` (each once), pipelined in SEND_SLICE writes.
        `reader=False`: the caller reads the answers itself (call)."""
        if self._closed:
            raise MetaError(errno.EBADF, "client is closed")
        if self._fatal is not None:
            raise self._fatal
        if reader:  # before sending: a big pipeline's answers must be read while it is sent
            self._start_io()
        futs: list[Future] = []
        now = time.monotonic()
        expires = now + self.retry_for
        with self._send_lock:
            frames: list[bytes] = []
            size = 0
            for rid, method, fr in encoded:
                fut: Future = Future()
                futs.append(fut)
                if len(fr) - 4 > self.max_frame:
                    fut.set_exception(
                        MetaError(errno.E2BIG, f"{method} request over {self.max_frame} bytes")
                    )
                    continue
                args, kwargs = _call_args(fr, method)
                allow = allowance(method, args, kwargs, len(fr) - 4)
                # a wait's retry window starts when its own wait would end: a service may
                # close a connection that only waits, to make room, and the wait goes on
                exp = expires + waits_for(method, args, kwargs)
                with self._lock:
                    self._pending[rid] = _Pending(fr, fut, method, exp, allow, now)
                frames.append(fr)
                size += len(fr)
                if size >= SEND_SLICE:
                    self._send(frames)
                    frames, size = [], 0
            if frames:
                self._send(frames)
        return futs

    def _send(self, frames: list[bytes]) -> None:
        """Write frames whose requests are registered (the caller holds _send_lock). A
        failed write wakes the reader, which reconnects and resends what is pending."""
        with self._lock:
            sock = self._sock
        if sock is None:
            return  # the reader is reconnecting; it resends everything pending
        try:
            sock.sendall(b"".join(frames))
        except OSError:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def behalf(self, token: str) -> OnBehalf:
        """This client's methods as another credential (`token`): the same connection and
        failover, each request checked against `token`'s role and scope. A host's client
        carries its ranks this way, each with its own credential."""
        return OnBehalf(self, token)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.call_as(None, method, args, kwargs)

    def call_as(self, token: str | None, method: str, args: tuple, kwargs: dict) -> Any:
        timeout = CALL_TIMEOUT
        if method == "wait_published":
            timeout += float(kwargs.get("timeout", args[2] if len(args) > 2 else 60.0))
        encoded = self.encode_many([(method, args, kwargs)], token=token)
        (fut,) = self.submit_encoded(encoded, reader=False)
        if self._io is None and self._reading.acquire(blocking=False):
            try:
                if self._io is None:
                    self._read_until(fut)
            finally:
                self._reading.release()
        if not fut.done() or self._pending:  # slow, lost, or another thread's answers
            self._start_io()
        if not fut.done() and self._closed:  # closed meanwhile: nobody will answer
            self._fail_all(MetaError(errno.EBADF, "client closed"))
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise MetaError(errno.ETIMEDOUT, f"{method}: no answer in {timeout:.0f}s") from None

    def init_volume(self, config: dict) -> None:
        raise MetaError(errno.EPERM, "format a volume on the service host, not over the network")

    def close(self) -> None:
        self._closed = True
        with self._lock:
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._reading:  # a caller reading its answer has given up the socket
            io = self._io
            if io is None and sock is not None:  # no reader will close it
                with self._lock:
                    self._sock = None
                sock.close()
        self._watch_wake.set()
        if io is not None:
            io.join(timeout=5)
        self._fail_all(MetaError(errno.EBADF, "client closed"))


class OnBehalf:
    """A RemoteEngine's remote methods on behalf of another credential (`behalf`)."""

    def __init__(self, engine: RemoteEngine, token: str) -> None:
        self._engine = engine
        self._token = token

    def __getattr__(self, name: str) -> Any:
        if name not in REMOTE_METHODS:
            raise AttributeError(name)
        engine, token = self._engine, self._token
        return lambda *args, **kwargs: engine.call_as(token, name, args, kwargs)

    def __repr__(self) -> str:
        return f"<on behalf of another credential over {self._engine!r}>"


def _forwarder(name: str) -> Any:
    def method(self: RemoteEngine, *args: Any, **kwargs: Any) -> Any:
        return self.call(name, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"RemoteEngine.{name}"
    method.__doc__ = f"Remote call of the engine's `{name}`."
    return method


for _name in sorted(REMOTE_METHODS):
    if _name not in RemoteEngine.__dict__:
        setattr(RemoteEngine, _name, _forwarder(_name))
RemoteEngine.__abstractmethods__ = frozenset()
