"""The change log's holes (metadata/sql/changes.py): a number taken by a transaction still
running is waited for until that transaction ends, however long, never skipped."""

from __future__ import annotations

import errno
import os
import stat
import time

import psycopg
import pytest

from fusefs.client.volume import Volume
from metadata.engine import ROOT_INO

LATE_S = 6.5  # the writer that took the number commits this long after the next one


def _chmod_sql(conn: psycopg.Connection, ino: int, mode: int) -> None:
    conn.execute("UPDATE inodes SET mode = (mode & ~4095) | %s WHERE ino = %s", (mode, ino))


def _seqs(rows: list) -> list[int]:
    return [s for s, _ in rows]


@pytest.fixture(params=["sqlite", "postgres"])
def vol(request, tmp_path):
    db = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    v = Volume.create(str(tmp_path / "vol"), nodes=2, db=db)
    yield v, db
    v.close()


def test_changes_since_says_when_a_missing_number_is_final(vol):
    """PostgreSQL: a number taken by a running transaction is missing while a higher one is
    listed; the read's (xmin, next) says it may still come, until that transaction ends:
    committed, it is listed; rolled back, it never is and the bound says it is final.
    SQLite: never a hole, and (0, 0): every number is final at once."""
    v, db = vol
    m = v.meta
    a = m.create(ROOT_INO, b"a", stat.S_IFREG | 0o644, 0, 0).ino
    b = m.create(ROOT_INO, b"b", stat.S_IFREG | 0o644, 0, 0).ino
    _, start, *_ = m.changes_since(None, xacts=True)
    assert len(m.changes_since(start)) == 3  # older clients: the 3-tuple, as before
    if db is None:
        m.setattr(a, mode=0o600)
        _, _, rows, xmin, nxt = m.changes_since(start, xacts=True)
        assert (xmin, nxt) == (0, 0) and [i for _, i in rows] == [a]
        return
    for outcome in ("commit", "rollback"):
        _, start, *_ = m.changes_since(None, xacts=True)
        late = psycopg.connect(db)  # a transaction, open until told
        _chmod_sql(late, a, 0o600)  # takes start + 1
        with psycopg.connect(db, autocommit=True) as quick:
            _chmod_sql(quick, b, 0o640)  # takes start + 2, committed at once
        _, _, rows, xmin, bound = m.changes_since(start, xacts=True)
        assert _seqs(rows) == [start + 2]  # start + 1: a hole
        assert xmin < bound  # its writer may still commit it
        _, _, rows, xmin, _ = m.changes_since(start, xacts=True)
        assert xmin < bound, "a hole may not be final while its writer runs"
        late.commit() if outcome == "commit" else late.rollback()
        late.close()
        _, _, rows, xmin, _ = m.changes_since(start, xacts=True)
        assert xmin >= bound  # the writer ended: the hole is final
        want = [start + 1, start + 2] if outcome == "commit" else [start + 2]
        assert _seqs(rows) == want, outcome


def test_a_mount_sees_a_change_whose_number_committed_late(
    tmp_path, pg_url, meta_server, mount_factory
):
    """Issue 40: a writer takes a change number and commits 6.5 s later, after a higher
    number was committed at once. The mount (through a service, on PostgreSQL) waits for
    the hole until that writer ends and shows the change within the feed's bound of its
    commit; it used to give up on the hole after 5 s and show the old attributes for as
    long as its caches keep them (a minute in the kernel, for good in the daemon)."""
    from fusefs.mount.metacache import CACHED_TIMEOUT, FEED_BOUND_S

    Volume.create(str(tmp_path / "vol"), nodes=2, db=pg_url).close()
    srv = meta_server(tmp_path / "vol", db=pg_url)
    mnt = mount_factory(srv.url, "a")
    for name in ("late", "quick"):
        with open(mnt.path(name), "wb") as f:
            f.write(b"x")
    ino = {n: os.stat(mnt.path(n)).st_ino for n in ("late", "quick")}
    time.sleep(1.5)  # past the mount's own short timeouts: what it shows now is cached
    for n in ino:
        assert stat.S_IMODE(os.stat(mnt.path(n)).st_mode) == 0o644

    def seen(path: str, mode: int, within: float) -> float:
        t0 = time.monotonic()
        while stat.S_IMODE(os.stat(path).st_mode) != mode:
            assert time.monotonic() - t0 < within, f"{path}: mode {mode:o} never shown"
            time.sleep(0.02)
        return time.monotonic() - t0

    slack = 1.0  # a loaded machine: the poll and the stat themselves take time
    late = psycopg.connect(pg_url)  # a second connection: a transaction left open
    try:
        _chmod_sql(late, ino["late"], 0o600)  # takes a change number, not committed
        with psycopg.connect(pg_url, autocommit=True) as quick:
            _chmod_sql(quick, ino["quick"], 0o640)  # the next number, committed at once
        t_quick = time.monotonic()
        seen(mnt.path("quick"), 0o640, FEED_BOUND_S + slack)  # the mount read past the hole
        time.sleep(max(0.0, t_quick + LATE_S - time.monotonic()))  # the writer takes its time
        assert stat.S_IMODE(os.stat(mnt.path("late")).st_mode) == 0o644  # not committed
        late.commit()
    finally:
        late.close()
    took = seen(mnt.path("late"), 0o600, FEED_BOUND_S + slack)
    print(f"the late commit was shown {took:.2f} s after it")
    assert CACHED_TIMEOUT > 10 * (FEED_BOUND_S + slack)  # what it would show without the feed


class _Log:
    """A change log whose reads are scripted: records, and which writers still run."""

    def __init__(self, old: bool = False) -> None:
        self.rows: list[list[int]] = []
        self.xmin = self.next = 0
        self.old = old  # a service older than xacts: it refuses the argument

    def changes_since(self, after, limit=4096, xacts=False):
        from metadata.engine import MetaError

        if xacts and self.old:
            raise MetaError(errno.EINVAL, "bad arguments for changes_since")
        newest = max((s for s, _ in self.rows), default=0)
        rows = [] if after is None else [r for r in self.rows if r[0] > after][:limit]
        got = (1 if self.rows else 0, newest, rows)
        return (*got, self.xmin, self.next) if xacts else got


@pytest.mark.parametrize("old", [False, True])
def test_the_feed_waits_for_a_hole_as_long_as_its_writer_runs(old, monkeypatch):
    """The feed's floor stays below a missing number while the read says a transaction
    that may have taken it runs (20 s here: long past HOLE_WAIT_S), and the record is
    applied when it comes. A service that cannot say (older) is waited out HOLE_WAIT_S."""
    import trio

    from fusefs.mount import metacache

    clock = [1000.0]
    monkeypatch.setattr(metacache.time, "monotonic", lambda: clock[0])
    lg = _Log(old)
    lg.rows = [[1, 10], [2, 11]]
    lg.xmin = lg.next = 5
    mc = metacache.MetaCache({})

    async def meta(fn, *args):
        return fn(*args)

    async def main() -> None:
        mc.floor = lg.changes_since(None)[1]
        await mc.poll(meta, lg)
        lg.rows.append([4, 13])  # 3 taken by a writer still running
        lg.xmin, lg.next = 5, 7
        for _ in range(40):
            await mc.poll(meta, lg)
            clock[0] += 0.5
        if old:
            assert mc.floor == 4 and not mc.holes  # given up on after HOLE_WAIT_S
            return
        assert mc.floor == 2 and set(mc.holes) == {3}
        lg.rows.insert(2, [3, 12])  # it commits
        lg.xmin = lg.next = 7
        await mc.poll(meta, lg)
        assert mc.floor == 4 and not mc.holes and not mc.above
        lg.rows.append([6, 15])  # 5 rolled back: final at once (nothing runs)
        await mc.poll(meta, lg)
        assert mc.floor == 6 and not mc.holes

    trio.run(main)
    assert mc.xacts is not old
