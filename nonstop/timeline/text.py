"""The timeline as text: :func:`timeline_text`, the summary ``nonstop timeline`` prints, and the
phrases the picture shares with it (its title, durations, how an unfinished record ended)."""

from __future__ import annotations

from collections.abc import Sequence

from nonstop.timeline.model import ElasticResize, ElasticWait, MigrationSpan, Timeline

__all__ = ["fmt_s", "summary", "timeline_text", "title", "totals", "unfinished_text"]


def fmt_s(s: float) -> str:
    return f"{s * 1000:.0f}ms" if s < 1.0 else f"{s:.2f}s"


def unfinished_text(tl: Timeline, end: float, what: str = "recovered") -> str:
    """How a record open at ``end`` (the log's end or the job's failure) ended."""
    if tl.failed_at is not None and end >= tl.failed_at - 1e-6:
        return f"not {what}: job failed"
    return "unfinished (the log ends)"


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(str(r) for r in ranks)}"


def _wait_text(tl: Timeline, w: ElasticWait) -> str:
    upto = f" up to {fmt_s(w.wait_s)}" if w.wait_s is not None else ""
    have = "has" if len(w.ranks) == 1 else "have"
    how = {
        "shrink": f"shrank after {fmt_s(w.seconds)}",
        "replaced": f"a spare took over after {fmt_s(w.seconds)}",
        "failed": f"the job failed after {fmt_s(w.seconds)}",
    }.get(w.outcome, "still waiting (the log ends)")
    return f"wait      {_ranks_text(w.ranks)} {have} no spare: waits{upto} | {how}"


def _resize_text(tl: Timeline, z: ElasticResize) -> str:
    gen = f"g{z.generation} " if z.generation is not None else ""
    sizes = z.sizes.replace("→", " -> ") + " ranks"
    if z.kind == "shrink":
        parts = [f"dropped {_ranks_text(z.dropped)}"] if z.dropped else []
        if z.renumbered:
            parts.append("renumbered " + ", ".join(f"{o}->{n}" for o, n in sorted(z.renumbered.items())))
        head = f"shrink    {gen}{sizes}" + (f", {', '.join(parts)}" if parts else "")
        head += f" ({z.reason})" if z.reason else ""
        tail = [f"waited {fmt_s(z.t - z.start)}"] if z.t > z.start else []
        if z.outcome == "done":
            tail.append(f"training again {fmt_s(z.end - z.t)} later")
        else:
            tail.append(unfinished_text(tl, z.end, "training again"))
        return f"{head} | {', '.join(tail)}"
    at = f" at boundary {z.boundary}" if z.boundary is not None else ""
    prep = z.stages[0]
    prepared = f"prepare {fmt_s(prep.seconds)}" + (
        f" (step {z.prepare_step})" if z.prepare_step is not None else ""
    )
    if z.outcome == "aborted":
        return f"grow      {sizes} aborted{at} after {fmt_s(z.end - z.start)}: {z.error or '?'}"[:200]
    if z.outcome == "unfinished":
        return f"grow      {gen}{sizes}{at}: {prepared} | {unfinished_text(tl, z.end, 'grown')}"
    swap = f", swap {fmt_s(z.stages[1].seconds)}" if len(z.stages) > 1 else ""
    return f"grow      {gen}{sizes}{at}: {prepared}{swap} | {fmt_s(z.seconds)}"


def _migration_text(tl: Timeline, m: MigrationSpan) -> str:
    where = f"node {m.source or '?'} -> {m.target or '?'}"
    why = f" ({m.reason})" if m.reason else ""
    at = f" at boundary {m.boundary}" if m.boundary is not None else ""
    head = f"migrate   rank {m.rank} {where}{why}{at}"
    if m.outcome == "aborted":
        phase = f" in {m.phase}" if m.phase else ""
        return f"{head} aborted{phase} after {fmt_s(m.seconds)}: {m.error or '?'}"[:200]
    parts = [f"{s.stage} {fmt_s(s.seconds)}" for s in m.stages]
    rounds = f"{m.rounds} catch-up round{'s' if m.rounds != 1 else ''}"
    if m.catchups:
        rounds += f" ({', '.join(c.kind for c in m.catchups)})"
    parts.append(rounds)
    if m.swap_delta is not None:
        parts.append("swap fetched a delta" if m.swap_delta else "swap fetched the whole step")
    tail = f"{fmt_s(m.seconds)}" if m.outcome == "done" else unfinished_text(tl, m.end, "moved")
    if m.outcome == "done" and m.pause_ratio is not None:
        tail += f", step gap {m.pause_ratio:.2f}x the median step"
    return f"{head}: {', '.join(parts)} | {tail}"


def summary(tl: Timeline) -> str:
    nodes = len(tl.nodes)
    where = f"{tl.world_size} rank{'s' if tl.world_size != 1 else ''}"
    if nodes:
        where += f" on {nodes} node{'s' if nodes != 1 else ''}"
    outcome = tl.outcome or "no job_end (running or killed)"
    sizes = [tl.world_size, *(z.world_size for z in tl.resizes if z.resized)]
    if len(sizes) > 1:  # the world sizes it went through
        where += f" (world {'->'.join('?' if n is None else str(n) for n in sizes)})"
    earlier = f" (the log's last job; {tl.earlier_jobs} earlier)" if tl.earlier_jobs else ""
    return f"job {tl.job_id or '?'}{earlier}: {where}, {outcome} after {tl.end:.1f}s"


def totals(tl: Timeline) -> str:
    kinds: dict[str, int] = {}
    for f in tl.failures:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    k = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    mttrs = [r.mttr_s for r in tl.recoveries if r.mttr_s is not None]
    out = f"{len(tl.failures)} failure{'s' if len(tl.failures) != 1 else ''}" + (f" ({k})" if k else "")
    if mttrs:
        out += f", MTTR mean {fmt_s(sum(mttrs) / len(mttrs))} max {fmt_s(max(mttrs))}"
    unfinished = sum(not r.complete for r in tl.recoveries)
    if unfinished:
        out += f", {unfinished} unfinished recover{'ies' if unfinished != 1 else 'y'}"
    out += f", {tl.lost_steps} lost step{'s' if tl.lost_steps != 1 else ''}"
    counts = {
        "migration": len(tl.migrations),
        "shrink": sum(z.kind == "shrink" for z in tl.resizes),
        "grow": sum(z.kind == "grow" and z.resized for z in tl.resizes),
        "aborted grow": sum(z.kind == "grow" and z.outcome == "aborted" for z in tl.resizes),
    }
    for name, n in counts.items():
        if n:
            out += f", {n} {name}{'s' if n != 1 else ''}"
    return out


def timeline_text(timeline: Timeline) -> str:
    """A compact summary for a terminal: a header line (job, ranks, nodes, outcome, totals),
    then one line per failure, recovery (with each stage's seconds and MTTR), node loss,
    coordinator restart, durable restore, wait for a spare, shrink, grow, migration (with its
    catch-up rounds and how the swap fetched) and job failure, in time order: a recovery at its
    end, a shrink at its decision, anything else at its start. No trailing newline."""
    tl = timeline
    lines: list[tuple[float, int, str]] = []
    for f in tl.failures:
        where = f"rank {f.rank}" + (f" (node {f.node})" if f.node is not None else "")
        step = f" after step {f.step}" if f.step is not None else ""
        det = f", detected in {fmt_s(f.detected - f.t)}" if f.detected > f.t else ""
        detail = f" ({f.detail})" if f.detail else ""
        lines.append((f.t, 0, f"failure   {f.kind} {where}{step}{detail}{det}"))
    for r in tl.recoveries:
        stages = " ".join(
            f"{k} {fmt_s(v)}" for k, v in r.stage_seconds.items() if k != "replan" or v > 0
        )  # replan: only when a later failure interrupted a reconfiguration
        gen = f"g{r.generation} " if r.generation is not None else ""
        how = []
        if r.replacement:
            how.append(f"-> {r.replacement}")
        if r.restore_step is not None:
            how.append(f"restored step {r.restore_step}" + (f" ({r.tier})" if r.tier else ""))
        head = f"recovery  {gen}{r.kind} rank {r.rank}" + (f" {' '.join(how)}" if how else "")
        if r.complete and r.mttr_s is not None:
            tail = f"| MTTR {fmt_s(r.mttr_s)}"
            if r.lost_steps is not None:
                tail += f", lost steps {r.lost_steps}"
        else:
            tail = f"| {unfinished_text(tl, r.end)}"
        lines.append((r.end, 1, f"{head}: {stages} {tail}"))
    for m in tl.node_marks:
        if m.kind == "lost":
            lines.append((m.t, 0, f"node      {m.node} lost" + (f": {m.detail}" if m.detail else "")))
        elif m.kind == "rejoin":
            lines.append((m.t, 0, f"node      {m.node} rejoined"))
    for m in tl.coordinator_marks:
        if m.kind == "resumed":
            lines.append((m.t, 0, f"coord     coordinator restarted, resumed {m.detail}".rstrip()))
    for m in tl.tier_marks:
        if m.kind == "restore_durable":
            lines.append(
                (m.t, 0, f"durable   restored step {m.step} from the durable tier {m.detail}".rstrip())
            )
        elif m.kind in ("persist_failed", "durable_failed"):
            lines.append((m.t, 0, f"durable   {m.kind.replace('_', ' ')}: {m.detail}"[:160]))
    for w in tl.waits:
        lines.append((w.start, 1, _wait_text(tl, w)))
    for z in tl.resizes:
        lines.append((z.t if z.kind == "shrink" else z.start, 1, _resize_text(tl, z)))
    for mv in tl.migrations:
        lines.append((mv.start, 1, _migration_text(tl, mv)))
    if tl.failed_at is not None:
        lines.append((tl.failed_at, 2, f"job       failed: {tl.error or '?'}"))
    out = [f"{summary(tl)}; {totals(tl)}"]
    out += [f"{t:8.2f}s  {s}" for t, _, s in sorted(lines, key=lambda x: (x[0], x[1]))]
    return "\n".join(out)


def title(tl: Timeline) -> str:
    """The picture's title: the summary and the totals."""
    return f"nonstop timeline: {summary(tl)}\n{totals(tl)}"
