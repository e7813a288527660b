"""commit_ranks in the service: a host's ranks' commits in one request, each rank
written by the group commit like any commit_rank.

A host's agent sends its ranks' commits as one request (issue 42): the service
decodes it once (protocol.py decodes it typed, files as WireFiles) and answers it
once, but its ranks are not a transaction of their own: each goes into the group
commit queue (groupcommit.py) as a commit_rank would, so it is written in the
same batches as every other host's ranks and publishes the step the same way.
The answer goes out when the last of its ranks is written: one entry per rank,
in order, {"ok": commit_rank's answer} or {"errno", "error"}: one rank's refusal
never fails the others (engine.rank_items says which refusals are the request's).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from metadata.engine import MetaError, internal_error, rank_answer, rank_items
from metadata.server.groupcommit import GroupCommit
from metadata.server.slot import Slot
from metadata.server.stats import ServiceStats


def _ranks_args(
    job: str, step: int, ranks: list, *, domain: int | None = None
) -> tuple[str, int, list, int | None]:
    return job, step, ranks, domain


class _Answer:
    """The entries of one commit_ranks answer, filled as its ranks are written."""

    __slots__ = ("out", "left", "slot", "counters")

    def __init__(self, out: list[Any], left: int, slot: Slot, counters: ServiceStats) -> None:
        self.out, self.left, self.slot, self.counters = out, left, slot, counters

    def written(self, i: int, started: float, s: Slot) -> None:
        """Rank i's outcome (on the loop, from the group commit's acknowledgement)."""
        self.counters.commit_answered(started)
        err = s.error
        if err is None:
            self.out[i] = {"ok": s.result}  # (encoded once for the step's ranks)
        else:
            self.out[i] = rank_answer(
                err if isinstance(err, MetaError) else internal_error("commit_rank", err)
            )
        self.left -= 1
        if self.left == 0:
            self.slot.set(self.out)


def submit_ranks(
    group: GroupCommit, counters: ServiceStats, args: Any, kwargs: Any, slot: Slot
) -> None:
    """Queue a commit_ranks' ranks for group commit; `slot` gets the answer when the
    last one is written. A request refused as a whole raises (TypeError, MetaError)
    before anything is queued."""
    job, step, ranks, domain = _ranks_args(*args, **kwargs)
    items = rank_items(job, step, ranks)
    if domain is not None:  # a scoped caller's trust domain (the service sets it: access.py)
        items = [it if isinstance(it, MetaError) else (*it, domain) for it in items]
    out: list[Any] = [rank_answer(it) if isinstance(it, MetaError) else None for it in items]
    todo = [i for i, it in enumerate(items) if not isinstance(it, MetaError)]
    if not todo:
        slot.set(out)
        return
    answer = _Answer(out, len(todo), slot, counters)
    for i in todo:
        inner = Slot()
        inner.add(partial(answer.written, i, counters.commit_arrived(job, step)))
        group.submit(items[i], inner)
