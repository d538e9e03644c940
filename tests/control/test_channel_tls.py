"""``--tls`` on the control channel and the data plane: real listeners and clients over TLS, the
bytes on the wire, a man in the middle (terminating TLS, or stripping it), clients of the wrong
kind, and a real multi-process demo run with ``--tls``."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nonstop.control.channel import BLOB, _recv_plain, _send_plain, connect, new_secret
from nonstop.control.listener import ControlServer
from nonstop.errors import AuthError, ControlError
from tests.tlscerts import Relay, make_ca, make_leaf, pump

SECRET = new_secret()
PAYLOAD = b"THE-WEIGHTS-0123456789" * 64


@pytest.fixture(params=[True, False], ids=["tls", "plain"])
def server(request: pytest.FixtureRequest) -> Iterator[ControlServer]:
    srv = ControlServer(host="127.0.0.1", port=0, secret=SECRET, purpose="data", tls=request.param)
    yield srv
    srv.close()


def _open(srv: ControlServer, addr: tuple[str, int] | None = None, **kw: object) -> object:
    return connect(addr or srv.address, SECRET, {"role": "t"}, purpose="data", timeout=5.0, **kw)  # type: ignore[arg-type]


def _echo_once(srv: ControlServer) -> None:
    """Answer the next message with its JSON and blob."""
    while True:
        kind, ch, msg = srv.events.get(timeout=10)
        if kind == "msg":
            assert msg is not None
            blob = msg.pop(BLOB, None)
            ch.send({"echo": msg}, blob=None if blob is None else bytes(blob))
            return


def test_frames_round_trip(server: ControlServer) -> None:
    ch = connect(server.address, SECRET, {"role": "t"}, purpose="data", timeout=5.0)
    try:
        for i in range(3):
            ch.send({"i": i}, blob=PAYLOAD * (i + 1))
            _echo_once(server)
            reply = ch.recv()
            assert reply["echo"] == {"i": i} and bytes(reply[BLOB]) == PAYLOAD * (i + 1)
    finally:
        ch.close()


def test_the_wire_carries_no_plaintext_with_tls(server: ControlServer) -> None:
    tls = server._tls is not None
    relay = Relay(server.address)
    try:
        ch = connect(relay.address, SECRET, {"role": "t"}, purpose="data", timeout=5.0)
        ch.send({"note": "a-known-json-value"}, blob=PAYLOAD)
        _echo_once(server)
        assert bytes(ch.recv()[BLOB]) == PAYLOAD
        ch.close()
        time.sleep(0.1)
        seen = bytes(relay.seen)
        assert (PAYLOAD[:22] in seen) is not tls
        assert (b"a-known-json-value" in seen) is not tls
        assert (b'"hello"' in seen) is not tls  # the handshake too, but for the preamble
        if not tls:  # without --tls, the bytes of before: the listener's nonce comes first
            assert seen[4:14] == b'{"nonce": '
        else:
            assert seen[4:].startswith(b'{"tls": "nonstop/v1"}')
    finally:
        relay.close()


def _mitm(target: tuple[str, int], face_tls: bool, cert_dir: Path) -> tuple[socket.socket, list[bytes]]:
    """A man in the middle who talks TLS to the listener and, to the client, TLS with its own
    certificate (``face_tls``) or plain (a downgrade). Returns its listening socket."""
    ca = make_ca(cert_dir, "mitm-ca")
    cert, key = make_leaf(cert_dir, "mitm", ca, cn="nonstop-ephemeral")
    face = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    face.load_cert_chain(str(cert), str(key))
    up_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    up_ctx.check_hostname, up_ctx.verify_mode = False, ssl.CERT_NONE
    srv = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def run() -> None:
        c, _ = srv.accept()
        up = socket.create_connection(target)
        pre = _recv_plain(up, time.monotonic() + 5)
        up_s = up_ctx.wrap_socket(up)
        if face_tls:
            _send_plain(c, pre)
            c = face.wrap_socket(c, server_side=True)
        threading.Thread(target=pump, args=(c, up_s, seen.append), daemon=True).start()
        pump(up_s, c, seen.append)

    threading.Thread(target=run, daemon=True).start()
    return srv, seen


@pytest.mark.parametrize("face_tls", [True, False], ids=["terminates-tls", "strips-tls"])
def test_a_man_in_the_middle_is_refused(face_tls: bool, tmp_path: Path) -> None:
    refused: list[str] = []
    srv = ControlServer(
        host="127.0.0.1", port=0, secret=SECRET, purpose="data", tls=True,
        on_refused=lambda peer, why: refused.append(why),
    )  # fmt: skip
    mitm, _ = _mitm(srv.address, face_tls, tmp_path)
    try:
        with pytest.raises(AuthError, match="refused the connection: authentication failed"):
            connect(mitm.getsockname()[:2], SECRET, {"role": "t"}, purpose="data", timeout=5.0)
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            time.sleep(0.02)
        assert refused and "man in the middle" in refused[0]
        assert srv.events.empty()  # nothing reached the owner of the listener
    finally:
        mitm.close()
        srv.close()


def test_clients_of_the_wrong_kind_fail_at_once_and_clearly() -> None:
    plain = ControlServer(host="127.0.0.1", port=0, secret=SECRET, purpose="data", tls=False)
    tls = ControlServer(host="127.0.0.1", port=0, secret=SECRET, purpose="data", tls=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(ControlError, match="does not use TLS, but this process requires it"):
            _open(plain, tls=True)
        with pytest.raises(ControlError, match=r"uses TLS \(its job runs with --tls\).*off"):
            _open(tls, tls=False)
        assert time.monotonic() - t0 < 2.0  # no wait on a silent peer
        # a client with no setting follows the listener, either way
        for srv in (plain, tls):
            ch = _open(srv)
            ch.close()  # type: ignore[attr-defined]
    finally:
        plain.close()
        tls.close()


def test_a_tls_client_speaking_plain_at_a_tls_listener_is_refused_in_time() -> None:
    """An old (or hostile) client that ignores the preamble and talks plain handshake: the
    listener's TLS handshake fails and the connection is refused, not held."""
    refused: list[str] = []
    srv = ControlServer(
        host="127.0.0.1", port=0, secret=SECRET, tls=True, on_refused=lambda peer, why: refused.append(why)
    )
    try:
        s = socket.create_connection(srv.address, timeout=5)
        _recv_plain(s, time.monotonic() + 5)
        _send_plain(s, {"nonce": "00" * 16, "mac": "00" * 32, "hello": {}})
        s.settimeout(5)
        t0 = time.monotonic()
        try:
            assert s.recv(100) == b""  # closed ...
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < 2.0  # ... at once
        s.close()
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            time.sleep(0.02)
        assert refused and "TLS handshake failed" in refused[0]
    finally:
        srv.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_with_tls_recovers_bitwise(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "nonstop.cli", "demo", "--nproc", "2", "--steps", "20", "--model", "tiny"]
    cmd += ["--fail", "kill:rank=1,step=8", "--tls", "--verify", "--job-dir", str(tmp_path / "demo")]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["equal"] is True
    # the job's listeners spoke TLS: its processes inherited NONSTOP_TLS=1
    log = (tmp_path / "demo" / "run" / "events.jsonl").read_text()
    assert "refused" not in log
