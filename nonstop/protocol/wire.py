"""The messages to the coordinator under their first names (before issue 46's one module per
channel): re-exports of :mod:`.base`, :mod:`.worker`, :mod:`.agent` and :mod:`.client`, kept so
that code written against ``nonstop.protocol.wire`` goes on importing. New code imports the
channel's module and the ``...Msg`` names.

A message that lacks a field or has one of the wrong type raises :class:`WireError` (a
``ValueError``): the coordinator fails that sender only (a worker's rank is recovered, an agent's
node lost, a client answered with an error) and goes on. Unknown kinds decode to ``None``.
"""

from __future__ import annotations

from nonstop.protocol.agent import (
    AgentMessage,
    ExitMsg,
    FatalMsg,
    FetchedMsg,
    InstalledMsg,
    InventoryMsg,
    JudgedMsg,
    LeaseMsg,
    LostMsg,
    PreemptMsg,
    RegisteredMsg,
    ReplicatedMsg,
    SpawnedMsg,
    decode_agent,
)
from nonstop.protocol.base import HealthMsg, MigrateMsg, RawMsg, WireError
from nonstop.protocol.client import (
    ClientRequest,
    DrainMsg,
    PersistRequestMsg,
    StatusRequestMsg,
    decode_client,
)
from nonstop.protocol.worker import (
    AT_MAX,
    DoneMsg,
    FaultMsg,
    HeartbeatMsg,
    InjectedMsg,
    PausedMsg,
    ReadyMsg,
    RestoredMsg,
    StepMsg,
    SubscribeMsg,
    WorkerMessage,
    decode_worker,
)

__all__ = [
    "AT_MAX",
    "AgentMessage",
    "ClientRequest",
    "Done",
    "Drain",
    "Exit",
    "Fatal",
    "Fault",
    "Fetched",
    "HealthReport",
    "Heartbeat",
    "Injected",
    "Installed",
    "Inventory",
    "Judged",
    "Lease",
    "Lost",
    "Migrate",
    "Paused",
    "PersistRequest",
    "Preempt",
    "Raw",
    "Ready",
    "Registered",
    "Replicated",
    "Restored",
    "Spawned",
    "StatusRequest",
    "Step",
    "Subscribe",
    "WireError",
    "WorkerMessage",
    "decode_agent",
    "decode_client",
    "decode_worker",
]

# the first names (one each; the ...Msg classes themselves)
Heartbeat = HeartbeatMsg
Injected = InjectedMsg
Restored = RestoredMsg
Ready = ReadyMsg
Step = StepMsg
Done = DoneMsg
Paused = PausedMsg
Fault = FaultMsg
Migrate = MigrateMsg
Raw = RawMsg
HealthReport = HealthMsg
Subscribe = SubscribeMsg
Lease = LeaseMsg
Exit = ExitMsg
Judged = JudgedMsg
Spawned = SpawnedMsg
Inventory = InventoryMsg
Installed = InstalledMsg
Fetched = FetchedMsg
Replicated = ReplicatedMsg
Lost = LostMsg
Preempt = PreemptMsg
Registered = RegisteredMsg
Fatal = FatalMsg
StatusRequest = StatusRequestMsg
PersistRequest = PersistRequestMsg
Drain = DrainMsg
