"""A hook of the site's build (``hooks:`` in mkdocs.yml): links to repository files.

Why it exists: the pages in ``docs/`` are read in two places. On GitHub a link such as
``[`examples/pod-reservation.yaml`](../examples/pod-reservation.yaml)`` opens the file; on the
site that file is not a page, so ``mkdocs build --strict`` would fail on it. The one rule for
both: a page may link to a file of the repository outside ``docs/``, and the site shows that
link as the file's path in inline code (``examples/pod-reservation.yaml``), to be found in the
repository. The pages keep working links on GitHub, and the site has no dead ones.

It also shows a repository file as a page: a page holding only
``<!-- include ../../charts/better-compute/README.md -->`` … ``<!-- end include -->`` (a link
for GitHub's readers in between) shows that file on the site, its relative links rebased onto
the page, so the chart's README is read on the site without a second copy to keep in step.

What it must never do: hide a broken link. A link to a repository path that does not exist,
or to anything outside the repository (``../shared``), is a warning, which fails the strict
build; links between pages are left to mkdocs, which checks them and their anchors.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

log = logging.getLogger("mkdocs.hooks.repository_links")

# A fenced code block (``` or ~~~), kept as it is.
_FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})[^\n]*\n.*?^\1\2[ \t]*$", re.MULTILINE | re.DOTALL)
# An inline link (not an image): [text](target "optional title").
_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
# Any inline link or image, and a reference definition: [name]: target.
_ANY_LINK = re.compile(r"!?\[[^\]\n]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_DEFINITION = re.compile(r"^ {0,3}\[[^\]\n]+\]:\s*(?P<target>\S+)", re.MULTILINE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# A repository file shown in place of what stands between the two comments.
_INCLUDE = re.compile(
    r"^<!-- include (?P<path>\S+) -->\n.*?^<!-- end include -->[ \t]*$", re.MULTILINE | re.DOTALL
)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """The page's Markdown with its links to repository files outside ``docs/`` shown as
    those files' paths."""
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    here = (docs / page.file.src_uri).parent
    where = page.file.src_uri
    markdown = _INCLUDE.sub(lambda m: _included(here, m.group("path")), markdown)

    def replace(match: re.Match[str]) -> str:
        target = match.group("target")
        if target.startswith(("#", "/")) or _SCHEME.match(target):
            return match.group(0)  # an anchor, an absolute path or a URL: mkdocs judges it
        path = unquote(target.split("#", 1)[0])
        resolved = Path(os.path.normpath(here / path))
        if resolved == docs or docs in resolved.parents:
            return match.group(0)  # another page: mkdocs checks it
        if resolved != root and root not in resolved.parents:
            log.warning("%s links to %r, which is outside the repository", where, target)
            return match.group(0)
        if not resolved.exists():
            log.warning("%s links to %r, which does not exist in the repository", where, target)
            return match.group(0)
        shown = resolved.relative_to(root).as_posix() + ("/" if resolved.is_dir() else "")
        return _as_path(match.group("text"), shown)

    return "".join(_LINK.sub(replace, part) if prose else part for prose, part in _parts(markdown))


def _included(here: Path, target: str) -> str:
    """The file ``target`` (relative to the page's folder ``here``), its relative links
    rebased from the file's folder onto the page's, so they lead where they led."""
    source = Path(os.path.normpath(here / target))
    folder = source.parent

    def rebase(match: re.Match[str]) -> str:
        link = match.group("target")
        if link.startswith(("#", "/")) or _SCHEME.match(link):
            return match.group(0)
        path, hash_, fragment = link.partition("#")
        moved = os.path.relpath(os.path.normpath(folder / unquote(path)), here)
        start, end = match.span("target")
        whole = match.group(0)
        offset = match.start()
        return whole[: start - offset] + moved + hash_ + fragment + whole[end - offset :]

    text = source.read_text(encoding="utf-8")
    return "".join(_LINK.sub(rebase, part) if prose else part for prose, part in _parts(text))


def links(markdown: str) -> list[str]:
    """Every link target of a page outside its code blocks: inline links, images and
    reference definitions (for the checks in ``test_links.py``)."""
    found = []
    for prose, part in _parts(markdown):
        if prose:
            found.extend(m.group("target") for m in _ANY_LINK.finditer(part))
            found.extend(m.group("target") for m in _DEFINITION.finditer(part))
    return found


def _parts(markdown: str) -> list[tuple[bool, str]]:
    """The page cut into prose (``True``) and fenced code blocks (``False``), in order."""
    parts, last = [], 0
    for fence in _FENCE.finditer(markdown):
        parts.append((True, markdown[last : fence.start()]))
        parts.append((False, fence.group(0)))
        last = fence.end()
    parts.append((True, markdown[last:]))
    return parts


def _as_path(text: str, path: str) -> str:
    """The link's text and the path: the path alone when the text is a code span that names
    the same file (``demo.yaml`` for ``src/bettercompute/dev/demo.yaml``)."""
    named = text.strip()
    if named.startswith("`") and named.endswith("`") and named.count("`") == 2:
        inner, whole = named.strip("`").rstrip("/"), path.rstrip("/")
        if inner and (whole == inner or whole.endswith("/" + inner)):
            return f"`{path}`"
    return f"{text} (`{path}`)"
