"""gc against writers in flight (audit 3.1): a file open past the grace period while gc
runs keeps its data readable after its commit, or its commit fails with a clear error;
never an unreadable committed file. See metadata/leases.py."""

from __future__ import annotations

import os
import time

import pytest

from fusefs.maint.gc import gc
from metadata.engine import MetaError

CHUNK = 64 * 1024


def _open_and_store(vol, data: bytes):
    """A writer whose chunks are on the nodes, unsynced then synced, but not committed."""
    w = vol.open_write("/job/f.bin", inline=False)
    w.write(data)
    w.flush_data()
    return w


def test_a_writer_open_past_the_grace_period_keeps_its_chunks(make_volume):
    vol = make_volume(nodes=2, replicas=1, chunk_size=CHUNK)
    data = os.urandom(4 * CHUNK + 17)
    w = _open_and_store(vol, data)
    time.sleep(1.2)  # every object is older than the grace period now
    rep = gc(vol, grace=0.5, progress=False)
    assert rep.objects_deleted == 0, rep
    w.close()
    assert vol.read_file("/job/f.bin") == data


def test_renewed_leases_outlive_their_ttl(make_volume):
    vol = make_volume(nodes=2, replicas=1, chunk_size=CHUNK)
    vol.meta.lease_ttl_s = 0.6
    vol.sink.renew_every = 0.1
    data = os.urandom(3 * CHUNK)
    w = _open_and_store(vol, data)
    time.sleep(1.5)  # past the TTL twice over: only renewals keep the leases
    assert gc(vol, grace=0.5, progress=False).objects_deleted == 0
    w.close()
    assert vol.read_file("/job/f.bin") == data


def test_a_commit_naming_chunks_gc_deleted_is_refused(make_volume):
    vol = make_volume(nodes=2, replicas=1, chunk_size=CHUNK)
    vol.meta.lease_ttl_s = 0.3
    vol.sink.renew_every = 3600.0  # a writer that stopped renewing (stuck, suspended)
    data = os.urandom(3 * CHUNK)
    w = _open_and_store(vol, data)
    time.sleep(1.2)
    assert gc(vol, grace=0.5, progress=False).objects_deleted > 0
    with pytest.raises(MetaError, match="lease") as e:
        w.close()
    assert "\n" not in str(e.value)
    assert vol.resolve("/job/f.bin").size == 0  # nothing committed: nothing unreadable
    # written again, the same content is stored again and reads back
    vol.meta.lease_ttl_s = 600.0
    vol.write_file("/job/f.bin", data, inline=False)
    assert vol.read_file("/job/f.bin") == data
