"""The coordinator's view of a job: nodes, processes and their roles, membership, progress.

One :class:`JobView` replaces the parallel maps the coordinator used to keep in step by hand.
A process (:class:`WorkerRecord`) carries its node, pid, liveness and :class:`Role`::

    spare --(a migration or grow picks it)--> joiner --(the swap)--> worker --> retired
      \\______________(a recovery gives it a rank)______________/

``members`` maps each rank of the current generation to the spawn id playing it; ``rank_node``
keeps, for every rank, the node that plays it (or last played it: a failed rank's node is where
its replacement is preferred). The view serialises whole to JSON (:meth:`JobView.to_record`) and
back (:meth:`JobView.from_record`): what a coordinator restarted from the control store resumes.

Threading: owned by the coordinator's thread; nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from nonstop.control.channel import Channel
from nonstop.policy.phase import JobPhase
from nonstop.policy.rescue import Report

__all__ = ["JobView", "NodeRecord", "Role", "WorkerRecord", "node_order"]


class Role(enum.StrEnum):
    SPARE = "spare"  # pre-warmed, waiting for a rank
    JOINER = "joiner"  # held by a migration or grow: prepares a rank, no member until the swap
    WORKER = "worker"  # plays a rank (a member, or launched to become one)
    RETIRED = "retired"  # left the job (a migration's leaver, an aborted joiner): its exit is no failure


@dataclass
class WorkerRecord:
    """The coordinator's view of one spawned process. Times are ``time.monotonic()``."""

    spawn_id: int
    role: Role
    rank: int | None = None
    node: str = ""
    pid: int | None = None
    live: bool = True  # spawned and its exit not reported yet
    chan: Channel | None = None
    last_hb: float = 0.0
    last_progress: float = 0.0
    last_step_wall: float = 0.0  # wall time of its last step report (0: none yet)
    coll: bool = False  # a gradient allreduce is pending on this rank
    # its last heartbeat's word: seconds out of any collective without a step (wire.Heartbeat)
    idle_s: float | None = None
    moving: bool = False  # its last heartbeat's word: its thread ran or waited for a CPU since the one before
    at: str | None = None  # its last heartbeat's word: where its training thread was
    stepped: bool = False  # completed a step in the current generation
    killed_for_hang: str | None = None  # why nonstop killed it, if it did
    judging_since: float | None = None  # silent: its agent is asked to kill it unless it moves
    excused: bool = False  # its agent saw it move while silent (agent/silence.py); a heartbeat clears it
    fault_at: float | None = None  # wall time an injected fault fired on it
    fault_report: tuple[float, str] | None = None  # (when, error) of a reported exception
    told_to_raise_at: float | None = None  # when it was told to raise that exception (it exits)
    # its fault report's rescue (train/rescue.py): (step or None, digest), until it is reconfigured;
    # ``told_gen``: the generation it was last told to join (an older generation's report is stale)
    rescue: Report | None = None
    told_gen: int = 0
    chan_closed_at: float | None = None
    # its LOCAL_RANK on its node, once it plays a rank (coordinator/torch_env.py); on a node with
    # devices, the device its agent gave it at spawn (devices/inventory.py), from its spawned report
    local_rank: int | None = None


@dataclass
class NodeRecord:
    """The coordinator's view of one node (its agent)."""

    name: str
    chan: Channel | None  # None: restored from the control store, its agent not reconnected yet
    nproc: int
    spares: int
    domain: str
    data_addr: str
    last_lease: float
    alive: bool = True
    quarantined: bool = False
    in_process: bool = False  # the coordinator's own node: no lease (they fail together)
    failure_times: list[float] = field(default_factory=list)
    lease_id: int = 0  # store mode: the agent's lease on its nodes/<name> key
    disconnected_at: float | None = None  # store mode: its channel dropped (it may reconnect)
    draining: bool = False  # a preemption notice: its ranks move away, nothing new goes there
    devices: int | None = None  # accelerator devices, one per process (devices/inventory.py); None: CPU


def node_order(name: str) -> tuple[int, int, str]:
    """Nodes sort by number when named by one, then by name."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


@dataclass
class JobView:
    """Membership and progress of one job (see the module docstring)."""

    job_id: str
    world_size: int
    phase: JobPhase = JobPhase.STARTING
    generation: int = 0
    next_sid: int = 0
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    workers: dict[int, WorkerRecord] = field(default_factory=dict)
    members: dict[int, int] = field(default_factory=dict)  # rank -> spawn id
    rank_node: dict[int, str] = field(default_factory=dict)  # rank -> node that plays (played) it
    latest_step: dict[int, int] = field(default_factory=dict)  # rank -> newest step snapshotted
    # rank -> newest step completed (snapshotted or not: --snapshot-every K > 1 skips some);
    # where a swap's boundary goes. Not kept in the record: a new coordinator starts it afresh.
    reached_step: dict[int, int] = field(default_factory=dict)
    done_ranks: set[int] = field(default_factory=set)
    replicated_step: int | None = None
    failures_total: int = 0
    reports: list[dict[str, Any]] = field(default_factory=list)

    def adopt(self, other: JobView) -> None:
        """Become ``other`` in place (a coordinator restarted from its record): every operation
        holding this view sees the adopted state, as a whole, not field by field."""
        vars(self).update(vars(other))

    # -- queries --------------------------------------------------------------------------------
    def alive_nodes(self) -> list[str]:
        """Live, unquarantined nodes in node order."""
        return sorted((n for n, r in self.nodes.items() if r.alive and not r.quarantined), key=node_order)

    def live(self, sid: int) -> bool:
        w = self.workers.get(sid)
        return w is not None and w.live

    def node_of(self, sid: int) -> str:
        w = self.workers.get(sid)
        return w.node if w is not None else ""

    def is_member(self, w: WorkerRecord) -> bool:
        return w.rank is not None and self.members.get(w.rank) == w.spawn_id

    def ranks_on(self, node: str) -> list[int]:
        """Ranks of the current generation played on ``node``."""
        return sorted(r for r in self.members if self.rank_node.get(r) == node)

    def load(self, nodes: list[str]) -> dict[str, int]:
        """Ranks each of ``nodes`` plays."""
        return {n: sum(1 for r in self.members if self.rank_node.get(r) == n) for n in nodes}

    def placement(self) -> dict[str, list[int]]:
        """node -> the ranks it plays, for every rank of the world."""
        out: dict[str, list[int]] = {}
        for rank in range(self.world_size):
            out.setdefault(self.rank_node[rank], []).append(rank)
        return out

    def idle_spares(self) -> dict[int, str]:
        """Connected hot spares waiting for a rank, not on a draining node: spawn id -> node."""
        return {
            sid: w.node
            for sid, w in self.workers.items()
            if w.role is Role.SPARE
            and w.rank is None
            and w.chan is not None
            and not w.killed_for_hang
            and w.live
            and not self.nodes[w.node].draining
        }

    def room_on(self, node: str) -> int | None:
        """How many more processes ``node`` has a free device for (None: a CPU node, no limit).
        A process holds its device until its exit is reported (retired ones included)."""
        devices = self.nodes[node].devices
        if devices is None:
            return None
        return max(0, devices - sum(1 for w in self.workers.values() if w.node == node and w.live))

    def spares_on(self, node: str) -> int:
        """Live spare processes on ``node`` (connected or still starting)."""
        return sum(1 for w in self.workers.values() if w.role is Role.SPARE and w.node == node and w.live)

    def members_alive(self) -> bool:
        return any(self.live(sid) for sid in self.members.values())

    def all_done(self) -> bool:
        return self.done_ranks >= set(range(self.world_size))

    # -- changes ----------------------------------------------------------------------------------
    def add_worker(self, node: str, role: Role, rank: int | None, now: float) -> WorkerRecord:
        """A process about to be spawned on ``node``; a rank makes it that rank's member."""
        sid = self.next_sid
        self.next_sid += 1
        w = WorkerRecord(spawn_id=sid, role=role, rank=rank, node=node, last_hb=now, last_progress=now)
        self.workers[sid] = w
        if rank is not None:
            self.members[rank] = sid
            self.rank_node[rank] = node
        return w

    def reached(self, rank: int) -> int:
        """The newest step ``rank`` completed, snapshotted or not (``latest_step`` may hold a
        newer one than ``reached_step`` where no step report set it: a rank's ``done``, or a
        coordinator that restarted from the store's record)."""
        return max(self.latest_step.get(rank, 0), self.reached_step.get(rank, 0))

    def rewind(self, step: int) -> None:
        """Every rank goes back to ``step``: later step reports are void."""
        self.latest_step = {rank: step for rank in range(self.world_size)}
        self.reached_step = dict(self.latest_step)
        if self.replicated_step is not None and self.replicated_step > step:
            self.replicated_step = step

    def renumber(self, new_of: dict[int, int], world_size: int) -> None:
        """A shrink: ranks that stay get their new numbers; the others leave the membership."""
        self.world_size = world_size
        self.members = {new_of[r]: sid for r, sid in self.members.items() if r in new_of}
        for rank, sid in self.members.items():
            self.workers[sid].rank = rank
        self.rank_node = {new_of[r]: n for r, n in self.rank_node.items() if r in new_of}
        self.latest_step = {new_of[r]: st for r, st in self.latest_step.items() if r in new_of}
        self.reached_step = {new_of[r]: st for r, st in self.reached_step.items() if r in new_of}

    # -- the record (JSON) ------------------------------------------------------------------------
    def to_record(self) -> dict[str, Any]:
        """The whole view as JSON types (channels and timers excepted)."""
        return {
            "job_id": self.job_id,
            "generation": self.generation,
            "state": str(self.phase),
            "world_size": self.world_size,
            "next_sid": self.next_sid,
            "workers": {
                str(sid): {
                    "role": str(w.role),
                    "rank": w.rank,
                    "node": w.node,
                    "pid": w.pid,
                    "live": w.live,
                    "local_rank": w.local_rank,
                }
                for sid, w in self.workers.items()
            },
            "members": {str(r): sid for r, sid in self.members.items()},
            "rank_node": {str(r): n for r, n in self.rank_node.items()},
            "latest_step": {str(r): s for r, s in self.latest_step.items()},
            "replicated_step": self.replicated_step,
            "done_ranks": sorted(self.done_ranks),
            "failures_total": self.failures_total,
            "reports": self.reports,
            "nodes": {
                n: {
                    "nproc": r.nproc,
                    "spares": r.spares,
                    "domain": r.domain,
                    "data_addr": r.data_addr,
                    "alive": r.alive,
                    "quarantined": r.quarantined,
                    "lease_id": r.lease_id,
                    "failures": len(r.failure_times),
                    "draining": r.draining,
                    "devices": r.devices,
                }
                for n, r in self.nodes.items()
            },
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any], *, now: float, grace_until: float) -> JobView:
        """A view from :meth:`to_record`'s output. Channels are None until peers reconnect; every
        worker counts as heard from at ``grace_until`` (it reconnects before it counts as hung)."""
        v = cls(job_id=str(rec["job_id"]), world_size=int(rec["world_size"]))
        v.generation = int(rec["generation"])
        v.phase = JobPhase(str(rec["state"]))
        v.next_sid = int(rec["next_sid"])
        for sid_s, wd in dict(rec["workers"]).items():
            sid = int(sid_s)
            rank = wd.get("rank")
            v.workers[sid] = WorkerRecord(
                spawn_id=sid,
                role=Role(str(wd["role"])),
                rank=None if rank is None else int(rank),
                node=str(wd["node"]),
                pid=None if wd.get("pid") is None else int(wd["pid"]),
                live=bool(wd.get("live")),
                local_rank=None if wd.get("local_rank") is None else int(wd["local_rank"]),
                last_hb=grace_until,
                last_progress=grace_until,
            )
        v.members = {int(r): int(sid) for r, sid in dict(rec["members"]).items()}
        v.rank_node = {int(r): str(n) for r, n in dict(rec["rank_node"]).items()}
        v.latest_step = {int(r): int(st) for r, st in dict(rec["latest_step"]).items()}
        rs = rec.get("replicated_step")
        v.replicated_step = None if rs is None else int(rs)
        v.done_ranks = {int(r) for r in rec.get("done_ranks", [])}
        v.failures_total = int(rec.get("failures_total", 0))
        v.reports = list(rec.get("reports", []))
        for name, nd in dict(rec["nodes"]).items():
            v.nodes[name] = NodeRecord(
                name=name,
                chan=None,
                nproc=int(nd["nproc"]),
                spares=int(nd["spares"]),
                domain=str(nd["domain"]),
                data_addr=str(nd["data_addr"]),
                last_lease=now,
                alive=bool(nd["alive"]),
                quarantined=bool(nd["quarantined"]),
                lease_id=int(nd.get("lease_id", 0)),
                draining=bool(nd.get("draining", False)),
                devices=None if nd.get("devices") is None else int(nd["devices"]),
            )
        return v
