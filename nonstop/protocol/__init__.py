"""What crosses a process boundary: the messages on the control channels
(:mod:`.wire`: decoded, typed, at the coordinator's edge) and the environment a worker is started
with (:mod:`.torchrun`). The coordinator, the agent and the worker each import this package; it
imports none of them.
"""
