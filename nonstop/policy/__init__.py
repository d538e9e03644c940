"""Pure machines and policies of the control plane: no I/O, no clock, no import of
:mod:`nonstop.coordinator` or :mod:`nonstop.agent`. The runtime and the simulator both take their
decisions from here, so the two cannot disagree.

* machines (fed events, returning actions): :mod:`.reconfiguration` (a generation's recovery
  stages), :mod:`.boundary_swap` (a live migration or an elastic grow), :mod:`.phase` (the job's
  phase and which background operation may start).
* policies (inputs in, a decision out): :mod:`.decisions` (committed step, hangs, failure kinds,
  where a rank restores from, replacements, replica placement), :mod:`.planning` (what the next
  generation does about missing ranks), :mod:`.rescue`, :mod:`.survivors`, :mod:`.elastic`, :mod:`.migration`,
  :mod:`.cadence` (the snapshot interval), :mod:`.straggler`, :mod:`.grading`, :mod:`.proactive`.
"""
