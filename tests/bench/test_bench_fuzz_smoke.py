"""Smoke test of ``benchmarks/bench_fuzz.py``: a few thousand mutated inputs over every decoder of
snapshot bytes, none crashes one or is decoded wrong (~5 s on two cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`

REPO = Path(__file__).resolve().parents[2]
DECODERS = {
    "chunk_info",
    "decode_chunk",
    "decode",
    "decode_manifest",
    "durable_load",
    "decode_raw",
    "decode_dtensor",
    "slot",
}


@pytest.mark.timeout(180)
def test_bench_fuzz_small(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_fuzz.py"), "--inputs", "4000", "--seed", "7"]
    proc = subprocess.run(
        [*cmd, "--json", str(out), "--alloc-every", "10"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "fuzz" and report["config"]["seed"] == 7
    decoders = report["decoders"]
    assert set(decoders) == DECODERS
    assert report["total"] == {**report["total"], "inputs": 4000, "crashes": 0, "wrong": 0}
    for name, d in decoders.items():
        assert d["inputs"] == d["decoded"] + d["rejected"] > 0, name
        assert d["crashes"] == d["wrong"] == 0 and d["examples"] == [], name
        assert d["alloc_sampled"] >= 1 and d["max_alloc_bytes"] < 8 << 20, name
        assert sum(d["top_rejections"].values()) <= d["rejected"], name
    # the mutations reach past the checks at the door: some inputs decode, most are rejected,
    # and the durable loader falls back to the intact older checkpoint
    assert decoders["decode_chunk"]["rejected"] > decoders["decode_chunk"]["decoded"] > 0
    assert any("decompression failed" in r for r in decoders["decode_chunk"]["top_rejections"])
    assert decoders["durable_load"]["outcomes"].get("fell back to step 10", 0) > 0
    assert decoders["slot"]["decoded"] == decoders["slot"]["inputs"]  # every input: the rank wrote on
