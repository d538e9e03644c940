"""What a job's coordinator holds: :class:`Operations`, every operation of one job over its
core (the view, the executor, the events, :class:`~nonstop.coordinator.job.JobLife`, the clock),
as :func:`~nonstop.coordinator.assembly.assemble` built and wired them and
:class:`~nonstop.coordinator.loop.Coordinator` drives them. How they are built, and why in that
order, is the assembly's."""

from __future__ import annotations

from dataclasses import dataclass

from nonstop.control.rdzv import KeyValueTable
from nonstop.coordinator.client_requests import ClientRequests
from nonstop.coordinator.clock import Clock
from nonstop.coordinator.detector import FailureDetector
from nonstop.coordinator.event_feed import EventFeed
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.failures import Failures
from nonstop.coordinator.generation_setup import GenerationSetup
from nonstop.coordinator.generations import Generations
from nonstop.coordinator.health import Health
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.job_shape import JobShape
from nonstop.coordinator.job_start import JobStart
from nonstop.coordinator.node_agents import NodeAgents
from nonstop.coordinator.persistence import ClusterPersister, PersistOps
from nonstop.coordinator.replication import ReplicationRounds
from nonstop.coordinator.resizing import Resizing
from nonstop.coordinator.restore_sources import RestoreSources
from nonstop.coordinator.routing import Routes
from nonstop.coordinator.store_sync import StoreSync
from nonstop.coordinator.swaps import Swaps
from nonstop.coordinator.view import JobView
from nonstop.coordinator.workers import WorkerProtocol
from nonstop.events.log import EventLog
from nonstop.snapshot.persist import Persister

__all__ = ["Operations"]


@dataclass(frozen=True, kw_only=True)
class Operations:
    """One job's coordinator: its shape, the core, and every operation, wired (see the module
    docstring). ``persister``: one node's Persister, or the rounds of a job of several nodes."""

    shape: JobShape
    view: JobView
    io: Executor
    events: EventLog
    life: JobLife
    detector: FailureDetector
    kv: KeyValueTable
    persister: Persister | ClusterPersister | None
    rounds: ClusterPersister | None
    replication: ReplicationRounds
    sources: RestoreSources
    swaps: Swaps
    store: StoreSync
    health: Health
    resize: Resizing
    agents: NodeAgents
    setup: GenerationSetup
    gens: Generations
    start: JobStart
    failures: Failures
    clients: ClientRequests
    persists: PersistOps
    feed: EventFeed
    workers: WorkerProtocol
    routes: Routes
    clock: Clock  # what the operations read the time through (clock.py); the loop's too
