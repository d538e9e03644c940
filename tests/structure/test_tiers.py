"""The extended tier's list (tests/tiers.py) names only tests that exist and are slow."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.tiers import EXTENDED

TESTS = Path(__file__).resolve().parents[1]


def _slow_tests(path: Path) -> set[str]:
    """The test functions of ``path`` that carry ``slow``: the module's ``pytestmark`` or their own."""
    tree = ast.parse(path.read_text())
    module_slow = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and "slow" in ast.unparse(node.value)
        for node in tree.body
    )
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        if module_slow or any("slow" in ast.unparse(d) for d in node.decorator_list)
    }


def test_every_extended_name_is_a_slow_test_that_exists() -> None:
    stale = []
    for name in EXTENDED:
        file, _, func = name.partition("::")
        path = TESTS / file
        if not path.is_file() or func not in _slow_tests(path):
            stale.append(name)
    assert not stale, f"tests/tiers.py names tests that are gone, renamed or not slow: {stale}"


def test_every_slow_test_file_keeps_a_core_test_or_is_named_whole() -> None:
    """A feature's file never moves to the extended tier whole by accident: each file the list
    touches keeps at least one slow test in make test."""
    extended: dict[str, set[str]] = {}
    for name in EXTENDED:
        file, _, func = name.partition("::")
        extended.setdefault(file, set()).add(func)
    bare = {file for file, funcs in extended.items() if _slow_tests(TESTS / file) <= funcs}
    allowed = {  # files whose only slow tests are extended: their feature's core test lives elsewhere
        "chaos/test_chaos.py",
        "e2e/test_event_hook_e2e.py",
        "structure/test_examples.py",
        "agent/test_notice.py",
        "e2e/test_repeated_error_e2e.py",
        "e2e/test_protocol_e2e.py",
        "e2e/test_store_stall.py",
        "control/test_etcd_tls.py",
        "timeline/test_timeline.py",
        "e2e/test_torchenv_e2e.py",
    }
    assert bare <= allowed, f"these files lost every core test: {sorted(bare - allowed)}"
