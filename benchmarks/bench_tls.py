"""The cost of ``--tls``: data-plane replication and fetch throughput, and control-channel
round-trips, with and without TLS, side by side in one run.

What is measured
----------------
Two data planes in this process on loopback (``nonstop.replica.peer``: a ``Replicator`` on node a,
a ``DataPlane`` holding replicas on node b), with real shared-memory snapshot stores:

* ``replicate_mbps``: a rank's snapshot of ``--mb`` MB (random float32: it barely compresses, so
  the wire carries about the raw size) replicated whole to node b (``Replicator.replicate`` after
  ``forget``: never a delta), raw MB / wall second, encode and decode included;
* ``fetch_mbps``: that step fetched back from node b's replica (``fetch_snapshot``), raw MB / s;
* ``rtt_us``: a control channel's round-trip, a small JSON message echoed by a listener thread,
  microseconds (median of ``--rtts`` round-trips per repetition);
* ``connect_ms``: opening a channel (TCP, TLS, HMAC handshake), milliseconds.

Both modes share the process, the data and the machine; they alternate within each repetition
(plain, then TLS) so background load hits both alike. Figures are medians of ``--reps``
repetitions, after one untimed warm-up per mode. TLS here is TLS 1.3 (OpenSSL's default
suite, AES-256-GCM with AES-NI where the CPU has it) on top of the frame MACs, which stay.

How to run
----------
::

    .venv/bin/python benchmarks/bench_tls.py            # 64 MB, 5 repetitions, ~1 min
    .venv/bin/python benchmarks/bench_tls.py --quick    # 4 MB, 2 repetitions, seconds

Results go to ``benchmarks/results/tls.json`` (``tls-quick.json`` with ``--quick``; ``--out``
overrides); a table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nonstop.config import ENV  # noqa: E402
from nonstop.control.channel import connect, new_secret  # noqa: E402
from nonstop.control.listener import ControlServer  # noqa: E402
from nonstop.replica.dataplane import DataPlane, shm_stores  # noqa: E402
from nonstop.replica.peer import Replicator, fetch_snapshot  # noqa: E402
from nonstop.snapshot import RankSnapshotStore  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MODES = ("plain", "tls")


def _set_mode(mode: str) -> None:
    os.environ[ENV.TLS] = "1" if mode == "tls" else "0"  # listeners and clients made from now on


def _data_plane(mode: str, shm: Path, job: str, secret: bytes, step: int) -> tuple[float, float]:
    """(replicate MB/s, fetch MB/s) of one repetition in ``mode``."""
    _set_mode(mode)
    holder = DataPlane(
        host="127.0.0.1",
        port=0,
        secret=secret,
        local=shm_stores(shm, f"{job}.b.{mode}", 2),
        replica=shm_stores(shm, f"{job}.b.{mode}.rep", 2),
    )
    rep = Replicator(node="a", secret=secret, local=shm_stores(shm, f"{job}.a", 2))
    try:
        raw = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.a", rank=0)
        nbytes = raw.copy_out(step).data.nbytes
        raw.close()
        rep.forget(0)
        t0 = time.perf_counter()
        rep.replicate(0, step, [holder.addr])
        t_rep = time.perf_counter() - t0
        t0 = time.perf_counter()
        _meta, data = fetch_snapshot(holder.addr, secret, node="c", rank=0, step=step, kind="replica")
        t_fetch = time.perf_counter() - t0
        assert len(data) == nbytes, (len(data), nbytes)
        return nbytes / 1e6 / t_rep, nbytes / 1e6 / t_fetch
    finally:
        rep.close()
        holder.close()


def _control(mode: str, secret: bytes, rtts: int) -> tuple[float, float]:
    """(median round-trip in us, connect ms) of one repetition in ``mode``."""
    _set_mode(mode)
    srv = ControlServer(host="127.0.0.1", port=0, secret=secret)

    def echo() -> None:
        while True:
            kind, ch, msg = srv.events.get()
            if kind == "msg" and msg is not None:
                if msg.get("t") == "stop":
                    return
                ch.send({"t": "pong", "i": msg["i"]})

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    try:
        t0 = time.perf_counter()
        ch = connect(srv.address, secret, {"role": "client"}, timeout=10.0)
        connect_ms = (time.perf_counter() - t0) * 1e3
        times = []
        for i in range(rtts):
            t0 = time.perf_counter()
            ch.send({"t": "ping", "i": i, "pad": "x" * 200})
            assert ch.recv()["i"] == i
            times.append(time.perf_counter() - t0)
        ch.send({"t": "stop", "i": -1})
        ch.close()
        return statistics.median(times) * 1e6, connect_ms
    finally:
        t.join(timeout=5)
        srv.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64.0, help="snapshot size, MB (default %(default)s)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rtts", type=int, default=500, help="round-trips per repetition")
    ap.add_argument("--quick", action="store_true", help="4 MB, 2 repetitions, 100 round-trips")
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.mb, ns.reps, ns.rtts = 4.0, 2, 100
    out = ns.out or RESULTS / ("tls-quick.json" if ns.quick else "tls.json")
    secret = new_secret()
    job = uuid.uuid4().hex[:8]
    torch.manual_seed(0)
    state = {"w": torch.randn(int(ns.mb * 1e6 / 4))}
    per: dict[str, dict[str, list[float]]] = {
        m: {"replicate": [], "fetch": [], "rtt": [], "conn": []} for m in MODES
    }
    saved = os.environ.get(ENV.TLS)
    with tempfile.TemporaryDirectory(prefix="nonstop-bench-tls-", dir="/dev/shm") as tmp:
        shm = Path(tmp)
        src = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.a", rank=0)
        src.write(1, state)
        src.close()
        try:
            for mode in MODES:  # warm-up, untimed: the listener certificate, first allocations
                _data_plane(mode, shm, job, secret, 1)
                _control(mode, secret, 10)
            for _ in range(ns.reps):
                for mode in MODES:
                    r, f = _data_plane(mode, shm, job, secret, 1)
                    rtt, conn = _control(mode, secret, ns.rtts)
                    for k, v in (("replicate", r), ("fetch", f), ("rtt", rtt), ("conn", conn)):
                        per[mode][k].append(v)
        finally:
            if saved is None:
                os.environ.pop(ENV.TLS, None)
            else:
                os.environ[ENV.TLS] = saved
    med = {m: {k: statistics.median(v) for k, v in per[m].items()} for m in MODES}
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "snapshot_mb": ns.mb,
        "reps": ns.reps,
        "rtts_per_rep": ns.rtts,
        "modes": {
            m: {
                "replicate_mbps": round(med[m]["replicate"], 1),
                "fetch_mbps": round(med[m]["fetch"], 1),
                "rtt_us": round(med[m]["rtt"], 1),
                "connect_ms": round(med[m]["conn"], 2),
                "runs": {k: [round(x, 2) for x in v] for k, v in per[m].items()},
            }
            for m in MODES
        },
        "tls_over_plain": {
            "replicate_throughput": round(med["tls"]["replicate"] / med["plain"]["replicate"], 3),
            "fetch_throughput": round(med["tls"]["fetch"] / med["plain"]["fetch"], 3),
            "rtt": round(med["tls"]["rtt"] / med["plain"]["rtt"], 3),
            "connect": round(med["tls"]["conn"] / med["plain"]["conn"], 3),
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'':8} {'replicate MB/s':>15} {'fetch MB/s':>11} {'RTT us':>8} {'connect ms':>11}")
    for m in MODES:
        r = report["modes"][m]
        print(f"{m:8} {r['replicate_mbps']:>15} {r['fetch_mbps']:>11} {r['rtt_us']:>8} {r['connect_ms']:>11}")
    print(f"tls/plain: {report['tls_over_plain']}  ({ns.mb:g} MB, median of {ns.reps}; {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
