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

This module keeps the loop, the committed step and the job's end; which operation handles each
event of the control server and each decoded message is one table, ``routes``
(:mod:`nonstop.coordinator.routing`).

Fencing: every message from a worker carries the generation it was sent in;
``restored``/``ready``/``step``/``done``/``fault``/``kv`` from an older generation, from a
process that is no longer a member, or from a lost node are ignored or refused, so two
processes never play one rank in one generation. A message its authenticated sender built wrong
fails that sender only (:meth:`Routes.dispatch <nonstop.coordinator.routing.Routes.dispatch>`).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nonstop.config import JobConfig
from nonstop.control.jobstore import JobStore
from nonstop.control.listener import ControlServer
from nonstop.control.rdzv import KeyValueTable
from nonstop.coordinator.client_requests import ClientRequests, JobFacts
from nonstop.coordinator.detector import FailureDetector
from nonstop.coordinator.event_feed import EventFeed
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.failures import Failures
from nonstop.coordinator.generation_setup import GenerationSetup
from nonstop.coordinator.generations import Generations
from nonstop.coordinator.health import Health
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.job_start import JobStart
from nonstop.coordinator.metrics import JobMonitor
from nonstop.coordinator.node_agents import AgentTerms, NodeAgents
from nonstop.coordinator.persistence import ClusterPersister, PersistOps
from nonstop.coordinator.plan_asks import PlanAsks
from nonstop.coordinator.replication import ReplicationRounds
from nonstop.coordinator.resizing import Resizing
from nonstop.coordinator.restore_sources import RestoreSources
from nonstop.coordinator.routing import Routes
from nonstop.coordinator.store_sync import StoreSync
from nonstop.coordinator.swap_actions import SwapActions
from nonstop.coordinator.swaps import Swaps
from nonstop.coordinator.view import JobView, NodeRecord
from nonstop.coordinator.workers import WorkerProtocol, cadence_tuner
from nonstop.errors import ControlError
from nonstop.events.log import EventLog
from nonstop.mesh import MeshSpec
from nonstop.policy.decisions import QuarantinePolicy
from nonstop.policy.elastic import ElasticPolicy
from nonstop.policy.phase import TICK_S, JobPhase, Op
from nonstop.policy.survivors import SurvivorMode
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
        self.worker_env = worker_env
        # one node: a Persister over the node's memory; several: rounds across the nodes
        self.persister = persister
        self.rounds = persister if isinstance(persister, ClusterPersister) else None
        self.durable_url = durable_url
        self.server = server
        self.events = events
        self.view = JobView(job_id=job_id, world_size=config.world_size)
        self.io = Executor(self.view, events)
        # the phase, what may start, the committed step, failing and finishing (coordinator/job.py)
        self.life = JobLife(view=self.view, events=events, io=self.io, replicating=self.replication_on)
        if self.rounds is not None:
            self.rounds.attach(self.io.send_to)
        # elastic (policy/elastic.py): the data-parallel shards stay those of the full-size job;
        # a sharded job comes and goes by whole replica groups (nonstop/mesh.py)
        self.mesh = MeshSpec.parse(config.mesh) if config.mesh is not None else None
        mesh = self.mesh
        self.num_shards = mesh.dp_size if mesh else config.world_size * config.elastic.shards_per_rank
        self.survivor_mode = SurvivorMode(config.elastic.survivors)  # policy/survivors.py
        self.elastic = ElasticPolicy(
            full_world_size=config.world_size,
            min_world_size=config.min_world,
            wait_s=config.elastic.wait_s,
            unit=mesh.group_size if mesh else 1,
        )
        # replicating: the held replicated step, the one a round is sending, the newest, one to write
        self.num_slots = 4 if config.replication.replicas > 0 and config.nnodes > 1 else 2
        self.detector = FailureDetector(config.detection.detector)
        self.quarantine = QuarantinePolicy(
            max_failures=config.detection.quarantine_failures, window_s=config.detection.quarantine_window_s
        )
        self.kv = KeyValueTable()
        self.replication = ReplicationRounds(
            view=self.view,
            io=self.io,
            events=events,
            replicas=config.replication.replicas,
            mesh=self.mesh,
        )
        # where restore steps come from: peers' memory (fetches) or the durable tier
        self.sources = RestoreSources(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            durable_url=durable_url,
            elastic=self.elastic.enabled,
            install_timeout_s=config.persist.timeout_s,
        )
        # live migrations and elastic grows: boundary swaps (policy/boundary_swap.py, coordinator/swaps.py)
        self.swaps = Swaps(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            actions=SwapActions(view=self.view, io=self.io, events=events, sources=self.sources),
            elastic=self.elastic,
            detector=self.detector,
            full_world_size=config.world_size,
            rebuild_timeout_s=config.detection.rebuild_timeout_s,
            swap_transfer=config.operations.swap_transfer,
            persist=self.rounds,
        )
        # store mode (--store etcd://): state saved in and restored from the control store
        self.store = StoreSync(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            jobs=jobs,
            address=server.address,
            lease_ttl_s=config.detection.lease_ttl_s,
            reconnect_s=config.control.reconnect_s,
            store_url=config.control.store,
            swaps=self.swaps,
        )
        # issue 21: fail-slow ranks, graded failures, probe verdicts, proactive moves (healthops.py)
        self.health = Health(
            view=self.view,
            events=events,
            config=config.detection.straggler,
            quarantine=self.quarantine,
            mover=self.swaps,
        )
        # the job's size: data shards, shrinks, where a resharded generation reads
        self.resize = Resizing(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            mesh=self.mesh,
            elastic=self.elastic,
            survivor_mode=self.survivor_mode,
            detector=self.detector,
            num_shards=self.num_shards,
            full_world_size=config.world_size,
            drop_batch=config.elastic.shrink_batch == "drop",
            durable_url=durable_url,
            swaps=self.swaps,
            sources=self.sources,
        )
        # node agents: admission, leases, losses, quarantine, spares
        self.agents = NodeAgents(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            terms=AgentTerms(
                nproc_per_node=config.nproc_per_node,
                lease_ttl_s=config.detection.lease_ttl_s,
                num_slots=self.num_slots,
                replicas=config.replication.replicas if self.replication_on else 0,
                worker_env=worker_env,
                store_mode=jobs is not None,
                store=config.control.store if jobs is not None else None,
                reconnect_s=config.control.reconnect_s,
                elastic=self.elastic.enabled,
            ),
            quarantine=self.quarantine,
            store=self.store,
            fetches=self.sources,
            rounds=self.replication,
        )
        # generations: planning every membership change (generations.py), and carrying each
        # planned one out: launch, stages, timing (generation_setup.py)
        self.setup = GenerationSetup(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            detector=self.detector,
            rebuild_timeout_s=config.detection.rebuild_timeout_s,
            shards=self.resize,
            swaps=self.swaps,
            spares=self.agents,
        )
        self.gens = Generations(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            asks=PlanAsks(
                view=self.view,
                io=self.io,
                rescue_wait_s=config.snapshot.rescue_wait_s,
                mesh=self.mesh,
                rescues=lambda: self.workers.rescues,
            ),
            setup=self.setup,
            sources=self.sources,
            sizes=self.resize,
            elastic=self.elastic,
            durable_url=durable_url,
            initial_step=initial_step,
            exits_waiting=lambda sids: self.failures.waiting(sids),
            fences=(lambda _: self.replication.reset(), self._fence_rendezvous),
        )
        self.sources.bind(setup=self.setup, needs=self.resize)
        # the job's start: the nodes joined, a resumed checkpoint installed, the first processes
        self.start = JobStart(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            nnodes=config.nnodes,
            nproc_per_node=config.nproc_per_node,
            join_timeout_s=config.join_timeout_s,
            world_size=config.world_size,
            resume_url=config.persist.resume or durable_url,
            sharded=config.mesh is not None,
            since=time.monotonic(),
            generations=self.gens,
            installer=self.sources,
        )
        # process exits and hangs become failures, failures become a recovery
        self.failures = Failures(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            detector=self.detector,
            max_restarts=config.max_restarts,
            faults_dir=config.job_dir.resolve() / "faults",
            swaps=self.swaps,
            grader=self.health,
            nodes=self.agents,
            recovery=self.gens,
        )
        # clients (nonstop status / persist / migrate / drain)
        self.clients = ClientRequests(
            view=self.view,
            io=self.io,
            life=self.life,
            facts=JobFacts(
                job_id=job_id,
                durable_url=durable_url,
                num_shards=self.num_shards,
                full_world_size=config.world_size,
                min_world_size=self.elastic.min_world_size,
                store=config.control.store,
            ),
            persister=persister,
            rounds=self.rounds,
            swaps=self.swaps,
            health=self.health,
            resize=self.resize,
        )
        # persist rounds of a job of several nodes
        self.persists = PersistOps(
            view=self.view,
            life=self.life,
            rounds=self.rounds,
            timeout_s=config.persist.timeout_s,
            store=self.store,
            clients=self.clients,
        )
        # --metrics-port: step reports and status snapshots for the metrics server (metrics.py)
        self.monitor: JobMonitor | None = None
        # Session.on_event: the job's events to the workers that subscribed (eventfeed.py)
        self.feed = EventFeed()
        events.subscribe(self.feed.on_event)
        # the workers' protocol: connections, heartbeats, step reports, rendezvous, stage reports
        self.workers = WorkerProtocol(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            cadence=cadence_tuner(config, self.mesh),
            snapshot_every=config.snapshot.every,
            start=self.start,
            setup=self.setup,
            resumes=self.store,
        )
        # the peers that call back into the swaps, the store sync and the node agents, built after them
        self.swaps.actions.bind(gens=self.gens, resize=self.resize)
        self.swaps.bind(resize=self.resize, nodes=self.agents)
        self.store.bind(nodes=self.agents, workers=self.workers, gens=self.gens)
        self.agents.bind(exits=self.failures)
        # which operation handles each event of the control server and each message (routing.py)
        self.routes = Routes(
            view=self.view,
            io=self.io,
            events=events,
            agents=self.agents,
            workers=self.workers,
            clients=self.clients,
            failures=self.failures,
            health=self.health,
            swaps=self.swaps,
            sources=self.sources,
            replication=self.replication,
            rounds=self.rounds,
            setup=self.setup,
            resize=self.resize,
            kv=self.kv,
            feed=self.feed,
            detector=self.detector,
            monitor=lambda: self.monitor,
        )
        self.life.busy_from(self.setup.busy, self.swaps.busy, self.store.busy)
        self.life.before_finish(self.swaps.finish)

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
        return self.config.replication.replicas > 0 and self.config.nnodes > 1

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
        self.agents.check_leases(time.monotonic())
        self.store.tick()
        self.start.check_join(time.monotonic())
        self.failures.handle_exits()
        self.pump_events(0)
        self.failures.detect()
        self.setup.check_timeouts()
        if self.replication_on and self.life.may_start(Op.REPLICATE):
            self.replication.maybe_start(now=time.monotonic())
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

    def _fence_rendezvous(self, generation: int) -> None:
        """Generation ``generation`` opened: the rendezvous drops the older keys and fails the
        calls parked on them (a worker gone meanwhile is not told)."""
        for reply, msg in self.kv.new_generation(generation):
            try:
                reply(msg)
            except ControlError:
                pass

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
