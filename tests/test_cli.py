"""The ckptfs command as a user runs it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest

MiB = 2**20


def ckptfs(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", *args],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=600,
        **kw,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"ckptfs {args} failed: {proc.stderr}")
    return proc


def _assert_clean_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines, "no error message"
    assert lines[-1].startswith("ckptfs") and "error" in lines[-1]
    for w in words:
        assert w in proc.stderr


def _write_random(path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 * MiB)
            f.write(os.urandom(n))
            left -= n


def test_put_get_1gib_random_byte_identical(tmp_path):
    vol = tmp_path / "vol"
    ckptfs("format", str(vol))
    src = tmp_path / "big.bin"
    _write_random(src, 1024 * MiB)
    ckptfs("put", str(vol), str(src), "/data/big.bin")
    src_size = src.stat().st_size
    out = tmp_path / "back.bin"
    ckptfs("get", str(vol), "/data/big.bin", str(out))
    assert out.stat().st_size == src_size
    assert filecmp.cmp(src, out, shallow=False)
    st = json.loads(ckptfs("stats", str(vol), "--json").stdout)
    assert st["logical_bytes"] == src_size
    assert st["stored_bytes"] >= src_size  # random bytes do not compress
    listing = ckptfs("ls", str(vol), "/data").stdout
    assert "big.bin" in listing and str(src_size) in listing


def test_second_name_grows_stored_bytes_under_1mib(tmp_path):
    vol = tmp_path / "vol"
    ckptfs("format", str(vol), "--nodes", "4", "--replicas", "2")
    src = tmp_path / "f.bin"
    _write_random(src, 256 * MiB)
    ckptfs("put", str(vol), str(src), "/a")
    s1 = json.loads(ckptfs("stats", str(vol), "--json").stdout)["stored_bytes"]
    ckptfs("put", str(vol), str(src), "/b")
    s2 = json.loads(ckptfs("stats", str(vol), "--json").stdout)["stored_bytes"]
    assert s2 - s1 < MiB


def test_rm_and_ls(tmp_path):
    vol = tmp_path / "vol"
    ckptfs("format", str(vol), "--chunk-size", "64KiB", "--compression", "zstd")
    src = tmp_path / "s"
    src.write_bytes(b"x" * 200_000)
    ckptfs("put", str(vol), str(src), "/d/s")
    ckptfs("rm", str(vol), "/d/s")
    assert "s" not in ckptfs("ls", str(vol), "/d").stdout.split()
    _assert_clean_error(ckptfs("rm", str(vol), "/d/s", check=False), "not found")
    ckptfs("put", str(vol), str(src), "/d/t")
    _assert_clean_error(ckptfs("rm", str(vol), "/d", check=False), "directory")
    ckptfs("rm", str(vol), "/d", "-r")
    assert json.loads(ckptfs("stats", str(vol), "--json").stdout)["unique_chunks"] == 0


def test_get_of_a_node_without_bytes_is_an_error(tmp_path):
    """A symlink or FIFO has no bytes of its own: `get` says so and writes nothing (it
    used to write an empty file)."""
    import stat

    from fusefs.client.volume import Volume
    from metadata.engine import ROOT_INO

    vol = tmp_path / "vol"
    ckptfs("format", str(vol))
    with Volume.open(str(vol)) as v:
        v.meta.create(ROOT_INO, b"fifo", stat.S_IFIFO | 0o644, 0, 0)
        v.meta.create(ROOT_INO, b"ln", stat.S_IFLNK | 0o777, 0, 0, target=b"fifo")
    for name in ("fifo", "ln"):
        _assert_clean_error(
            ckptfs("get", str(vol), name, str(tmp_path / "out"), check=False), "not a regular file"
        )  # fmt: skip
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args,words",
    [
        (["stats", "{tmp}/missing"], ["no volume"]),
        (["format", "{tmp}/v2", "--chunk-size", "4XB"], ["bad size"]),
        (["format", "{tmp}/v2", "--chunk-size", "1KiB"], ["chunk size"]),
        (["format", "{tmp}/v2", "--replicas", "9"], ["replicas"]),
        (["format", "{tmp}/v2", "--node", "ftp://x"], ["expected dir:"]),
        (["put", "{vol}", "{tmp}/no-such-file", "/x"], ["cannot read"]),
        (["get", "{vol}", "/no/such", "{tmp}/out"], ["not found"]),
        (["put", "{vol}", "{src}", "/bad\\name/.."], ["not allowed"]),
    ],
)
def test_user_errors_are_one_line(tmp_path, args, words):
    vol = tmp_path / "vol"
    ckptfs("format", str(vol))
    src = tmp_path / "src"
    src.write_bytes(b"abc")
    before = ckptfs("stats", str(vol), "--json").stdout
    argv = [a.format(tmp=tmp_path, vol=vol, src=src) for a in args]
    _assert_clean_error(ckptfs(*argv, check=False), *words)
    assert ckptfs("stats", str(vol), "--json").stdout == before
    assert not (tmp_path / "v2").exists()
    assert not (tmp_path / "out").exists()


def test_get_never_writes_through_a_planted_partial_file(tmp_path):
    """A symlink at DEST.ckptfs-partial (the old fixed temp name) must not redirect the
    download: the victim stays as it was, the destination gets the bytes."""
    vol = tmp_path / "vol"
    ckptfs("format", str(vol))
    src = tmp_path / "src"
    src.write_bytes(os.urandom(3 * MiB))
    ckptfs("put", str(vol), str(src), "/f")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    dest = tmp_path / "dest"
    os.symlink(victim, str(dest) + ".ckptfs-partial")
    ckptfs("get", str(vol), "/f", str(dest))
    assert victim.read_bytes() == b"precious"
    assert filecmp.cmp(src, dest, shallow=False)
    assert [p.name for p in tmp_path.iterdir() if ".ckptfs-partial." in p.name] == []


def test_names_with_terminal_escapes_are_shown_escaped(tmp_path):
    """File, job and host names reach human output escaped; JSON output keeps them exact."""
    from fusefs.client.volume import Volume

    vol = tmp_path / "vol"
    ckptfs("format", str(vol))
    evil = "x\x1b]0;owned\x07\x1b[2J"
    with Volume.open(str(vol)) as v:
        v.write_file("/" + evil, b"abc")
        v.write_file("/raw\xff".encode("latin-1").decode("utf-8", "surrogateescape"), b"d")
        v.meta.begin(evil, 1, 1)
        v.meta.commit_rank(evil, 1, 0, [], host="h\x1b[31m")
    for out in (
        ckptfs("ls", str(vol)).stdout,
        ckptfs("checkpoints", str(vol), "list").stdout,
        ckptfs("checkpoints", str(vol), "show", evil, "1").stdout,
    ):
        assert "\x1b" not in out and "\x07" not in out
        assert "\\x1b" in out
    assert "raw\\xff" in ckptfs("ls", str(vol)).stdout
    rows = json.loads(ckptfs("checkpoints", str(vol), "list", "--json").stdout)
    assert rows[0]["job"] == evil  # exact in JSON


@pytest.mark.parametrize("existing", [False, True])
def test_a_format_that_cannot_reach_a_node_leaves_nothing(tmp_path, existing):
    """An unreachable S3 node: one line, exit non-zero, and no half-made volume (it left
    meta.db without volume.json, and a traceback)."""
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    vol = tmp_path / "vol"
    if existing:
        vol.mkdir()
        (vol / "keep.txt").write_text("mine")
    url = f"s3://bkt?endpoint=http://127.0.0.1:{port}&connect_timeout=0.5&retries=1"
    proc = ckptfs("format", str(vol), "--node", "dir:n0", "--node", url, "--replicas", "1",
                  check=False)  # fmt: skip
    _assert_clean_error(proc, "cannot format")
    if existing:
        assert sorted(p.name for p in vol.iterdir()) == ["keep.txt"]
    else:
        assert not vol.exists()
    ckptfs("format", str(vol))  # the path is usable afterwards


def test_a_missing_path_is_named_as_written(tmp_path):
    """get, ls and rm of a missing path name the whole path the user gave, and the missing
    component when it is not the last (they printed `b'does' not found`)."""
    vol = tmp_path / "vol"
    ckptfs("format", str(vol))
    src = tmp_path / "src"
    src.write_bytes(b"abc")
    ckptfs("put", str(vol), str(src), "/a/b")
    cases = [
        (["get", str(vol), "/does/not/exist", str(tmp_path / "x")],
         "/does/not/exist: not found (/does does not exist)"),
        (["ls", str(vol), "/does/not"], "/does/not: not found (/does does not exist)"),
        (["ls", str(vol), "/a/zz"], "/a/zz: not found"),
        (["rm", str(vol), "/a/q"], "/a/q: not found"),
        (["ls", str(vol), "/a/b/c"], "/a/b/c: /a/b is not a directory"),
    ]  # fmt: skip
    for argv, text in cases:
        proc = ckptfs(*argv, check=False)
        _assert_clean_error(proc, text)
        assert "b'" not in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists()


def test_failover_warning_is_one_clean_line(tmp_path, meta_server):
    """A client whose first listed replica is down says so in one line, each address once,
    without a second `ckptfs meta:` prefix."""
    import socket

    vol = tmp_path / "vol"
    ckptfs("format", str(vol))
    srv = meta_server(str(vol))
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    url = f"ckptfs://127.0.0.1:{dead},127.0.0.1:{srv.port}?token_file={srv.token_file}"
    proc = ckptfs("ls", url, "/")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("ckptfs: WARNING: metadata service at "), line
    assert line.count(f"127.0.0.1:{dead}") == 1, line
    assert "ckptfs meta" not in line and "cannot reach" not in line, line
    assert line.endswith(f"failed over to 127.0.0.1:{srv.port}"), line


def _ckptfs_bytes(*args: str, cwd, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """The CLI run from `cwd` with binary standard input and output."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", *args],
        input=stdin,
        capture_output=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_dash_is_standard_input_and_output(tmp_path):
    """`put VOL - PATH` reads standard input and `get VOL PATH -` writes standard output
    (get wrote a file named `-`, put could not read a pipe)."""
    vol = tmp_path / "vol"
    ckptfs("format", str(vol), "--chunk-size", "64KiB")
    data = os.urandom(300_000)
    _ckptfs_bytes("put", str(vol), "-", "/piped.bin", cwd=tmp_path, stdin=data)
    out = _ckptfs_bytes("get", str(vol), "/piped.bin", "-", cwd=tmp_path)
    assert out.stdout == data
    assert not (tmp_path / "-").exists()
    # `./-` is still a file of that name
    _ckptfs_bytes("get", str(vol), "/piped.bin", "./-", cwd=tmp_path)
    assert (tmp_path / "-").read_bytes() == data


def test_checkpoint_list_columns_fit_long_job_names(tmp_path):
    """A 27-character job name (the demo's are 26) stays in the JOB column: every row's
    STEP ends where the header's does (the 20-wide column overflowed and shifted the row)."""
    from fusefs.client.volume import Volume

    vol = tmp_path / "vol"
    ckptfs("format", str(vol))
    long_job = "demo-20261203-124501-abcdef"
    with Volume.open(str(vol)) as v:
        v.meta.begin(long_job, 1, 1)
        v.meta.commit_rank(long_job, 1, 0, [], host="h")
        v.meta.begin("j", 12345, 2)
    lines = ckptfs("checkpoints", str(vol), "list").stdout.splitlines()
    assert len(lines) == 3
    end = lines[0].index("STEP") + len("STEP")
    assert lines[1].startswith(long_job + " ")
    assert lines[1][:end].endswith(" 1") and lines[2][:end].endswith(" 12345"), lines
    state = lines[0].index("STATE")
    assert lines[1][state:].startswith("published") and lines[2][state:].startswith("open")


def test_default_nodes_and_backups_outlive_the_volume_directory(tmp_path):
    """`format VOL` puts its nodes in VOL.nodes/, beside VOL (they were in VOL/nodes, so the
    backups meant to survive the loss of VOL went with it): after `rm -rf VOL` the volume
    is restored from its nodes, and a new format over them is refused."""
    import shutil

    vol = tmp_path / "vol"
    out = ckptfs("format", str(vol)).stdout
    nodes_dir = tmp_path / "vol.nodes"
    assert f"nodes:    {nodes_dir}/n0..n3" in out and "backups:" in out, out
    assert not (vol / "nodes").exists()
    src = tmp_path / "src"
    src.write_bytes(os.urandom(200_000))  # past the inline size: its chunks go to the nodes
    ckptfs("put", str(vol), str(src), "/keep.bin")
    ckptfs("meta", "backup", str(vol))
    key = tmp_path / "offhost.key"  # the operator's copy, made when format said so
    shutil.copy(vol / "backup.key", key)
    shutil.rmtree(vol)

    node_args = [a for i in range(4) for a in ("--node", f"dir:{nodes_dir}/n{i}")]
    assert ckptfs("meta", "backups", *node_args).stdout.strip()
    _assert_clean_error(ckptfs("format", str(vol), check=False), "already holds nodes")
    assert not vol.exists()
    new = tmp_path / "restored"
    ckptfs("meta", "restore", str(new), *node_args, "--key", str(key))
    ckptfs("get", str(new), "/keep.bin", str(tmp_path / "back"))
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    assert (new / "backup.key").read_bytes() == key.read_bytes()  # it signs on with it


def test_format_makes_the_backup_key_and_says_to_copy_it(tmp_path):
    """Issue 40: every volume has its backup key from `format` on (0600, in the volume
    directory, never in the metadata), and format says in one line where it is and that
    it must be copied off the host."""
    vol = tmp_path / "vol"
    out = ckptfs("format", str(vol)).stdout
    key = vol / "backup.key"
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    assert len(bytes.fromhex(key.read_text().strip())) == 32
    (line,) = [ln for ln in out.splitlines() if ln.lstrip().startswith("key:")]
    assert str(key) in line and "copy it off this host" in line, out
    assert "replica" not in line  # (SQLite: no service replicas to copy it to)
    # the key is kept across `meta backup-key` and signs the first backup
    made = ckptfs("meta", "backup-key", str(vol)).stdout
    assert made.startswith("have the backup key"), made
    m = json.loads(ckptfs("meta", "backup", str(vol), "--json").stdout)
    from fusefs.maint import backup as bk

    assert bk.verify(m, bk.read_key(str(key)))


def test_restore_needs_the_key_or_no_verify(tmp_path):
    """`meta restore` with neither --key nor --no-verify refuses in one line naming both,
    and writes nothing; --no-verify restores with one warning line."""
    import shutil

    vol = tmp_path / "vol"
    ckptfs("format", str(vol))
    src = tmp_path / "src"
    src.write_bytes(os.urandom(200_000))
    ckptfs("put", str(vol), str(src), "/f.bin")
    ckptfs("meta", "backup", str(vol))
    shutil.rmtree(vol)
    node_args = [a for i in range(4) for a in ("--node", f"dir:{tmp_path}/vol.nodes/n{i}")]

    new = tmp_path / "new"
    proc = ckptfs("meta", "restore", str(new), *node_args, check=False)
    _assert_clean_error(proc, "--key FILE", "--no-verify")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout == "" and not new.exists()
    both = ckptfs("meta", "restore", str(new), *node_args, "--no-verify", "--key", str(src),
                  check=False)  # fmt: skip
    _assert_clean_error(both, "not both")
    assert not new.exists()

    proc = ckptfs("meta", "restore", str(new), *node_args, "--no-verify", "--json")
    (warning,) = proc.stderr.splitlines()
    assert warning.startswith("ckptfs: warning: --no-verify") and "not verified" in warning
    rep = json.loads(proc.stdout)
    assert rep["verified"] is False and rep["missing_chunks"] == []
    assert not (new / "backup.key").exists()  # no key given, none invented
    ckptfs("get", str(new), "/f.bin", str(tmp_path / "back"))
    assert (tmp_path / "back").read_bytes() == src.read_bytes()


def test_meta_serve_errors_raised_inside_nurseries_are_one_line(tmp_path, pg_url):
    """trio >= 0.25 raises what fails inside a nursery as an exception group: a taken
    --listen port and a database that refuses still print one line, never a traceback."""
    import socket

    vol = str(tmp_path / "vol")
    ckptfs("format", vol, "--nodes", "2")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = ckptfs("meta", "serve", vol, "--listen", f"127.0.0.1:{port}", check=False)
    _assert_clean_error(proc, f"cannot listen on 127.0.0.1:{port}", "in use")
    assert "Errno" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    missing = pg_url.rsplit("/", 1)[0] + "/no_such_database"
    proc = ckptfs("meta", "serve", vol, "--db", missing, "--listen", "127.0.0.1:0", check=False)
    _assert_clean_error(proc, "no_such_database")
