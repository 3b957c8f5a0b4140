"""Every relative link in README.md and docs/*.md resolves: the file (or directory)
exists, and an anchor (`page.md#section`, `#section`) names a heading of the page, as
GitHub spells heading anchors. Links to other sites are not followed."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,}).*?^\1\2[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
# [text](target) and ![alt](target); the target ends at whitespace (a "title") or ")".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than
    `-` and `_` removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", page.read_text()))
    return found


def targets(page: Path) -> list[str]:
    text = prose(page.read_text())
    return [*LINK.findall(text), *REFERENCE.findall(text)]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in targets(page):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file {os.path.relpath(dest, root)}")
            continue
        if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {os.path.relpath(dest, root)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_docs_index_lists_every_page() -> None:
    index = ROOT / "docs" / "README.md"
    listed = {t.partition("#")[0] for t in targets(index)}
    missing = [p.name for p in PAGES if p.parent.name == "docs" and p != index and p.name not in listed]
    assert missing == [], "docs/README.md does not link these pages"


def test_the_checker_catches_what_it_should(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## `Router.CallModel`: the same over gRPC\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Section two\n\n"
        "[ok](other.md) [ok](other.md#other-page) [ok](other.md#routercallmodel-the-same-over-grpc)\n"
        "[ok](#section-two) [ok](https://example.com/missing.md) `[not a link](missing.md)`\n"
        "```\n[not a link](missing.md)\n```\n"
        "[bad](missing.md) [bad](other.md#no-such) [bad](#nowhere)\n"
    )
    assert [b.split(":")[0] for b in broken_links(page, tmp_path)] == [
        "missing.md",
        "other.md#no-such",
        "#nowhere",
    ]
