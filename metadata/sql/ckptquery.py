"""Checkpoint queries: step states, latest, manifests, listings and the rank timeline.

Read-only (`_ckpt_read`), mixed into SqlEngine beside CheckpointMixin, whose
tables they read.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Any

from metadata.ckptcheck import check_job, manifest_ranks, no_durable_step
from metadata.ckptformat import INO, blob_chunk_ids
from metadata.engine import (
    STAGED,
    MetaError,
)
from metadata.sql.checkpoints import PUBLISHED, STATE_NAMES, rank_ranges
from metadata.sql.needs import SqlCore

DURABLE_SEEN_MAX = 4096  # (job, step) pairs remembered as durable by latest_durable


class CheckpointQueryMixin(SqlCore):
    """Needs CheckpointMixin's `_ckpt_read`, `_brief`, `_step`, `_blobs`, `_file_rows`."""

    expire: Any
    apply_pending: Any

    # -- queries ---------------------------------------------------------------
    def step_state(self, job: str, step: int) -> dict:
        check_job(job)
        with self._ckpt_read() as c:
            return self._brief(c, job, step)

    def wait_published(self, job: str, step: int, timeout: float = 60.0) -> dict:
        """Block until the step is published or aborted; ETIMEDOUT after `timeout` s."""
        end = time.monotonic() + max(0.0, float(timeout))
        delay = 0.005
        while True:
            info = self.step_state(job, step)
            if info["state"] != "open":
                return info
            if time.monotonic() >= end:
                raise MetaError(errno.ETIMEDOUT, f"{job} step {step} not published in {timeout}s")
            if self.expire():
                continue
            time.sleep(min(delay, max(0.0, end - time.monotonic())))
            delay = min(delay * 2, 0.1)

    def latest(self, job: str) -> int | None:
        check_job(job)
        with self._ckpt_read() as c:
            row = self._one(
                c,
                "SELECT MAX(step) FROM ckpt_steps WHERE job = ? AND state = ?",
                (job, PUBLISHED),
            )
        return None if row is None or row[0] is None else int(row[0])

    def latest_durable(self, job: str) -> int | None:
        """The newest published step whose every chunk is on the object nodes.

        Checking a step reads every chunk id of it; a restarted job asks once per rank, so
        a step found durable is remembered, keyed by (job, step, created, the change log's
        last number): a step's chunks stay durable while nothing rewrites its files (gc
        takes only unreferenced chunks), a rewrite of any inode advances the change log
        (metadata/sql/changes.py, a trigger on every inode update), and the published steps
        are read afresh on every call, so a step deleted since, deleted and begun again (a
        new `created`) or written to since is never answered from memory, by this replica
        or any other. A step is checked and remembered within one read transaction."""
        check_job(job)
        seen = self.__dict__.setdefault("_durable_seen", {})
        with self._ckpt_read() as c:
            steps, seq = self._published_steps(c, job)
            if steps and (job, int(steps[0][0]), steps[0][1], seq) in seen:
                return int(steps[0][0])
        self.apply_pending()  # chunk states of journalled chunks live in the journal
        with self._ckpt_read() as c:
            steps, seq = self._published_steps(c, job)
            for step, created in steps:
                key = (job, int(step), created, seq)
                if key in seen:
                    return int(step)
                inos = self._step_inos(c, job, step)
                ids: set[bytes] = set()
                for ranks in inos.values():
                    for blob in self._blobs(c, [ino for _, ino in ranks]).values():
                        ids.update(blob_chunk_ids(blob))
                if not self._any_staged(c, sorted(ids)):
                    if ids:  # an empty answer (a step deleted under a weaker isolation)
                        if len(seen) >= DURABLE_SEEN_MAX:
                            seen.clear()
                        seen[key] = True
                    return int(step)
        return None

    def _published_steps(self, c: Any, job: str) -> tuple[list, int]:
        """(step, created) of the job's published steps, newest first, and the change log's
        last number, read in the caller's transaction."""
        steps = self._x(
            c,
            "SELECT step, created FROM ckpt_steps WHERE job = ? AND state = ? "
            "ORDER BY step DESC LIMIT 1000",
            (job, PUBLISHED),
        ).fetchall()
        row = self._one(c, "SELECT MAX(seq) FROM changes", ())
        return steps, int(row[0] or 0) if row else 0

    def _any_staged(self, c: Any, ids: list[bytes]) -> bool:
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            marks = ",".join("?" * len(part))
            if self._one(
                c,
                f"SELECT 1 FROM chunks WHERE id IN ({marks}) AND state = {STAGED} LIMIT 1",
                part,
            ):
                return True
        return False

    def _step_inos(self, c: Any, job: str, step: int) -> dict[int, list[tuple[bytes, int]]]:
        """rank -> [(path, ino)] from the rank records (files in path order)."""
        out: dict[int, list[tuple[bytes, int]]] = {}
        for rank, inos, paths in self._x(
            c,
            "SELECT rank, inos, paths FROM ckpt_ranks WHERE job = ? AND step = ? ORDER BY rank",
            (job, step),
        ).fetchall():
            nums = [i for (i,) in INO.iter_unpack(bytes(inos))]
            names = bytes(paths).split(b"\0") if nums else []
            out[int(rank)] = list(zip(names, nums, strict=True))
        return out

    def manifest_parts(self, job: str, step: int) -> tuple[dict, dict[int, list[dict]]]:
        """A published step's header and its files grouped by rank (extents packed)."""
        check_job(job)
        with self._ckpt_read() as c:
            head = self._brief(c, job, step)
            if head["state"] != "published":
                raise MetaError(
                    errno.EAGAIN, f"{job} step {step} is {head['state']}, not published"
                )
            files = self._step_inos(c, job, step)
            by_ino = self._file_rows(c, [ino for fs in files.values() for _, ino in fs])
        by_rank: dict[int, list[dict]] = {}
        for rank, fs in files.items():
            out = by_rank[rank] = []
            for path, ino in fs:
                hit = by_ino.get(ino)
                if hit is not None:  # a file unlinked since publish drops out
                    out.append(
                        {"path": os.fsdecode(path), "size": hit[0], "rank": rank, "extents": hit[1]}
                    )
        return head, by_rank

    def manifest(
        self, job: str, step: int | None, rank: int | None = None, ranks: list[int] | None = None
    ) -> dict:
        """Every file of a published step with packed extents; or one rank's (`rank`); or
        those of a host's ranks in one answer (`ranks`, in that order; each file names its
        rank): a host that reads for many ranks asks once instead of once per rank.

        `step` None: the latest durable step's (its number is the answer's "step"), so a
        rank of a restarted job finds what to read in one request, not two."""
        only = manifest_ranks(rank, ranks)  # bad arguments: refused before any read
        if step is None:
            step = self.latest_durable(job)
            if step is None:
                raise no_durable_step(job)
        head, by_rank = self.manifest_parts(job, step)
        if only is None:
            files = [f for r in sorted(by_rank) for f in by_rank[r]]
        else:
            files = [f for r in only for f in by_rank.get(r, [])]
        return {**head, "files": files}

    def list_checkpoints(self, job: str | None = None) -> list[dict]:
        with self._ckpt_read() as c:
            where, args = ("WHERE s.job = ?", (job,)) if job is not None else ("", ())
            rows = self._x(
                c,
                "SELECT s.job, s.step, s.state, s.world_size, s.created, s.published, s.path, "
                "COUNT(r.rank), COALESCE(SUM(r.bytes), 0), COALESCE(SUM(r.files), 0) "
                "FROM ckpt_steps s LEFT JOIN ckpt_ranks r ON r.job = s.job AND r.step = s.step "
                f"{where} GROUP BY s.job, s.step, s.state, s.world_size, s.created, s.published, "
                "s.path ORDER BY s.job, s.step",
                args,
            ).fetchall()
        return [
            {
                "job": r[0],
                "step": int(r[1]),
                "state": STATE_NAMES[r[2]],
                "world_size": int(r[3]),
                "created": r[4] / 1e9,
                "published": r[5] / 1e9 if r[5] else None,
                "path": os.fsdecode(bytes(r[6])),
                "committed": int(r[7]),
                "bytes": int(r[8]),
                "files": int(r[9]),
            }
            for r in rows
        ]

    def checkpoint_info(self, job: str, step: int) -> dict:
        """State, size, dedup, and the per-rank timeline with stragglers flagged."""
        check_job(job)
        with self._ckpt_read() as c:
            state, world, _, path, deadline, reason, created, published = self._step(c, job, step)
            rows = self._x(
                c,
                "SELECT rank, host, committed, bytes, new_bytes, files FROM ckpt_ranks "
                "WHERE job = ? AND step = ? ORDER BY committed",
                (job, step),
            ).fetchall()
        ranks = [
            {
                "rank": int(r[0]),
                "host": r[1],
                "commit_s": round((r[2] - created) / 1e9, 6),
                "bytes": int(r[3]),
                "new_bytes": int(r[4]),
                "files": int(r[5]),
                "straggler": False,
            }
            for r in rows
        ]
        stragglers = flag_stragglers(ranks)
        have = {r["rank"] for r in ranks}
        total = sum(r["bytes"] for r in ranks)
        new = sum(r["new_bytes"] for r in ranks)
        return {
            "job": job,
            "step": step,
            "state": STATE_NAMES[state],
            "reason": reason,
            "path": os.fsdecode(bytes(path)),
            "world_size": world,
            "created": created / 1e9,
            "deadline": deadline / 1e9,
            "published": published / 1e9 if published else None,
            "committed": len(ranks),
            "missing": rank_ranges([r for r in range(world) if r not in have]),
            "bytes": total,
            "new_bytes": new,
            "dedup_ratio": round(total / new, 4) if new else None,
            "stragglers": stragglers,
            "ranks": sorted(ranks, key=lambda r: r["rank"]),
        }


def flag_stragglers(ranks: list[dict]) -> list[int]:
    """Ranks that committed well after the typical rank: past median + max(1 s, 3 x MAD)."""
    if len(ranks) < 2:
        return []
    times = sorted(r["commit_s"] for r in ranks)
    med = times[len(times) // 2]
    mad = sorted(abs(t - med) for t in times)[len(times) // 2]
    limit = med + max(1.0, 3 * mad)
    out = []
    for r in ranks:
        if r["commit_s"] > limit:
            r["straggler"] = True
            out.append(r["rank"])
    return sorted(out)
