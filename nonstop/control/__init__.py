"""The control channel between workers and the coordinator.

Every connection is authenticated with the per-job secret (mutual HMAC
challenge-response), every frame after the handshake carries an HMAC over a
per-direction sequence number and the payload, and payloads are JSON: nothing
read from the network is ever unpickled. The server binds exactly the address
it is given.
"""

from nonstop.control.channel import Channel, ControlServer, connect, new_secret

__all__ = ["Channel", "ControlServer", "connect", "new_secret"]
