"""Metadata backups on the nodes, restore from the nodes alone, and SQLite <-> PostgreSQL.

Real subprocesses for the commands a user runs, real DCP saves, a real PostgreSQL.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from fusefs.client.volume import Volume
from fusefs.dcp import CkptfsReader, CkptfsWriter, close_volumes
from fusefs.maint import backup as bk
from fusefs.maint.fsck import check_volume
from fusefs.maint.gc import gc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def ckptfs(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env=env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"ckptfs {args} failed ({proc.returncode}): {proc.stderr}")
    return proc


def _node_urls(tmp_path) -> list[str]:
    return [f"dir:{tmp_path / 'nodes' / f'n{i}'}" for i in range(3)]


def _serves_the_same(tmp_path, new: str, files: dict[str, bytes], tag: str) -> dict:
    """The rebuilt volume serves _populate's files and its published DCP step; returns the
    loaded state for further checks."""
    for path, data in files.items():
        dest = tmp_path / (tag + path.replace("/", "_"))
        ckptfs("get", new, path, str(dest))
        assert dest.read_bytes() == data
    steps = json.loads(ckptfs("checkpoints", new, "list", "--json").stdout)
    assert [(s["job"], s["step"], s["state"]) for s in steps] == [("train", 1, "published")]
    target = {"w": torch.zeros(300_000), "b": torch.zeros(7)}
    dcp.load(target, storage_reader=CkptfsReader(new, "train/step-000001"), no_dist=True)
    close_volumes()
    assert torch.equal(target["w"], torch.arange(300_000, dtype=torch.float32))
    return target


def _copy_key(tmp_path, vol_dir: str) -> str:
    """The operator's copy of the volume's backup key, off the volume directory."""
    dest = str(tmp_path / (os.path.basename(vol_dir) + ".backup.key"))
    shutil.copy(os.path.join(vol_dir, bk.KEY_FILE), dest)
    return dest


def _populate(tmp_path, vol_dir: str, nodes: list[str]) -> dict[str, bytes]:
    """Files put with `ckptfs put` and a published single-process DCP checkpoint."""
    ckptfs("format", vol_dir, *[a for u in nodes for a in ("--node", u)])
    files = {
        "/data/big.bin": os.urandom(3 * MiB + 17),
        "/data/small.txt": b"hello backups\n",
    }
    for path, data in files.items():
        local = tmp_path / ("src" + path.replace("/", "_"))
        local.write_bytes(data)
        ckptfs("put", vol_dir, str(local), path)
    sd = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}
    dcp.save(sd, storage_writer=CkptfsWriter(vol_dir, "train/step-000001"), no_dist=True)
    close_volumes()
    return files


def test_backup_delete_volume_restore_from_nodes(tmp_path):
    """The issue's scenario: three dir: nodes outside the volume directory."""
    nodes = _node_urls(tmp_path)
    vol_dir = str(tmp_path / "vol")
    files = _populate(tmp_path, vol_dir, nodes)
    out = json.loads(ckptfs("meta", "backup", vol_dir, "--json").stdout)
    assert out["files"] >= 3 and out["checkpoints"] == 1
    key = _copy_key(tmp_path, vol_dir)

    shutil.rmtree(vol_dir)  # the volume directory, not the nodes
    listed = json.loads(ckptfs("meta", "backups", *[a for u in nodes for a in ("--node", u)],
                               "--json").stdout)  # fmt: skip
    assert [m["id"] for m in listed] == [out["id"]]

    new = str(tmp_path / "restored")
    rep = ckptfs("meta", "restore", new, *[a for u in nodes for a in ("--node", u)], "--json",
                 "--key", key)  # fmt: skip
    assert json.loads(rep.stdout)["missing_chunks"] == []
    assert json.loads(rep.stdout)["verified"]
    target = _serves_the_same(tmp_path, new, files, "out")
    assert torch.equal(target["b"], torch.ones(7))
    fsck = json.loads(ckptfs("fsck", new, "--json").stdout)
    assert fsck["problems"] == [], fsck


def test_missing_chunk_is_reported_by_restore_and_fsck(tmp_path):
    nodes = _node_urls(tmp_path)
    vol = Volume.create(str(tmp_path / "vol"), nodes=nodes)
    vol.write_file("/f.bin", os.urandom(2 * MiB))
    (ext,) = [e for e in vol.meta.chunk_rows() if e not in vol.inline_chunks([e])]
    bk.create_backup(vol)
    for n in vol.store.nodes:  # the chunk gone from every node
        try:
            n.delete(ext)
        except Exception:  # noqa: BLE001 - not placed there
            pass
    vol.close()
    key = _copy_key(tmp_path, str(tmp_path / "vol"))
    new = str(tmp_path / "new")
    proc = ckptfs("meta", "restore", new, *[a for u in nodes for a in ("--node", u)], "--json",
                  "--key", key, check=False)  # fmt: skip
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["missing_chunks"] == [ext.hex()]
    assert "1 chunk(s) the backup names are on no node" in proc.stderr
    with Volume.open(new) as v:
        kinds = {p.kind for p in check_volume(v).problems}
    assert "dangling_extent" in kinds


def test_gc_keeps_chunks_a_kept_backup_names(tmp_path):
    nodes = _node_urls(tmp_path)
    vol = Volume.create(str(tmp_path / "vol"), nodes=nodes)
    data = os.urandom(MiB)
    vol.write_file("/doomed.bin", data)
    bk.create_backup(vol)
    vol.unlink("/doomed.bin")
    rep = gc(vol, grace=0)
    assert rep.rows_deleted >= 1 and rep.objects_deleted == 0  # rows go, objects stay
    assert check_volume(vol, grace=0).problems == []  # neither orphans nor backup objects
    key = bk.read_key(os.path.join(vol.base_dir, bk.KEY_FILE))
    vol.close()
    new = str(tmp_path / "new")
    assert bk.restore(new, nodes, key=key).verified
    with Volume.open(new) as v:
        assert v.read_file("/doomed.bin") == data
    # once the backup is dropped, gc reclaims them
    with Volume.open(str(tmp_path / "vol")) as v:
        for m in bk.list_backups(v.store.nodes):
            bk.drop_backup(v.store.nodes, m)
        assert gc(v, grace=0).objects_deleted >= 1


def test_backups_keep_the_newest(tmp_path):
    vol = Volume.create(str(tmp_path / "vol"), nodes=_node_urls(tmp_path))
    vol.write_file("/x", b"x" * 100)
    ids = [bk.create_backup(vol, keep=2)["id"] for _ in range(3)]
    assert [m["id"] for m in bk.list_backups(vol.store.nodes)] == ids[1:]
    vol.close()


def test_sqlite_dump_loads_into_postgresql(tmp_path, pg_url):
    nodes = _node_urls(tmp_path)
    vol_dir = str(tmp_path / "vol")
    files = _populate(tmp_path, vol_dir, nodes)
    dump = str(tmp_path / "meta.ckd")
    ckptfs("meta", "dump", vol_dir, dump)
    new = str(tmp_path / "pg")
    ckptfs("meta", "load", dump, new, "--db", pg_url)
    _serves_the_same(tmp_path, new, files, "pg")
    # the PostgreSQL volume takes new files (identity sequences moved past the loaded keys)
    with Volume.open(new) as v:
        v.write_file("/data/after.bin", b"new")
        assert v.read_file("/data/after.bin") == b"new"
        assert check_volume(v).problems == []
    # and back: PostgreSQL -> dump -> SQLite
    back = str(tmp_path / "meta2.ckd")
    ckptfs("meta", "dump", new, back)
    ckptfs("meta", "load", back, str(tmp_path / "sq"))
    with Volume.open(str(tmp_path / "sq")) as v:
        assert v.read_file("/data/big.bin") == files["/data/big.bin"]
        assert v.read_file("/data/after.bin") == b"new"


def test_load_refuses_a_corrupt_dump_and_leaves_nothing(tmp_path):
    vol = Volume.create(str(tmp_path / "vol"), nodes=_node_urls(tmp_path))
    vol.write_file("/x", os.urandom(300_000))
    vol.close()
    dump = tmp_path / "d.ckd"
    ckptfs("meta", "dump", str(tmp_path / "vol"), str(dump))
    dump.write_bytes(dump.read_bytes()[:-20])
    proc = ckptfs("meta", "load", str(dump), str(tmp_path / "new"), check=False)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "ckptfs: error:" in proc.stderr
    assert not os.path.exists(tmp_path / "new")


def test_meta_serve_takes_automatic_backups(tmp_path):
    """A volume formatted with --backup-interval is backed up by its service with nobody
    asking, and keeps only --backup-keep of them."""
    import time

    from bench.servers.metaserve import MetaServer

    nodes = _node_urls(tmp_path)
    vol_dir = str(tmp_path / "vol")
    args = [a for u in nodes for a in ("--node", u)]
    ckptfs("format", vol_dir, *args, "--backup-interval", "1", "--backup-keep", "2")
    src = tmp_path / "src"
    src.write_bytes(os.urandom(100_000))
    ckptfs("put", vol_dir, str(src), "/f")
    srv = MetaServer(vol_dir)
    try:
        deadline = time.monotonic() + 60
        seen: list = []
        while time.monotonic() < deadline:
            seen = json.loads(ckptfs("meta", "backups", *args, "--json").stdout)
            if len(seen) >= 2:
                break
            time.sleep(0.5)
        assert len(seen) >= 2, seen
        time.sleep(3)  # more ticks: older ones dropped
        seen = json.loads(ckptfs("meta", "backups", *args, "--json").stdout)
        assert 1 <= len(seen) <= 2 and all(b["files"] >= 1 for b in seen)
    finally:
        srv.stop()


def test_an_automatic_backup_that_fails_is_retried_later_and_never_raises(tmp_path):
    nodes = _node_urls(tmp_path)
    vol_dir = str(tmp_path / "vol")
    ckptfs("format", vol_dir, *[a for u in nodes for a in ("--node", u)], "--backup-interval", "60")
    with Volume.open(vol_dir) as vol:
        auto = bk.AutoBackup(vol)
        first = auto.tick()
        assert first is not None and auto.taken == 1  # none on the nodes: one is due
        assert auto.tick() is None  # the clock says not yet (no node listing)
        real = vol.store.put_encoded

        def broken(*a, **kw):
            raise OSError(28, "No space left on device")

        vol.store.put_encoded = broken
        assert auto.tick(now=time.time() + 61) is None  # failed: logged, not raised
        vol.store.put_encoded = real
        assert auto.tick(now=time.time() + 120) is None  # retried only after AUTO_RETRY_S
        assert auto.tick(now=time.time() + bk.AUTO_RETRY_S + 1) is not None
        assert auto.taken == 2


def test_bench_backup_reports_commit_during_backup(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(
        [sys.executable, "-m", "bench.backup", "--files", "200", "--ranks", "32", "--rounds", "1"],
        capture_output=True, text=True, env=env, cwd=root, timeout=300, check=True,
    )  # fmt: skip
    out = json.loads(p.stdout)
    for key in ("backup_s", "restore_s", "backup_peak_rss_mib", "restore_peak_rss_mib",
                "backup_bytes_per_extent"):  # fmt: skip
        assert key in out
    assert out["commit_during_backup_vs_alone"] > 0
    (r,) = out["commit_rounds"]
    assert r["backup_running_at_commit"] and r["state"] == r["alone_state"] == "published"


# -- issue 40 (B): nothing planted on a node stops backups, listings or gc --------------
def _plant_object(node_url: str, cid: bytes, body: bytes, *, encode: bool = True) -> None:
    from chunkstore import codec
    from chunkstore.nodes import open_node, parse_node_url

    node = open_node(parse_node_url(node_url, name="n1"))
    node.put(cid, codec.encode(body, "none") if encode else body)
    node.close()


def _planted_manifest(number: int) -> bytes:
    return json.dumps({"format": 1, "id": number, "created": time.time(), "volume": None,
                       "pieces": [{"len": 10, "xxh128": "0" * 32}], "size": 10, "files": 1,
                       "checkpoints": 0, "nodes": []}).encode()  # fmt: skip


def test_a_planted_huge_backup_id_stops_neither_backups_nor_gc(tmp_path):
    nodes = _node_urls(tmp_path)
    args = [a for u in nodes for a in ("--node", u)]
    vol_dir = str(tmp_path / "vol")
    ckptfs("format", vol_dir, *args)
    src = tmp_path / "src"
    src.write_bytes(os.urandom(MiB))
    ckptfs("put", vol_dir, str(src), "/doomed")
    # only on n1: a manifest numbered 0xFFFFFFFF whose piece is on no node
    planted = bk.backup_id(0xFFFFFFFF, bk.MANIFEST_PIECE)
    _plant_object(nodes[1], planted, _planted_manifest(0xFFFFFFFF))

    out = ckptfs("meta", "backup", vol_dir, "--json")  # was: struct.error
    m = json.loads(out.stdout)
    assert abs(m["id"] - time.time()) < 60
    listed = ckptfs("meta", "backups", *args)
    assert planted.hex() in listed.stdout and "piece 0 is on no node" in listed.stdout
    assert planted.hex() in listed.stderr
    js = json.loads(ckptfs("meta", "backups", *args, "--json").stdout)
    assert [b["id"] for b in js] == [m["id"]]

    ckptfs("rm", vol_dir, "/doomed")
    proc = ckptfs("gc", vol_dir, "--grace", "0", "--json", check=False)  # was: exit 1
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["rows_deleted"] >= 1 and rep["errors"] == []
    assert [p["object"] for p in rep["bad_backups"]] == [planted.hex()]
    ckptfs("meta", "backup", vol_dir, "--keep", "1")  # drops the one naming /doomed
    rep = json.loads(ckptfs("gc", vol_dir, "--grace", "0", "--json").stdout)
    assert rep["objects_deleted"] >= 1
    # the automatic backups of a daemon go on too
    with Volume.open(vol_dir) as vol:
        assert bk.AutoBackup(vol, interval=1).step(now=time.time() + 10) is not None


def test_ill_formed_backup_objects_are_named_and_skipped(tmp_path):
    nodes = _node_urls(tmp_path)
    vol = Volume.create(str(tmp_path / "vol"), nodes=nodes)
    vol.write_file("/x", b"x" * 100)
    good = bk.create_backup(vol)
    n = good["id"]
    bad = {
        bk.backup_id(n + 1, bk.MANIFEST_PIECE): (b"\x00not an object", False),
        bk.backup_id(n + 2, bk.MANIFEST_PIECE): (b"[1, 2]", True),
        bk.backup_id(n + 3, bk.MANIFEST_PIECE): (b"{", True),
        bk.backup_id(n + 4, bk.MANIFEST_PIECE): (
            json.dumps({**good, "id": n + 4, "pieces": [{"len": "x"}]}).encode(), True),
        bk.backup_id(n + 5, bk.MANIFEST_PIECE): (
            json.dumps({**good, "id": n + 5, "files": "many"}).encode(), True),
        bk.backup_id(n + 6, bk.MANIFEST_PIECE): (
            json.dumps({**good, "id": n + 6, "pieces": good["pieces"] * 4}).encode(), True),
    }  # fmt: skip
    for cid, (body, enc) in bad.items():
        _plant_object(nodes[1], cid, body, encode=enc)
    scan = bk.scan_backups(vol.store.nodes)
    assert [m["id"] for m in scan.backups] == [n]
    assert sorted(p["object"] for p in scan.problems) == sorted(c.hex() for c in bad)
    assert bk.last_scan_problems == len(bad)
    # gc reads around them, and the next backup takes a number none of them uses
    assert gc(vol, grace=0).errors == []
    assert bk.create_backup(vol)["id"] not in {n + i for i in range(7)}
    # the daemons' metric
    from fusefs.metrics import MountCollector

    (fam,) = [f for f in MountCollector().collect() if f.name == "ckptfs_backup_bad_objects"]
    assert fam.samples[0].value == len(bad)
    vol.close()


def test_new_backup_numbers_follow_the_clock_not_a_node(tmp_path):
    scan = bk.Scan(backups=[{"id": 0xFFFFFFFE}, {"id": 1000}], numbers={0xFFFFFFFE, 1000, 2000})
    assert bk.new_number(scan, now=2000) == 2001  # taken numbers skipped, far claims ignored
    assert bk.new_number(bk.Scan(backups=[{"id": 2005}]), now=2000) == 2006  # near: followed


# -- issue 40 (C): authenticated backups ------------------------------------------------
def test_a_forged_backup_does_not_verify_and_restore_refuses_it(tmp_path):
    """A backup planted on one node (a well-formed manifest and dump of the attacker's)
    is listed as not verifying, skipped by a keyed restore, and refused when named."""
    from tests.test_dump import _plant, _raw_records

    nodes = _node_urls(tmp_path)
    args = [a for u in nodes for a in ("--node", u)]
    vol_dir = str(tmp_path / "vol")
    ckptfs("format", vol_dir, *args)
    src = tmp_path / "src"
    src.write_bytes(b"the real file\n")
    ckptfs("put", vol_dir, str(src), "/f")
    made = ckptfs("meta", "backup-key", vol_dir).stdout
    assert "backup key" in made and "copy it off" in made
    key_file = tmp_path / "offhost.key"  # the operator's copy
    shutil.copy(os.path.join(vol_dir, bk.KEY_FILE), key_file)
    assert oct(os.stat(os.path.join(vol_dir, bk.KEY_FILE)).st_mode & 0o777) == "0o600"
    real = json.loads(ckptfs("meta", "backup", vol_dir, "--json").stdout)
    assert real["mac"] and real["key_id"]
    # the forgery: a dump of the attacker's choosing (here the real one) under a newer
    # number, with a manifest copied from the real one, its MAC and key id included
    with Volume.open(vol_dir) as vol:
        records = _raw_records(bk.backup_stream(vol.store.nodes, real).read())
    forged_id = real["id"] + 1000
    _plant(nodes[1], "n1", real, records, forged_id)
    shutil.rmtree(vol_dir)

    listed = ckptfs("meta", "backups", *args, "--key", str(key_file)).stdout
    rows = {line.split()[0]: line for line in listed.splitlines()[1:] if line.strip()}
    assert " yes " in rows[str(real["id"])] and " NO " in rows[str(forged_id)]
    proc = ckptfs("meta", "restore", str(tmp_path / "x"), *args, "--key", str(key_file),
                  "--backup", str(forged_id), check=False)  # fmt: skip
    assert proc.returncode == 1 and f"backup {forged_id} does not verify" in proc.stderr
    assert proc.stderr.count("\n") == 1
    new = str(tmp_path / "new")
    rep = json.loads(ckptfs("meta", "restore", new, *args, "--key", str(key_file), "--json").stdout)
    assert rep["backup"] == real["id"] and rep["verified"]
    with Volume.open(new) as v:
        assert v.read_file("/f") == b"the real file\n"
    # another volume's key verifies nothing
    other = tmp_path / "other.key"
    other.write_text(os.urandom(32).hex() + "\n")
    proc = ckptfs("meta", "restore", str(tmp_path / "y"), *args, "--key", str(other), check=False)
    assert proc.returncode == 1 and "no backup on these nodes verifies" in proc.stderr


def test_the_key_is_never_in_the_backup(tmp_path):
    vol = Volume.create(str(tmp_path / "vol"), nodes=_node_urls(tmp_path))
    vol.write_file("/x", b"x")
    m = bk.create_backup(vol)  # a SQLite volume makes its key at its first backup
    key = bk.read_key(os.path.join(vol.base_dir, bk.KEY_FILE))
    assert bk.verify(m, key)
    dump = bk.backup_stream(vol.store.nodes, m).read()
    import zstandard

    raw = zstandard.ZstdDecompressor().stream_reader(dump).read()
    assert key.hex().encode() not in raw and key not in raw
    tampered = {**m, "files": m["files"] + 1}
    assert not bk.verify(tampered, key)
    vol.close()


def test_restore_without_a_key_needs_no_verify_and_prefers_replicated_backups(tmp_path):
    """The library refuses a keyless restore unless told (no_verify); unverified, it takes
    the newest backup with as many identical copies as the backups show (R), so a newer
    one planted on one node does not win; a keyed restore puts the key in the new volume."""
    from tests.test_dump import _plant, _raw_records

    nodes = _node_urls(tmp_path)
    vol = Volume.create(str(tmp_path / "vol"), nodes=nodes)  # R=2 of 3 nodes
    vol.write_file("/f", b"real")
    real = bk.create_backup(vol)
    records = _raw_records(bk.backup_stream(vol.store.nodes, real).read())
    key = bk.read_key(os.path.join(vol.base_dir, bk.KEY_FILE))
    vol.close()
    _plant(nodes[1], "n1", {**real, "replicas": 1}, records, real["id"] + 1000)

    new = str(tmp_path / "new")
    try:
        bk.restore(new, nodes)
        raise AssertionError("a keyless restore without no_verify went ahead")
    except bk.BackupError as e:
        assert "no_verify" in str(e)
    assert not os.path.exists(new)
    rep = bk.restore(new, nodes, no_verify=True)
    assert rep.backup == real["id"] and not rep.verified
    assert not os.path.exists(os.path.join(new, bk.KEY_FILE))
    # named, the planted one is what --no-verify restores: the operator asked for it
    assert bk.restore(str(tmp_path / "named"), nodes, backup=real["id"] + 1000,
                      no_verify=True).backup == real["id"] + 1000  # fmt: skip

    keyed = str(tmp_path / "keyed")
    assert bk.restore(keyed, nodes, key=key).verified
    assert bk.read_key(os.path.join(keyed, bk.KEY_FILE)) == key
    assert oct(os.stat(os.path.join(keyed, bk.KEY_FILE)).st_mode & 0o777) == "0o600"
    with Volume.open(keyed) as v:  # it signs its next backups with the same key
        assert bk.verify(bk.create_backup(v), key)
    # a directory holding another key is not restored into
    other = tmp_path / "other"
    other.mkdir()
    (other / bk.KEY_FILE).write_text(os.urandom(32).hex() + "\n")
    try:
        bk.restore(str(other), nodes, key=key)
        raise AssertionError("restored beside another volume's key")
    except bk.BackupError as e:
        assert "another backup key" in str(e)
    assert sorted(os.listdir(other)) == [bk.KEY_FILE]
