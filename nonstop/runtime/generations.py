"""Generations: every membership change of a job -- its start, a recovery, a boundary swap --
is a new generation, planned, launched and timed here.

* **plan** (:func:`~nonstop.runtime.planning.plan_generation`, pure): who plays each missing rank,
  which step every rank restores (memory first, then the durable tier), a shrink or a wait;
  the nodes' inventories are asked first when a restore is needed;
* **launch**: spares take ranks, cold processes start, nodes that lack a rank's restore step
  fetch it from a peer (a swap's boundary fetch may have been asked for earlier and is adopted);
* **stages** (:class:`~nonstop.runtime.recovery.Reconfiguration`): launch -> restore ->
  rebuild -> resume -> done, each timed; a stage that overruns ``rebuild_timeout_s`` has its
  laggards killed (and recovered);
* a failure during a generation's setup starts the next one, inheriting the failures.

Threading: the coordinator's thread only. I/O goes through the coordinator's executor.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from nonstop.control.channel import Message
from nonstop.errors import ControlError, NonstopError
from nonstop.runtime import wire
from nonstop.runtime.elastic import assign_shards, resume_sources
from nonstop.runtime.phase import JobPhase
from nonstop.runtime.planning import Inventory, PlanAction, Shrink, plan_generation
from nonstop.runtime.recovery import Failure, Reconfiguration, Stage
from nonstop.runtime.view import NodeRecord, Role
from nonstop.runtime.wire import Fetched, Installed

if TYPE_CHECKING:
    from nonstop.runtime.coordinator import Coordinator

__all__ = ["Generations"]

PLAN_WAIT_S = 3.0  # longest planning waits for the nodes' inventories

JobState = JobPhase


class Generations:
    """The current generation's setup (``reconf``) and what it waits for (see the module docstring)."""

    def __init__(self, c: Coordinator, *, initial_step: int | None) -> None:
        self.c = c
        self.initial_step = initial_step  # resumed from the durable tier: install this first
        self.reconf: Reconfiguration | None = None
        self.replan_at: float | None = None  # elastic wait: re-plan then (or when a spare appears)
        self.waiting_fetch: dict[int, tuple[int, int]] = {}  # request id -> (rank, generation)
        # fetches asked for before their generation (a swap's boundary): request id -> (rank, ok),
        # ok None while in flight; the generation adopts them (``fetch_for(early=...)``)
        self.early: dict[int, tuple[int, bool | None]] = {}
        # a planning interrupted by more failures: (failures, replans, replacements) to merge
        self.deferred: tuple[list[Failure], int, dict[int, str]] | None = None
        # the nodes' inventories asked for the generation being planned: request id -> node
        self.inventory_reqs: dict[int, str] = {}
        self.inventory_deadline = 0.0

    def drop_early(self, req: int) -> None:
        """A swap that asked for boundary fetch ``req`` ended: a late answer is ignored."""
        self.early.pop(req, None)

    def replan_tick(self) -> None:
        """Re-plan a generation waiting for a spare (one appeared, or the wait is over); grow the
        world back while it is below its full size and spares are idle."""
        if self.deferred is not None and self.replan_at is not None:
            if time.monotonic() >= self.replan_at or self.c.view.idle_spares():
                before, replans, replacements = self.deferred
                self.deferred, self.replan_at = None, None
                self.begin(before, replans=replans + 1, replacements=replacements)
            return

    def check_timeouts(self) -> None:
        r = self.reconf
        if (
            self.c.view.phase is not JobState.RECONFIGURING
            or r is None
            or r.stage in (Stage.LAUNCH, Stage.RESUME)
        ):
            return
        if r.deadline == 0.0:
            r.deadline = time.time() + self.c.config.rebuild_timeout_s
        if time.time() > r.deadline:
            waiting = r.restored if r.stage is Stage.RESTORE else r.ready
            for rank in set(range(self.c.view.world_size)) - waiting:
                sid = self.c.view.members.get(rank)
                if sid is not None and sid in self.c.view.workers:
                    self.c.view.workers[sid].killed_for_hang = f"stage {r.stage} timed out"
                    self.c.io.kill(sid)
            r.deadline = time.time() + self.c.config.rebuild_timeout_s  # one kill round per period

    def _ask_inventories(self) -> None:
        """Ask every live node what its memory holds; the answers arrive as events and
        :meth:`inventory_tick` plans once all are in (or ``PLAN_WAIT_S`` passed)."""
        self.inventory_reqs = {
            self.c.io.request(self.c.view.nodes[n], {"t": "inventory"}): n for n in self.c.view.alive_nodes()
        }
        self.inventory_deadline = time.monotonic() + PLAN_WAIT_S

    def _drop_inventories(self) -> None:
        for req in self.inventory_reqs:
            self.c.io.replies.pop(req, None)
            self.c.io.done(req)
        self.inventory_reqs = {}

    def inventory_tick(self) -> None:
        """Plan the generation whose inventory was asked for, once every node answered (or the
        wait is over). Exits not handled yet are handled first: a second node lost while the
        nodes answered is planned together with the first (``on_failures`` merges them)."""
        if not self.inventory_reqs or self.deferred is None:
            return
        replies = self.c.io.replies
        if any(r not in replies for r in self.inventory_reqs) and time.monotonic() < self.inventory_deadline:
            return
        members = set(self.c.view.members.values())
        if any(ex.sid in members for ex in self.c.failures.exits):
            self.c.events.emit("replan_deferred", generation=self.c.view.generation)
            return
        avail: dict[int, dict[int, list[tuple[str, str]]]] = {}
        for req, node in self.inventory_reqs.items():
            msg = replies.get(req)
            if not isinstance(msg, wire.Inventory) or not self.c.view.nodes[node].alive:
                continue
            for kind, held in (("local", msg.local), ("replica", msg.replicas)):
                for rank, steps in held.items():
                    for step in steps:
                        avail.setdefault(rank, {}).setdefault(step, []).append((node, kind))
        self._drop_inventories()
        failures, replans, replacements = self.deferred
        self.deferred = None
        self.initial_step = None
        self._plan(failures, replans=replans, replacements=replacements, inventory=avail)

    def begin(
        self,
        failures: list[Failure],
        *,
        replans: int = 0,
        replacements: dict[int, str] | None = None,
        inventory_needed: bool = False,
    ) -> None:
        """Open generation + 1 and plan it. Every rank restores the newest step all ranks hold
        (memory first, then durable) when there are ``failures``, a resumed checkpoint to
        install, or ``inventory_needed`` (a restarted coordinator redoing an interrupted
        recovery): the nodes' inventories are asked for first, and the plan waits for them as
        events (the coordinator serves everything else meanwhile; a failure meanwhile merges
        into this plan). The decision is :func:`~nonstop.runtime.planning.plan_generation`'s."""
        self.open_generation()
        if self.c.view.alive_nodes() and (failures or self.initial_step is not None or inventory_needed):
            self.deferred = (failures, replans, dict(replacements or {}))
            self._ask_inventories()
            return
        self._plan(failures, replans=replans, replacements=dict(replacements or {}), inventory=None)

    def _plan(
        self,
        failures: list[Failure],
        *,
        replans: int,
        replacements: dict[int, str],
        inventory: Inventory | None,
    ) -> None:
        """Decide (pure ``plan_generation``) and carry the decision out."""
        now = time.time()
        alive_nodes = self.c.view.alive_nodes()
        plan = plan_generation(
            world_size=self.c.view.world_size,
            present=set(self.c.view.members),
            last_node=dict(self.c.view.rank_node),
            inventory=inventory,
            idle_spares=self.c.view.idle_spares(),
            live_nodes=alive_nodes,
            load=self.c.view.load(alive_nodes),
            elastic=self.c.elastic,
            waited_s=now - min((f.detected_at for f in failures), default=now),
            recovering=bool(failures),
        )
        if plan.action is PlanAction.FAIL:
            self.c.fail(plan.reason)
            return
        if plan.action is PlanAction.WAIT:
            for sid in self.c.view.members.values():  # their fault reports are answered after the wait
                self.c.view.workers[sid].fault_report = None
            self.deferred = (failures, replans, dict(replacements or {}))
            self.replan_at = time.monotonic() + plan.wait_s
            self.c.events.emit("elastic_wait", ranks=list(plan.unplaced), wait_s=plan.wait_s)
            return
        from_rank: dict[int, int] = {}
        if plan.shrink is not None:
            from_rank = self.shrink(plan.shrink, plan.reason)
        placements, avail, restore_step = plan.placements, plan.inventory, plan.restore_step
        unplaced = plan.unplaced
        for rank, p in placements.items():
            self.c.view.rank_node[rank] = p.node
        tier = "memory"
        if plan.action is PlanAction.FROM_DURABLE:
            restore_step = self.restore_from_durable()
            tier = "durable"
            if restore_step is None:
                # Survivors hold later state than any fresh process could: never mix them.
                self.c.fail(
                    "no step is snapshotted for every rank in memory or in the durable tier "
                    f"({self.c.durable_url or 'none configured'}); "
                    "cannot recover this failure (persist more often with --persist-every)"
                )
                return
            avail = {}
        r = Reconfiguration(
            generation=self.c.view.generation,
            world_size=self.c.view.world_size,
            failures=failures,
            restore_step=restore_step,
            replans=replans,
            replacements=dict(replacements or {}),
        )
        r.marks["detect"] = max((f.detected_at for f in failures), default=now)
        r.from_rank = from_rank
        if unplaced:  # renumbered ranks and new processes write their new number's slots afresh
            r.fresh = set(from_rank) | set(placements)
        if failures and restore_step is not None:
            r.lost_steps = max(0, self.c.committed() - restore_step)
        if restore_step is not None:
            self.rewind(restore_step)
        for rank, p in sorted(placements.items()):
            r.replacements[rank] = p.source.value
            if p.spare is not None:
                w = self.c.view.workers[p.spare]
                w.rank, w.role = rank, Role.WORKER
                w.last_progress, w.stepped = time.monotonic(), False
                self.c.view.members[rank] = p.spare
            else:
                self.c.io.spawn(p.node, Role.WORKER, rank)
                r.waiting_launch.add(rank)
        r.marks["plan"] = time.time()
        fetches = (
            self.plan_fetches(r, restore_step, avail) if tier == "memory" and restore_step is not None else {}
        )
        for rank in fetches:  # its step arrives in its new rank's memory: restore that
            r.from_rank.pop(rank, None)
        self.launch(r, tier=tier, fetches=fetches)

    def shrink(self, shrink: Shrink, why: str) -> dict[int, int]:
        """Drop ``shrink.dropped``: the ranks that stay are renumbered ``0..W'-1`` in their old
        order and the shards spread over them. Returns new rank -> old rank for every rank
        renumbered."""
        old_world = self.c.view.world_size
        new_of = shrink.new_of
        self.c.view.world_size = shrink.world_size
        self.c.view.members = {new_of[r]: sid for r, sid in self.c.view.members.items() if r in new_of}
        for rank, sid in self.c.view.members.items():
            self.c.view.workers[sid].rank = rank
        self.c.view.rank_node = {new_of[r]: n for r, n in self.c.view.rank_node.items() if r in new_of}
        self.c.view.latest_step = {new_of[r]: st for r, st in self.c.view.latest_step.items() if r in new_of}
        self.c.swaps.forget_steps()
        self.c.events.emit(
            "shrink",
            world_size=self.c.view.world_size,
            old_world_size=old_world,
            dropped=list(shrink.dropped),
            renumbered={str(o): n for o, n in new_of.items() if o != n},
            shards={
                str(r): list(sh)
                for r, sh in enumerate(assign_shards(self.c.num_shards, self.c.view.world_size))
            },
            reason=why,
        )
        return {n: o for o, n in new_of.items() if o != n}

    def open_generation(self) -> None:
        """Generation + 1: fence the old one (its fetches, rendezvous, replication round)."""
        self.c.view.generation += 1
        self.c.set_phase(JobState.RECONFIGURING)
        self.reconf = None
        self._drop_inventories()  # asked for a generation that will not be planned any more
        for req in [q for q, (_, gen) in self.waiting_fetch.items() if gen < self.c.view.generation]:
            del self.waiting_fetch[req]  # a late answer is ignored (its generation is over)
            self.c.io.done(req)
        self.c.replication.reset()
        for reply, msg in self.c.kv.new_generation(self.c.view.generation):
            try:
                reply(msg)
            except ControlError:
                pass
        self.c.view.done_ranks.clear()

    def rewind(self, step: int) -> None:
        """Every rank goes back to ``step``: later step reports are void."""
        self.c.view.latest_step = {rank: step for rank in range(self.c.view.world_size)}
        if self.c.view.replicated_step is not None and self.c.view.replicated_step > step:
            self.c.view.replicated_step = step

    def launch(self, r: Reconfiguration, *, tier: str, fetches: dict[int, str], **extra: Any) -> None:
        """Log the planned generation ``r`` and start it: reconfigure every connected member."""
        self.reconf = r
        self.c.events.emit(
            "generation",
            generation=r.generation,
            restore_step=r.restore_step,
            tier=tier,
            members={str(k): v for k, v in sorted(self.c.view.members.items())},
            nodes={str(k): self.c.view.rank_node.get(k) for k in sorted(self.c.view.members)},
            replacements=r.replacements,
            cause=[f.rank for f in r.failures],
            fetches={str(k): v for k, v in fetches.items()},
            replans=r.replans,
            **extra,
        )
        for rank, sid in self.c.view.members.items():
            if (
                self.c.view.workers[sid].chan is None
            ):  # still starting (e.g. launched by a re-planned generation)
                r.waiting_launch.add(rank)
            self.maybe_reconfigure(rank)
        r.stage = Stage.LAUNCH
        self.advance()

    def fetch_for(
        self,
        r: Reconfiguration,
        rank: int,
        step: int,
        source: str,
        kind: str,
        *,
        src_rank: int | None = None,
        base: int | None = None,
        early: int | None = None,
    ) -> str:
        """A fetch generation ``r`` waits for before ``rank`` restores (to the node playing it);
        ``src_rank``: the rank whose snapshot that is, when not ``rank`` (a world-size change);
        ``base``: a step the node holds from a catch-up (the fetch may come as a delta);
        ``early``: the same fetch already asked for (:meth:`_fetch_early`): adopted unless it
        failed -- waited for while in flight, nothing to wait for once done."""
        if early is not None and early in self.early:
            ok = self.early.pop(early)[1]
            if ok is not False:
                if ok is None:
                    self.waiting_fetch[early] = (rank, r.generation)
                    r.waiting_fetch.add(rank)
                return f"{source}:{kind}"
        src = rank if src_rank is None else src_rank
        req = self.c.io.fetch(self.c.view.rank_node[rank], src, step, source, kind, as_rank=rank, base=base)
        self.waiting_fetch[req] = (rank, r.generation)
        r.waiting_fetch.add(rank)
        return f"{source}:{kind}"

    def fetch_early(
        self, target: str, rank: int, step: int, source: str, *, as_rank: int, base: int | None = None
    ) -> int:
        """A swap's boundary fetch asked for as soon as the source rank completed the step, before
        its generation exists (the other ranks are still finishing theirs); a request id for
        ``_fetch_for(early=...)``."""
        req = self.c.io.fetch(target, rank, step, source, "local", as_rank=as_rank, base=base)
        self.early[req] = (as_rank, None)
        return req

    def plan_fetches(self, r: Reconfiguration, step: int, avail: Inventory) -> dict[int, str]:
        """Have each node that will play a rank without holding ``step`` of it fetch it from a peer."""
        out: dict[int, str] = {}
        for rank in range(self.c.view.world_size):
            target = self.c.view.rank_node[rank]
            sources = avail.get(rank, {}).get(step, [])
            if any(n == target and k == "local" for n, k in sources):
                continue
            # prefer the target's own replica (a copy within the node), then any other holder
            src = sorted(sources, key=lambda s: (s[0] != target, s[1] != "replica", s[0]))[0]
            out[rank] = self.fetch_for(r, rank, step, src[0], src[1], src_rank=r.from_rank.get(rank))
        return out

    def on_fetched(self, node: NodeRecord, msg: Fetched) -> None:
        """A fetch a generation waits for (or a swap's boundary fetch, asked early) ended."""
        req = msg.id
        if req in self.early:  # arrived before the swap adopted it: nothing waits on it yet
            rank = self.early[req][0]
            self.early[req] = (rank, msg.ok)
            self.c.io.done(req)
            self.c.events.emit(
                "fetched",
                node=node.name,
                rank=rank,
                ok=msg.ok,
                seconds=msg.seconds,
                error=msg.error,
                early=True,
            )
            return
        rank, gen = self.waiting_fetch.pop(req, (-1, -1))
        self.c.io.done(req)
        r = self.reconf
        self.c.events.emit(
            "fetched", node=node.name, rank=rank, ok=msg.ok, seconds=msg.seconds, error=msg.error
        )
        if r is None or gen != r.generation:
            return
        if not msg.ok:
            self.c.fail(f"rank {rank} could not be fetched to node {node.name}: {msg.error}")
            return
        r.waiting_fetch.discard(rank)
        self.maybe_reconfigure(rank)
        self.advance()

    def restore_from_durable(self) -> int | None:
        """Have every node install its ranks from the newest durable checkpoint that loads."""
        if self.c.durable_url is None:
            return None
        from nonstop.snapshot.durable import DurableStore

        try:
            steps = DurableStore(self.c.durable_url).steps()
        except NonstopError as e:
            self.c.events.emit("durable_unavailable", error=str(e))
            return None
        placement = self.c.view.placement()
        for step in sorted(steps, reverse=True):
            t0 = time.monotonic()
            if self.install_durable(step, placement, self.c.durable_url):
                self.c.events.emit(
                    "restore_from_durable", step=step, url=self.c.durable_url, seconds=time.monotonic() - t0
                )
                return step
        return None

    def install_durable(self, step: int, placement: dict[str, list[int]], url: str) -> bool:
        """Have every node install its ranks of durable checkpoint ``step``. A checkpoint of
        another world size (written while the job was shrunk) serves an elastic job only: its
        ranks are data-parallel replicas (``resume_sources``)."""
        from nonstop.snapshot.durable import DurableStore

        try:
            written = DurableStore(url).world_size_at(step)
        except NonstopError as e:
            self.c.events.emit("durable_install_failed", step=step, errors=[str(e)])
            return False
        sources: dict[int, int] = {}
        if written != self.c.view.world_size:
            if not self.c.elastic.enabled:
                self.c.events.emit(
                    "durable_install_failed",
                    step=step,
                    errors=[f"the checkpoint has {written} ranks, the job {self.c.view.world_size}"],
                )
                return False
            sources = {r: s for r, s in resume_sources(written, self.c.view.world_size).items() if r != s}
        reqs = []
        for n, ranks in placement.items():
            msg: Message = {"t": "install_durable", "url": url, "step": step, "ranks": ranks}
            if any(r in sources for r in ranks):
                msg["from"] = {str(r): sources[r] for r in ranks if r in sources}
            reqs.append(self.c.io.request(self.c.view.nodes[n], msg))
        replies = self.c.await_replies(reqs, self.c.config.persist_timeout_s)
        bad = [
            m.error if isinstance(m, Installed | wire.Lost) else f"{type(m).__name__} answer"
            for m in replies.values()
            if not isinstance(m, Installed) or not m.ok
        ]
        if bad or len(replies) < len(reqs):
            self.c.events.emit("durable_install_failed", step=step, errors=bad or ["timed out"])
            return False
        return True

    def maybe_reconfigure(self, rank: int) -> None:
        r = self.reconf
        if r is None or rank in r.waiting_launch or rank in r.waiting_fetch:
            return
        sid = self.c.view.members.get(rank)
        if sid is None:
            return
        w = self.c.view.workers[sid]
        if w.chan is None:
            return
        w.stepped, w.coll, w.fault_report = False, False, None
        self.c.io.send(
            w,
            {
                "t": "reconfigure",
                "gen": r.generation,
                "rank": rank,
                "world_size": self.c.view.world_size,
                "restore_step": r.restore_step,
                "recovery": bool(r.failures),
                **self.shards_of(rank),
                **({"from_rank": r.from_rank[rank]} if rank in r.from_rank else {}),
                **({"fresh": True} if rank in r.fresh else {}),
                **({"live": True} if r.live else {}),
            },
        )

    def shards_of(self, rank: int, world_size: int | None = None) -> dict[str, Any]:
        """The data shards ``rank`` plays in ``world_size`` (default: the current one)."""
        world = self.c.view.world_size if world_size is None else world_size
        return {
            "shards": list(assign_shards(self.c.num_shards, world)[rank]),
            "num_shards": self.c.num_shards,
        }

    def advance(self) -> None:
        r = self.reconf
        if r is None:
            return
        before = r.stage
        after = r.advance()
        if after is not before:
            r.deadline = 0.0  # each stage gets its own rebuild_timeout_s
        order = [Stage.LAUNCH, Stage.RESTORE, Stage.REBUILD, Stage.RESUME, Stage.DONE]
        now = time.time()
        for s in order[order.index(before) : order.index(after)]:
            r.marks[s.value] = now
            self.c.events.emit(
                "stage", generation=r.generation, stage=s.value, seconds=now - r.marks[_previous(s)]
            )
        if before is not Stage.REBUILD and after in (Stage.REBUILD, Stage.RESUME, Stage.DONE):
            for sid in self.c.view.members.values():
                self.c.io.send(self.c.view.workers[sid], {"t": "rebuild", "gen": r.generation})
        if after in (Stage.RESUME, Stage.DONE) and before not in (Stage.RESUME, Stage.DONE):
            self.c.set_phase(JobState.RUNNING)
            now_m = time.monotonic()
            for sid in self.c.view.members.values():
                self.c.view.workers[sid].last_progress = now_m
        if after is Stage.DONE:
            self.reconf = None
            self.c.swaps.on_generation_done(r.generation)
            if r.failures:
                records = r.report()
                self.c.view.reports.extend(records)
                for rec in records:
                    self.c.events.emit("recovery", **rec)
            self.c.agents.replenish_spares()
            if (
                self.c.view.done_ranks >= set(range(self.c.view.world_size))
                and self.c.view.phase is JobState.RUNNING
            ):
                self.c.finish()

    def send_prepare(self, sid: int, rank: int, world_size: int, step: int | None) -> None:
        """Tell a joiner (a migration's or a grow's) its rank: it restores ``step``, which its node
        holds, and warms up while the job trains; it is no member until the swap."""
        self.c.io.send(
            self.c.view.workers[sid],
            {
                "t": "reconfigure",
                "gen": self.c.view.generation,
                "rank": rank,
                "world_size": world_size,
                "restore_step": step,
                "recovery": False,
                "prepare": True,
                **self.shards_of(rank, world_size),
            },
        )

    def boundary_generation(
        self, step: int, replacements: dict[int, str], *, fresh: set[int] | None = None
    ) -> Reconfiguration:
        """The generation just opened, starting at boundary ``step`` that every rank paused after
        (a migration's swap, a grow): nothing rolls back, paused ranks keep their live state."""
        r = Reconfiguration(
            generation=self.c.view.generation,
            world_size=self.c.view.world_size,
            failures=[],
            restore_step=step,
            replans=0,
            replacements=replacements,
            fresh=fresh or set(),
            live=True,
        )
        r.marks["detect"] = r.marks["plan"] = time.time()
        self.rewind(step)
        return r


def _previous(stage: Stage) -> str:
    return {
        Stage.LAUNCH: "plan",
        Stage.RESTORE: "launch",
        Stage.REBUILD: "restore",
        Stage.RESUME: "rebuild",
        Stage.DONE: "resume",
    }.get(stage, "plan")
