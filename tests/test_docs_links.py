"""Every relative link in README.md and docs/**/*.md resolves to a file or folder of the repository, and every
``#anchor`` into a Markdown file names one of its headings (GitHub's heading slugs), so the docs cannot point at
pages, files or sections that were moved or removed. Links inside code (fenced blocks, inline code) are not links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slugs(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens, repeats
    numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """``PAGE:LINE: target`` for every relative link of ``page`` that does not resolve inside ``root``."""
    problems = []
    for n, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto: ...
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}:{n}: {target}"
            if not dest.is_relative_to(root.resolve()) or not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
                problems.append(f"{where} (no heading with that anchor)")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_is_a_front_door() -> None:
    """The developers' guide's limit: the README stays at most 150 lines; details go to docs/."""
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


def test_the_check_catches_a_broken_link_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Some `code` section\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#some-code-section) [ok](#top) [web](https://example.com)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nothing) `[code](docs/c.md)`\n"
        "```\n[fenced](docs/d.md)\n```\n# Top\n",
        encoding="utf-8",
    )
    assert broken_links(page, tmp_path) == [
        "README.md:2: docs/b.md (no such file)",
        "README.md:2: docs/a.md#nothing (no heading with that anchor)",
    ]
