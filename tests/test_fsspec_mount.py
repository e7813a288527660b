"""The fsspec filesystem and the other frontends see the same files: what fsspec.open
writes reads back identically through a real FUSE mount of the volume and through
`ckptfs get`, and what the mount writes reads back identically through fsspec."""

from __future__ import annotations

import os

import fsspec

from fusefs.client.registry import close_volumes

MiB = 2**20


def test_fsspec_write_reads_back_through_the_mount_and_get(
    new_volume, mount_factory, mount_env, tmp_path, monkeypatch, entry_point_site
):
    vol = new_volume()
    m = mount_factory(vol)
    # the mount's staging directory: this process stages where the mount reads
    monkeypatch.setenv("XDG_CACHE_HOME", mount_env["XDG_CACHE_HOME"])
    data = os.urandom(9 * MiB + 4321)
    try:
        with fsspec.open("ckptfs:///ckpt/model.bin", "wb", volume=vol) as f:
            for off in range(0, len(data), MiB):
                f.write(data[off : off + MiB])
        with open(m.path("ckpt", "model.bin"), "rb") as f:
            assert f.read() == data
        out = tmp_path / "got.bin"
        m.cli("get", vol, "/ckpt/model.bin", str(out), check=True, timeout=300)
        assert out.read_bytes() == data

        back = os.urandom(5 * MiB + 7)
        with open(m.path("ckpt", "from-mount.bin"), "wb") as f:
            f.write(back)
        fs = fsspec.filesystem("ckptfs", volume=vol)
        assert fs.cat_file("/ckpt/from-mount.bin") == back
        assert fs.info("/ckpt/from-mount.bin")["size"] == len(back)
        assert sorted(os.listdir(m.path("ckpt"))) == ["from-mount.bin", "model.bin"]
    finally:
        close_volumes()
