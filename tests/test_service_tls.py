"""The metadata service over TLS: a real `ckptfs meta serve --tls-cert`, real clients."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from bench.servers.metaserve import self_signed
from fusefs.client.volume import Volume
from metadata.client import connect
from metadata.engine import MetaError
from metadata.wire.protocol import PROTO_VERSION, FrameDecoder, decode, encode_frame
from tests.test_checkpoints import FILES, rank_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def certs(tmp_path):
    return self_signed(str(tmp_path), "service"), self_signed(str(tmp_path), "stranger")


@pytest.fixture
def tls_served(tmp_path, meta_server, certs):
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    return meta_server(tmp_path / "vol", tls=certs[0])


def test_tls_pipelined_commits_from_threads_survive_a_service_kill(tls_served):
    """Many threads write through one TLS connection while its reader takes the answers;
    a SIGKILL of the service mid-step: the clients reconnect over TLS and finish."""
    job, world = "tls", 64
    c = connect(tls_served.url)
    assert c.tls is not None
    c.begin(job, 1, world)
    vol = Volume(c, c.get_config())
    vol.write_file("/over-tls", b"x" * 100_000)  # the data path's calls, through TLS
    errors: list[BaseException] = []

    def ranks(first: int) -> None:
        try:
            futs = c.submit_many(
                [("commit_rank", (job, 1, r, rank_files(r)), {}) for r in range(first, first + 4)]
                + [("stats", (), {})] * 50
            )  # fmt: skip
            for f in futs:
                f.result(timeout=60)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ranks, args=(4 * i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert c.step_state(job, 1)["state"] == "open"
    tls_served.kill()
    later = [threading.Thread(target=ranks, args=(4 * i,)) for i in range(8, 16)]
    for t in later:
        t.start()
    tls_served.restart()
    for t in later:
        t.join(timeout=120)
    assert not errors, errors
    assert c.reconnects >= 1
    assert c.wait_published(job, 1, 30)["state"] == "published"
    man = connect(tls_served.url).manifest(job, 1)
    assert len(man["files"]) == world * FILES
    assert vol.read_file("/over-tls") == b"x" * 100_000
    vol.close()


def test_tls_service_refuses_wrong_peers_and_keeps_serving(tmp_path, tls_served, certs):
    token = f"token_file={tls_served.token_file}"
    base = f"ckptfs://127.0.0.1:{tls_served.port}"
    good = connect(tls_served.url)
    before = good.stats().as_dict()
    # a client without TLS: told what to add
    with pytest.raises(MetaError) as e:
        connect(f"{base}?{token}")
    assert e.value.errno == errno.EPROTO and "speaks TLS: add ?ca=PATH" in str(e.value)
    # a client that trusts another certificate
    with pytest.raises(MetaError) as e:
        connect(f"{base}?{token}&ca={certs[1][0]}")
    assert e.value.errno == errno.EACCES and "not trusted" in str(e.value)
    # a plaintext hello with the right token is refused in plain text: the token needs TLS
    with open(tls_served.token_file) as f:
        hello = encode_frame({"proto": PROTO_VERSION, "token": f.read().strip()})
    with socket.create_connection(("127.0.0.1", tls_served.port), timeout=10) as s:
        s.sendall(hello)
        dec, frames = FrameDecoder(), []
        while not frames:
            frames = dec.feed(s.recv(65536))
        reply = decode(frames[0])
        assert reply["ok"] is False and reply["errno"] == errno.EPROTO
        assert "speaks TLS" in reply["error"]
    # a bad URL option
    with pytest.raises(MetaError) as e:
        connect(f"{base}?{token}&tls=maybe")
    assert e.value.errno == errno.EINVAL
    # the good client goes on, nothing changed
    assert good.stats().as_dict() == before
    good.begin("after", 1, 1)
    assert good.step_state("after", 1)["state"] == "open"
    good.close()
    # a TLS client against a service without TLS
    Volume.create(str(tmp_path / "plain"), nodes=2).close()
    from bench.servers.metaserve import MetaServer

    plain = MetaServer(str(tmp_path / "plain"))
    try:
        with pytest.raises(MetaError) as e:
            connect(f"{plain.url}&ca={certs[0][0]}")
        assert e.value.errno == errno.EPROTO and "does not speak TLS" in str(e.value)
        connect(plain.url).close()  # and it serves plain clients
    finally:
        plain.stop()


def test_tls_certificate_for_another_address_and_a_service_turning_tls_on(tmp_path, meta_server):
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    server = meta_server(tmp_path / "vol")
    plain = connect(server.url, retry_for=30)
    plain.begin("j", 1, 1)
    # the service comes back with TLS: the plain client stops at once, told why, instead
    # of retrying until retry_for runs out
    server.tls = self_signed(str(tmp_path), "elsewhere", address="127.0.0.2")
    server.restart()
    t0 = time.monotonic()
    with pytest.raises(MetaError) as e:
        plain.step_state("j", 1)
    assert e.value.errno == errno.EPROTO and "speaks TLS" in str(e.value)
    assert time.monotonic() - t0 < 20
    # its certificate names 127.0.0.2, the URL 127.0.0.1
    with pytest.raises(MetaError) as e:
        connect(server.url)
    assert e.value.errno == errno.EACCES and "does not name '127.0.0.1'" in str(e.value)


@pytest.mark.parametrize(
    "opts, says",
    [
        (["--tls-cert", "{cert}", "--tls-key", "{other_key}"], "cannot load certificate"),
        (["--tls-cert", "{dir}/missing.pem"], "no such file"),
        (["--tls-key", "{key}"], "--tls-key needs --tls-cert"),
    ],
)
def test_meta_serve_bad_tls_options_are_one_line_errors(tmp_path, certs, opts, says):
    Volume.create(str(tmp_path / "vol"), nodes=2).close()
    (cert, key), (_, other_key) = certs
    fill = {"cert": cert, "key": key, "other_key": other_key, "dir": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "meta", "serve", str(tmp_path / "vol"),
         "--listen", "127.0.0.1:0", *[o.format(**fill) for o in opts]],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1
    assert says in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""  # it never said it was serving
