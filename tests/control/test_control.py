"""The authenticated control channel, over real sockets."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from nonstop.control import ControlServer, connect, new_secret
from nonstop.errors import AuthError, UsageError


@pytest.fixture
def server() -> Iterator[tuple[ControlServer, bytes, list[str]]]:
    secret = new_secret()
    refused: list[str] = []
    srv = ControlServer(
        host="127.0.0.1", port=0, secret=secret, on_refused=lambda p, why: refused.append(why)
    )
    yield srv, secret, refused
    srv.close()


def _wait_for(pred, timeout: float = 2.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_messages_flow_both_ways(server: tuple[ControlServer, bytes, list[str]]) -> None:
    srv, secret, _ = server
    client = connect(srv.address, secret, {"role": "worker", "spawn_id": 1})
    kind, chan, _ = srv.events.get(timeout=2)
    assert kind == "open" and chan.hello == {"role": "worker", "spawn_id": 1}
    client.send({"t": "step", "step": 3})
    assert srv.events.get(timeout=2)[2] == {"t": "step", "step": 3}
    chan.send({"t": "rebuild", "gen": 2})
    assert client.recv() == {"t": "rebuild", "gen": 2}
    client.close()
    assert srv.events.get(timeout=2)[0] == "close"


def test_wrong_secret_is_refused_and_logged(server: tuple[ControlServer, bytes, list[str]]) -> None:
    srv, _, refused = server
    with pytest.raises(AuthError, match="authentication failed"):
        connect(srv.address, new_secret(), {"role": "worker"})
    assert _wait_for(lambda: refused == ["wrong job secret"])
    assert srv.events.empty()


def test_client_refuses_an_impostor_server() -> None:
    impostor = ControlServer(host="127.0.0.1", port=0, secret=new_secret())
    try:
        with pytest.raises(AuthError):
            connect(impostor.address, new_secret(), {})
    finally:
        impostor.close()


def test_unauthenticated_garbage_is_refused(server: tuple[ControlServer, bytes, list[str]]) -> None:
    srv, _, refused = server
    with socket.create_connection(srv.address) as s:
        s.recv(4096)  # the nonce
        s.sendall(struct.pack(">I", 9) + b"not json!")
        s.settimeout(2)
        assert s.recv(4096) == b""  # the server hung up without a word
    assert _wait_for(lambda: len(refused) == 1)
    assert srv.events.empty()


def test_tampered_frame_drops_the_connection(server: tuple[ControlServer, bytes, list[str]]) -> None:
    srv, secret, _ = server
    client = connect(srv.address, secret, {"spawn_id": 0})
    assert srv.events.get(timeout=2)[0] == "open"
    payload = json.dumps({"t": "step", "step": 999}).encode()
    client._sock.sendall(struct.pack(">I", len(payload)) + b"\0" * 32 + payload)  # forged MAC
    kind, _, msg = srv.events.get(timeout=2)
    assert kind == "close" and msg is None


def test_busy_port_is_a_usage_error(server: tuple[ControlServer, bytes, list[str]]) -> None:
    srv, secret, _ = server
    with pytest.raises(UsageError, match="already in use: pick another with --port"):
        ControlServer(host="127.0.0.1", port=srv.address[1], secret=secret)


def test_binds_only_the_given_address(server: tuple[ControlServer, bytes, list[str]]) -> None:
    srv, _, _ = server
    assert srv.address[0] == "127.0.0.1"
