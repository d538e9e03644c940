"""The node agent: one long-lived process per node, between the coordinator and the node's
processes.

* :mod:`.node` -- :class:`~nonstop.agent.node.NodeAgent`: the agent's loop and its control channel.
* :mod:`.processes` -- the processes it starts (workers, hot spares), watched and reaped.
* :mod:`.spawn` -- how a process is started on a device of its own.
* :mod:`.data_path` -- snapshot inventories, replication, fetches, installs and persists.
* :mod:`.memory` -- the node's snapshot memory (its room in ``/dev/shm``).
* :mod:`.lease` -- store mode: the node's liveness key.
* :mod:`.silence` -- a silent worker judged where it runs: stuck, or starved.
* :mod:`.probes`, :mod:`.probe_thread` -- health probes of the host and the thread that runs them.
* :mod:`.notice` -- preemption notices; :mod:`.gc` -- what a crashed job left behind.

Nothing here imports :mod:`nonstop.coordinator` or :mod:`nonstop.launch`: the agent and the
coordinator meet only through :mod:`nonstop.protocol`.
"""
