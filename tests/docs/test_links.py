"""No page of the site, and no entry of its nav, points outside the repository; every link is
relative; and the README's links into ``docs/`` still lead to pages."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.docs import mkdocs_hooks

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _local(target: str) -> str | None:
    """The file part of a relative link, or ``None`` for a URL or an anchor on the page."""
    if target.startswith("#") or target.startswith(("http://", "https://", "mailto:")):
        return None
    return target.split("#", 1)[0]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_links_stay_in_the_repository(page: Path) -> None:
    for target in mkdocs_hooks.links(page.read_text(encoding="utf-8")):
        path = _local(target)
        if path is None:
            continue
        assert not _SCHEME.match(target), f"{page.name}: {target!r} is not a relative link"
        assert not path.startswith("/"), f"{page.name}: {target!r} is an absolute path"
        resolved = Path(os.path.normpath(page.parent / path))
        assert _inside(resolved, ROOT), f"{page.name}: {target!r} leaves the repository"


def _nav_entries(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _nav_entries(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _nav_entries(value)


def test_nav_lists_pages_of_docs_only() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs"
    entries = list(_nav_entries(config["nav"]))
    for entry in entries:
        resolved = Path(os.path.normpath(DOCS / entry))
        assert _inside(resolved, DOCS), entry
        assert resolved.is_file(), entry
    assert sorted(Path(os.path.normpath(DOCS / e)) for e in entries) == PAGES


def test_readme_links_into_docs_lead_to_pages() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    into_docs = [t for t in mkdocs_hooks.links(readme) if t.startswith("docs/")]
    assert into_docs
    for target in into_docs:
        assert (ROOT / target.split("#", 1)[0]).is_file(), target
