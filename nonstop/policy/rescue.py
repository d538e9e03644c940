"""Planning with the survivors' rescue snapshots (pure; the simulator models the outcome).

With ``--snapshot-every K`` (K > 1) the newest step every rank holds in memory can be up to
K - 1 steps behind the survivors' live state. A data-parallel survivor whose failed step left its
state untouched writes the state after its last completed step ``s`` to its slots before it
reports the fault (:mod:`nonstop.train.rescue`): ``rescued: s`` and a digest of what it holds
outside the replicated tensors. The coordinator waits up to ``--rescue-wait`` (2 s) for every
present rank's report (:class:`~nonstop.policy.planning.Pending`), then
:func:`gather` says whether they rescued one step together, and :func:`with_rescue` adds it to the
inventory:

* every survivor holds ``s`` on its own node, whatever its node answered (the rescue may have
  landed after the answer);
* a missing rank holds ``s`` where a survivor (its *donor*) does, when the survivors' digests
  agree (:attr:`Rescue.alike`: at least two of them, all equal -- their RNGs, extras and ``state=``
  objects are alike, as in a job seeded alike; a grow's joiner takes rank 0's state the same way):
  the replacement restores the donor's ``s`` (``from_rank``), fetched to its node if elsewhere;
  in an HSDP job the donor is a survivor of its copy group (the same shards, another replica
  group: :meth:`~nonstop.mesh.MeshSpec.copy_group`), and a rank whose copy group is all lost
  (an FSDP job without replicas) has none.

:func:`~nonstop.policy.planning.plan_generation` then picks the newest step every rank holds, as
ever: ``s`` when everyone rescued it, the old committed step otherwise (a survivor that could not
rescue, digests that differ, a rank without a donor, a shrink that renumbers the ranks: the donors
are dropped there).

A survivor blocked on a peer that is partitioned rather than dead reports only once the plan's
reconfigure severs its group, too late for that plan: the wait's bound is what such a failure
pays more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

__all__ = ["Report", "Rescue", "gather", "with_rescue"]

# rank -> step -> [(node, "local" | "replica")]: where each rank's snapshots are in memory (the
# nodes' inventories; planning.py plans with it too)
Inventory = Mapping[int, Mapping[int, Sequence[tuple[str, str]]]]
# a present rank's fault report of its rescue: (the step it wrote, or None: it could not; its digest)
Report = tuple[int | None, str | None]


@dataclass(frozen=True)
class Rescue:
    """Step ``step`` rescued by every present rank (rank -> its node), and whether their heads
    agree (a missing rank may then take a survivor's state)."""

    step: int
    holders: Mapping[int, str]
    alike: bool
    # rank -> its copy group (MeshSpec.copy_group: an HSDP job's ranks holding the same shards in
    # different replica groups); empty: every rank holds the same state (data-parallel)
    groups: Mapping[int, int] = field(default_factory=dict)

    def donors_for(self, rank: int) -> list[int]:
        """The survivors whose state ``rank`` may take (same copy group), in rank order."""
        if not self.groups:
            return sorted(self.holders)
        return [r for r in sorted(self.holders) if self.groups.get(r) == self.groups.get(rank)]


def gather(
    reports: Mapping[int, Report],
    present: Set[int],
    nodes: Mapping[int, str | None],
    groups: Mapping[int, int] | None = None,
) -> Rescue | None:
    """The rescue every present rank reported (``reports``: rank -> (step or None, digest)), or
    None: a rank did not report, could not rescue, or they rescued different steps. ``groups``:
    the ranks' copy groups (:attr:`Rescue.groups`)."""
    if not present or any(r not in reports for r in present):
        return None
    steps = {reports[r][0] for r in present}
    if len(steps) != 1:
        return None
    (step,) = steps
    if step is None or any(nodes.get(r) is None for r in present):
        return None
    digests = {reports[r][1] for r in present}
    alike = len(present) >= 2 and len(digests) == 1 and None not in digests
    holders = {r: str(nodes[r]) for r in sorted(present)}
    return Rescue(step=step, holders=holders, alike=alike, groups=dict(groups or {}))


def with_rescue(
    inventory: Inventory, rescue: Rescue, missing: list[int], *, donors: bool
) -> tuple[dict[int, dict[int, list[tuple[str, str]]]], dict[int, int]]:
    """``inventory`` with ``rescue.step`` held by every survivor on its node, and (``donors``,
    the survivors alike) by each missing rank where its donor holds it; returns that and
    missing rank -> donor rank (the survivors taken in turn)."""
    out = {r: {s: list(where) for s, where in steps.items()} for r, steps in inventory.items()}
    s = rescue.step
    for rank, node in rescue.holders.items():
        held = out.setdefault(rank, {}).setdefault(s, [])
        if (node, "local") not in held:
            held.append((node, "local"))
    given: dict[int, int] = {}
    if donors and rescue.alike:
        for i, rank in enumerate(r for r in sorted(missing) if s not in out.get(r, {})):
            candidates = rescue.donors_for(rank)
            if not candidates:  # no survivor holds its shards (its whole copy group is lost)
                continue
            donor = candidates[i % len(candidates)]
            given[rank] = donor
            out.setdefault(rank, {})[s] = [(rescue.holders[donor], "local")]
    return out, given
