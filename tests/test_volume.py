"""The storage engine end to end in one process: put/get, dedup, replicas, corruption."""

from __future__ import annotations

import errno
import io
import os
import shutil

import numpy as np
import pytest

from chunkstore.store import ChunkUnavailable
from fusefs.client.volume import Volume, VolumeError, VolumeSettings
from metadata.engine import MetaError

MiB = 2**20


def _random(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _put_stream(vol: Volume, path: str, data: bytes, piece: int = 3 * MiB + 17) -> None:
    """Write through the stream API in odd-sized pieces (not aligned to chunks)."""
    with vol.open_write(path) as w:
        for i in range(0, len(data), piece):
            w.write(data[i : i + piece])


def _object_path(vol: Volume, node_idx: int, cid: bytes) -> str:
    h = cid.hex()
    return os.path.join(vol.store.nodes[node_idx].root, "objects", h[:2], h[2:4], h)


def test_roundtrip_sizes(volume):
    for n in (0, 1, 4 * MiB - 1, 4 * MiB, 4 * MiB + 1, 13 * MiB + 5):
        data = _random(n, n)
        _put_stream(volume, f"/f{n}", data)
        assert volume.resolve(f"/f{n}").size == n
        assert volume.read_file(f"/f{n}") == data


def test_range_reads(volume):
    data = _random(10 * MiB + 123, 1)
    _put_stream(volume, "/d/file", data)
    with volume.open_read("/d/file") as r:
        for off, size in [(0, 10), (4 * MiB - 5, 10), (7 * MiB, 3 * MiB + 200), (10 * MiB, 10**9)]:
            assert r.pread(off, size) == data[off : off + size]
        assert r.pread(len(data) + 5, 10) == b""


def test_namespace_ops(volume):
    volume.write_file("/a/b/c.bin", b"hello")
    assert [n for n, _ in volume.listdir("/a/b")] == [b"c.bin"]
    volume.rename("/a/b/c.bin", "/a/c.bin")
    assert volume.read_file("/a/c.bin") == b"hello"
    assert not volume.exists("/a/b/c.bin")
    volume.write_file("/a/d.bin", b"other")
    volume.rename("/a/d.bin", "/a/c.bin")  # replaces atomically
    assert volume.read_file("/a/c.bin") == b"other"
    volume.unlink("/a/c.bin")
    assert volume.stats()["unique_chunks"] == 0


def test_dedup_same_file_twice(volume):
    data = _random(64 * MiB, 2)
    _put_stream(volume, "/one", data)
    before = volume.stats()["stored_bytes"]
    _put_stream(volume, "/two", data)
    after = volume.stats()
    assert after["stored_bytes"] - before < 1 * MiB
    assert after["dedup_ratio"] == pytest.approx(2.0, rel=0.01)
    assert volume.read_file("/two") == data


def test_fixed_chunking_partial_change(make_volume):
    vol = make_volume(chunking="fixed", chunk_size=4 * MiB, compression="none")
    data = bytearray(_random(160 * MiB, 3))
    _put_stream(vol, "/base", bytes(data))
    before = vol.stats()["stored_bytes"]
    for block in range(0, 40, 10):  # 4 of 40 blocks = 10%
        data[block * 4 * MiB + 100] ^= 0xFF
    _put_stream(vol, "/changed", bytes(data))
    grew = vol.stats()["stored_bytes"] - before
    assert 0.09 * len(data) <= grew <= 0.11 * len(data)


def test_cdc_insert_at_start(make_volume):
    vol = make_volume(chunking="cdc", chunk_size=4 * MiB, compression="none")
    data = _random(64 * MiB, 4)
    _put_stream(vol, "/base", data)
    chunks_before = vol.stats()["unique_chunks"]
    _put_stream(vol, "/shifted", os.urandom(100) + data)
    assert vol.stats()["unique_chunks"] - chunks_before <= 3
    assert vol.read_file("/shifted")[100:] == data


def test_torch_state_dict_roundtrip(volume):
    torch = pytest.importorskip("torch")
    sd = {
        "w": torch.randn(256, 512),
        "b": torch.randn(512).to(torch.bfloat16),
        "step": torch.tensor(7),
    }
    buf = io.BytesIO()
    torch.save(sd, buf)
    _put_stream(volume, "/ckpt/model.pt", buf.getvalue())
    loaded = torch.load(io.BytesIO(volume.read_file("/ckpt/model.pt")))
    assert set(loaded) == set(sd)
    for k in sd:
        assert torch.equal(loaded[k], sd[k])


def test_lost_node_loses_no_file(make_volume):
    vol = make_volume(nodes=4, replicas=2)
    files = {f"/f{i}": _random(9 * MiB + i, 10 + i) for i in range(6)}
    for p, d in files.items():
        _put_stream(vol, p, d)
    shutil.rmtree(vol.store.nodes[1].root)
    for p, d in files.items():
        assert vol.read_file(p) == d


def test_flipped_byte_is_served_from_other_replica(make_volume):
    vol = make_volume(nodes=4, replicas=2, compression="none")
    data = _random(4 * MiB, 20)
    _put_stream(vol, "/x", data)
    (ext,) = vol.meta.get_extents(vol.resolve("/x").ino)
    first = vol.store.nodes.index(vol.store.placement(ext.chunk_id)[0])
    path = _object_path(vol, first, ext.chunk_id)
    with open(path, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    assert vol.read_file("/x") == data
    bad = vol.store.bad_replicas
    assert len(bad) == 1 and bad[0].cid == ext.chunk_id
    assert bad[0].node == vol.store.nodes[first].name


def test_corruption_with_one_replica_is_an_error(make_volume):
    vol = make_volume(nodes=2, replicas=1, compression="none")
    data = _random(2 * MiB, 21)
    _put_stream(vol, "/x", data)
    (ext,) = vol.meta.get_extents(vol.resolve("/x").ino)
    idx = vol.store.nodes.index(vol.store.placement(ext.chunk_id)[0])
    path = _object_path(vol, idx, ext.chunk_id)
    with open(path, "r+b") as f:
        f.seek(500_000)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ChunkUnavailable) as ei:
        vol.read_file("/x")
    assert ext.chunk_id.hex() in str(ei.value)


def test_truncated_object_is_an_error_not_short_data(make_volume):
    vol = make_volume(nodes=1, replicas=1, compression="zstd")
    data = b"abc" * 500_000
    _put_stream(vol, "/x", data)
    (ext,) = vol.meta.get_extents(vol.resolve("/x").ino)
    path = _object_path(vol, 0, ext.chunk_id)
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    with pytest.raises(ChunkUnavailable, match=ext.chunk_id.hex()):
        vol.read_file("/x")


@pytest.mark.parametrize("bad", ["/a\0b", "/a/../b", "/" + "x" * 256, "/..", "/a/.."])
def test_invalid_names_change_nothing(volume, bad):
    volume.write_file("/keep", b"data")
    before = volume.stats()
    with pytest.raises(MetaError) as ei:
        volume.write_file(bad, b"x")
    assert ei.value.errno in (errno.EINVAL, errno.ENAMETOOLONG)
    assert volume.stats() == before
    assert [n for n, _ in volume.listdir("/")] == [b"keep"]


def test_name_length_limit_is_255_bytes(volume):
    volume.write_file("/" + "n" * 255, b"ok")
    with pytest.raises(MetaError) as ei:
        volume.write_file("/" + "n" * 256, b"no")
    assert ei.value.errno == errno.ENAMETOOLONG


@pytest.mark.parametrize(
    "settings",
    [
        {"chunk_size": 1024},
        {"chunk_size": 128 * MiB},
        {"replicas": 5},
        {"replicas": 0},
        {"chunking": "rabin"},
        {"compression": "lz4"},
    ],
)
def test_bad_settings_create_nothing(tmp_path, settings):
    with pytest.raises(VolumeError):
        Volume.create(str(tmp_path / "v"), nodes=4, settings=VolumeSettings(**settings))
    assert not (tmp_path / "v").exists()


def test_missing_volume(tmp_path):
    with pytest.raises(VolumeError, match="no volume"):
        Volume.open(str(tmp_path / "nope"))


def test_format_twice_refuses(tmp_path):
    Volume.create(str(tmp_path / "v")).close()
    with pytest.raises(VolumeError, match="already"):
        Volume.create(str(tmp_path / "v"))


def test_failed_write_changes_nothing(volume):
    volume.write_file("/f", b"old content")
    with pytest.raises(RuntimeError):
        with volume.open_write("/f") as w:
            w.write(b"new" * 1000)
            raise RuntimeError("writer died")
    assert volume.read_file("/f") == b"old content"


def test_stats_keys(volume):
    volume.write_file("/z", bytes(8 * MiB))
    st = volume.stats()
    for k in ("logical_bytes", "stored_bytes", "unique_chunks", "dedup_ratio", "compression_ratio"):
        assert k in st
    assert st["logical_bytes"] == 8 * MiB
    assert st["unique_chunks"] == 1  # two identical zero chunks
    assert st["stored_bytes"] < 64 * 1024  # zeros compress


def test_a_store_remembers_a_bounded_number_of_bad_replicas(make_volume):
    """A long-running process (a mount) used to keep every bad replica it ever met."""
    from chunkstore.store import BAD_REPLICAS_KEPT, BadReplica

    vol = make_volume(nodes=2, replicas=1)
    for i in range(BAD_REPLICAS_KEPT + 500):
        vol.store._report(BadReplica(i.to_bytes(16, "big"), "n0", "test", False))
    assert len(vol.store.bad_replicas) == BAD_REPLICAS_KEPT
    assert vol.store.bad_replicas_seen == BAD_REPLICAS_KEPT + 500
    assert vol.store.bad_replicas[-1].cid == (BAD_REPLICAS_KEPT + 499).to_bytes(16, "big")


def test_the_mount_forgets_page_generations_with_the_inode(make_volume):
    """The kernel drops an inode's pages when it forgets the inode: so does the mount's map
    (it grew by every file ever opened)."""
    import trio

    from fusefs.mount.fs import CkptFS

    vol = make_volume(nodes=2, replicas=1)
    fs = CkptFS(vol, "/nonexistent")
    for ino in range(100, 200):
        fs.lookups[ino] = 2
        fs.page_gen[ino] = 1
    trio.run(fs.forget, [(ino, 2) for ino in range(100, 150)] + [(150, 1)])
    assert sorted(fs.page_gen) == list(range(150, 200))
    assert fs.lookups[150] == 1
    if fs.local is not None:
        fs.local.close()
