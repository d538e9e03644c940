"""Which package may import which: the runtime and the timeline never import the simulator (the
simulator builds on them; plotting helpers both need live in nonstop/plotting.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import nonstop

SOURCE = Path(nonstop.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at any depth: functions' lazy imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("package", ["runtime", "timeline"])
def test_the_runtime_and_the_timeline_never_import_the_simulator(package: str) -> None:
    files = sorted((SOURCE / package).rglob("*.py"))
    assert len(files) >= 5
    offenders = {
        str(p.relative_to(SOURCE)): sorted(
            m for m in _imports(p) if m == "nonstop.sim" or m.startswith("nonstop.sim.")
        )
        for p in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_scan_sees_an_import_of_the_simulator(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from nonstop.sim.metrics import plot_results\n    import nonstop.sim\n")
    assert {"nonstop.sim.metrics", "nonstop.sim"} <= _imports(probe)


def test_the_runtime_logs_typed_events_not_kinds_by_name() -> None:
    """The coordinator's modules construct the event classes (a renamed field is a mypy error);
    only the snapshot persister, which may not import the runtime, logs through a callback by name
    (validated when it is logged)."""
    import re

    root = Path(__file__).resolve().parent.parent / "nonstop"
    by_name = re.compile(r"""\.emit\(\s*["']""")
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "eventlog.py" and by_name.search(p.read_text())
    ]
    assert offenders == [], offenders
