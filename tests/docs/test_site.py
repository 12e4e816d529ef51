"""The documentation site builds with ``mkdocs build --strict``, and the strict build does
fail on what it must: a broken link or anchor, a link out of the repository, a page missing
from the nav.

mkdocs is part of the test extra (CI installs it), so a missing mkdocs is a failure here,
never a skip. The build is never run with ``-q`` or ``-v``: with either, mkdocs 1.6 no longer
counts warnings in strict mode (mkdocs issues #4126 and #3991), and a broken link passes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "install the test extra: .venv/bin/pip install -e '.[test]'"


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )


def test_site_builds_strict(tmp_path: Path) -> None:
    started = time.monotonic()
    result = build(ROOT, tmp_path / "site")
    output = result.stdout + result.stderr
    assert "No module named mkdocs" not in output, INSTALL
    assert result.returncode == 0, output
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "http-api" / "index.html").is_file()
    assert time.monotonic() - started < 120


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The repository as the site's build sees it, with ``docs/`` and ``mkdocs.yml`` copied
    (to break) and everything else linked."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or entry.name in ("docs", "mkdocs.yml", "site"):
            continue
        (root / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    return root


@pytest.mark.parametrize(
    ("page", "line", "complaint"),
    [
        ("concepts.md", "[gone](no-such-page.md)", "no-such-page.md"),
        ("concepts.md", "[gone](reservations.md#no-such-anchor)", "no-such-anchor"),
        ("concepts.md", "[away](../../shared/notes.md)", "outside the repository"),
        ("concepts.md", "[away](../examples/no-such-file.yaml)", "does not exist"),
        ("stray.md", "# A page the nav does not list", "stray.md"),
    ],
)
def test_strict_build_fails_on(copy: Path, page: str, line: str, complaint: str) -> None:
    target = copy / "docs" / page
    before = target.read_text(encoding="utf-8") if target.exists() else ""
    target.write_text(before + "\n" + line + "\n", encoding="utf-8")
    result = build(copy, copy / "site")
    output = result.stdout + result.stderr
    assert "No module named mkdocs" not in output, INSTALL
    assert result.returncode != 0, output
    assert complaint in output


def test_ci_builds_the_site_strict_and_not_quiet() -> None:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    builds = [line.split() for line in lines if "mkdocs build" in line]
    assert builds, ".ci/run does not build the site"
    for words in builds:
        assert "--strict" in words
        assert not {"-q", "--quiet", "-v", "--verbose"} & set(words), "strict would not count"
