"""The agent: a host's ranks served on one Unix socket, over the volume opened once.

Each rank connection speaks the metadata wire protocol (metadata/wire/protocol.py): a
hello with the rank's token, then pipelined requests answered in any order. The agent

- checks the peer first (SO_PEERCRED: the agent's own user or root; anyone else is
  refused with one log line), then the hello: a service volume needs the rank's token (it
  is verified once with a ping on the rank's behalf and remembered for TOKEN_TTL; every
  forwarded request still carries it, so the service keeps deciding what the rank may do);
  an embedded volume takes any hello (opening its directory makes one its admin anyway);
- answers locally what needs no service: ping, get_config, and the agent_* methods
  (agent_info, agent_adopt, agent_fetch, agent_flush, agent_stats: the data plane of the
  host's write-behind tier, see rank.py);
- groups commit_rank, manifest and missing_chunks through the batcher (batch.py), and
  forwards everything else on the rank's behalf (upstream.py).

Shutdown (SIGTERM/SIGINT, in the CLI): stop accepting, let the requests in flight finish
(up to DRAIN_S), then close; nothing is flushed by force, the tier's journal keeps what is
staged for the next agent.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import stat
import struct
import threading
import time
from functools import partial
from typing import Any

import trio

from chunkstore.store import ChunkUnavailable
from fusefs.agent.batch import Batcher
from fusefs.agent.paths import listening, make_socket_dir
from metadata.engine import MetaError
from metadata.wire.protocol import (
    MAX_FRAME,
    PROTO_VERSION,
    FrameDecoder,
    ProtocolError,
    decode,
    encode,
    encode_answer,
    encode_frame,
    frame,
    parse_request,
)

log = logging.getLogger("ckptfs.agent")

HELLO_TIMEOUT = 5.0  # seconds a new connection has to say hello
TOKEN_TTL = 60.0  # seconds a verified token is trusted for locally answered methods
INFLIGHT = 256  # requests of one connection in flight at once
DRAIN_S = 30.0  # seconds shutdown waits for requests in flight
THREADS = 8  # blocking tier calls at once
LOCAL = frozenset({"ping", "get_config"})
AGENT_METHODS = frozenset(
    {"agent_info", "agent_adopt", "agent_fetch", "agent_flush", "agent_stats"}
)  # fmt: skip
PEERCRED = struct.Struct("3i")  # pid, uid, gid
ACCEPT_PAUSE = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


class AgentError(Exception):
    """The agent cannot start (its socket is taken or unsafe); one line for the user."""


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
    return PEERCRED.unpack(raw)


def bind_socket(path: str) -> socket.socket:
    """A listening Unix socket at `path` (mode 0600, in a 0700 directory it makes); a
    stale one (no one listening: a killed agent's) is replaced, a live one is an error."""
    make_socket_dir(path)
    if os.path.lexists(path):
        if not _is_socket(path):
            raise AgentError(f"{path} exists and is not a socket")
        if listening(path):
            raise AgentError(f"an agent already serves this volume at {path}")
        os.unlink(path)
        log.info("replaced the stale socket %s", path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise AgentError(f"cannot listen on {path}: {e.strerror}") from None
    return sock


def _remove_socket(path: str) -> None:
    try:
        if _is_socket(path):
            os.unlink(path)
    except OSError:
        pass


def _is_socket(path: str) -> bool:
    return stat.S_ISSOCK(os.lstat(path).st_mode)


class Agent:
    """One volume's agent: `serve()` in a trio run; `shutdown()` from a signal handler."""

    def __init__(
        self,
        vol: Any,
        upstream: Any,
        path: str,
        *,
        config: dict,
        staging_dir: str | None,
        durability: str,
    ) -> None:
        self.vol = vol
        self.upstream = upstream
        self.path = path
        self.config = config
        self.staging_dir = staging_dir
        self.durability = durability
        self.batcher: Batcher | None = None
        self.limiter = trio.CapacityLimiter(THREADS)
        self._tokens: dict[str, float] = {}  # verified token -> until when
        # token being checked -> (set when done, [its refusal or None]): one ping for a
        # burst of hellos with the same token (a restarted job's ranks), not one each
        self._verifying: dict[str, tuple[trio.Event, list]] = {}
        self._accepting = trio.CancelScope()
        self._conns = trio.CancelScope()
        self._idle = trio.Event()
        self.inflight = 0
        self.uid = os.getuid()
        self.started = time.time()
        self.stats = {
            "connections": 0,  # open now
            "connections_total": 0,
            "ranks_served": 0,  # connections that said a good hello
            "refused_peer": 0,
            "refused_hello": 0,
            "token_checks": 0,  # pings sent to check hellos' tokens (one per burst)
            "requests": 0,
        }

    # -- lifecycle ------------------------------------------------------------------------
    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listener = bind_socket(self.path)
        # What the agent opened lives as long as it does (the volume, the tier's journal and
        # index): out of the collector's walks, which every rank's requests trigger.
        gc.freeze()
        try:
            async with trio.open_nursery() as nursery:
                self.batcher = Batcher(nursery, self.upstream.call)
                with self._conns:
                    async with trio.open_nursery() as conns:
                        conns.start_soon(self._accept, listener, conns)
                        task_status.started(self.path)
                nursery.cancel_scope.cancel()  # window timers of a batch nobody waits for
        finally:
            listener.close()
            _remove_socket(self.path)
            # the sender thread finishes what is queued (a send may wait on the service):
            # joined in a thread, shielded, so the loop never blocks on it
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.upstream.close)

    async def shutdown(self, drain: float = DRAIN_S) -> None:
        """Stop accepting, wait (up to `drain` s) for the requests in flight, close."""
        self._accepting.cancel()
        with trio.move_on_after(drain):
            while self.inflight:
                self._idle = trio.Event()
                await self._idle.wait()
        self._conns.cancel()

    async def _accept(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        lst = trio.socket.from_stdlib_socket(listener)
        with self._accepting:
            while True:
                try:
                    sock, _ = await lst.accept()
                except OSError as e:  # out of descriptors or memory: pause, not die
                    if e.errno not in ACCEPT_PAUSE:
                        raise
                    log.error("accepting a rank: %s; pausing", e)
                    await trio.sleep(0.1)
                    continue
                nursery.start_soon(self._connection, sock)

    # -- a connection -----------------------------------------------------------------------
    async def _connection(self, tsock: Any) -> None:
        self.stats["connections"] += 1
        self.stats["connections_total"] += 1
        stream = trio.SocketStream(tsock)
        try:
            pid, uid, _gid = peer_cred(tsock)
            if uid not in (self.uid, 0):
                self.stats["refused_peer"] += 1
                log.warning("refused a connection from pid %d: uid %d is not the agent's", pid, uid)
                await _refuse(stream, errno.EACCES, f"uid {uid} may not use this agent")
                return
            dec = FrameDecoder(MAX_FRAME)
            hello = await self._hello(stream, pid, dec)
            if hello is None:
                return
            token, early = hello
            self.stats["ranks_served"] += 1
            await self._session(stream, token, dec, early)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass
        except ProtocolError as e:
            log.info("dropping a rank connection: %s", e)
        except Exception:  # a bug in one connection must not take the host's agent down
            log.exception("a rank connection failed")
        finally:
            self.stats["connections"] -= 1
            await trio.aclose_forcefully(stream)

    async def _hello(
        self, stream: trio.SocketStream, pid: int, dec: FrameDecoder
    ) -> tuple[str, list] | None:
        """(the rank's token, requests sent right after the hello), or None: refused."""
        frames: list = []
        with trio.move_on_after(HELLO_TIMEOUT):
            while not frames:
                data = await stream.receive_some(65536)
                if not data:
                    return None
                frames = dec.feed(data)
        if not frames:
            raise ProtocolError("no hello in time")
        if len(frames[0]) > 64 * 1024:
            raise ProtocolError("a hello over 64 KiB")
        hello = decode(frames[0])  # a hello without a token is refused below, in words
        if not isinstance(hello, dict):
            raise ProtocolError("the first message must be a hello")
        token = hello.get("token")
        if hello.get("proto") != PROTO_VERSION:
            self.stats["refused_hello"] += 1
            await _refuse(stream, errno.EPROTO, f"protocol version {hello.get('proto')!r}")
            return None
        if self.upstream.remote:
            refusal = await self._verify(token)
            if refusal is not None:
                code, err = refusal
                self.stats["refused_hello"] += 1
                log.warning("refused rank pid %d: %s", pid, err)
                await _refuse(stream, code, err)
                return None
        answer: dict[str, Any] = {"ok": True, "proto": PROTO_VERSION}
        want = hello.get("want")
        if isinstance(want, list):  # the session's set-up in this one round trip (rank.py)
            if "config" in want:
                answer["config"] = self.config
            if "info" in want:
                answer["info"] = await self.agent_info()
        await stream.send_all(encode_frame(answer))
        return token or "", [bytes(f) for f in frames[1:]]

    async def _verify(self, token: Any) -> tuple[int, str] | None:
        """(errno, why) this token may not use a service volume through the agent, or None.
        A service that cannot be asked is not a refusal of the token: its errno says so,
        and the rank runs its own client (rank.py)."""
        if not isinstance(token, str) or not token:
            why = "a hello without a token (the agent never acts as its own credential)"
            return errno.EACCES, why
        if self._tokens.get(token, 0.0) > time.monotonic():
            return None
        asking = self._verifying.get(token)
        if asking is not None:  # a hello with this token is being checked: its answer serves
            await asking[0].wait()
            return asking[1][0]
        done, outcome = trio.Event(), [(errno.EIO, "the check of the rank's token was cut short")]
        self._verifying[token] = (done, outcome)
        try:
            outcome[0] = await self._ping(token)
        finally:
            del self._verifying[token]
            done.set()
        return outcome[0]

    async def _ping(self, token: str) -> tuple[int, str] | None:
        """Ask the service about the token once (_verify); remember it when it is good."""
        self.stats["token_checks"] += 1
        try:
            await self.upstream.call(token, "ping", [], {})
        except MetaError as e:
            if e.errno == errno.EACCES:
                return errno.EACCES, f"the service refused the rank's token: {e}"
            return e.errno or errno.EIO, f"cannot check the rank's token: {e}"
        self._tokens[token] = time.monotonic() + TOKEN_TTL
        if len(self._tokens) > 4096:
            now = time.monotonic()
            self._tokens = {t: u for t, u in self._tokens.items() if u > now}
        return None

    async def _session(
        self, stream: trio.SocketStream, token: str, dec: FrameDecoder, early: list
    ) -> None:
        send_lock = trio.Lock()
        slots = trio.Semaphore(INFLIGHT)
        async with trio.open_nursery() as nursery:
            try:  # (inside the nursery: what escapes its body would come out as a group)
                frames = early
                while True:
                    for body in frames:
                        req = parse_request(body)
                        await slots.acquire()
                        self.inflight += 1
                        nursery.start_soon(self._request, stream, send_lock, slots, token, req)
                    data = await stream.receive_some(1 << 20)
                    if not data:
                        break
                    frames = dec.feed(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                pass  # the rank went away (killed: a reset)
            except ProtocolError as e:
                log.info("dropping a rank connection: %s", e)
                with trio.move_on_after(1.0):
                    async with send_lock:
                        await stream.send_all(encode_frame([0, errno.EPROTO, str(e)]))
            nursery.cancel_scope.cancel()  # the rank is gone: nobody reads its answers

    async def _request(
        self,
        stream: trio.SocketStream,
        send_lock: trio.Lock,
        slots: trio.Semaphore,
        token: str,
        req: tuple,
    ) -> None:
        rid, method, args, kwargs, key = req[:5]
        self.stats["requests"] += 1
        try:
            try:
                result = await self._dispatch(token, method, args, kwargs, key)
                body = encode_answer(rid, result)
            except MetaError as e:
                body = encode([rid, e.errno or errno.EIO, str(e)])
            except (TypeError, ValueError) as e:
                body = encode([rid, errno.EINVAL, f"bad arguments for {method}: {e}"])
            except TimeoutError as e:
                body = encode([rid, errno.ETIMEDOUT, f"{method}: {e}"])
            except OSError as e:
                body = encode([rid, e.errno or errno.EIO, f"{method}: {e}"])
            except ChunkUnavailable as e:  # agent_fetch: no node has it (rank.py re-raises)
                body = encode([rid, errno.ENODATA, str(e)])
            except Exception as e:  # noqa: BLE001 - a bug answers its rank, not kills us
                log.exception("%s failed", method)
                body = encode([rid, errno.EIO, f"{method} failed in the agent: {e}"])
            async with send_lock:
                await stream.send_all(frame(body))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            slots.release()
            self.inflight -= 1
            if not self.inflight:
                self._idle.set()

    async def _dispatch(
        self, token: str, method: str, args: list, kwargs: dict, key: bytes | None
    ) -> Any:
        assert self.batcher is not None
        if method in LOCAL:
            return self.config if method == "get_config" else None
        if method in AGENT_METHODS:
            return await getattr(self, method)(*args, **kwargs)
        if method == "commit_rank":
            return await self.batcher.commit_rank(token, key, args, kwargs)
        if method == "manifest":
            return await self.batcher.manifest(token, args, kwargs)
        if method == "missing_chunks" and len(args) == 1 and not kwargs:
            return await self.batcher.missing_chunks(token, args[0])
        return await self.upstream.call(token, method, args, kwargs, key)

    # -- agent-local methods (rank.py's AgentLink) -------------------------------------------
    async def agent_info(self) -> dict:
        s = self.vol.settings
        return {
            "pid": os.getpid(),
            "socket": self.path,
            "uuid": self.config.get("uuid"),
            "staging_dir": self.staging_dir,
            "durability": self.durability,
            "tier": self.vol.tier is not None,
            "budget": getattr(self.vol.tier, "budget", None),  # the staging size (stager.py)
            "settings": {
                "chunk_size": s.chunk_size, "chunking": s.chunking,
                "compression": s.compression, "cdc_min": s.cdc_min, "cdc_max": s.cdc_max,
            },
        }  # fmt: skip

    def _tier(self, what: str) -> Any:
        tier = self.vol.tier
        if tier is None:
            raise MetaError(errno.EOPNOTSUPP, f"{what}: this agent runs without a staging tier")
        return tier

    async def agent_adopt(self, entries: list, synced: bool = True) -> int:
        tier = self._tier("agent_adopt")
        ents = [(bytes(e[0]), int(e[1]), None if e[2] is None else int(e[2])) for e in entries]
        await self._thread(tier.adopt, ents, synced=bool(synced))
        return len(ents)

    async def agent_fetch(self, ids: list) -> Any:
        tier = self._tier("agent_fetch")
        return await self._thread(tier.fill_cache, [bytes(i) for i in ids])

    async def agent_flush(self, seconds: float | None = None) -> bool:
        """The tier's flush (`seconds`: its timeout; TimeoutError reaches the rank)."""
        tier = self.vol.tier
        if tier is not None:
            await self._thread(tier.flush, timeout=seconds)
        if self.batcher is not None:  # a step may be durable now (batch.py LATEST_TTL)
            self.batcher.forget_latest()
        return True

    async def agent_stats(self) -> dict:
        b = self.batcher.stats if self.batcher is not None else {}
        names = [t.name for t in threading.enumerate()]
        return {
            **self.stats,
            **b,
            "upstream_connections": self.upstream.connections(),
            **self.upstream.counters(),
            "uploader_threads": sum(1 for n in names if n.startswith("ckptfs-upload")),
            "pid": os.getpid(),
        }

    async def _thread(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return await trio.to_thread.run_sync(partial(fn, *args, **kw), limiter=self.limiter)


async def _refuse(stream: trio.SocketStream, code: int, why: str) -> None:
    """Say why, then read what the peer still sends (briefly, a little) before the close:
    closing over unread bytes resets the connection, and the peer would lose the reason."""
    try:
        await stream.send_all(encode_frame({"ok": False, "errno": code, "error": why}))
        await stream.send_eof()
        with trio.move_on_after(1.0):
            left = 1 << 20
            while left > 0 and (data := await stream.receive_some(65536)):
                left -= len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def agent_for(vol: Any, spec: str, path: str, durability: str) -> Agent:
    """The agent over a volume this process opened (its tier, if any, attached): the
    `ckptfs agent` command's, or a mount's (`ckptfs mount --agent`)."""
    from fusefs.agent.upstream import LocalUpstream, RemoteUpstream
    from metadata.server.service import absolute_config

    if spec.startswith("ckptfs://"):
        config, upstream = vol.config, RemoteUpstream(vol.meta)
    else:
        config = absolute_config(vol.config, vol.base_dir)
        upstream = LocalUpstream(vol.meta, config)
    staging = vol.tier.root if vol.tier is not None else None
    return Agent(vol, upstream, path, config=config, staging_dir=staging, durability=durability)
