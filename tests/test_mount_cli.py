"""`ckptfs mount` as a user meets it: a non-empty mountpoint is refused unless asked for,
and a --background daemon always logs somewhere that `mount`, `status` and `umount` name."""

from __future__ import annotations

import os
import signal
import time

from tests.fixtures.mount import _force_unmount, is_mounted, run_cli


def test_a_non_empty_mountpoint_is_refused_unless_nonempty(new_volume, mount_env, tmp_path):
    vol = new_volume()
    mp = tmp_path / "mnt"
    mp.mkdir()
    (mp / "mine.txt").write_text("keep me visible")
    try:
        res = run_cli("mount", vol, str(mp), "--background", env=mount_env)
        assert res.returncode == 1 and "Traceback" not in res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptfs: error: "), res.stderr
        assert "not empty" in lines[0] and "--nonempty" in lines[0]
        assert not is_mounted(str(mp))
        assert (mp / "mine.txt").read_text() == "keep me visible"
        # asked for: mounted over the files, which come back at unmount
        res = run_cli("mount", vol, str(mp), "--background", "--nonempty", env=mount_env)
        assert res.returncode == 0, res.stderr
        assert is_mounted(str(mp)) and not (mp / "mine.txt").exists()
        run_cli("umount", str(mp), env=mount_env, check=True)
        assert (mp / "mine.txt").read_text() == "keep me visible"
    finally:
        _force_unmount(str(mp))


def test_a_background_mount_logs_by_default(new_volume, mount_env, tmp_path):
    """Without --log the daemon's output went to /dev/null: a mount that died left no trace."""
    vol = new_volume()
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        res = run_cli("mount", vol, str(mp), "--background", env=mount_env)
        assert res.returncode == 0, res.stderr
        log = res.stderr.split("log ")[-1].rstrip(")\n")
        assert log.startswith(mount_env["XDG_DATA_HOME"]) and os.path.isfile(log), res.stderr
        pid = int(res.stderr.split("daemon pid ")[1].split(",")[0])
        with open(log) as f:
            assert f"pid {pid}: {vol} at {mp}" in f.read()
        st = run_cli("status", vol, env=mount_env, check=True).stdout
        assert f"mount        {mp}: pid {pid}, log {log}" in st
        res = run_cli("umount", str(mp), env=mount_env, check=True)
        assert f"daemon log {log}" in res.stderr

        # a daemon that dies: its log is named when the dead mount is cleaned up
        res = run_cli("mount", vol, str(mp), "-b", env=mount_env, check=True)
        pid = int(res.stderr.split("daemon pid ")[1].split(",")[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.05)
        assert "(dead)" in run_cli("status", vol, env=mount_env, check=True).stdout
        res = run_cli("umount", str(mp), env=mount_env, check=True)
        assert "its daemon died" in res.stderr and log in res.stderr, res.stderr
        with open(log) as f:
            assert f"pid {pid}: {vol} at {mp}" in f.read()
        assert f"mount        {mp}" not in run_cli("status", vol, env=mount_env).stdout
    finally:
        _force_unmount(str(mp))
