"""Hard abort of a process group's connections, so no peer waits on a group we left.

Why: a survivor that abandons a step (it was interrupted, or its own collective
failed) tears its gloo group down, but ``destroy_process_group`` only drops
the registry's reference: the sockets close when the last reference to the
group dies, and DDP's reducer, comm hooks and tracebacks can keep it alive.
A peer blocked in the allreduce, waiting for this rank's contribution, would
then wait for the full collective timeout instead of failing at once.

How: gloo connects its full mesh while the group is created, so the sockets
that appear in this process during ``init_process_group`` are the group's.
:class:`SocketWatch` records them; :meth:`SocketWatch.half_close` sends a FIN on
each (``shutdown(SHUT_WR)``): peers read EOF and their pending collectives
fail immediately, while our own side can still read, so gloo's event loop is
not handed an error it does not expect (a full ``SHUT_RDWR`` under a pending
operation can make gloo call ``std::terminate``). Linux only (``/proc/self/fd``).

A peer that is cut off (a network partition: no FIN, no reset ever arrives) would still hold
*us* in a collective until the group's timeout. :meth:`SocketWatch.shut_reads` ends that from
another thread: ``shutdown(SHUT_RD)`` on each connected socket of the group makes gloo's pending
reads see end-of-file, exactly as if every peer had half-closed, so the collective fails at once
with gloo's ordinary "connection closed by peer" error. Listening sockets are skipped: gloo's
listener treats a failed ``accept`` as fatal (``std::terminate``).
Sockets another thread happens to create during the group's creation would be
included; nonstop's own threads create none.
"""

from __future__ import annotations

import os
import socket

__all__ = ["SocketWatch"]


def _socket_inodes() -> dict[int, int]:
    """fd -> socket inode for every socket this process has open."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(name)] = int(link[8:-1])
    return out


class SocketWatch:
    """Records the sockets created between construction and :meth:`stop`."""

    def __init__(self) -> None:
        self._before = set(_socket_inodes().values())
        self.created: frozenset[int] = frozenset()

    def stop(self) -> None:
        self.created = frozenset(set(_socket_inodes().values()) - self._before)

    def half_close(self) -> int:
        """Send FIN on every recorded socket still open; return how many."""
        return self._shutdown(socket.SHUT_WR, skip_listeners=False)

    def shut_reads(self) -> int:
        """End every pending and future read on the recorded connected sockets (see the module
        docstring); return how many. Safe from any thread: only kernel state changes here."""
        return self._shutdown(socket.SHUT_RD, skip_listeners=True)

    def _shutdown(self, how: int, *, skip_listeners: bool) -> int:
        """``shutdown(how)`` on each recorded socket still open (through a duplicate of its fd);
        one that is closed meanwhile or not connected is passed over. ``skip_listeners``: leave
        listening sockets alone. Returns how many were shut down."""
        done = 0
        for fd, inode in _socket_inodes().items():
            if inode not in self.created:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as s:
                    if skip_listeners and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue  # gloo's listener: a failed accept is fatal to it
                    s.shutdown(how)
                done += 1
            except OSError:
                pass  # closed by gloo meanwhile, or not connected (a listener)
        return done
