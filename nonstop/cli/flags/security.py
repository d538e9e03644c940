"""The control plane's flags and the part they fill (:class:`~nonstop.config.ControlConfig`):
the control store (``--store``, ``--reconnect``) and the job secret's file (``--secret-file``),
which ``nonstop run`` lists in its group "many nodes", and the security flags of ``nonstop run``
and ``nonstop demo``: TLS to etcd and on the channels. :func:`control_config` reads them back."""

from __future__ import annotations

import argparse
from pathlib import Path

from nonstop.config import ControlConfig

__all__ = ["add_security_args", "control_config", "secret_arg", "store_args"]


def store_args(g: argparse._ArgumentGroup) -> None:
    """``--store`` and ``--reconnect``."""
    c = ControlConfig()
    g.add_argument(
        "--store",
        default=c.store,
        help="control store: embedded:// (default; the coordinator lives in node 0's process) or "
        "etcd://HOST:PORT (job state and node leases in etcd: the coordinator runs as its own process "
        "and may restart without stopping the job; needs --secret-file, the etcd password); "
        "etcds://HOST:PORT: the same over TLS (--etcd-ca, --etcd-cert, --etcd-key)",
    )
    g.add_argument(
        "--reconnect",
        type=float,
        default=c.reconnect_s,
        help="with --store etcd: seconds agents and workers wait for a restarted coordinator "
        "(default %(default)s)",
    )


def secret_arg(g: argparse._ArgumentGroup) -> None:
    """``--secret-file``."""
    g.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="job secret (default: JOB_DIR/secret, written by node 0)",
    )


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


def control_config(ns: argparse.Namespace) -> ControlConfig:
    """The job's control part from :func:`store_args`, :func:`secret_arg` and
    :func:`add_security_args` (with ``etcd``)."""
    return ControlConfig(
        store=ns.store,
        reconnect_s=ns.reconnect,
        secret_file=ns.secret_file,
        etcd_ca=ns.etcd_ca,
        etcd_cert=ns.etcd_cert,
        etcd_key=ns.etcd_key,
        tls=ns.tls,
    )
