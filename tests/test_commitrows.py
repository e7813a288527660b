"""metadata/sql/commitrows.py: the rows a group commit inserts without the database,
made by the validator; several validated chunks merged into one write."""

from __future__ import annotations

import os

from bench.commit import rank_files
from metadata.ckptformat import INO, RANK, WireFile
from metadata.engines.sqlite import SqliteEngine
from metadata.sql.commitrows import JOURNAL_GROUP, FileCols, Rows, merge


def _engine(tmp_path) -> SqliteEngine:
    eng = SqliteEngine(os.path.join(tmp_path, "meta.db"))
    eng.init_volume({"chunk_seed": "00" * 16})
    return eng


def _items(step: int, ranks: range, job: str = "j") -> list[tuple]:
    return [(job, step, r, [WireFile(**f) for f in rank_files(r)], f"h{r}", None) for r in ranks]


def _made_by_writer(monkeypatch) -> list[int]:
    """Count the files' columns made from here on (the writer's own, when it does not use
    the validator's); a wrong use would not fail the write but fall back to rank-by-rank,
    so tests count this and the journal rows instead."""
    made: list[int] = []
    orig = FileCols.of.__func__

    def of(cls, todo):
        made.append(len(todo))
        return orig(cls, todo)

    monkeypatch.setattr(FileCols, "of", classmethod(of))
    return made


def _journal(eng: SqliteEngine) -> list[tuple[list[int], int | None]]:
    """ref_journal rows: (the ranks each holds, its trust domain), in id order."""
    rows = eng._conn.execute("SELECT ranks, domain FROM ref_journal ORDER BY id").fetchall()
    return [([r for (r,) in RANK.iter_unpack(bytes(ranks))], dom) for ranks, dom in rows]


def test_rows_hold_what_the_writer_inserts(tmp_path):
    """Per file, in commit order: the directory prefix, the name (also as a bytearray, the
    bound value), size, extents (a bytearray) and alloc; per rank its ckpt_ranks row but
    the time and inode numbers, the byte range of its INO records; the journal in rows of
    up to JOURNAL_GROUP ranks, the first rank's number and every rank's packed."""
    eng = _engine(tmp_path)
    n = JOURNAL_GROUP + 3
    out, todo, domains, rows = eng.prepare_commits(_items(1, range(n)))
    assert out == [None] * n and rows.cover(todo) and rows.files is not None
    files = [f for t in todo for f in t[4]]
    assert len(rows.files.names) == len(files) == 4 * n
    for k, (_path, parts, size, blob, _chunks) in enumerate(files):
        assert rows.files.prefixes[k] == tuple(parts[:-1]) and rows.files.names[k] == parts[-1]
        assert rows.files.name_blobs[k] == bytearray(parts[-1])
        assert type(rows.files.blobs[k]) is bytearray and rows.files.blobs[k] == blob
        assert rows.files.sizes[k] == size
    assert rows.files.allocs == [a for t in todo for a in t[9][5]]
    ends = rows.ino_ends
    for t, row, a, b in zip(todo, rows.ranks, ends[:-1], ends[1:], strict=True):
        assert row[:4] == ("j", 1, t[3], f"h{t[3]}") and row[6] == len(t[4])
        assert bytes(row[7]) == t[6] and bytes(row[8]) == t[9][1]
        assert b - a == INO.size * len(t[4])
    assert [r[2] for r in rows.journal] == [0, JOURNAL_GROUP]  # first rank of each row
    got = [r for j in rows.journal for (r,) in RANK.iter_unpack(bytes(j[3]))]
    assert got == list(range(n))
    assert not rows.cover(todo[1:]) and not rows.cover([*todo[1:], todo[0]])


def test_merged_chunks_write_as_one_and_match_one_batch(tmp_path, monkeypatch):
    """Chunks validated apart and merged are one write_commits: every rank committed, the
    step published, the same files and journal as the whole batch validated at once, in
    one pass with the validator's rows (the writer makes none of its own)."""
    eng = _engine(tmp_path)
    n = 2 * JOURNAL_GROUP + 5
    items = _items(1, range(n))  # (random chunk ids: made once)
    whole = eng.prepare_commits(items)
    chunks = [eng.prepare_commits(items[a : a + 20]) for a in range(0, n, 20)]
    merged = eng.merge_prepared(chunks)
    assert merged[0] == whole[0] and [t[0] for t in merged[1]] == list(range(n))
    assert [t[1:9] for t in merged[1]] == [t[1:9] for t in whole[1]]
    rows = merged[3]
    assert rows.cover(merged[1]) and rows.ino_ends == whole[3].ino_ends
    assert rows.ranks == whole[3].ranks
    assert vars(rows.files) == vars(whole[3].files)
    ranks = [[r for (r,) in RANK.iter_unpack(bytes(j[3]))] for j in rows.journal]
    assert [r for part in ranks for r in part] == list(range(n))  # each chunk's rows
    assert all(0 < len(part) <= JOURNAL_GROUP for part in ranks)
    eng.begin("j", 1, n)
    made = _made_by_writer(monkeypatch)
    res = eng.write_commits(merged)
    assert all(isinstance(r, dict) for r in res) and res[-1]["state"] == "published"
    assert made == [] and [r for r, _ in _journal(eng)] == ranks  # not rank by rank


def test_merged_chunks_keep_each_commits_trust_domain(tmp_path, monkeypatch):
    """Items carry their committer's trust domain (a sixth field, by item index): after a
    merge moves the indices, each rank's journal row still carries its own domain."""
    eng = _engine(tmp_path)
    items = [(*it[:5], 7 if it[2] % 2 else None) for it in _items(1, range(6))]
    a, b = eng.prepare_commits(items[:3]), eng.prepare_commits(items[3:])
    assert a[2] == {1: 7} and b[2] == {0: 7, 2: 7}
    merged = eng.merge_prepared([a, b])
    assert merged[2] == {1: 7, 3: 7, 5: 7}
    eng.begin("j", 1, 6)
    made = _made_by_writer(monkeypatch)
    res = eng.write_commits(merged)
    assert res[-1]["state"] == "published" and made == []
    got = {r: dom for ranks, dom in _journal(eng) for r in ranks}
    assert got == {r: (7 if r % 2 else None) for r in range(6)}


def test_merge_without_rows_leaves_the_writer_to_make_them(tmp_path):
    """A chunk without rows (an older caller's 2-tuple) makes the merge carry none: the
    writer then makes its own, and the write is the same."""
    eng = _engine(tmp_path)
    a = eng.prepare_commits(_items(1, range(3)))
    b = eng.prepare_commits(_items(1, range(3, 6)))[:2]
    out, todo, domains, rows = merge([a, b])
    assert rows is None and [t[0] for t in todo] == list(range(6)) and domains == {}
    eng.begin("j", 1, 6)
    res = eng.write_commits((out, todo, domains, rows))
    assert res[-1]["state"] == "published" and res[-1]["committed"] == 6


def test_the_writer_makes_its_own_rows_when_a_rank_drops_out(tmp_path, monkeypatch):
    """Rows are used only for exactly the commits they were made for: with a duplicate
    (already committed) rank in the batch the writer makes its own for the others, in
    one pass, and they commit."""
    eng = _engine(tmp_path)
    eng.begin("j", 1, 4)
    items = _items(1, range(4))
    assert eng.write_commits(eng.prepare_commits(items[:1]))[0]["state"] == "open"
    again = eng.prepare_commits(items)  # rank 0 again: a duplicate
    made = _made_by_writer(monkeypatch)
    res = eng.write_commits(again)
    assert res[0]["duplicate"] and not res[1]["duplicate"]
    assert res[-1]["state"] == "published" and res[-1]["committed"] == 4
    assert made == [3]  # its own columns, for the three it wrote
    assert [r for r, _ in _journal(eng)] == [[0], [1, 2, 3]]  # one row: not rank by rank


def test_empty_file_columns():
    cols = FileCols.of([])
    assert cols.names == [] and cols.blobs == []
    cols.extend(FileCols())
    assert cols.sizes == []
    assert Rows([], {}).journal == [] and Rows([], {}).ino_ends == [0]
