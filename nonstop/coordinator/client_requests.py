"""Requests from people's tools (``nonstop status``, ``persist``, ``migrate``, ``drain``) on
authenticated client channels, and the job status they are shown.

A request that cannot be honoured gets an error answer naming why; a migration or drain is
answered ``accepted`` at once and ``migrated`` per rank when its move ends; a persist is
answered when the durable tier holds the step.

Threading: the coordinator's thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nonstop.control.channel import Channel, Message
from nonstop.errors import ControlError
from nonstop.protocol.base import kind_of
from nonstop.protocol.client import AcceptedMsg, ErrorMsg, MigratedMsg, PersistedMsg, StatusMsg
from nonstop.protocol.wire import Drain, Migrate, PersistRequest, StatusRequest, decode_client

if TYPE_CHECKING:
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.persistence import ClusterPersister
    from nonstop.coordinator.view import JobView
    from nonstop.snapshot.persist import Persister

__all__ = ["ClientRequests", "JobFacts"]


@dataclass(frozen=True, kw_only=True)
class JobFacts:
    """What ``nonstop status`` shows of the job that does not change while it runs."""

    job_id: str
    durable_url: str | None
    num_shards: int
    full_world_size: int
    min_world_size: int
    store: str | None


class MigrationDesk(Protocol):
    """The swaps as clients see them: a move asked for, who waits for its end, their status."""

    clients: dict[int, list[Channel]]

    def request_migration(self, rank: int, target: str | None, reason: str) -> str | None: ...

    def status(self) -> dict[str, Any]: ...


class StatusPart(Protocol):
    def status(self) -> dict[str, Any]: ...


class DataShards(Protocol):
    def data_shards(self, world_size: int) -> tuple[tuple[int, ...], ...]: ...


class ClientRequests:
    """Connected clients and the persist requests they wait on (see the module docstring).
    ``persister``: the job's persists (one node's, or the rounds across several); ``rounds``:
    the latter, whose last step is the durable step shown."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        life: JobLife,
        facts: JobFacts,
        persister: Persister | ClusterPersister | None,
        rounds: ClusterPersister | None,
        swaps: MigrationDesk,
        health: StatusPart,
        resize: DataShards,
    ) -> None:
        self.view = view
        self.io = io
        self.life = life
        self.facts = facts
        self.persister = persister
        self.rounds = rounds
        self.swaps = swaps
        self.health = health
        self.resize = resize
        self.channels: dict[int, Channel] = {}
        self.tickets: list[tuple[Channel, int]] = []  # a client waiting for a persist, its ticket

    def on_request(self, chan: Channel, msg: Message) -> None:
        """One request, decoded (:func:`~nonstop.protocol.wire.decode_client`) and answered."""
        req = decode_client(msg)
        if isinstance(req, Migrate | Drain):
            if isinstance(req, Migrate):
                assert req.rank is not None
                moves = [(req.rank, req.to)]
            else:
                if req.node not in self.view.nodes:
                    self.io.answer(
                        chan,
                        MigratedMsg(rank=None, ok=False, error=f"no node {req.node} in the job").encode(),
                    )
                    return
                moves = [(r, None) for r, n in sorted(self.view.rank_node.items()) if n == req.node]
            reason = "migrate" if isinstance(req, Migrate) else "drain"
            for rank, target in moves:
                error = self.swaps.request_migration(rank, target, reason)
                if error is not None:
                    self.io.answer(chan, MigratedMsg(rank=rank, ok=False, error=error).encode())
                else:
                    self.swaps.clients.setdefault(rank, []).append(chan)
            self.io.answer(chan, AcceptedMsg(ranks=tuple(r for r, _ in moves)).encode())
        elif isinstance(req, StatusRequest):
            self.io.answer(chan, StatusMsg(status=self.status()).encode())
        elif isinstance(req, PersistRequest):
            if self.persister is None:
                self.io.answer(chan, PersistedMsg(error="this job has no durable tier on this node").encode())
                return
            self.tickets.append((chan, self.persister.request()))
        else:
            self.io.answer(chan, ErrorMsg(error=f"unknown request {kind_of(msg)!r}").encode())

    def status(self) -> dict[str, Any]:
        """What ``nonstop status`` shows (JSON types)."""
        spares: dict[str, int] = {}
        for node in self.view.idle_spares().values():
            spares[node] = spares.get(node, 0) + 1
        return {
            "job_id": self.facts.job_id,
            "state": str(self.view.phase),
            "generation": self.view.generation,
            "world_size": self.view.world_size,
            "ranks": {
                str(r): {
                    "node": self.view.rank_node.get(r),
                    "spawn_id": sid,
                    # a member planned but not spawned yet has no process record
                    "pid": w.pid if (w := self.view.workers.get(sid)) is not None else None,
                    # its process has connected (a cold one a spare took over from never does as
                    # this rank: it waits as a spare)
                    "connected": w is not None and w.chan is not None,
                    "step": self.view.latest_step.get(r),
                }
                for r, sid in sorted(self.view.members.items())
            },
            "nodes": {
                n: {
                    "alive": rec.alive,
                    "quarantined": rec.quarantined,
                    "domain": rec.domain,
                    "ranks": sorted(r for r, nn in self.view.rank_node.items() if nn == n),
                    "idle_spares": spares.get(n, 0),
                    "failures": len(rec.failure_times),
                }
                for n, rec in sorted(self.view.nodes.items())
            },
            "committed_step": self.life.committed(),
            "replicated_step": self.view.replicated_step,
            "durable_step": self.rounds.last_step if self.rounds is not None else None,
            "durable_url": self.facts.durable_url,
            "failures": self.view.failures_total,
            **self.swaps.status(),
            **self.health.status(),  # issue 21: stragglers, graded failures, probe verdicts
            "num_shards": self.facts.num_shards,
            "full_world_size": self.facts.full_world_size,
            "min_world_size": self.facts.min_world_size,
            "shards": {
                str(r): list(sh) for r, sh in enumerate(self.resize.data_shards(self.view.world_size))
            },
            "store": self.facts.store,
        }

    def answer_persists(self) -> None:
        if not self.tickets or self.persister is None:
            return
        pending = []
        for chan, ticket in self.tickets:
            if not self.persister.wait(ticket, 0):
                pending.append((chan, ticket))
                continue
            last = self.persister.last
            reply = PersistedMsg(
                error=self.persister.last_error,
                step=None if last is None else last.step,
                url=None if last is None else self.persister.durable.url,
                stored_bytes=None if last is None else last.stored_bytes,
            ).encode()
            try:
                self.io.answer(chan, reply)
            except ControlError:
                pass
        self.tickets = pending
