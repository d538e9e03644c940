"""The security flags of ``nonstop run`` and ``nonstop demo``: TLS to etcd and on the channels."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_security_args", "security_config"]


def add_security_args(p: argparse.ArgumentParser, *, etcd: bool = True) -> None:
    """``--tls`` and (with ``etcd``) ``--etcd-ca/--etcd-cert/--etcd-key``."""
    g = p.add_argument_group("security")
    g.add_argument(
        "--tls",
        action="store_true",
        help="encrypt the control channel and the data plane (weights, snapshots) with TLS, bound to "
        "the job secret's handshake; every node of the job needs it (needs the openssl command)",
    )
    if not etcd:
        return
    g.add_argument(
        "--etcd-ca",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --store etcds://: the CA that signed etcd's certificate (checked with the URL's host)",
    )
    g.add_argument(
        "--etcd-cert", type=Path, default=None, metavar="FILE", help="with etcds://: client certificate"
    )
    g.add_argument("--etcd-key", type=Path, default=None, metavar="FILE", help="its private key")


def security_config(ns: argparse.Namespace) -> dict[str, object]:
    """The :class:`~nonstop.config.JobConfig` fields of the flags above."""
    return {"tls": ns.tls, "etcd_ca": ns.etcd_ca, "etcd_cert": ns.etcd_cert, "etcd_key": ns.etcd_key}
