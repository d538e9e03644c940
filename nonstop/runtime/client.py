"""Talking to a running job from another process (``nonstop persist``).

The client reads the job's control address from ``JOB_DIR/job.json`` and the
per-job secret from ``JOB_DIR/secret`` (0600: only the job's user can read it),
and speaks the same authenticated channel as the workers, as role ``client``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from nonstop.control.channel import Message, connect
from nonstop.errors import ControlError, NonstopError, UsageError

__all__ = ["request_persist"]


def _job_address(job_dir: Path) -> tuple[tuple[str, int], bytes]:
    info_file, secret_file = job_dir / "job.json", job_dir / "secret"
    try:
        info = json.loads(info_file.read_text())
        secret = secret_file.read_bytes().strip()
    except FileNotFoundError:
        raise UsageError(f"no running job in {str(job_dir)!r}: give the job's --job-dir") from None
    except PermissionError:
        raise UsageError(f"cannot read {secret_file}: run as the user who started the job") from None
    host, _, port = str(info["control"]).rpartition(":")
    return (host, int(port)), secret


def request_persist(job_dir: Path, *, timeout: float) -> Message:
    """Ask the job in ``job_dir`` to persist its committed step; wait for it to be durable."""
    addr, secret = _job_address(job_dir)
    try:
        chan = connect(addr, secret, {"role": "client"}, timeout=10.0)
    except (ControlError, OSError) as e:
        raise UsageError(f"cannot reach the job in {str(job_dir)!r} ({e}); is it still running?") from None
    try:
        chan.send({"t": "persist"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = chan.recv()
            if reply.get("t") == "persisted":
                if reply.get("error") or "step" not in reply:
                    raise NonstopError(f"persist failed: {reply.get('error') or 'nothing committed yet'}")
                return reply
        raise NonstopError(f"no answer within {timeout} s")
    finally:
        chan.close()
