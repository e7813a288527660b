"""Prometheus metrics of the ckptfs daemons (`ckptfs mount --metrics`, `ckptfs meta serve
--metrics`): collectors that read plain counters at scrape time, and the HTTP endpoint.

Why collectors and not prometheus_client's Counter objects on the hot paths: a FUSE write,
a chunk store or a service reply then pays an integer add on an object it already holds
(CkptFS, FileCache, ChunkSink, NodeHealth, WriteBehindTier, ServiceStats), with no lock
and no import of a metrics library below fusefs (chunkstore and metadata import neither
this module nor prometheus_client). The scrape, in the endpoint's own thread, reads them
and builds the families; gauges that need a lock (the tier's) take it only then.

Every metric is named ckptfs_*, and no label takes an unbounded set of values: FUSE
operations, request methods (unknown ones are "unknown"), errno names, the volume's node
names (fixed by its config), where a chunk went. Never paths, chunk ids or ranks. The
README's "Metrics" section lists them all; docs/grafana-ckptfs.json graphs the first ones
an operator opens.
"""

from __future__ import annotations

import errno
import io
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from metadata.periodic import failures

PREFIX = "ckptfs_"


class MetricsError(Exception):
    """The metrics endpoint cannot start (a taken port, a bad address): one line."""


def _counter(name: str, doc: str, value: float | None = None, labels=()) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value, labels=labels or None)


def _gauge(name: str, doc: str, value: float | None = None, labels=()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value, labels=labels or None)


def _periodic_failures() -> CounterMetricFamily:
    """The daemon's periodic tasks (metadata.periodic) whose step raised, by task name (a
    fixed set: backup, expire, prune_requests, idle_reaper, tokens, silent_backends,
    housekeeping, change_feed)."""
    fam = _counter(
        "periodic_failures", "Periodic task steps that failed (retried)", labels=["task"]
    )
    for task, n in sorted(failures().items()):
        fam.add_metric([task], n)
    return fam


def _backup_bad_objects() -> GaugeMetricFamily:
    """Backup objects on the nodes found unreadable or ill-formed (planted, or damaged) at
    this process's last listing of them (its automatic backups list the nodes)."""
    import sys

    mod = sys.modules.get("fusefs.maint.backup")
    n = getattr(mod, "last_scan_problems", 0) if mod is not None else 0
    return _gauge(
        "backup_bad_objects",
        "Backup objects on the nodes skipped as unreadable or ill-formed at the last listing",
        n,
    )


class MountCollector(Collector):
    """The FUSE side of a mount: requests, bytes, dirty data, the chunk read cache.
    `attach(fs)` once the CkptFS exists (fusefs.mount.fs.serve's on_start)."""

    def __init__(self) -> None:
        self.fs: Any = None

    def attach(self, fs: Any) -> None:
        self.fs = fs

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield _periodic_failures()  # backups, housekeeping, the change feed
        yield _backup_bad_objects()
        fs = self.fs
        if fs is None:
            return
        req = _counter("fuse_requests", "FUSE requests by operation", labels=["op"])
        for op, n in sorted(dict(fs.op_counts).items()):
            req.add_metric([op], n)
        yield req
        err = _counter("fuse_errors", "FUSE requests answered with an error", labels=["op"])
        for op, n in sorted(dict(fs.op_errors).items()):
            err.add_metric([op], n)
        yield err
        nbytes = _counter("fuse_bytes", "Bytes read and written through FUSE", labels=["op"])
        nbytes.add_metric(["read"], fs.bytes_read)
        nbytes.add_metric(["write"], fs.bytes_written)
        yield nbytes
        yield _gauge("fuse_open_files", "Open file handles", len(fs.handles))
        cache = fs.cache
        if cache is None:
            return
        yield _gauge(
            "fuse_dirty_bytes", "Written bytes not yet sealed into chunks", cache.dirty_bytes
        )
        yield _gauge("fuse_storing_bytes", "Sealed bytes being stored", cache.inflight_bytes)
        yield _counter(
            "fuse_read_cache_hits", "Chunk reads served by the mount's cache", cache.cache_hits
        )
        yield _counter(
            "fuse_read_cache_misses", "Chunk reads that fetched the chunk", cache.cache_misses
        )
        yield _gauge(
            "fuse_read_cache_bytes", "Bytes held by the mount's chunk cache", cache._cached_bytes
        )


class VolumeCollector(Collector):
    """The volume client, the host write-behind tier and the object nodes of the volumes
    `volumes()` returns (summed: a daemon serves one volume)."""

    def __init__(self, volumes: Callable[[], Iterable[Any]]) -> None:
        self.volumes = volumes

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        vols = list(self.volumes())
        if not vols:
            return
        yield from self._client(vols)
        yield from self._nodes(vols)
        tiers = [v.tier for v in vols if v.tier is not None]
        if tiers:
            yield from self._tier([t.stats() for t in tiers])

    @staticmethod
    def _client(vols: list[Any]) -> Iterator[Metric]:
        sinks = [v.sink for v in vols]

        def total(attr: str) -> int:
            return sum(getattr(s, attr) for s in sinks)

        yield _counter(
            "client_chunks", "Chunks handed to the chunk sink by writers", total("chunks_in")
        )
        yield _counter(
            "client_logical_bytes", "Bytes written by writers (before dedup)", total("bytes_in")
        )
        yield _counter(
            "client_dedup_hits", "Chunks already stored (not written again)", total("dedup_hits")
        )
        yield _counter(
            "client_dedup_bytes", "Bytes of the chunks already stored", total("dedup_bytes")
        )
        puts = _counter(
            "client_chunk_puts", "New chunks stored, by where they went", labels=["where"]
        )
        for where in ("inline", "tier", "nodes"):
            puts.add_metric([where], total("puts_" + where))
        yield puts
        yield _counter("client_stored_bytes", "Bytes written for new chunks", total("stored_bytes"))
        yield _counter(
            "client_bad_replicas",
            "Chunk replicas that failed verification on read (served from another)",
            sum(v.store.bad_replicas_seen for v in vols),
        )

    @staticmethod
    def _nodes(vols: list[Any]) -> Iterator[Metric]:
        errors = _counter("node_errors", "Failed requests to an object node", labels=["node"])
        open_ = _gauge(
            "node_breaker_open", "1 while a node's circuit breaker is open", labels=["node"]
        )
        streak = _gauge(
            "node_consecutive_failures", "Failures since the node's last success", labels=["node"]
        )
        now = time.monotonic()
        for v in vols:
            for name, h in sorted(v.store.health.items()):
                errors.add_metric([name], h.errors)
                open_.add_metric([name], 0 if h.available(now) else 1)
                streak.add_metric([name], h.failures)
        yield from (errors, open_, streak)

    @staticmethod
    def _tier(stats: list[dict]) -> Iterator[Metric]:
        def total(key: str) -> float:
            return sum(s[key] or 0 for s in stats)

        oldest = [s["oldest_pending_ns"] for s in stats if s["oldest_pending_ns"]]
        age = max(0.0, (time.time_ns() - min(oldest)) / 1e9) if oldest else 0.0
        yield _gauge(
            "tier_pending_chunks",
            "Chunks staged here, not yet durable on the nodes",
            total("pending_chunks"),
        )
        yield _gauge(
            "tier_pending_bytes",
            "Bytes staged here, not yet durable on the nodes",
            total("pending_bytes"),
        )
        yield _gauge(
            "tier_to_upload_chunks", "Chunks queued or being uploaded", total("to_upload_chunks")
        )
        yield _gauge(
            "tier_oldest_pending_age_seconds", "Age of the oldest pending chunk (0: none)", age
        )
        yield _counter(
            "tier_uploaded_chunks", "Chunks uploaded to the nodes", total("uploaded_chunks")
        )
        yield _counter(
            "tier_upload_bytes", "Encoded bytes uploaded (once per chunk)", total("uploaded_bytes")
        )
        yield _gauge(
            "tier_upload_rate_bytes_per_second",
            "Upload rate over the last 10 s",
            total("upload_rate_bps"),
        )
        yield _counter(
            "tier_housekeeping_failures",
            "Tier housekeeping passes (rescan, status, compaction) that failed (retried)",
            total("housekeeping_failures"),
        )
        yield _counter(
            "tier_upload_failures",
            "Upload attempts that failed (retried)",
            total("upload_failures"),
        )
        yield _counter(
            "tier_lost_chunks",
            "Staged chunks found corrupt, never uploaded (fsck: lost)",
            total("lost_chunks"),
        )
        yield _counter(
            "tier_writer_waits", "Times a writer waited for staging space", total("writer_waits")
        )
        yield _gauge(
            "tier_used_bytes", "Staging bytes used (staged and cached)", total("used_bytes")
        )
        yield _gauge(
            "tier_cached_bytes", "Staging bytes used by the read cache", total("cached_bytes")
        )
        yield _gauge("tier_budget_bytes", "Staging budget", total("budget_bytes"))
        yield _counter(
            "tier_cache_hits", "Chunk reads served by the host read cache", total("cache_hits")
        )
        yield _counter(
            "tier_cache_misses", "Chunk reads the host read cache missed", total("cache_misses")
        )


class ServiceCollector(Collector):
    """The metadata service: replies, latencies, group commits, connections, steps."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        c = svc.counters
        req = _counter(
            "meta_requests",
            "Requests answered, by method and outcome",
            labels=["method", "outcome"],
        )
        for (method, outcome), n in sorted(dict(c.replies).items()):
            req.add_metric([method, outcome], n)
        yield req
        yield _histogram(
            "meta_commit_latency_seconds", "commit_rank: arrival to answer", c.commit_latency
        )
        yield _histogram(
            "meta_publish_latency_seconds",
            "A step's first rank commit to its publish",
            c.publish_latency,
        )
        yield _histogram(
            "meta_group_commit_ranks", "Rank commits written per group commit", c.batch_ranks
        )
        yield _gauge("meta_connections", "Open client connections", svc.connections)
        yield _periodic_failures()  # expirer, idle reaper, backups
        yield _backup_bad_objects()
        yield _counter("meta_checkpoints_published", "Steps published", c.published)
        yield _counter(
            "meta_steps_aborted", "Steps aborted (failed rank, request, deadline)", c.aborted
        )
        yield _counter(
            "meta_bad_clients",
            "Connections dropped for a protocol or token error",
            svc.stats["bad_clients"],
        )
        yield _counter(
            "meta_hello_evictions",
            "Connections dropped waiting for their hello",
            svc.stats["hello_evictions"],
        )
        yield _counter(
            "meta_refused",
            "Requests a credential's role or scope does not allow (EACCES), or a reused key",
            svc.stats["refused_scope"],
        )
        yield _counter(
            "meta_admin_calls",
            "Requests that need the admin role, made by an admin credential",
            svc.stats["admin_calls"],
        )


def _histogram(name: str, doc: str, h: Any) -> HistogramMetricFamily:
    return HistogramMetricFamily(PREFIX + name, doc, buckets=h.cumulative(), sum_value=h.sum)


class _Info(Collector):
    def __init__(self, component: str) -> None:
        self.component = component
        try:
            self.version = version("ckptfs")
        except PackageNotFoundError:
            self.version = "unknown"

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        g = _gauge("info", "The daemon serving these metrics", labels=["component", "version"])
        g.add_metric([self.component, self.version], 1)
        yield g


class _ScrapeCost(Collector):
    """What answering scrapes cost this process: the CPU time of the endpoint's request
    threads, parsing, collecting, formatting and sending (`thread_time`: time spent
    waiting for the GIL is not counted, time running with it is). An estimate of what
    the endpoint takes from the daemon, not a bound: a thread descheduled while holding
    the GIL or the tier's lock stalls others longer, and the accept loop is not counted.
    bench.fsspec checks the estimate against measured losses at a high scrape rate."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.scrapes = 0
        self._lock = threading.Lock()

    def add(self, cpu_s: float) -> None:
        with self._lock:
            self.cpu_s += cpu_s
            self.scrapes += 1

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            scrapes, cpu_s = self.scrapes, self.cpu_s
        yield _counter("metrics_scrapes", "Scrapes answered before this one", scrapes)
        yield _counter(
            "metrics_scrape_cpu_seconds",
            "CPU seconds the endpoint's threads spent answering the scrapes before this one",
            cpu_s,
        )


class MetricsServer:
    """The /metrics endpoint: prometheus_client's WSGI app in a threading HTTP server in a
    daemon thread, over a registry of its own (the default one would add Python collectors
    under names that are not ckptfs_*; the process collector here is namespaced)."""

    def __init__(self, host: str, port: int, component: str, collectors: Iterable[Collector]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Info(component))
        for c in collectors:
            self.registry.register(c)
        ProcessCollector(namespace="ckptfs", registry=self.registry)
        self.cost = _ScrapeCost()
        self.registry.register(self.cost)
        try:
            self._httpd = _serve(host, port, make_wsgi_app(self.registry), self.cost)
        except (OSError, UnicodeError, ValueError) as e:  # bad names fail in the IDNA codec
            why = getattr(e, "strerror", None) or str(e)
            if getattr(e, "errno", None) == errno.EADDRINUSE:
                why = "the port is taken (another process listens there)"
            raise MetricsError(f"cannot serve metrics on {host}:{port}: {why}") from None
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="ckptfs-metrics", daemon=True
        )
        self._thread.start()
        self.host = host
        self.port = self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


# The endpoint is unauthenticated and may face any network its address reaches, so what a
# client can make it hold is bounded for the endpoint as a whole (DESIGN "Trust model"):
# connections whose request headers are not complete yet wait in one selector thread (at
# most PENDING_MAX of them, the oldest dropped for a new one, each for at most
# REQUEST_TIMEOUT_S and HEADER_MAX bytes), and only complete requests reach the WORKERS
# threads that answer them, each socket operation of theirs timed out too. 300 scrapers
# that never finish their headers hold no thread, and a real scrape is answered at once.
WORKERS = 2  # threads answering complete requests
QUEUE_MAX = 16  # complete requests waiting for a worker (more: 503)
PENDING_MAX = 64  # connections still sending their headers
REQUEST_TIMEOUT_S = 5.0  # to send the request headers; then each send/recv of the answer
HEADER_MAX = 16 << 10  # bytes of request line and headers (more: 431)


class _Prefixed(io.RawIOBase):
    """A socket's input with the bytes the selector already read in front."""

    def __init__(self, head: bytes, sock: socket.socket) -> None:
        self.head = memoryview(head)
        self.sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.head:
            n = min(len(b), len(self.head))
            b[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        return self.sock.recv_into(b)


class _BoundedServer(WSGIServer):
    """wsgiref's WSGIServer bound and listening as usual, served by serve_forever below:
    a selector thread reads request headers without blocking, a fixed pool answers."""

    request_queue_size = 128

    def __init__(self, addr: tuple, handler: type, family: int) -> None:
        self.address_family = family
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()  # (before a bind that may fail)
        super().__init__(addr, handler)
        self._queue: queue.Queue = queue.Queue(QUEUE_MAX)
        self._workers: list[threading.Thread] = []
        self.dropped = 0  # connections closed unanswered (slow, oversized, over the bounds)
        self._done = threading.Event()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        for i in range(WORKERS):
            t = threading.Thread(target=self._work, name=f"ckptfs-metrics-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        sel = selectors.DefaultSelector()
        self.socket.setblocking(False)
        sel.register(self.socket, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        pending: dict[
            socket.socket, list
        ] = {}  # conn -> [deadline, bytearray, addr] (in age order)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                first = next(iter(pending.values()), None)
                wait = (
                    poll_interval if first is None else max(0.0, min(poll_interval, first[0] - now))
                )
                for key, _ in sel.select(wait):
                    sock = key.fileobj
                    if sock is self.socket:
                        self._accept(sel, pending)
                    elif sock is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        self._read(sel, pending, sock)  # type: ignore[arg-type]
                now = time.monotonic()
                for sock, (deadline, _buf, _addr) in list(pending.items()):
                    if deadline > now:
                        break  # in age order: the rest are younger
                    self._drop(sel, pending, sock)
        finally:
            for sock in list(pending):
                self._drop(sel, pending, sock)
            sel.close()
            for _ in self._workers:
                self._queue.put(None)
            self._done.set()

    def _accept(self, sel: Any, pending: dict) -> None:
        for _ in range(64):  # what is waiting now, not forever
            try:
                conn, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, a reset: the next round
                return
            if len(pending) >= PENDING_MAX:  # the oldest (slowest) makes room
                self._drop(sel, pending, next(iter(pending)))
            conn.setblocking(False)
            pending[conn] = [time.monotonic() + REQUEST_TIMEOUT_S, bytearray(), addr]
            sel.register(conn, selectors.EVENT_READ, None)

    def _read(self, sel: Any, pending: dict, sock: socket.socket) -> None:
        entry = pending.get(sock)
        if entry is None:
            return
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, pending, sock)
            return
        buf = entry[1]
        buf += data
        if b"\r\n\r\n" in buf or b"\n\n" in buf:
            sel.unregister(sock)
            del pending[sock]
            try:
                self._queue.put_nowait((sock, bytes(buf), entry[2]))
            except queue.Full:
                self._refuse(sock, b"503 Service Unavailable")
        elif len(buf) > HEADER_MAX:
            sel.unregister(sock)
            del pending[sock]
            self._refuse(sock, b"431 Request Header Fields Too Large")

    def _drop(self, sel: Any, pending: dict, sock: socket.socket) -> None:
        pending.pop(sock, None)
        try:
            sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        self.dropped += 1

    def _refuse(self, sock: socket.socket, status: bytes) -> None:
        try:
            sock.send(b"HTTP/1.0 " + status + b"\r\nContent-Length: 0\r\n\r\n")
        except OSError:
            pass
        sock.close()
        self.dropped += 1

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            sock, head, addr = item
            try:
                sock.setblocking(True)
                sock.settimeout(REQUEST_TIMEOUT_S)
                self.RequestHandlerClass(sock, addr, self, head=head)
            except Exception:  # noqa: BLE001, S110 - a client gone mid-answer: its loss only
                pass
            finally:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._done.wait(5.0)

    def server_close(self) -> None:
        super().server_close()
        self._wake_r.close()
        self._wake_w.close()


def _serve(host: str, port: int, app: Any, cost: _ScrapeCost) -> _BoundedServer:
    """A bound WSGI server for `app` (bounded: see _BoundedServer) whose request threads
    add their CPU time to `cost` and log nothing (a scrape a second would flood stderr)."""

    class Handler(WSGIRequestHandler):
        timeout = REQUEST_TIMEOUT_S

        def __init__(self, request: Any, client_address: Any, server: Any, *, head: bytes):
            self._head = head
            super().__init__(request, client_address, server)

        def setup(self) -> None:
            self.connection = self.request
            self.connection.settimeout(self.timeout)
            self.rfile = io.BufferedReader(_Prefixed(self._head, self.connection))
            self.wfile = self.connection.makefile("wb")  # buffered: never a partial write

        def handle(self) -> None:
            t = time.thread_time()
            try:
                super().handle()
            finally:
                cost.add(time.thread_time() - t)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    # As prometheus_client picks it: the first passive address, so "" is 0.0.0.0 and an
    # IPv6 literal binds IPv6.
    infos = socket.getaddrinfo(
        host or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, _, _, _, sockaddr = infos[0]
    server = _BoundedServer((sockaddr[0], port), Handler, family)
    server.set_app(app)
    return server


def serve_mount_metrics(listen: tuple[str, int]) -> tuple[MetricsServer, MountCollector]:
    """The endpoint of a mount, bound before the mount starts (a taken port fails it
    first): its FUSE side and its volume appear once `attach`ed to the CkptFS."""
    mount = MountCollector()
    volume = VolumeCollector(lambda: [mount.fs.vol] if mount.fs is not None else [])
    return MetricsServer(listen[0], listen[1], "mount", [mount, volume]), mount


def serve_service_metrics(listen: tuple[str, int], service: Any) -> MetricsServer:
    """The endpoint of `ckptfs meta serve`."""
    return MetricsServer(listen[0], listen[1], "meta", [ServiceCollector(service)])


def serve_process_metrics(listen: tuple[str, int]) -> MetricsServer:
    """An endpoint for a training process: the volume client and write-behind tier of the
    volumes its DCP writers and fsspec filesystems opened (fusefs.client.registry)."""
    from fusefs.client.registry import open_volumes

    return MetricsServer(listen[0], listen[1], "client", [VolumeCollector(open_volumes)])
