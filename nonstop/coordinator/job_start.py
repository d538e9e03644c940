"""The job's start: the nodes join, a resumed checkpoint is installed on them, the first
processes are spawned, and the first generation begins once every one of them connected.

* **join**: the job starts once ``nnodes`` agents joined (:mod:`nonstop.coordinator.node_agents`
  admits them), or fails when they have not within ``join_timeout_s`` of the coordinator's start;
* **resume** (``--resume``, or the durable tier's newest checkpoint): its step is installed on
  every node first; a sharded job's checkpoint written at another world size is installed
  nowhere: every new rank cuts its shards out of the old ranks' (the first generation reshards
  from it, :meth:`~nonstop.coordinator.peers.ResumePoint.reshard_first`);
* **first processes**: each node's ranks and its spares; the first generation begins when every
  member connected (:meth:`JobStart.connected`, from the workers' protocol).

Threading: the coordinator's thread only. I/O through the executor; the durable tier is read
once (``world_at``) to tell a checkpoint of another size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from nonstop import events as ev
from nonstop.coordinator.view import Role
from nonstop.policy.phase import JobPhase

if TYPE_CHECKING:
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import DurableInstall, ResumePoint
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog

__all__ = ["JobStart", "durable_world_size"]


def durable_world_size(url: str, step: int) -> int:
    """The world size that wrote checkpoint ``step`` at ``url`` (read from its manifest)."""
    from nonstop.snapshot.durable import DurableStore

    return DurableStore(url).world_size_at(step)


class JobStart:
    """The job's start (see the module docstring).

    ``nnodes``, ``nproc_per_node``, ``join_timeout_s``, ``world_size``: the job's; ``resume_url``:
    where a resumed checkpoint is read (``--resume``, else the durable tier; None: neither);
    ``sharded``: the job has a mesh (a checkpoint of another size is resharded, not installed);
    ``since``: when the coordinator started (monotonic), which the join timeout counts from.
    Peers: ``generations`` (the resumed step, the first generation) and ``installer`` (the
    durable install on the nodes)."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        nnodes: int,
        nproc_per_node: int,
        join_timeout_s: float,
        world_size: int,
        resume_url: str | None,
        sharded: bool,
        since: float,
        generations: ResumePoint,
        installer: DurableInstall,
        world_at: Callable[[str, int], int] = durable_world_size,
    ) -> None:
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.join_timeout_s = join_timeout_s
        self.world_size = world_size
        self.resume_url = resume_url
        self.sharded = sharded
        self.started_at = since  # node 0 waits join_timeout_s for the others from here
        self.generations = generations
        self.installer = installer
        self.world_at = world_at
        self.starting = False  # the nodes joined: a resumed checkpoint is being installed

    def check_join(self, now: float) -> None:
        """A tick while the job starts: start it once enough nodes joined, or fail it at the
        join timeout. Once started (members spawned, or an install under way) it does nothing."""
        if self.view.phase is not JobPhase.STARTING or self.view.members or self.starting:
            return
        alive = self.view.alive_nodes()
        if len(alive) >= self.nnodes:
            self.start_job(alive[: self.nnodes])
        elif now - self.started_at > self.join_timeout_s:
            self.life.fail(
                f"only {len(alive)} of {self.nnodes} nodes joined within "
                f"{self.join_timeout_s:g}s; start `nonstop run --node-rank I` on every node"
            )

    def start_job(self, nodes: list[str]) -> None:
        """``nodes`` joined: install the resumed checkpoint (if any), then spawn the first processes."""
        self.events.emit(ev.NodesJoined(nodes=nodes))
        step = self.generations.initial_step
        if step is None:
            self._spawn_all(nodes)
            return
        placement = {
            n: list(range(i * self.nproc_per_node, (i + 1) * self.nproc_per_node))
            for i, n in enumerate(nodes)
        }
        url = self.resume_url
        if url is None:
            self.life.fail(f"could not install the resumed checkpoint step {step}: no durable tier")
            return
        if self.sharded:
            written = self.world_at(url, step)
            if written != self.world_size:
                # every new rank cuts its shards out of all the old ranks' (its worker reads
                # them from the durable tier once its model is built on the new mesh)
                self.generations.reshard_first({"url": url, "step": step, "world": written})
                self._spawn_all(nodes)
                return
        self.starting = True

        def installed(got: int | None) -> None:
            if got is None:
                self.life.fail(f"could not install the resumed checkpoint step {step} on every node")
            else:
                self._spawn_all(nodes)

        self.installer.install_durable([step], placement, url, installed)

    def _spawn_all(self, nodes: list[str]) -> None:
        """The first processes: every node's ranks and its spares."""
        for i, name in enumerate(nodes):
            for k in range(self.nproc_per_node):
                self.io.spawn(name, Role.WORKER, i * self.nproc_per_node + k)
            for _ in range(self.view.nodes[name].spares):
                self.io.spawn(name, Role.SPARE, None)

    def connected(self) -> None:
        """A process connected while the job starts: once every member has, the first
        generation begins."""
        if self.view.members and all(
            self.view.workers[sid].chan is not None for sid in self.view.members.values()
        ):
            self.generations.begin([])
