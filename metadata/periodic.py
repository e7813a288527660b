"""Periodic background steps that outlive their own failures (trio tasks).

A daemon runs small steps on a clock: the service's deadline expirer, request-id pruning
and idle reaper, a mount's engine housekeeping and change feed, the automatic metadata
backups of both. A step that raises must not take the process down with it (issue 37:
one failed backup tick killed `meta serve` and the mount), nor fail silently. So every
such loop is `run_periodic(name, step, every)`:

- an Exception from a step is counted in FAILURES[name] (exported as
  `ckptfs_periodic_failures_total{task}` by fusefs.metrics), logged in one line naming
  the task and the error, and the step runs again at its next period;
- a run of identical failures is logged once, then again every SAY_AGAIN_S while it
  lasts (a service that is down fails the change feed twice a second), and the first
  success after it says so (a warning as well, so it shows wherever the failure did);
- cancellation (trio.Cancelled, a BaseException) and KeyboardInterrupt go through: the
  process still stops when asked.

$CKPTFS_PERIODIC_MAX_S (seconds > 0; unset: no cap) caps every wait of a periodic task:
its sleeps between steps, and the wait before a failed automatic backup is attempted again
(fusefs.maint.backup). Tests set it to run minutes' worth of rounds (request-id pruning
every 60 s, backup checks every 60 s) in seconds; a daemon needs no setting.

Here in metadata/ so that both the service and fusefs import it (metadata imports
nothing of fusefs or chunkstore; chunkstore's background work runs in plain threads).
Task names are a fixed set (they are a metric label), never paths or ids.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

# task name -> steps that raised, in this process (bumped on the trio loop thread; read
# by the metrics endpoint's thread at scrape time)
FAILURES: dict[str, int] = {}
SAY_AGAIN_S = 60.0  # a failure that goes on is logged again this often

MAX_ENV = "CKPTFS_PERIODIC_MAX_S"

_log = logging.getLogger("ckptfs.periodic")


def capped(seconds: float) -> float:
    """A periodic wait, at most $CKPTFS_PERIODIC_MAX_S (read at each call: cheap)."""
    raw = os.environ.get(MAX_ENV)
    if not raw:
        return seconds
    try:
        cap = float(raw)
    except ValueError:
        return seconds
    return min(seconds, cap) if cap > 0 else seconds


async def run_periodic(
    name: str,
    step: Callable[[], Awaitable[Any]],
    every: float | Callable[[], float],
    *,
    log: logging.Logger | None = None,
    on_error: Callable[[Exception], None] | None = None,
    on_ok: Callable[[], None] | None = None,
) -> None:
    """Sleep `every` seconds (a number, or a callable asked before each sleep; capped()),
    then
    `await step()`; forever, until cancelled. A step that raises an Exception is counted,
    logged (see the module docstring) and `on_error(exc)` is called; a step that returns
    calls `on_ok()`. Neither hook may raise."""
    import trio  # here: fusefs.maint.backup imports capped() in processes without a loop

    log = log or _log
    failing = 0  # failures in a row
    said_at = -SAY_AGAIN_S
    said = ""
    while True:
        await trio.sleep(capped(every() if callable(every) else every))
        try:
            await step()
        except Exception as e:
            FAILURES[name] = FAILURES.get(name, 0) + 1
            failing += 1
            what = f"{type(e).__name__}: {e}"
            now = trio.current_time()
            if failing == 1 or what != said or now - said_at >= SAY_AGAIN_S:
                nxt = capped(every() if callable(every) else every)
                log.warning(
                    "periodic task %s failed (%d in a row; next try in %.3g s): %s",
                    name, failing, nxt, what,
                )  # fmt: skip
                said, said_at = what, now
            log.debug("periodic task %s failed", name, exc_info=True)
            if on_error is not None:
                on_error(e)
            continue
        if failing:
            # a warning too: whoever saw the failure (a daemon logs warnings) sees its end
            log.warning("periodic task %s works again after %d failure(s)", name, failing)
            failing, said = 0, ""
        if on_ok is not None:
            on_ok()


def failures() -> dict[str, int]:
    """A copy of FAILURES (for the metrics endpoint's thread)."""
    return dict(FAILURES)
