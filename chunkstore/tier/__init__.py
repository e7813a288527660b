"""The host write-behind tier: saves land on local NVMe, drain to the object nodes later.

tier.py is the tier (put, sync, upload, read cache), journal.py its journal format,
recover.py adoption of dead processes' journals, status.py what `ckptfs status` reads,
reads.py the verified read of staged/ and cache/. With a per-host agent (issue 42) the
agent holds the tier and each rank a stager.py HostStager: the rank writes and renames
its chunk files itself and the agent syncs and adopts them (ranks.py: adopt, fill_cache).

Layout of a staging directory (one per host and volume, shared by every process there)::

    staged/<hex>        encoded chunk objects not yet known durable (never evicted)
    cache/<hex>         uploaded or fetched objects: the LRU read cache (chunkstore.cache)
    journal/<seg>.jnl   one append-only journal segment per process (P = staged, D = done)
    status/<seg>.json   what `ckptfs status` shows about that process (rate, queue)
    tmp/, locks/        writes in progress; single-flight lock stripes

Why it is crash safe: a chunk is written to tmp/, fsync'd, renamed into staged/ and the
directory fsync'd *before* its P record is appended to the journal and fsync'd, so the journal
never names a missing or half-written file. A small chunk (up to INLINE_MAX) put unsynced
is journaled with its bytes instead (an I record): its staged file is renamed into place
but never fsync'd, and whoever adopts the journal after a crash rewrites the file from the
record if it is missing or damaged. A small file's close then costs one journal fsync, not
a file fdatasync, a directory fsync and a journal fsync. A D record is written only after
the chunk is on R nodes and marked durable in the metadata; only then does the file leave
staged/. Concurrent writers share fsyncs (group commit): one fsync acknowledges every
record written before it.

A rank's chunks (HostStager) follow the same order across two processes, with the syncs
moved to the agent: the rank renames its temp files into staged/ unsynced, then the
agent's `adopt(synced=False)` checks each file's size, makes the files and renames
durable with one syncfs shared by every rank adopting at that moment (GroupSync; one
fsync each and a directory fsync without syncfs), and only then journals them (the
acknowledgement). A rank killed before its rename leaves temp files named by its pid,
which the agent's periodic `tidy` removes (nothing was acknowledged). Killed between
rename and adopt, it leaves files no journal names: `tidy` verifies them, syncs them and
adopts them once older than RECONCILE_AGE_S (ctime, set by the rename), so a file in
that window is never taken by another process, and if an adopt comes after all it finds
the chunk pending and adds nothing. Nothing ever deletes such a file but an uploader
after its upload; a rank never replaces a staged copy of the same chunk whose size is
right (RENAME_NOREPLACE: another rank's acknowledgement may rest on it) and never
removes one. An agent killed after adopt returned leaves its journal to the next tier,
as below.

Ownership: a process owns its segment while it holds an flock on it. A segment whose lock is
free belongs to a dead process: any tier (at start, then every few seconds) adopts it by
taking the lock, copying its pending records into its own segment, and unlinking it. So a
kill -9 loses nothing acknowledged: the next tier to open the directory uploads the rest.

Chunk states are the metadata's ints (STAGED, DURABLE) redefined here: chunkstore does not
import metadata. The tier talks back through `on_durable(ids, stored_lens) -> ids the
metadata does not know yet`; those (uploaded before their file was committed) are retried,
so a commit that lands after the upload cannot leave a chunk marked staged forever.
`stored_lens` are the sizes on the nodes of chunks compressed at upload (0: unchanged).
"""
