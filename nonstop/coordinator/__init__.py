"""The coordinator: one per job. Membership, generations, failure detection, recovery and
migration plans, the event log.

Where a change goes:

* :mod:`.loop` -- :class:`~nonstop.coordinator.loop.Coordinator`, the loop: it routes every event
  (a message, an exit, a tick) to the operation that owns it; :mod:`.routing`, its table of
  which operation handles each decoded message.
* :mod:`.view` -- :class:`~nonstop.coordinator.view.JobView`, the one record of nodes, processes,
  roles and progress every operation reads.
* :mod:`.executor` -- the coordinator's I/O: sends, spawns and kills through node agents.
* the operations, one module each: :mod:`.workers` (the workers' protocol), :mod:`.node_agents`
  (node agents: admission, leases, loss), :mod:`.job_start` (the job's start), :mod:`.failures`,
  :mod:`.generations` (every membership change, planned and launched), :mod:`.plan_asks`,
  :mod:`.restore_sources`, :mod:`.resizing`, :mod:`.swaps` (live migrations and grows),
  :mod:`.replication`, :mod:`.persistence`, :mod:`.health`, :mod:`.client_requests`,
  :mod:`.event_feed`, :mod:`.store_sync`.
* what the coordinator serves or computes for others: :mod:`.detector`, :mod:`.metrics`,
  :mod:`.status_server`, :mod:`.torch_env`.

The decisions are pure policies in :mod:`nonstop.policy`; the messages are :mod:`nonstop.protocol`'s.
Nothing here imports :mod:`nonstop.agent` or :mod:`nonstop.launch`.
"""
