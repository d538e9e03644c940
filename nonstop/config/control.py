"""What the control plane reads (:class:`ControlConfig`, ``config.control``): the control store,
how long a lost coordinator is waited for, the job secret's file and the security settings (TLS
on the channels and the data plane, TLS to etcd). Validated alone (a bad value: one line naming
its flag); what a store needs of the job's other parts (a fixed ``--coordinator`` port) is the
job's check (:class:`~nonstop.config.job.JobConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nonstop.errors import UsageError

__all__ = ["ControlConfig", "EMBEDDED_STORE"]

EMBEDDED_STORE = "embedded://"  # the coordinator lives in node 0's process


@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """``store``: ``embedded://`` or ``etcd://HOST:PORT[,...]`` (``etcds://``: TLS), where the
    job's state and node leases live (the coordinator may restart). ``reconnect_s``: store mode:
    how long agents and workers wait for a new coordinator. ``secret_file``: where the job secret
    is (None: node 0 writes ``JOB_DIR/secret``); with etcd it is also the etcd password.
    ``etcd_ca``/``etcd_cert``/``etcd_key``: ``etcds://``: the CA that signed etcd's certificate,
    this job's client certificate and key. ``tls``: TLS on the control channel and the data plane
    (control/tls.py; needs the openssl command, checked at construction)."""

    store: str = EMBEDDED_STORE
    reconnect_s: float = 30.0
    secret_file: Path | None = None
    etcd_ca: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    tls: bool = False

    def __post_init__(self) -> None:
        if self.store != EMBEDDED_STORE:
            scheme, sep, rest = self.store.partition("://")
            if scheme not in ("etcd", "etcds") or not sep or not rest:
                raise UsageError(
                    "--store must be embedded://, etcd://HOST:PORT[,HOST:PORT...] or etcds://... (TLS) "
                    f"(got {self.store!r})"
                )
        if self.reconnect_s <= 0:
            raise UsageError(f"--reconnect must be > 0 seconds (got {self.reconnect_s})")
        self._check_security()

    def _check_security(self) -> None:
        from nonstop.control.tls import EtcdTLS, check_openssl

        tls_files = (self.etcd_ca, self.etcd_cert, self.etcd_key)
        if self.store.startswith("etcds://"):
            if self.etcd_ca is None:
                raise UsageError(
                    "--store etcds://... needs --etcd-ca FILE, the CA that signed etcd's certificate"
                )
            EtcdTLS(self.etcd_ca, self.etcd_cert, self.etcd_key).check()
        elif any(f is not None for f in tls_files):
            raise UsageError(
                "--etcd-ca/--etcd-cert/--etcd-key are for TLS to etcd: use --store etcds://HOST:PORT"
            )
        if self.tls:
            check_openssl()

    @property
    def uses_store(self) -> bool:
        """True when the job's state lives in an external control store (etcd)."""
        return self.store != EMBEDDED_STORE
