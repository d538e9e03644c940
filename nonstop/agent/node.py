"""The node agent: one per node, between the coordinator and the node's processes.

It owns what is local to a node: the worker and spare processes (through
:class:`~nonstop.agent.processes.Agent`), the node's snapshot memory, the
replicas it holds for other nodes and its data plane
(:class:`~nonstop.replica.DataPlane`). It obeys the coordinator's commands
and reports what only it can see (process exits, what memory holds).

Protocol on the agent's control channel (JSON, authenticated; each message a class of
:mod:`nonstop.protocol.agent`, encoded by its sender and decoded by its receiver)::

    agent -> coordinator   hello {role: agent, node, nproc, spares, domain, data_addr, pid, in_process,
                                  devices, device_type}
    coordinator -> agent   welcome {job_id, lease_ttl_s, num_slots, env}  |  refused {error}
    agent -> coordinator   lease {seq}            every lease_ttl_s / 5
    coordinator -> agent   lease_ok {seq}
    coordinator -> agent   spawn {spawn_id, role, rank?, env?} -> spawned {spawn_id, pid, device}
                           (no free device: spawned {spawn_id, pid: null, error}, then
                           exit {spawn_id, rc: EXIT_NO_DEVICE, pid: null})
    coordinator -> agent   kill {spawn_id, sig}
    agent -> coordinator   exit {spawn_id, rc, pid, fault_at}
    coordinator -> agent   inventory {id}                 -> inventory {id, local, replicas}
    coordinator -> agent   replicate {step, ranks: {rank: [addr]}}
                                                          -> replicated {step, rank, ok, raw, wire}
    coordinator -> agent   fetch {id, rank, step, addr, kind[, as_rank, base, track]}
                           -> fetched {id, rank, ok, error, seconds, raw_bytes, wire_bytes, delta, capped}
    coordinator -> agent   install_durable {id, url, step, ranks[, from]} -> installed {id, ok, error}
                           (``from``: rank -> the checkpoint's rank it restores, a resize)
    coordinator -> agent   committed {step}   hold that step in memory, release older holds
    coordinator -> agent   persist {id, step, url, world_size, ranks, lossy, lossy_bits}
                                     -> persisted {id, ok, records, raw, stored, full, error}
    agent -> coordinator   preempt {grace_s}     a preemption notice: drain this node
    agent -> coordinator   health {verdict, probe, detail}   its probes' first verdict and each
                           change (agent/probes.py, on a thread of its own)
    coordinator -> agent   release               drained: stop every process, exit 0
    coordinator -> agent   finish {failed} | fenced {error}

**Lease and self-fencing.** The agent renews its lease every TTL/5. If no
renewal has been acknowledged for FENCE_AT x TTL (3/4), measured from when the
last acknowledged renewal was *sent* (the coordinator measures the full TTL
from when it *received* it), the agent SIGKILLs every process of the node,
waits until they are gone, records that in ``<job_dir>/fenced-node-<node>.json``
and exits. The quarter TTL of margin covers killing and reaping the processes,
so a node cut off from the coordinator has stopped playing its ranks before
anyone else is given them. Node 0's
agent (``in_process``: a thread of the coordinator's process) holds no lease.

**Devices.** The agent holds the node's :class:`~nonstop.devices.inventory.DeviceInventory`:
every process it spawns (rank or spare) takes a free device and keeps it until its exit is
seen (:mod:`nonstop.devices.inventory`: ``LOCAL_RANK`` = that device's index, set in the child's
environment over whatever the spawn message said). ``hello`` tells the coordinator how many
devices the node has (``devices`` null: a CPU node, no limit) so it places processes only where
one is free; a spawn that finds none anyway is refused as above. On a CUDA node the workers'
environment also gets nonstop's NCCL settings (:mod:`nonstop.devices.nccl`).

**Threads.** The agent's own loop (the caller of :meth:`NodeAgent.run`) renews the
lease, polls the processes and carries out the process commands; a reader thread
feeds it the coordinator's messages. The commands that move snapshot bytes
(inventory, replicate, install_durable, forget, committed, fetch, persist) go to
:class:`~nonstop.agent.data_path.NodeWork`, on threads of its own.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nonstop.agent import silence
from nonstop.agent.data_path import NodeWork
from nonstop.agent.gc import hold_lock, release_lock
from nonstop.agent.lease import FENCE_AT, NodeLease, fence_node
from nonstop.agent.memory import NodeMemory, pins_slots
from nonstop.agent.notice import NoticePoller
from nonstop.agent.probe_thread import ProbeThread, node_probes
from nonstop.agent.processes import Agent, remove_segments
from nonstop.agent.spawn import EXIT_NO_DEVICE as EXIT_NO_DEVICE
from nonstop.agent.spawn import TICK_S, DeviceSpawner
from nonstop.config import ENV, ProbeConfig
from nonstop.control.channel import Channel, Message, connect
from nonstop.devices.inventory import DeviceInventory, Devices
from nonstop.devices.nccl import nccl_env
from nonstop.errors import ControlError, NonstopError, SnapshotMissingError
from nonstop.faults import preempt_notice_path
from nonstop.protocol.agent import (
    DATA_COMMANDS,
    AgentHelloMsg,
    ExitMsg,
    FatalMsg,
    FencedMsg,
    KillMsg,
    LeaseMsg,
    LeaseOkMsg,
    NodeFinishMsg,
    NodeRefusedMsg,
    NodeWelcomeMsg,
    PreemptMsg,
    ReleaseMsg,
    SpawnMsg,
    decode_command,
    decode_welcome,
)
from nonstop.protocol.base import kind_of
from nonstop.protocol.torchrun import without_rank_vars
from nonstop.replica.dataplane import DataPlane, shm_stores
from nonstop.replica.peer import (
    REPLICA_SLOTS,
    Replicator,
    local_store_id,
    replica_store_id,
)
from nonstop.snapshot.store import RankSnapshotStore

__all__ = ["EXIT_FENCED", "NodeAgent", "NodeSpec"]

log = logging.getLogger(__name__)

EXIT_FENCED = 3
NOTICE_POLL_S = 0.1  # how often the preemption notice file is looked for
RECONNECT_EVERY_S = 0.2  # store mode: how often a node retries a lost coordinator


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """What a node brings to the job."""

    node: str
    nproc: int
    spares: int
    domain: str
    data_host: str = "127.0.0.1"
    replica_bandwidth_mb_s: float | None = None
    devices: Devices = field(default_factory=Devices)  # its accelerators (devices/inventory.py); default: CPU
    # issue 21: its health probes (agent/probes.py); default: none (the launcher passes the job's)
    probes: ProbeConfig = field(default_factory=lambda: ProbeConfig(period_s=0.0))


def _not_set_up(rank: int) -> RankSnapshotStore:
    raise SnapshotMissingError(f"rank {rank}: this node has not joined the job yet (no snapshot memory)")


class NodeAgent(DeviceSpawner):
    """Runs one node of a job until the job ends or the node is fenced."""

    def __init__(
        self,
        *,
        spec: NodeSpec,
        coordinator: tuple[str, int],
        secret: bytes,
        secret_file: Path,
        command: list[str],
        env: dict[str, str],
        job_dir: Path,
        shm_dir: Path,
        redirect_output: bool,
        in_process: bool = False,
    ) -> None:
        # in_process: node 0's agent, a thread of the coordinator's own process. It cannot be cut
        # off from the coordinator (they live and die together), so it holds no lease.
        self.in_process = in_process
        self.spec = spec
        self.coordinator = coordinator
        self.secret = secret
        self.secret_file = secret_file
        self.command = command
        self.base_env = env
        self.job_dir = job_dir
        self.shm_dir = shm_dir
        self.redirect_output = redirect_output
        self.fenced: str | None = None
        self._inbox: queue.Queue[Message | None] = queue.Queue()
        self._data_work: NodeWork | None = None  # the data path (agent/data_path.py), once welcomed
        # its snapshot memory, once welcomed: until then its data plane (already listening) refuses
        self._local: Callable[[int], RankSnapshotStore] = _not_set_up
        self._replica: Callable[[int], RankSnapshotStore] = _not_set_up
        self.agent: Agent | None = None
        self.data: DataPlane | None = None
        self._chan: Channel | None = None
        self.job_id = ""
        self._lock: tuple[int, Path] | None = None
        # set by the owner when the node may free its memory (node 0: after the final persist)
        self.release = threading.Event()
        self.release.set()
        # store mode (--store etcd://): this node's lease lives in the store, and a lost
        # coordinator is waited for (it restarts) rather than a reason to fence
        self._lease: NodeLease | None = None
        self.reconnect_s = 0.0
        self._outbox: list[Message] = []  # exit reports while the coordinator is away
        # preemption: SIGTERM (set by the owner, grace ``preempt_grace_s``) or the notice file
        self.preempt_signal = threading.Event()
        self.preempt_grace_s = 30.0
        self._preempt_deadline: float | None = None
        self._next_notice_check = 0.0
        self.notice: NoticePoller | None = None  # --preempt-url: set by the owner before run()
        self.memory: NodeMemory | None = None  # its memory tier's plan and watch, once welcomed
        self.devices = DeviceInventory(spec.devices)  # which process holds each device (loop only)
        self._killed: set[int] = set()  # spawn ids SIGKILLed on command, not reaped yet
        self._probes: ProbeThread | None = None  # issue 21: its health probes, once welcomed

    # -- lifecycle --------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> int:
        """Serve the job; return 0 when it finished, EXIT_FENCED when this node was cut off."""
        mb = self.spec.replica_bandwidth_mb_s
        self.data = DataPlane(
            host=self.spec.data_host,
            port=0,
            secret=self.secret,
            local=lambda r: self._local(r),
            replica=lambda r: self._replica(r),
            on_refused=lambda peer, why: log.warning("data plane refused %s: %s", peer, why),
            bandwidth_bytes_s=mb * 1e6 if mb else None,
        )
        try:
            self._chan = connect(self.coordinator, self.secret, self._hello())
            welcome = decode_welcome(self._chan.recv())
            if isinstance(welcome, NodeRefusedMsg):
                raise NonstopError(f"coordinator refused node {self.spec.node}: {welcome.error}")
            self._setup(welcome)
            threading.Thread(target=self._reader, name="nonstop-agent-reader", daemon=True).start()
            assert self._data_work is not None
            self._data_work.start()
            if self.notice is not None:
                self.notice.start()
            self._start_probes()
            return self._loop(stop, welcome.lease_ttl_s)
        finally:
            if self.agent is not None:
                self.agent.wait_all(0.5)
            self.release.wait(timeout=600.0)
            self._shutdown()

    def _hello(self, *, resume: bool = False) -> Message:
        assert self.data is not None
        return AgentHelloMsg(
            node=self.spec.node,
            nproc=self.spec.nproc,
            spares=self.spec.spares,
            domain=self.spec.domain,
            data_addr=self.data.addr,
            pid=os.getpid(),
            in_process=self.in_process,
            devices=self.spec.devices.count,
            device_type=self.spec.devices.type,
            resume=resume,
            lease_id=(self._lease.lease_id if self._lease is not None else 0) if resume else None,
        ).encode()

    def _setup(self, welcome: NodeWelcomeMsg) -> None:
        self.job_id = welcome.job_id
        if welcome.store:
            self._register(welcome.store, welcome.lease_ttl_s)
            self.reconnect_s = welcome.reconnect_s
        self._lock = hold_lock(self.shm_dir, local_store_id(self.job_id, self.spec.node), self.job_dir)
        self.num_slots = welcome.num_slots
        self.memory = NodeMemory.open(
            node=self.spec.node, job_id=self.job_id, job_dir=self.job_dir, shm_dir=self.shm_dir,
            nproc=self.spec.nproc, num_slots=self.num_slots, replicas=welcome.replicas,
            pinned=pins_slots(self.spec.devices),  # issue 20: its ranks page-lock slots: RLIMIT_MEMLOCK
            copy_groups=_copy_groups(welcome.env),
        )  # fmt: skip
        env = without_rank_vars(self.base_env)  # a spare has no RANK, a rank only the coordinator's
        env.update(welcome.env)
        env.update(
            {
                ENV.JOB_ID: local_store_id(self.job_id, self.spec.node),
                ENV.JOB_DIR: str(self.job_dir),
                ENV.CONTROL: f"{self.coordinator[0]}:{self.coordinator[1]}",
                # torchrun's: the process group's rendezvous goes through the coordinator
                # (coordinator/torch_env.py); no TCPStore listens there
                "MASTER_ADDR": str(self.coordinator[0]),
                "MASTER_PORT": str(self.coordinator[1]),
                ENV.SECRET_FILE: str(self.secret_file),
                ENV.SHM_DIR: str(self.shm_dir),
                ENV.NODE: self.spec.node,
                ENV.AGENT_PID: str(os.getpid()),
                ENV.SLOTS: str(self.num_slots),
            }
        )
        env.update(nccl_env(self.spec.devices.type, env))  # never over a value the user set
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, self.spec.nproc))))
        self.agent = Agent(
            job_id=local_store_id(self.job_id, self.spec.node),
            job_dir=self.job_dir,
            shm_dir=self.shm_dir,
            command=self.command,
            env=env,
            redirect_output=self.redirect_output,
            num_slots=self.num_slots,
        )
        self._local = shm_stores(self.shm_dir, local_store_id(self.job_id, self.spec.node), self.num_slots)
        self._replica = shm_stores(self.shm_dir, replica_store_id(self.job_id, self.spec.node), REPLICA_SLOTS)
        mb = self.spec.replica_bandwidth_mb_s
        self.replicator = Replicator(
            node=self.spec.node,
            secret=self.secret,
            local=self._local,
            bandwidth_bytes_s=mb * 1e6 if mb else None,
        )
        assert self.data is not None
        self._data_work = NodeWork(
            node=self.spec.node,
            job_id=self.job_id,
            shm_dir=self.shm_dir,
            secret=self.secret,
            agent=self.agent,
            data=self.data,
            local=self._local,
            replica=self._replica,
            replicator=self.replicator,
            send=self._send,
        )

    def _start_probes(self) -> None:
        """Issue 21: run the node's health probes on a thread of their own (agent/probes.py);
        each verdict change goes to the coordinator as ``health {verdict, probe, detail}``. The
        health command sees the job's environment and NONSTOP_NODE / NONSTOP_JOB_DIR."""
        cfg = self.spec.probes
        if not cfg.enabled:
            return
        env = {**self.base_env, ENV.NODE: self.spec.node, ENV.JOB_DIR: str(self.job_dir)}
        self._probes = ProbeThread(lambda: node_probes(cfg, env=env), period_s=cfg.period_s, send=self._send)
        self._probes.start()

    def _check_space(self) -> None:
        """A store of this node found its memory tier too small (agent/memory.py): tell the
        coordinator, which fails the job with that line (the launcher exits 2 with it)."""
        assert self.memory is not None
        error = self.memory.poll()
        if error is not None:
            log.info("%s", error)  # the node's nonstop run exits 2 with the line (launch/launcher.py)
            self._send(FatalMsg(error=error).encode())

    def _reader(self) -> None:
        assert self._chan is not None
        try:
            while True:
                self._inbox.put(self._chan.recv())
        except (ControlError, OSError, ValueError):
            self._inbox.put(None)

    def _register(self, url: str, ttl: float) -> None:
        """Store mode: hold this node's liveness key with its own lease (agent/lease.py)."""
        assert self.data is not None
        self._lease = NodeLease.open(
            url, secret=self.secret, job_id=self.job_id, node=self.spec.node, data_addr=self.data.addr,
            ttl=ttl, send=self._send,
        )  # fmt: skip

    def _send(self, msg: Message) -> None:
        chan = self._chan
        if chan is not None and not chan.closed:
            try:
                chan.send(msg)
                return
            except ControlError:
                pass
        if self._lease is not None and kind_of(msg) == ExitMsg.T:
            self._outbox.append(msg)  # the restarted coordinator must learn of it

    def _reconnect(self) -> bool:
        """Store mode: try once to reach the (restarted) coordinator; True when back."""
        try:
            chan = connect(self.coordinator, self.secret, self._hello(resume=True), timeout=1.0)
            welcome = decode_welcome(chan.recv())
        except (ControlError, OSError, ValueError):
            return False
        if isinstance(welcome, NodeRefusedMsg):
            chan.close()
            raise NonstopError(f"the coordinator refused node {self.spec.node}: {welcome.error}")
        self._chan = chan
        threading.Thread(target=self._reader, name="nonstop-agent-reader", daemon=True).start()
        pending, self._outbox = self._outbox, []
        for msg in pending:
            self._send(msg)
        if self._probes is not None:
            self._probes.forget()  # a restarted coordinator knows no verdict: send the next one
        log.info("node %s reconnected to the coordinator", self.spec.node)
        return True

    def _loop(self, stop: threading.Event, ttl: float) -> int:
        assert self.agent is not None
        renew_every = ttl / 5
        seq = 0
        sent_at: dict[int, float] = {}
        acked_sent_at = time.monotonic()
        next_renew = 0.0
        away_since: float | None = None  # store mode: when the coordinator connection dropped
        next_try = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if away_since is not None and now >= next_try:
                next_try = now + RECONNECT_EVERY_S
                if self._reconnect():
                    away_since = None
                elif now - away_since > self.reconnect_s:
                    return self._fence(f"no coordinator for {now - away_since:.1f}s (--reconnect)")
            if now >= next_renew and away_since is None:
                seq += 1
                sent_at[seq] = now
                self._send(LeaseMsg(seq=seq).encode())
                next_renew = now + renew_every
            self._report_exits()
            # Read what arrived before judging the lease: after a stall of this process the
            # acknowledgements are already queued.
            try:
                msg: Message | None = self._inbox.get(timeout=TICK_S)
            except queue.Empty:
                msg = None
                empty = True
            else:
                empty = False
            while not empty:
                if msg is None and self._lease is not None:
                    # Store mode: the coordinator may be restarting. This node's right to play
                    # its ranks is its lease in the store, checked below, not this connection.
                    log.warning("node %s: lost the coordinator; reconnecting", self.spec.node)
                    away_since = away_since or time.monotonic()
                elif msg is None:
                    return self._fence("lost the connection to the coordinator")
                elif kind_of(msg) == LeaseOkMsg.T:
                    acked = LeaseOkMsg.decode(msg).seq
                    assert acked is not None  # (the decode requires a number)
                    acked_sent_at = max(acked_sent_at, sent_at.pop(acked, acked_sent_at))
                    for old in [k for k in sent_at if k < acked]:
                        del sent_at[old]
                else:
                    code = self._on_command(msg)
                    if code is not None:
                        return code
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
            now = time.monotonic()
            self._check_space()
            if not self.in_process:
                if self._preempt_deadline is None:
                    self._check_preemption(now)
                elif now > self._preempt_deadline:
                    return self._fence("preempted: the grace period ran out before the node was drained")
            if self._lease is not None:
                why = self._lease.judge(now, now - acked_sent_at, ttl)
                if why is not None:
                    return self._fence(why)
            elif now - acked_sent_at > FENCE_AT * ttl and not self.in_process:
                return self._fence(f"no lease renewal acknowledged for {now - acked_sent_at:.2f}s")
        return 0

    def _check_preemption(self, now: float) -> None:
        """A preemption notice (SIGTERM, or the notice file with the grace in seconds): tell the
        coordinator, which drains this node; the processes stay until the grace runs out."""
        grace: float | None = None
        if self.preempt_signal.is_set():
            grace = self.preempt_grace_s
        elif self.notice is not None and self.notice.noticed.is_set():
            grace = self.notice.grace_s
        elif now >= self._next_notice_check:
            self._next_notice_check = now + NOTICE_POLL_S
            notice = preempt_notice_path(self.job_dir, self.spec.node)
            if notice.exists():
                try:
                    grace = float(notice.read_text().strip() or self.preempt_grace_s)
                except (OSError, ValueError):
                    grace = self.preempt_grace_s
        if grace is None:
            return
        self._preempt_deadline = now + grace
        log.warning("node %s: preemption notice, %.1fs of grace; draining", self.spec.node, grace)
        self._send(PreemptMsg(grace_s=grace).encode())

    def _on_command(self, msg: Message) -> int | None:
        """Carry out one coordinator command; an exit code when the agent is to stop."""
        assert self.agent is not None
        if kind_of(msg) in DATA_COMMANDS:  # the data path, on threads of its own (decoded there)
            assert self._data_work is not None
            self._data_work.submit(msg)
            return None
        cmd = decode_command(msg)
        if isinstance(cmd, ReleaseMsg):  # drained (preemption): nothing of the job runs here any more
            for sid in list(self.agent.procs):
                self.agent.kill(sid, signal.SIGKILL)
            self.agent.wait_all(5.0)
            return 0
        if isinstance(cmd, SpawnMsg):
            self._spawn(cmd)
        elif isinstance(cmd, KillMsg):
            sid = cmd.spawn_id
            if cmd.unless_moving:  # silent: killed only if stuck (agent/silence.py)
                kill = functools.partial(self._kill, sig=signal.SIGKILL)
                silence.kill_unless_moving(sid, self.agent.pid(sid), send=self._send, kill=kill)
            else:
                self._kill(sid, cmd.sig)
        elif isinstance(cmd, NodeFinishMsg):
            self.agent.wait_all(10.0)
            return 1 if cmd.failed else 0
        elif isinstance(cmd, FencedMsg):
            return self._fence(cmd.error)
        return None

    def _kill(self, sid: int, sig: int) -> None:
        assert self.agent is not None
        self.agent.kill(sid, sig)
        if sig == signal.SIGKILL and sid in self.agent.procs:
            self._killed.add(sid)  # certain to exit: a spawn may wait for its device

    def _fence(self, why: str) -> int:
        """Stop playing any rank (:func:`~nonstop.agent.lease.fence_node`)."""
        self.fenced = why
        fence_node(self.agent, node=self.spec.node, job_dir=self.job_dir, why=why)
        return EXIT_FENCED

    def _shutdown(self) -> None:
        if self.notice is not None:
            self.notice.stop()
        if self._probes is not None:
            self._probes.stop()
        if self._data_work is not None:
            self._data_work.stop()
        if self._lease is not None:  # a finished node ends its lease at once; a fenced one lost it
            self._lease.close(revoke=self.fenced is None)
        if self.agent is not None:
            self.agent.shutdown()
        if self.data is not None:
            self.data.close()
        if getattr(self, "replicator", None) is not None:
            self.replicator.close()
        if self._chan is not None:
            self._chan.close()
        if self.job_id:
            remove_segments(self.shm_dir, local_store_id(self.job_id, self.spec.node))
            remove_segments(self.shm_dir, replica_store_id(self.job_id, self.spec.node))
        if self._lock is not None:
            release_lock(*self._lock)  # the file goes while still held: gc never sees it orphaned


def _copy_groups(env: Mapping[str, str]) -> int:
    """The node copies' groups the coordinator's worker env names (config.node_copy_groups; at
    least 1: the plan counts them only when the ranks keep node copies)."""
    try:
        return max(1, int(env.get(ENV.NODE_COPY, "1")))
    except (TypeError, ValueError):
        return 1
