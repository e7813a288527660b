"""The network client: a MetaEngine whose methods are RPCs to `ckptfs meta serve`.

Sync and thread-safe, for worker threads and DCP ranks. One TCP connection
per client carries pipelined requests from any number of threads; an I/O
thread owns reading and reconnecting. When the connection drops, it
reconnects with exponential backoff and resends every unanswered request
with its original idempotency key, so a commit retried across a service
restart is applied once (the service dedups keys; checkpoint commits are
also idempotent by content).

URL: `ckptfs://HOST:PORT[?token_file=PATH&retry=SECONDS&tls=1&ca=PATH]`. The
token comes from, in order: the URL's `token_file=`, `CKPTFS_TOKEN`,
`CKPTFS_TOKEN_FILE`. `tls=1` or `ca=PATH` speaks TLS to a service started
with `--tls-cert` (see tls.py).
Object-node settings come from the service (`get_config`), so address and
token are all a client needs.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import ssl
import threading
import time
from concurrent.futures import Future
from typing import Any
from urllib.parse import parse_qs, urlsplit

from metadata.ckptformat import pack_files
from metadata.engine import MetaEngine, MetaError
from metadata.protocol import (
    MAX_FRAME,
    MUTATING_METHODS,
    PROTO_VERSION,
    REMOTE_METHODS,
    FrameDecoder,
    ProtocolError,
    decode,
    encode_frame,
)
from metadata.tls import TlsSocket, client_context, describe_tls_error

CONNECT_TIMEOUT = 5.0
DEFAULT_RETRY = 60.0
CALL_TIMEOUT = 600.0
SEND_SLICE = 256 << 10  # submit_many writes this much at a time


def _result_fix(method: str, value: Any) -> Any:
    if method == "chunk_info":
        return {k: tuple(v) for k, v in value.items()}
    return value


class _Pending:
    __slots__ = ("frame", "future", "method", "expires")

    def __init__(self, frame: bytes, future: Future, method: str, expires: float) -> None:
        self.frame = frame
        self.future = future
        self.method = method
        self.expires = expires


def resolve_token(params: dict[str, list[str]]) -> str:
    files = params.get("token_file")
    if files:
        return _read_token(files[0])
    if os.environ.get("CKPTFS_TOKEN"):
        return os.environ["CKPTFS_TOKEN"].strip()
    if os.environ.get("CKPTFS_TOKEN_FILE"):
        return _read_token(os.environ["CKPTFS_TOKEN_FILE"])
    raise MetaError(
        errno.EACCES,
        "no token for the metadata service: set CKPTFS_TOKEN or CKPTFS_TOKEN_FILE, "
        "or add ?token_file=PATH to the ckptfs:// URL",
    )


def _read_token(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise MetaError(errno.EACCES, f"cannot read token file {path}: {e.strerror}") from None


def parse_url(spec: str) -> tuple[str, int, dict[str, list[str]]]:
    parts = urlsplit(spec)
    if parts.scheme != "ckptfs" or not parts.hostname or parts.port is None:
        raise MetaError(errno.EINVAL, f"bad service URL {spec!r}: expected ckptfs://HOST:PORT")
    return parts.hostname, parts.port, parse_qs(parts.query)


def connect(spec: str, **kw: Any) -> RemoteEngine:
    """A client for a `ckptfs://HOST:PORT` URL; fails fast if the service is unreachable."""
    try:
        host, port, params = parse_url(spec)
    except ValueError as e:
        raise MetaError(errno.EINVAL, f"bad service URL {spec!r}: {e}") from None
    token = kw.pop("token", None) or resolve_token(params)
    if "retry" in params:
        kw.setdefault("retry_for", float(params["retry"][0]))
    kw.setdefault("tls", client_context(params))
    return RemoteEngine(host, port, token, **kw)


class RemoteEngine(MetaEngine):
    """MetaEngine over the wire; methods in protocol.REMOTE_METHODS are forwarded."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        retry_for: float = DEFAULT_RETRY,
        max_frame: int = MAX_FRAME,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.tls = tls
        self._token = token
        self.retry_for = retry_for
        self.max_frame = max_frame
        self._lock = threading.Lock()  # pending map and connection state
        self._send_lock = threading.Lock()  # socket writes, resends
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self._sock: socket.socket | TlsSocket | None = None
        self._closed = False
        self._fatal: MetaError | None = None
        self.reconnects = 0
        sock = self._open(CONNECT_TIMEOUT)  # fail fast on a wrong address or token
        self._sock = sock
        self._io = threading.Thread(target=self._io_loop, args=(sock,), daemon=True)
        self._io.start()

    # -- connection ----------------------------------------------------------------
    def _open(self, timeout: float) -> socket.socket | TlsSocket:
        try:
            sock: socket.socket | TlsSocket = socket.create_connection(
                (self.host, self.port), timeout=timeout
            )
        except OSError as e:
            raise MetaError(
                errno.ECONNREFUSED,
                f"cannot reach the metadata service at {self.host}:{self.port}: {e}",
            ) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                try:
                    sock = TlsSocket(sock, self.tls, self.host, timeout)
                except ssl.SSLError as e:
                    raise describe_tls_error(self.host, self.port, e) from None
            sock.sendall(encode_frame({"proto": PROTO_VERSION, "token": self._token}))
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
            reply = decode(frames[0])
            if not isinstance(reply, dict) or not reply.get("ok"):
                err = reply.get("errno", errno.EPROTO) if isinstance(reply, dict) else errno.EPROTO
                msg = reply.get("error", "handshake refused") if isinstance(reply, dict) else "?"
                raise MetaError(err, f"metadata service refused the connection: {msg}")
            sock.settimeout(None)
            if frames[1:]:
                raise ProtocolError("unexpected frames after the handshake")
            return sock
        except MetaError:
            sock.close()
            raise
        except (OSError, ProtocolError) as e:
            sock.close()
            raise MetaError(
                errno.ECONNRESET, f"handshake with {self.host}:{self.port}: {e}"
            ) from None

    def _io_loop(self, sock: socket.socket | TlsSocket) -> None:
        """Read responses; on a broken connection reconnect and resend what is pending."""
        delay = 0.05
        down_since: float | None = None
        resender: threading.Thread | None = None
        while not self._closed:
            if sock is None:
                try:
                    sock = self._open(CONNECT_TIMEOUT)
                except MetaError as e:
                    now = time.monotonic()
                    down_since = down_since or now
                    if e.errno == errno.EACCES or e.errno == errno.EPROTO:
                        self._fail_all(e, permanent=True)
                        return
                    self._expire_pending(now, e)
                    time.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 2.0)
                    continue
                delay, down_since = 0.05, None
                self.reconnects += 1
                resender = threading.Thread(
                    target=self._resend, args=(sock,), name="ckptfs-meta-resend", daemon=True
                )
                resender.start()
            try:
                self._read(sock)
            except (OSError, ProtocolError):
                pass
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
            sock = None  # type: ignore[assignment]

    def _resend(self, sock: socket.socket | TlsSocket) -> None:
        """After a reconnect: make `sock` the connection and send every pending request
        again, while the I/O thread reads the answers. Sent from the I/O thread itself,
        before it read anything, a resend bigger than what the service queues for one
        connection (OUT_MAX of answers) and the socket buffers hold left each side waiting
        for the other: the client hung for good after a service restart."""
        with self._send_lock:
            with self._lock:
                self._sock = sock
                resend = [p.frame for p in self._pending.values()]
            try:
                for fr in resend:
                    sock.sendall(fr)
            except OSError:
                pass  # the reader notices

    def _read(self, sock: socket.socket | TlsSocket) -> None:
        dec = FrameDecoder(self.max_frame)
        while True:
            data = sock.recv(1 << 20)
            if not data:
                return
            for body in dec.feed(data):
                msg = decode(body)
                if not isinstance(msg, list) or len(msg) != 3:
                    raise ProtocolError("bad response")
                rid, code, payload = msg
                if rid == 0:  # the service rejected our stream
                    raise ProtocolError(f"service: {payload}")
                with self._lock:
                    p = self._pending.pop(rid, None)
                if p is None or p.future.done():
                    continue
                if code:
                    p.future.set_exception(MetaError(code, str(payload)))
                else:
                    try:
                        p.future.set_result(_result_fix(p.method, payload))
                    except Exception as e:  # noqa: BLE001 - deliver, don't kill the reader
                        p.future.set_exception(e)

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

    def encode_many(self, calls: list[tuple[str, tuple, dict]]) -> list[tuple]:
        """Encode requests now (ids and idempotency keys assigned) to send later with
        `submit_encoded`: a process speaking for many ranks can pay the encoding
        before the moment they all send."""
        out: list[tuple] = []
        for method, args, kwargs in calls:
            if method == "commit_rank" and len(args) >= 4:
                args = (*args[:3], pack_files(args[3]), *args[4:])
            key = os.urandom(16) if method in MUTATING_METHODS else None
            with self._lock:
                rid = self._next_id
                self._next_id += 1
            fr = encode_frame([rid, method, list(args), kwargs, key])
            out.append((rid, method, fr))
        return out

    def submit_encoded(self, encoded: list[tuple]) -> list[Future]:
        """Send requests from `encode_many` (each once), pipelined in SEND_SLICE writes."""
        if self._closed:
            raise MetaError(errno.EBADF, "client is closed")
        if self._fatal is not None:
            raise self._fatal
        futs: list[Future] = []
        expires = time.monotonic() + self.retry_for
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
                with self._lock:
                    self._pending[rid] = _Pending(fr, fut, method, expires)
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

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        timeout = CALL_TIMEOUT
        if method == "wait_published":
            timeout += float(kwargs.get("timeout", args[2] if len(args) > 2 else 60.0))
        fut = self.submit(method, *args, **kwargs)
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
        self._io.join(timeout=5)
        self._fail_all(MetaError(errno.EBADF, "client closed"))


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
