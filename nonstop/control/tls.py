"""TLS for nonstop's connections: to etcd, and (``--tls``) on the control channel and data plane.

**etcd** (``--store etcds://HOST:PORT``): an ordinary verified TLS client. etcd's certificate must
chain to ``--etcd-ca`` and name the URL's host (an IP address as an IP SAN); ``--etcd-cert`` /
``--etcd-key`` are the client certificate etcd checks with ``--client-cert-auth``
(:class:`EtcdTLS`).

**Channels** (``--tls``): the peers of a job share a secret, not a PKI, so a listener makes an
ephemeral self-signed certificate when its process starts (:func:`listener_cert`, with the
``openssl`` command: no Python package is needed) and a client does not verify any chain.
Instead the TLS session is bound to the existing HMAC handshake (``tls-server-end-point``
channel binding, RFC 5929): both sides put the SHA-256 fingerprint of the server certificate --
the one the server holds, the one the client saw -- into every MAC of the handshake and into the
frame keys (:mod:`nonstop.control.channel`). A man in the middle who terminates TLS shows the
client its own certificate, so the fingerprints differ and the server refuses the client's MAC
(and the client would refuse the server's): without the job's key it can neither read nor
relay a session. A TLS listener first sends a one-message plain preamble (:data:`PREAMBLE`), so
a client of the wrong kind fails at once with a clear error instead of waiting on a silent peer.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nonstop.errors import ControlError, UsageError

__all__ = [
    "PREAMBLE",
    "EtcdTLS",
    "ListenerCert",
    "check_openssl",
    "client_handshake",
    "listener_cert",
    "server_handshake",
    "speaks_tls",
]

PREAMBLE = {"tls": "nonstop/v1"}  # what a TLS listener says first, in clear
_CERT_DAYS = 30  # an ephemeral certificate lives as long as its process; nothing checks the dates
INSTALL_OPENSSL = "install the openssl command (Debian/Ubuntu: apt-get install openssl)"


@dataclass(frozen=True)
class EtcdTLS:
    """Files of a TLS connection to etcd: the CA that signed etcd's certificate, and the
    client certificate and key (both or neither)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def check(self) -> None:
        """Raise UsageError, in one line, unless every file is there, readable and loads."""
        if (self.cert is None) != (self.key is None):
            raise UsageError("--etcd-cert and --etcd-key go together: give both (or neither)")
        for flag, path in (("--etcd-ca", self.ca), ("--etcd-cert", self.cert), ("--etcd-key", self.key)):
            if path is None:
                continue
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise UsageError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
        try:
            self.context()
        except ssl.SSLError as e:
            raise UsageError(
                f"--etcd-ca {self.ca} / --etcd-cert / --etcd-key do not load as PEM certificates and "
                f"a matching key ({e.reason or e})"
            ) from None

    def context(self) -> ssl.SSLContext:
        """A client context that verifies etcd's certificate against the CA and its host name."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cafile=str(self.ca))
        if self.cert is not None:
            ctx.load_cert_chain(str(self.cert), None if self.key is None else str(self.key))
        return ctx


def describe_ssl_error(e: ssl.SSLError) -> str:
    """What went wrong in a TLS handshake with etcd, and what to do about it, in words."""
    text = str(e)
    if isinstance(e, ssl.SSLCertVerificationError):
        return (
            f"etcd's certificate was not accepted ({e.verify_message or text}): check that "
            "--etcd-ca is the CA that signed it and that it names the host of the URL"
        )
    if "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
        return "it does not speak TLS there: use etcd://HOST:PORT, without --etcd-ca"
    if "CERTIFICATE_REQUIRED" in text or "certificate required" in text or "BAD_CERTIFICATE" in text:
        return (
            f"etcd refused this client's certificate ({text}): give --etcd-cert and --etcd-key, "
            "signed by a CA etcd trusts (its --trusted-ca-file)"
        )
    return f"TLS failed: {text}"


def speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` completes a TLS handshake (nothing verified: a diagnosis only)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            with ctx.wrap_socket(raw):
                return True
    except ssl.SSLError as e:  # a TLS server that wants a client certificate still answers in TLS
        return "alert" in str(e).lower()
    except OSError:
        return False


# -- the channels' ephemeral certificates -------------------------------------------------------


@dataclass(frozen=True)
class ListenerCert:
    """A listener's server context and the SHA-256 of its certificate (the channel binding)."""

    context: ssl.SSLContext
    fingerprint: bytes


def check_openssl() -> None:
    """UsageError unless the openssl command is there (``--tls`` makes its certificates with it)."""
    if shutil.which("openssl") is None:
        raise UsageError(f"--tls needs the openssl command to make its certificates: {INSTALL_OPENSSL}")


@functools.cache
def listener_cert() -> ListenerCert:
    """This process's ephemeral certificate (EC P-256, self-signed), made once and shared by
    its listeners. The key is written to a private temporary directory only to load it, then
    deleted: it exists only in this process's memory."""
    check_openssl()
    with tempfile.TemporaryDirectory(prefix="nonstop-tls-") as tmp:  # 0700
        key, cert = Path(tmp) / "key.pem", Path(tmp) / "cert.pem"
        cmd = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        cmd += ["-nodes", "-keyout", str(key), "-out", str(cert), "-days", str(_CERT_DAYS)]
        cmd += ["-subj", "/CN=nonstop-ephemeral", "-batch"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            raise UsageError(f"--tls: openssl could not make a certificate: {proc.stderr.strip()[-300:]}")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.num_tickets = 0  # no session tickets: a reader thread's SSL_read never has to write
        ctx.load_cert_chain(str(cert), str(key))
        der = ssl.PEM_cert_to_DER_cert(cert.read_text())
    return ListenerCert(ctx, hashlib.sha256(der).digest())


@functools.cache
def _client_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # no chain to verify: the HMAC handshake binds the certificate
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def server_handshake(sock: socket.socket, cert: ListenerCert, deadline: float) -> ssl.SSLSocket:
    """The TLS handshake of an accepted connection, finished by ``deadline`` (time.monotonic)
    however the peer paces its bytes: a watchdog shuts the socket down when the time is up."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ControlError("handshake not completed in time")
    ssock = cert.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    timer = threading.Timer(left, _shutdown, args=(sock,))
    timer.daemon = True
    timer.start()
    try:
        _server_handshake(ssock, left, deadline)
    except BaseException:
        ssock.close()
        raise
    finally:
        timer.cancel()
    return ssock


def _server_handshake(ssock: ssl.SSLSocket, left: float, deadline: float) -> None:
    try:
        ssock.settimeout(left)
        ssock.do_handshake()
    except TimeoutError:
        raise ControlError("handshake not completed in time") from None
    except ssl.SSLError as e:
        raise ControlError(f"TLS handshake failed ({e.reason or e}): a client with TLS off?") from e
    except OSError as e:
        if time.monotonic() >= deadline:
            raise ControlError("handshake not completed in time") from None
        raise ControlError(f"TLS handshake failed ({e})") from e


def client_handshake(sock: socket.socket, deadline: float) -> tuple[ssl.SSLSocket, bytes]:
    """TLS over ``sock`` (no chain verified); the socket and the SHA-256 of the certificate the
    server showed, which the caller's HMAC handshake binds."""
    ssock = _client_context().wrap_socket(sock, do_handshake_on_connect=False)
    try:
        ssock.settimeout(max(0.001, deadline - time.monotonic()))
        ssock.do_handshake()
        der = ssock.getpeercert(binary_form=True)
        if not der:
            raise ControlError("the listener showed no certificate")
    except BaseException as e:
        ssock.close()
        if isinstance(e, TimeoutError):
            raise ControlError("TLS handshake not completed in time") from None
        raise
    return ssock, hashlib.sha256(der).digest()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
