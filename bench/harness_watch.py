"""The fleet watcher: a server of the run that exits when no fault asked for it ends the run.

A thread polls every service replica, S3 node and the database (bench.harness_env.Env
.check_fleet) twice a second. Faults that kill, stop or restart a server on purpose
register it first (Env.on_purpose), so only an exit nobody asked for is flagged: the run
then ends within seconds with verdict FAIL, naming the process and the last lines of its
log, instead of its hosts retrying against a service that is gone until a phase times out.

How the run is ended: the watcher records the exit and calls `wake`, which the coordinator
sets to interrupt its main thread (a signal that raises FleetDown wherever it waits: a
metadata call, the workers' answers, a fault's join). Where no signal can be sent (a run
outside the main thread) the coordinator's own waits poll `failed`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

POLL_S = 0.5
TAIL_LINES = 8


class FleetDown(BaseException):
    """A server of the fleet exited unasked: the run stops where it is (a BaseException,
    so no `except Exception` on the way swallows it) and reports FAIL."""


def log_tail(path: str, n: int = TAIL_LINES, max_bytes: int = 16384) -> list[str]:
    """The last `n` non-blank lines of a log (each cut to 300 characters)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = [ln.rstrip()[:300] for ln in text.splitlines() if ln.strip()]
    return lines[-n:]


def describe(exit_: dict) -> str:
    """One finding: which process, how it ended, and (on lines of their own) its log's end."""
    code = exit_["status"]
    if code is None or (code < 0 and exit_["name"] == "db"):
        how = "is gone"
    elif code < 0:
        how = f"was killed by signal {-code}"
    else:
        how = f"exited with status {code}"
    tail = exit_.get("tail") or []
    where = os.path.basename(exit_["log"]) if exit_.get("log") else "its log"
    text = (
        f"fleet: {exit_['what']} {exit_['name']} (pid {exit_['pid']}) {how}, "
        f"and no fault asked for it; the last lines of {where}:"
    )
    if not tail:
        return text + " (empty)"
    return text + "".join(f"\n      | {ln}" for ln in tail)


class Watcher:
    """Polls `check()` (a list of unasked exits) from a thread; on the first finding,
    records it, says it, sets `failed` and calls `wake()` once."""

    def __init__(
        self,
        check: Callable[[], list[dict]],
        say: Callable[[str], None],
        wake: Callable[[], None],
        interval: float = POLL_S,
    ) -> None:
        self.check = check
        self.say = say
        self.wake = wake
        self.interval = interval
        self.exits: list[dict] = []
        self.failed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fleet-watcher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                found = self.check()
            except Exception as e:  # noqa: BLE001 - a watcher must not die of one bad poll
                self.say(f"fleet watcher: {type(e).__name__}: {e}")
                continue
            if not found:
                continue
            for ex in found:
                ex["tail"] = log_tail(ex["log"]) if ex.get("log") else []
                self.exits.append(ex)
                self.say(describe(ex) + "\n  ending the run")
            self.failed.set()
            if not self._stop.is_set():
                self.wake()
            return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def findings(self) -> list[str]:
        return [describe(ex) for ex in self.exits]

    def as_list(self) -> list[dict]:
        return [
            {k: ex.get(k) for k in ("name", "what", "pid", "status", "log", "tail")}
            for ex in self.exits
        ]
