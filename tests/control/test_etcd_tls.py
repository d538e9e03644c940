"""The control store over TLS (``--store etcds://``) against a real etcd that ``scripts/etcd.sh``
starts with TLS and client-certificate authentication (certificates made here by openssl):
the store works; a wrong CA, a missing client certificate and a plain client each fail with an
error that says what to do; bad TLS settings fail at start; and a multi-process job runs on it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nonstop.config import job_config_from_flat
from nonstop.control.etcd import EtcdStore
from nonstop.control.store import open_store
from nonstop.control.tls import EtcdTLS
from nonstop.coordinator.loop import JobState
from nonstop.demo.runner import demo_job_config
from nonstop.errors import ControlError, UsageError
from nonstop.launch.local_nodes import run_local_nodes
from tests.conftest import ETCD_SH, free_port
from tests.tlscerts import Relay, make_ca, make_etcd_tls_dir, make_leaf


@dataclass
class TLSEtcd:
    state: Path
    port: int
    tls_dir: Path
    secret_file: Path
    secret: str

    @property
    def url(self) -> str:
        return f"etcds://127.0.0.1:{self.port}"

    @property
    def files(self) -> EtcdTLS:
        t = self.tls_dir
        return EtcdTLS(t / "ca.pem", t / "client.pem", t / "client-key.pem")


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSEtcd]:
    root = tmp_path_factory.mktemp("etcd-tls")
    secret = secrets.token_hex(16)
    secret_file = root / "secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    server = TLSEtcd(root / "state", free_port(), make_etcd_tls_dir(root / "tls"), secret_file, secret)
    args = [str(server.state), str(server.port), str(secret_file), str(free_port())]
    env = {**os.environ, "ETCD_TLS_DIR": str(server.tls_dir)}
    proc = subprocess.run(
        [str(ETCD_SH), "start", *args], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, f"scripts/etcd.sh start (TLS) failed: {proc.stderr}"
    yield server
    subprocess.run([str(ETCD_SH), "stop", str(server.state)], check=True, timeout=30)


def test_put_get_watch_lease_over_tls(tls_etcd: TLSEtcd) -> None:
    store = open_store(tls_etcd.url, secret=tls_etcd.secret, etcd_tls=tls_etcd.files)
    try:
        rev = store.put("tls/a", b"1")
        got = store.get("tls/a")
        assert got is not None and got.value == b"1" and got.mod_revision == rev
        with store.watch_prefix("tls/", start_revision=rev + 1) as w:
            store.put("tls/b", b"2")
            ev = w.get(timeout=5)
            assert ev is not None and (ev.kind, ev.key, ev.value) == ("put", "tls/b", b"2")
        lease = store.grant_lease(2)
        store.put("tls/leased", b"x", lease=lease.id)
        assert store.keepalive(lease.id)
        store.revoke(lease.id)
        assert store.get("tls/leased") is None
    finally:
        store.close()


def test_the_tls_files_reach_open_store_through_the_environment(
    tls_etcd: TLSEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process of the job (a node agent) opens the store with the URL only."""
    f = tls_etcd.files
    monkeypatch.setenv("NONSTOP_ETCD_CA", str(f.ca))
    monkeypatch.setenv("NONSTOP_ETCD_CERT", str(f.cert))
    monkeypatch.setenv("NONSTOP_ETCD_KEY", str(f.key))
    open_store(tls_etcd.url, secret=tls_etcd.secret).close()


def test_a_wrong_ca_is_refused_clearly(tls_etcd: TLSEtcd, tmp_path: Path) -> None:
    other_ca = make_ca(tmp_path, "other")
    f = tls_etcd.files
    with pytest.raises(ControlError, match=r"certificate was not accepted.*--etcd-ca is the CA"):
        open_store(tls_etcd.url, secret=tls_etcd.secret, etcd_tls=EtcdTLS(other_ca[0], f.cert, f.key))
    # a client certificate from a CA etcd does not trust is refused by etcd
    mine = make_leaf(tmp_path, "mine", other_ca)
    with pytest.raises(ControlError, match="--etcd-cert and --etcd-key"):
        open_store(tls_etcd.url, secret=tls_etcd.secret, etcd_tls=EtcdTLS(f.ca, *mine))


def test_no_client_certificate_is_refused_clearly(tls_etcd: TLSEtcd) -> None:
    with pytest.raises(ControlError, match="give --etcd-cert and --etcd-key"):
        open_store(tls_etcd.url, secret=tls_etcd.secret, etcd_tls=EtcdTLS(tls_etcd.files.ca))


def test_a_plain_client_of_a_tls_etcd_is_told_to_use_etcds(tls_etcd: TLSEtcd) -> None:
    with pytest.raises(ControlError, match="speaks TLS: use etcds://"):
        open_store(f"etcd://127.0.0.1:{tls_etcd.port}", secret=tls_etcd.secret)


def test_the_host_name_is_checked(tls_etcd: TLSEtcd) -> None:
    """etcd's certificate names 127.0.0.1 and localhost, not 127.0.0.2 (a relay there reaches it)."""
    relay = Relay(("127.0.0.1", tls_etcd.port), host="127.0.0.2")
    try:
        with pytest.raises(ControlError, match=r"not accepted.*IP address mismatch.*names the host"):
            EtcdStore(f"etcds://127.0.0.2:{relay.address[1]}", password=None, tls=tls_etcd.files)
    finally:
        relay.close()


def test_a_tls_client_of_a_plain_etcd_is_told_to_use_etcd(tls_etcd: TLSEtcd) -> None:
    plain = free_port()
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", plain))

    def answer() -> None:  # a plain HTTP server: answers any bytes with an HTTP error
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        with pytest.raises(ControlError, match="does not speak TLS there: use etcd://"):
            EtcdStore(f"etcds://127.0.0.1:{plain}", password=None, tls=tls_etcd.files)
    finally:
        srv.close()


def test_bad_tls_settings_fail_at_start_in_one_line(tls_etcd: TLSEtcd, tmp_path: Path) -> None:
    f = tls_etcd.files
    base = dict(script="x.py", coordinator="127.0.0.1:5000", secret_file=tls_etcd.secret_file)
    cases = [
        (dict(store=tls_etcd.url), "needs --etcd-ca FILE"),
        (dict(store=tls_etcd.url, etcd_ca=f.ca, etcd_cert=f.cert), "--etcd-cert and --etcd-key go together"),
        (dict(store=tls_etcd.url, etcd_ca=tmp_path / "nope.pem"), "--etcd-ca .*nope.pem: cannot read it"),
        (dict(store=f"etcd://127.0.0.1:{tls_etcd.port}", etcd_ca=f.ca), "use --store etcds://"),
        (dict(store=tls_etcd.url, etcd_ca=f.key), "do not load as PEM"),
    ]
    for extra, message in cases:
        with pytest.raises(UsageError, match=message) as e:
            job_config_from_flat({**base, **extra})
        assert "\n" not in str(e.value)
    job_config_from_flat(
        {**base, "store": tls_etcd.url, "etcd_ca": f.ca, "etcd_cert": f.cert, "etcd_key": f.key}
    )


def test_cli_refuses_etcds_without_a_ca(tmp_path: Path) -> None:
    from nonstop.cli import main

    secret = tmp_path / "s"
    secret.write_text(secrets.token_hex(16))
    secret.chmod(0o600)
    argv = ["run", "--store", "etcds://127.0.0.1:1", "--coordinator", "127.0.0.1:5000"]
    assert main([*argv, "--secret-file", str(secret), "--job-dir", str(tmp_path / "j"), "x.py"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_multi_node_job_runs_over_etcds(tls_etcd: TLSEtcd, tmp_path: Path) -> None:
    """Two local nodes (separate agent processes) and a coordinator process, with the job's
    state and every node's lease in the TLS etcd; a rank is killed and the job recovers."""
    f = tls_etcd.files
    job_dir = tmp_path / "job"
    config = demo_job_config(
        result=job_dir / "result.json", model="tiny", batch=4, steps=12, job_dir=job_dir,
        script_extra=("--step-delay", "0.2"), nnodes=2, nproc_per_node=1, spares=1,
        coordinator=f"127.0.0.1:{free_port()}", store=tls_etcd.url, secret_file=tls_etcd.secret_file,
        lease_ttl_s=3.0, etcd_ca=f.ca, etcd_cert=f.cert, etcd_key=f.key, faults=("kill:rank=1,step=5",),
    )  # fmt: skip
    result = run_local_nodes(config, redirect_output=True)
    assert result.state is JobState.DONE, result.error
    assert json.loads((job_dir / "result.json").read_text())["step"] == 12
    assert len(result.failures) == 1
    events = [json.loads(line) for line in (job_dir / "events.jsonl").read_text().splitlines()]
    names = [e["event"] for e in events]
    assert "coordinator_leads" in names  # the coordinator process led the job through etcd
    assert sorted(e["node"] for e in events if e["event"] == "node_join") == ["0", "1"]
    assert "NONSTOP_ETCD_CA" not in os.environ  # the launcher restored the environment
