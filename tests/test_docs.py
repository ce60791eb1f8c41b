"""The documentation holds together: every relative link in the README and the docs resolves (the file exists,
and an anchor names a heading of it), nothing cites a design document outside the repository, and the README
stays a manual (about 300 lines; results live in benchmarks/RESULTS.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md", *ROOT.glob("docs/*.md")]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation dropped, spaces as dashes."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_nothing_cites_a_design_document_outside_the_repository() -> None:
    cited = []
    for path in [
        *ROOT.glob("hybridflow/**/*.py"),
        *ROOT.glob("tests/**/*.py"),
        *ROOT.glob("benchmarks/*"),
        *PAGES,
    ]:
        if path.is_file() and path != Path(__file__).resolve():
            text = path.read_text(errors="replace")
            cited += [f"{path.relative_to(ROOT)}" for _ in re.finditer(r"DESIGN\.md", text)]
    assert not cited, f"cite docs/architecture.md or benchmarks/RESULTS.md instead: {sorted(set(cited))}"


def test_the_readme_is_a_manual() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move results and details to RESULTS.md/docs"
