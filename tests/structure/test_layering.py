"""Which package may import which (docs/architecture.md, "Packages and layers"): the policies import
no runtime, the agent and the coordinator never import each other, nothing below the runtime imports
it, and the runtime and the timeline never import the simulator (plotting helpers both need live in
nonstop/plotting.py)."""

from __future__ import annotations

import ast
import sys
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


# The layers (docs/architecture.md, "Packages and layers"): a package may import the ones below it,
# never one above. Each entry: the package, and the nonstop packages it must never import.
RUNTIME = ("coordinator", "agent", "launch")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # the vocabularies every process shares
    "events": ("config", "control", "snapshot", "policy", "protocol", *RUNTIME, "train", "sim", "timeline"),
    "devices": ("config", "control", "snapshot", "policy", *RUNTIME, "train", "sim"),
    # pure machines and policies: what the simulator imports of the runtime
    "policy": ("config", "control", "snapshot", "replica", "protocol", *RUNTIME, "train", "sim", "timeline"),
    "protocol": (*RUNTIME, "train", "sim", "timeline"),
    # the parts below the runtime
    "snapshot": (*RUNTIME, "train", "sim", "timeline"),
    "replica": (*RUNTIME, "train", "sim", "timeline"),
    "control": (*RUNTIME, "train", "sim", "timeline"),
    "timeline": (*RUNTIME, "train", "sim"),
    "train": (*RUNTIME, "sim", "timeline"),
    # the two sides of the control plane meet only through the protocol
    "agent": ("coordinator", "launch", "train", "sim", "timeline"),
    "coordinator": ("agent", "launch", "train", "sim", "timeline"),
    "launch": ("sim", "timeline"),
    "config": (*RUNTIME, "train", "sim"),  # below the runtime: the modules' rule, as a package
    "sim": (*RUNTIME, "protocol", "train", "control", "snapshot", "replica"),
}
LOWER_MODULES = ("mesh", "errors", "faults", "placements", "reshardplan", "workerlog", "progress")


def _offenders(files: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {f"nonstop.{f}" for f in forbidden} | {"nonstop.runtime"}
    out = {
        (str(p.relative_to(SOURCE)) if p.is_relative_to(SOURCE) else p.name): sorted(
            m for m in _imports(p) if any(m == b or m.startswith(b + ".") for b in bad)
        )
        for p in files
    }
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_one_above_it(package: str) -> None:
    files = sorted((SOURCE / package).rglob("*.py"))
    assert files, package
    assert _offenders(files, FORBIDDEN[package]) == {}


@pytest.mark.parametrize("module", LOWER_MODULES)
def test_the_modules_below_the_runtime_never_import_it(module: str) -> None:
    assert _offenders([SOURCE / f"{module}.py"], (*RUNTIME, "train", "sim")) == {}


def test_nothing_imports_the_old_runtime_paths() -> None:
    """``nonstop.runtime`` is only the deprecated aliases of the moved modules (a user's old imports
    keep working); the package itself imports the modules where they are now."""
    files = [p for p in SOURCE.rglob("*.py") if "runtime" not in p.relative_to(SOURCE).parts]
    offenders = {
        str(p.relative_to(SOURCE)): sorted(m for m in _imports(p) if m.startswith("nonstop.runtime"))
        for p in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_old_runtime_paths_are_the_moved_modules() -> None:
    import importlib
    import warnings

    from nonstop.runtime import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(f"nonstop.runtime.{old}", None)  # a second import would be the cached one
        with pytest.warns(DeprecationWarning, match="moved to"):
            warnings.simplefilter("always")
            alias = importlib.import_module(f"nonstop.runtime.{old}")
        moved = importlib.import_module(new)
        assert alias is moved, old
        assert moved.__spec__ is not None and moved.__spec__.name == new


def test_the_scan_sees_a_forbidden_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from nonstop.coordinator.view import JobView\n")
    assert _offenders([probe], ("coordinator",)) == {
        "probe.py": ["nonstop.coordinator.view", "nonstop.coordinator.view.JobView"]
    }
    assert _offenders([probe], ("agent",)) == {}


def test_the_scan_sees_an_import_of_the_simulator(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from nonstop.sim.metrics import plot_results\n    import nonstop.sim\n")
    assert {"nonstop.sim.metrics", "nonstop.sim"} <= _imports(probe)


def test_the_runtime_logs_typed_events_not_kinds_by_name() -> None:
    """The coordinator's modules construct the event classes (a renamed field is a mypy error);
    only the snapshot persister, which may not import the runtime, logs through a callback by name
    (validated when it is logged)."""
    import re

    root = Path(__file__).resolve().parents[2] / "nonstop"
    by_name = re.compile(r"""\.emit\(\s*["']""")
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "eventlog.py" and by_name.search(p.read_text())
    ]
    assert offenders == [], offenders
