"""Recovery, the half of WriteBehindTier that runs after a crash: adopting the journal
segments of dead processes (their pending chunks are uploaded by the adopter, so a kill -9
loses nothing acknowledged) and removing their unacknowledged temp files.

A mixin of WriteBehindTier (its state: staged_dir, seg, _pending, _cond...), kept apart
because it is read when reasoning about crashes, not about the save path."""

from __future__ import annotations

import fcntl
import heapq
import logging
import os
import time

from chunkstore import codec
from chunkstore.fileio import (
    fsync_dir,
    temp_path,
    write_new,
)
from chunkstore.ids import from_hex
from chunkstore.tier.journal import (
    KIND_UPLOADED,
    SEGMENT_SUFFIX,
    SegmentState,
    open_segments,
    parse_segment,
    place_inline,
    same_bytes,
)
from chunkstore.tier.status import pid_alive

log = logging.getLogger("ckptfs.tier")

RECONCILE_AGE_S = 60.0  # staged files renamed more recently may be a live writer's


class Recovery:
    """Adoption of dead processes' journals (mixed into WriteBehindTier)."""

    def _clean_tmp(self, min_age: float = 0.0) -> None:
        """Remove temp files of dead writers (their chunks were never acknowledged), those
        at least `min_age` seconds old (a pid may name a process in another pid namespace:
        the periodic pass gives a live writer's file time to be renamed or removed)."""
        now = time.time()
        with os.scandir(self.tmp_dir) as it:
            for e in it:
                try:
                    pid = int(e.name[1:].split(".")[0])
                except ValueError:
                    pid = -1
                alive = pid > 0 and pid_alive(pid)
                try:
                    age = now - e.stat().st_mtime
                    if (not alive and age >= min_age) or age > 3600:
                        os.unlink(e.path)
                except OSError:
                    pass

    def tidy(self) -> None:
        """The periodic pass over what other processes left (every RECONCILE_AGE_S; at start
        too, unconditionally): temp files of dead writers, and staged files no journal
        names, which are a rank's that died between its rename and the agent's adopt
        (HostStager) or lost their record. Once at start was not enough for an agent that
        lives for weeks while ranks come and go."""
        self._clean_tmp(min_age=RECONCILE_AGE_S)
        self.reconcile_staged()

    def adopt_orphans(self) -> int:
        """Take over the segments of dead processes; returns the chunks adopted."""
        adopted = 0
        for name, path, fd in open_segments(self.journal_dir, skip=self.seg.name):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            try:
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    continue  # adopted or rewritten meanwhile
            except FileNotFoundError:
                continue
            with open(fd, "rb", closefd=False) as f:
                state = parse_segment(f.read())
            adopted += self._adopt(name, path, state)
        return adopted

    def _restore_inline(self, cid: bytes, payload: bytes) -> bool:
        """An I record's chunk: put its staged file back from the record if a crash lost
        or damaged it (the file was never fsync'd), durably. True if it wrote one (the
        caller fsyncs the directory)."""
        dst = os.path.join(self.staged_dir, cid.hex())
        if same_bytes(dst, payload):
            return False
        tmp = temp_path(self.tmp_dir, "s")
        write_new(tmp, payload, sync=True)
        place_inline(tmp, dst, payload)
        return True

    def _adopt(self, name: str, path: str, state: SegmentState) -> int:
        if state.corrupt:
            log.warning(
                "journal %s: %d damaged run(s), %d bytes, skipped; the %d records around them "
                "are kept (staged chunks they named are found by reconcile_staged)",
                name, state.corrupt, state.skipped, state.records,
            )  # fmt: skip
        if state.torn:
            log.info("journal %s: torn tail after %d records ignored", name, state.records)
        carry = []
        restored = False
        for cid, (size, t_ns) in sorted(state.pending.items(), key=lambda kv: kv[1][1]):
            with self._cond:
                if cid in self._pending:
                    continue
            if cid in state.inline:  # journaled with its bytes: carried the same way
                restored |= self._restore_inline(cid, state.inline[cid])
                carry.append((cid, size, t_ns))
                continue
            try:
                with open(os.path.join(self.staged_dir, cid.hex()), "rb") as f:
                    codec.verify(f.read())
            except FileNotFoundError:
                continue  # uploaded by another process that staged it too
            except codec.ChunkFormatError as e:
                self.lost += 1
                log.error(
                    "journal %s: staged chunk %s is corrupt, cannot upload: %s", name, cid.hex(), e
                )
                continue
            carry.append((cid, size, t_ns))
        for cid, t_ns in state.done.items():  # D written, file not yet moved (crash between)
            src = os.path.join(self.staged_dir, cid.hex())
            try:
                if os.stat(src).st_mtime_ns <= t_ns and cid not in self._pending:
                    if self.keep_cache:
                        os.rename(src, self.cache.path(cid))
                    else:
                        os.unlink(src)
            except FileNotFoundError:
                pass
        if restored:
            fsync_dir(self.staged_dir)
        if carry:
            inline = {c: state.inline[c] for c, _, _ in carry if c in state.inline}
            self.seg.add_pending(carry, inline)
        uploaded = [c for c in state.uploaded if c not in self._unregistered]
        if uploaded:
            self.seg.add_done(uploaded, KIND_UPLOADED)
        os.unlink(path)
        fsync_dir(self.journal_dir)
        try:
            os.unlink(os.path.join(self.status_dir, name[: -len(SEGMENT_SUFFIX)] + ".json"))
        except FileNotFoundError:
            pass
        with self._cond:
            now = time.monotonic()
            for cid in uploaded:
                self._unregistered[cid] = (now, 0.0)
        self._queue_carried(carry)
        if carry or state.pending:
            log.info("adopted journal %s: %d pending chunks to upload", name, len(carry))
        return len(carry)

    def _queue_carried(self, carry: list[tuple[bytes, int, int]]) -> None:
        """Queue chunks now journaled as pending in our segment for upload, oldest first."""
        with self._cond:
            for cid, size, t_ns in carry:
                if cid in self._pending:
                    continue
                self._pending[cid] = (size, t_ns)
                self._own_staged += size
                self._seq += 1
                heapq.heappush(self._queue, (t_ns, self._seq, cid))
            self._cond.notify_all()

    def reconcile_staged(self, min_age: float | None = None) -> int:
        """Take the staged chunks that no journal names as pending here; returns how many.

        A staged file is renamed into staged/ right before its P record is appended, so a
        file no segment names is one whose record was lost (a damaged journal run: see
        parse_segment), or one renamed in the last moments by a live process: files
        renamed less than `min_age` ago (ctime: a rename sets it) are left alone. Each is
        checked before it is taken; a corrupt one is reported and removed (its record is
        gone, nothing could ever upload it). Without this such chunks were never uploaded
        nor cleaned."""
        min_age = RECONCILE_AGE_S if min_age is None else min_age
        named = set(self._pending)
        for _, _, fd in open_segments(self.journal_dir, skip=self.seg.name):
            with open(fd, "rb", closefd=False) as f:
                named.update(parse_segment(f.read()).pending)
        now = time.time()
        carry = []
        with os.scandir(self.staged_dir) as it:
            entries = list(it)
        for e in entries:
            try:
                cid = from_hex(e.name)
                if cid in named:
                    continue
                st = e.stat(follow_symlinks=False)
                if now - st.st_ctime < min_age or not e.is_file(follow_symlinks=False):
                    continue
                with open(e.path, "rb") as f:
                    codec.verify(f.read())
            except ValueError:
                continue  # not a chunk file: not ours
            except FileNotFoundError:
                continue  # uploaded and moved meanwhile
            except codec.ChunkFormatError as err:
                self.lost += 1
                log.error("staged chunk %s named by no journal is corrupt: %s", e.name, err)
                os.unlink(e.path)
                continue
            carry.append((cid, st.st_size, st.st_mtime_ns))
        if carry:
            carry.sort(key=lambda c: c[2])
            # A rank renames its files unsynced (its adopt has the agent sync them): durable
            # before a record names them, or a power cut could leave a record of garbage.
            self._files_durable([(cid, n, None) for cid, n, _ in carry])  # type: ignore[attr-defined]
            self.seg.add_pending(carry, {})
            self._queue_carried(carry)
            log.warning("%d staged chunk(s) no journal named are queued for upload", len(carry))
        return len(carry)
