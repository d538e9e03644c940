"""Synthetic event logs for the timeline tests, shaped like the coordinator's: a job's start,
steps, recoveries with their stages, resizes, migrations and catch-up rounds, and its end."""

from __future__ import annotations

from typing import Any

T0 = 1_700_000_000.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# a recovery's stage seconds, in the order the coordinator reports them
STAGES = {"plan": 0.01, "launch": 0.02, "restore": 0.2, "rebuild": 0.05, "resume": 0.4}


class Log:
    """Synthetic event logs shaped like the coordinator's (coordinator/loop.py)."""

    def __init__(self, nodes: int = 1, per_node: int = 3, spares: int = 1, start: float = 5.0) -> None:
        self.events: list[dict[str, Any]] = []
        self.world = nodes * per_node
        self.gen = 0
        self.next_sid = 0
        self.members: dict[int, int] = {}
        self.rank_node: dict[int, str] = {}
        self.spares: dict[str, list[int]] = {}
        self.add(0.0, "job_start", job_id="abc123", nnodes=nodes, nproc=per_node, spares=spares)
        names = [str(i) for i in range(nodes)]
        for n in names:
            self.add(0.01, "node_join", node=n, rejoin=False)
        self.add(0.02, "nodes_joined", nodes=names)
        for i, n in enumerate(names):
            for r in range(i * per_node, (i + 1) * per_node):
                self.members[r] = self.spawn(0.03, "worker", r, n)
                self.rank_node[r] = n
            self.spares[n] = [self.spawn(0.03, "spare", None, n) for _ in range(spares)]
        self.generation(start, cause=[])

    def add(self, t: float, event: str, **fields: Any) -> Log:
        self.events.append({"ts": T0 + t, "event": event, **fields})
        return self

    def spawn(self, t: float, role: str, rank: int | None, node: str) -> int:
        sid = self.next_sid
        self.next_sid += 1
        self.add(t, "spawn", spawn_id=sid, role=role, rank=rank, node=node)
        return sid

    def generation(self, t: float, cause: list[int], restore_step: int | None = None) -> float:
        """A generation at ``t`` with its stage events; returns when its 'resume' stage ends."""
        self.gen += 1
        self.add(
            t,
            "generation",
            generation=self.gen,
            restore_step=restore_step,
            tier="memory",
            members={str(k): v for k, v in sorted(self.members.items())},
            nodes={str(k): self.rank_node[k] for k in sorted(self.members)},
            cause=cause,
        )
        now = t
        for stage in ("launch", "restore", "rebuild", "resume"):
            now += STAGES[stage]
            self.add(now, "stage", generation=self.gen, stage=stage, seconds=STAGES[stage])
        return now

    def fail(
        self,
        t: float,
        ranks: list[int],
        kind: str = "kill",
        step: int = 10,
        detect: float = 0.1,
        wait: float | None = None,
    ) -> float:
        """``ranks`` fail at ``t`` (one reconfiguration repairs them); returns when it is done.
        ``wait``: no spare at first, the job waits that long (``elastic_wait``) until one takes over."""
        for r in ranks:
            self.add(t, "fault_injected", rank=r, step=step, kind=kind, spawn_id=self.members[r])
        for r in ranks:
            self.add(
                t + detect, "failure", kind=kind, rank=r, spawn_id=self.members[r], detail=kind, step=step,
                detect_s=detect,
            )  # fmt: skip
        for r in ranks:
            node = self.rank_node[r]
            pool = self.spares.get(node) if kind != "node" else None
            pool = pool or next(p for n, p in self.spares.items() if p and n != node)
            self.members[r] = pool.pop(0)
            self.rank_node[r] = next(n for n, p in self.spares.items() if p is pool)
        if wait is not None:
            self.add(t + detect, "elastic_wait", ranks=ranks, wait_s=wait + 1.0)
        plan_end = t + detect + (wait or 0.0) + STAGES["plan"]
        done = self.generation(plan_end, cause=ranks, restore_step=step)
        for r in ranks:
            stages = {"detect": detect, "replan": 0.0, **STAGES, "plan": STAGES["plan"] + (wait or 0.0)}
            self.add(
                done, "recovery", kind=kind, rank=r, step=step, detail=kind, detect_s=detect, stages=stages,
                training_again_s=done - STAGES["resume"] - t, mttr_s=done - t, lost_steps=1,
                restore_step=step, replacement="spare", generation=self.gen,
            )  # fmt: skip
        for r in ranks:
            node = self.rank_node[r]
            self.spares[node].append(self.spawn(done, "spare", None, node))
        return done

    def shrink(
        self, t: float, ranks: list[int], wait: float = 5.0, detect: float = 0.1, step: int = 10
    ) -> float:
        """``ranks`` fail at ``t`` with no spare: the job waits ``wait`` s for one, then drops them (the
        others renumbered in order, as the coordinator's _shrink does); returns when it trains again."""
        for r in ranks:
            self.add(t, "fault_injected", rank=r, step=step, kind="kill", spawn_id=self.members[r])
            self.add(
                t + detect,
                "failure",
                kind="kill",
                rank=r,
                spawn_id=self.members[r],
                step=step,
                detect_s=detect,
            )
        self.add(t + detect, "elastic_wait", ranks=ranks, wait_s=wait)
        decided = t + detect + wait
        keep = [r for r in sorted(self.members) if r not in ranks]
        new_of = {old: new for new, old in enumerate(keep)}
        self.add(
            decided, "shrink", world_size=len(keep), old_world_size=len(self.members), dropped=ranks,
            renumbered={str(o): n for o, n in new_of.items() if o != n},
            shards={str(n): [o] for o, n in new_of.items()},
            reason=f"no spare for {len(ranks)} rank(s) after {wait:.2f}s",
        )  # fmt: skip
        self.members = {new_of[o]: sid for o, sid in self.members.items() if o in new_of}
        self.rank_node = {new_of[o]: n for o, n in self.rank_node.items() if o in new_of}
        done = self.generation(decided + STAGES["plan"], cause=ranks, restore_step=step)
        for r in ranks:
            self.add(
                done, "recovery", kind="kill", rank=r, step=step, detect_s=detect, mttr_s=done - t,
                stages={"detect": detect, "plan": done - t - detect - 0.67, "launch": 0.02, "restore": 0.2,
                        "rebuild": 0.05, "resume": 0.4},
                lost_steps=0, restore_step=step, replacement=None, generation=self.gen,
            )  # fmt: skip
        return done

    def grow(self, t: float, joiners: int = 1, prepare: float = 1.2, abort: str | None = None) -> float:
        """Idle spares on node 0 join as new ranks: prepare for ``prepare`` s, pause 0.3 s, swap
        (or abort with ``abort`` after the pause); returns when it is done (or aborted)."""
        sids = [self.spawn(t - 1.0, "spare", None, "0") for _ in range(joiners)]
        old = len(self.members)
        self.add(
            t, "grow_start", world_size=old, new_world_size=old + joiners, prepare_step=50,
            joiners={str(s): "0" for s in sids},
        )  # fmt: skip
        self.add(t + prepare, "grow_pause", boundary=60, prepare_s=prepare)
        swap = t + prepare + 0.3
        if abort is not None:
            self.add(swap, "grow_aborted", boundary=60, error=abort)
            return swap
        self.add(swap, "grow", world_size=old + joiners, old_world_size=old, boundary=60, shards={})
        for i, sid in enumerate(sids):
            self.members[old + i], self.rank_node[old + i] = sid, "0"
        done = self.generation(swap, cause=[], restore_step=60)
        self.add(done, "grow_done", world_size=old + joiners, boundary=60, seconds=done - t)
        return done

    def migrate(
        self,
        t: float,
        rank: int,
        target: str,
        catchups: tuple[bool, ...] = (True, False),
        swap_delta: bool = True,
    ) -> float:
        """``rank`` moves to node ``target``: prepare 1 s, one catch-up round per entry (True: a
        delta) 0.3 s apart, pause 0.2 s later, swap; returns when it is done."""
        joiner = self.spawn(t - 1.0, "spare", None, target)
        source = self.rank_node[rank]
        self.add(
            t,
            "migration_start",
            rank=rank,
            source=source,
            target=target,
            joiner=joiner,
            step=40,
            reason="drain",
        )
        now = t + 1.0
        for i, delta in enumerate(catchups):
            now += 0.3
            self.add(
                now, "catchup", rank=rank, step=42 + i, ok=True, delta=delta, raw_bytes=1000,
                wire_bytes=100 if delta else 1000, seconds=0.2, capped=False, error=None,
            )  # fmt: skip
        pause = now + 0.2
        self.add(pause, "migration_pause", rank=rank, boundary=48)
        self.members[rank], self.rank_node[rank] = joiner, target
        done = self.generation(pause + 0.1, cause=[], restore_step=48)
        self.add(
            done, "migration_done", rank=rank, source=source, target=target, boundary=48,
            stages={"fetched": 0.5, "prepared": 0.5}, max_step_gap_s=0.5, median_step_s=0.1, pause_ratio=5.0,
            reason="drain", catchup_rounds=len(catchups), swap_delta=swap_delta,
        )  # fmt: skip
        return done

    def end(self, t: float, state: str = "done") -> Log:
        self.add(t, "finish", step=100, generation=self.gen)
        self.add(t + 0.5, "job_done", generation=self.gen)
        self.add(t + 1.0, "job_end", state=state, seconds=t + 1.0, generation=self.gen, error=None)
        return self


def elastic_log() -> Log:
    """Everything this section draws: a wait and a shrink, an aborted grow, a grow, a migration."""
    log = Log(nodes=2, per_node=2, spares=0)
    log.shrink(10.0, [1], wait=4.0)
    log.grow(22.0, abort="joiner exited")
    log.grow(30.0)
    log.migrate(40.0, 0, "1")
    return log.end(50.0)
