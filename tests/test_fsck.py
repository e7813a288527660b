"""fsck, scrub and gc on local directory nodes: every injected problem is found, the
repairable ones are repaired, and the CLI reports and exits accordingly."""

from __future__ import annotations

import json
import os
import time

import pytest

from chunkstore import codec
from chunkstore.ids import chunk_id
from fusefs.cli.main import main
from fusefs.maint.fsck import check_volume
from fusefs.maint.gc import gc
from fusefs.maint.scrub import scrub
from metadata.engine import STAGED


def fsck_json(capsys, vol, *extra: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["fsck", vol.base_dir, "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def kinds(rep: dict) -> list[str]:
    return sorted(p["kind"] for p in rep["problems"])


@pytest.fixture
def filled(make_volume):
    vol = make_volume(nodes=4, replicas=2, chunk_size=64 * 1024)
    data = os.urandom(5 * 64 * 1024 + 123)
    vol.write_file("/d/a.bin", data)
    return vol, data


def first_chunk(vol, path="/d/a.bin") -> bytes:
    return vol.meta.get_extents(vol.resolve(path).ino)[0].chunk_id


def test_clean_volume_has_no_problems(filled, capsys):
    vol, _ = filled
    rc, rep = fsck_json(capsys, vol)
    assert rc == 0
    assert rep["problems"] == []
    # the 123-byte tail chunk is inline: its bytes are in the metadata, on no node
    assert rep["chunks"] == 6 and rep["objects"] == 10 and rep["replicas_read"] == 10
    assert rep["inline_chunks"] == 1


def test_deleted_replica_found_and_repaired(filled, capsys):
    vol, data = filled
    cid = first_chunk(vol)
    victim = vol.store.placement(cid)[1]
    victim.delete(cid)
    rc, rep = fsck_json(capsys, vol)
    assert rc == 1 and kinds(rep) == ["missing_replica"]
    assert rep["problems"][0]["node"] == victim.name
    rc, rep = fsck_json(capsys, vol, "--repair")
    assert rc == 0 and rep["problems"][0]["repaired"] is True
    assert victim.exists(cid)
    rc, rep = fsck_json(capsys, vol)
    assert rc == 0 and rep["problems"] == []
    assert vol.read_file("/d/a.bin") == data


def test_upload_stopped_half_way_is_not_a_missing_replica(filled, capsys):
    """A chunk still staged on a host (not durable) whose upload a crash stopped after one
    replica: the copy present is checked, the other is not reported missing; once the
    chunk is marked durable the same gap is a missing replica."""
    vol, _ = filled
    cid = first_chunk(vol)
    vol.store.placement(cid)[1].delete(cid)
    with vol.meta._tx() as c:  # as the row is before the uploader marks it durable
        c.execute(vol.meta._q(f"UPDATE chunks SET state = {STAGED} WHERE id = ?"), (cid,))
    rc, rep = fsck_json(capsys, vol)
    assert rc == 0 and rep["problems"] == [], rep["problems"]
    assert rep["staged_chunks"] == 1  # said, not silently skipped
    vol.store.placement(cid)[0].delete(cid)  # no copy on the nodes at all: still not lost
    rc, rep = fsck_json(capsys, vol)
    assert rc == 0 and rep["problems"] == [], rep["problems"]
    assert main(["fsck", vol.base_dir]) == 0
    assert "1 chunk(s) still staged" in capsys.readouterr().out
    vol.meta.mark_durable([cid])
    rc, rep = fsck_json(capsys, vol)
    assert rc == 1 and sorted(set(kinds(rep))) == ["dangling_extent", "missing_replica"], rep
    assert rep["staged_chunks"] == 0


def test_flipped_byte_found_and_rewritten(filled, capsys):
    vol, data = filled
    cid = first_chunk(vol)
    node = vol.store.placement(cid)[0]
    blob = bytearray(node.get(cid))
    blob[len(blob) // 2] ^= 0x01
    node.plant(cid, bytes(blob))  # (a put keeps a whole object)
    rc, rep = fsck_json(capsys, vol)
    assert rc == 1 and kinds(rep) == ["corrupt_replica"]
    rc, rep = fsck_json(capsys, vol, "--repair")
    assert rc == 0
    codec.verify(node.get(cid))
    assert fsck_json(capsys, vol)[1]["problems"] == []


def test_orphan_object_respects_grace_then_is_deleted(filled, capsys):
    vol, _ = filled
    raw = os.urandom(1000)
    cid = chunk_id(raw, vol.seed)
    node = vol.store.nodes[0]
    node.put(cid, codec.encode(raw, "none"))
    rc, rep = fsck_json(capsys, vol)  # default grace: an in-flight write, left alone
    assert rc == 0 and rep["problems"] == [] and rep["young_objects_skipped"] == 1
    rc, rep = fsck_json(capsys, vol, "--grace", "0")
    assert rc == 1 and kinds(rep) == ["orphan_object"]
    rc, rep = fsck_json(capsys, vol, "--grace", "0", "--repair")
    assert rc == 0 and not node.exists(cid)


def test_chunk_lost_everywhere_is_named_not_repaired(filled, capsys):
    vol, _ = filled
    cid = first_chunk(vol)
    for n in vol.store.nodes:
        n.delete(cid)
    rc, rep = fsck_json(capsys, vol, "--repair")
    assert rc == 1
    dangling = [p for p in rep["problems"] if p["kind"] == "dangling_extent"]
    assert len(dangling) == 1 and dangling[0]["chunk"] == cid.hex()
    assert dangling[0]["files"] == ["/d/a.bin"] and "lost" in dangling[0]["why_not"]
    assert not dangling[0]["repaired"]
    # Text mode names the file too, and still fails.
    capsys.readouterr()
    assert main(["fsck", vol.base_dir]) == 1
    out = capsys.readouterr().out
    assert "dangling_extent" in out and "used by /d/a.bin" in out and "NOT repaired" in out


def test_bad_inline_chunk_is_named_and_never_read(filled, capsys):
    """An inline chunk's bytes are in the metadata, their one copy: bytes that no longer
    match the id, or are gone, are reported with the file, and a read fails instead of
    returning them."""
    import sqlite3

    from chunkstore.store import ChunkUnavailable

    vol, data = filled
    tail = vol.meta.get_extents(vol.resolve("/d/a.bin").ino)[-1]
    assert tail.length == 123 and vol.meta.chunk_info([tail.chunk_id])[tail.chunk_id][3] == 2
    assert vol.read_file("/d/a.bin") == data
    db = sqlite3.connect(vol.meta.path)
    db.execute("UPDATE inline_data SET data = ? WHERE id = ?", (b"x" * 123, tail.chunk_id))
    db.commit()
    rc, rep = fsck_json(capsys, vol, "--repair")
    assert rc == 1 and kinds(rep) == ["bad_inline"]
    (p,) = rep["problems"]
    assert p["chunk"] == tail.chunk_id.hex() and p["files"] == ["/d/a.bin"]
    assert "do not match" in p["detail"] and not p["repaired"]
    with pytest.raises(ChunkUnavailable, match="corrupt"):
        vol.read_file("/d/a.bin")
    # text where the bytes belong (an older version let a client store it): reported the
    # same way; it made every inline query fail, and fsck with a traceback
    db.execute("UPDATE inline_data SET data = ? WHERE id = ?", ("x" * 123, tail.chunk_id))
    db.commit()
    rc, rep = fsck_json(capsys, vol)
    assert rc == 1 and kinds(rep) == ["bad_inline"]
    assert "do not match" in rep["problems"][0]["detail"]
    db.execute("DELETE FROM inline_data WHERE id = ?", (tail.chunk_id,))
    db.commit()
    db.close()
    rc, rep = fsck_json(capsys, vol)
    assert rc == 1 and kinds(rep) == ["bad_inline"] and "missing" in rep["problems"][0]["detail"]


def test_gc_drops_inline_bytes_with_their_row(make_volume, capsys):
    vol = make_volume(nodes=3, replicas=2)
    vol.write_file("/small", b"s" * 1000)
    cid = vol.meta.get_extents(vol.resolve("/small").ino)[0].chunk_id
    assert vol.meta.inline_data([cid]) and not any(list(n.list()) for n in vol.store.nodes)
    vol.unlink("/small")
    rep = gc(vol, grace=0)
    assert rep.rows_deleted == 1 and rep.objects_deleted == 0
    assert vol.meta.inline_data([cid]) == {} and vol.meta.chunk_info([cid]) == {}
    assert fsck_json(capsys, vol)[1]["problems"] == []


def test_wrong_refcount_found_and_fixed(filled, capsys):
    vol, _ = filled
    cid = first_chunk(vol)
    with vol.meta._tx() as c:
        c.execute("UPDATE chunks SET refcount = 7 WHERE id = ?", (cid,))
    rc, rep = fsck_json(capsys, vol)
    assert rc == 1 and kinds(rep) == ["refcount_mismatch"]
    rc, rep = fsck_json(capsys, vol, "--repair")
    assert rc == 0
    assert vol.meta.chunk_info([cid])[cid][2] == 1
    assert fsck_json(capsys, vol)[1]["problems"] == []


def test_wiped_node_is_rereplicated_from_survivors(filled, capsys):
    vol, data = filled
    # the node holding most replicas (a fixed one held none in 1 run of 64: 6 chunks, 2 of 4)
    lost = max(vol.store.nodes, key=lambda n: sum(1 for _ in n.list()))
    held = sum(1 for _ in lost.list())
    assert held > 0
    lost.wipe()
    lost.ensure()
    rc, rep = fsck_json(capsys, vol, "--repair")
    assert rc == 0 and kinds(rep) == ["missing_replica"] * held
    assert sum(1 for _ in lost.list()) == held
    assert fsck_json(capsys, vol)[1]["problems"] == []
    assert vol.read_file("/d/a.bin") == data


def test_scrub_rewrites_bad_replica_and_honours_rate(filled):
    vol, data = filled
    cid = first_chunk(vol)
    node = vol.store.placement(cid)[1]
    blob = bytearray(node.get(cid))
    blob[-1] ^= 0xFF
    node.plant(cid, bytes(blob))  # (a put keeps a whole object)
    rep = scrub(vol)
    assert [p.kind for p in rep.problems] == ["corrupt_replica"] and rep.problems[0].repaired
    codec.verify(node.get(cid))
    total = rep.bytes_read
    t0 = time.monotonic()
    rep = scrub(vol, rate_mbps=total / 1e6 / 0.5)  # the whole volume at 2x its size per second
    assert rep.problems == [] and time.monotonic() - t0 >= 0.4
    assert vol.read_file("/d/a.bin") == data


def test_gc_deletes_only_unreferenced_chunks_past_grace(make_volume, capsys):
    vol = make_volume(nodes=3, replicas=2, chunk_size=64 * 1024)
    keep = os.urandom(3 * 64 * 1024)
    drop = os.urandom(4 * 64 * 1024)
    vol.write_file("/keep", keep)
    vol.write_file("/drop", drop)
    drop_ids = {e.chunk_id for e in vol.meta.get_extents(vol.resolve("/drop").ino)}
    vol.unlink("/drop")
    assert gc(vol, grace=3600).rows_deleted == 0  # inside the grace period: nothing goes
    capsys.readouterr()
    assert main(["gc", vol.base_dir, "--grace", "0", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["rows_deleted"] == 4 and rep["objects_deleted"] == 8
    assert not any(n.exists(c) for n in vol.store.nodes for c in drop_ids)
    assert vol.read_file("/keep") == keep
    assert fsck_json(capsys, vol)[1]["problems"] == []


def test_gc_removes_partial_writes_a_crash_left_on_a_node(filled):
    """A put killed between its temp write and the rename leaves a temp file that no
    object names: gc removes it once past the grace period; a young one (a live put)
    stays; the objects and their file are untouched."""
    vol, data = filled
    node = vol.store.nodes[0]
    tmp = os.path.join(node.root, "tmp")
    old, young = os.path.join(tmp, "ab.1234"), os.path.join(tmp, "cd.5678")
    for p in (old, young):
        with open(p, "wb") as f:
            f.write(b"x" * 1000)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    rep = gc(vol, grace=3600)
    assert rep.tmp_files_deleted == 1 and rep.bytes_freed >= 1000
    assert not os.path.exists(old) and os.path.exists(young)
    assert rep.objects_deleted == 0
    assert vol.read_file("/d/a.bin") == data


def test_gc_spares_chunk_a_writer_just_deduplicated(make_volume):
    vol = make_volume(nodes=3, replicas=2, chunk_size=64 * 1024)
    data = os.urandom(2 * 64 * 1024)
    vol.write_file("/a", data)
    vol.unlink("/a")
    time.sleep(1.2)
    ids = vol.sink.ids([data[: 64 * 1024], data[64 * 1024 :]])
    assert vol.meta.missing_chunks(ids) == set()  # a writer dedups: timers restart
    assert gc(vol, grace=1.0).rows_deleted == 0
    vol.write_file("/b", data)  # commits against the kept chunks without storing them
    assert vol.read_file("/b") == data


def test_gc_never_deletes_a_chunk_extents_use_even_with_refcount_zero(filled):
    vol, data = filled
    cid = first_chunk(vol)
    with vol.meta._tx() as c:
        c.execute("UPDATE chunks SET refcount = 0, touched = 0 WHERE id = ?", (cid,))
    rep = gc(vol, grace=0)
    assert rep.rows_deleted == 0 and rep.objects_deleted == 0
    assert vol.read_file("/d/a.bin") == data


def test_fsck_without_verify_lists_only(filled):
    vol, _ = filled
    rep = check_volume(vol, verify=False)
    assert rep.replicas_read == 0 and rep.problems == []


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "{vol}", "--grace", "-1"],
        ["gc", "{vol}", "--grace", "soon"],
        ["scrub", "{vol}", "--rate", "0"],
    ],
)
def test_bad_options_are_rejected(filled, argv, capsys):
    vol, _ = filled
    with pytest.raises(SystemExit) as e:
        main([a.format(vol=vol.base_dir) for a in argv])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_missing_volume_is_one_line_error(tmp_path, capsys):
    for cmd in ("fsck", "scrub", "gc"):
        assert main([cmd, str(tmp_path / "nope")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("ckptfs: error: no volume") and "Traceback" not in err
