"""Test certificates made with the ``openssl`` command: a CA, and leaf certificates it signs."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["Relay", "make_ca", "make_etcd_tls_dir", "make_leaf"]

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    cmd = ["openssl", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"openssl {' '.join(args)}: {proc.stderr}"


def make_ca(d: Path, name: str = "ca") -> tuple[Path, Path]:
    """A self-signed CA in ``d``: (NAME.pem, NAME-key.pem)."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", *_EC, "-keyout", f"{name}-key.pem", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN=nonstop-test-{name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-batch", cwd=d,
    )  # fmt: skip
    return d / f"{name}.pem", d / f"{name}-key.pem"


def make_leaf(d: Path, name: str, ca: tuple[Path, Path], *, cn: str = "", san: str = "") -> tuple[Path, Path]:
    """A certificate NAME.pem (key NAME-key.pem) signed by ``ca``, for server and client use;
    without ``cn`` its subject is only /O=nonstop-test (etcd's gateway refuses a client CN)."""
    subj = f"/CN={cn}" if cn else "/O=nonstop-test"
    _openssl("req", "-new", *_EC, "-keyout", f"{name}-key.pem", "-out", f"{name}.csr", "-subj", subj, cwd=d)
    ext = d / f"{name}.ext"
    lines = ["basicConstraints=CA:FALSE", "keyUsage=digitalSignature,keyEncipherment"]
    lines.append("extendedKeyUsage=serverAuth,clientAuth")
    if san:
        lines.append(f"subjectAltName={san}")
    ext.write_text("\n".join(lines) + "\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name, cwd=d,
    )  # fmt: skip
    (d / f"{name}-key.pem").chmod(0o600)
    return d / f"{name}.pem", d / f"{name}-key.pem"


def make_etcd_tls_dir(d: Path) -> Path:
    """What ``ETCD_TLS_DIR`` of ``scripts/etcd.sh`` needs: ca.pem, server.pem (IP:127.0.0.1,
    DNS:localhost; a CN no etcd user has), client.pem (no CN) and their keys."""
    ca = make_ca(d)
    make_leaf(d, "server", ca, cn="nonstop-test-etcd-server", san="IP:127.0.0.1,DNS:localhost")
    make_leaf(d, "client", ca, san="DNS:nonstop-test-client")
    return d


def pump(src: socket.socket, dst: socket.socket, seen: Callable[[bytes], None]) -> None:
    """Pass what ``src`` sends on to ``dst`` (``seen`` gets each piece) until either end closes;
    then shut both down."""
    try:
        while data := src.recv(1 << 16):
            seen(data)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Relay:
    """A TCP relay on ``host`` to ``target`` that records every byte it passes on, each way."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._srv = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._srv.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        pump(src, dst, self._record)

    def _record(self, data: bytes) -> None:
        with self._lock:
            self.seen += data

    def close(self) -> None:
        self._srv.close()
