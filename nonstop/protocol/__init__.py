"""What crosses a process boundary: one module per channel, each message a frozen ``...Msg``
dataclass whose ``encode()`` the sender and ``decode()`` the receiver use -- :mod:`.worker`
(worker <-> coordinator), :mod:`.agent` (agent <-> coordinator), :mod:`.client` (operators'
tools <-> coordinator), :mod:`.rendezvous` (a worker's process-group store <-> the
coordinator's key-value table), :mod:`.dataplane` (node <-> node snapshot copies), with
:mod:`.base` (the :class:`~.base.WireError` a malformed message raises, the field readers) --
and the environment a worker is started with (:mod:`.torchrun`). :mod:`.wire` keeps the first
names. The coordinator, the agent and the worker each import this package; it imports none of
them.
"""
