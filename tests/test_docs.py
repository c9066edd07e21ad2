"""The user docs (README.md, docs/): every relative link resolves, every citation is an upstream source or a public
URL (never a path outside the repository), and the prose carries no dates or commit hashes (git keeps the story;
examples of output and spec values, in code, may show dates)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = [t for t in LINK.findall(re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M))
              if not re.match(r"[a-z]+:|#", t) and not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links that do not resolve from {page.parent.name}/: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_citation_points_outside_the_repository(page):
    assert "../shared" not in page.read_text(), f"{page.relative_to(ROOT)} cites ../shared, which users do not have"


@pytest.mark.parametrize("page", [p for p in PAGES if "dev" not in p.relative_to(ROOT).parts[:-1]],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_carry_no_dates_or_commit_hashes(page):
    text = prose(page.read_text())
    dates = re.findall(r"\b20\d\d-[01]\d-[0-3]\d\b", text)
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", h) and re.search(r"[a-f]", h)]
    assert not dates and not hashes, f"{page.relative_to(ROOT)}: dates {dates}, commit-like hashes {hashes}"


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("see [x](missing.md) and [y](p.md)\n")
    assert [t for t in LINK.findall(page.read_text()) if not (page.parent / t).exists()] == ["missing.md"]
