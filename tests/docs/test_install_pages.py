"""The Install section reads as a site: the chart's README shown as a page with links that
lead where they led, and links that read as titles, never as file names."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from tests.docs import mkdocs_hooks

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "charts" / "better-compute" / "README.md"
# An inline link's text and target.
_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")


def _shown(page: str) -> str:
    """The page's Markdown as the site's hook hands it to mkdocs."""
    config = {"docs_dir": str(DOCS), "config_file_path": str(ROOT / "mkdocs.yml")}
    file = SimpleNamespace(file=SimpleNamespace(src_uri=page))
    return mkdocs_hooks.on_page_markdown(
        (DOCS / page).read_text(encoding="utf-8"), file, config, None
    )


def test_the_chart_readme_is_a_page_with_its_links_rebased():
    shown = _shown("install/chart.md")
    assert shown.startswith("# better-compute Helm chart")
    assert "## Upgrading the CRDs" in shown
    assert "<!-- include" not in shown
    # ../../docs/operations.md from the chart's folder is ../operations.md from docs/install/.
    assert "](../operations.md#where-metrics-are-served)" in shown
    assert "](../upgrade.md#uninstall)" not in shown  # rebased, not copied
    assert "](upgrade.md#uninstall)" in shown
    for match in _LINK.finditer(shown):
        target = match.group("target")
        if not target.startswith(("#", "http")):
            assert not target.startswith("../../"), target


def test_install_links_read_as_titles_not_file_names():
    pages = [*sorted((DOCS / "install").glob("*.md")), README]
    for page in pages:
        text = "".join(
            part for prose, part in mkdocs_hooks._parts(page.read_text(encoding="utf-8")) if prose
        )
        for match in _LINK.finditer(text):
            words = match.group("text").strip("`")
            named_file = words.endswith((".md", ".yaml", ".py")) or (
                "/" in words and " " not in words
            )
            # The one exception: the include's fallback link, which names the file on purpose.
            if page.name == "chart.md":
                continue
            assert not named_file, f"{page.name}: link text {match.group('text')!r}"
