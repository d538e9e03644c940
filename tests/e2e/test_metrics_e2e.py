"""A real job with ``--metrics-port``: scraped during the job with its token, ``/metrics`` shows
the failure counter, the MTTR histogram and the committed step move through a SIGKILL, and
``/status`` is what ``nonstop status --json`` shows."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DemoRun, run_demo_job
from tests.coordinator.test_metrics import samples, value


def _get(addr: tuple[str, int], path: str, token: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*addr, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _total(body: bytes, name: str) -> float:
    """The sum of ``name``'s samples over its labels."""
    return sum(v for (n, _), v in samples(body).items() if n == name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scrapes_during_a_job_see_a_kill_recovered(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    out: dict[str, DemoRun] = {}

    def job() -> None:
        out["run"] = run_demo_job(
            job_dir,
            nproc=2,
            spares=1,
            steps=50,
            faults=("kill:rank=1,step=15",),
            script_extra=("--step-delay", "0.1"),
            metrics_port=0,
        )

    t = threading.Thread(target=job)
    t.start()
    scrapes: list[dict[str, Any]] = []
    statuses: list[dict[str, Any]] = []
    last_body = ""
    try:
        deadline = time.monotonic() + 120
        info: dict[str, Any] = {}
        while "metrics" not in info and time.monotonic() < deadline and t.is_alive():
            try:
                info = json.loads((job_dir / "job.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                time.sleep(0.05)
        assert "metrics" in info, "the job never said where its metrics are"
        host, _, port = info["metrics"].rpartition(":")
        addr = (host, int(port))
        token = Path(info["metrics_token_file"]).read_text().strip()
        assert _get(addr, "/metrics", "not-the-token")[0] == 401
        while t.is_alive():
            try:
                code, body = _get(addr, "/metrics", token)
                scode, sbody = _get(addr, "/status", token)
            except OSError:
                break  # the job ended between two scrapes
            assert code == 200 and scode in (200, 503)
            last_body = body.decode()
            scrapes.append(
                {
                    "committed": value(body, "nonstop_committed_step"),
                    "failures": _total(body, "nonstop_failures_total"),
                    "mttr_count": value(body, "nonstop_mttr_seconds_count"),
                    "steps": value(body, "nonstop_steps_total"),
                }
            )
            if scode == 200:
                statuses.append(json.loads(sbody))
            time.sleep(0.25)
    finally:
        t.join(timeout=240)
    run = out["run"]
    assert run.result.state.value == "done", run.result.error
    assert len(run.result.failures) == 1
    kinds = {e["kind"] for e in run.events if e["event"] == "failure"}
    committed = [s["committed"] for s in scrapes if s["committed"] is not None]
    assert len(committed) >= 5 and committed[-1] > committed[0], scrapes
    assert scrapes[0]["failures"] == 0 and max(s["failures"] for s in scrapes) == 1, scrapes
    assert max(s["mttr_count"] or 0 for s in scrapes) == 1, scrapes
    assert kinds and all(f'kind="{k}"' in last_body for k in kinds)
    assert any(s["failures"] == 1 and s["committed"] is not None and s["committed"] > 15 for s in scrapes)
    assert (
        statuses
        and statuses[-1]["t"] == "status"
        and set(statuses[-1])
        >= {
            "job_id",
            "state",
            "generation",
            "ranks",
            "nodes",
            "committed_step",
        }
    )
    assert statuses[-1]["job_id"] == run.job_id
    assert not (job_dir / "metrics.token").exists()  # removed with the job
