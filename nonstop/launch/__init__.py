"""Starting a job and seeing it through: ``nonstop run`` and what it leaves for other processes.

* :mod:`.launcher` -- one node of a job: the coordinator (node 0), the node agent, the shutdown.
* :mod:`.local_nodes` -- every node of a job on this machine.
* :mod:`.coordproc` -- the coordinator as a process of its own (store mode).
* :mod:`.jobdir`, :mod:`.jobfiles` -- the job dir (one job per dir) and the files kept there.
* :mod:`.job_client` -- talking to a running job from another process (``nonstop status``...).

The top of the runtime: it may import the coordinator and the agent; nothing imports it but the
CLI, the demo and the chaos harness.
"""
