"""A node's accelerators: which device each process holds (:mod:`.inventory`) and the NCCL
settings a worker on a CUDA node is given (:mod:`.nccl`). Shared by the agent, which hands out
devices, and the worker, which binds to its own.
"""
