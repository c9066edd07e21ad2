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


def _spec_fields(cls, prefix=""):
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        sub = hints[f.name]
        inner = [a for a in typing.get_args(sub) if dataclasses.is_dataclass(a)] if type(None) in typing.get_args(sub) else []
        if dataclasses.is_dataclass(sub) or inner:
            yield from _spec_fields(sub if dataclasses.is_dataclass(sub) else inner[0], f"{prefix}{f.name}.")
        else:
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>")
            yield f"{prefix}{f.name}", default


def test_the_spec_page_shows_every_field_with_its_default():
    """docs/spec.md's YAML is the spec's fields as appliance/spec.py has them, each at its default (an example
    goes in the comment): a field added, removed or given another default fails here."""
    import yaml

    from appliance.spec import Spec

    text = (ROOT / "docs" / "spec.md").read_text()
    block = re.search(r"^```yaml\n(.*?)^```", text, re.S | re.M).group(1)

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("env",):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    shown = dict(flat(yaml.safe_load(block)))
    fields = dict(_spec_fields(Spec))
    assert sorted(shown) == sorted(fields), (set(shown) ^ set(fields))
    wrong = {k: (shown[k], d) for k, d in fields.items()
             if d != "<required>" and shown[k] != (list(d) if isinstance(d, tuple) else d)}
    assert not wrong, f"docs/spec.md shows these fields at other than their defaults: {wrong}"
