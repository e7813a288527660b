"""The PostgreSQL engine (psycopg 3): the same SQL as SQLite, for shared namespaces.

Several `ckptfs meta serve` replicas may run on one database, each with one
connection, and their writers do not queue behind one lock: writers of
different checkpoints, and of unrelated parts of the namespace, run side by
side. Transactions run at READ COMMITTED, so every statement sees each
transaction committed before it started: a statement after a lock was granted
sees everything the lock's previous holder wrote. Reads run outside write
transactions (autocommit) and never wait for another service's writer (within
a service they take turns on its connection).

Locks, in the order a transaction takes them (SQLite's BEGIN IMMEDIATE
serializes every writer, so sqlbase's lock hooks do nothing there):

1. RENAME_LOCK (advisory): a rename that moves a directory to another parent.
2. Step locks (advisory, one per (job, step), taken sorted): begin, a group
   commit (every step in the batch), publish (inside the last commit), abort,
   expire, delete_checkpoint. Advisory, since a step being begun has no row yet.
3. CHUNK_GATE (advisory): shared by transactions that take chunk references
   (commit_file, group commits) or find chunks to deduplicate against
   (missing_chunks); exclusive for those that delete chunk rows or set counts
   (gc_chunk_rows, fsck's drop/fix/register/true_refcounts).
4. Inode rows (SELECT ... FOR UPDATE, sorted), parents before children: the
   directory whose entries change (create, link, unlink, rmdir, rename, publish,
   delete_checkpoint), then the inode whose links, attributes, extents or
   xattrs change.
5. Chunk and journal rows, in id order (the row locks of relative UPDATEs and
   upserts; journal rows read FOR UPDATE, or SKIP LOCKED by background slices).
SCHEMA_LOCK (advisory) guards DDL, taken only when a table is missing.

A transaction that cannot know every row up front (a rename learns what it
replaces by looking) may still meet another in a cycle: PostgreSQL rolls one
back (deadlock, 40P01; likewise serialization failures, 40001) and
`txlocks.retried` runs that whole method again.

Why each invariant still holds:
- Unique names in a directory: UNIQUE (parent, name) on `dentries`; every insert
  of a name is ON CONFLICT DO NOTHING and answers EEXIST, never a second entry.
  Whoever changes a directory's entries holds its row, so check-then-act on a
  name (rename over a target, rmdir's "empty?", publish's "free?") is not raced,
  and nothing is made in a directory being removed (create, link and publish
  check nlink > 0 after taking the directory's row).
- Rename is atomic and makes no cycle: one transaction holding both parents and
  the inodes moved or replaced. A directory changing parents holds RENAME_LOCK
  while it checks that the target is not inside it, so no other directory
  changes parents meanwhile (Linux's s_vfs_rename_mutex); other writers only
  add new leaves (create, a step's hidden tree, publish) or remove subtrees.
- Link counts: changed relatively (nlink = nlink +/- 1) under the inode's row
  lock; the checks that depend on them (link of an unlinked inode, an orphan
  dropped at 0, the links left outside a deleted step) run after that lock.
- Chunk refcounts: every change is relative (refcount = refcount + d) in an
  UPDATE or upsert, so concurrent writers add up. A file's old extents, whose
  references a commit drops, are read under the file's row lock. Journal rows
  are locked when read and deleted by their exact ids: applied once even with
  two services applying, never deleted unapplied; abort locks its step's rows
  (applied meanwhile = gone = counted as applied).
- gc never deletes a referenced chunk: gc holds CHUNK_GATE exclusively, so no
  transaction taking references is in flight while it applies the journal and
  reads counts and extents. A commit checks that the chunks it references exist
  after taking the gate (shared): one gc deleted before is reported (the writer
  stores it again), one it saw cannot be deleted before it commits. A chunk
  missing_chunks finds is touched in the same gated transaction, so gc keeps it
  for the grace period, as on SQLite.
- A checkpoint is published once, with all ranks, or aborted: every transaction
  that writes a step holds its step lock, so the count that triggers the publish
  (in the last commit's transaction) counts every committed rank, and publish,
  abort and the deadline see one state; expire re-reads the state once locked.
- A double commit is rejected: the rank's record (PRIMARY KEY (job, step,
  rank)) is checked and written under the step lock: the same content answers
  as a duplicate, other content EEXIST.
- A request retried on another replica is applied once: requests.py.

The schema is SQLite's, translated mechanically (BLOB -> BYTEA, INTEGER ->
BIGINT, rowid keys -> identity columns), so the engines cannot drift apart.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
import time
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from metadata.engine import MetaError
from metadata.engines import DB_WAIT_S
from metadata.engines.sqlite import SCHEMA
from metadata.sql.base import SqlEngine
from metadata.sql.changes import POSTGRES_DDL
from metadata.sql.txlocks import lock_key

log = logging.getLogger("ckptfs.meta")

_RESERVED = re.compile(
    r'(?<!")\boffset\b(?!")'
)  # a column name in our schema, a keyword in PostgreSQL


def translate_ddl(stmt: str) -> str:
    s = stmt.replace("INTEGER PRIMARY KEY", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
    s = s.replace(" WITHOUT ROWID", "").replace("x''", "'\\x'::bytea")
    s = re.sub(r"\bBLOB\b", "BYTEA", s)
    s = re.sub(r"\bINTEGER\b", "BIGINT", s)
    return _RESERVED.sub('"offset"', s)


RECONNECT_WINDOW_S = DB_WAIT_S  # how long a lost database is waited for before calls fail


# A replica that goes silent inside a transaction (stopped, hung, its host gone) holds row
# and advisory locks that the request retried on another replica waits for: the database
# lets go of it within seconds (docs/metadata-replicas.md, "When a replica hangs").
IDLE_IN_TX_S = 5.0  # idle_in_transaction_session_timeout: no statement for this long in a tx
# A replica stopped in the middle of a COPY is not idle (its backend waits to read the
# rest of the data, and its kernel still acknowledges): every replica ends such a backend
# once its COPY has run this long (a 16k-rank group commit's COPY takes well under 1 s).
SILENT_COPY_S = 8.0
KEEPALIVE = (5, 2, 3)  # TCP keepalive idle, interval, probes, both ways: a vanished host ~11 s
USER_TIMEOUT_MS = 11000  # tcp_user_timeout, both ways: data unacknowledged this long
# libpq's side (the replica finds the database gone); a URL's own values win
_LIBPQ_KEEPALIVE = {
    "keepalives": "1",
    "keepalives_idle": str(KEEPALIVE[0]),
    "keepalives_interval": str(KEEPALIVE[1]),
    "keepalives_count": str(KEEPALIVE[2]),
    "tcp_user_timeout": str(USER_TIMEOUT_MS),
}
# the session's settings (the server's side of the same)
_SESSION = {
    # psycopg prepares a statement after 5 runs, and PostgreSQL may then keep a generic
    # plan chosen while the tables were small: the duplicate-rank check of a group
    # commit (`rank IN (...)` over ckpt_ranks) went from 5 to 240 ms per 1024 ranks as
    # a 16k-rank step filled. Plans made for each run's values stay index scans.
    "plan_cache_mode": "force_custom_plan",
    "idle_in_transaction_session_timeout": f"{IDLE_IN_TX_S * 1000:.0f}",
    "tcp_keepalives_idle": str(KEEPALIVE[0]),
    "tcp_keepalives_interval": str(KEEPALIVE[1]),
    "tcp_keepalives_count": str(KEEPALIVE[2]),
    "tcp_user_timeout": str(USER_TIMEOUT_MS),
}
_SET_SESSION = "SELECT " + ", ".join(f"set_config('{k}', %s, false)" for k in _SESSION)


def _connect(url: str) -> psycopg.Connection:
    try:
        given = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        given = {}
    extra = {k: v for k, v in _LIBPQ_KEEPALIVE.items() if k not in given}
    conn = psycopg.connect(url, autocommit=True, **extra)
    conn.execute(_SET_SESSION, list(_SESSION.values())).fetchall()
    return conn


def _transient(e: psycopg.Error) -> bool:
    """An error that a database restart gives and that waiting cures: no server answered
    (connection refused, no route) or one answered that it is starting up, shutting down,
    recovering or full (SQLSTATE class 57 or 53300). A server that refuses for good (no
    such database, a wrong password: libpq gives those as a FATAL message without a
    SQLSTATE) is not waited for: the user would only wait for the same error."""
    state = getattr(e, "sqlstate", None)
    if state is not None:
        return state.startswith("57") or state == "53300"
    msg = str(e)
    if any(w in msg for w in _LASTING):
        return False
    return "FATAL:" not in msg or any(w in msg for w in _PASSING)


# FATAL messages that pass: starting, stopping or recovering, and the connection slots full
# (53300: "too many clients already", or the reserved slots' "remaining connection slots")
_PASSING = (
    "the database system is",
    "too many clients",
    "too many connections",
    "remaining connection slots",
)
# client-side refusals libpq gives without FATAL that no wait cures: credentials and TLS
_LASTING = ("password", "fe_sendauth", "does not support SSL", "SSL is not enabled", "certificate")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _connect_waiting(url: str, wait_s: float) -> psycopg.Connection:
    """A connection, waiting up to `wait_s` (with backoff, saying so once in the log) while
    the error is one that waiting cures (`_transient`); otherwise the error at once."""
    deadline = time.monotonic() + wait_s
    delay, said = 0.05, False
    while True:
        try:
            return _connect(url)
        except psycopg.OperationalError as e:
            if not _transient(e) or time.monotonic() >= deadline:
                raise
            if not said:
                log.warning("waiting up to %.0f s for PostgreSQL: %s", wait_s, _first_line(e))
                said = True
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def ensure_database(admin_url: str, name: str) -> None:
    """Create database `name` on the server `admin_url` reaches, unless it exists (`ckptfs
    meta postgres`: the one place outside the engine that needs the driver, kept here so no
    frontend imports it). `name` comes from the code; a failure is one line (MetaError)."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
        raise MetaError(errno.EINVAL, f"not a database name this code makes: {name!r}")
    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as c:
            found = c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if found.fetchone() is None:
                c.execute(f"CREATE DATABASE {name}")
    except psycopg.Error as e:
        raise MetaError(errno.EIO, f"cannot create the {name} database: {_first_line(e)}") from None


class _Conn:
    """What sqlbase expects of a connection (execute() returning a cursor, executemany()),
    over a psycopg connection that is opened again when the database restarts.

    A statement that finds the connection broken outside a transaction (a read) is run
    again on a new connection: on its own it is a whole request. Inside a transaction the
    error goes up, the transaction is lost with the connection, and `txlocks.retried`
    runs the whole method again, whose BEGIN (`reopen_if_broken`) reconnects first. A
    retried request is applied once: its key or its digest is in the database
    (requests.py), so a COMMIT whose answer was lost is not applied twice."""

    def __init__(self, url: str, in_tx: Any, wait_s: float = 0.0) -> None:
        self.url = url
        self._in_tx = in_tx
        self.reconnects = 0
        try:
            self.conn = _connect_waiting(url, wait_s)
        except psycopg.Error as e:
            raise MetaError(errno.EIO, f"cannot connect to PostgreSQL: {e}".strip()) from None

    def execute(self, sql: str, args: Any = ()) -> psycopg.Cursor:
        try:
            return self.conn.execute(sql, args)
        except psycopg.OperationalError:
            if self._in_tx() or not self.conn.broken:
                raise
            self.reconnect()
            return self.conn.execute(sql, args)

    def executemany(self, sql: str, rows: Any) -> None:
        with self.conn.cursor() as cur:
            cur.executemany(sql, rows)

    def reopen_if_broken(self) -> None:
        if self.conn.broken or self.conn.closed:
            self.reconnect()

    def reconnect(self) -> None:
        """A new connection, waiting for the database up to RECONNECT_WINDOW_S (a
        restart, a failover of its host), with backoff; then MetaError(EIO)."""
        try:
            self.conn.close()
        except psycopg.Error:
            pass
        try:
            self.conn = _connect_waiting(self.url, RECONNECT_WINDOW_S)
        except psycopg.Error as e:
            raise MetaError(errno.EIO, f"PostgreSQL connection lost: {e}".strip()) from None
        self.reconnects += 1
        log.warning("PostgreSQL connection opened again (%d since start)", self.reconnects)


class PostgresEngine(SqlEngine):
    CHANGES_DDL = POSTGRES_DDL  # the change log's trigger is a plpgsql function here

    def __init__(self, url: str, wait_s: float = 0.0) -> None:
        """`wait_s`: how long an unreachable database is waited for at the first connection
        (a long-running service waits out a database restart; a one-shot command fails at
        once). Afterwards a lost connection is waited for up to RECONNECT_WINDOW_S, as long
        as the errors are ones that waiting cures (`_transient`)."""
        self.url = url
        self._conn = _Conn(url, lambda: self._depth > 0, wait_s)
        self._lock = threading.RLock()
        self._depth = 0
        self._qcache: dict[str, str] = {}
        self._upgrade_schema()

    def _ddl(self) -> list[str]:
        out = [translate_ddl(s) for s in SCHEMA]
        out.append(  # identities start past the root inode, which init_volume inserts itself
            "DO $$ BEGIN PERFORM setval(pg_get_serial_sequence('inodes', 'ino'), "
            "GREATEST(2, (SELECT COALESCE(MAX(ino), 1) + 1 FROM inodes)), false); END $$"
        )
        return out

    def end_silent_backends(self, after_s: float = SILENT_COPY_S) -> list[int]:
        """End this database's backends stuck in a COPY that waits for its client's data for
        longer than `after_s` (a replica stopped mid-COPY: its transaction's locks would
        hold every retried request until it resumed); their pids. The service runs it
        every couple of seconds; the stopped replica's transaction rolls back, and its
        client's request, resent to another replica, applies once."""
        with self._read() as c:
            rows = self._x(
                c,
                "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend' AND state = 'active' "
                "AND wait_event = 'ClientRead' AND query ILIKE 'COPY %' "
                "AND query_start < now() - make_interval(secs => ?)",
                (float(after_s),),
            ).fetchall()
        ended = [int(r[0]) for r in rows if r[1]]
        for pid in ended:
            log.warning("ended PostgreSQL backend %d: a COPY silent for %.0f s", pid, after_s)
        return ended

    def _alloc_inos(self, c: Any, n: int) -> list[int]:
        """Reserve n inode numbers from the identity sequence (other services share it)."""
        if n <= 0:
            return []
        rows = self._x(
            c,
            "SELECT nextval(pg_get_serial_sequence('inodes', 'ino')) FROM generate_series(1, ?)",
            (n,),
        ).fetchall()
        return [int(r[0]) for r in rows]

    def _bulk_insert(
        self, c: Any, table: str, cols: str, rows: list[tuple], fixed: dict[str, Any] | None = None
    ) -> None:
        """COPY: one stream instead of a statement per row (a unique violation still
        raises, and the group commit falls back to rank-by-rank)."""
        if not rows:
            return
        extra = tuple((fixed or {}).values())
        names = ", ".join([cols, *(fixed or {})])
        with c.conn.cursor() as cur, cur.copy(f"COPY {table} ({names}) FROM STDIN") as cp:
            for row in rows:
                cp.write_row(row + extra if extra else row)

    def _add_refs(self, c: Any, rows: list[tuple[bytes, int]], now: int) -> None:
        """One statement over arrays: applying a journal row (2,048 chunks) statement by
        statement took 150-370 ms on a loaded 2-core machine, and held the service's one
        connection meanwhile. The rows are locked in id order first (FOR UPDATE), the
        order every writer of chunk rows follows."""
        ids = [bytes(cid) for cid, _ in rows]
        c.execute("SELECT 1 FROM chunks WHERE id = ANY(%s) ORDER BY id FOR UPDATE", (ids,))
        c.execute(
            "UPDATE chunks SET refcount = chunks.refcount + d.delta, touched = %s "
            "FROM unnest(%s::bytea[], %s::bigint[]) AS d(id, delta) WHERE chunks.id = d.id",
            (now, ids, [d for _, d in rows]),
        )

    def _upsert_chunks(self, c: Any, rows: list[tuple]) -> None:
        """One INSERT ... SELECT over arrays (see `_add_refs`); rows are taken in the
        arrays' order (sorted ids), so conflicting rows are locked in id order."""
        cols = list(zip(*rows, strict=True))
        c.execute(
            "INSERT INTO chunks (id, raw_len, stored_len, refcount, state, touched, domain) "
            "SELECT * FROM unnest(%s::bytea[], %s::bigint[], %s::bigint[], %s::bigint[], "
            "%s::bigint[], %s::bigint[], %s::bigint[]) " + self.UPSERT_TAIL,
            [[bytes(v) for v in cols[0]], *(list(col) for col in cols[1:])],
        )

    def _ckpt_ddl(self) -> list[str]:
        return [translate_ddl(s) for s in super()._ckpt_ddl()]

    def _ddl_text(self, stmt: str) -> str:
        return translate_ddl(stmt)

    def _q(self, sql: str) -> str:
        out = self._qcache.get(sql)
        if out is None:
            out = _RESERVED.sub('"offset"', sql.replace("%", "%%").replace("?", "%s"))
            if len(self._qcache) < 4096:
                self._qcache[sql] = out
        return out

    # -- locks (see the module docstring) -------------------------------------------
    # conflicts, and a connection lost mid-transaction (the database restarted): the
    # transaction is gone either way, and runs again from its BEGIN
    _retryable = (
        psycopg.errors.DeadlockDetected,
        psycopg.errors.SerializationFailure,
        psycopg.OperationalError,
    )
    _skip_locked = " FOR UPDATE SKIP LOCKED"
    _for_update = " FOR UPDATE"

    def _lock_inodes(self, c: Any, inos: Any) -> None:
        want = sorted(set(inos))
        if want:  # rows are locked in the ORDER BY's order: one order for every writer
            c.execute(
                "SELECT ino FROM inodes WHERE ino = ANY(%s) ORDER BY ino FOR UPDATE", (want,)
            ).fetchall()

    def _lock_steps(self, c: Any, keys: Any) -> None:
        want = sorted({lock_key("step", job, step) for job, step in keys})
        if want:  # an advisory lock: a step being begun has no row to lock yet
            c.execute(
                "SELECT pg_advisory_xact_lock(k) FROM unnest(%s::bigint[]) AS k", (want,)
            ).fetchall()

    def _lock_named(self, c: Any, name: str, *, shared: bool = False) -> None:
        fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        c.execute(f"SELECT {fn}(%s)", (lock_key("lock", name),)).fetchall()

    def _begin(self) -> None:
        self._conn.reopen_if_broken()
        try:
            self._conn.conn.execute("BEGIN")
        except psycopg.OperationalError:
            if not self._conn.conn.broken:
                raise
            self._conn.reconnect()  # the database restarted since the last statement
            self._conn.conn.execute("BEGIN")

    def _end(self, *, commit: bool) -> None:
        conn = self._conn.conn
        if commit:
            conn.execute("COMMIT")
        elif not conn.closed and not conn.broken:
            conn.execute("ROLLBACK")

    # -- dump (metadata/sql/dumpsql.py) --------------------------------------------------
    def _snapshot_open(self) -> tuple[Any, str]:
        """A connection of its own in a REPEATABLE READ, read-only transaction: one view
        of every table, taking no lock a writer waits for."""
        try:
            conn = psycopg.connect(self.url)
        except psycopg.Error as e:
            raise MetaError(errno.EIO, f"cannot connect to PostgreSQL: {e}".strip()) from None
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        conn.execute("SELECT 1").fetchone()  # the snapshot starts here
        return conn, "postgresql"

    def _snapshot_has(self, conn: Any, table: str) -> bool:
        return conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None

    def _snapshot_rows(self, conn: Any, sql: str, batch: int) -> Any:
        """A server-side cursor: rows come over a batch at a time, never all at once."""
        with conn.cursor(name="ckptfs_dump") as cur:
            cur.itersize = batch
            cur.execute(sql)
            while rows := cur.fetchmany(batch):
                yield rows

    def _after_load(self, c: Any) -> None:
        """Identity sequences past the keys the load wrote itself."""
        for table, col in (("inodes", "ino"), ("dentries", "id"), ("ref_journal", "id")):
            c.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', '{col}'), "
                f"GREATEST(2, (SELECT COALESCE(MAX({col}), 1) + 1 FROM {table})), false)"
            ).fetchall()

    def close(self) -> None:
        with self._lock:
            self._conn.conn.close()
