"""Opening a connection to one service replica: TCP keepalive, and one plain-TCP attempt
(non-blocking connect, hello, answer) that the client races across its replicas
(metadata/client.py `RemoteEngine._race`). A replica whose host is an absolute path is a
Unix socket (a host's ckptfs agent speaks the same protocol there; its port is ignored)."""

from __future__ import annotations

import errno
import os
import select
import socket
from typing import TYPE_CHECKING

from metadata.engine import MetaError
from metadata.wire.protocol import FrameDecoder, ProtocolError, decode
from metadata.wire.url import UNREACHABLE

if TYPE_CHECKING:
    from metadata.client import RemoteEngine

CONNECT_TIMEOUT = 5.0  # seconds to open one connection (TCP and handshake)
AGENT_UNREACHABLE = "cannot reach the host's ckptfs agent at "  # a Unix socket replica
KEEPALIVE = (5, 2, 3)  # TCP keepalive idle, interval, probes: a vanished host in ~11 s


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive, so a connection whose host vanished (powered off, cut off the
    network) breaks in seconds and the client fails over, instead of waiting forever
    for an answer. The peer's kernel answers the probes: a busy service is not dead."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle, interval, count = KEEPALIVE
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
    except (OSError, AttributeError):  # a platform without these options
        pass


def check_hello(body: bytes | memoryview) -> dict:
    """The service's answer to our hello: accepted (the answer, which carries what the
    hello's `want` asked of a peer that knows it: an agent's config and info, rank.py),
    or MetaError with its reason."""
    reply = decode(body)
    if not isinstance(reply, dict) or not reply.get("ok"):
        err = reply.get("errno", errno.EPROTO) if isinstance(reply, dict) else errno.EPROTO
        msg = reply.get("error", "handshake refused") if isinstance(reply, dict) else "?"
        raise MetaError(err, f"metadata service refused the connection: {msg}")
    return reply


class Attempt:
    """One plain-TCP connection attempt to replica `i` (RemoteEngine._race): a
    non-blocking connect, then the hello and its answer, each step on a poll event.
    Ends with `result` (a blocking socket, handshake done, and `answer`, the hello's
    answer) or `error` (MetaError, worded as `_open` words it)."""

    def __init__(self, eng: RemoteEngine, i: int, hello: bytes, now: float) -> None:
        self.i = i
        self.where = eng._where(i)
        self.started = now
        self.deadline = now + CONNECT_TIMEOUT
        self.out = hello
        self.dec = FrameDecoder(eng.max_frame)
        self.sock: socket.socket | None = None
        self.connected = False
        self.hello_sent = False
        self.result: socket.socket | None = None
        self.answer: dict = {}
        self.error: MetaError | None = None
        host, port = eng.replicas[i]
        if host.startswith("/"):  # a Unix socket (a host's ckptfs agent: fusefs/agent)
            self.addrs = [(socket.AF_UNIX, socket.SOCK_STREAM, 0, "", host)]
            self._next_address(None)
            return
        try:
            self.addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            self.addrs = []
            self._unreachable(e)
            return
        self._next_address(None)

    def _unreachable(self, e: BaseException) -> None:
        self.close()
        what = AGENT_UNREACHABLE if self.where.startswith("/") else UNREACHABLE
        self.error = MetaError(errno.ECONNREFUSED, f"{what}{self.where}: {e}")

    def _handshake_failed(self, e: BaseException) -> None:
        self.close()
        self.error = MetaError(errno.ECONNRESET, f"handshake with {self.where}: {e}")

    def _next_address(self, err: BaseException | None) -> None:
        self.close()
        while self.addrs:
            family, kind, proto, _, addr = self.addrs.pop(0)
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as e:
                err = e
                continue
            sock.setblocking(False)
            rc = sock.connect_ex(addr)
            if rc in (0, errno.EINPROGRESS):
                self.sock = sock
                self.connected = False
                return
            sock.close()
            err = OSError(rc, os.strerror(rc))
        self._unreachable(err or OSError("no address"))

    def events(self) -> int:
        return select.POLLOUT if not self.hello_sent else select.POLLIN

    def on_event(self, ev: int) -> None:
        sock = self.sock
        assert sock is not None
        if not self.hello_sent:
            if not self.connected:
                rc = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if rc:
                    self._next_address(OSError(rc, os.strerror(rc)))
                    return
                self.connected = True
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
                keepalive(sock)
            try:
                sent = sock.send(self.out)
            except BlockingIOError:
                return
            except OSError as e:
                self._handshake_failed(e)
                return
            self.out = self.out[sent:]
            self.hello_sent = not self.out
            return
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:
            self._handshake_failed(e)
            return
        if not data:
            hint = " (a service with TLS? add ?ca=PATH or ?tls=1)"
            self._handshake_failed(
                ConnectionError(f"service closed the connection during the handshake{hint}")
            )
            return
        try:
            frames = self.dec.feed(data)
            if not frames:
                return
            self.answer = check_hello(frames[0])
            if frames[1:]:
                raise ProtocolError("unexpected frames after the handshake")
        except MetaError as e:
            self.close()
            self.error = e
            return
        except ProtocolError as e:
            self._handshake_failed(e)
            return
        sock.setblocking(True)
        self.result, self.sock = sock, None

    def timed_out(self) -> None:
        if self.connected:
            self._handshake_failed(TimeoutError("timed out"))
        else:
            self._unreachable(TimeoutError("timed out"))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
