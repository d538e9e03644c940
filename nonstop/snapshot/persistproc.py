"""Persist writes in a process of their own, at the lowest CPU priority.

Why a process and not a thread: "training first" means the persist work runs at ``nice 19``;
a thread at ``nice 19`` inside a node agent or the coordinator still takes the process's GIL,
and on a CPU the training saturates the kernel seldom schedules it -- while it holds the GIL
the process's other threads (the agent's lease renewals, the coordinator's loop) cannot run.
Measured on this 2-core machine under three CPU burners: the main loop of a process whose
other thread spins at ``nice 19`` saw 0.68 s gaps at its 99th percentile (0.02 s beside a
``nice 0`` thread), and a node agent's loop stalled 1.8 s after each persist command, long
enough for it to fence itself (no lease renewal acknowledged) in a test job. A child process
has no GIL to share: it may starve, the agent and the coordinator do not.

Contract: :class:`PersistProcess` writes some ranks of a checkpoint that another writer opened
with :meth:`~nonstop.snapshot.durable.DurableStore.begin` (the ``contribute`` half of a persist
round, :mod:`nonstop.runtime.persistence`) and returns their manifest records; the opener
adopts them and commits. The child reads the ranks' snapshot slots from shared memory itself
(store id, slot count) and keeps one :class:`~nonstop.snapshot.persist.RankEncoder` per
(checkpoint root, codec): delta bases stay where they are used. Requests and replies are JSON
lines on its stdin and stdout, never pickles. The owner starts the child with the job
(:meth:`PersistProcess.start`): its imports (at normal priority, see :func:`main`) are done
before the first round. A child that dies is started again at the next write (its encoders start over: that
write is full); it dies with the thread that started it (``PR_SET_PDEATHSIG``) and ends at
the end of its stdin. One write at a time (a lock).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from nonstop.errors import NonstopError, SnapshotMissingError
from nonstop.snapshot.codec import CodecConfig

__all__ = ["PersistProcess", "PersistProcessError", "bind_to_parent"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
CLOSE_WAIT_S = 5.0


def bind_to_parent() -> None:
    """In a child between fork and exec: SIGKILL it when the thread that started it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _child_setup() -> None:  # between fork and exec
    """Bound to its parent, and deaf to the signals that stop a job: a SIGTERM or Ctrl-C sent to
    the job's process group (a scheduler's notice, ``kill -TERM -PGID``) reached the child too,
    and the persist of the committed step that the parent then makes failed with it. It ends
    with its parent instead (PDEATHSIG, or the end of its stdin)."""
    bind_to_parent()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


class PersistProcessError(NonstopError):
    """A persist write failed in the child (its message), or the child itself died."""


class PersistProcess:
    """The parent's handle on one persist child (module docstring)."""

    def __init__(self, *, shm_dir: Path, store_id: str, num_slots: int) -> None:
        self.shm_dir = Path(shm_dir)
        self.store_id = store_id
        self.num_slots = num_slots
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child now, not at the first write: its imports (torch, seconds of CPU) are
        then done while the job starts."""
        with self._lock:
            self._ensure()

    def write(
        self, *, url: str, step: int, world_size: int, ranks: list[int], codec: CodecConfig,
        forget_others: bool = False, full: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Write ``ranks`` of checkpoint ``step`` under ``url`` (opened by someone else);
        ``{"records", "raw", "stored", "full", "seconds"}``. ``forget_others``: drop the delta
        bases of every other rank first (a node's ranks changed); ``full``: drop every base (the
        write is full, after a failure a base may have caused). SnapshotMissingError when a
        rank's slots no longer hold ``step``; PersistProcessError for any other failure."""
        req = {
            "url": url,
            "step": step,
            "world_size": world_size,
            "ranks": ranks,
            "codec": dataclasses.asdict(codec),
            "forget_others": forget_others,
            "full": full,
        }
        with self._lock:
            proc = self._ensure()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(req) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except OSError:
                line = ""
            if not line:
                self._reap()
                raise PersistProcessError("the persist process died; the next write starts a new one")
        reply: dict[str, Any] = json.loads(line)
        if reply.get("ok"):
            return reply
        if reply.get("missing"):
            raise SnapshotMissingError(str(reply.get("error")))
        raise PersistProcessError(str(reply.get("error")))

    def close(self) -> None:
        """End the child (at the end of its stdin; SIGKILL after CLOSE_WAIT_S)."""
        with self._lock:
            self._reap()

    def _ensure(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._reap()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "nonstop.snapshot.persistproc", str(self.shm_dir), self.store_id,
             str(self.num_slots)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_child_setup,
        )  # fmt: skip
        return self._proc

    def _reap(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the child ---------------------------------------------------------------------------------
def _serve(req: dict[str, Any], stores: Any, encoders: dict[tuple[str, str], Any]) -> dict[str, Any]:
    from nonstop.snapshot.durable import DurableStore
    from nonstop.snapshot.persist import RankEncoder

    url, step, ranks = str(req["url"]), int(req["step"]), [int(r) for r in req["ranks"]]
    codec = CodecConfig(**dict(req["codec"]))
    key = (url, json.dumps(req["codec"], sort_keys=True))
    enc = encoders.get(key)
    if enc is None:
        for old in encoders.values():  # one root and codec at a time: bases and scratch are per rank
            old.close()
        encoders.clear()
        enc = encoders[key] = RankEncoder(codec)
    if req.get("full"):
        enc.reset()
    elif req.get("forget_others"):
        enc.forget_others(set(ranks))
    t0 = time.monotonic()
    try:
        snaps = [stores(r).copy_out(step, out=enc.scratch(r)) for r in ranks]
    except SnapshotMissingError as e:
        return {"ok": False, "missing": True, "error": str(e)}
    writer = DurableStore(url).contribute(step, int(req["world_size"]), codec.describe())
    try:
        raw, stored, full = enc.write(writer, snaps)
    except BaseException:
        enc.reset()  # a base may be what went wrong: the next write is full
        writer.abort()
        raise
    return {
        "ok": True,
        "records": [writer.record(r) for r in ranks],
        "raw": raw,
        "stored": stored,
        "full": full,
        "seconds": time.monotonic() - t0,
    }


def _child(argv: list[str], stdin: IO[str], out: IO[str]) -> None:
    from nonstop.snapshot.store import RankSnapshotStore

    shm_dir, store_id, num_slots = Path(argv[0]), argv[1], int(argv[2])
    opened: dict[int, RankSnapshotStore] = {}

    def stores(rank: int) -> RankSnapshotStore:
        if rank not in opened:
            opened[rank] = RankSnapshotStore(shm_dir=shm_dir, job_id=store_id, rank=rank, num_slots=num_slots)
        return opened[rank]

    encoders: dict[tuple[str, str], Any] = {}
    try:
        for line in stdin:
            try:
                reply = _serve(json.loads(line), stores, encoders)
            except Exception as e:  # the request's failure, never the child's
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        for enc in encoders.values():
            enc.close()


def main() -> None:
    # Training first -- from here on. Not before the imports: a child started at nice 19 beside
    # two CPU burners and two test jobs on this 2-core VM had had 1 s of CPU after a minute, and
    # its imports (torch, ~2 s of CPU) would have held back the job's first persist; at normal
    # priority they are paid once, while the job starts.
    try:
        os.nice(19)
    except OSError:
        pass
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the replies
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s nonstop-persist: %(levelname)s %(message)s"
    )
    _child(sys.argv[1:], sys.stdin, out)


if __name__ == "__main__":
    main()
