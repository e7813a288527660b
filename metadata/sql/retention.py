"""Retention: deleting published checkpoints and a per-job keep-last policy.

Deleting a step unlinks its directory from wherever it now is in the
namespace and drops, in the same transaction, every inode of its tree that
has no link left outside it, releasing that inode's chunk references. Chunks
no other step (or file) uses fall to refcount 0 and are collected by `gc`
after the grace period; a file hard-linked elsewhere survives with its data.

The policy (`set_retention(job, keep_last)`) lives in the config table and is
applied right after a step of that job publishes, in its own transaction, so
the publish itself never waits for old steps to be deleted.
"""

from __future__ import annotations

import errno
import json
from typing import Any

from metadata.ckptcheck import check_int, check_job
from metadata.engine import MetaError
from metadata.sql.checkpoints import ABORTED, DELETED, OPEN, PUBLISHED
from metadata.sql.needs import SqlCore
from metadata.sql.txlocks import retried

_POLICY_KEY = "retention:"


class RetentionMixin(SqlCore):
    """Mixed into SqlEngine after CheckpointMixin (uses its tables and `_step`)."""

    _ckpt_tx: Any
    _touch_dir: Any
    _subtree: Any

    # -- deleting ------------------------------------------------------------
    @retried
    def delete_checkpoint(self, job: str, step: int) -> dict:
        """Delete a published step (idempotent for an already deleted or aborted one)."""
        check_job(job)
        check_int(step, "step")
        with self._ckpt_tx() as c:
            self._lock_steps(c, [(job, step)])
            state, _, root, path = self._step(c, job, step)[:4]
            if state == OPEN:
                raise MetaError(errno.EBUSY, f"{job} step {step} is open: abort it instead")
            freed = 0
            if state == PUBLISHED:
                freed = self._delete_tree(c, int(root))
                self._x(
                    c,
                    "UPDATE ckpt_steps SET state = ?, reason = ? WHERE job = ? AND step = ?",
                    (DELETED, "deleted", job, step),
                )
            return {
                "job": job,
                "step": step,
                "state": "deleted" if state in (PUBLISHED, DELETED) else "aborted",
                "inodes_freed": freed,
            }

    def _delete_tree(self, c: Any, root: int) -> int:
        """Unlink a published step's tree and drop what has no link left outside it.

        Locks (PostgreSQL; see postgres.py), parents first: the directory holding the
        tree (found again once held: a rename may have moved the tree meanwhile), then
        the tree's directories level by level before their entries are read (so no entry
        is made in one behind our back), then its files (a link made to one meanwhile is
        counted)."""
        parent = None
        for _ in range(1000):
            links = self._one(c, "SELECT parent FROM dentries WHERE ino = ? LIMIT 1", (root,))
            if links is None:
                return 0  # already removed through the namespace (rm -r on the mount)
            if int(links[0]) == parent:
                break
            parent = int(links[0])
            self._lock_inodes(c, (parent,))
        else:
            raise MetaError(errno.EAGAIN, f"the tree of inode {root} keeps moving; retry")
        dirs, files = self._subtree(c, root, lock=True)  # files: inode -> links in the tree
        self._lock_inodes(c, files)
        self._x(c, "DELETE FROM dentries WHERE ino = ? AND parent = ?", (root, parent))
        self._touch_dir(c, parent, -1)
        freed = 0
        for ino, n in files.items():
            left = self._one(c, "SELECT nlink FROM inodes WHERE ino = ?", (ino,))[0] - n
            if left > 0:  # hard-linked outside the checkpoint: keep it and its data
                self._x(c, "UPDATE inodes SET nlink = ? WHERE ino = ?", (left, ino))
                continue
            self._release_extents(c, ino)
            self._x(c, "DELETE FROM xattrs WHERE ino = ?", (ino,))
            self._x(c, "DELETE FROM inodes WHERE ino = ?", (ino,))
            freed += 1
        for i in range(0, len(dirs), 500):
            part = dirs[i : i + 500]
            marks = ",".join("?" * len(part))
            self._x(c, f"DELETE FROM dentries WHERE parent IN ({marks})", part)
            self._x(c, f"DELETE FROM xattrs WHERE ino IN ({marks})", part)
            self._x(c, f"DELETE FROM inodes WHERE ino IN ({marks})", part)
        return freed + len(dirs)

    # -- keep-last ---------------------------------------------------------
    def retain(self, job: str, keep_last: int) -> list[int]:
        """Delete all published steps of a job but the newest `keep_last`; returns them."""
        check_job(job)
        keep = check_int(keep_last, "keep_last", lo=1)
        with self._ckpt_read() as c:
            steps = [
                int(r[0])
                for r in self._x(
                    c,
                    "SELECT step FROM ckpt_steps WHERE job = ? AND state = ? ORDER BY step DESC",
                    (job, PUBLISHED),
                ).fetchall()
            ]
        doomed = sorted(steps[keep:])
        for step in doomed:
            self.delete_checkpoint(job, step)
        return doomed

    @retried
    def set_retention(self, job: str, keep_last: int | None) -> None:
        """Keep only the newest `keep_last` published steps of `job` (None: keep all)."""
        check_job(job)
        key = _POLICY_KEY + job
        keep = None if keep_last is None else check_int(keep_last, "keep_last", lo=1)
        with self._ckpt_tx() as c:
            if keep is None:
                self._x(c, "DELETE FROM config WHERE key = ?", (key,))
            else:  # an upsert: two services setting it at once both succeed
                self._x(
                    c,
                    "INSERT INTO config (key, value) VALUES (?, ?) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (key, json.dumps({"keep_last": keep})),
                )

    def get_retention(self, job: str) -> int | None:
        check_job(job)
        with self._ckpt_read() as c:
            row = self._one(c, "SELECT value FROM config WHERE key = ?", (_POLICY_KEY + job,))
        return None if row is None else int(json.loads(row[0])["keep_last"])

    def apply_retention(self, job: str) -> list[int]:
        """Apply the job's stored policy (called after each publish of the job)."""
        keep = self.get_retention(job)
        return [] if keep is None else self.retain(job, keep)


__all__ = ["RetentionMixin", "DELETED", "ABORTED"]
