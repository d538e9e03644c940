"""The coordinator's operations, built and wired: :func:`assemble` takes a job's config and
returns its :class:`Operations`, which :class:`~nonstop.coordinator.loop.Coordinator` drives.

What is built, in this order (each group by a function of its own):

1. **the core** (:func:`_core`): the :class:`~nonstop.coordinator.view.JobView`, the one
   :class:`~nonstop.coordinator.executor.Executor`, :class:`~nonstop.coordinator.job.JobLife`, the
   failure detector, the rendezvous table; persist rounds (a job of several nodes) attached to the
   executor's sends. With it **the job's shape** (:func:`job_shape`, job_shape.py): pure policies
   and sizes the config fixes (mesh, data shards, elastic policy, survivors, snapshot slots,
   quarantine);
2. **the data** (:func:`_data`): replication rounds and the restore sources;
3. **the moves** (:func:`_moves`): the swaps (live migrations, grows) with their actions, the
   store sync (it records the swaps), the health (it moves through the swaps) and the resizing;
4. **the nodes** (:func:`_node_agents`): admission, leases, losses, spares;
5. **the recovery** (:func:`_recovery`): the generation setup, the generations (with their plan
   asks), then the job's start (it resumes through the generations) and the failures (they
   recover through the generations);
6. **the observers** (:func:`_observers`): the clients, persist ops, the event feed (subscribed to
   the event log here) and the workers' protocol;
7. **the late binds** (:func:`_bind`) and **the routes** (:func:`_routes`): which operation
   handles each event; last, what :class:`JobLife` asks every tick (who is busy, what a finish
   waits for).

Why binds come late: where two operations call each other, the one built first gets the other by
its ``bind(...)``, once, here, before the first event. The swap actions need the generations and
the resizing (built after the swaps, which both use); the swaps need the resizing (grow joiners)
and the node agents (a drained node lost); the store sync needs the node agents, the workers'
protocol and the generations (each built after it: they call back into it); the node agents
need the failures as the sink of exits (the failures see the node agents as their history); the
restore sources need the setup (it waits for their fetches) and the resizing (what a reshard
needs). Two cycles are closed by a lambda instead, read when called (never during assembly): the
plan asks read the workers' protocol's ``rescues`` and the generations the failures' waiting
exits (:class:`_Later`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nonstop.config import JobConfig
from nonstop.control.jobstore import JobStore
from nonstop.control.rdzv import KeyValueTable
from nonstop.coordinator.client_requests import ClientRequests, JobFacts
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.detector import FailureDetector
from nonstop.coordinator.event_feed import EventFeed
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.failures import Failures
from nonstop.coordinator.generation_setup import GenerationSetup
from nonstop.coordinator.generations import Generations
from nonstop.coordinator.health import Health
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.job_shape import JobShape, job_shape, replicates
from nonstop.coordinator.job_start import JobStart
from nonstop.coordinator.metrics import JobMonitor
from nonstop.coordinator.node_agents import AgentTerms, NodeAgents
from nonstop.coordinator.operations import Operations
from nonstop.coordinator.persistence import ClusterPersister, PersistOps
from nonstop.coordinator.plan_asks import PlanAsks
from nonstop.coordinator.replication import ReplicationRounds
from nonstop.coordinator.resizing import Resizing
from nonstop.coordinator.restore_sources import RestoreSources
from nonstop.coordinator.routing import Routes, fence_rendezvous
from nonstop.coordinator.store_sync import StoreSync
from nonstop.coordinator.swap_actions import SwapActions
from nonstop.coordinator.swaps import Swaps
from nonstop.coordinator.view import JobView
from nonstop.coordinator.workers import WorkerProtocol, cadence_tuner
from nonstop.events.log import EventLog
from nonstop.snapshot.persist import Persister

__all__ = ["JobShape", "Operations", "assemble", "job_shape", "replicates"]  # the shape: job_shape.py


@dataclass(frozen=True, kw_only=True)
class _Core:
    """What every operation is built over."""

    view: JobView
    io: Executor
    events: EventLog
    life: JobLife
    detector: FailureDetector
    kv: KeyValueTable
    rounds: ClusterPersister | None  # persist rounds of a job of several nodes
    clock: Clock  # what the operations that take a clock read the time through (clock.py)


class _Later:
    """Operations built after one that calls them through a lambda (a cycle of construction):
    set by :func:`assemble` once built, read only when the lambda is called."""

    workers: WorkerProtocol
    failures: Failures


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What :func:`assemble` was given besides the config (its docstring)."""

    config: JobConfig
    job_id: str
    address: tuple[str, int]
    worker_env: dict[str, str]
    persister: Persister | ClusterPersister | None
    durable_url: str | None
    initial_step: int | None
    jobs: JobStore | None


def assemble(
    *,
    config: JobConfig,
    events: EventLog,
    job_id: str,
    address: tuple[str, int],
    worker_env: dict[str, str],
    persister: Persister | ClusterPersister | None,
    durable_url: str | None,
    initial_step: int | None,
    jobs: JobStore | None,
    monitor: Callable[[], JobMonitor | None],
    clock: Clock = SYSTEM_CLOCK,
) -> Operations:
    """Build and wire one job's operations (the order and the late binds: the module docstring).
    ``address``: the control server's (the store's leader key names it); ``monitor``: the
    metrics hook as it is when an event is routed (set after assembly, ``--metrics-port``);
    ``clock``: what the operations that take one read the time through (:mod:`.clock`)."""
    job = _Job(
        config=config,
        job_id=job_id,
        address=address,
        worker_env=worker_env,
        persister=persister,
        durable_url=durable_url,
        initial_step=initial_step,
        jobs=jobs,
    )
    shape = job_shape(config)
    core = _core(job, events, shape, clock)
    replication, sources = _data(core, shape, job)
    swaps, store, health, resize = _moves(core, shape, job, sources)
    agents = _node_agents(core, shape, job, store=store, sources=sources, replication=replication)
    later = _Later()
    setup, gens, start, failures = _recovery(
        core, shape, job, later, sources=sources, resize=resize, swaps=swaps, agents=agents,
        replication=replication, health=health,
    )  # fmt: skip
    later.failures = failures
    clients, persists, feed, workers = _observers(
        core, shape, job, swaps=swaps, health=health, resize=resize, store=store, start=start, setup=setup
    )
    later.workers = workers
    _bind(
        swaps=swaps, store=store, agents=agents, gens=gens, resize=resize, workers=workers, failures=failures
    )
    routes = _routes(
        core, agents=agents, workers=workers, clients=clients, failures=failures, health=health, swaps=swaps,
        sources=sources, replication=replication, setup=setup, resize=resize, feed=feed, monitor=monitor,
    )  # fmt: skip
    core.life.busy_from(setup.busy, swaps.busy, store.busy)
    core.life.before_finish(swaps.finish)
    return Operations(
        shape=shape,
        view=core.view,
        io=core.io,
        events=events,
        life=core.life,
        detector=core.detector,
        kv=core.kv,
        persister=persister,
        rounds=core.rounds,
        replication=replication,
        sources=sources,
        swaps=swaps,
        store=store,
        health=health,
        resize=resize,
        agents=agents,
        setup=setup,
        gens=gens,
        start=start,
        failures=failures,
        clients=clients,
        persists=persists,
        feed=feed,
        workers=workers,
        routes=routes,
        clock=core.clock,
    )


# -- 1. the core -------------------------------------------------------------------------------------
def _core(job: _Job, events: EventLog, shape: JobShape, clock: Clock) -> _Core:
    """The view, the executor, JobLife (the phase, what may start, the committed step, failing
    and finishing), the detector, the rendezvous table; persist rounds send through the executor."""
    config = job.config
    view = JobView(job_id=job.job_id, world_size=config.world_size)
    io = Executor(view, events, clock=clock)
    life = JobLife(view=view, events=events, io=io, replicating=shape.replicating)
    rounds = job.persister if isinstance(job.persister, ClusterPersister) else None
    if rounds is not None:
        rounds.attach(io.send_to)
    detector = FailureDetector(config.detection.detector)
    return _Core(
        view=view,
        io=io,
        events=events,
        life=life,
        detector=detector,
        kv=KeyValueTable(),
        rounds=rounds,
        clock=clock,
    )


# -- 2. the data: replication, where restore steps come from --------------------------------------------
def _data(core: _Core, shape: JobShape, job: _Job) -> tuple[ReplicationRounds, RestoreSources]:
    """Replication rounds to the peers' memory, and the restore sources: peers' memory (fetches)
    or the durable tier."""
    config = job.config
    replication = ReplicationRounds(
        view=core.view,
        io=core.io,
        events=core.events,
        replicas=config.replication.replicas,
        mesh=shape.mesh,
        clock=core.clock,
    )
    sources = RestoreSources(
        view=core.view,
        io=core.io,
        events=core.events,
        life=core.life,
        durable_url=job.durable_url,
        elastic=shape.elastic.enabled,
        install_timeout_s=config.persist.timeout_s,
        clock=core.clock,
    )
    return replication, sources


# -- 3. the moves: swaps, the store's record, health, the job's size ---------------------------------------
def _moves(
    core: _Core, shape: JobShape, job: _Job, sources: RestoreSources
) -> tuple[Swaps, StoreSync, Health, Resizing]:
    """Live migrations and elastic grows (boundary swaps: policy/boundary_swap.py), store mode's
    record (``--store etcd://``), issue 21's health (fail-slow ranks, graded failures, proactive
    moves, through the swaps), and the job's size (data shards, shrinks, reshards)."""
    config, view, io, events, life = job.config, core.view, core.io, core.events, core.life
    swaps = Swaps(
        view=view,
        io=io,
        events=events,
        life=life,
        actions=SwapActions(view=view, io=io, events=events, sources=sources, clock=core.clock),
        elastic=shape.elastic,
        detector=core.detector,
        full_world_size=config.world_size,
        rebuild_timeout_s=config.detection.rebuild_timeout_s,
        swap_transfer=config.operations.swap_transfer,
        persist=core.rounds,
        clock=core.clock,
    )
    store = StoreSync(
        view=view,
        io=io,
        events=events,
        life=life,
        jobs=job.jobs,
        address=job.address,
        lease_ttl_s=config.detection.lease_ttl_s,
        reconnect_s=config.control.reconnect_s,
        store_url=config.control.store,
        swaps=swaps,
        clock=core.clock,
    )
    health = Health(
        view=view,
        events=events,
        config=config.detection.straggler,
        quarantine=shape.quarantine,
        mover=swaps,
        clock=core.clock,
    )
    resize = Resizing(
        view=view,
        io=io,
        events=events,
        life=life,
        mesh=shape.mesh,
        elastic=shape.elastic,
        survivor_mode=shape.survivor_mode,
        detector=core.detector,
        num_shards=shape.num_shards,
        full_world_size=config.world_size,
        drop_batch=config.elastic.shrink_batch == "drop",
        durable_url=job.durable_url,
        swaps=swaps,
        sources=sources,
    )
    return swaps, store, health, resize


# -- 4. the nodes --------------------------------------------------------------------------------------
def _node_agents(
    core: _Core,
    shape: JobShape,
    job: _Job,
    *,
    store: StoreSync,
    sources: RestoreSources,
    replication: ReplicationRounds,
) -> NodeAgents:
    """Node agents: admission (the job's terms, which every welcome tells), leases, losses,
    quarantine, spares."""
    config, store_mode = job.config, job.jobs is not None
    terms = AgentTerms(
        nproc_per_node=config.nproc_per_node,
        lease_ttl_s=config.detection.lease_ttl_s,
        num_slots=shape.num_slots,
        replicas=config.replication.replicas if shape.replicating else 0,
        worker_env=job.worker_env,
        store_mode=store_mode,
        store=config.control.store if store_mode else None,
        reconnect_s=config.control.reconnect_s,
        elastic=shape.elastic.enabled,
    )
    return NodeAgents(
        view=core.view,
        io=core.io,
        events=core.events,
        life=core.life,
        terms=terms,
        quarantine=shape.quarantine,
        store=store,
        fetches=sources,
        rounds=replication,
        clock=core.clock,
    )


# -- 5. the recovery: generations, the job's start, failures -------------------------------------------------
def _recovery(
    core: _Core,
    shape: JobShape,
    job: _Job,
    later: _Later,
    *,
    sources: RestoreSources,
    resize: Resizing,
    swaps: Swaps,
    agents: NodeAgents,
    replication: ReplicationRounds,
    health: Health,
) -> tuple[GenerationSetup, Generations, JobStart, Failures]:
    """The generations (:func:`_generations`); then the job's start (the nodes joined, a resumed
    checkpoint installed, the first processes) and the failures (exits and hangs become failures,
    failures a recovery through the generations)."""
    config, view, io, events, life = job.config, core.view, core.io, core.events, core.life
    setup, gens = _generations(
        core,
        shape,
        job,
        later,
        sources=sources,
        resize=resize,
        swaps=swaps,
        agents=agents,
        replication=replication,
    )
    start = JobStart(
        view=view,
        io=io,
        events=events,
        life=life,
        nnodes=config.nnodes,
        nproc_per_node=config.nproc_per_node,
        join_timeout_s=config.join_timeout_s,
        world_size=config.world_size,
        resume_url=config.persist.resume or job.durable_url,
        sharded=config.mesh is not None,
        since=core.clock.monotonic(),
        generations=gens,
        installer=sources,
    )
    failures = Failures(
        view=view,
        io=io,
        events=events,
        life=life,
        detector=core.detector,
        max_restarts=config.max_restarts,
        faults_dir=config.job_dir.resolve() / "faults",
        swaps=swaps,
        grader=health,
        nodes=agents,
        recovery=gens,
        clock=core.clock,
    )
    return setup, gens, start, failures


def _generations(
    core: _Core,
    shape: JobShape,
    job: _Job,
    later: _Later,
    *,
    sources: RestoreSources,
    resize: Resizing,
    swaps: Swaps,
    agents: NodeAgents,
    replication: ReplicationRounds,
) -> tuple[GenerationSetup, Generations]:
    """Planning every membership change (generations.py, through its plan asks) and carrying
    each planned one out (generation_setup.py: launch, stages, timing); a new generation fences
    the replication and the rendezvous. The restore sources get the setup and the resizing."""
    config, view, io, events, life = job.config, core.view, core.io, core.events, core.life
    setup = GenerationSetup(
        view=view,
        io=io,
        events=events,
        life=life,
        detector=core.detector,
        rebuild_timeout_s=config.detection.rebuild_timeout_s,
        shards=resize,
        swaps=swaps,
        spares=agents,
        clock=core.clock,
    )
    asks = PlanAsks(
        view=view,
        io=io,
        rescue_wait_s=config.snapshot.rescue_wait_s,
        mesh=shape.mesh,
        rescues=lambda: later.workers.rescues,
    )
    gens = Generations(
        view=view,
        io=io,
        events=events,
        life=life,
        asks=asks,
        setup=setup,
        sources=sources,
        sizes=resize,
        elastic=shape.elastic,
        durable_url=job.durable_url,
        initial_step=job.initial_step,
        exits_waiting=lambda sids: later.failures.waiting(sids),
        fences=(lambda _: replication.reset(), fence_rendezvous(core.kv)),
        clock=core.clock,
    )
    sources.bind(setup=setup, needs=resize)
    return setup, gens


# -- 6. the observers: clients, persists, the event feed, the workers ------------------------------------
def _observers(
    core: _Core,
    shape: JobShape,
    job: _Job,
    *,
    swaps: Swaps,
    health: Health,
    resize: Resizing,
    store: StoreSync,
    start: JobStart,
    setup: GenerationSetup,
) -> tuple[ClientRequests, PersistOps, EventFeed, WorkerProtocol]:
    """The clients (``nonstop status / persist / migrate / drain``), the persist rounds of a job
    of several nodes, the event feed (``Session.on_event``: the job's events to the workers that
    subscribed, an event log subscriber from here on) and the workers' protocol (connections,
    heartbeats, step reports, rendezvous, stage reports)."""
    config, view, life = job.config, core.view, core.life
    facts = JobFacts(
        job_id=job.job_id,
        durable_url=job.durable_url,
        num_shards=shape.num_shards,
        full_world_size=config.world_size,
        min_world_size=shape.elastic.min_world_size,
        store=config.control.store,
    )
    clients = ClientRequests(
        view=view,
        io=core.io,
        life=life,
        facts=facts,
        persister=job.persister,
        rounds=core.rounds,
        swaps=swaps,
        health=health,
        resize=resize,
    )
    persists = PersistOps(
        view=view,
        life=life,
        rounds=core.rounds,
        timeout_s=config.persist.timeout_s,
        store=store,
        clients=clients,
        clock=core.clock,
    )
    feed = EventFeed(clock=core.clock)
    core.events.subscribe(feed.on_event)
    workers = WorkerProtocol(
        view=view,
        io=core.io,
        events=core.events,
        life=life,
        cadence=cadence_tuner(config, shape.mesh),
        snapshot_every=config.snapshot.every,
        start=start,
        setup=setup,
        resumes=store,
        clock=core.clock,
    )
    return clients, persists, feed, workers


# -- 7. the late binds ------------------------------------------------------------------------------------
def _bind(
    *,
    swaps: Swaps,
    store: StoreSync,
    agents: NodeAgents,
    gens: Generations,
    resize: Resizing,
    workers: WorkerProtocol,
    failures: Failures,
) -> None:
    """The peers that call back into the swaps, the store sync and the node agents, built after
    them (why each: the module docstring); once, before the first event."""
    swaps.actions.bind(gens=gens, resize=resize)
    swaps.bind(resize=resize, nodes=agents)
    store.bind(nodes=agents, workers=workers, gens=gens)
    agents.bind(exits=failures)


# -- the routes -------------------------------------------------------------------------------------------
def _routes(
    core: _Core,
    *,
    agents: NodeAgents,
    workers: WorkerProtocol,
    clients: ClientRequests,
    failures: Failures,
    health: Health,
    swaps: Swaps,
    sources: RestoreSources,
    replication: ReplicationRounds,
    setup: GenerationSetup,
    resize: Resizing,
    feed: EventFeed,
    monitor: Callable[[], JobMonitor | None],
) -> Routes:
    """Which operation handles each event of the control server and each decoded message
    (routing.py)."""
    return Routes(
        view=core.view,
        io=core.io,
        events=core.events,
        agents=agents,
        workers=workers,
        clients=clients,
        failures=failures,
        health=health,
        swaps=swaps,
        sources=sources,
        replication=replication,
        rounds=core.rounds,
        setup=setup,
        resize=resize,
        kv=core.kv,
        feed=feed,
        detector=core.detector,
        monitor=monitor,
        clock=core.clock,
    )
