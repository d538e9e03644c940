"""The coordinator: one per job. It routes every event to the operation that owns it.

Threading: one thread (the caller of :meth:`Coordinator.run`) owns all state; the control
server's threads only put events on a queue, and :meth:`Coordinator.tick` handles them.

State: a :class:`~nonstop.coordinator.view.JobView` (nodes, processes and their roles, membership,
progress) in a :class:`~nonstop.policy.phase.JobPhase`, which decides which background operation
may start. I/O goes through one :class:`~nonstop.coordinator.executor.Executor`. The operations:

=================================  ==========================================================
``start`` (coordinator/job_start.py)   the nodes joined: a resumed checkpoint installed, the first processes
``agents`` (coordinator/node_agents.py)      nodes are admitted, renew leases, are lost or quarantined; spares
``failures`` (coordinator/failures.py) exits and hangs become failures, failures a new generation
``gens`` (coordinator/generations.py)  plan generations (pure ``Pending``, ``plan_generation``)
``setup`` (generation_setup.py)    launch and time a planned one (pure ``Reconfiguration``)
``swaps`` (coordinator/swaps.py)     live migrations and grows: the pure ``BoundarySwap`` machine
``replication`` (replication.py)   replication rounds to the peers' memory
``store`` (coordinator/store_sync.py)   store mode: lead, save the record, resume from it
``clients`` (coordinator/client_requests.py)   ``nonstop status / persist / migrate / drain``
``workers`` (coordinator/workers.py)   the workers' protocol: connections, heartbeats, step reports,
                                   rendezvous ``kv``, stage reports (fenced by generation)
=================================  ==========================================================

This module keeps the loop, the committed step and the job's end; every operation is built and
wired, in its order and with its late binds, by :func:`~nonstop.coordinator.assembly.assemble`
(:mod:`nonstop.coordinator.assembly`); which operation handles each event of the control server
and each decoded message is one table, ``routes`` (:mod:`nonstop.coordinator.routing`).

Fencing: every message from a worker carries the generation it was sent in;
``restored``/``ready``/``step``/``done``/``fault``/``kv`` from an older generation, from a
process that is no longer a member, or from a lost node are ignored or refused, so two
processes never play one rank in one generation. A message its authenticated sender built wrong
fails that sender only (:meth:`Routes.dispatch <nonstop.coordinator.routing.Routes.dispatch>`).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from nonstop.config import JobConfig
from nonstop.control.jobstore import JobStore
from nonstop.control.listener import ControlServer
from nonstop.coordinator.assembly import assemble
from nonstop.coordinator.metrics import JobMonitor
from nonstop.coordinator.persistence import ClusterPersister
from nonstop.coordinator.view import NodeRecord
from nonstop.events.log import EventLog
from nonstop.policy.phase import TICK_S, JobPhase, Op
from nonstop.protocol.agent import NodeFinishMsg
from nonstop.snapshot.persist import Persister

__all__ = ["Coordinator", "JobResult", "JobState", "NodeRecord"]

JobState = JobPhase  # the name the launcher, the CLI and the tests know


@dataclass
class JobResult:
    state: JobState
    generation: int
    final_step: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    usage_error: bool = False  # error is the training script's mistake (nonstop run exits 2)
    median_step_s: float | None = None
    replication: dict[str, Any] = field(default_factory=dict)


class Coordinator:
    """One job's coordinator (see the module docstring). ``persister``: one node's
    :class:`~nonstop.snapshot.persist.Persister`, or a job of several nodes' persist rounds;
    ``initial_step``: a resumed durable checkpoint to install first; ``jobs``: store mode."""

    def __init__(
        self,
        *,
        config: JobConfig,
        server: ControlServer,
        events: EventLog,
        job_id: str,
        worker_env: dict[str, str],
        persister: Persister | ClusterPersister | None = None,
        durable_url: str | None = None,
        initial_step: int | None = None,
        jobs: JobStore | None = None,
    ) -> None:
        self.config = config
        self.server = server
        self.events = events
        self.durable_url = durable_url
        # --metrics-port: step reports and status snapshots for the metrics server (metrics.py)
        self.monitor: JobMonitor | None = None
        # every operation, built and wired in its order (coordinator/assembly.py)
        self.ops = ops = assemble(
            config=config,
            events=events,
            job_id=job_id,
            address=server.address,
            worker_env=worker_env,
            persister=persister,
            durable_url=durable_url,
            initial_step=initial_step,
            jobs=jobs,
            monitor=lambda: self.monitor,
        )
        # the operations under the names the loop, the launcher, the status server and the tests use
        self.view = ops.view
        self.io = ops.io
        self.life = ops.life
        self.detector = ops.detector
        self.replication = ops.replication
        self.sources = ops.sources
        self.swaps = ops.swaps
        self.store = ops.store
        self.health = ops.health
        self.resize = ops.resize
        self.agents = ops.agents
        self.setup = ops.setup
        self.gens = ops.gens
        self.start = ops.start
        self.failures = ops.failures
        self.clients = ops.clients
        self.persists = ops.persists
        self.feed = ops.feed
        self.workers = ops.workers
        self.routes = ops.routes

    def status(self) -> dict[str, Any]:
        """What ``nonstop status`` shows (JSON types)."""
        return self.clients.status()

    @property
    def job_id(self) -> str:
        """The job's id: the view's (a restarted coordinator's is its record's)."""
        return self.view.job_id

    @property
    def error(self) -> str | None:
        return self.life.error

    @property
    def usage_error(self) -> bool:
        return self.life.usage_error

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def state(self) -> JobPhase:
        return self.view.phase

    @property
    def generation(self) -> int:
        return self.view.generation

    @property
    def replication_on(self) -> bool:
        return self.ops.shape.replicating

    def run(self, stop: threading.Event) -> JobResult:
        if self.store.jobs is not None:
            self.store.open()
        while self.view.phase not in (JobState.DONE, JobState.FAILED):
            if stop.is_set():
                self.life.fail("stopped by signal")
                break
            self.tick(TICK_S)
        while not self.persists.final_tick():  # the job ended: its last step is made durable
            self.pump_events(TICK_S)
        return self._close()

    def tick(self, wait_s: float = 0.0) -> None:
        """One turn of the loop: handle the events that arrived (waiting up to ``wait_s`` for
        the first), then every periodic check. Tests drive a coordinator through this."""
        self.pump_events(wait_s)
        self.agents.check_leases(self.ops.clock.monotonic())
        self.store.tick()
        self.start.check_join(self.ops.clock.monotonic())
        self.failures.handle_exits()
        self.pump_events(0)
        self.failures.detect()
        self.setup.check_timeouts()
        if self.replication_on and self.life.may_start(Op.REPLICATE):
            self.replication.maybe_start(now=self.ops.clock.monotonic())
        self.persists.tick()
        self.swaps.tick()
        self.health.tick()  # issue 21: stragglers judged, a proactive move asked
        self.gens.inventory_tick()
        self.sources.install_tick()
        self.gens.replan_tick()
        self.clients.answer_persists()
        if self.monitor is not None:
            self.monitor.tick()
        self.feed.tick(
            committed=self.life.committed(), generation=self.generation, world_size=self.view.world_size
        )

    def _close(self) -> JobResult:
        """The job ended (and its last step is persisted): release the nodes, the result."""
        for node in self.view.nodes.values():
            self.io.send_node(node, NodeFinishMsg(failed=self.view.phase is JobState.FAILED).encode())
        self.store.close()
        self.feed.close()
        final = min(self.view.latest_step.values()) if self.view.latest_step else 0
        return JobResult(
            state=self.view.phase,
            generation=self.view.generation,
            final_step=final,
            failures=self.view.reports,
            error=self.error,
            usage_error=self.usage_error,
            median_step_s=self.detector.median_step_s,
            replication=self.replication_stats(),
        )

    def replication_stats(self) -> dict[str, Any]:
        return self.replication.stats()

    # -- events ------------------------------------------------------------------------------
    def pump_events(self, timeout: float) -> None:
        try:
            kind, chan, msg = self.server.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self.routes.dispatch(kind, chan, msg)
            try:
                kind, chan, msg = self.server.events.get_nowait()
            except queue.Empty:
                return
