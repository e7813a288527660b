"""Directory nodes and chunk-id parsing: what a node reports and writes is only ever its
own objects, named by their ids, and an unsynced put never replaces an object."""

from __future__ import annotations

import os

import pytest

from chunkstore import codec
from chunkstore.ids import chunk_id, from_hex
from chunkstore.nodes import NodeInfo
from chunkstore.nodes.dir import DirNode


def _node(tmp_path) -> DirNode:
    n = DirNode(NodeInfo("n0", f"dir:{tmp_path}/n0", "n0"))
    n.ensure()
    return n


def test_from_hex_takes_exactly_32_lowercase_hex_digits():
    good = "0123456789abcdef" * 2
    assert from_hex(good) == bytes.fromhex(good)
    for bad in (good + "\n", "\n" + good, good.upper(), good[:-1], good + "0", "", None):
        with pytest.raises(ValueError):
            from_hex(bad)  # type: ignore[arg-type]


def test_an_unsynced_put_never_replaces_an_object(tmp_path):
    n = _node(tmp_path)
    raw = os.urandom(5000)
    cid = chunk_id(raw, 1)
    blob = codec.encode(raw, "none")
    n.put(cid, blob)
    _, final = n._path(cid)
    ino = os.stat(final).st_ino
    n.put_nosync(cid, blob)  # a second writer that deduplicated too late
    assert os.stat(final).st_ino == ino  # the object in place was kept
    assert os.listdir(os.path.join(n.root, "tmp")) == []  # and its temp file removed
    n.sync()  # makes the kept object durable for this writer's commit
    assert n.get(cid) == blob
    other = os.urandom(100)
    cid2 = chunk_id(other, 1)
    n.put_nosync(cid2, codec.encode(other, "none"))  # a new object still goes in
    n.sync()
    assert {c for c, _, _ in n.list()} == {cid, cid2}


def test_a_put_never_replaces_a_whole_object_and_replaces_a_damaged_one(tmp_path):
    """nodes/base.py: a put over a whole object of the id leaves it unchanged (synced or
    not, with and without the seed), over a damaged or planted one replaces it."""
    n = _node(tmp_path)
    raw = os.urandom(5000)
    cid = chunk_id(raw, 7)
    blob = codec.encode(raw, "none")
    n.put(cid, blob)
    _, final = n._path(cid)
    ino = os.stat(final).st_ino
    n.content_seed = 7  # as a ChunkStore sets it
    for put in (n.put, n.put_nosync):
        put(cid, codec.encode(raw, "zstd"))  # the same content, another encoding
        assert os.stat(final).st_ino == ino and n.get(cid) == blob
    n.sync()
    n.plant(cid, codec.encode(os.urandom(5000), "none"))  # whole, but of another id
    n.put(cid, blob)
    assert n.get(cid) == blob  # the planted object was replaced
    damaged = bytearray(blob)
    damaged[-1] ^= 1
    n.plant(cid, bytes(damaged))
    n.put_nosync(cid, blob)
    n.sync()
    assert n.get(cid) == blob
    assert os.listdir(os.path.join(n.root, "tmp")) == []


def test_listing_reports_only_objects_in_their_fan_out_directories(tmp_path):
    n = _node(tmp_path)
    raw = b"x" * 100
    cid = chunk_id(raw, 1)
    n.put(cid, codec.encode(raw, "none"))
    objects = os.path.join(n.root, "objects")
    h = cid.hex()
    other = ("ff" if h[:2] != "ff" else "00") + h[2:]
    wrong = os.path.join(objects, h[:2], h[2:4], other)  # an id in a directory not its own
    with open(wrong, "wb") as f:
        f.write(b"foreign")
    os.makedirs(os.path.join(objects, "zz", "00"))  # not hex
    with open(os.path.join(objects, "zz", "00", h), "wb") as f:
        f.write(b"foreign")
    outside = tmp_path / "outside"
    (outside / "00").mkdir(parents=True)
    (outside / "00" / ("00" * 16)).write_bytes(b"not the node's")
    os.symlink(outside, os.path.join(objects, "ab" if h[:2] != "ab" else "cd"))
    with open(os.path.join(objects, "0f"), "wb") as f:  # a file where a directory goes
        f.write(b"x")
    assert [c for c, _, _ in n.list()] == [cid]
