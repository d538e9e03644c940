"""The node agent: spawns workers and hot spares, watches them, owns snapshot memory.

Process contract:

* Every child runs in its own session (Ctrl-C in the terminal reaches only the
  launcher, which then shuts the job down in order) and is bound to the agent
  with ``PR_SET_PDEATHSIG = SIGKILL``: if the agent dies, so do its children.
* :meth:`Agent.poll` reports each exit exactly once, as soon as it is observed.
* :meth:`Agent.shutdown` terminates every child (SIGTERM, then SIGKILL after a
  grace period) and deletes every shared-memory segment of the job.

Output contract: every child's stdout and stderr are pipes read by a thread of the agent
(:mod:`nonstop.workerlog`): lines reach the console prefixed with the child's rank
(filtered, and bounded: a slow console never blocks a child), ``--log-dir`` files per rank and
process, or with ``redirect_output`` ``JOB_DIR/logs/{role}-{spawn_id}.log``; what a child wrote
before it was SIGKILLed is kept. The options come from the worker environment
(:meth:`~nonstop.workerlog.LogConfig.from_env`).

Memory contract: slots are created by the workers under the names the agent
hands them (``/dev/shm/nonstop-<job>-r<rank>-s<i>``), they outlive any worker,
and only the agent (or ``nonstop gc``) deletes them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from nonstop.config import ENV
from nonstop.snapshot import RankSnapshotStore, segment_prefix
from nonstop.workerlog import ENV_TAG, Console, Label, LogConfig, WorkerOutput

__all__ = ["Agent", "SpawnedProcess"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _bind_to_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class SpawnedProcess:
    spawn_id: int
    role: str
    proc: subprocess.Popen[bytes]
    output: WorkerOutput


class Agent:
    def __init__(
        self,
        *,
        job_id: str,
        job_dir: Path,
        shm_dir: Path,
        command: list[str],
        env: dict[str, str],
        redirect_output: bool,
        num_slots: int = 2,
        console: Console | None = None,
    ) -> None:
        """``console``: where the children's prefixed lines go (default: this process's stdout
        and stderr; none with ``redirect_output``)."""
        self.job_id = job_id
        self.num_slots = num_slots
        self.job_dir = job_dir
        self.shm_dir = shm_dir
        self.command = command
        self.env = env
        self.redirect_output = redirect_output
        self.procs: dict[int, SpawnedProcess] = {}
        self.exited_pids: dict[int, int] = {}  # spawn id -> pid, for processes already reaped
        self._next_id = 0
        self._stores: dict[int, RankSnapshotStore] = {}
        self.log_config = LogConfig.from_env(env)
        self._console: Console | None = None if redirect_output else console or Console()
        self._outputs: list[WorkerOutput] = []  # every child's, until shutdown has them finish

    def spawn(
        self,
        role: str,
        spawn_id: int | None = None,
        *,
        rank: int | None = None,
        env: dict[str, str] | None = None,
    ) -> int:
        """Start a worker or a hot spare; return its spawn id (the coordinator tells it its rank;
        ``rank``: the one it is started for, its output's label until it says otherwise; ``env``:
        variables added to the agent's worker environment, e.g. torchrun's for that rank).
        ``spawn_id``: the id the coordinator chose (unique in the job); default the next local one."""
        if spawn_id is None:
            spawn_id = self._next_id
        self._next_id = max(self._next_id, spawn_id) + 1
        env = {**self.env, **(env or {})}
        env[ENV.ROLE] = role
        env[ENV.SPAWN_ID] = str(spawn_id)
        spawn_file = None
        if self.redirect_output:
            logs = self.job_dir / "logs"
            logs.mkdir(exist_ok=True)
            spawn_file = logs / f"{role}-{spawn_id}.log"
        tag = os.urandom(8).hex()
        env[ENV_TAG] = tag
        output = WorkerOutput(
            Label(spawn_id, role, rank),
            config=self.log_config,
            console=self._console,
            tag=tag,
            spawn_file=spawn_file,
        )
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                start_new_session=True,
                preexec_fn=_bind_to_parent,
            )
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
        output.start(out_r, err_r)
        self._outputs.append(output)
        self.procs[spawn_id] = SpawnedProcess(spawn_id, role, proc, output)
        return spawn_id

    def poll(self) -> list[tuple[int, int]]:
        """``(spawn_id, returncode)`` of every child that exited since the last call."""
        exited = []
        for sid, sp in list(self.procs.items()):
            rc = sp.proc.poll()
            if rc is not None:
                exited.append((sid, rc))
                self.exited_pids[sid] = sp.proc.pid
                del self.procs[sid]  # its output thread ends by itself at the pipes' end
        return exited

    def kill(self, spawn_id: int, sig: int = signal.SIGKILL) -> None:
        sp = self.procs.get(spawn_id)
        if sp is not None and sp.proc.poll() is None:
            try:
                os.kill(sp.proc.pid, sig)
            except ProcessLookupError:
                pass

    def pid(self, spawn_id: int) -> int | None:
        sp = self.procs.get(spawn_id)
        return sp.proc.pid if sp is not None else None

    def _store(self, rank: int) -> RankSnapshotStore:
        store = self._stores.get(rank)
        if store is None:
            store = self._stores[rank] = RankSnapshotStore(
                shm_dir=self.shm_dir, job_id=self.job_id, rank=rank, num_slots=self.num_slots
            )
        return store

    def ranks_in_memory(self) -> list[int]:
        """Ranks that have snapshot slots in this agent's shared memory."""
        return ranks_with_segments(self.shm_dir, self.job_id)

    def complete_steps(self) -> dict[int, list[int]]:
        """Steps with a complete snapshot in memory, per rank with slots here (slot headers)."""
        return {rank: self._store(rank).complete_steps() for rank in self.ranks_in_memory()}

    def unsettled(self) -> bool:
        """Whether some rank's slots are about to change: a live process is writing a step into
        them, or is behind on the node's newest shared write and holds no whole step meanwhile
        (:meth:`~nonstop.snapshot.reads.SlotReads.behind_shared`). One look at the slots and the
        children per call, for a caller that polls."""
        live = self._live_pids()
        for rank in self.ranks_in_memory():
            store = self._store(rank)
            if store.writing_step(live) is not None or store.behind_shared(live):
                return True
        return False

    def _live_pids(self) -> set[int]:
        """Pids of this agent's children still running. poll(): a child SIGKILLed a moment ago is
        a zombie, alive to os.kill but writing nothing. A copy first: the node's worker thread
        calls this while the agent's loop spawns and reaps."""
        return {sp.proc.pid for sp in list(self.procs.values()) if sp.proc.poll() is None}

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.procs and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.01)
        return not self.procs

    def shutdown(self, grace_s: float = 3.0) -> None:
        """Stop every child and delete the job's shared memory. Idempotent."""
        for sid in list(self.procs):
            self.kill(sid, signal.SIGTERM)
            self.kill(sid, signal.SIGCONT)  # a stopped (hung) child cannot act on SIGTERM
        if not self.wait_all(grace_s):
            for sid in list(self.procs):
                self.kill(sid, signal.SIGKILL)
            self.wait_all(5.0)
        for store in self._stores.values():
            store.close()
        self._stores.clear()
        remove_segments(self.shm_dir, self.job_id)
        self.finish_output(timeout=2.0)

    def finish_output(self, timeout: float) -> None:
        """Wait (up to ``timeout`` in all) for every child's last lines to be read and routed,
        then write out what the console still holds. A child's own child still holding its
        pipes (a daemon it started) is not waited for beyond that."""
        deadline = time.monotonic() + timeout
        for output in self._outputs:
            output.join(max(0.0, deadline - time.monotonic()))
        self._outputs = [o for o in self._outputs if not o.join(0)]
        if self._console is not None:
            self._console.close(timeout=max(0.5, deadline - time.monotonic()))
            self._console = None


def ranks_with_segments(shm_dir: Path, job_id: str) -> list[int]:
    """Ranks with at least one slot file of ``job_id`` (``<prefix>r<rank>-s<i>``), ascending."""
    prefix = segment_prefix(job_id)
    ranks = set()
    for path in shm_dir.glob(f"{prefix}r*-s*"):
        head = path.name[len(prefix) + 1 :].partition("-s")[0]
        if head.isdigit():
            ranks.add(int(head))
    return sorted(ranks)


def remove_segments(shm_dir: Path, job_id: str) -> list[Path]:
    """Delete every shared-memory segment of ``job_id``; return what was removed."""
    removed = []
    for path in shm_dir.glob(f"{segment_prefix(job_id)}*"):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
