"""The pipeline prototype: P processes on gloo, torch.distributed.pipelining, full-name snapshots.

    python pp_run.py launch --pp 2 --sched 1f1b --mode ref --out DIR [--steps 12] [--at 5]

Modes (what happens at step --at):
  ref          uninterrupted
  rebuild      the victim rank (--victim, default 1) discards its stage module(s) and optimizer,
               rebuilds them (from other weights) and restores its saved full-name state; every
               rank makes a new pp group (new_group); survivors keep their modules and optimizer
               and make new PipelineStage + schedule objects on the new group
  rebuild-all  as rebuild, but every rank rebuilds its module(s) from its own snapshot (what
               nonstop's Sharded trainee does every generation)
  swapgroup    survivors keep even their PipelineStage and schedule objects and only point
               stage.group at the new group (private attribute; does it work?)
  kill         the victim SIGKILLs itself in the forward of micro-batch 1 of step --at; the
               launcher starts a replacement process; survivors catch the error, tear down, join
               generation 1 (a new world + pp group), agree on the committed step (MIN), restore
               their own snapshot of it (files in DIR/snap: the 'host memory'), rebuild stages
  resume       start at --start-step from the full-name snapshots of another run (--from DIR,
               possibly another pp): each rank takes the names it holds

--static gives PipelineStage input_args/output_args (no shape inference at the first step).
Each rank writes DIR/rank<R>.json: digest of its final state by full name, step times, events.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import pp_common as C
from nonstop.train.abort import SocketWatch

M = 4  # micro-batches
TIMEOUT_S = 20.0  # the pp group's (P2P) timeout
JOIN_TIMEOUT_S = 180.0  # the world's: a replacement imports torch first (minutes on a loaded 2-core box)


def args_of(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["launch", "rank"])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--sched", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--at", type=int, default=5)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--mode", default="ref")
    ap.add_argument("--static", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--from", dest="src", type=Path, default=None)
    ap.add_argument("--start-step", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--gen", type=int, default=0)
    return ap.parse_args(argv)


class Rank:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.rank, self.pp = a, a.rank, a.pp
        self.per_rank = 2 if a.sched == "interleaved" else 1
        self.num_stages = self.pp * self.per_rank
        self.ids = C.stage_ids(self.rank, self.pp, self.per_rank)
        self.events: list[dict[str, Any]] = []
        self.times: list[tuple[int, int, float]] = []  # (gen, step, seconds)
        self.gen = a.gen
        self.sockets: list[SocketWatch] = []

    # -- groups ---------------------------------------------------------------------------
    def join(self, gen: int) -> None:
        t0 = time.monotonic()
        store = dist.FileStore(str(self.a.out / f"store.gen{gen}"), self.pp)
        w = SocketWatch()
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.pp,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        w.stop()
        self.sockets = [w]
        self.pg = self.new_pp_group()
        self.gen = gen
        self.events.append({"ev": "joined", "gen": gen, "s": round(time.monotonic() - t0, 3)})

    def new_pp_group(self) -> Any:
        w = SocketWatch()
        pg = dist.new_group(list(range(self.pp)), timeout=datetime.timedelta(seconds=TIMEOUT_S),
                            use_local_synchronization=True)
        w.stop()
        self.sockets.append(w)
        return pg

    def teardown(self) -> None:
        for w in self.sockets:
            w.half_close()
        self.sockets = []
        try:
            dist.destroy_process_group()
        except Exception as e:
            self.events.append({"ev": "destroy_failed", "err": str(e)[:100]})

    # -- model ----------------------------------------------------------------------------
    def build_modules(self, seed: int = 0) -> None:
        self.modules = [C.build_stage(s, self.num_stages, self.a.layers, seed) for s in self.ids]
        params = [p for m in self.modules for p in m.parameters()]
        self.opt = torch.optim.AdamW(params, lr=3e-3)

    def build_schedule(self) -> None:
        t0 = time.monotonic()
        mb = C.BATCH // M
        self.stages = []
        for s, m in zip(self.ids, self.modules, strict=True):
            kw: dict[str, Any] = {}
            if self.a.static:
                inp = torch.zeros(mb, C.SEQ, dtype=torch.long) if s == 0 else torch.zeros(mb, C.SEQ, C.DIM)
                out = torch.zeros(mb, C.SEQ, C.VOCAB if s == self.num_stages - 1 else C.DIM)
                # torch 2.13 static mode takes requires_grad from these examples: activations
                # must require grad, or the previous stage gets no gradient (a crash, or -- given
                # output_grads -- silently different training: DESIGN.md section 6)
                inp.requires_grad_(s != 0)
                out.requires_grad_(True)
                kw = {"input_args": (inp,), "output_args": (out,)}
            self.stages.append(PipelineStage(m, s, self.num_stages, torch.device("cpu"), group=self.pg, **kw))
        if self.a.sched == "interleaved":
            self.sched = ScheduleInterleaved1F1B(self.stages, M, loss_fn=C.loss_fn)
        else:
            cls = ScheduleGPipe if self.a.sched == "gpipe" else Schedule1F1B
            self.sched = cls(self.stages[0], M, loss_fn=C.loss_fn)
        self.events.append({"ev": "schedule_built", "gen": self.gen, "s": round(time.monotonic() - t0, 4)})

    @property
    def first(self) -> bool:
        return 0 in self.ids

    @property
    def last(self) -> bool:
        return self.num_stages - 1 in self.ids

    def step(self, step: int) -> float | None:
        self.opt.zero_grad(set_to_none=True)
        x, y = C.batch(step)
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kw: dict[str, Any] = {"target": y, "losses": losses} if self.last else {}
        self.sched.step(*args, **kw)
        self.opt.step()
        return float(torch.stack(losses).mean()) if losses else None

    # -- snapshots ("host memory": files, two slots) ---------------------------------------
    def snap_path(self, rank: int, step: int) -> Path:
        return self.a.out / "snap" / f"rank{rank}.step{step}.pt"

    def save(self, step: int) -> None:
        p = self.snap_path(self.rank, step)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        torch.save(C.snapshot(self.modules, self.opt, step), tmp)
        os.replace(tmp, p)
        old = self.snap_path(self.rank, step - 2)
        if old.exists():
            old.unlink()

    def newest(self) -> int:
        steps = [int(p.name.split(".step")[1][:-3]) for p in (self.a.out / "snap").glob(f"rank{self.rank}.step*.pt")]
        return max(steps, default=0)


def rank_main(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    r = Rank(a)
    r.join(a.gen)
    r.build_modules()
    step = a.start_step
    if a.mode == "resume":  # full-name snapshots of another run (another pp): the union of them
        merged: dict[str, Any] = {"model": {}, "optim": {}, "groups": None}
        for f in sorted((a.src / "snap").glob(f"rank*.step{a.start_step}.pt")):
            s = torch.load(f, weights_only=False)
            merged["model"].update(s["model"])
            merged["optim"].update(s["optim"])
            merged["groups"] = s["groups"]
        C.restore(r.modules, r.opt, merged)
    if a.gen > 0:  # a replacement: restore the committed step from the dead rank's memory
        step = recover(r, replacement=True)
    r.build_schedule()
    victim = r.rank == a.victim
    if a.mode == "kill" and victim and a.gen == 0:
        calls = {"n": 0}

        def die(mod: Any, inp: Any) -> None:
            if r.cur == a.at:
                calls["n"] += 1
                if calls["n"] == 2:  # the forward of micro-batch 1 of step --at
                    r.events.append({"ev": "kill"})
                    dump(r, step)
                    os.kill(os.getpid(), signal.SIGKILL)

        next(iter(r.modules[0].layers.values())).register_forward_pre_hook(die)
    while step < a.steps:
        r.cur = step
        if step == a.at and a.gen == 0 and a.mode in ("rebuild", "rebuild-all", "swapgroup"):
            t0 = time.monotonic()
            old = r.pg
            r.pg = r.new_pp_group()
            if victim or a.mode == "rebuild-all":
                snap = C.snapshot(r.modules, r.opt, step)
                del r.modules, r.opt, r.stages, r.sched
                gc.collect()
                r.build_modules(seed=999)  # other weights: the restore must bring the right ones
                C.restore(r.modules, r.opt, snap)
                r.build_schedule()
            elif a.mode == "swapgroup":
                for st in r.stages:
                    st.group = r.pg
            else:
                r.build_schedule()
            dist.destroy_process_group(old)
            r.events.append({"ev": "rebuilt", "mode": a.mode, "s": round(time.monotonic() - t0, 4)})
        t0 = time.monotonic()
        try:
            loss = r.step(step)
        except Exception as e:
            r.events.append({"ev": "step_failed", "step": step, "t": time.time(), "err": str(e)[:200]})
            r.teardown()
            t1 = time.monotonic()
            r.join(r.gen + 1)
            step = recover(r, replacement=False)
            r.build_schedule()
            r.events.append({"ev": "recovered", "step": step, "s": round(time.monotonic() - t1, 3)})
            continue
        r.times.append((r.gen, step, round(time.monotonic() - t0, 4)))
        step += 1
        if a.mode in ("kill", "resume") or a.src is None and a.mode == "ref":
            r.save(step)
    dump(r, step)
    r.teardown()


def recover(r: Rank, *, replacement: bool) -> int:
    """The committed step: MIN over the ranks' newest snapshots; restore this rank's of it."""
    t = torch.tensor([r.newest()])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=r.pg)
    committed = int(t)
    if committed > 0:
        C.restore(r.modules, r.opt, torch.load(r.snap_path(r.rank, committed), weights_only=False))
    r.events.append({"ev": "restored", "committed": committed, "replacement": replacement})
    return committed


def dump(r: Rank, step: int) -> None:
    out = {
        "rank": r.rank, "step": step, "gen": r.gen, "events": r.events, "times": r.times,
        "digest": C.digest(C.snapshot(r.modules, r.opt, step)),
        "names": [n for m in r.modules for n, _ in m.named_parameters()],
        "pp_seq": r.pg._get_sequence_number_for_group(),  # gloo's count of this rank's ops on the pp group
    }
    suffix = "" if not any(e["ev"] == "kill" for e in r.events) else ".killed"
    (r.a.out / f"rank{r.rank}{suffix}.json").write_text(json.dumps(out))


def launch(a: argparse.Namespace, argv: list[str]) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, __file__, "rank", *[x for x in argv if x != "launch"]]
    logs = a.out / "logs"
    logs.mkdir(exist_ok=True)

    def start(rank: int, gen: int) -> subprocess.Popen[bytes]:
        log = open(logs / f"rank{rank}.gen{gen}.log", "wb")
        return subprocess.Popen([*base, "--rank", str(rank), "--gen", str(gen)], stdout=log, stderr=log)

    procs = {r: start(r, 0) for r in range(a.pp)}
    t0 = time.monotonic()
    while procs:
        for r, p in list(procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del procs[r]
            if rc != 0 and a.mode == "kill":
                print(f"rank {r} exited {rc} at {time.monotonic() - t0:.2f}s: starting a replacement", flush=True)
                (a.out / "killed_at").write_text(str(time.time()))
                procs[r] = start(r, 1)
            elif rc != 0:
                print(f"rank {r} failed rc={rc}; see {logs}", flush=True)
        if time.monotonic() - t0 > 300:
            print("timeout: killing", flush=True)
            for p in procs.values():
                p.kill()
            break
        time.sleep(0.05)
    print(f"done in {time.monotonic() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    ns = args_of()
    if ns.cmd == "launch":
        launch(ns, sys.argv[1:])
    else:
        rank_main(ns)
