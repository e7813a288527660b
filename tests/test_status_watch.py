"""`ckptfs status --watch`: the status figures refreshed in place on a terminal (a real
pseudo-terminal here), one block per refresh into a pipe, JSON lines with --json."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

from tests.fixtures.mount import ROOT, run_cli


def _run_on_tty(args: list[str], env: dict, timeout: float = 60) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal as its stdout; (exit code, what it printed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusefs.cli", *args],
        env=env, cwd=ROOT, stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            out += data
        elif proc.poll() is not None:
            break
    os.close(master)
    code = proc.wait(timeout=10)
    proc.stderr.close()
    return code, out.decode(errors="replace")


def test_watch_redraws_in_place_on_a_terminal(new_volume, mount_env):
    vol = new_volume()
    code, out = _run_on_tty(
        ["status", vol, "--watch", "--interval", "0.2", "--count", "3"], mount_env
    )
    assert code == 0, out
    assert out.count("\x1b[2J") == 1  # the screen is cleared once
    assert out.count("\x1b[H") == 3  # then each refresh starts from the top...
    assert out.count("\x1b[J") == 3  # ...and clears what the previous one left below
    assert out.count("pending      0 chunks") == 3
    assert f"ckptfs status {vol}" in out


def test_watch_into_a_pipe_and_as_json(new_volume, mount_env):
    vol = new_volume()
    res = run_cli("status", vol, "--watch", "--interval", "0.1", "--count", "2", env=mount_env)
    assert res.returncode == 0, res.stderr
    assert "\x1b[" not in res.stdout
    assert res.stdout.count("upload rate") == 2
    res = run_cli(
        "status", vol, "--watch", "--json", "--interval", "0.1", "--count", "3", env=mount_env
    )
    frames = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(frames) == 3 and all(f["pending_bytes"] == 0 for f in frames)
    res = run_cli("status", vol, "--watch", "--interval", "0", env=mount_env)
    assert res.returncode == 1 and "--interval" in res.stderr


_STAGER = """
import os, sys, time
from bench.throttle import throttle_volume
from fusefs.client.volume import Volume

vol = Volume.open(sys.argv[1])
throttle_volume(vol, 4e6)  # the nodes take 4 MB/s: the upload lasts seconds
tier = vol.attach_tier(sys.argv[2], durability="local")
with vol.open_write("/ckpt.bin") as w:  # 32 MiB that compress about 2:1
    for _ in range(32):
        w.write(os.urandom(512 * 1024) + bytes(512 * 1024))
print("staged", flush=True)
tier.flush(timeout=120)
vol.close()
"""


def test_watch_upload_figures_say_what_they_measure(new_volume, mount_env, tmp_path):
    """While a tier uploads, each refresh's upload line names its unit and window: the
    uploaders' 10 s average of compressed bytes first, then bytes sent (compressed) and
    pending fallen (uncompressed) over the same interval (it showed `draining 148 MiB/s`
    beside `upload rate 22.9 MiB/s`, unlabelled)."""
    vol = new_volume("vol", "--chunk-size", "1MiB", "--compression", "zstd")
    staging = str(tmp_path / "staging")
    stager = subprocess.Popen(
        [sys.executable, "-c", _STAGER, vol, staging],
        env=mount_env, cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert stager.stdout.readline().strip() == "staged"
        res = run_cli(
            "status", vol, "--staging", staging, "--watch", "--interval", "1", "--count", "4",
            env=mount_env,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
    finally:
        stager.wait(timeout=180)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("upload rate")]
    assert len(lines) == 4, res.stdout
    assert lines[0].endswith("sent to the nodes, compressed (average of the last 10 s)")
    sent = []
    for ln in lines[1:]:
        assert "sent to the nodes, compressed; pending " in ln and "(staged" in ln, ln
        assert " over the last 1." in ln, ln
        sent.append(ln.split()[2])
    assert any(float(x) > 0 for x in sent), lines  # the upload was seen while it ran
