"""The mount as a daemon and as a multi-user filesystem: permissions, lifecycle, crashes."""

from __future__ import annotations

import errno
import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import time

import pytest

from tests.fixtures.mount import is_mounted

MiB = 2**20
NOBODY = pwd.getpwnam("nobody")

# The test interpreter may live where nobody cannot read it (/root/.pyenv): use the system one.
OTHER_PYTHON = next(
    (p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None
)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or OTHER_PYTHON is None, reason="needs root and a system python3 for nobody"
)


@pytest.fixture
def public_dir():
    """A directory other users can traverse (pytest's tmp dirs are 0700 for root)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="ckptfs-mnt-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_nobody(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run python code as nobody; it prints the errno name of its failure, or OK."""

    def drop() -> None:
        os.setgroups([])
        os.setgid(NOBODY.pw_gid)
        os.setuid(NOBODY.pw_uid)

    wrapper = (
        "import errno, os, sys\n"
        "try:\n" + "".join(f"    {line}\n" for line in code.splitlines()) + "    print('OK')\n"
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno])\n"
    )
    return subprocess.run(
        [OTHER_PYTHON, "-S", "-c", wrapper, *args],
        preexec_fn=drop,
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )


@needs_root
def test_allow_other_enforces_modes(public_dir, new_volume, mount_factory):
    m = mount_factory(new_volume(), os.path.join(public_dir, "mnt"), "--allow-other")
    os.chmod(m.mp, 0o755)
    secret = m.path("secret")
    with open(secret, "wb") as f:
        f.write(b"root only")
    os.chmod(secret, 0o600)
    public = m.path("public")
    with open(public, "wb") as f:
        f.write(b"everyone")
    os.chmod(public, 0o644)
    assert _as_nobody("open(sys.argv[1], 'rb').read()", secret).stdout.strip() == "EACCES"
    assert _as_nobody("open(sys.argv[1], 'rb').read()", public).stdout.strip() == "OK"
    assert _as_nobody("open(sys.argv[1], 'ab')", public).stdout.strip() == "EACCES"
    assert _as_nobody("open(sys.argv[1] + '/new', 'wb')", m.mp).stdout.strip() == "EACCES"


@needs_root
def test_without_allow_other_other_users_are_out(public_dir, new_volume, mount_factory):
    mounted = mount_factory(new_volume(), os.path.join(public_dir, "mnt"))
    os.chmod(mounted.mp, 0o755)
    with open(mounted.path("f"), "wb") as f:
        f.write(b"x")
    os.chmod(mounted.path("f"), 0o644)
    res = _as_nobody("os.stat(sys.argv[1])", mounted.path("f"))
    assert res.stdout.strip() == "EACCES"


@needs_root
def test_chmod_chown_rules(public_dir, new_volume, mount_factory):
    m = mount_factory(new_volume(), os.path.join(public_dir, "mnt"), "--allow-other")
    os.chmod(m.mp, 0o777)
    mine = m.path("nobodys")
    assert _as_nobody("open(sys.argv[1], 'wb').write(b'n')", mine).stdout.strip() == "OK"
    st = os.stat(mine)
    assert (st.st_uid, st.st_gid) == (NOBODY.pw_uid, NOBODY.pw_gid)  # owner = the caller
    assert _as_nobody("os.chmod(sys.argv[1], 0o600)", mine).stdout.strip() == "OK"
    assert os.stat(mine).st_mode & 0o777 == 0o600
    # only root may give a file away
    assert _as_nobody("os.chown(sys.argv[1], 0, -1)", mine).stdout.strip() == "EPERM"
    roots = m.path("roots")
    open(roots, "wb").close()
    os.chmod(roots, 0o666)
    assert _as_nobody("os.chmod(sys.argv[1], 0o777)", roots).stdout.strip() == "EPERM"
    assert _as_nobody("os.chown(sys.argv[1], 65534, -1)", roots).stdout.strip() == "EPERM"
    os.chown(roots, NOBODY.pw_uid, NOBODY.pw_gid)  # root may
    st = os.stat(roots)
    assert (st.st_uid, st.st_gid) == (NOBODY.pw_uid, NOBODY.pw_gid)
    os.utime(roots, ns=(1_000_000_000, 2_000_000_000))
    assert os.stat(roots).st_mtime_ns == 2_000_000_000


@needs_root
def test_setgid_directory_hands_down_its_group(public_dir, new_volume, mount_factory):
    m = mount_factory(new_volume(), os.path.join(public_dir, "mnt"), "--allow-other")
    os.chmod(m.mp, 0o777)
    shared, plain = m.path("shared"), m.path("plain")
    for d in (shared, plain):
        os.mkdir(d)
        os.chown(d, 0, NOBODY.pw_gid)
        os.chmod(d, 0o777)
    os.chmod(shared, 0o2777)
    for d in (shared, plain):
        open(os.path.join(d, "f"), "wb").close()  # root, primary group 0
        os.mkdir(os.path.join(d, "sub"))
        os.symlink("f", os.path.join(d, "ln"))
    for name in ("f", "sub", "ln"):
        st = os.lstat(os.path.join(shared, name))
        assert (st.st_uid, st.st_gid) == (0, NOBODY.pw_gid), name  # the directory's group
        st = os.lstat(os.path.join(plain, name))
        assert (st.st_uid, st.st_gid) == (0, 0), name  # the creator's group
    assert os.stat(os.path.join(shared, "sub")).st_mode & 0o2000  # passed on to subdirectories
    assert not os.stat(os.path.join(plain, "sub")).st_mode & 0o2000
    assert not os.stat(os.path.join(shared, "f")).st_mode & 0o2000
    os.chmod(os.path.join(shared, "sub"), 0o2777)
    deeper = os.path.join(shared, "sub", "deeper")
    assert _as_nobody("os.mkdir(sys.argv[1])", deeper).stdout == "OK\n"
    st = os.stat(deeper)
    assert (st.st_uid, st.st_gid, bool(st.st_mode & 0o2000)) == (NOBODY.pw_uid, NOBODY.pw_gid, True)
    m.unmount()
    m = mount_factory(m.volume, m.mp, "--allow-other")
    st = os.stat(deeper)
    assert (st.st_gid, bool(st.st_mode & 0o2000)) == (NOBODY.pw_gid, True)


def test_kill9_leaves_disconnected_mount_that_umount_cleans(new_volume, mount_factory):
    vol = new_volume()
    m = mount_factory(vol, "mnt")
    closed = {f"f{i}": os.urandom(i * 700_000 + 1) for i in range(6)}
    for name, data in closed.items():
        with open(m.path(name), "wb") as f:
            f.write(data)
    os.mkdir(m.path("dir"))
    with open(m.path("dir", "g"), "wb") as f:
        f.write(b"in a dir")
    pending = open(m.path("open-at-kill"), "wb")  # never closed: may be lost, must not break
    pending.write(os.urandom(MiB))
    pending.flush()
    m.proc.send_signal(signal.SIGKILL)
    m.proc.wait(timeout=30)
    with pytest.raises(OSError) as e:
        os.stat(m.mp)
    assert e.value.errno == errno.ENOTCONN  # "Transport endpoint is not connected"
    try:
        pending.close()
    except OSError:
        pass
    again = m.cli("mount", vol, m.mp)  # a disconnected mountpoint is a clear error
    assert again.returncode != 0 and "umount" in again.stderr and "Traceback" not in again.stderr
    res = m.cli("umount", m.mp)
    assert res.returncode == 0, res.stderr
    assert not is_mounted(m.mp)
    m2 = mount_factory(vol, "mnt")
    for name, data in closed.items():
        with open(m2.path(name), "rb") as f:
            assert f.read() == data, name
    with open(m2.path("dir", "g"), "rb") as f:
        assert f.read() == b"in a dir"


def test_sigterm_unmounts_cleanly_and_publishes_open_files(new_volume, mount_factory):
    vol = new_volume()
    m = mount_factory(vol, "mnt")
    f = open(m.path("open"), "wb")
    f.write(b"written, not closed")
    f.flush()
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=30) == 0
    assert not is_mounted(m.mp)
    try:
        f.close()
    except OSError:
        pass
    m2 = mount_factory(vol, "mnt2")
    with open(m2.path("open"), "rb") as g:
        assert g.read() == b"written, not closed"


def test_busy_mountpoint_and_bad_input(new_volume, mounted, tmp_path):
    res = mounted.cli("mount", mounted.volume, mounted.mp)
    assert res.returncode != 0 and "already a mount point" in res.stderr
    assert "Traceback" not in res.stderr
    res = mounted.cli("mount", str(tmp_path / "no-volume"), str(tmp_path))
    assert res.returncode != 0 and "no volume" in res.stderr and "Traceback" not in res.stderr
    res = mounted.cli("mount", mounted.volume, str(tmp_path / "missing-dir"))
    assert res.returncode != 0 and "does not exist" in res.stderr
    res = mounted.cli("umount", str(tmp_path))
    assert res.returncode != 0 and "not mounted" in res.stderr
    with open(mounted.path("busy"), "wb"):
        res = mounted.cli("umount", mounted.mp)
        assert res.returncode != 0 and "busy" in res.stderr and "Traceback" not in res.stderr
    assert is_mounted(mounted.mp)


def test_background_default_volume_and_umount(mount_env, tmp_path):
    mp = str(tmp_path / "bg")
    os.mkdir(mp)
    res = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "mount", mp, "--background"],
        env=mount_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert res.returncode == 0, res.stderr
        assert is_mounted(mp)  # ready when the command returned
        with open(os.path.join(mp, "hello"), "wb") as f:
            f.write(b"default volume")
        default = os.path.join(mount_env["XDG_DATA_HOME"], "ckptfs", "default")
        assert os.path.exists(os.path.join(default, "volume.json"))
        res = subprocess.run(
            [sys.executable, "-m", "fusefs.cli", "umount", "--flush", mp],
            env=mount_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert not is_mounted(mp)
    finally:
        if is_mounted(mp):
            subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True, timeout=30)
            time.sleep(0.5)
    ls = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "ls", default],
        env=mount_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "hello" in ls.stdout


def test_fifos_sockets_and_device_nodes(public_dir, new_volume, mount_factory):
    """mknod(2)'s node types: a FIFO carries data through the kernel's pipe, a socket can
    be bound, a device node keeps its number; each survives a remount, lists with its
    type, and goes away with unlink. Only root makes a device node; a type no file can
    have is EINVAL."""
    import socket
    import stat
    import threading

    vol = new_volume()
    m = mount_factory(vol, os.path.join(public_dir, "mnt"), "--allow-other")
    os.chmod(m.mp, 0o777)
    fifo, sock, dev = m.path("fifo"), m.path("sock"), m.path("null")
    os.mkfifo(fifo, 0o640)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    with open(fifo, "wb") as w:
        w.write(b"through the pipe")
    reader.join(timeout=30)
    assert got == [b"through the pipe"]
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(sock)
    os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    with pytest.raises(OSError) as e:
        os.mknod(m.path("bad"), 0o170000 | 0o600)  # S_IFMT itself: no such type
    assert e.value.errno == errno.EINVAL
    assert _as_nobody(
        "import stat\nos.mknod(sys.argv[1], stat.S_IFBLK | 0o600, os.makedev(8, 0))",
        m.path("nobodys-dev"),
    ).stdout.strip() == "EPERM"  # fmt: skip
    assert _as_nobody("os.mkfifo(sys.argv[1])", m.path("nobodys-fifo")).stdout.strip() == "OK"
    m.unmount()
    m = mount_factory(vol, os.path.join(public_dir, "mnt"))
    kinds = {e.name: stat.S_IFMT(e.stat(follow_symlinks=False).st_mode) for e in os.scandir(m.mp)}
    assert kinds == {"fifo": stat.S_IFIFO, "sock": stat.S_IFSOCK, "null": stat.S_IFCHR,
                     "nobodys-fifo": stat.S_IFIFO}  # fmt: skip
    st = os.lstat(dev)
    assert (st.st_rdev, st.st_mode & 0o777, st.st_size) == (os.makedev(1, 3), 0o600, 0)
    assert os.lstat(fifo).st_mode & 0o777 == 0o640
    for p in (fifo, sock, dev):
        os.unlink(p)
    assert sorted(os.listdir(m.mp)) == ["nobodys-fifo"]


def test_writes_by_others_clear_setuid_and_setgid(public_dir, new_volume, mount_factory):
    """A write or truncating open by a process without CAP_FSETID clears setuid, and setgid
    when group-executable or when the writer is not in the file's group, through
    write-only (direct I/O) and read-write handles alike, as on ext4. Root's writes keep
    them. And trusted.* attribute names are not listed to other users."""
    m = mount_factory(new_volume(), os.path.join(public_dir, "mnt"), "--allow-other")
    os.chmod(m.mp, 0o777)
    cases = [
        ("open(sys.argv[1], 'r+b').write(b'n')", 0o6777, 0o777),  # read-write handle
        ("open(sys.argv[1], 'wb').write(b'n')", 0o6777, 0o777),  # O_WRONLY|O_TRUNC
        ("os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_TRUNC))", 0o4777, 0o777),
        ("fd = os.open(sys.argv[1], os.O_WRONLY)\nos.pwrite(fd, b'n', 5)", 0o2767, 0o767),
        ("fd = os.open(sys.argv[1], os.O_RDWR)\nos.pwrite(fd, b'n', 5)", 0o2767, 0o767),
        # setgid without group-execute: the kernel clears setuid only, the daemon the rest
        ("fd = os.open(sys.argv[1], os.O_RDWR)\nos.write(fd, b'n')", 0o6666, 0o666),
        ("os.truncate(sys.argv[1], 2)", 0o6666, 0o666),
        ("os.truncate(sys.argv[1], 2)", 0o2666, 0o666),
        ("os.ftruncate(os.open(sys.argv[1], os.O_RDWR), 3)", 0o6666, 0o666),
    ]
    for i, (code, before, after) in enumerate(cases):
        p = m.path(f"f{i}")
        _write_root(p, b"0123456789", before)
        assert _as_nobody(code, p).stdout.strip() == "OK", code
        assert os.stat(p).st_mode & 0o7777 == after, (code, oct(os.stat(p).st_mode))
    p = m.path("in-group")  # a writer in the file's group keeps setgid without group-execute
    _write_root(p, b"0123456789", 0o6666)
    os.chown(p, 0, NOBODY.pw_gid)
    os.chmod(p, 0o6666)
    assert _as_nobody("os.truncate(sys.argv[1], 2)", p).stdout.strip() == "OK"
    assert (os.stat(p).st_mode & 0o7777, os.stat(p).st_size) == (0o2666, 2)
    p = m.path("roots")
    _write_root(p, b"x", 0o6755)
    with open(p, "r+b") as f:
        f.write(b"y")
    assert os.stat(p).st_mode & 0o7777 == 0o6755  # root has CAP_FSETID
    os.chmod(p, 0o644)
    os.setxattr(p, "trusted.secret", b"s")
    os.setxattr(p, "user.plain", b"p")
    code = "print(sorted(os.listxattr(sys.argv[1])))"
    assert _as_nobody(code, p).stdout.split("\n")[0] == "['user.plain']"
    assert sorted(os.listxattr(p)) == ["trusted.secret", "user.plain"]


def _write_root(path: str, data: bytes, mode: int) -> None:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


# -- the permission matrix, against the local disk -----------------------------------------
OWNER, GROUP = 1000, 2000  # every matrix file's owner and group
MATRIX_USERS = {  # name: (uid, gid, supplementary groups)
    "root": (0, 0, [0]),
    "owner": (OWNER, OWNER, [OWNER]),
    "member": (1001, 1001, [1001, GROUP]),
    "other": (1002, 1002, [1002]),
}
MATRIX_MODES = (0o000, 0o200, 0o400, 0o600, 0o604, 0o640, 0o660, 0o666,
                0o4766, 0o2766, 0o6766, 0o2746, 0o6777)  # fmt: skip
MATRIX_OP_NAMES = ("read", "write", "rdwr", "trunc_open", "append", "truncate", "ftruncate",
                   "chmod", "chmod_sgid", "chgrp", "chgrp_own", "chown", "utime_now",
                   "utime_set", "unlink", "rename", "link", "setxattr", "getxattr",
                   "access_w")  # fmt: skip
# The child each user runs: the named ops on the given paths, one errno name (or OK) each.
MATRIX_OPS = """
import errno, json, os, sys
def fd_op(p, flags, then=None):
    fd = os.open(p, flags)
    try:
        if then:
            then(fd)
    finally:
        os.close(fd)
OPS = {
    "read": lambda p: fd_op(p, os.O_RDONLY),
    "write": lambda p: fd_op(p, os.O_WRONLY, lambda fd: os.write(fd, b"w")),
    "rdwr": lambda p: fd_op(p, os.O_RDWR, lambda fd: os.pwrite(fd, b"r", 1)),
    "trunc_open": lambda p: fd_op(p, os.O_WRONLY | os.O_TRUNC),
    "append": lambda p: fd_op(p, os.O_WRONLY | os.O_APPEND, lambda fd: os.write(fd, b"a")),
    "truncate": lambda p: os.truncate(p, 1),
    "ftruncate": lambda p: fd_op(p, os.O_RDWR, lambda fd: os.ftruncate(fd, 2)),
    "chmod": lambda p: os.chmod(p, 0o644),
    "chmod_sgid": lambda p: os.chmod(p, 0o2755),
    "chgrp": lambda p: os.chown(p, -1, 2000),
    "chgrp_own": lambda p: os.chown(p, -1, os.getgid()),
    "chown": lambda p: os.chown(p, os.getuid(), -1),
    "utime_now": lambda p: os.utime(p, None),
    "utime_set": lambda p: os.utime(p, (1, 2)),
    "unlink": lambda p: os.unlink(p),
    "rename": lambda p: os.rename(p, p + ".moved"),
    "link": lambda p: os.link(p, p + ".link"),
    "setxattr": lambda p: os.setxattr(p, "user.x", b"1"),
    "getxattr": lambda p: os.getxattr(p, "user.k"),
    "access_w": lambda p: None if os.access(p, os.W_OK) else (_ for _ in ()).throw(
        OSError(errno.EACCES, "no")),
}
out = []
for op, p in json.loads(sys.argv[1]):
    try:
        OPS[op](p)
        out.append("OK")
    except OSError as e:
        out.append(errno.errorcode.get(e.errno, str(e.errno)))
print(json.dumps(out))
"""


def _run_as(user: str, script: str, jobs: list) -> list[str]:
    """Run `script` with `jobs` as one of MATRIX_USERS: its errno name (or OK) per job."""
    uid, gid, groups = MATRIX_USERS[user]

    def drop() -> None:
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)

    run = subprocess.run(
        [OTHER_PYTHON, "-S", "-c", script, json.dumps(jobs)],
        preexec_fn=drop, capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _jobs(ops, modes, make) -> dict[str, list]:
    """Each user's cases, in order: make(user, op, mode) prepares one (as root) and
    returns its job for `_run_as`."""
    return {u: [make(u, op, mode) for op in ops for mode in modes] for u in MATRIX_USERS}


def _matrix(root: str) -> dict:
    """Run every op as every user on a fresh file of every mode under `root` (a sticky,
    world-writable directory of root's); the errno of each, and each file's state after."""
    os.chmod(root, 0o777)
    d = os.path.join(root, "sticky")
    os.mkdir(d)
    os.chmod(d, 0o1777)

    def make(user: str, op: str, mode: int) -> tuple:
        p = os.path.join(d, f"{user}-{op}-{mode:o}")
        with open(p, "wb") as f:
            f.write(b"0123")
        os.setxattr(p, "user.k", b"v")
        os.chown(p, OWNER, GROUP)
        os.chmod(p, mode)
        return (op, p)

    jobs = _jobs(MATRIX_OP_NAMES, MATRIX_MODES, make)
    results = {}
    for user in MATRIX_USERS:
        for (_op, p), res in zip(jobs[user], _run_as(user, MATRIX_OPS, jobs[user]), strict=True):
            rel = os.path.relpath(p, root)
            after = {}
            for q in (p, p + ".moved", p + ".link"):
                try:
                    st = os.lstat(q)
                    after[q[len(p) :] or "."] = (oct(st.st_mode), st.st_uid, st.st_gid,
                                                 st.st_size, st.st_nlink)  # fmt: skip
                except FileNotFoundError:
                    pass
            results[rel] = (res, after)
    return results


def _mount_vs_disk(matrix, public_dir, new_volume, mount_factory) -> int:
    """Run `matrix` on a reference directory of the local disk and on a fresh mount; every
    case must agree. Returns the number of cases."""
    m = mount_factory(new_volume(), os.path.join(public_dir, "mnt"), "--allow-other")
    ref = os.path.join(public_dir, "ref")
    os.mkdir(ref)
    want, got = matrix(ref), matrix(m.mp)
    diff = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    shown = sorted(diff.items())[:40]
    assert not diff, "\n".join(f"{k}: mount {g} disk {w}" for k, (g, w) in shown)
    return len(want)


@needs_root
def test_permission_matrix_matches_the_local_disk(public_dir, new_volume, mount_factory):
    """20 operations (opens, writes, truncates, chmod/chown, utimes, unlink/rename/link in a
    sticky directory, xattrs) by root, the owner, a group member and another user, each on
    a fresh file of 13 modes (setuid/setgid combinations among them): the mount must give
    the errno the local disk gives, and leave each file's mode, owner, size and links as
    the local disk leaves them, 1,040 cases."""
    cases = _mount_vs_disk(_matrix, public_dir, new_volume, mount_factory)
    assert cases == len(MATRIX_USERS) * len(MATRIX_OP_NAMES) * len(MATRIX_MODES) == 1040


DIR_MODES = (0o000, 0o555, 0o700, 0o711, 0o733, 0o755, 0o775, 0o777, 0o1777, 0o2775, 0o3777)
DIR_OP_NAMES = ("ls", "stat_f", "create", "mkdir", "unlink_f", "unlink_r", "rmdir",
                "rename_f", "rename_out", "chmod", "chgrp", "symlink", "link", "utime")  # fmt: skip
DIR_OPS = """
import errno, json, os, sys
OPS = {
    "ls": lambda d, o: os.listdir(d),
    "stat_f": lambda d, o: os.stat(d + "/f"),
    "create": lambda d, o: os.close(os.open(d + "/new", os.O_CREAT | os.O_WRONLY, 0o666)),
    "mkdir": lambda d, o: os.mkdir(d + "/newd", 0o777),
    "unlink_f": lambda d, o: os.unlink(d + "/f"),
    "unlink_r": lambda d, o: os.unlink(d + "/r"),
    "rmdir": lambda d, o: os.rmdir(d + "/s"),
    "rename_f": lambda d, o: os.rename(d + "/f", d + "/g"),
    "rename_out": lambda d, o: os.rename(d + "/f", o),
    "chmod": lambda d, o: os.chmod(d, 0o755),
    "chgrp": lambda d, o: os.chown(d, -1, 2000),
    "symlink": lambda d, o: os.symlink("f", d + "/l"),
    "link": lambda d, o: os.link(d + "/f", d + "/h"),
    "utime": lambda d, o: os.utime(d, None),
}
out = []
for op, d, o in json.loads(sys.argv[1]):
    try:
        OPS[op](d, o)
        out.append("OK")
    except OSError as e:
        out.append(errno.errorcode.get(e.errno, str(e.errno)))
print(json.dumps(out))
"""


def _dir_matrix(root: str) -> dict:
    """Every directory op as every user in a fresh directory of every mode (owned by
    OWNER:GROUP, holding OWNER's file f, root's file r and OWNER's empty directory s):
    the errno of each, then the directory's entries and their state."""
    os.chmod(root, 0o777)

    def make(user: str, op: str, mode: int) -> tuple:
        d = os.path.join(root, f"{user}-{op}-{mode:o}")
        os.mkdir(d)
        for name, owner in (("f", OWNER), ("r", 0)):
            with open(os.path.join(d, name), "wb") as f:
                f.write(b"x")
            os.chown(os.path.join(d, name), owner, GROUP)
        os.mkdir(os.path.join(d, "s"))
        os.chown(os.path.join(d, "s"), OWNER, GROUP)
        os.chown(d, OWNER, GROUP)
        os.chmod(d, mode)
        return (op, d, os.path.join(root, f"out-{user}-{op}-{mode:o}"))

    jobs = _jobs(DIR_OP_NAMES, DIR_MODES, make)
    results = {}
    for user in MATRIX_USERS:
        for (_op, d, o), res in zip(jobs[user], _run_as(user, DIR_OPS, jobs[user]), strict=True):
            after = {}
            for q in (d, o, *(os.path.join(d, n) for n in os.listdir(d))):
                try:
                    st = os.lstat(q)
                except FileNotFoundError:
                    continue
                size = None if stat.S_ISDIR(st.st_mode) else st.st_size  # ext4 dirs: 4096
                after[os.path.relpath(q, root)] = (oct(st.st_mode), st.st_uid, st.st_gid,
                                                   st.st_nlink, size)  # fmt: skip
            results[os.path.relpath(d, root)] = (res, after)
    return results


@needs_root
def test_directory_matrix_matches_the_local_disk(public_dir, new_volume, mount_factory):
    """14 directory operations (list, lookup, create, mkdir, unlink of the owner's and of
    root's file, rmdir, renames in and out, chmod, chgrp, symlink, link, utimes) by root,
    the owner, a group member and another user in directories of 11 modes (sticky and
    setgid among them): errno, entries, and each entry's mode, owner, group and links as
    on the local disk, 616 cases."""
    cases = _mount_vs_disk(_dir_matrix, public_dir, new_volume, mount_factory)
    assert cases == len(MATRIX_USERS) * len(DIR_OP_NAMES) * len(DIR_MODES) == 616
