"""Every page of `docs/` is reachable from the README by its links (a page linked from
nowhere is a page nobody reads), and every relative link in the README and `docs/` names a
file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def _relative_links(page: Path) -> list[Path]:
    targets = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        targets.append((page.parent / target).resolve())
    return targets


def test_every_relative_link_names_a_file_that_exists() -> None:
    broken = [
        f"{page.relative_to(ROOT)} -> {target}"
        for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for target in _relative_links(page)
        if not target.exists()
    ]
    assert broken == []


def test_every_doc_is_reachable_from_the_readme() -> None:
    seen: set[Path] = set()
    todo = [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        todo += [t for t in _relative_links(page) if t.suffix == ".md" and t.exists()]
    unreached = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.resolve() not in seen
    )
    assert unreached == []
