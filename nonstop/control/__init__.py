"""The control channel between workers and the coordinator.

Every connection is authenticated with a key derived from the per-job secret for
its purpose (mutual HMAC challenge-response), every frame after the handshake
carries an HMAC, under a key of its direction, over a sequence number and the
payload, and payloads are JSON: nothing read from the network is ever unpickled.
The server binds exactly the address it is given and bounds what unauthenticated
peers can hold (:mod:`nonstop.control.listener`).
"""

from nonstop.control.channel import Channel, connect, derive_key, etcd_password, new_secret
from nonstop.control.listener import ControlServer, ListenerLimits

__all__ = [
    "Channel",
    "ControlServer",
    "ListenerLimits",
    "connect",
    "derive_key",
    "etcd_password",
    "new_secret",
]
