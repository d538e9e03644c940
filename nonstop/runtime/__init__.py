"""The control plane: coordinator, agent, recovery state machine, pure policies.

* :mod:`.policy` — pure decisions (committed step, hang detection, failure
  classification, recovery plan). No I/O; the simulator reuses them.
* :mod:`.recovery` — the recovery state machine and its timed stages.
* :mod:`.agent` — per-node processes: workers, hot spares, snapshot memory.
* :mod:`.coordinator` — membership, generations, detection, recovery, event log.
* :mod:`.launcher` — ``nonstop run``: wires the above together for one job.
"""
