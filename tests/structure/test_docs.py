"""The README and docs/ stay walkable: the README fits a newcomer's first ten minutes (issue 46),
starts with the two commands, and every relative link and every file it tells a reader to open
exists; the layering page names every package tests/structure/test_layering.py holds to a layer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.structure.test_layering import FORBIDDEN

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 200
MAX_FIRST_FILES = 6

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _links(text: str) -> list[str]:
    """The relative targets of a Markdown text's links (code blocks left out)."""
    targets = _LINK.findall(_FENCE.sub("", text))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_anchor(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` whose file, or whose ``#anchor`` in that file, is not there."""
    bad = []
    for target in _links(path.read_text()):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    return bad


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_check_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading) [web](https://example.com)\n"
        "[gone](missing.md) [no anchor](there.md#nowhere)\n```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md", "there.md#nowhere"]


def test_the_readme_fits_a_newcomers_first_ten_minutes() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md is {len(lines)} lines; move detail to docs/"


def test_the_readme_starts_with_the_two_commands() -> None:
    text = README.read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "demo"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_the_files_to_read_first_are_few_and_real() -> None:
    section = README.read_text().split("## Read these files first", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. \[[^\]]+\]\(([^)]+)\)", section, re.M)
    assert 0 < len(items) <= MAX_FIRST_FILES
    assert [i for i in items if not (ROOT / i).is_file()] == []


def test_the_readme_links_every_docs_page() -> None:
    linked = {Path(t.partition("#")[0]).name for t in _links(README.read_text())}
    assert [p.name for p in PAGES if p.name not in linked] == []


def test_the_architecture_page_names_every_layered_package() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    layers = text.split("## Packages and layers", 1)[1].split("\n## ", 1)[0]
    assert [p for p in FORBIDDEN if f"{p}/" not in layers] == []
