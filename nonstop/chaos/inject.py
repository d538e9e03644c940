"""Carrying one fault of the schedule out on a running job, by kind.

Worker-side kinds that only the worker can do to itself (``exit``, ``stall``) are posted to the
job's fault inbox (:func:`nonstop.faults.post_fault`) for the rank's next steps; the rest is done
from outside, at a random moment (not on a step boundary): signals to the rank's process (kill,
hang), to a node's agent (node loss), to the coordinator (restart) or to etcd (a stall); the
rank's shared memory unlinked everywhere (wipe); a durable chunk's bytes flipped (corrupt); a
node's link cut (partition); ``nonstop migrate``; a preemption notice file.

Each method returns when the fault is in (its ``detail`` filled) and says when it was injected.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nonstop.chaos.cluster import Episode, Etcd, Netns
from nonstop.chaos.schedule import Planned
from nonstop.chaos.watch import JobWatch, Timeout
from nonstop.faults import FaultSpec, post_fault, preempt_notice_path
from nonstop.launch.launcher import default_shm_dir
from nonstop.snapshot.durable.format import parse_step_dir, rank_file

__all__ = ["Injected", "Injector", "durable_steps"]

PREEMPT_GRACE_S = 30.0


@dataclass
class Injected:
    """A fault that is in: when (unix time), and what was done."""

    t: float
    detail: dict[str, Any] = field(default_factory=dict)


def durable_steps(root: Path) -> list[int]:
    """The committed checkpoints (a manifest written) of a local checkpoint root, oldest first."""
    out = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for d in entries:
        step = parse_step_dir(d.name)
        if step is not None and (d / "manifest.json").exists():
            out.append(step)
    return sorted(out)


def segments_of_rank(job_id: str, rank: int, shm_dir: Path | None = None) -> list[Path]:
    """Every shared-memory slot holding rank ``rank``'s snapshots: its own node's and every
    replica of it on other nodes."""
    pat = re.compile(rf"nonstop-{re.escape(job_id)}\..+-r{rank}-s\d+")
    shm = shm_dir or default_shm_dir()
    return [p for p in shm.glob(f"nonstop-{job_id}.*") if pat.fullmatch(p.name)]


def segments_of_node(job_id: str, node: int, shm_dir: Path | None = None) -> list[Path]:
    """Every shared-memory file of node ``node`` of the job: its ranks' slots, the replicas it
    holds, its lock."""
    shm = shm_dir or default_shm_dir()
    return [*shm.glob(f"nonstop-{job_id}.{node}-*"), *shm.glob(f"nonstop-{job_id}.{node}.*")]


class Injector:
    """Does each kind of fault to one episode's job."""

    def __init__(self, ep: Episode, watch: JobWatch, *, etcd: Etcd | None, netns: Netns | None) -> None:
        self.ep, self.watch, self.etcd, self.netns = ep, watch, etcd, netns
        self.root = Path(ep.config.persist.url or ep.job_dir / "checkpoints")

    def inject(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        return getattr(self, f"_{p.kind}")(p, status, timeout)  # type: ignore[no-any-return]

    # -- one worker --------------------------------------------------------------------------------
    @staticmethod
    def _pid(status: dict[str, Any], rank: int) -> int:
        return int(status["ranks"][str(rank)]["pid"])

    def _signal(self, p: Planned, status: dict[str, Any], sig: signal.Signals) -> Injected:
        pid = self._pid(status, p.rank)
        t = time.time()
        os.kill(pid, sig)
        node = status["ranks"][str(p.rank)]["node"]
        return Injected(t, {"rank": p.rank, "pid": pid, "node": node, "signal": sig.name})

    def _kill(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        return self._signal(p, status, signal.SIGKILL)

    def _hang(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        return self._signal(p, status, signal.SIGSTOP)

    def _post(self, spec: FaultSpec, timeout: float) -> tuple[float, int]:
        """Post ``spec`` to the job's inbox; wait until a worker fired it: (when, its pid)."""
        markers = self.ep.job_dir / "faults"
        index = post_fault(markers, spec)
        marker = markers / f"fault-{index}"

        def fired() -> dict[str, Any] | None:
            try:
                got: dict[str, Any] = json.loads(marker.read_text())
                return got
            except (OSError, ValueError):
                return None

        rec = self.watch.wait(f"fault {spec.to_text()} to fire", fired, timeout, alive=self._node0_alive)
        return float(rec["ts"]), int(rec["pid"])

    def _at_step(self, status: dict[str, Any], rank: int) -> int:
        return int(status["ranks"][str(rank)].get("step") or 0) + 2

    def _exit(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        spec = FaultSpec(kind="exit", rank=p.rank, step=self._at_step(status, p.rank), code=p.code)
        t, pid = self._post(spec, timeout)
        return Injected(t, {"rank": p.rank, "pid": pid, "code": p.code, "spec": spec.to_text()})

    def _stall(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        spec = FaultSpec(kind="stall", rank=p.rank, step=self._at_step(status, p.rank))
        t, pid = self._post(spec, timeout)
        return Injected(t, {"rank": p.rank, "pid": pid, "spec": spec.to_text()})

    # -- memory and the durable tier ---------------------------------------------------------------
    def _wipe(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        """Rank ``p.rank``'s memory is lost everywhere (its slots and every replica), then its
        process: no step is in every rank's memory, the job must come back from the durable tier."""
        job_id = str(status["job_id"])
        pid = self._pid(status, p.rank)
        t = time.time()
        gone = segments_of_rank(job_id, p.rank)
        for seg in gone:
            seg.unlink(missing_ok=True)
        os.kill(pid, signal.SIGKILL)
        return Injected(t, {"rank": p.rank, "pid": pid, "segments": sorted(s.name for s in gone)})

    def _corrupt(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        """Flip bytes of rank ``p.rank``'s chunk file in the newest durable checkpoint, then lose
        that rank's memory: the loader must find the checksum wrong and fall back to an older one."""
        steps = durable_steps(self.root)
        newest = steps[-1]
        step = self.root / f"step-{newest:012d}"
        path = step / rank_file(p.rank)
        if path.stat().st_size == 0:
            # every chunk of this rank is shared with another rank's file (ranks alike: a DDP
            # job seeded alike): flip the bytes of the file that holds them
            path = max(step.glob("rank-*.bin"), key=lambda f: f.stat().st_size)
        size = path.stat().st_size
        at = size // 2
        with path.open("r+b") as f:
            f.seek(at)
            old = f.read(16)
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in old))
            f.flush()
            os.fsync(f.fileno())
        got = self._wipe(p, status, timeout)
        got.detail.update(corrupted_step=newest, file=str(path), offset=at, older=steps[:-1])
        return got

    # -- nodes -------------------------------------------------------------------------------------
    def aim_node(self, p: Planned, status: dict[str, Any]) -> int:
        """The node a node fault hits: the planned one if it plays a rank, else the first other
        node (not node 0) that does (migrations move ranks; a node of spares only loses no rank)."""
        if _ranks_on(status, p.node):
            return p.node
        playing = [k for k in range(1, self.ep.config.nnodes) if _ranks_on(status, k)]
        return playing[0] if playing else p.node

    def _node(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        """The node is lost: its agent and every process of it SIGKILLed, and its memory with them
        (its segments unlinked: on one machine they would outlive it, a lost host's do not)."""
        node = self.aim_node(p, status)
        t = time.time()
        pid = self.ep.kill_node(node)
        gone = segments_of_node(str(status["job_id"]), node)
        for seg in gone:
            seg.unlink(missing_ok=True)
        detail = {"node": node, "agent_pid": pid, "ranks": _ranks_on(status, node), "segments": len(gone)}
        return Injected(t, detail)

    def _partition(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        assert self.netns is not None
        node = self.aim_node(p, status)
        t = time.time()
        self.netns.cut(node)
        return Injected(t, {"node": node, "ranks": _ranks_on(status, node)})

    def _preempt(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        node = self.aim_node(p, status)
        notice = preempt_notice_path(self.ep.job_dir, str(node))
        tmp = notice.with_suffix(".tmp")
        tmp.write_text(f"{PREEMPT_GRACE_S}\n")
        t = time.time()
        tmp.replace(notice)
        return Injected(t, {"node": node, "grace_s": PREEMPT_GRACE_S, "ranks": _ranks_on(status, node)})

    def _migrate(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        here = str(status["ranks"][str(p.rank)]["node"])
        nodes = sorted(int(n) for n, rec in status["nodes"].items() if rec["alive"] and n != here)
        to = p.node if p.node in nodes else nodes[p.index % len(nodes)]
        cmd = [sys.executable, "-m", "nonstop.cli", "migrate", "--job-dir", str(self.ep.job_dir)]
        cmd += ["--rank", str(p.rank), "--to", str(to)]
        t = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        detail = {"rank": p.rank, "from": here, "to": to, "returncode": proc.returncode}
        detail["output"] = (proc.stdout + proc.stderr).strip()[-300:]
        return Injected(t, detail)

    # -- the control plane -------------------------------------------------------------------------
    def _coordinator(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        pid = self.ep.coordinator_pid()
        if pid is None:
            raise Timeout("no coordinator pid in job.json")
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return Injected(t, {"pid": pid})

    def _store_stall(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
        assert self.etcd is not None
        t = time.time()
        os.kill(self.etcd.pid, signal.SIGSTOP)
        try:
            time.sleep(p.seconds)  # the stall itself: etcd answers nothing for this long
        finally:
            os.kill(self.etcd.pid, signal.SIGCONT)
        return Injected(t, {"stopped_s": p.seconds, "etcd_pid": self.etcd.pid})

    def _node0_alive(self) -> bool:
        return self.ep.node_running(0)


def _ranks_on(status: dict[str, Any], node: int) -> list[int]:
    return sorted(int(r) for r, rec in status["ranks"].items() if str(rec.get("node")) == str(node))
