"""A job's Prometheus metrics and the status snapshot the metrics server reads
(``nonstop run --metrics-port``; served by :mod:`nonstop.coordinator.status_server`).

Where each metric comes from:

* the **event stream**: :class:`JobMetrics` subscribes to the job's
  :class:`~nonstop.events.log.EventLog` and turns failures, recoveries (MTTR, each stage),
  generations, replication rounds, persists, migrations, resizes and lost nodes into counters
  and histograms (:meth:`JobMetrics.on_event`);
* **step reports**: the coordinator hands each rank's step report to :meth:`JobMonitor.on_step`
  (step time and snapshot stall histograms, the steps counter);
* the **view**, read at scrape time: a :class:`StatusBoard` holds the last ``nonstop status``
  dict the coordinator's thread published (committed step, ranks' steps, nodes alive, spares
  ready, the tiers' steps), and a collector turns it into gauges.

Names follow Prometheus' conventions: ``nonstop_`` prefix, base units in the name (``_seconds``,
``_bytes``), counters end ``_total``. Every job has a registry of its own (never the process's
default one: a process may run several jobs, tests do).

Threading: :meth:`JobMetrics.on_event` runs on whichever thread logs the event (prometheus-client's
metrics are thread-safe); :meth:`JobMonitor.on_step` and :meth:`JobMonitor.tick` on the
coordinator's thread only; :meth:`JobMonitor.status` on the server's threads: it asks the
coordinator for a fresh snapshot and waits for it a bounded time, and never touches the view.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nonstop import events as ev
from nonstop.protocol.client import StatusMsg

log = logging.getLogger(__name__)

__all__ = ["JobMetrics", "JobMonitor", "StatusBoard"]

# seconds: a recovery's stages are ms..s, MTTR s..minutes; steps and stalls ms..s
_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_IO_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class JobMetrics:
    """The event-driven counters and histograms of one job, in :attr:`registry` (with the view's
    gauges once :meth:`add_view` is given a snapshot source)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.steps = Counter(
            "nonstop_steps", "Optimizer steps rank 0 completed (a redone step counts again)", registry=r
        )
        self.step_seconds = Histogram(
            "nonstop_step_seconds",
            "A rank's step (forward, backward, optimizer)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.stall_seconds = Histogram(
            "nonstop_snapshot_stall_seconds",
            "Time a rank's training loop waited on its per-step snapshot",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.failures = Counter("nonstop_failures", "Failures detected, by kind", ["kind"], registry=r)
        self.recoveries = Counter("nonstop_recoveries", "Failures recovered, by kind", ["kind"], registry=r)
        self.mttr = Histogram(
            "nonstop_mttr_seconds", "Failure to every rank training again", buckets=_STAGE_BUCKETS, registry=r
        )
        self.detect = Histogram(
            "nonstop_failure_detect_seconds", "Failure to its detection", buckets=_STAGE_BUCKETS, registry=r
        )
        self.stage = Histogram(
            "nonstop_recovery_stage_seconds",
            "Each stage of a recovery (detect, plan, restore, rebuild, ...)",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.lost_steps = Counter("nonstop_lost_steps", "Steps redone after recoveries", registry=r)
        self.generations = Counter(
            "nonstop_generations", "Memberships decided (generations begun)", registry=r
        )
        self.nodes_lost = Counter(
            "nonstop_nodes_lost", "Nodes lost (lease expired, fenced, quarantined)", registry=r
        )
        self.repl_rounds = Counter(
            "nonstop_replication_rounds", "Replication rounds to peers' memory", registry=r
        )
        self.repl_failures = Counter(
            "nonstop_replication_failures", "Replication rounds that failed", registry=r
        )
        self.repl_bytes = Counter(
            "nonstop_replicated_bytes",
            "Bytes replicated: raw (snapshot) and wire (sent)",
            ["encoding"],
            registry=r,
        )
        self.repl_seconds = Histogram(
            "nonstop_replication_seconds", "A replication round", buckets=_IO_BUCKETS, registry=r
        )
        self.persists = Counter("nonstop_persists", "Steps made durable", registry=r)
        self.persist_failures = Counter("nonstop_persist_failures", "Persists that failed", registry=r)
        self.persist_bytes = Counter(
            "nonstop_persisted_bytes", "Bytes persisted: raw (snapshot) and stored", ["encoding"], registry=r
        )
        self.persist_seconds = Histogram(
            "nonstop_persist_seconds", "A persist of one step", buckets=_IO_BUCKETS, registry=r
        )
        self.migrations = Counter(
            "nonstop_migrations",
            "Live migrations, by outcome (done, aborted, refused)",
            ["outcome"],
            registry=r,
        )
        self.resizes = Counter("nonstop_resizes", "Elastic resizes, by direction", ["direction"], registry=r)
        self.durable_restores = Counter(
            "nonstop_durable_restores", "Restores from the durable tier", registry=r
        )
        self.refused = Counter(
            "nonstop_refused_connections", "Control connections refused (authentication, limits)", registry=r
        )

    def on_event(self, e: ev.Event) -> None:
        """Count one event of the job's log (an :meth:`EventLog.subscribe` subscriber)."""
        if isinstance(e, ev.Failure):
            self.failures.labels(kind=e.failure_kind).inc()
        elif isinstance(e, ev.Recovery):
            self.recoveries.labels(kind=e.failure_kind).inc()
            if e.mttr_s is not None:
                self.mttr.observe(e.mttr_s)
            if e.detect_s is not None:
                self.detect.observe(e.detect_s)
            for stage, seconds in e.stages.items():
                self.stage.labels(stage=stage).observe(seconds)
            if e.lost_steps:
                self.lost_steps.inc(e.lost_steps)
        elif isinstance(e, ev.NewGeneration):
            self.generations.inc()
        elif isinstance(e, ev.NodeLost):
            self.nodes_lost.inc()
        elif isinstance(e, ev.Replicated):
            self.repl_rounds.inc()
            self.repl_bytes.labels(encoding="raw").inc(e.raw_bytes or 0)
            self.repl_bytes.labels(encoding="wire").inc(e.wire_bytes or 0)
            if e.seconds is not None:
                self.repl_seconds.observe(e.seconds)
        elif isinstance(e, ev.ReplicationFailed):
            self.repl_failures.inc()
        elif isinstance(e, ev.Persist):
            self.persists.inc()
            self.persist_bytes.labels(encoding="raw").inc(e.raw_bytes or 0)
            self.persist_bytes.labels(encoding="stored").inc(e.stored_bytes or 0)
            if e.seconds is not None:
                self.persist_seconds.observe(e.seconds)
        elif isinstance(e, ev.PersistFailed):
            self.persist_failures.inc()
        elif isinstance(e, ev.MigrationDone):
            self.migrations.labels(outcome="done").inc()
        elif isinstance(e, ev.MigrationAborted):
            self.migrations.labels(outcome="aborted").inc()
        elif isinstance(e, ev.MigrationRefused):
            self.migrations.labels(outcome="refused").inc()
        elif isinstance(e, ev.Shrink):
            self.resizes.labels(direction="shrink").inc()
        elif isinstance(e, ev.GrowDone):
            self.resizes.labels(direction="grow").inc()
        elif isinstance(e, ev.RestoreFromDurable):
            self.durable_restores.inc()
        elif isinstance(e, ev.Refused):
            self.refused.inc()

    def on_step(self, rank: int, step_s: float, snap_s: float) -> None:
        """One step report of ``rank``."""
        if rank == 0:
            self.steps.inc()
        self.step_seconds.observe(step_s)
        self.stall_seconds.observe(snap_s)

    def add_view(self, snapshot: Callable[[], Mapping[str, Any] | None]) -> None:
        """Gauges read at scrape time from ``snapshot()`` (a status dict, see :func:`view_gauges`)."""
        self.registry.register(_ViewCollector(snapshot))

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, value: float | None, labels: Mapping[str, str] | None = None) -> Metric:
    g = GaugeMetricFamily(name, doc, labels=list(labels) if labels else None)
    if value is not None:
        if labels:
            g.add_metric(list(labels.values()), value)
        else:
            g.add_metric([], value)
    return g


def view_gauges(st: Mapping[str, Any]) -> Iterator[Metric]:
    """The gauges of one status snapshot (``nonstop status --json`` plus ``step_s``/``snap_s``/
    ``snap_bytes``: rank -> its last report, added by :class:`JobMonitor`)."""
    ranks: Mapping[str, Mapping[str, Any]] = st.get("ranks") or {}
    nodes: Mapping[str, Mapping[str, Any]] = st.get("nodes") or {}
    yield _gauge(
        "nonstop_committed_step", "The committed step: every rank can restore it", st.get("committed_step")
    )
    yield _gauge("nonstop_generation", "The current generation (membership)", st.get("generation"))
    yield _gauge("nonstop_world_size", "Ranks of the current generation", st.get("world_size"))
    yield _gauge(
        "nonstop_replicated_step", "Newest step replicated to peers' memory", st.get("replicated_step")
    )
    yield _gauge("nonstop_durable_step", "Newest step in the durable tier", st.get("durable_step"))
    steps = [int(r["step"]) for r in ranks.values() if r.get("step") is not None]
    lag = None
    if steps and st.get("replicated_step") is not None:
        lag = max(0, min(steps) - int(st["replicated_step"]))
    yield _gauge("nonstop_replication_lag_steps", "Steps every rank has taken beyond the replicated one", lag)
    yield _gauge(
        "nonstop_nodes_alive",
        "Nodes alive and not quarantined",
        sum(1 for n in nodes.values() if n.get("alive") and not n.get("quarantined")),
    )
    yield _gauge(
        "nonstop_spares_ready",
        "Hot spares connected and waiting for a rank",
        sum(int(n.get("idle_spares") or 0) for n in nodes.values()),
    )
    per_rank: list[tuple[str, str, Mapping[str, Any]]] = [
        (
            "nonstop_rank_last_step",
            "Newest step a rank reported",
            {r: v.get("step") for r, v in ranks.items()},
        ),
        ("nonstop_rank_step_seconds", "A rank's last step time", st.get("step_s") or {}),
        ("nonstop_rank_snapshot_stall_seconds", "A rank's last snapshot stall", st.get("snap_s") or {}),
        ("nonstop_rank_snapshot_bytes", "A rank's last snapshot size", st.get("snap_bytes") or {}),
    ]
    for name, doc, values in per_rank:
        g = GaugeMetricFamily(name, doc, labels=["rank"])
        for rank in ranks:  # the current generation's ranks only
            value = values.get(rank)
            if value is not None:
                g.add_metric([rank], float(value))
        yield g


class _ViewCollector(Collector):
    def __init__(self, snapshot: Callable[[], Mapping[str, Any] | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        st = self._snapshot()
        if st is not None:
            yield from view_gauges(st)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked: the families depend on the snapshot


class StatusBoard:
    """The handoff of status snapshots from the coordinator's thread to the server's threads.

    A reader asks (:meth:`get`): if the last snapshot is younger than ``max_age_s`` it gets it at
    once; else it raises a flag, which the coordinator's loop sees on its next tick and answers
    with :meth:`publish`, and waits for that at most ``wait_s`` (a busy coordinator: the stale one,
    or None before the first). So readers cost the coordinator at most one status per ``max_age_s``
    however many there are, and never hold it."""

    def __init__(self, *, max_age_s: float = 0.25) -> None:
        self.max_age_s = max_age_s
        self._cond = threading.Condition()
        self._wanted = threading.Event()
        self._status: dict[str, Any] | None = None
        self._at = 0.0  # monotonic time of the last published status
        self._answered = 0.0  # ... and of the coordinator's last answer (with a status or none)

    @property
    def wanted(self) -> bool:
        return self._wanted.is_set()

    def publish(self, status: dict[str, Any] | None) -> None:
        """Coordinator's thread: the newest status (the board keeps it; do not mutate it after),
        or None: none now, the waiting readers get the previous one."""
        with self._cond:
            if status is not None:
                self._status, self._at = status, time.monotonic()
            self._answered = time.monotonic()
            self._wanted.clear()
            self._cond.notify_all()

    def get(self, *, wait_s: float = 0.5) -> dict[str, Any] | None:
        """Server's threads: a recent snapshot (see the class docstring). The caller may not mutate it."""
        with self._cond:
            if self._status is not None and time.monotonic() - self._at < self.max_age_s:
                return self._status
            asked = time.monotonic()
            self._wanted.set()
            self._cond.wait_for(lambda: self._answered >= asked, timeout=wait_s)
            return self._status


class JobMonitor:
    """The coordinator's hook for metrics (``Coordinator.monitor``): step reports in, status
    snapshots out. ``status``: the coordinator's ``status()`` (called on its thread only)."""

    def __init__(self, status: Callable[[], dict[str, Any]], metrics: JobMetrics | None = None) -> None:
        self._status = status
        self.metrics = metrics or JobMetrics()
        self.board = StatusBoard()
        self.metrics.add_view(self.snapshot)
        # the last report of each rank (coordinator's thread), copied into each snapshot
        self._step_s: dict[int, float] = {}
        self._snap_s: dict[int, float] = {}
        self._snap_bytes: dict[int, int] = {}

    def on_step(self, rank: int, step_s: float, snap_s: float, nbytes: int) -> None:
        """Coordinator's thread: a member's step report."""
        self._step_s[rank], self._snap_s[rank], self._snap_bytes[rank] = step_s, snap_s, nbytes
        self.metrics.on_step(rank, step_s, snap_s)

    def tick(self) -> None:
        """Coordinator's thread, every loop: publish a snapshot if a reader waits for one. A
        status that cannot be built now (a view between two consistent states) is skipped: the
        readers get the previous one; the coordinator never fails for a scrape."""
        if not self.board.wanted:
            return
        try:
            st = self.build()
        except Exception:  # a scrape must never end the job
            log.debug("no status snapshot this tick", exc_info=True)
            self.board.publish(None)
            return
        self.board.publish(st)

    def build(self) -> dict[str, Any]:
        st = copy.deepcopy(self._status())  # the board's copy: nothing the coordinator holds
        st["step_s"] = {str(r): s for r, s in self._step_s.items()}
        st["snap_s"] = {str(r): s for r, s in self._snap_s.items()}
        st["snap_bytes"] = {str(r): b for r, b in self._snap_bytes.items()}
        return st

    def snapshot(self) -> dict[str, Any] | None:
        """Server's threads: the latest snapshot, refreshed if stale (:meth:`StatusBoard.get`)."""
        return self.board.get()

    def status(self) -> dict[str, Any] | None:
        """Server's threads: exactly what ``nonstop status --json`` shows (the snapshot without
        the per-rank step figures the metrics add)."""
        st = self.snapshot()
        if st is None:
            return None
        return StatusMsg(
            status={k: v for k, v in st.items() if k not in ("step_s", "snap_s", "snap_bytes")}
        ).encode()
