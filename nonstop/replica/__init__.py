"""Peer replication: every rank's snapshot, encoded, in r other nodes' memory.

Contract:

* Each node agent runs a :class:`~nonstop.replica.dataplane.DataPlane`: an
  authenticated listener (job secret, HMAC-framed, nothing unpickled) that
  holds replicas of other nodes' ranks in its own shared memory and serves
  snapshots to nodes that need them after a failure.
* The coordinator runs replication in **rounds**: round S asks every node to
  replicate step S of each of its ranks to that rank's holders. When every
  rank's step S is acknowledged, S becomes the job's *replicated step*, and
  after a node loss every rank can be restored to it from memory.
* A replica is sent as a delta against the previous replica the holder
  acknowledged (or in full when there is none), encoded with the snapshot
  codec (lossless), chunk by chunk, each chunk CRC-32C checked when the
  holder decodes it; a bad chunk fails the transfer and nothing is installed.
* Transfers are bandwidth-capped (token bucket) so replication does not
  starve the training job's own traffic.
"""

from nonstop.replica.dataplane import DataPlane
from nonstop.replica.peer import FetchError, Replicator, fetch_snapshot

__all__ = ["DataPlane", "FetchError", "Replicator", "fetch_snapshot"]
