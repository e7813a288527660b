"""Token files and the service's limits on authenticated connections (audit 3.12).

A token file group or others may access is refused, by clients and by `meta serve`
alike, in one line naming the file and the fix; an authenticated connection idle past
the idle timeout is closed (the client reconnects on its next call); past the cap on
authenticated connections the least recently active idle one makes room."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from fusefs.cli.service import ensure_token
from fusefs.client.volume import Volume, VolumeError
from metadata.client import connect
from metadata.engine import MetaError
from metadata.wire.protocol import PROTO_VERSION, FrameDecoder, decode, encode_frame
from tests.fixtures.service import in_process_service

TOKEN = "a-token-of-at-least-sixteen-characters"


def _service(vol: str, **kw: object):
    """A MetaService over the volume's SQLite engine, in this process."""
    return in_process_service(vol, TOKEN, **kw)


def _authed(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(encode_frame({"proto": PROTO_VERSION, "token": TOKEN}))
    assert _frame(s)["ok"] is True
    return s


def _frame(s: socket.socket) -> object:
    dec = FrameDecoder()
    while True:
        data = s.recv(65536)
        if not data:
            return None
        frames = dec.feed(data)
        if frames:
            return decode(frames[0])


def _closed(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


@pytest.fixture
def vol(tmp_path) -> str:
    path = str(tmp_path / "vol")
    Volume.create(path, nodes=2).close()
    return path


def test_a_token_file_others_may_read_is_refused_by_clients(tmp_path, monkeypatch):
    tok = tmp_path / "tok"
    tok.write_text(TOKEN + "\n")
    os.chmod(tok, 0o644)
    for how in ("url", "env"):
        if how == "env":
            monkeypatch.setenv("CKPTFS_TOKEN_FILE", str(tok))
            url = "ckptfs://127.0.0.1:1?retry=0"
        else:
            url = f"ckptfs://127.0.0.1:1?token_file={tok}&retry=0"
        with pytest.raises(MetaError) as e:
            connect(url)
        msg = str(e.value)
        assert str(tok) in msg and "chmod 600" in msg and "\n" not in msg, msg
    os.chmod(tok, 0o600)  # the fix the message names is enough: now it is the port that fails
    with pytest.raises(MetaError, match="127.0.0.1:1"):
        connect(f"ckptfs://127.0.0.1:1?token_file={tok}&retry=0")


def test_meta_serve_refuses_a_token_file_others_may_read(vol):
    tok = os.path.join(vol, "meta.token")
    ensure_token(tok)  # created 0600: fine
    os.chmod(tok, 0o640)
    with pytest.raises(VolumeError, match="chmod 600"):
        ensure_token(tok)
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "meta", "serve", vol, "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and tok in lines[0] and f"chmod 600 {tok}" in lines[0], p.stderr


def test_idle_authenticated_connections_are_closed_and_clients_reconnect(vol):
    with _service(vol, idle_timeout=0.5) as (svc, port):
        raw = _authed(port)
        assert _closed(raw, 10), "an idle authenticated connection stayed open"
        raw.close()
        client = connect(f"ckptfs://127.0.0.1:{port}", token=TOKEN)
        try:
            assert client.call("ping") is None
            time.sleep(1.5)  # closed meanwhile; the next call reconnects on its own
            assert client.call("ping") is None
            assert client.getattr(1).is_dir
            assert client.reconnects >= 1
        finally:
            client.close()
        assert svc.stats["idle_closed"] >= 2


def test_past_the_connection_cap_the_least_recently_active_idle_one_goes(vol):
    with _service(vol, max_connections=3) as (svc, port):
        a, b, c = (_authed(port) for _ in range(3))
        a.sendall(encode_frame([1, "ping", [], {}, None]))  # a is now the most recent
        assert _frame(a) is not None
        client = connect(f"ckptfs://127.0.0.1:{port}", token=TOKEN)
        try:
            assert client.call("ping") is None
            assert _closed(b, 10), "the least recently active idle connection stayed open"
            assert not _closed(a, 0.3) and not _closed(c, 0.3)
            assert svc.stats["evicted"] == 1 and len(svc._authed) == 3
        finally:
            client.close()
            for s in (a, b, c):
                s.close()


def test_past_the_connection_cap_with_none_idle_the_newcomer_is_refused(vol):
    with _service(vol, max_connections=1) as (svc, port):
        busy = _authed(port)
        svc.engine.begin("job", 1, 2)  # type: ignore[attr-defined]
        # a request that stays in flight: a wait younger than waiters.EVICT_AGE (an older
        # one may be closed to make room: test_waiters.py)
        busy.sendall(encode_frame([1, "wait_published", ["job", 1], {"timeout": 30}, None]))
        time.sleep(0.3)
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(encode_frame({"proto": PROTO_VERSION, "token": TOKEN}))
        reply = _frame(s)
        assert isinstance(reply, dict) and reply["ok"] is False, reply
        assert "--max-connections" in reply["error"] and svc.stats["refused_full"] == 1
        s.close()
        busy.close()
