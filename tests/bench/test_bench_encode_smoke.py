"""Smoke test of ``benchmarks/bench_encode.py --quick``: every method reports a ratio and speeds,
and every lossless method's decode reproduced the input byte for byte.

Runs the benchmark's quick mode (tiny model, 6 training steps, 1 repetition) into a temporary
directory, about 10 s on two cores::

    .venv/bin/python -m pytest -q tests/bench/test_bench_encode_smoke.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.timeout(180)
def test_bench_encode_quick(tmp_path: Path) -> None:
    out = tmp_path / "encode-quick.json"
    report = run_benchmark_quick("bench_encode", out, "--cache-dir", str(tmp_path / "cache"), timeout=170)
    assert report["benchmark"] == "encode" and report["config"]["quick"] is True
    assert report["workload"]["training"]["last_loss"] < report["workload"]["training"]["first_loss"]
    results = report["results"]
    seen = {(r["variant"], r["mode"], r["method"]) for r in results}
    for variant in ("fp32", "bf16"):
        for mode in ("full", "delta"):
            for method in ("zstd1+shuffle", "lz4+shuffle", "zstd1+bitshuffle", "plain-zstd1", "plain-lz4"):
                assert (variant, mode, method) in seen
            assert (variant, mode, "lossy-q8") in seen and (variant, mode, "lossy-q4") in seen
        for method in ("zstd1+shuffle+sub", "lossy-q8-chain", "lossy-q4-chain"):
            assert (variant, "delta", method) in seen
    for r in results:
        assert r["raw_bytes"] > 0 and r["enc_bytes"] > 0
        assert r["ratio"] == pytest.approx(r["raw_bytes"] / r["enc_bytes"])
        for key in ("encode_mbps_per_core", "encode_mbps_1t", "encode_mbps_2t", "decode_mbps"):
            assert r[key] > 0, (r["method"], key)
        if r["method"].startswith("lossy-"):
            assert r["roundtrip_ok"] is None and r["lossless_bytes_exact"] is True
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                err = r["lossy_error"][kind]
                assert 0 <= err["max_rel"] < 0.2 and 0 <= err["mean_rel"] < 0.5
        else:
            assert r["roundtrip_ok"] is True, r["method"]
    # Shuffled zstd beats plain zstd on float deltas; deltas beat full encodes.
    by = {(r["variant"], r["mode"], r["method"]): r["ratio"] for r in results}
    assert by[("fp32", "delta", "zstd1+shuffle")] > by[("fp32", "delta", "plain-zstd1")]
    assert by[("fp32", "delta", "zstd1+shuffle")] > by[("fp32", "full", "zstd1+shuffle")]
    assert (
        by[("fp32", "delta", "lossy-q4")]
        > by[("fp32", "delta", "lossy-q8")]
        > by[("fp32", "delta", "zstd1+shuffle")]
    )
    assert set(report["goals"]) >= {
        "fp32_delta_zstd1+shuffle",
        "bf16_delta_zstd1+shuffle",
        "fp32_delta_lossy-q4",
    }
