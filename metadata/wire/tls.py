"""Optional TLS between clients and `ckptfs meta serve`.

The service wraps its listeners in trio's SSLStream (`server_context`). The
client is harder: one thread reads the connection while any other thread may
write to it, and an OpenSSL connection object must not be used from two
threads at once (a TLS 1.3 read can itself produce bytes to send, e.g. the
answer to a key update). So the client speaks TLS through memory buffers
(`TlsSocket`): the TLS object is touched only under one short lock, and the
raw socket is read and written outside it, by the reader and the writers in
parallel, as for a plain connection. The bytes TLS produces leave in the
order it produced them because only the holder of the write lock drains
them; a reader that finds some waiting while a writer holds that lock
leaves them to the writer, which looks again after it lets go.

Without TLS the token crosses the network in the clear: use it on any
network that is not trusted.
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
import threading

from metadata.engine import MetaError

# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
X509_NAME_MISMATCH = (62, 64)


def server_context(cert: str, key: str | None = None) -> ssl.SSLContext:
    """A server context from a PEM certificate chain and its private key (or one file
    holding both); a clear error for a missing, unreadable or mismatched file."""
    for path in (cert, key):
        if path is not None and not os.path.isfile(path):
            raise MetaError(errno.ENOENT, f"TLS: no such file {path!r}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise MetaError(
            errno.EINVAL, f"TLS: cannot load certificate {cert!r} with key {key or cert!r}: {e}"
        ) from None
    return ctx


def client_context(params: dict[str, list[str]]) -> ssl.SSLContext | None:
    """TLS settings from a ckptfs:// URL's query: `tls=1` verifies the service against
    the system's CAs, `ca=PATH` against that PEM bundle (and implies tls=1). None: plain
    TCP. The certificate must name the host the URL names (name or IP address)."""
    flag = params.get("tls", ["0"])[0].lower()
    ca = params.get("ca", [None])[0]
    if flag not in ("0", "1", "true", "false", "yes", "no"):
        raise MetaError(errno.EINVAL, f"bad tls={flag!r} in the service URL: use tls=1")
    if ca is None and flag in ("0", "false", "no"):
        return None
    if ca is not None and not os.path.isfile(ca):
        raise MetaError(errno.ENOENT, f"TLS: no such CA file {ca!r}")
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (ssl.SSLError, OSError) as e:
        raise MetaError(errno.EINVAL, f"TLS: cannot load CA file {ca!r}: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class TlsSocket:
    """A connected TCP socket speaking TLS, safe for one reader and many writers."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, host: str, timeout: float) -> None:
        self._sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_hostname=host)
        self._lock = threading.Lock()  # the TLS object and both buffers
        self._wlock = threading.Lock()  # writes to the socket, in TLS's order
        sock.settimeout(timeout)
        self._handshake()

    def _handshake(self) -> None:
        """Before any other thread sees the socket: no locking needed."""
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:  # tell the service why (its log shows our alert, not EOF)
                try:
                    self._sock.sendall(self._out.read())
                except OSError:
                    pass
                raise
            self._sock.sendall(self._out.read())
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("service closed the connection during the TLS handshake")
            self._in.write(data)
        self._sock.sendall(self._out.read())

    # -- the socket methods the client uses ---------------------------------------------
    def sendall(self, data: bytes) -> None:
        with self._wlock:
            with self._lock:
                self._tls.write(data)
                out = self._out.read()
            self._sock.sendall(out)
        self._send_owed()

    def recv(self, n: int) -> bytes:
        while True:
            with self._lock:
                try:
                    data = self._tls.read(n)
                except ssl.SSLWantReadError:
                    data = None
                except ssl.SSLZeroReturnError:  # the service closed TLS cleanly
                    data = b""
                owed = self._out.pending
            if owed:
                self._send_owed()
            if data is not None:
                return data
            raw = self._sock.recv(max(n, 65536))
            with self._lock:
                if raw:
                    self._in.write(raw)
                else:
                    self._in.write_eof()

    def _send_owed(self) -> None:
        """Send what TLS produced outside a write (post-handshake messages). Whoever
        holds the write lock sends it; if a writer holds it now, it calls this again
        after letting go, so nothing is left behind."""
        while self._out.pending and self._wlock.acquire(blocking=False):
            try:
                with self._lock:
                    out = self._out.read()
                if out:
                    self._sock.sendall(out)
            finally:
                self._wlock.release()

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()


def describe_tls_error(host: str, port: int, e: BaseException) -> MetaError:
    """A TLS failure as an error that says what to check, not OpenSSL's reason code."""
    reason = getattr(e, "reason", None) or str(e)
    if isinstance(e, ssl.SSLCertVerificationError):
        if e.verify_code in X509_NAME_MISMATCH:
            return MetaError(
                errno.EACCES,
                f"TLS: the certificate of {host}:{port} does not name {host!r}: "
                "use a host name or IP address it lists in the URL",
            )
        msg = f"TLS: the certificate of {host}:{port} is not trusted: {e.verify_message}"
        hint = "pass the CA that signed it with ?ca=PATH"
        return MetaError(errno.EACCES, f"{msg} ({hint})")
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
        return MetaError(
            errno.EPROTO,
            f"TLS: {host}:{port} does not speak TLS (a service without --tls-cert? "
            "drop tls=/ca= from the URL)",
        )
    return MetaError(errno.EPROTO, f"TLS handshake with {host}:{port} failed: {reason}")
