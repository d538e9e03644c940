"""``nonstop chaos``: a soak of seeded random faults on real multi-node jobs on this machine.

``schedule`` (the faults, pure), ``cluster`` (etcd, network namespaces, a job's node processes),
``watch`` (the event log and status), ``inject`` (one fault, by kind), ``recover`` (waiting for
recovery and for the job to be whole), ``invariants`` (what must hold, pure), ``checks`` (the
invariants fed, leftovers), ``report``, ``driver`` (the soak), ``cli``.
"""
