"""The agent channel: a node agent (:mod:`nonstop.agent.node`) <-> the coordinator
(:mod:`nonstop.coordinator.node_agents`). One import point for both directions:
:mod:`.agent_reports` (agent -> coordinator) and :mod:`.agent_commands` (coordinator -> agent).

The conversation (JSON, authenticated; every message is a frozen ``...Msg`` whose ``encode()`` the
sender and whose ``decode`` the receiver uses)::

    agent -> coordinator   AgentHelloMsg (the handshake's hello, no ``t``)
    coordinator -> agent   NodeWelcomeMsg (resumed: a reconnect)  |  NodeRefusedMsg
    agent -> coordinator   LeaseMsg every lease TTL / 5           -> LeaseOkMsg
    coordinator -> agent   SpawnMsg                               -> SpawnedMsg (refused: then ExitMsg)
    coordinator -> agent   KillMsg (unless_moving: JudgedMsg first)
    agent -> coordinator   ExitMsg when a process ends
    coordinator -> agent   InventoryRequestMsg                    -> InventoryMsg
    coordinator -> agent   ReplicateMsg                           -> ReplicatedMsg per rank
    coordinator -> agent   FetchRequestMsg                        -> FetchedMsg
    coordinator -> agent   InstallDurableMsg                      -> InstalledMsg
    coordinator -> agent   CommittedMsg, ForgetMsg (no answer)
    coordinator -> agent   PersistRanksMsg                        -> RanksPersistedMsg
    agent -> coordinator   PreemptMsg, RegisteredMsg, FatalMsg, HealthMsg (its own)
    coordinator -> agent   ReleaseMsg, NodeFinishMsg, FencedMsg (the end)

Requests (inventory, fetch, install) carry the id :meth:`Executor.request
<nonstop.coordinator.executor.Executor.request>` gives them, last on the wire; their answers name
it. :class:`LostMsg` is made by the coordinator for a request whose node was lost (never sent).

A malformed message raises :class:`~nonstop.protocol.base.WireError`: the coordinator loses that
node (its agent broke the protocol); the agent logs (or, for a persist, answers a failure to) a
data-path command it cannot read and stops on any other, as before.
"""

from __future__ import annotations

from nonstop.protocol.agent_commands import (
    DATA_COMMANDS,
    AgentCommand,
    AgentRequestMsg,
    CommittedMsg,
    FencedMsg,
    FetchRequestMsg,
    ForgetMsg,
    InstallDurableMsg,
    InventoryRequestMsg,
    KillMsg,
    LeaseOkMsg,
    NodeFinishMsg,
    NodeRefusedMsg,
    NodeWelcomeMsg,
    PersistRanksMsg,
    ReleaseMsg,
    ReplicateMsg,
    SpawnMsg,
    decode_command,
    decode_welcome,
    request_id,
)
from nonstop.protocol.agent_reports import (
    AgentHelloMsg,
    AgentMessage,
    ExitMsg,
    FatalMsg,
    FetchedBytes,
    FetchedMsg,
    InstalledMsg,
    InventoryMsg,
    JudgedMsg,
    LeaseMsg,
    LostMsg,
    PreemptMsg,
    RanksPersistedMsg,
    RegisteredMsg,
    ReplicatedMsg,
    SpawnedMsg,
    decode_agent,
)
from nonstop.protocol.base import HealthMsg

__all__ = [
    "DATA_COMMANDS",
    "AgentCommand",
    "AgentHelloMsg",
    "AgentMessage",
    "AgentRequestMsg",
    "CommittedMsg",
    "ExitMsg",
    "FatalMsg",
    "FencedMsg",
    "FetchRequestMsg",
    "FetchedBytes",
    "FetchedMsg",
    "ForgetMsg",
    "HealthMsg",
    "InstallDurableMsg",
    "InstalledMsg",
    "InventoryMsg",
    "InventoryRequestMsg",
    "JudgedMsg",
    "KillMsg",
    "LeaseMsg",
    "LeaseOkMsg",
    "LostMsg",
    "NodeFinishMsg",
    "NodeRefusedMsg",
    "NodeWelcomeMsg",
    "PersistRanksMsg",
    "PreemptMsg",
    "RanksPersistedMsg",
    "RegisteredMsg",
    "ReleaseMsg",
    "ReplicateMsg",
    "ReplicatedMsg",
    "SpawnMsg",
    "SpawnedMsg",
    "decode_agent",
    "decode_command",
    "decode_welcome",
    "request_id",
]
