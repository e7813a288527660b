"""The write-behind tier for real: separate processes, kill -9, throttled nodes, shared cache."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import chunkstore.cache
from bench.throttle import read_counts, throttle_volume
from chunkstore import codec
from chunkstore.tier.journal import (
    INLINE_MAX,
    KIND_DONE,
    KIND_PENDING,
    REC_SIZE,
    SEGMENT_SUFFIX,
    GroupSync,
    pack_inline,
    pack_record,
    parse_segment,
    read_segment,
)
from fusefs.cli.main import main as cli_main
from fusefs.client.volume import FileWriter, Volume, VolumeSettings

MiB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _wait(pred, timeout: float, what: str, step: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _check_journals(staging: str) -> int:
    """Every pending record names a whole, verified staged file; returns pending count."""
    pending = 0
    jdir = os.path.join(staging, "journal")
    for name in os.listdir(jdir):
        if not name.endswith(SEGMENT_SUFFIX):
            continue
        st = read_segment(os.path.join(jdir, name))
        for cid, (size, _t) in st.pending.items():
            path = os.path.join(staging, "staged", cid.hex())
            assert os.path.exists(path), f"journal {name} names missing {cid.hex()}"
            with open(path, "rb") as f:
                blob = f.read()
            assert len(blob) == size
            codec.verify(blob)
            pending += 1
    return pending


@pytest.fixture
def vol_path(tmp_path):
    path = str(tmp_path / "vol")
    Volume.create(path, nodes=4, settings=VolumeSettings(chunk_size=1 * MiB, replicas=2)).close()
    return path


def _open(path: str, staging: str, rate: float | None = None, **kw) -> Volume:
    vol = Volume.open(path)
    throttle_volume(vol, rate)
    vol.attach_tier(staging, **kw)
    return vol


# -- journal mechanics -----------------------------------------------------------------------


def test_journal_torn_tail_and_corrupt_record_are_ignored():
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    recs = pack_record(KIND_PENDING, a, 10, 1) + pack_record(KIND_PENDING, b, 20, 2)
    recs += pack_record(KIND_DONE, a, 0, 3)
    st = parse_segment(recs)
    assert st.pending == {b: (20, 2)} and set(st.done) == {a} and not st.torn
    torn = parse_segment(recs + pack_record(KIND_PENDING, c, 5, 4)[: REC_SIZE - 3])
    assert torn.torn and torn.pending == {b: (20, 2)}
    bad = bytearray(recs + pack_record(KIND_PENDING, c, 5, 4))
    bad[-10] ^= 0xFF  # a flipped bit in the last record: checksum fails, record ignored
    st2 = parse_segment(bytes(bad))
    assert st2.torn and c not in st2.pending


def test_a_damaged_record_in_the_middle_keeps_the_records_after_it():
    """A damaged run used to end the replay: every record after it was lost, and the chunks
    they named were never uploaded nor cleaned."""
    a, b, c, d = (bytes([i]) * 16 for i in (1, 2, 3, 4))
    small = os.urandom(3000)
    recs = [
        pack_record(KIND_PENDING, a, 10, 1),
        pack_record(KIND_PENDING, b, 20, 2),
        pack_inline(c, small, 3),
        pack_record(KIND_DONE, a, 0, 4),
        pack_record(KIND_PENDING, d, 40, 5),
    ]
    data = bytearray(b"".join(recs))
    data[len(recs[0]) + 5] ^= 0x40  # inside b's record
    st = parse_segment(bytes(data))
    assert st.corrupt == 1 and st.skipped == len(recs[1]) and not st.torn
    assert st.pending == {c: (3000, 3), d: (40, 5)} and st.inline == {c: small}
    assert set(st.done) == {a} and st.records == 4
    data[-len(recs[-1]) - 3] ^= 0x01  # and the CRC of a's D record: two runs, a comes back
    st = parse_segment(bytes(data))
    assert st.corrupt == 2 and a in st.pending and d in st.pending


def test_journal_inline_records_carry_their_bytes_checksummed():
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    small = os.urandom(5000)
    recs = pack_record(KIND_PENDING, a, 10, 1) + pack_inline(b, small, 2)
    st = parse_segment(recs + pack_record(KIND_PENDING, c, 7, 3))
    assert st.pending == {a: (10, 1), b: (5000, 2), c: (7, 3)} and not st.torn
    assert st.inline == {b: small}
    done = parse_segment(recs + pack_record(KIND_DONE, b, 0, 4))
    assert done.pending == {a: (10, 1)} and done.inline == {} and b in done.done
    torn = parse_segment(recs[:-100])  # cut inside the payload
    assert torn.torn and torn.pending == {a: (10, 1)} and torn.inline == {}
    bad = bytearray(recs)
    bad[REC_SIZE + 40 + 1000] ^= 0x01  # one flipped payload bit: the record is not trusted
    flipped = parse_segment(bytes(bad))
    assert flipped.torn and b not in flipped.pending
    huge = bytearray(pack_inline(c, b"x", 5))
    huge[20:28] = (INLINE_MAX + 1).to_bytes(8, "little")  # a size no I record can have
    assert parse_segment(bytes(huge)).torn


def test_read_object_into_small_objects_in_one_read(tmp_path, monkeypatch):
    """A chunk that fits one verify window is read with one preadv (header, payload, a byte
    past the end): the same answers as the general path for a good, foreign, compressed,
    torn or overlong object, and a short read falls back to the general path."""
    from chunkstore import cache as cache_mod
    from chunkstore.cache import read_object_into
    from chunkstore.ids import chunk_id

    raw = os.urandom(65536)
    cid = chunk_id(raw, 7)
    path = str(tmp_path / "obj")
    good = codec.encode(raw, "none")
    calls = []
    real_preadv = os.preadv

    def counting_preadv(fd, bufs, off, flags=0):
        calls.append(len(bufs))
        return real_preadv(fd, bufs, off, flags)

    monkeypatch.setattr(cache_mod.os, "preadv", counting_preadv)
    with open(path, "wb") as f:
        f.write(good)
    buf = bytearray(len(raw))
    assert read_object_into(path, [memoryview(buf)], cid, 7) and buf == raw
    assert calls == [3]  # header, payload and the byte past the end, together
    with pytest.raises(codec.ChunkFormatError, match="chunk id"):
        read_object_into(path, [memoryview(bytearray(len(raw)))], chunk_id(raw, 8), 7)
    assert not read_object_into(path, [memoryview(bytearray(len(raw) - 1))], cid, 7)
    for content in (good + b"x", good[:-1]):  # overlong, torn
        with open(path, "wb") as f:
            f.write(content)
        assert not read_object_into(path, [memoryview(bytearray(len(raw)))], cid, 7)
    zeros = bytes(len(raw))
    with open(path, "wb") as f:
        f.write(codec.encode(zeros, "zstd"))  # compressed: the decoding read's job
    assert not read_object_into(path, [memoryview(bytearray(len(raw)))], chunk_id(zeros, 7), 7)
    with open(path, "wb") as f:
        f.write(good)

    def short_preadv(fd, bufs, off, flags=0):  # a filesystem returning a few bytes at a time
        return real_preadv(fd, [memoryview(bufs[0])[:7]], off, flags)

    monkeypatch.setattr(cache_mod.os, "preadv", short_preadv)
    out = bytearray(len(raw))
    assert read_object_into(path, [memoryview(out)], cid, 7) and out == raw


def test_memory_only_reads_take_nothing_from_the_disk(tmp_path, monkeypatch):
    """read_object_into(nowait=True), the batch reader's probe: an object in the page
    cache is read and checked as by the blocking read; one the kernel would have to wait
    for raises BlockingIOError, whole or in part; a torn one is never read as whole. (The
    kernel's refusals are simulated: a refused RWF_NOWAIT read starts the read-ahead, which
    on a fast disk may finish before the check, so a real evicted page is not a sure one.)"""
    from bench.common import evict
    from chunkstore import cache as cache_mod
    from chunkstore.cache import read_object_into
    from chunkstore.ids import chunk_id

    real_preadv = os.preadv
    cold: dict[str, int] = {}  # what the fake kernel holds of each cold file: bytes from 0

    def kernel(fd, bufs, off, flags=0):
        held = cold.get(os.readlink(f"/proc/self/fd/{fd}"))
        if held is None or not flags & os.RWF_NOWAIT:
            return real_preadv(fd, bufs, off, flags)
        if off >= held:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        cut, left = [], held - off
        for b in bufs:  # a short read: what is held
            v = memoryview(b).cast("B")
            cut.append(v[: max(0, min(v.nbytes, left))])
            left -= cut[-1].nbytes
        return real_preadv(fd, [c for c in cut if c.nbytes], off, flags)

    monkeypatch.setattr(cache_mod.os, "preadv", kernel)
    for size in (65536, 300_000):  # the one-read path and the general path
        raw = os.urandom(size)
        cid = chunk_id(raw, 7)
        path = str(tmp_path / f"obj{size}")
        with open(path, "wb") as f:
            f.write(codec.encode(raw, "none"))
        out = bytearray(size)
        assert read_object_into(path, [memoryview(out)], cid, 7, nowait=True) and out == raw
        with pytest.raises(codec.ChunkFormatError, match="chunk id"):
            read_object_into(path, [memoryview(out)], chunk_id(raw, 8), 7, nowait=True)
        for held in (0, 4096, size // 2):  # nothing, the header, half the payload
            cold[path] = held
            with pytest.raises(BlockingIOError):
                read_object_into(path, [memoryview(bytearray(size))], cid, 7, nowait=True)
            out = bytearray(size)
            assert read_object_into(path, [memoryview(out)], cid, 7) and out == raw  # blocking
        del cold[path]
        with open(path, "r+b") as f:
            f.truncate(codec.HEADER + size - 1)  # torn: never True
        try:
            torn = read_object_into(path, [memoryview(out)], cid, 7, nowait=True)
        except BlockingIOError:  # the one-read path cannot tell torn from not in memory
            torn = size > 65536
        assert torn is False
        assert not read_object_into(path, [memoryview(bytearray(size))], cid, 7)
        assert not read_object_into(str(tmp_path / "missing"), [memoryview(out)], cid, 7,
                                    nowait=True)  # fmt: skip
    monkeypatch.setattr(cache_mod.os, "preadv", real_preadv)
    path = str(tmp_path / "real")  # the real kernel, evicted: refused, or whole and checked
    raw = os.urandom(300_000)
    with open(path, "wb") as f:
        f.write(codec.encode(raw, "none"))
    evict(path)
    out = bytearray(len(raw))
    try:
        assert read_object_into(path, [memoryview(out)], chunk_id(raw, 7), 7, nowait=True)
        assert out == raw
    except BlockingIOError:
        pass


def test_read_object_into_fills_views_only_from_a_good_raw_copy(tmp_path, monkeypatch):
    """The direct read used by DCP loads: the payload lands in the caller's views and is
    checked against the id; compressed, torn, foreign or missing objects are refused (False),
    so the caller takes the decoding read instead; content that does not match its id is a
    format error."""
    from chunkstore import cache as cache_mod
    from chunkstore.cache import VERIFY_WINDOW, read_object_into
    from chunkstore.ids import chunk_id

    raw = os.urandom(300_000)
    cid = chunk_id(raw, 7)
    path = str(tmp_path / "obj")
    with open(path, "wb") as f:
        f.write(codec.encode(raw, "none"))
    a, b = bytearray(1000), bytearray(len(raw) - 1000)
    assert read_object_into(path, [memoryview(a), memoryview(b)], cid, 7)
    assert bytes(a + b) == raw
    buf = bytearray(len(raw))
    with pytest.raises(codec.ChunkFormatError, match="chunk id"):  # another id
        read_object_into(path, [memoryview(buf)], chunk_id(raw, 8), 7)
    assert not read_object_into(path, [memoryview(bytearray(10))], cid, 7)  # other length
    assert not read_object_into(str(tmp_path / "none"), [memoryview(buf)], cid, 7)
    with open(path, "wb") as f:
        f.write(codec.encode(raw, "none")[:-1])  # torn
    assert not read_object_into(path, [memoryview(buf)], cid, 7)
    with open(path, "wb") as f:
        f.write(codec.encode(bytes(len(raw)), "zstd"))  # compressed
    assert not read_object_into(path, [memoryview(buf)], chunk_id(bytes(len(raw)), 7), 7)
    # bigger than the read-and-hash window (VERIFY_WINDOW), views cut across windows; a
    # flipped byte in the last window is caught as well as one in the first
    big = os.urandom(3 * VERIFY_WINDOW + 12345)
    with open(path, "wb") as f:
        f.write(codec.encode(big, "none"))
    parts = [
        bytearray(5),
        bytearray(0),
        bytearray(VERIFY_WINDOW + 7),
        bytearray(len(big) - VERIFY_WINDOW - 12),
    ]
    assert read_object_into(path, [memoryview(p) for p in parts], chunk_id(big, 7), 7)
    assert b"".join(parts) == big
    # short reads (a regular file rarely gives them, a network filesystem may): every byte
    # still lands in place and is hashed once
    real_preadv, rng = os.preadv, random.Random(5)

    def short_preadv(fd, bufs, off, flags=0):
        (buf,) = bufs
        return real_preadv(fd, [buf[: rng.randint(1, len(buf))]], off, flags)

    monkeypatch.setattr(cache_mod.os, "preadv", short_preadv)
    out = bytearray(len(big))
    assert read_object_into(path, [memoryview(out)], chunk_id(big, 7), 7)
    assert out == big
    monkeypatch.setattr(cache_mod.os, "preadv", real_preadv)
    for at in (0, len(big) - 1):
        bad = bytearray(big)
        bad[at] ^= 1
        with open(path, "wb") as f:
            f.write(codec.encode(bytes(bad), "none"))
        with pytest.raises(codec.ChunkFormatError, match="chunk id"):
            read_object_into(path, [memoryview(bytearray(len(big)))], chunk_id(big, 7), 7)


def test_group_sync_shares_fsyncs():
    calls = []

    def slow_sync():
        calls.append(1)
        time.sleep(0.02)

    g = GroupSync(slow_sync)
    threads = [threading.Thread(target=g.sync) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1 <= len(calls) < 32  # one fsync acknowledged many writers


# -- durability=local vs throttled nodes, checkpoints ---------------------------------------


def _save_rank(vol: Volume, job: str, step: int, rank: int, data: bytes) -> None:
    w = FileWriter(vol, 0)
    w.write(data)
    w.close(commit=False)
    vol.meta.commit_rank(
        job,
        step,
        rank,
        [
            {
                "path": f"rank-{rank}.distcp",
                "size": w.size,
                "extents": w.extents,
                "new_chunks": list(w.new_chunks.values()),
            }
        ],
    )


def test_local_save_at_local_speed_latest_durable_lags(vol_path, tmp_path):
    rate = 6e6  # bytes/s for all nodes together
    vol = _open(vol_path, str(tmp_path / "staging"), rate=rate, size=256 * MiB)
    try:
        blobs = [_data(8 * MiB, r) for r in range(2)]
        vol.meta.begin("job", 1, 2)
        t0 = time.perf_counter()
        for r, d in enumerate(blobs):
            _save_rank(vol, "job", 1, r, d)
        save_s = time.perf_counter() - t0
        upload_s = sum(map(len, blobs)) * 2 / rate  # R = 2 replicas through the cap
        assert save_s < upload_s / 3, (save_s, upload_s)
        assert vol.meta.latest("job") == 1
        assert vol.meta.latest_durable("job") is None
        assert vol.stats()["staged_chunks"] > 0
        assert _check_journals(vol.tier.root) > 0
        seen = []
        vol.tier.flush(lambda done, total: seen.append((done, total)), timeout=60)
        assert seen[-1][0] == seen[-1][1] > 0
        assert vol.meta.latest_durable("job") == 1
        assert vol.stats()["staged_chunks"] == 0
    finally:
        vol.close()
    with Volume.open(vol_path) as plain:  # no tier: straight from the object nodes
        for r, d in enumerate(blobs):
            assert plain.read_file(f"job/step-000001/rank-{r}.distcp") == d


def test_remote_durability_is_durable_on_return(vol_path, tmp_path):
    vol = _open(vol_path, str(tmp_path / "staging"), durability="remote", size=64 * MiB)
    try:
        data = _data(5 * MiB, 7)
        vol.write_file("/r", data)
        assert vol.stats()["staged_chunks"] == 0
        assert os.listdir(os.path.join(vol.tier.root, "staged")) == []
        assert vol.read_file("/r") == data  # served from the host cache
    finally:
        vol.close()


# -- crash: kill -9 mid-upload ---------------------------------------------------------------

WRITER = r"""
import sys, time, numpy as np
from fusefs.client.volume import Volume
from bench.throttle import throttle_volume
vol = Volume.open(sys.argv[1])
throttle_volume(vol, float(sys.argv[3]))
vol.attach_tier(sys.argv[2], size=512 * 2**20)
for i in range(3):
    vol.write_file(f"/f{i}", np.random.default_rng(i).integers(0, 256, 6 * 2**20 + i * 12345,
                                                         dtype=np.uint8).tobytes())
print("SAVED", flush=True)
time.sleep(600)
"""


def test_kill9_mid_upload_then_recovery_uploads_everything(vol_path, tmp_path):
    staging = str(tmp_path / "staging")
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, vol_path, staging, "3e6"],
        stdout=subprocess.PIPE,
        env=_env(),
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "SAVED"
        nodes_dir = vol_path + ".nodes"  # format's default nodes, beside the volume

        def some_uploaded():
            return any(
                files for n in os.listdir(nodes_dir) for _, _, files in os.walk(f"{nodes_dir}/{n}")
            )

        _wait(some_uploaded, 30, "the first uploads")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    datas = [_data(6 * MiB + i * 12345, i) for i in range(3)]
    pending = _check_journals(staging)
    assert pending > 0, "the kill should have caught chunks not yet uploaded"
    for name in os.listdir(os.path.join(staging, "staged")):  # no half-written file in staged/
        with open(os.path.join(staging, "staged", name), "rb") as f:
            codec.verify(f.read())
    with Volume.open(vol_path) as vol:
        assert vol.stats()["staged_chunks"] > 0
        tier = vol.attach_tier(staging)
        assert tier.stats()["pending_chunks"] == pending  # the orphaned journal was adopted
        tier.flush(timeout=60)
        assert vol.stats()["staged_chunks"] == 0
        assert tier.stats()["lost_chunks"] == 0
    journal = os.listdir(os.path.join(staging, "journal"))
    assert [n for n in journal if n.endswith(SEGMENT_SUFFIX)] == []
    with Volume.open(vol_path) as plain:
        for i, d in enumerate(datas):
            assert plain.read_file(f"/f{i}") == d
            for e in plain.meta.get_extents(plain.resolve(f"/f{i}").ino):
                if plain.meta.inline_data([e.chunk_id]):
                    continue  # a small tail: its bytes are in the metadata
                assert sum(n.exists(e.chunk_id) for n in plain.store.nodes) >= 2


# -- back-pressure ----------------------------------------------------------------------------


def test_staging_full_writers_block_and_resume(vol_path, tmp_path):
    budget = 6 * MiB
    vol = _open(vol_path, str(tmp_path / "staging"), rate=40e6, size=budget, keep_cache=False)
    staged_dir = os.path.join(vol.tier.root, "staged")
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.wait(0.01):
            total = 0
            for n in os.listdir(staged_dir):
                try:
                    total += os.path.getsize(os.path.join(staged_dir, n))
                except FileNotFoundError:
                    pass
            peak[0] = max(peak[0], total)

    datas = {f"/w{i}": _data(12 * MiB, 100 + i) for i in range(2)}
    errors: list[BaseException] = []

    def writer(path: str, data: bytes) -> None:
        try:
            vol.write_file(path, data)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    mon = threading.Thread(target=watch)
    mon.start()
    try:
        ts = [threading.Thread(target=writer, args=kv) for kv in datas.items()]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errors, errors
        assert vol.tier.stats()["writer_waits"] > 0
        vol.tier.flush(timeout=60)
        # chunks uploaded before their file was committed were marked once it was
        assert vol.stats()["staged_chunks"] == 0
    finally:
        stop.set()
        mon.join()
        vol.close()
    assert peak[0] <= budget + MiB + 1024, peak[0]  # header overhead per object
    with Volume.open(vol_path) as plain:
        for p, d in datas.items():
            assert plain.read_file(p) == d


def test_enospc_only_when_nothing_can_drain(vol_path, tmp_path, caplog):
    vol = Volume.open(vol_path)
    link = throttle_volume(vol)
    vol.attach_tier(str(tmp_path / "staging"), size=3 * MiB, stall_timeout=1.0)
    try:
        link.down = True
        with pytest.raises(OSError) as ei:
            vol.write_file("/x", _data(6 * MiB, 3))
        assert ei.value.errno == errno.ENOSPC
        assert "nothing drained" in caplog.text
        link.down = False  # nodes back: what was staged drains, a new save succeeds
        vol.tier.flush(timeout=60)
        data = _data(6 * MiB, 4)
        vol.write_file("/y", data)
        vol.tier.flush(timeout=60)
        assert vol.read_file("/y") == data
    finally:
        vol.close()


def test_housekeeping_reports_a_full_disk_once_and_recovers(vol_path, tmp_path, caplog):
    """A failing status write (the disk full) is one error line, not a traceback every
    pass; saves keep working; a later good pass says so."""
    vol = _open(vol_path, str(tmp_path / "staging"))
    tier = vol.tier
    real = tier._write_status
    calls = {"n": 0}

    def full() -> None:
        calls["n"] += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        with caplog.at_level("INFO", logger="ckptfs"):
            tier._write_status = full
            _wait(lambda: calls["n"] >= 3, 30, "three failing housekeeping passes")
            data = _data(3 * MiB, 7)
            vol.write_file("/during", data)
            tier._write_status = real
            _wait(lambda: "works again" in caplog.text, 30, "the recovery line")
        failing = [r for r in caplog.records if "housekeeping" in r.getMessage()]
        assert [r.levelname for r in failing] == ["ERROR", "INFO"], failing
        assert "No space left" in failing[0].getMessage()
        assert "Traceback" not in caplog.text and not any(r.exc_info for r in failing)
        tier.flush(timeout=60)
        assert vol.read_file("/during") == data
    finally:
        tier._write_status = real
        vol.close()


# -- read cache + cross-process single flight -----------------------------------------------

READER = r"""
import hashlib, os, sys, time
from fusefs.client.volume import Volume
from bench.throttle import throttle_volume
vol = Volume.open(sys.argv[1])
throttle_volume(vol, 200e6, count_file=sys.argv[3])
vol.attach_tier(sys.argv[2], size=256 * 2**20)
print("READY", flush=True)
while not os.path.exists(sys.argv[4]):
    time.sleep(0.005)
print(hashlib.sha256(vol.read_file("/cold")).hexdigest(), flush=True)
vol.close()
"""


def test_eight_processes_fetch_each_chunk_once(vol_path, tmp_path):
    data = _data(12 * MiB + 5, 42)
    with Volume.open(vol_path) as vol:  # written straight to the nodes: cold for the host
        vol.write_file("/cold", data, inline=False)
        n_chunks = len({e.chunk_id for e in vol.meta.get_extents(vol.resolve("/cold").ino)})
    staging, counts, go = (str(tmp_path / n) for n in ("staging", "gets.log", "go"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READER, vol_path, staging, counts, go],
            stdout=subprocess.PIPE,
            env=_env(),
            text=True,
        )
        for _ in range(8)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READY"
        open(go, "w").close()
        digests = [p.stdout.readline().strip() for p in procs]
        for p in procs:
            assert p.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert set(digests) == {hashlib.sha256(data).hexdigest()}
    got = read_counts(counts)
    assert len(got) == n_chunks and set(got.values()) == {1}, got


# -- visibility -------------------------------------------------------------------------------


def test_status_and_flush_commands(vol_path, tmp_path, capsys):
    staging = str(tmp_path / "staging")
    vol = Volume.open(vol_path)
    link = throttle_volume(vol)
    vol.attach_tier(staging, size=64 * MiB)
    link.down = True  # nothing drains while we look
    vol.write_file("/s", _data(3 * MiB, 9))
    time.sleep(1.2)  # let the status file catch up
    try:
        assert cli_main(["status", vol_path, "--staging", staging, "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["pending_chunks"] == 3 and st["pending_bytes"] > 3 * MiB
        assert st["volume_staged_chunks"] == 3
        assert st["oldest_pending_age_s"] >= 1.0
        assert [s["live"] for s in st["segments"]] == [True]
        assert cli_main(["status", vol_path, "--staging", staging]) == 0
        assert "3 chunks" in capsys.readouterr().out
        assert cli_main(["flush", vol_path, "--staging", staging, "--timeout", "1"]) == 1
        assert "timed out" in capsys.readouterr().err
        link.down = False
        assert cli_main(["flush", vol_path, "--staging", staging, "--timeout", "60"]) == 0
        assert "flushed" in capsys.readouterr().out
        assert vol.stats()["staged_chunks"] == 0
    finally:
        vol.close()
    assert cli_main(["status", vol_path, "--staging", str(tmp_path / "nope")]) == 1
    assert "no staging directory" in capsys.readouterr().err


def test_flush_restores_replicas_written_around_a_down_node(vol_path, tmp_path, capsys):
    """Uploads that meet a down node go to the next one (hinted handoff); once the node is
    back, `ckptfs flush` copies them to their placement and fsck finds the volume whole."""
    from bench.throttle import Bandwidth, ThrottledNode
    from chunkstore.store import ChunkStore

    staging = str(tmp_path / "staging")
    vol = Volume.open(vol_path)
    n0 = Bandwidth(None)
    old = vol.store
    vol.store = ChunkStore(
        [ThrottledNode(old.nodes[0], n0), *old.nodes[1:]], old.replicas, old.seed
    )
    vol.store.on_under_replicated = old.on_under_replicated
    old.close()
    vol.attach_tier(staging)
    data = _data(16 * MiB, 11)  # 16 chunks over 4 nodes, R=2: some land on n0
    try:
        n0.down = True
        vol.write_file("/h", data)
        vol.tier.flush(timeout=60)
        lacking = vol.meta.under_replicated()
        assert lacking and all(set(names) == {"n0"} for names in lacking.values()), lacking
    finally:
        vol.close()
    assert cli_main(["fsck", vol_path]) == 1  # written around n0: replicas missing there
    assert "missing_replica" in capsys.readouterr().out
    n0.down = False  # (the CLI opens the plain nodes: n0 is back)
    assert cli_main(["flush", vol_path, "--staging", staging, "--timeout", "60"]) == 0
    assert f"restored {len(lacking)} replica(s)" in capsys.readouterr().out
    rc = cli_main(["fsck", vol_path])
    assert rc == 0, capsys.readouterr()
    with Volume.open(vol_path) as v:
        assert v.meta.under_replicated() == {}
        assert v.read_file("/h") == data


# -- foreground first: yielding uploader, batched fsyncs, upload-time compression -------------


def _raw_chunk(vol: Volume, n: int, seed: int) -> tuple[bytes, bytes]:
    from chunkstore.ids import chunk_id

    raw = _data(n, seed)
    return chunk_id(raw, vol.seed), raw


def test_uploader_yields_to_foreground_writes_host_wide(vol_path, tmp_path):
    """While any process on the host is putting, no tier uploads; once quiet, they drain.
    flush() drains even while writes go on."""
    staging = str(tmp_path / "staging")
    writer = _open(vol_path, staging, size=256 * MiB, idle_s=1.5)
    other = _open(vol_path, staging, size=256 * MiB, idle_s=1.5)  # another segment, same host
    try:
        cid, raw = _raw_chunk(other, 256 * 1024, 99)
        other.tier.put(cid, codec.encode(raw, "none"))  # staged by the other tier
        end = time.monotonic() + 2.0
        i = 0
        while time.monotonic() < end:  # the writer keeps the host busy
            c, r = _raw_chunk(writer, 64 * 1024, i)
            writer.tier.put(c, codec.encode(r, "none"))
            i += 1
            time.sleep(0.02)
            assert writer.tier.uploaded_chunks == 0 and other.tier.uploaded_chunks == 0, i
        _wait(lambda: other.tier.drained(), 30, "the other tier to drain once the host is quiet")
        _wait(lambda: writer.tier.drained(), 30, "the writer's tier to drain")
        assert other.tier.uploaded_chunks == 1 and writer.tier.uploaded_chunks == i

        stop = threading.Event()

        def busy() -> None:
            j = 10_000
            while not stop.is_set():
                c, r = _raw_chunk(writer, 64 * 1024, j)
                writer.tier.put(c, codec.encode(r, "none"))
                j += 1
                time.sleep(0.02)

        t = threading.Thread(target=busy)
        t.start()
        try:
            time.sleep(0.3)
            writer.tier.flush(timeout=60)  # drains although the host never goes quiet
            assert writer.tier.uploaded_chunks > i
        finally:
            stop.set()
            t.join()
    finally:
        writer.close()
        other.close()


def test_a_save_of_known_content_holds_the_uploaders_off(vol_path, tmp_path):
    """A save whose chunks are all stored already puts nothing, but it is a save all the
    same: its "which are missing?" questions keep the host's uploaders off until it ends."""
    staging = str(tmp_path / "staging")
    v = _open(vol_path, staging, size=256 * MiB, idle_s=0.5)
    try:
        ino = v.write_file("/known", _data(256 * 1024, 7)).ino
        known = [e.chunk_id for e in v.meta.get_extents(ino)]
        v.tier.flush(timeout=60)
        uploaded = v.tier.uploaded_chunks
        cid, raw = _raw_chunk(v, 256 * 1024, 8)
        v.tier.put(cid, codec.encode(raw, "none"))  # staged, waiting for a quiet host
        end = time.monotonic() + 1.5  # three times idle_s
        asked = 0
        while time.monotonic() < end:
            assert v.sink.missing(known) == set()
            asked += 1
            time.sleep(0.02)
            assert v.tier.uploaded_chunks == uploaded, asked
        _wait(lambda: v.tier.drained(), 30, "the tier to drain once the save is over")
        assert v.tier.uploaded_chunks == uploaded + 1
    finally:
        v.close()


def test_cache_eviction_is_oldest_first_and_scans_once_for_many(tmp_path, monkeypatch):
    """Evicting one entry at a time (as puts into a full tier do) scans the directory once,
    takes the oldest first, and keeps an entry read since the scan."""
    cache = chunkstore.cache.ChunkCache(str(tmp_path / "staging"), seed=0)
    ids = [bytes([i]) * 16 for i in range(10)]
    for i, cid in enumerate(ids):
        assert cache.add(cid, b"x" * 1000) == 1000
        t = 1_000_000_000 * (1000 + i)  # distinct mtimes, oldest first
        os.utime(cache.path(cid), ns=(t, t))
    scans = []
    scandir = os.scandir

    def counted(path):
        if path == cache.dir:
            scans.append(path)
        return scandir(path)

    monkeypatch.setattr(os, "scandir", counted)

    assert cache.evict(1) == 1000
    os.utime(cache.path(ids[1]))  # read since the scan: the LRU touch
    assert cache.evict(1) == 1000  # skips ids[1], takes ids[2]
    assert cache.evict(2500) == 3000  # ids[3..5]
    left = {cid for cid in ids if os.path.exists(cache.path(cid))}
    assert left == {ids[1], *ids[6:]}
    assert len(scans) == 1
    assert cache.evict(10**9) == 5000  # a rescan finds the touched one too
    assert len(scans) == 2 and not os.listdir(cache.dir)
    assert cache.evict(1) == 0

    # An entry that arrives after a scan with an older mtime (an uploaded chunk renamed in
    # from staged/ keeps its staging time) is taken in its turn once the list is stale.
    for i, cid in enumerate(ids[:3]):
        cache.add(cid, b"x" * 1000)
        t = 1_000_000_000 * (2000 + i)
        os.utime(cache.path(cid), ns=(t, t))
    assert cache.evict(1) == 1000  # scans: ids[0] goes, ids[1], ids[2] are candidates
    cache.add(ids[9], b"x" * 1000)
    os.utime(cache.path(ids[9]), ns=(1_000_000_000 * 1500,) * 2)  # older than every one
    monkeypatch.setattr(chunkstore.cache, "EVICT_LIST_S", 0.0)
    assert cache.evict(1) == 1000
    assert not os.path.exists(cache.path(ids[9])) and os.path.exists(cache.path(ids[1]))


def test_a_full_read_cache_does_not_start_uploads_during_a_save(vol_path, tmp_path):
    """The read cache is evicted at will, so a tier whose cache fills its budget still holds
    its uploads back while the host saves. It counted toward the drain threshold: every save
    into a warm staging dir competed with its own upload (1 GiB through the mount at ~300
    instead of ~800 MB/s), and each put scanned the whole cache to evict one entry."""
    staging = str(tmp_path / "staging")
    vol = _open(vol_path, staging, size=32 * MiB, idle_s=1.5)
    try:
        for k in range(30):  # uploaded, then moved to the read cache: 30 of 32 MiB
            cid, raw = _raw_chunk(vol, MiB, 1000 + k)
            vol.tier.put(cid, codec.encode(raw, "none"))
        vol.tier.flush(timeout=60)
        cached = vol.tier.cache.dir
        _wait(lambda: len(os.listdir(cached)) == 30, 10, "the uploaded chunks to be cached")
        before = vol.tier.uploaded_chunks
        for i in range(40):  # a save of 10 MiB: under half the budget, past the free space
            c, r = _raw_chunk(vol, 256 * 1024, i)
            vol.tier.put(c, codec.encode(r, "none"))
            time.sleep(0.02)
            assert vol.tier.uploaded_chunks == before, i
        assert len(os.listdir(cached)) < 28
        _wait(lambda: vol.tier.drained(), 30, "the tier to drain once the host is quiet")
        assert vol.tier.uploaded_chunks == before + 40
    finally:
        vol.close()


def test_unsynced_puts_are_acknowledged_by_one_sync(vol_path, tmp_path):
    """put(sync=False) writes only a temp file; sync_staged() journals the batch with one
    journal fsync; discard_unsynced() drops what was never acknowledged."""
    staging = str(tmp_path / "staging")
    vol = _open(vol_path, staging, size=256 * MiB, idle_s=60)
    try:
        tier = vol.tier
        chunks = [_raw_chunk(vol, 128 * 1024, s) for s in range(6)]
        for cid, raw in chunks:
            parts = codec.raw_parts([raw[:1000], memoryview(raw)[1000:]])
            tier.put(cid, parts, sync=False)
        assert _check_journals(staging) == 0
        assert not os.listdir(os.path.join(staging, "staged"))
        assert len(os.listdir(os.path.join(staging, "tmp"))) == 6
        fsyncs = tier.seg.fsyncs
        assert tier.sync_staged() == 6
        assert tier.seg.fsyncs == fsyncs + 1
        assert _check_journals(staging) == 6
        for cid, raw in chunks:
            assert tier.get(cid) == raw
            assert bytes(tier.get(cid, view=True)) == raw
        cid, raw = _raw_chunk(vol, 128 * 1024, 50)
        used = tier.stats()["used_bytes"]
        tier.put(cid, codec.encode(raw, "none"), sync=False)
        tier.discard_unsynced()
        assert tier.stats()["used_bytes"] == used
        assert not [n for n in os.listdir(os.path.join(staging, "tmp")) if n.startswith("s")]
        assert tier.sync_staged() == 0
        assert _check_journals(staging) == 6
    finally:
        vol.close()


def test_a_big_batch_is_made_durable_by_one_syncfs(vol_path, tmp_path, monkeypatch):
    """From SYNCFS_MIN files on, sync_staged makes them durable with one syncfs of the
    staging filesystem (through the tier's own descriptor) instead of an fdatasync each;
    below that, file by file. A failed sync drops the batch: its writers fail, and the
    same chunks put again are written again, not acknowledged from the failed files."""
    import errno as _errno

    from chunkstore.tier import tier as tiermod
    from chunkstore.tier.tier import SYNCFS_MIN

    calls: list[int] = []
    fdatasyncs: list[str] = []
    fail = [0]
    real_fs, real_fd = tiermod.sync_filesystem, tiermod.fdatasync_path

    def syncfs(fd: int) -> None:
        calls.append(fd)
        if fail[0]:
            fail[0] -= 1
            raise OSError(_errno.EIO, "injected writeback error")
        real_fs(fd)

    monkeypatch.setattr(tiermod, "sync_filesystem", syncfs)
    monkeypatch.setattr(tiermod, "fdatasync_path", lambda p: fdatasyncs.append(p) or real_fd(p))
    staging = str(tmp_path / "staging")
    vol = _open(vol_path, staging, size=256 * MiB, idle_s=60)
    try:
        tier = vol.tier
        if tier._syncfs_fd is None:
            pytest.skip("no syncfs that reports writeback errors here (Linux < 5.8)")
        for n, want_syncfs in ((SYNCFS_MIN, 1), (3, 0)):
            calls.clear()
            fdatasyncs.clear()
            chunks = [_raw_chunk(vol, 128 * 1024, 1000 * n + s) for s in range(n)]
            for cid, raw in chunks:
                tier.put(cid, codec.encode(raw, "none"), sync=False)
            assert tier.sync_staged() == n
            assert calls == [tier._syncfs_fd] * want_syncfs
            assert len(fdatasyncs) == (0 if want_syncfs else n)
            for cid, raw in chunks:
                assert tier.get(cid) == raw
        assert _check_journals(staging) == SYNCFS_MIN + 3
        chunks = [_raw_chunk(vol, 128 * 1024, 7000 + s) for s in range(SYNCFS_MIN)]
        for cid, raw in chunks:
            tier.put(cid, codec.encode(raw, "none"), sync=False)
        fail[0] = 1
        with pytest.raises(OSError):
            tier.sync_staged()
        assert not os.listdir(os.path.join(staging, "tmp"))  # the batch is gone
        assert tier.sync_staged() == 0 and _check_journals(staging) == SYNCFS_MIN + 3
        for cid, raw in chunks:  # put again: written again, then acknowledged
            tier.put(cid, codec.encode(raw, "none"), sync=False)
        assert len(os.listdir(os.path.join(staging, "tmp"))) == SYNCFS_MIN
        assert tier.sync_staged() == SYNCFS_MIN
        for cid, raw in chunks:
            assert tier.get(cid) == raw
    finally:
        vol.close()


UNSYNCED_CHILD = r"""
import sys, time
from chunkstore import codec
from chunkstore.ids import chunk_id
from fusefs.client.volume import Volume
vol = Volume.open(sys.argv[1])
vol.attach_tier(sys.argv[2], size=64 * 2**20)
for s in range(3):
    raw = bytes([s]) * 300_000
    vol.tier.put(chunk_id(raw, vol.seed), codec.encode(raw, "none"), sync=False)
print("ready", flush=True)
time.sleep(60)
"""


def _kill9_once(script: str, ready: str, *args: str) -> None:
    """Run a writer process until it prints `ready`, then SIGKILL it."""
    p = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, env=_env(), text=True
    )
    try:
        assert p.stdout.readline().strip() == ready
    finally:
        p.kill()
        p.wait()


def test_kill9_before_sync_leaves_no_journal_reference(vol_path, tmp_path):
    staging = str(tmp_path / "staging")
    _kill9_once(UNSYNCED_CHILD, "ready", vol_path, staging)
    assert len(os.listdir(os.path.join(staging, "tmp"))) >= 3
    vol = _open(vol_path, staging, size=64 * MiB)
    try:  # the next tier on the host: nothing to adopt, the dead writer's temp files gone
        assert _check_journals(staging) == 0
        assert vol.tier.stats()["pending_chunks"] == 0
        assert not [n for n in os.listdir(os.path.join(staging, "tmp")) if n.startswith("s")]
    finally:
        vol.close()


SMALL_CHILD = r"""
import sys, time
from fusefs.client.volume import Volume
vol = Volume.open(sys.argv[1])
vol.attach_tier(sys.argv[2], size=64 * 2**20, idle_s=600)  # nothing uploads before the kill
for i in range(6):
    # not inline in the metadata: small chunks through the tier, as a checkpoint's are
    vol.write_file(f"/small{i}", bytes([i + 1]) * (3000 + 9000 * i), inline=False)
print("SAVED", flush=True)
time.sleep(600)
"""


def test_small_chunks_journaled_with_their_bytes_survive_lost_staged_files(vol_path, tmp_path):
    """Small chunks are acknowledged by one journal fsync, their staged files never
    fsync'd: after a crash that lost or damaged those files (as a power cut could), the
    next tier rewrites them from the journal and uploads every one."""
    staging = str(tmp_path / "staging")
    _kill9_once(SMALL_CHILD, "SAVED", vol_path, staging)
    jdir = os.path.join(staging, "journal")
    (seg,) = [n for n in os.listdir(jdir) if n.endswith(SEGMENT_SUFFIX)]
    st = read_segment(os.path.join(jdir, seg))
    assert len(st.inline) == len(st.pending) == 6  # every chunk journaled with its bytes
    staged = os.path.join(staging, "staged")
    for cid, payload in st.inline.items():
        with open(os.path.join(staged, cid.hex()), "rb") as f:
            assert f.read() == payload
    lost = sorted(st.inline)
    os.unlink(os.path.join(staged, lost[0].hex()))  # the rename never reached the disk
    os.unlink(os.path.join(staged, lost[1].hex()))
    with open(os.path.join(staged, lost[2].hex()), "r+b") as f:
        f.truncate(100)  # the data never did
    with Volume.open(vol_path) as vol:
        tier = vol.attach_tier(staging, size=64 * MiB)
        assert tier.stats()["pending_chunks"] == 6
        for cid in lost[:3]:
            with open(os.path.join(staged, cid.hex()), "rb") as f:
                assert f.read() == st.inline[cid]
        tier.flush(timeout=60)
        assert tier.stats()["lost_chunks"] == 0
        assert vol.stats()["staged_chunks"] == 0
    with Volume.open(vol_path) as plain:  # from the nodes alone
        for i in range(6):
            assert plain.read_file(f"/small{i}") == bytes([i + 1]) * (3000 + 9000 * i)


def test_compaction_copies_inline_records_from_the_journal(vol_path, tmp_path):
    """Compaction takes an I record's bytes from the segment itself, not from the staged
    file (shared with other processes, never fsync'd)."""
    staging = str(tmp_path / "staging")
    vol = _open(vol_path, staging, size=64 * MiB, idle_s=600)
    try:
        tier = vol.tier
        chunks = [_raw_chunk(vol, 20_000, s) for s in range(4)]
        for cid, raw in chunks:
            tier.put(cid, codec.raw_parts([raw]), sync=False)
        fsyncs = tier.seg.fsyncs
        assert tier.sync_staged() == 4
        assert tier.seg.fsyncs == fsyncs + 1
        tier.seg.add_done([chunks[0][0]])  # one of them done: compaction drops it
        with open(os.path.join(staging, "staged", chunks[1][0].hex()), "r+b") as f:
            f.truncate(10)  # a damaged staged file must not reach the new segment
        tier.seg.compact()
        tier.seg.compact()  # twice: the offsets of the rewritten segment hold too
        st = read_segment(tier.seg.path)
        assert set(st.pending) == set(st.inline) == {c for c, _ in chunks[1:]}
        for cid, raw in chunks[1:]:
            assert codec.decode(st.inline[cid]) == raw
        assert tier.seg.live_bytes == os.path.getsize(tier.seg.path)
    finally:
        vol.close()


def test_a_journal_write_cut_short_by_a_full_disk_leaves_no_fragment(tmp_path, monkeypatch):
    """A partial append is cut off again: a fragment would hide every later record from a
    replay and shift the offsets compaction copies I records from."""
    import chunkstore.tier.journal as wb

    seg = wb.Segment(str(tmp_path), "host-1-x.jnl")
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    seg.add_pending([(a, 5000, 1)], {a: os.urandom(5000)})
    real_write = os.write
    calls = []

    def short_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wb.os, "write", short_then_full)
    with pytest.raises(OSError):
        seg.add_pending([(b, 6000, 2)], {b: os.urandom(6000)})
    monkeypatch.setattr(wb.os, "write", real_write)
    payload = os.urandom(7000)
    seg.add_pending([(c, 7000, 3)], {c: payload})
    st = read_segment(seg.path)
    assert not st.torn and set(st.pending) == {a, c} and st.inline[c] == payload
    seg.compact()
    assert read_segment(seg.path).inline[c] == payload
    seg.close(remove=True)


def test_an_inline_chunk_replaces_garbage_under_its_name_durably(vol_path, tmp_path):
    """A power cut between an unsynced rename into staged/ and its journal fsync can
    leave garbage under a chunk's name that no record names; staging the same chunk
    again replaces it, and the chunk reaches the nodes whole."""
    staging = str(tmp_path / "staging")
    vol = _open(vol_path, staging, size=64 * MiB, idle_s=600)
    try:
        tier = vol.tier
        (cid, raw), (same, sraw) = _raw_chunk(vol, 30_000, 1), _raw_chunk(vol, 30_000, 2)
        with open(os.path.join(staging, "staged", cid.hex()), "wb") as f:
            f.write(b"\0" * 100)  # what the cut left
        blob = b"".join(bytes(p) for p in codec.raw_parts([sraw]))
        with open(os.path.join(staging, "staged", same.hex()), "wb") as f:
            f.write(blob)  # the same bytes another writer left: kept as they are
        ino = os.stat(os.path.join(staging, "staged", same.hex())).st_ino
        tier.put(cid, codec.raw_parts([raw]), sync=False)
        tier.put(same, codec.raw_parts([sraw]), sync=False)
        assert tier.sync_staged() == 2
        with open(os.path.join(staging, "staged", cid.hex()), "rb") as f:
            assert codec.decode(f.read()) == raw
        assert os.stat(os.path.join(staging, "staged", same.hex())).st_ino == ino
        assert _check_journals(staging) == 2
        tier.flush(timeout=60)
        assert tier.stats()["lost_chunks"] == 0
        assert vol.store.get(cid) == raw and vol.store.get(same) == sraw
    finally:
        vol.close()


def test_transcode_at_upload_and_raw_reads_verified(vol_path, tmp_path):
    """A chunk staged raw is compressed on its way to the nodes; a corrupt raw cached copy
    is never returned (the id check covers the payload), it is refetched."""
    staging = str(tmp_path / "staging")

    def transcode(blob: bytes, width: int | None) -> bytes:
        return codec.encode(codec.decode(blob), "zstd")

    vol = _open(vol_path, staging, size=64 * MiB, transcode=transcode)
    try:
        from chunkstore.ids import chunk_id

        raw = b"checkpoint " * 50_000
        cid = chunk_id(raw, vol.seed)
        vol.tier.put(cid, codec.encode(raw, "none"), sync=False, width=None)
        vol.tier.sync_staged()
        vol.tier.flush(timeout=60)
        stored = [n.get(cid) for n in vol.store.placement(cid)]
        assert all(codec.header_info(b)[1] == "zstd" and len(b) < len(raw) // 10 for b in stored)
        assert codec.decode(stored[0]) == raw
        cached = vol.tier.cache.path(cid)
        with open(cached, "r+b") as f:  # the raw copy kept as read cache: flip a payload byte
            f.seek(codec.HEADER + 12345)
            b = f.read(1)
            f.seek(codec.HEADER + 12345)
            f.write(bytes([b[0] ^ 1]))
        assert vol.tier.cache.misses == 0
        assert bytes(vol.tier.get(cid, view=True)) == raw
        assert vol.tier.cache.misses == 1  # the bad copy was dropped; fetched from the nodes
    finally:
        vol.close()


def test_compressed_at_upload_reports_stored_size(tmp_path):
    """A chunk staged raw and compressed by the uploader: stats count its size on the nodes."""
    from chunkstore import codec as _codec
    from fusefs.client.volume import Volume as _Volume

    def transcode(blob: bytes, width: int | None) -> bytes:
        return _codec.encode(_codec.decode(blob), "zstd")

    with _Volume.create(str(tmp_path / "vol"), nodes=2) as vol:
        vol.attach_tier(str(tmp_path / "staging"), durability="local", transcode=transcode)
        vol.write_file("/zeros", bytes(8 * 2**20), codec_name="none")
        assert vol.stats()["stored_bytes"] >= 4 * 2**20  # staged raw: not known smaller yet
        vol.tier.flush(timeout=60)
        st = vol.stats()
        assert st["staged_chunks"] == 0
        assert st["stored_bytes"] < 64 * 1024, st  # the zstd size on the nodes
        assert vol.read_file("/zeros") == bytes(8 * 2**20)


def test_compaction_closes_the_replaced_segment_files(tmp_path):
    """Each compaction used to keep the old segment's fd open until the tier closed: a
    long-running tier leaked one fd, and the unlinked file's blocks, per compaction."""
    from chunkstore.tier.journal import Segment

    seg = Segment(str(tmp_path), "host-1-x.jnl")
    ids = [bytes([i]) * 16 for i in range(10)]
    before = len(os.listdir("/proc/self/fd"))
    for step in range(40):
        seg.add_pending([(c, 4096, step + 1) for c in ids], {})
        seg.add_done(ids[:5])
        seg.compact()
    assert len(os.listdir("/proc/self/fd")) <= before
    assert set(read_segment(seg.path).pending) == set(ids[5:])  # the live records survive
    seg.close(remove=True)


def test_a_sync_waiting_on_a_retired_file_returns_once_its_fsync_is_done():
    """GroupSync.retire: the running fsync finishes before the fd is closed; callers queued
    behind it return without another fsync (their records are durable in the new file)."""
    import threading

    release, started = threading.Event(), threading.Event()
    calls, events = [], []

    def slow_fsync():
        calls.append(1)
        started.set()
        assert release.wait(10)
        events.append("fsync done")

    gs = GroupSync(slow_fsync)
    first = threading.Thread(target=gs.sync)
    first.start()
    assert started.wait(10)
    queued = threading.Thread(target=gs.sync)
    queued.start()
    retiring = threading.Thread(target=gs.retire, args=(lambda: events.append("closed"),))
    retiring.start()
    release.set()
    for t in (first, queued, retiring):
        t.join(10)
        assert not t.is_alive()
    assert calls == [1] and events == ["fsync done", "closed"]
    gs.sync()  # retired: returns at once
    assert calls == [1]


def test_a_staged_chunk_whose_record_was_lost_is_uploaded(vol_path, tmp_path):
    """reconcile_staged: a staged file that no journal names any more (its record was in
    a damaged run) is checked and uploaded by the next tier; a corrupt one is removed."""
    staging = str(tmp_path / "staging")
    vol = _open(vol_path, staging, size=64 * MiB, idle_s=600)
    cid, raw = _raw_chunk(vol, 300_000, 5)
    bad_cid, bad_raw = _raw_chunk(vol, 300_000, 6)
    vol.tier.put(cid, codec.encode(raw, "none"))
    vol.tier.put(bad_cid, codec.encode(bad_raw, "none"))
    seg = vol.tier.seg.path
    vol.close()  # nothing uploaded (idle_s=600): both chunks pending in the journal
    with open(seg, "r+b") as f:  # damage both P records
        data = bytearray(f.read())
        for i in range(0, len(data), REC_SIZE):
            data[i + 10] ^= 0xFF
        f.seek(0)
        f.write(data)
    with open(os.path.join(staging, "staged", bad_cid.hex()), "r+b") as f:
        f.seek(5000)
        f.write(b"\0" * 16)
    vol = _open(vol_path, staging, size=64 * MiB, idle_s=600)
    try:
        assert vol.tier.stats()["pending_chunks"] == 0  # young files: left to their writer
        assert vol.tier.reconcile_staged(min_age=0) == 1
        assert not os.path.exists(os.path.join(staging, "staged", bad_cid.hex()))
        vol.tier.flush(timeout=60)
        assert vol.store.get(cid) == raw
    finally:
        vol.close()
