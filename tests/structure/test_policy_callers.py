"""Every public function and class of ``nonstop/policy/`` has a caller in the runtime (issue 46).

The simulator takes its decisions from ``policy/`` so that it cannot disagree with the runtime;
a policy only the simulator (or a test) calls decides nothing the runtime does, so it either goes,
or -- the simulator's own modelling -- lives in ``sim/``.

Static (AST) and conservative: a name counts as called when the runtime's code -- ``nonstop/``
less ``sim/``, ``policy/`` and the ``runtime/`` alias -- names it (an import, a call, an attribute),
or when the body of a policy definition so called names it (``plan_generation`` calls
``choose_replacements``: the runtime calls both), followed to a fixed point. Module-level
statements of a policy module (constants, type aliases; not its imports) count as called.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "nonstop"
POLICY = ROOT / "policy"
NOT_RUNTIME = {"sim", "policy", "runtime"}  # runtime/: the deprecated alias of the moved modules


def _names(nodes: Iterable[ast.AST]) -> set[str]:
    """Every identifier the code names: variables, attributes, imported names."""
    out: set[str] = set()
    for top in nodes:
        for n in ast.walk(top):
            if isinstance(n, ast.Name):
                out.add(n.id)
            elif isinstance(n, ast.Attribute):
                out.add(n.attr)
            elif isinstance(n, ast.alias):
                out.add(n.name.rsplit(".", 1)[-1])
                if n.asname:
                    out.add(n.asname)
    return out


def _is_all(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
    )


def _exports(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if _is_all(node):
            assert isinstance(node, ast.Assign)
            return list(ast.literal_eval(node.value))
    return []


def uncalled(root: Path = ROOT) -> dict[str, list[str]]:
    """policy module -> its public functions and classes the runtime does not reach."""
    runtime: set[str] = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        if len(rel) > 1 and rel[0] in NOT_RUNTIME:
            continue
        runtime |= _names([ast.parse(path.read_text())])
    defs: dict[str, set[str]] = {}  # policy definition -> the names its body uses
    public: dict[str, list[str]] = {}
    live = set(runtime)
    for path in sorted((root / "policy").glob("*.py")):
        tree = ast.parse(path.read_text())
        exports = set(_exports(tree))
        public[path.name] = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defs.setdefault(node.name, set()).update(_names([node]) - {node.name})
                if node.name in exports:
                    public[path.name].append(node.name)
            elif not isinstance(node, ast.Import | ast.ImportFrom) and not _is_all(node):
                live |= _names([node])  # a constant, a type alias: runs on import
    grew = True
    while grew:
        reached = set().union(*(used for name, used in defs.items() if name in live))
        grew = not reached <= live
        live |= reached
    return {mod: dead for mod, names in public.items() if (dead := [n for n in names if n not in live])}


def test_every_public_policy_has_a_caller_in_the_runtime() -> None:
    assert uncalled() == {}, (
        "called only by the simulator or tests: delete it, or move it into sim/ if it is the "
        "simulator's own modelling (issue 46)"
    )


def test_an_unused_policy_is_found(tmp_path: Path) -> None:
    """The check can fail: a public function nothing in the runtime calls, and one only another
    uncalled policy calls, are both reported; one the runtime calls through a policy is not."""
    (tmp_path / "policy").mkdir()
    (tmp_path / "coordinator").mkdir()
    (tmp_path / "sim").mkdir()
    (tmp_path / "policy" / "p.py").write_text(
        '__all__ = ["used", "helper", "orphan", "orphans_helper", "Kept"]\n'
        "def helper() -> int:\n    return 1\n"
        "def used() -> int:\n    return helper()\n"
        "def orphans_helper() -> int:\n    return 2\n"
        "def orphan() -> int:\n    return orphans_helper()\n"
        "class Kept:\n    pass\n"
    )
    (tmp_path / "coordinator" / "c.py").write_text(
        "from nonstop.policy.p import Kept, used\nx: Kept\nused()\n"
    )
    (tmp_path / "sim" / "s.py").write_text("from nonstop.policy.p import orphan\norphan()\n")
    assert uncalled(tmp_path) == {"p.py": ["orphans_helper", "orphan"]}


@pytest.mark.parametrize("module", sorted(p.name for p in POLICY.glob("*.py") if p.name != "__init__.py"))
def test_every_policy_module_says_what_it_exports(module: str) -> None:
    assert _exports(ast.parse((POLICY / module).read_text())), f"policy/{module} has no __all__"
