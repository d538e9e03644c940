"""Metrics scrape cost (issue 16, "Measured"): what ``--metrics-port`` scraped every second costs
the coordinator and the training, side by side with the same job unscraped.

What is measured. A data-parallel job of the demo transformer (``--model``, ``small`` by default;
gloo, CPU), ``--nproc`` ranks and one hot spare on one node, run in this process (the coordinator
and node 0's agent on their threads, the ranks as processes), alternating run by run:

* ``off``: no ``--metrics-port``;
* ``scraped``: ``--metrics-port 0``, and a separate scraper process (like Prometheus) that GETs
  ``/metrics`` and ``/status`` with the job's bearer token every ``--interval`` seconds.

Per run: ``median_step_s`` (the coordinator's median of the ranks' reported step times) and
``wall_s`` (the whole job). In ``scraped`` runs also, per scrape, the CPU time it cost the
coordinator's process, measured with ``time.thread_time()`` around the work on each thread that
does it: the server thread answering the request (``server_cpu_ms``: exposition, JSON) and the
coordinator's thread building the status snapshot it reads (``publish_cpu_ms``: at most one per
0.25 s, whatever the scrape rate); and the scraper's wall time per request (``scrape_ms``).

Summaries are median [min, max] over ``--runs`` runs of each mode (after ``--warmup`` rounds).
Results go to ``benchmarks/results/metrics.json``::

    .venv/bin/python benchmarks/bench_metrics.py            # small model, 2 ranks, 3 runs each
    .venv/bin/python benchmarks/bench_metrics.py --quick    # tiny model, 1 run each (smoke)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchcommon import fmt, machine_info, run_stamp, summarize  # noqa: E402  (a sibling script)

from nonstop.coordinator import metrics as metrics_mod  # noqa: E402
from nonstop.coordinator import status_server as statusserver  # noqa: E402
from nonstop.coordinator.loop import JobState  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.launch.launcher import run_job  # noqa: E402

MODES = ("off", "scraped")

# The scraper: a process of its own, as Prometheus is. Reads job.json for the address and the
# token file, then GETs /metrics and /status every INTERVAL s until the job's info file goes;
# prints one JSON line of per-request wall times (ms).
SCRAPER = r"""
import http.client, json, sys, time
from pathlib import Path
job_dir, interval = Path(sys.argv[1]), float(sys.argv[2])
info = {}
while "metrics" not in info:
    try:
        info = json.loads((job_dir / "job.json").read_text())
    except (FileNotFoundError, ValueError):
        time.sleep(0.02)
host, _, port = info["metrics"].rpartition(":")
token = Path(info["metrics_token_file"]).read_text().strip()
walls, codes = [], {}
while (job_dir / "job.json").exists():
    t0 = time.monotonic()
    try:
        for path in ("/metrics", "/status"):
            c = http.client.HTTPConnection(host, int(port), timeout=10)
            c.request("GET", path, headers={"Authorization": "Bearer " + token})
            r = c.getresponse(); r.read(); c.close()
            codes[r.status] = codes.get(r.status, 0) + 1
    except OSError:
        break
    walls.append((time.monotonic() - t0) * 1000 / 2)
    time.sleep(max(0.0, interval - (time.monotonic() - t0)))
print(json.dumps({"scrape_ms": walls, "codes": codes}))
"""


class CpuMeter:
    """CPU seconds of the calls wrapped on each thread (``time.thread_time``), and their count."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cpu = {"server": 0.0, "publish": 0.0}
        self.calls = {"server": 0, "publish": 0}

    def add(self, what: str, seconds: float) -> None:
        with self.lock:
            self.cpu[what] += seconds
            self.calls[what] += 1


@contextmanager
def metered(meter: CpuMeter) -> Iterator[None]:
    """Time the server's requests and the coordinator's snapshots (monkeypatched for the run)."""
    finish = statusserver.StatusServer.finish_request
    build = metrics_mod.JobMonitor.build

    def timed_finish(self: Any, request: Any, client_address: Any) -> None:
        t0 = time.thread_time()
        try:
            finish(self, request, client_address)
        finally:
            meter.add("server", time.thread_time() - t0)

    def timed_build(self: Any) -> dict[str, Any]:
        t0 = time.thread_time()
        try:
            return build(self)
        finally:
            meter.add("publish", time.thread_time() - t0)

    statusserver.StatusServer.finish_request = timed_finish  # type: ignore[method-assign]
    metrics_mod.JobMonitor.build = timed_build  # type: ignore[method-assign]
    try:
        yield
    finally:
        statusserver.StatusServer.finish_request = finish  # type: ignore[method-assign]
        metrics_mod.JobMonitor.build = build  # type: ignore[method-assign]


def _run(args: argparse.Namespace, run_dir: Path, mode: str) -> dict[str, Any]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    config = demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=run_dir / "result.json",
        steps=args.steps,
        model=args.model,
        nproc_per_node=args.nproc,
        spares=1,
        job_dir=run_dir,
        metrics_port=0 if mode == "scraped" else None,
    )
    meter = CpuMeter()
    scraper = None
    if mode == "scraped":
        scraper = subprocess.Popen(
            [sys.executable, "-c", SCRAPER, str(run_dir), str(args.interval)],
            stdout=subprocess.PIPE,
            text=True,
        )
    t0 = time.monotonic()
    try:
        with metered(meter):
            result = run_job(config, redirect_output=True)
    finally:
        wall = time.monotonic() - t0
        scraped: dict[str, Any] = {}
        if scraper is not None:
            out, _ = scraper.communicate(timeout=60)
            scraped = json.loads(out) if out.strip() else {}
    out_: dict[str, Any] = {"mode": mode, "ok": result.state is JobState.DONE, "wall_s": wall}
    out_["median_step_s"] = result.median_step_s
    if mode == "scraped":
        requests, publishes = meter.calls["server"], meter.calls["publish"]
        out_.update(
            requests=requests,
            codes=scraped.get("codes"),
            server_cpu_ms=1000 * meter.cpu["server"] / requests if requests else None,
            publishes=publishes,
            publish_cpu_ms=1000 * meter.cpu["publish"] / meter.calls["publish"]
            if meter.calls["publish"]
            else None,
            # the coordinator's process per scrape (a /metrics and a /status request)
            cpu_per_scrape_ms=1000 * (meter.cpu["server"] + meter.cpu["publish"]) / (requests / 2)
            if requests
            else None,
            scrape_ms=summarize(scraped.get("scrape_ms") or []),
        )
    if not out_["ok"]:
        out_["error"] = result.error
    return out_


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny model, 30 steps, 1 run, no warm-up")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "metrics.json")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.runs, args.warmup, args.interval = "tiny", 30, 1, 0, 0.2
    info = machine_info()
    work = Path(tempfile.mkdtemp(prefix="nonstop-bench-metrics-"))
    runs = []
    try:
        for i in range(args.warmup + args.runs):
            for mode in MODES:
                r = _run(args, work / f"{mode}-{i}", mode)
                r["warmup"] = i < args.warmup
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    counted = [r for r in runs if not r["warmup"] and r["ok"]]
    keys = ("median_step_s", "wall_s", "cpu_per_scrape_ms", "server_cpu_ms", "publish_cpu_ms")
    summary: dict[str, Any] = {
        mode: {
            k: summarize([r[k] for r in counted if r["mode"] == mode and r.get(k) is not None]) for k in keys
        }
        | {"runs": sum(r["mode"] == mode for r in counted)}
        for mode in MODES
    }
    scraped = [r for r in counted if r["mode"] == "scraped" and r.get("scrape_ms")]
    summary["scraped"]["scrape_ms"] = summarize([r["scrape_ms"]["median"] for r in scraped])
    off, on = summary["off"]["median_step_s"], summary["scraped"]["median_step_s"]
    summary["step_time_ratio"] = on["median"] / off["median"] if off and on else None
    report = {
        "settings": vars(args) | {"out": str(args.out)},
        "machine": info,
        "stamp": run_stamp(),
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'':8} {'median step (ms)':>22} {'job wall (s)':>20} {'CPU per scrape (ms)':>22}")
    for mode in MODES:
        s = summary[mode]
        step = s["median_step_s"]
        step_ms = {k: v * 1000 if k != "n" else v for k, v in step.items()} if step else None
        print(f"{mode:8} {fmt(step_ms):>22} {fmt(s['wall_s']):>20} {fmt(s['cpu_per_scrape_ms']):>22}")
    print(f"step time scraped / off: {summary['step_time_ratio']}")
    return 0 if len(counted) == 2 * args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
