"""Preemption notices from an HTTP endpoint (agent/notice.py): what counts as a notice, the
poller against a real HTTP server, and a node drained on such a notice with real processes."""

from __future__ import annotations

import datetime
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nonstop.agent.notice import NoticePoller, parse_headers, parse_notice
from nonstop.config import JobConfig, OperationsConfig
from nonstop.demo.runner import demo_job_config
from nonstop.errors import UsageError
from tests.conftest import LEASE_TTL_S, NodesInBackground, events_named

NOW = 1_800_000_000.0


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


@pytest.mark.parametrize(
    ("status", "body"),
    [(404, b""), (200, b""), (200, b"FALSE"), (200, b"false\n"), (500, b"TRUE"), (200, b'{"Events": []}')],
)
def test_no_notice(status: int, body: bytes) -> None:
    assert parse_notice(status, body, now=NOW, default_grace_s=30.0) is None


def test_gcp_plain_notice_gets_the_default_grace() -> None:
    assert parse_notice(200, b"TRUE", now=NOW, default_grace_s=30.0) == 30.0


def test_aws_instance_action_deadline_is_the_grace() -> None:
    body = f'{{"action": "terminate", "time": "{_iso(NOW + 120)}"}}'.encode()
    assert parse_notice(200, body, now=NOW, default_grace_s=30.0) == pytest.approx(120.0)
    late = f'{{"action": "stop", "time": "{_iso(NOW - 5)}"}}'.encode()
    assert parse_notice(200, late, now=NOW, default_grace_s=30.0) == 0.0


def test_azure_scheduled_events() -> None:
    other = b'{"Events": [{"EventType": "Freeze", "NotBefore": ""}]}'
    assert parse_notice(200, other, now=NOW, default_grace_s=30.0) is None
    when = datetime.datetime.fromtimestamp(NOW + 40, datetime.UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")
    body = f'{{"Events": [{{"EventType": "Preempt", "NotBefore": "{when}"}}]}}'.encode()
    assert parse_notice(200, body, now=NOW, default_grace_s=30.0) == pytest.approx(40.0)


def test_headers_and_bad_config_fail_at_start() -> None:
    assert parse_headers(["Metadata-Flavor: Google", "X:y:z"]) == {"Metadata-Flavor": "Google", "X": "y:z"}
    with pytest.raises(ValueError):
        parse_headers(["no colon"])
    with pytest.raises(UsageError, match="--preempt-url"):
        JobConfig(script="x.py", operations=OperationsConfig(preempt_url="file:///etc/passwd"))
    with pytest.raises(UsageError, match="--preempt-header"):
        JobConfig(
            script="x.py", operations=OperationsConfig(preempt_url="http://h/x", preempt_headers=(": v",))
        )
    with pytest.raises(ValueError):
        NoticePoller("ftp://x", headers={}, interval_s=1, default_grace_s=1)


class _Endpoint:
    """A real HTTP server standing in for a metadata service: 404 until ``notice`` is set for
    a path; records the headers it was sent."""

    def __init__(self) -> None:
        self.notices: dict[str, bytes] = {}
        self.headers: list[dict[str, str]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.headers.append(dict(self.headers))
                body = outer.notices.get(self.path)
                self.send_response(404 if body is None else 200)
                self.end_headers()
                if body is not None:
                    self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def endpoint() -> Iterator[_Endpoint]:
    ep = _Endpoint()
    yield ep
    ep.server.shutdown()


def test_poller_against_a_real_http_server(endpoint: _Endpoint) -> None:
    poller = NoticePoller(
        endpoint.url + "/meta/preempted",
        headers={"Metadata-Flavor": "Google"},
        interval_s=0.05,
        default_grace_s=12.0,
    ).start()
    try:
        time.sleep(0.3)
        assert not poller.noticed.is_set()
        endpoint.notices["/meta/preempted"] = b"TRUE"
        assert poller.noticed.wait(5.0)
        assert poller.grace_s == 12.0
        assert endpoint.headers[0].get("Metadata-Flavor") == "Google"
    finally:
        poller.stop()


@pytest.mark.slow
def test_http_notice_drains_the_node(tmp_path: Path, endpoint: _Endpoint, reference_hash: str) -> None:
    """Node 2's metadata endpoint announces a termination 30 s ahead (AWS's format) while the job
    trains: the node is drained by live migration and released; bitwise equal, nothing failed."""
    job_dir = tmp_path / "job"
    config = demo_job_config(
        result=job_dir / "result.json",
        steps=16,
        model="tiny",
        batch=4,
        # paced so that the drain (fetch, prepare, catch up, pause: ~2.5 s here) fits well within
        # the job's 16 steps on a saturated machine: at 0.1 s a step a full-suite run saw the
        # migration begin at step 8 and abort, "the job finished first" at its boundary, step 16
        script_extra=("--step-delay", "0.3"),
        nproc_per_node=1,
        spares=1,
        nnodes=3,
        job_dir=job_dir,
        coordinator="127.0.0.1:0",
        lease_ttl_s=LEASE_TTL_S,
        preempt_url=endpoint.url + "/latest/meta-data/spot/instance-action/{node}",
        preempt_poll_s=0.2,
    )
    job = NodesInBackground(config)
    job.wait_replicated(2)
    endpoint.notices["/latest/meta-data/spot/instance-action/2"] = (
        f'{{"action": "terminate", "time": "{_iso(time.time() + 30)}"}}'.encode()
    )
    result = job.result(timeout=300)
    assert result.error is None, result.error
    events = [json.loads(x) for x in (job_dir / "events.jsonl").read_text().splitlines()]
    (notice,) = events_named(events, "preempt_notice")
    assert notice["node"] == "2" and 20 < notice["grace_s"] <= 30
    (done,) = events_named(events, "migration_done")
    assert done["rank"] == 2 and done["reason"] == "preempt"
    assert [e["node"] for e in events_named(events, "node_released")] == ["2"]
    assert result.failures == []
    out = json.loads((job_dir / "result.json").read_text())
    assert out["final_hash"] == reference_hash
