"""Talking to a running job from another process (``nonstop persist``, ``status``, ``migrate``,
``drain``).

The client reads the job's control address from ``JOB_DIR/job.json`` and the
per-job secret from ``JOB_DIR/secret`` (0600: only the job's user can read it),
and speaks the same authenticated channel as the workers, as role ``client``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from nonstop.control.channel import Channel, Message, connect
from nonstop.control.secret import read_secret_file
from nonstop.errors import ControlError, NonstopError, UsageError
from nonstop.protocol.base import MigrateMsg
from nonstop.protocol.client import (
    AcceptedMsg,
    DrainMsg,
    MigratedMsg,
    PersistedMsg,
    PersistRequestMsg,
    StatusMsg,
    StatusRequestMsg,
    decode_client_answer,
)

__all__ = ["request_migration", "request_persist", "request_status"]


def _job_address(job_dir: Path) -> tuple[tuple[str, int], bytes]:
    info_file, secret_file = job_dir / "job.json", job_dir / "secret"
    try:
        info = json.loads(info_file.read_text())
        secret_file = Path(info.get("secret_file") or secret_file)
        secret = read_secret_file(secret_file, what="the job secret")
    except FileNotFoundError:
        raise UsageError(f"no running job in {str(job_dir)!r}: give the job's --job-dir") from None
    except PermissionError:
        raise UsageError(f"cannot read {secret_file}: run as the user who started the job") from None
    host, _, port = str(info["control"]).rpartition(":")
    return (host, int(port)), secret


def request_persist(job_dir: Path, *, timeout: float) -> PersistedMsg:
    """Ask the job in ``job_dir`` to persist its committed step; wait for it to be durable."""
    addr, secret = _job_address(job_dir)
    try:
        chan = connect(addr, secret, {"role": "client"}, timeout=10.0, read_timeout=timeout)
    except (ControlError, OSError) as e:
        raise UsageError(f"cannot reach the job in {str(job_dir)!r} ({e}); is it still running?") from None
    try:
        chan.send(PersistRequestMsg().encode())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answer = decode_client_answer(chan.recv())
            if isinstance(answer, PersistedMsg):
                if answer.error or answer.step is None:
                    raise NonstopError(f"persist failed: {answer.error or 'nothing committed yet'}")
                return answer
        raise NonstopError(f"no answer within {timeout} s")
    finally:
        chan.close()


def _connect(job_dir: Path, *, read_timeout: float = 10.0) -> Channel:
    """A client channel to the job; an answer awaited longer than ``read_timeout`` raises."""
    addr, secret = _job_address(job_dir)
    try:
        return connect(addr, secret, {"role": "client"}, timeout=10.0, read_timeout=read_timeout)
    except (ControlError, OSError) as e:
        raise UsageError(f"cannot reach the job in {str(job_dir)!r} ({e}); is it still running?") from None


def request_status(job_dir: Path) -> Message:
    """The running job's ranks, nodes, spares, steps, tiers and any migration in progress."""
    chan = _connect(job_dir)
    try:
        chan.send(StatusRequestMsg().encode())
        answer = decode_client_answer(chan.recv())
        if not isinstance(answer, StatusMsg):
            raise NonstopError(f"the job answered a status request with {answer!r}")
        return dict(answer.status)
    finally:
        chan.close()


def request_migration(job_dir: Path, request: MigrateMsg | DrainMsg, *, timeout: float) -> list[MigratedMsg]:
    """Send a ``migrate {rank, to}`` or ``drain {node}`` request; wait until every rank it moves
    has moved (or failed to); one ``migrated {rank, ok, error, ...}`` answer per rank."""
    chan = _connect(job_dir, read_timeout=timeout)
    try:
        chan.send(request.encode())
        deadline = time.monotonic() + timeout
        waiting: set[int] | None = None
        answers: list[MigratedMsg] = []
        while time.monotonic() < deadline and (waiting is None or waiting):
            answer = decode_client_answer(chan.recv())
            if isinstance(answer, AcceptedMsg):
                waiting = set(answer.ranks) - {a.rank for a in answers if a.rank is not None}
            elif isinstance(answer, MigratedMsg):
                answers.append(answer)
                if answer.rank is None:
                    return answers  # the request itself was refused
                if waiting is not None:
                    waiting.discard(answer.rank)
        if waiting is None or waiting:
            raise NonstopError(f"no answer for every rank within {timeout} s")
        return answers
    finally:
        chan.close()
