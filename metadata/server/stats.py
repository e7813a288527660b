"""What the metadata service counts for its operators: replies by method and outcome,
commit and publish latencies, group-commit batch sizes, steps published and aborted.

Plain counters and fixed-bucket histograms, bumped on the service's trio loop (every
hook below runs there), read by a Prometheus collector in another thread at scrape time
(fusefs.metrics; this package imports no metrics library and nothing of fusefs). A hook
costs a dict or list add and, for a latency, a bisect over a dozen bounds.

Labels stay bounded: a method name a client sent that the protocol does not know is
counted as "unknown", an outcome is "ok" or an errno name, and steps are never labels
(the sets that remember which steps were counted, and when a step's first commit came,
keep only the newest STEPS_KEPT).
"""

from __future__ import annotations

import errno
import time
from bisect import bisect_left
from collections import OrderedDict

from metadata.engine import MetaError
from metadata.wire.protocol import REMOTE_METHODS

STEPS_KEPT = 4096  # steps remembered for counting each publish/abort once
COMMIT_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
PUBLISH_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
BATCH_BOUNDS = tuple(float(2**i) for i in range(12))  # 1 .. 2048 ranks (MAX_BATCH)


class Histogram:
    """Counts per fixed upper bound (the last slot is +Inf), their sum and count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, observations at or below it), +Inf last."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class ServiceStats:
    """The service's counters; see the module docstring for who calls what."""

    def __init__(self) -> None:
        self.replies: dict[tuple[str, str], int] = {}  # (method, outcome) -> count
        self.commit_latency = Histogram(COMMIT_BOUNDS)
        self.publish_latency = Histogram(PUBLISH_BOUNDS)
        self.batch_ranks = Histogram(BATCH_BOUNDS)
        self.published = 0
        self.aborted = 0
        self._first_commit: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._counted: OrderedDict[tuple[str, int], None] = OrderedDict()

    def sizes(self) -> dict[str, int]:
        """Entries of the structures that grow with steps and methods (all bounded)."""
        return {
            "first_commit": len(self._first_commit),
            "counted": len(self._counted),
            "replies": len(self.replies),
        }

    def reply(self, method: str, error: BaseException | None) -> None:
        """A request answered (from _Conn.reply)."""
        if method not in REMOTE_METHODS:
            method = "unknown"
        if error is None:
            outcome = "ok"
        else:
            code = error.errno if isinstance(error, MetaError) else errno.EIO
            if isinstance(error, TypeError | ValueError):
                code = errno.EINVAL
            outcome = errno.errorcode.get(code or errno.EIO, "EIO")
        key = (method, outcome)
        self.replies[key] = self.replies.get(key, 0) + 1

    def commit_arrived(self, job: str, step: int) -> float:
        """A commit_rank queued for group commit: its start time (for commit_answered),
        and the step's first commit time (for its publish latency)."""
        now = time.monotonic()
        key = (job, step)
        if isinstance(job, str) and isinstance(step, int) and key not in self._first_commit:
            self._first_commit[key] = now
            while len(self._first_commit) > STEPS_KEPT:
                self._first_commit.popitem(last=False)
        return now

    def commit_answered(self, started: float) -> None:
        self.commit_latency.observe(time.monotonic() - started)

    def batch(self, ranks: int) -> None:
        """A group commit was written (its size in rank commits)."""
        self.batch_ranks.observe(ranks)

    def step_state(self, job: str, step: int, state: str) -> None:
        """A step seen published or aborted by this service: counted once per step;
        a publish also records its latency from the step's first commit seen here."""
        if state not in ("published", "aborted"):
            return
        key = (job, step)
        if key in self._counted:
            return
        self._counted[key] = None
        while len(self._counted) > STEPS_KEPT:
            self._counted.popitem(last=False)
        first = self._first_commit.pop(key, None)
        if state == "aborted":
            self.aborted += 1
            return
        self.published += 1
        if first is not None:
            self.publish_latency.observe(time.monotonic() - first)
