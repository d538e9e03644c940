"""Waiting for a job to recover from each fault, and to be whole again before the next one.

*Recovered* (the fault's recovery time, from its injection): the coordinator answers, the job is
running at full size with every rank played by a live process, and its committed step is past the
one it had to come back to (for a failure: a new generation has started; a restored step is
checked against what had to be kept). *Whole again*: every node is up (the driver starts again a
node it killed, cut off or drained, and one that fenced itself), every node has its hot spares,
no migration is in flight, and the committed step advances.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nonstop.chaos.checks import Checks
from nonstop.chaos.cluster import Episode, Netns
from nonstop.chaos.inject import Injector, durable_steps
from nonstop.chaos.report import FaultRecord
from nonstop.chaos.schedule import Planned
from nonstop.chaos.watch import JobEnded, JobWatch, Timeout
from nonstop.faults import preempt_notice_path

__all__ = ["FAILURE_KINDS", "PLANNED_KINDS", "Overtaken", "Recoveries"]

# kinds after which the job must run a new generation (a rank is replaced)
FAILURE_KINDS = frozenset({"kill", "hang", "exit", "stall", "wipe", "corrupt", "node", "partition"})
DURABLE_KINDS = frozenset({"wipe", "corrupt"})  # memory lost on purpose: back to a durable checkpoint
# planned moves: the job may reach its last step before one completes, which cancels it (no fault)
PLANNED_KINDS = frozenset({"migrate", "preempt"})
PLANNED_ROOM_S = 25.0  # seconds of training a job must have left to take a planned move
RATE_WINDOW_S = 10.0  # the step rate is measured over the last this many seconds


class Overtaken(Timeout):
    """A planned move the job's end overtook: not a failure; the next job takes the fault again."""


class Recoveries:
    def __init__(
        self, ep: Episode, watch: JobWatch, checks: Checks, *, netns: Netns | None, opts: Any, say: Any
    ) -> None:
        self.ep, self.watch, self.checks, self.netns, self.opts, self.say = (
            ep,
            watch,
            checks,
            netns,
            opts,
            say,
        )
        self._seen = 0
        self.margin = max(40, opts.steps // 10)  # steps a job must have left to take a fault
        self._progress: list[tuple[float, int]] = []  # (monotonic time, committed step) as seen
        self.clock = time.monotonic  # what the step rate is timed with (tests set it)

    # -- looking -----------------------------------------------------------------------------------
    def look(self, fault: str = "") -> dict[str, Any] | None:
        """Ask for the status, read the new events, feed the invariants; the status (or None)."""
        status = self.watch.status()
        self.watch.poll()
        new = self.watch.events[self._seen :]
        self._seen = len(self.watch.events)
        self.checks.look(status, new, fault=fault)
        c = status.get("committed_step") if status is not None else None
        if c is not None:
            now = self.clock()
            self._progress.append((now, int(c)))
            while len(self._progress) > 2 and self._progress[1][0] < now - RATE_WINDOW_S:
                self._progress.pop(0)
        return status

    def step_rate(self) -> float | None:
        """Committed steps per second over the last :data:`RATE_WINDOW_S` seconds (None before
        two looks a second apart, or while the job does not advance)."""
        if len(self._progress) < 2:
            return None
        (t0, c0), (t1, c1) = self._progress[0], self._progress[-1]
        if t1 - t0 < 1.0 or c1 <= c0:
            return None
        return (c1 - c0) / (t1 - t0)

    def _full(self, st: dict[str, Any] | None) -> bool:
        return (
            st is not None
            and st.get("state") == "running"
            and st.get("world_size") == self.opts.world_size
            and len(st["ranks"]) == self.opts.world_size
            and all(rec.get("pid") for rec in st["ranks"].values())
        )

    def _alive(self) -> bool:
        return self.ep.node_running(0)

    # -- whole again -------------------------------------------------------------------------------
    def restart_exited_nodes(self) -> list[int]:
        """Start again every node (but node 0) whose process exited: killed, fenced, drained."""
        out = []
        for k in range(1, self.opts.nnodes):
            if not self.ep.node_running(k):
                preempt_notice_path(self.ep.job_dir, str(k)).unlink(missing_ok=True)
                self.ep.start_node(k)
                out.append(k)
        return out

    def wait_ready(self, base: int | None, timeout: float, fault: str = "") -> dict[str, Any]:
        """Until the job is whole (see the module) with its committed step past ``base``."""
        restarted: list[int] = []

        def ready() -> dict[str, Any] | None:
            restarted.extend(self.restart_exited_nodes())
            st = self.look(fault)
            if not self._full(st):
                return None
            assert st is not None
            nodes = st["nodes"]
            if len(nodes) < self.opts.nnodes or not all(rec["alive"] for rec in nodes.values()):
                return None
            if any(rec["idle_spares"] < self.opts.spares for rec in nodes.values()):
                return None
            if st.get("migration") or st.get("queued_migrations") or st.get("growing"):
                return None
            c = st.get("committed_step")
            return st if c is not None and c > (base if base is not None else 0) else None

        st: dict[str, Any] = self.watch.wait(
            "the job whole again", ready, timeout, alive=self._alive, every=0.25
        )
        st["restarted_nodes"] = restarted
        return st

    def room_for(self, p: Planned, root: Path) -> dict[str, Any] | None:
        """The status when the job has room for fault ``p`` (steps left; for a wipe a durable
        checkpoint, for a corruption two); None when it is too near its end for it."""
        need = {"wipe": 1, "corrupt": 2}.get(p.kind, 0)

        def ok() -> Any:
            st = self.look()
            if self.watch.ended():
                return {"no_room": True}  # it reached its last step
            if st is None:
                return None
            c = st.get("committed_step") or 0
            if c >= self.opts.steps - self.margin:
                return {"no_room": True}
            if p.kind in PLANNED_KINDS:  # a move takes seconds whatever the pace: room in time
                rate = self.step_rate()
                if rate is None:
                    return None
                if (self.opts.steps - c) / rate < PLANNED_ROOM_S:
                    return {"no_room": True}
            return st if len(durable_steps(root)) >= need else None

        got = self.watch.wait(f"room for a {p.kind}", ok, self.opts.timeout_s, alive=self._alive, every=0.25)
        return None if got.get("no_room") else dict(got)

    # -- one fault ---------------------------------------------------------------------------------
    def fault(
        self, p: Planned, rec: FaultRecord, injector: Injector, status: dict[str, Any], *, tag: str
    ) -> None:
        """Inject ``p`` and wait until the job recovered and is whole again (filling ``rec``).
        :class:`Overtaken` when ``p`` is a planned move the job's end cancelled; :class:`Timeout`
        when a wait ran out (a failure)."""
        failed = len(self.checks.violations)
        try:
            self._fault(p, rec, injector, status, tag=tag)
        except JobEnded as e:
            if p.kind not in PLANNED_KINDS or len(self.checks.violations) > failed:
                raise
            raise Overtaken(str(e)) from e

    def _fault(
        self, p: Planned, rec: FaultRecord, injector: Injector, status: dict[str, Any], *, tag: str
    ) -> None:
        timeout = self.opts.timeout_s
        c0, g0 = status.get("committed_step"), int(status.get("generation") or 0)
        expected: int | None = c0
        if p.kind in DURABLE_KINDS:
            steps = sorted(s for s in durable_steps(injector.root) if c0 is None or s <= c0)
            expected = steps[-1] if p.kind == "wipe" and steps else (steps[-2] if len(steps) > 1 else None)
        got = injector.inject(p, status, timeout)
        rec.time, rec.detail = got.t, dict(got.detail)
        rec.detail.update(committed_before=c0, generation_before=g0)
        base = c0
        node = int(rec.detail.get("node", p.node))
        if p.kind in ("node", "partition") and not rec.detail.get("ranks"):  # spares only: no rank lost
            self.watch.wait(
                f"node {node} lost",
                lambda: (
                    self.look(tag),
                    [e for e in self.watch.named("node_lost", got.t) if e.get("node") == str(node)],
                )[1],
                timeout,
                alive=self._alive,
            )
        elif p.kind in FAILURE_KINDS:
            gen = self.watch.wait(
                "a new generation",
                lambda: (
                    self.look(tag),
                    [e for e in self.watch.named("generation", got.t) if e.get("cause")],
                )[1],
                timeout,
                alive=self._alive,
            )[0]
            restore, tier = int(gen.get("restore_step") or 0), str(gen.get("tier"))
            rec.detail.update(
                restore_step=restore, tier=tier, cause=gen.get("cause"), generation=gen.get("generation")
            )
            if p.kind in DURABLE_KINDS and tier != "durable":
                expected = c0  # the memory was not all lost (a replica was written since): keep it all
            rec.detail["lost_steps"] = self.checks.job.recovery(
                restore_step=restore, expected_min=expected, tier=tier, fault=tag
            )
            if p.kind == "corrupt" and restore == rec.detail.get("corrupted_step"):
                self.checks.fail(f"{tag}the job restored the corrupted checkpoint of step {restore}")
            base = restore
        elif p.kind == "coordinator":
            ev = self.watch.wait_event("coordinator_resumed", got.t, timeout, alive=self._alive)
            rec.detail.update(resumed_generation=ev.get("generation"), lost_nodes=ev.get("lost"))
        elif p.kind == "migrate":
            if rec.detail["returncode"] != 0:
                self.watch.poll()
                if self.watch.ended() and "the job finished first" in str(rec.detail["output"]):
                    raise Overtaken(f"the job reached its last step before the move: {rec.detail['output']}")
                self.checks.fail(f"{tag}nonstop migrate failed: {rec.detail['output']}")
        elif p.kind == "preempt":
            self.watch.wait(
                f"node {node} drained and released",
                lambda: (self.look(tag), not self.ep.node_running(node))[1],
                timeout,
                alive=self._alive,
            )

        def trained() -> Any:
            st = self.look(tag)
            if not self._full(st):
                return None
            assert st is not None
            if (
                p.kind in FAILURE_KINDS
                and "restore_step" in rec.detail
                and int(st.get("generation") or 0) <= g0
            ):
                return None
            c = st.get("committed_step")
            return st if c is not None and c > (base if base is not None else 0) else None

        self.watch.wait("training again", trained, timeout, alive=self._alive, every=0.1)
        rec.recovery_s = round(time.time() - got.t, 3)
        if p.kind == "partition":
            assert self.netns is not None
            fence = self.ep.job_dir / f"fenced-node-{node}.json"

            def fenced() -> Any:
                try:
                    got_fence = json.loads(fence.read_text())
                except (OSError, ValueError):
                    return None
                return got_fence if float(got_fence.get("at", 0)) >= got.t else None

            rec.detail["fenced"] = self.watch.wait(f"node {node} fenced", fenced, timeout, alive=self._alive)
            self.netns.heal(node)
        try:
            st = self.wait_ready(base, timeout, fault=tag)
            rec.ready_s = round(time.time() - got.t, 3)
            rec.detail["restarted_nodes"] = st["restarted_nodes"]
        except Timeout:
            if not self.watch.ended():
                raise
            rec.detail["ended_before_whole"] = True  # it recovered, then reached its last step
        since = [e for e in self.watch.events if float(e.get("ts", 0)) >= got.t]
        rec.detail["failures"] = [
            {"kind": e.get("kind"), "rank": e.get("rank"), "detail": e.get("detail")}
            for e in since
            if e.get("event") == "failure"
        ]
        rec.detail["nodes_lost"] = [e.get("node") for e in since if e.get("event") == "node_lost"]
        mttr = [e.get("mttr_s") for e in since if e.get("event") == "recovery"]
        if mttr:
            rec.detail["coordinator_mttr_s"] = mttr
        bad = [e for e in since if e.get("event") == "durable_install_failed"]
        if bad:
            rec.detail["durable_install_failed"] = [
                {"step": e.get("step"), "errors": e.get("errors")} for e in bad
            ]
