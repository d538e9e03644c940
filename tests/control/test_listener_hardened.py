"""Listeners under attack and bad luck (issue 17, item 1 and part of 7), over real sockets.

Each test names the defect it guards against; every one failed on the code before it."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nonstop.control import ControlServer, ListenerLimits, connect, new_secret
from nonstop.control.channel import derive_key, etcd_password
from nonstop.control.listener import RefusalLimiter
from nonstop.errors import AuthError, ControlError, UsageError
from nonstop.replica.peer import FetchError, fetch

ROOT = Path(__file__).resolve().parents[2]


def _wait_for(pred, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _closed_by_peer(s: socket.socket, within: float) -> bool:
    """True when the peer closes ``s`` within ``within`` seconds (reads and drops what comes)."""
    s.settimeout(within)
    end = time.monotonic() + within
    try:
        while time.monotonic() < end:
            if s.recv(4096) == b"":
                return True
    except (TimeoutError, ConnectionResetError):
        return False
    return False


@pytest.fixture
def refusals() -> Iterator[tuple[ControlServer, bytes, list[str]]]:
    secret = new_secret()
    seen: list[str] = []
    srv = ControlServer(
        host="127.0.0.1",
        port=0,
        secret=secret,
        on_refused=lambda _p, why: seen.append(why),
        limits=ListenerLimits(max_pending=4, handshake_timeout_s=1.0),
    )
    yield srv, secret, seen
    srv.close()


_SERVER = textwrap.dedent(
    """
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    from nonstop.control import ControlServer
    srv = ControlServer(host="127.0.0.1", port=0, secret=sys.argv[1].encode())
    print(srv.address[1], flush=True)
    time.sleep(120)
    """
)


@pytest.mark.slow
def test_listener_accepts_again_after_running_out_of_file_descriptors(tmp_path: Path) -> None:
    """Was: the accept loop returned on the first EMFILE; the listener never accepted again."""
    secret = new_secret()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, secret.decode()], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]  # silent, all of them
        time.sleep(1.0)  # the server ran out of descriptors meanwhile
        for s in flood:
            s.close()
        chan = None
        deadline = time.monotonic() + 20.0  # the flood's handshakes time out within 5 s
        while chan is None and time.monotonic() < deadline:
            try:
                chan = connect(("127.0.0.1", port), secret, {"role": "client"}, timeout=3.0)
            except ControlError:
                time.sleep(0.2)
        assert chan is not None, "the listener never accepted again after the flood"
        chan.close()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_dripping_handshake_is_cut_off_at_the_total_deadline(
    refusals: tuple[ControlServer, bytes, list[str]],
) -> None:
    """Was: a 5 s timeout per read, so a byte every few seconds held the slot for ever."""
    srv, _, seen = refusals
    with socket.create_connection(srv.address) as s:
        s.recv(4096)  # the nonce
        hello = json.dumps({"nonce": "00" * 16, "mac": "00" * 32, "hello": {}}).encode()
        frame = struct.pack(">I", len(hello)) + hello
        t0 = time.monotonic()
        closed = False
        for i in range(len(frame)):  # one byte every 0.2 s: each read is quick, the whole is not
            try:
                s.sendall(frame[i : i + 1])
            except OSError:
                closed = True
                break
            if _closed_by_peer(s, 0.2):
                closed = True
                break
            if time.monotonic() - t0 > 4.0:
                break
        assert closed, "the server still held a handshake dripping for 4 s (deadline 1 s)"
        assert time.monotonic() - t0 < 3.0
    assert _wait_for(lambda: any("in time" in r for r in seen))


def test_unauthenticated_connections_are_capped_and_a_legit_peer_gets_in_afterwards(
    refusals: tuple[ControlServer, bytes, list[str]],
) -> None:
    """Was: one thread per connection, no cap."""
    srv, secret, seen = refusals
    silent = [socket.create_connection(srv.address) for _ in range(4)]
    for s in silent:
        s.settimeout(2.0)
        assert s.recv(4096)  # each got its nonce: 4 handshakes in progress
    extra = socket.create_connection(srv.address)
    assert _closed_by_peer(extra, 2.0), "a connection beyond max_pending was kept"
    extra.close()
    assert _wait_for(lambda: any("already in the handshake" in r for r in seen))
    for s in silent:
        s.close()
    chan = None
    deadline = time.monotonic() + 5.0
    while chan is None and time.monotonic() < deadline:
        try:
            chan = connect(srv.address, secret, {"role": "client"}, timeout=2.0)
        except ControlError:
            time.sleep(0.05)
    assert chan is not None
    chan.close()


def test_a_frame_reflected_back_to_its_sender_is_refused() -> None:
    """Was: one key for both directions, so the server accepted its own frame sent back."""
    secret = new_secret()
    srv = ControlServer(host="127.0.0.1", port=0, secret=secret)
    try:
        client = connect(srv.address, secret, {"role": "worker"})
        kind, chan, _ = srv.events.get(timeout=2)
        assert kind == "open"
        chan.send({"t": "rebuild", "gen": 2})  # the server's frame 0 ...
        raw = client._sock.recv(65536)
        client._sock.sendall(raw)  # ... played back as the client's frame 0
        kind, _, msg = srv.events.get(timeout=2)
        assert (kind, msg) == ("close", None), f"the reflected frame was delivered: {msg}"
        client.close()
    finally:
        srv.close()


def test_each_purpose_has_its_own_key() -> None:
    """Was: the secret itself keyed every channel and was etcd's password."""
    secret = new_secret()
    keys = {derive_key(secret, p) for p in ("control", "data", "etcd")}
    assert len(keys) == 3 and secret not in keys
    assert secret.decode() not in etcd_password(secret)
    data = ControlServer(host="127.0.0.1", port=0, secret=secret, purpose="data")
    try:
        with pytest.raises(AuthError):
            connect(data.address, secret, {"role": "worker"})  # a control key on the data plane
        connect(data.address, secret, {"role": "peer"}, purpose="data").close()
    finally:
        data.close()
    with pytest.raises(UsageError, match="fewer than 16"):
        derive_key(b"short", "control")


def test_a_flood_of_refusals_is_reported_a_few_at_a_time() -> None:
    """Was: a line in events.jsonl per refused connection, unbounded."""
    seen: list[tuple[str, str]] = []
    srv = ControlServer(
        host="127.0.0.1",
        port=0,
        secret=new_secret(),
        on_refused=lambda p, why: seen.append((p, why)),
        limits=ListenerLimits(refusals_per_window=3, refusal_window_s=1.0),
    )
    try:
        t0 = time.monotonic()
        for _ in range(30):
            with pytest.raises(AuthError):
                connect(srv.address, new_secret(), {"role": "x"}, timeout=2.0)
        windows = int(time.monotonic() - t0) + 1

        def accounted() -> tuple[int, int]:
            one_by_one = sum(1 for _p, w in seen if w.startswith("wrong job secret"))
            counted = sum(int(w.split()[0]) for _p, w in seen if "more connection(s) refused" in w)
            return one_by_one, counted

        assert _wait_for(lambda: sum(accounted()) == 30, timeout=5.0), seen
        one_by_one, counted = accounted()
        assert one_by_one <= 3 * windows and counted >= 30 - 3 * windows
        assert len(seen) <= 4 * windows
    finally:
        srv.close()


def test_a_wrong_secret_is_recorded_before_the_peer_hears_it() -> None:
    """Was: the listener told the peer first and reported after, so a caller that checked the
    refusal as soon as its connect failed could miss it, and a listener thread logged into a
    test's closed output after the test had ended ("Logging error" in CI). A slow report (an
    event log on a busy disk) makes the order visible."""
    seen: list[str] = []

    def slow_report(_peer: str, why: str) -> None:
        time.sleep(0.3)
        seen.append(why)

    srv = ControlServer(host="127.0.0.1", port=0, secret=new_secret(), on_refused=slow_report)
    try:
        for n in range(1, 3):
            with pytest.raises(AuthError):
                connect(srv.address, new_secret(), {"role": "x"}, timeout=5.0)
            assert len(seen) == n and seen[-1].startswith("wrong job secret")  # no wait: recorded
    finally:
        srv.close()


def test_refusal_limiter_counts_beyond_the_burst_and_reports_the_count_once() -> None:
    now = [0.0]
    lim = RefusalLimiter(2, 10.0, clock=lambda: now[0])
    assert [lim.refused("x") for _ in range(5)] == ["x", "x", None, None, None]
    assert lim.flush() is None
    now[0] = 10.5
    got = lim.flush()
    assert got is not None and got.startswith("3 more")
    assert lim.flush() is None  # reported once
    assert lim.refused("y") == "y"


def _silent_holder(secret: bytes, answer: list[tuple[dict[str, object], bytes | None]]) -> ControlServer:
    """A data-plane listener that authenticates and answers every message with ``answer``."""
    srv = ControlServer(host="127.0.0.1", port=0, secret=secret, purpose="data")

    def loop() -> None:
        while True:
            try:
                kind, chan, _msg = srv.events.get(timeout=10)
            except Exception:
                return
            if kind == "msg":
                for msg, blob in answer:
                    chan.send(msg, blob)

    threading.Thread(target=loop, daemon=True).start()
    return srv


def test_fetch_from_a_silent_authenticated_peer_gives_up() -> None:
    """Was: no read timeout after the handshake; a silent holder blocked the fetch for ever."""
    secret = new_secret()
    srv = _silent_holder(secret, [])
    try:
        addr = f"{srv.address[0]}:{srv.address[1]}"
        t0 = time.monotonic()
        with pytest.raises(FetchError, match="timed out"):
            fetch(addr, secret, node="n", rank=0, step=1, kind="local", timeout=1.0)
        assert time.monotonic() - t0 < 5.0
    finally:
        srv.close()


@pytest.mark.parametrize(
    "answer",
    [
        [({"t": "fetch_begin", "data_len": "x", "nchunks": 1}, b"{}")],
        [({"t": "fetch_begin", "nchunks": 1}, b"{}")],
        [({"t": "fetch_begin", "data_len": 1 << 50, "nchunks": 0}, b"{}")],
        [
            ({"t": "fetch_begin", "data_len": 4, "nchunks": 1}, b"{}"),
            (
                {
                    "t": "chunk",
                    "info": {
                        "offset": 0,
                        "length": 8,
                        "typesize": 1,
                        "codec": "raw",
                        "delta": False,
                        "enc_len": 8,
                        "crc_enc": 0,
                        "crc_raw": 0,
                    },
                },
                b"1234",
            ),
        ],
    ],
    ids=["non-int-length", "missing-length", "huge-length", "chunk-of-the-wrong-length"],
)
def test_a_malformed_fetch_answer_is_a_fetch_error(answer: list[tuple[dict[str, object], bytes]]) -> None:
    """Was: ValueError/KeyError/MemoryError escaped fetch; the agent's caller only logged them and
    the coordinator never heard that the fetch failed."""
    secret = new_secret()
    srv = _silent_holder(secret, answer)
    try:
        addr = f"{srv.address[0]}:{srv.address[1]}"
        with pytest.raises(FetchError):
            fetch(addr, secret, node="n", rank=0, step=1, kind="local", timeout=5.0)
    finally:
        srv.close()


def test_a_malformed_fetch_request_gets_an_error_answer(tmp_path: Path) -> None:
    """Was: a ValueError in the fetch server killed its thread without a reply."""
    from nonstop.replica.dataplane import DataPlane, shm_stores

    secret = new_secret()
    stores = shm_stores(tmp_path, "malformed", 2)
    plane = DataPlane(host="127.0.0.1", port=0, secret=secret, local=stores, replica=stores)
    try:
        ch = connect(plane.address, secret, {"role": "peer"}, purpose="data", read_timeout=5.0)
        for bad in ({"t": "fetch", "rank": "zero", "step": 1}, {"t": "fetch", "step": 1}):
            ch.send(bad)
            reply = ch.recv()
            assert reply["t"] == "fetch_begin" and reply["error"]
        ch.close()
    finally:
        plane.close()
