"""A planned generation carried out: launched, set up stage by stage, timed and finished.

:class:`GenerationSetup` is the executor of :class:`~nonstop.policy.reconfiguration.Reconfiguration`
(the pure machine: launch -> restore -> rebuild -> resume -> done). It is given a planned
generation (:meth:`GenerationSetup.launch`, by :mod:`nonstop.coordinator.generations` or a
boundary swap), feeds the machine what the ranks report and the clock's ticks
(:meth:`GenerationSetup.report`), and carries out its actions: each member told its new
generation (``reconfigure``), the rebuild, the phase back to running, laggards killed when a
stage overruns ``rebuild_timeout_s``, and, once set up, the per-failure recovery reports.

Collaborators: the view, the executor (every send and kill), the event log, the job's life
(phase, finishing), the failure detector (the median step, for the reports), and three peers
(:mod:`nonstop.coordinator.peers`): the job's size (``RankShards``: the data shards and the
reshard a rank is told), the swaps (``SwapsDone``: a swap waits for its generation) and the node
agents (``SpareSupply``: spares used by the generation are replaced).

Threading: the coordinator's thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nonstop import events as ev
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.torch_env import rank_env
from nonstop.policy.phase import Busy, JobPhase
from nonstop.policy.reconfiguration import (
    Action,
    Finished,
    KillLaggards,
    Rebuild,
    Reconfiguration,
    Reconfigure,
    RecoveryEvent,
    Resumed,
    Stage,
    StageEnded,
    Tick,
)
from nonstop.protocol.worker import RebuildMsg, ReconfigureMsg

if TYPE_CHECKING:
    from nonstop.coordinator.detector import FailureDetector
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import RankShards, SpareSupply, SwapsDone
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog

__all__ = ["GenerationSetup"]


class GenerationSetup:
    """The generation being set up (``reconf``; None between setups), see the module docstring.
    ``rebuild_timeout_s``: how long its restore and rebuild stages may each take (0: forever)."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        detector: FailureDetector,
        rebuild_timeout_s: float,
        shards: RankShards,
        swaps: SwapsDone,
        spares: SpareSupply,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.detector = detector
        self.rebuild_timeout_s = rebuild_timeout_s
        self.shards = shards
        self.swaps = swaps
        self.spares = spares
        self.reconf: Reconfiguration | None = None

    def in_training(self) -> bool:
        """The members train: the job runs, or the generation being set up has resumed."""
        r = self.reconf
        return self.view.phase is JobPhase.RUNNING or (r is not None and r.stage is Stage.RESUME)

    def rebuilding(self) -> set[int]:
        """The ranks not yet ready in the rebuild stage of the generation being set up."""
        r = self.reconf
        if r is None or r.stage is not Stage.REBUILD:
            return set()
        return set(range(self.view.world_size)) - r.ready

    def busy(self) -> set[Busy]:
        """A generation being set up holds back the background operations."""
        return {Busy.RESUMING} if self.reconf is not None else set()

    def check_timeouts(self) -> None:
        """A stage that overran ``rebuild_timeout_s`` has its laggards killed (the machine says who)."""
        if self.view.phase is JobPhase.RECONFIGURING:
            self.report(Tick(self.clock.wall()))

    def abandon(self) -> None:
        """A newer generation opens: the one being set up (if any) is dropped unfinished; the
        reports of its ranks that come late are ignored."""
        self.reconf = None

    def launch(self, r: Reconfiguration, *, tier: str, fetches: dict[int, str], **extra: Any) -> None:
        """Log the planned generation ``r`` and start it: reconfigure every connected member.
        ``tier``: where its restore step comes from; ``fetches``: rank -> the fetch it waits
        for; ``extra``: what the ``generation`` event says more (a migration, a grow)."""
        self.reconf = r
        v = self.view
        self.events.emit(
            ev.NewGeneration(
                generation=r.generation,
                restore_step=r.restore_step,
                tier=tier,
                members={str(k): s for k, s in sorted(v.members.items())},
                nodes={str(k): v.rank_node.get(k) for k in sorted(v.members)},
                replacements={str(k): s for k, s in r.replacements.items()},
                cause=[f.rank for f in r.failures],
                fetches={str(k): s for k, s in fetches.items()},
                replans=r.replans,
                **extra,
            )
        )
        for rank, sid in v.members.items():
            if v.workers[sid].chan is None:  # still starting (e.g. launched by a re-plan)
                r.waiting_launch.add(rank)
        r.timeout_s = self.rebuild_timeout_s
        self._execute(r, r.start(self.clock.wall()))

    def report(self, event: RecoveryEvent) -> None:
        """What a rank reported (or a clock tick), for the generation being set up."""
        r = self.reconf
        if r is not None:
            self._execute(r, r.on_event(event))

    def _execute(self, r: Reconfiguration, actions: list[Action]) -> None:
        """Carry out what the generation's machine (:class:`Reconfiguration`) decided."""
        v = self.view
        for a in actions:
            if isinstance(a, Reconfigure):
                self._reconfigure(r, a.rank)
            elif isinstance(a, StageEnded):
                self.events.emit(
                    ev.ReconfigurationStage(generation=r.generation, stage=a.stage.value, seconds=a.seconds)
                )
            elif isinstance(a, Rebuild):
                for sid in v.members.values():
                    self.io.send(v.workers[sid], RebuildMsg(gen=r.generation).encode())
            elif isinstance(a, Resumed):
                self.life.set_phase(JobPhase.RUNNING)
                now_m = self.clock.monotonic()
                for member in v.members.values():
                    v.workers[member].last_progress = now_m
            elif isinstance(a, KillLaggards):
                for rank in a.ranks:
                    laggard = v.members.get(rank)
                    if laggard is not None and laggard in v.workers:
                        v.workers[laggard].killed_for_hang = a.why
                        self.io.kill(laggard)
            elif isinstance(a, Finished):
                self._finished(r, a)

    def _reconfigure(self, r: Reconfiguration, rank: int) -> None:
        """Tell the process playing ``rank`` its new generation (if it is connected)."""
        v = self.view
        sid = v.members.get(rank)
        w = v.workers.get(sid) if sid is not None else None
        if w is None or w.chan is None:
            return
        w.stepped, w.coll, w.idle_s, w.fault_report = False, False, None, None
        w.told_to_raise_at, w.rescue, w.told_gen = None, None, r.generation
        shards = self.shards.shards_of(rank)
        self.io.send(
            w,
            ReconfigureMsg(
                gen=r.generation,
                rank=rank,
                world_size=v.world_size,
                env=rank_env(v, w.spawn_id, rank),  # torchrun's (coordinator/torch_env.py)
                restore_step=r.restore_step,
                recovery=bool(r.failures),
                # the failed ranks, numbered as in the generation the survivors are leaving: a
                # survivor keeps the mesh groups none of them was in (nonstop/train/settle.py)
                lost=tuple(sorted({f.rank for f in r.failures})) if r.failures else None,
                shards=tuple(shards["shards"]) if "shards" in shards else None,
                num_shards=shards.get("num_shards"),
                divisor=shards.get("divisor"),
                from_rank=r.from_rank.get(rank),
                fresh=rank in r.fresh,
                live=r.live,
                reshard=self.shards.reshard_for(r.reshard, rank) if r.reshard is not None else None,
            ).encode(),
        )

    def _finished(self, r: Reconfiguration, a: Finished) -> None:
        """The generation is set up: reports, what waited on it, spares, the job's end."""
        self.reconf = None
        self.swaps.on_generation_done(r.generation)
        median = self.detector.median_step_s
        for rec in a.reports:
            gap = rec.get("survivor_gap_s")
            rec["survivor_gap_steps"] = gap / median if gap is not None and median else None
        self.view.reports.extend(a.reports)
        for rec in a.reports:
            self.events.emit(ev.from_fields("recovery", rec))  # the report record, keyed as logged
        self.spares.replenish_spares()
        if self.view.all_done() and self.view.phase is JobPhase.RUNNING:
            self.life.finish()
