"""Smoke test of ``benchmarks/bench_keep_groups.py --quick``: an HSDP 2 x 2 job migrates a rank
once keeping the groups it did not touch and once building them all (~70 s on two cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

# a benchmark script's smoke run of a minute or more: `make test-bench`, by hand (not CI)
pytestmark = [pytest.mark.bench, pytest.mark.manual]


@pytest.mark.timeout(400)
def test_bench_keep_groups_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_keep_groups", tmp_path / "keep.json", timeout=390)
    keep, every = report["summary"]["keep"], report["summary"]["rebuild_all"]
    assert keep["ok"] == every["ok"] == "1/1"
    # the migration's generation: rank 3's two groups are built again, the other two kept by
    # both their members (4 kept, 4 built over the 4 ranks); without keeping, all 8 built
    assert (keep["kept"]["median"], keep["built"]["median"]) == (4, 4)
    assert (every["kept"]["median"], every["built"]["median"]) == (0, 8)
    for s in (keep, every):
        assert 0 < s["mesh_s"]["median"] <= s["rebuild_s"]["median"]
    (run,) = report["runs"]["keep"]
    assert report["summary"]["saved"]["mesh_s"]["median"] == pytest.approx(
        report["runs"]["rebuild_all"][0]["mesh_s"] - run["mesh_s"]
    )
